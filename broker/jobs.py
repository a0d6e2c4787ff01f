"""The job model: what a caller asks for (`JobSpec`) and what the store keeps (`Job`).

A job moves through a small state machine. Every move out of ``handed_off`` is
fenced by the lease (``handoff_id``) that the main minted for that handoff, so a
report from an older attempt can never change a newer one::

    queued ──claim(lease)──▶ handed_off ──complete(lease)──▶ completed
      ▲                          │  ──fail(lease), retries left──▶ queued (run_at = backoff)
      │                          │  ──fail(lease), exhausted─────▶ failed
      │                          │  ──lost(lease), recoveries left▶ queued (run_at = now)
      │                          │  ──lost(lease), exhausted─────▶ failed
      └──return / reschedule─────┘  ──cancel──────────────────────▶ cancelled
    queued ──cancel──▶ cancelled

``completed``, ``failed`` and ``cancelled`` are terminal; only pruning removes them.
"""

from __future__ import annotations

import enum
import json
import math
import operator
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from datetime import UTC, datetime
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any, TypeAlias

from broker.exceptions import IdempotencyConflictError, InvalidJobError
from broker.model.bounds import (
    MAX_NAME_BYTES,
    MAX_PARENTS,
    MAX_RATE_KEY_BYTES,
    MAX_TRACE_CONTEXT_BYTES,
    MAX_TRACE_CONTEXT_ENTRIES,
)
from broker.model.values import check_name, check_run_at, storable_text

JSONValue: TypeAlias = Any
"""Anything :func:`json.dumps` accepts; the store round-trips it unchanged."""

DEFAULT_QUEUE = "default"
DEFAULT_MAX_RETRIES = 10
"""Ten retries after the first run, so eleven runs in all before a job is dead."""
DEFAULT_MAX_RECOVERIES = 3
"""Recovery attempts a job gets (after attempts lost with their worker, child or
connection) when neither the job nor the main sets another number: the fourth lost attempt
ends it dead, so a job that kills its machine stops instead of looping."""
MAX_UNIQUE_KEY_BYTES = MAX_NAME_BYTES
"""Longest ``unique_key`` (UTF-8): it is indexed, and a B-tree entry has a size limit."""


class JobStatus(enum.StrEnum):
    WAITING = "waiting"
    """Enqueued with parents (``depends_on``) that have not all completed yet: not due,
    never claimed; the settle that completes its last parent makes it ``queued`` (see
    :mod:`broker.dependencies`)."""
    QUEUED = "queued"
    HANDED_OFF = "handed_off"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES

    @property
    def is_active(self) -> bool:
        return not self.is_terminal


TERMINAL_STATUSES = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})
ACTIVE_STATUSES = frozenset({JobStatus.WAITING, JobStatus.QUEUED, JobStatus.HANDED_OFF})


class ExecutionMode(enum.StrEnum):
    """Where a worker runs the job.

    ``inline`` runs on the worker's own event loop (cheap, no isolation);
    ``pooled`` runs in a warm child process reused across jobs (the default);
    ``forked`` runs in a fresh process per job (full isolation, slowest).
    """

    INLINE = "inline"
    POOLED = "pooled"
    FORKED = "forked"


class ParentFailure(enum.StrEnum):
    """What a job's parent ending ``failed`` (dead) or ``cancelled`` does to the job."""

    CANCEL = "cancel"
    """The job is cancelled, its ``last_error`` naming the parent (the default)."""
    RUN = "run"
    """The parent counts as finished: the job runs once every parent has ended."""


class ParentResults(enum.StrEnum):
    """How a job with parents receives their results when it becomes due."""

    NONE = "none"
    """Not at all (a plain dependency)."""
    FIRST_ARG = "first_arg"
    """Its one parent's result comes first in its arguments (a chain's next step)."""
    LIST_ARG = "list_arg"
    """The list of its parents' results, in ``depends_on`` order, comes first (a fan-in)."""


def utcnow() -> datetime:
    return datetime.now(UTC)


Clock: TypeAlias = Callable[[], datetime]
"""Where a store reads the time; adapters take one so tests can move time by hand."""


def _require_run_at(value: datetime | None) -> None:
    if value is None:
        return
    if value.tzinfo is None:
        raise InvalidJobError(f"run_at must be timezone-aware (got naive {value.isoformat()})")
    try:
        check_run_at("run_at", value)
    except ValueError as exc:
        raise InvalidJobError(str(exc)) from None


def _require_names(**names: str | None) -> None:
    """Each name given is one :func:`~broker.model.values.check_name` accepts (at most
    :data:`~broker.model.bounds.MAX_NAME_BYTES`, no control characters)."""
    for name, value in names.items():
        if value is not None:
            try:
                check_name(name, value)
            except ValueError as exc:
                raise InvalidJobError(str(exc)) from None


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_FAST_ENCODE = (
    None
    if c_make_encoder is None
    else c_make_encoder(
        None, _ENCODER.default, encode_basestring_ascii, None, ":", ",", False, False, False
    )
)


def compact_json(value: JSONValue) -> str:
    """``value`` as compact, ASCII-escaped JSON, NaN and infinities refused: the form every
    store writes payloads in and payload limits measure, exactly as ``json.dumps(value,
    separators=(",", ":"), allow_nan=False)`` writes it.

    Each enqueued job is encoded a few times on its way in, and ``json.dumps`` builds its
    C encoder anew on every call, which cost more than the encoding of small arguments.
    This one is built once, without the check for circular values (its bookkeeping
    cannot be shared between calls); a circular value recurses until ``RecursionError``,
    and is then encoded once more by the checking encoder, to raise what it always did.
    """
    if _FAST_ENCODE is None:
        return _ENCODER.encode(value)
    try:
        return "".join(_FAST_ENCODE(value, 0))
    except RecursionError:
        return _ENCODER.encode(value)


_PLAIN = frozenset({str, int, bool, type(None)})
"""Types whose every value JSON holds as it is (a float may be NaN)."""
_STR = frozenset({str})


def _require_json(name: str, value: JSONValue) -> None:
    kind = type(value)
    items = value if kind is tuple or kind is list else value.values() if kind is dict else None
    if items is not None and _PLAIN.issuperset(map(type, items)):
        return  # the common case, without encoding it (nor a Python loop over the items)
    try:
        compact_json(value)
    except (TypeError, ValueError) as exc:
        raise InvalidJobError(f"{name} is not JSON-serialisable: {exc}") from exc
    except RecursionError:
        # The main refuses far shallower nesting anyway (its payload depth limit).
        raise InvalidJobError(f"{name} nest too deeply to be encoded as JSON") from None


def _own_arguments(
    args: Sequence[JSONValue], kwargs: Mapping[str, JSONValue]
) -> tuple[tuple[JSONValue, ...], dict[str, JSONValue]]:
    """A job's arguments as it keeps them (a tuple, and a dict of its own), once checked."""
    if type(args) not in (tuple, list) and (
        isinstance(args, str | bytes) or not isinstance(args, Sequence)
    ):
        raise InvalidJobError("args must be a list of JSON values")
    if (type(kwargs) is not dict and not isinstance(kwargs, Mapping)) or (
        kwargs
        and not _STR.issuperset(map(type, kwargs))
        and not all(isinstance(k, str) for k in kwargs)
    ):
        raise InvalidJobError("kwargs must be an object with string keys")
    owned = (args if type(args) is tuple else tuple(args)), dict(kwargs)
    _require_json("args", owned[0])
    _require_json("kwargs", owned[1])
    return owned


def _require_recovery_options(max_recoveries: object, local_state: object) -> None:
    if max_recoveries is not None and (
        not isinstance(max_recoveries, int)
        or isinstance(max_recoveries, bool)
        or not 0 <= max_recoveries < 2**31
    ):
        raise InvalidJobError("max_recoveries must be an integer of at least 0")
    if not isinstance(local_state, bool):
        raise InvalidJobError("local_state must be true or false")


_ID_BATCH = 256
"""Ids drawn from one ``os.urandom`` call."""
_ID_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_ID_SET = (4 << 76) | (0x8000 << 48)
"""The version (4) and variant (RFC 4122) bits, set as ``uuid.UUID(version=4)`` sets them."""
_spare_ids: list[int] = []
_new_uuid = object.__new__
_set_uuid_int = uuid.UUID.__dict__["int"].__set__
_set_uuid_safe = uuid.UUID.__dict__["is_safe"].__set__
_UNKNOWN_SAFETY = uuid.SafeUUID.unknown
"""Read once: an enum member read through its class costs a descriptor call each time."""
os.register_at_fork(after_in_child=_spare_ids.clear)


def _random_bits() -> int:
    """128 random bits with the version (4) and variant bits set, from the spare list
    (refilled ``_ID_BATCH`` at a time)."""
    try:
        return _spare_ids.pop()
    except IndexError:
        raw = os.urandom(16 * _ID_BATCH)
        fresh = [
            int.from_bytes(raw[i : i + 16]) & _ID_CLEAR | _ID_SET for i in range(0, len(raw), 16)
        ]
        value = fresh.pop()
        _spare_ids.extend(fresh)
        return value


def random_uuid() -> uuid.UUID:
    """A random UUID, version 4, as ``uuid.uuid4()`` makes one, in a third of the time: the
    id of every job and the lease of every handoff.

    ``uuid4`` was 17% of a bulk enqueue's client CPU: one system call per id, and
    ``UUID.__init__``'s checks of its arguments.
    Here the random bytes are read ``_ID_BATCH`` ids at a time and the UUID is filled in
    through its slots (the version and variant bits set as ``uuid4`` sets them). A taken
    value leaves the list in one ``pop`` (atomic under the GIL), so two threads never get
    the same one; a forked child drops the values it inherited, so it never repeats its
    parent's ids.
    """
    value = _random_bits()
    job_id = _new_uuid(uuid.UUID)
    _set_uuid_int(job_id, value)
    _set_uuid_safe(job_id, _UNKNOWN_SAFETY)
    return job_id


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A request to run ``task`` once, as a caller enqueues it.

    Validation happens here, at construction, so an invalid request fails in the
    caller's process with a clear message and nothing half-written reaches a store.
    """

    task: str
    args: Sequence[JSONValue] = ()
    kwargs: Mapping[str, JSONValue] = field(default_factory=dict)
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    run_at: datetime | None = None
    max_attempts: int = DEFAULT_MAX_RETRIES + 1
    idempotency_key: str | None = None
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    timeout: float | None = None
    execution_mode: ExecutionMode = ExecutionMode.POOLED
    id: uuid.UUID = field(default_factory=random_uuid)
    unique_key: str | None = None
    """At most one *active* (queued or handed-off) job holds a unique key at a time."""
    max_recoveries: int | None = None
    """How many times the job runs again after an attempt was lost (its worker, child or
    connection died, or the main took its lease back); ``None``: the main's default.
    Counted apart from ``max_attempts``, which only failures the task raised use up."""
    local_state: bool = False
    """The job keeps state on its worker's machine (files, a warm cache) that a recovery
    should find: a lost attempt's recovery waits for the same worker id first (see
    ``docs/howto/long-jobs.md``)."""
    depends_on: tuple[uuid.UUID, ...] = ()
    """Jobs that must end before this one is due (it waits as ``waiting``); each must be
    stored already (no cycle can form), at most :data:`MAX_PARENTS`, none twice."""
    on_parent_failure: ParentFailure = ParentFailure.CANCEL
    parent_results: ParentResults = ParentResults.NONE
    workflow_id: uuid.UUID | None = None
    """The workflow (a chain, group or fan-in) the job belongs to, if any."""
    trace_context: Mapping[str, str] | None = None
    """The W3C trace context (``traceparent``, ``tracestate``) of the span that enqueued
    the job, so that its run is a child of it; the client fills it in from the active
    span when OpenTelemetry is installed (see ``docs/howto/tracing.md``)."""
    rate_key: str | None = None
    """Which bucket of its task's per-key rate limit the job spends
    (``@task(rate_limit=..., rate_key="{tenant}")``): the task's template filled from the
    job's arguments once, at enqueue, so that dispatch never reads the arguments; at most
    :data:`~broker.model.bounds.MAX_RATE_KEY_BYTES`."""

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task.strip():
            raise InvalidJobError("task must be a non-empty string naming a registered task")
        if not isinstance(self.queue, str) or not self.queue.strip():
            raise InvalidJobError("queue must be a non-empty string")
        _require_names(
            task=self.task,
            queue=self.queue,
            unique_key=self.unique_key,
            idempotency_key=self.idempotency_key,
            concurrency_key=self.concurrency_key,
            rate_key=self.rate_key,
        )
        _require_rate_key(self.rate_key)
        args, kwargs = _own_arguments(self.args, self.kwargs)
        if args is not self.args:
            object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", kwargs)
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidJobError("priority must be an integer (higher runs first)")
        if not -(2**31) <= self.priority < 2**31:
            raise InvalidJobError("priority must fit in 32 bits")
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise InvalidJobError("max_attempts must be an integer of at least 1")
        _require_run_at(self.run_at)
        if self.unique_key is not None and (
            not isinstance(self.unique_key, str)
            or not self.unique_key
            or len(self.unique_key.encode("utf-8", "surrogatepass")) > MAX_UNIQUE_KEY_BYTES
        ):
            raise InvalidJobError(
                f"unique_key must be a non-empty string of at most {MAX_UNIQUE_KEY_BYTES} bytes"
            )
        if (self.concurrency_key is None) != (self.concurrency_limit is None):
            raise InvalidJobError("concurrency_key and concurrency_limit go together")
        if self.concurrency_limit is not None and (
            not isinstance(self.concurrency_limit, int) or self.concurrency_limit < 1
        ):
            raise InvalidJobError("concurrency_limit must be a positive integer")
        if self.timeout is not None and (
            not isinstance(self.timeout, int | float)
            or not math.isfinite(self.timeout)
            or self.timeout <= 0
        ):
            raise InvalidJobError("timeout must be a positive number of seconds")
        try:
            if type(self.execution_mode) is not ExecutionMode:
                object.__setattr__(self, "execution_mode", ExecutionMode(self.execution_mode))
        except ValueError:
            modes = ", ".join(m.value for m in ExecutionMode)
            raise InvalidJobError(
                f"execution_mode must be one of {modes} (got {self.execution_mode!r})"
            ) from None
        if not isinstance(self.id, uuid.UUID):
            raise InvalidJobError("id must be a UUID")
        _require_recovery_options(self.max_recoveries, self.local_state)
        _require_dependencies(self)
        object.__setattr__(self, "trace_context", _trace_context(self.trace_context))

    def with_arguments(self, args: Sequence[JSONValue], kwargs: Mapping[str, JSONValue]) -> JobSpec:
        """This spec's task and options with ``args`` and ``kwargs`` (checked as a spec
        checks its own) and a fresh id, the options not checked again: they were, when
        this spec was made. A caller that enqueues one task with the same options call
        after call (``broker.client.transactional.job_spec``) checks them once: a whole
        spec each call, the broker's Python of a one-at-a-time direct enqueue was about
        53 µs of CPU a job with the caches cold (as they are after each wait for the
        server), this way about 45."""
        values = list(spec_fields(self))
        values[_ARGS_AT], values[_KWARGS_AT] = _own_arguments(args, kwargs)
        values[_ID_AT] = random_uuid()
        spec: JobSpec = _new_spec(JobSpec)
        for fill, value in zip(_SPEC_SLOTS, values, strict=True):
            fill(spec, value)
        return spec


def _require_rate_key(key: str | None) -> None:
    """A rate key (checked as a name already) is within
    :data:`~broker.model.bounds.MAX_RATE_KEY_BYTES`."""
    if key is not None and len(key.encode("utf-8", "surrogatepass")) > MAX_RATE_KEY_BYTES:
        raise InvalidJobError(
            f"rate_key must be at most {MAX_RATE_KEY_BYTES} bytes (a tenant id, an "
            "account: a name, not a payload)"
        )


def _require_dependencies(spec: JobSpec) -> None:
    """The dependency fields of ``spec`` are well formed (checked only when it has some)."""
    if spec.depends_on == () and spec.workflow_id is None:
        return
    parents = spec.depends_on
    if isinstance(parents, str | bytes) or not isinstance(parents, Sequence | frozenset | set):
        raise InvalidJobError("depends_on must be a list of job ids")
    try:
        parents = tuple(p if isinstance(p, uuid.UUID) else uuid.UUID(str(p)) for p in parents)
    except ValueError:
        raise InvalidJobError("depends_on must be a list of job ids") from None
    object.__setattr__(spec, "depends_on", parents)
    if len(parents) > MAX_PARENTS:
        raise InvalidJobError(f"depends_on names at most {MAX_PARENTS} jobs (got {len(parents)})")
    if len(set(parents)) != len(parents):
        raise InvalidJobError("depends_on names a job twice")
    if spec.id in parents:
        raise InvalidJobError("a job cannot depend on itself")
    if parents and spec.unique_key is not None:
        # A waiting job would take its key only when due, inside a parent's settle.
        raise InvalidJobError("a job with depends_on cannot have a unique_key")
    for name, kind in (("on_parent_failure", ParentFailure), ("parent_results", ParentResults)):
        try:
            object.__setattr__(spec, name, kind(getattr(spec, name)))
        except ValueError:
            choices = ", ".join(m.value for m in kind)
            raise InvalidJobError(f"{name} must be one of {choices}") from None
    if spec.parent_results is ParentResults.FIRST_ARG and len(parents) != 1:
        raise InvalidJobError("parent_results first_arg needs exactly one parent")
    if spec.workflow_id is not None and not isinstance(spec.workflow_id, uuid.UUID):
        raise InvalidJobError("workflow_id must be a UUID")


DEPENDENCY_FIELDS = ("depends_on", "on_parent_failure", "parent_results", "workflow_id")
"""The :class:`JobSpec` fields a store keeps beside the job (its dependency edges and
workflow), not as :class:`Job` fields."""


def _trace_context(value: object) -> dict[str, str] | None:
    """``value`` as a job's own trace context, checked against its bound; an empty one is
    none (``None``). The entries are counted first and each text is held to a name's
    bound before any is measured, so an oversized one costs no more than its refusal.
    Raises :class:`InvalidJobError`."""
    if value is None:
        return None
    too_big = InvalidJobError(
        f"trace_context must map at most {MAX_TRACE_CONTEXT_ENTRIES} text keys to text "
        f"values, of {MAX_TRACE_CONTEXT_BYTES} bytes in all"
    )
    if not isinstance(value, Mapping) or len(value) > MAX_TRACE_CONTEXT_ENTRIES:
        raise too_big
    for text in (*value.keys(), *value.values()):
        try:
            check_name("trace_context", text)
        except ValueError as exc:
            raise InvalidJobError(str(exc)) from None
    if sum(len(t.encode("utf-8", "surrogatepass")) for kv in value.items() for t in kv) > (
        MAX_TRACE_CONTEXT_BYTES
    ):
        raise too_big
    return dict(value) or None


SPEC_FIELDS = tuple(f.name for f in fields(JobSpec))
"""The names of :class:`JobSpec`'s fields, in order."""
spec_fields = operator.attrgetter(*SPEC_FIELDS)
"""A spec's field values as a tuple, in :data:`SPEC_FIELDS` order (one C call)."""
_SPEC_SLOTS = tuple(JobSpec.__dict__[name].__set__ for name in SPEC_FIELDS)
"""Each :class:`JobSpec` field's slot setter, in :data:`SPEC_FIELDS` order."""
_ARGS_AT, _KWARGS_AT, _ID_AT = map(SPEC_FIELDS.index, ("args", "kwargs", "id"))
_new_spec = object.__new__
SPEC_DEFAULTS = tuple(
    f.default if f.default_factory is MISSING else MISSING for f in fields(JobSpec)
)
"""Each :class:`JobSpec` field's default, in :data:`SPEC_FIELDS` order, to build one
positionally: ``MISSING`` for a field made by its factory (its ``__init__`` calls the
factory when given ``MISSING``, see :func:`_slot_init`) and for ``task``, which has none."""


def _slot_init(cls: Any) -> None:
    """Give the frozen, slotted dataclass ``cls`` an ``__init__`` (same parameters,
    defaults and default factories, then its ``__post_init__`` if it has one) that fills
    each slot through its descriptor.

    The generated one calls ``object.__setattr__(self, name, value)`` per field, which looks
    the slot up by name each time: for :class:`Job`'s 31 fields that was half the cost of
    building one, and the main builds one for every row it selects or claims; for a
    :class:`JobSpec`, built by the client and again by the main for every job enqueued,
    it was a fifth.
    """
    params: list[str] = []
    names: dict[str, Any] = {"_MISSING": MISSING}
    body: list[str] = []
    for f in fields(cls):
        names[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        value = f.name
        if f.default_factory is not MISSING:
            # The dataclass convention: a sentinel default, the factory called when omitted.
            names[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            value = f"_factory_{f.name}() if {f.name} is _MISSING else {f.name}"
        elif f.default is MISSING:
            params.append(f.name)
        else:
            names[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        body.append(f"\n    _set_{f.name}(self, {value})")
    if "__post_init__" in cls.__dict__:
        body.append("\n    self.__post_init__()")
    exec(f"def __init__(self, {', '.join(params)}):{''.join(body)}", names)
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init


@dataclass(frozen=True, slots=True)
class Job:
    """A job as the store holds it. Immutable: every change comes back as a new value."""

    id: uuid.UUID
    task: str
    args: tuple[JSONValue, ...]
    kwargs: dict[str, JSONValue]
    queue: str
    priority: int
    status: JobStatus
    attempts: int
    max_attempts: int
    run_at: datetime
    created_at: datetime
    updated_at: datetime
    execution_mode: ExecutionMode = ExecutionMode.POOLED
    handoff_id: uuid.UUID | None = None
    worker_id: str | None = None
    handed_off_at: datetime | None = None
    last_error: str | None = None
    result: JSONValue = None
    idempotency_key: str | None = None
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    timeout: float | None = None
    unique_key: str | None = None
    checkpoint: JSONValue = None
    """The last checkpoint a run of this job saved (see :mod:`broker.tasks.context`); it
    outlives the run, so the next attempt starts from it, and stays once the job ends."""
    checkpoint_seq: int = 0
    """How many checkpoints were saved over all the job's runs: 0 means none, and the
    next attempt is a fresh start rather than a continuation. The store only takes a
    checkpoint numbered above it, so a late copy never overwrites a newer one."""
    checkpoint_at: datetime | None = None
    progress: float | None = None
    """The last progress (0 to 1) a run reported; not acknowledged, so a crash may lose
    the latest value (see ``docs/howto/long-jobs.md``)."""
    progress_message: str | None = None
    max_recoveries: int | None = None
    local_state: bool = False
    recoveries: int = 0
    """Attempts lost with their worker, child or connection (not failures the task raised)."""
    state_holder: str | None = None
    """While a ``local_state`` job waits for the recovery of a lost attempt: the worker id
    that ran that attempt, so holds its local state. Cleared by the next claim."""
    trace_context: dict[str, str] | None = None
    """The W3C trace context of the span that enqueued the job (see :class:`JobSpec`)."""
    rate_key: str | None = None
    """The bucket of its task's per-key rate limit it spends (see :class:`JobSpec`)."""

    @classmethod
    def from_spec(cls, spec: JobSpec, now: datetime) -> Job:
        """The row a store writes for ``spec`` when it is enqueued at ``now``."""
        return cls(**new_job_fields(spec, now))

    @property
    def retries_left(self) -> int:
        return max(0, self.max_attempts - self.attempts - 1)

    def to_dict(self) -> dict[str, JSONValue]:
        """The one JSON-ready view of a job that leaves the main: request replies
        (``job_info``, ``job_list``) and the operator CLI, through the main or the store.

        It leaves out the lease (``handoff_id``): a lease belongs to the connection it was
        handed to, and no client needs it. ``worker_id`` stays, for operators.
        """
        return {
            f.name: json_field(getattr(self, f.name))
            for f in fields(self)
            if f.name != "handoff_id"
        }


_slot_init(Job)
_slot_init(JobSpec)

JOB_DEFAULTS = {f.name: f.default for f in fields(Job) if f.default is not MISSING}
"""The :class:`Job` fields that have a default, by name, with it."""


DispatchKey = tuple[int, datetime, datetime]
DISPATCH_KEY_FIELDS = ("priority", "run_at", "created_at")
"""The job fields :func:`dispatch_key` takes, in its order."""


def dispatch_key(priority: int, run_at: datetime, created_at: datetime) -> DispatchKey:
    """Where a job stands in the dispatch order, which sorts ascending: higher priority
    first, then the earlier run time, then the earlier creation (a store breaks the ties
    left by insert order)."""
    return (-priority, run_at, created_at)


def _first_status(spec: JobSpec) -> JobStatus:
    """A new job's status: waiting on its parents if it has any, else queued."""
    return JobStatus.WAITING if spec.depends_on else JobStatus.QUEUED


def new_job_values(spec: JobSpec, now: datetime) -> list[Any]:
    """The fields of the :class:`Job` a store writes for ``spec`` enqueued at ``now``, in
    :data:`NEW_JOB_FIELDS` order (every other field at its default, :data:`JOB_DEFAULTS`):
    the one definition of a new job, which :func:`new_job_fields` names and a one-job
    insert encodes straight into its statement's values
    (:func:`adapters.sql.rows.new_values`). The spec's fields a job keeps are read in one
    C call (its ``args`` a tuple already); ``kwargs`` is the spec's own dict."""
    values = [*_job_spec_values(spec), _first_status(spec), 0, now, now]
    if spec.run_at is None:
        values[_RUN_AT] = now
    return values


def new_job_fields(spec: JobSpec, now: datetime) -> dict[str, Any]:
    """:func:`new_job_values` by name (``kwargs`` a copy, the job's own): what
    :meth:`Job.from_spec` builds, for a store that writes the row without building the
    value (see :meth:`EnqueueResult.inserted`)."""
    values = dict(zip(NEW_JOB_FIELDS, new_job_values(spec, now), strict=True))
    values["kwargs"] = dict(spec.kwargs)
    return values


def new_jobs_columns(specs: Sequence[JobSpec], now: datetime) -> dict[str, list[Any]]:
    """:func:`new_job_fields` of each of ``specs`` (at least one), by field: each field's
    values over the jobs, in order (``kwargs`` the spec's own dict, which a store only
    encodes). A store that writes a batch column by column (PostgreSQL's bulk enqueue,
    ``unnest`` of the columns) builds no dict per job: the dicts and their rows were
    most of a bulk enqueue's CPU per job in the caller. The same fields, set the same
    way (a unit test holds the two to each other)."""
    by_field = zip(*map(_job_spec_values, specs), strict=True)
    columns = dict(zip(_JOB_SPEC_FIELDS, map(list, by_field), strict=True))
    columns["run_at"] = [now if run_at is None else run_at for run_at in columns["run_at"]]
    return _with_new_state(columns, list(map(_first_status, specs)), now)


def _with_new_state(
    columns: dict[str, list[Any]], statuses: list[JobStatus], now: datetime
) -> dict[str, list[Any]]:
    """``columns`` (a new job's spec fields, by field) with what every new job starts
    with: its first status, no attempt yet, made and changed at ``now``."""
    count = len(statuses)
    columns["status"] = statuses
    columns["attempts"] = [0] * count
    columns["created_at"] = columns["updated_at"] = [now] * count
    return columns


@dataclass(frozen=True, slots=True)
class SpecColumns:
    """Jobs that differ only in their arguments (and ids): one checked ``template`` for
    the task and every option, and each job's ``args``, ``kwargs`` and ``id``, by column.

    A bulk enqueue of one task with many argument sets (what PgQueuer's list-taking
    ``enqueue`` does) builds no :class:`JobSpec` per job this way: a spec's checks and
    its construction were half of a direct bulk enqueue's CPU per job in the caller.
    Each job's arguments are checked as a spec checks them; the options once. No key
    names one job (an idempotency or unique key), and no job has parents: each job is a
    new, independent one, stored as its own row. :meth:`specs` are the same jobs one
    by one, for a store that writes them the careful way; a unit test holds
    :meth:`fields` to :func:`new_jobs_columns` of those."""

    template: JobSpec
    args: list[tuple[JSONValue, ...]]
    kwargs: list[dict[str, JSONValue]]
    ids: list[uuid.UUID]

    @classmethod
    def of(
        cls,
        template: JobSpec,
        args: Sequence[Sequence[JSONValue]],
        kwargs: Sequence[Mapping[str, JSONValue]] | None = None,
    ) -> SpecColumns:
        """The jobs of ``template`` with each of ``args`` (and the ``kwargs`` at the same
        place, if given: as many), each with a fresh id.

        :raises InvalidJobError: an argument set is not JSON, ``kwargs`` is not as long as
            ``args``, or ``template`` has a key that names one job or has parents.
        """
        cls.check_template(template)
        if kwargs is None:
            # No keywords: one empty dict for all (the column is encoded once).
            owned = [_own_arguments(a, _NO_KWARGS)[0] for a in args]
            return cls(template, owned, [{}] * len(owned), [random_uuid() for _ in owned])
        pairs = list(map(_own_arguments, args, keyword_sets(len(args), kwargs)))
        return cls(
            template,
            [a for a, _ in pairs],
            [k for _, k in pairs],
            [random_uuid() for _ in pairs],
        )

    @staticmethod
    def check_template(template: JobSpec) -> None:
        """:raises InvalidJobError: ``template`` has a key that names one job, or parents:
        it cannot be the options of many jobs (:meth:`of`'s rule, which a bulk request
        whose jobs go one spec each keeps too)."""
        if template.idempotency_key is not None or template.unique_key is not None:
            raise InvalidJobError(
                "an idempotency_key or unique_key names one job: give it to each job of "
                "enqueue_many_in_async instead of once for a list of argument sets"
            )
        if template.depends_on or template.workflow_id is not None:
            raise InvalidJobError("jobs with depends_on or a workflow are enqueued one by one")

    def __len__(self) -> int:
        return len(self.ids)

    def chunk(self, start: int, stop: int) -> SpecColumns:
        """The jobs from ``start`` to ``stop``."""
        return SpecColumns(
            self.template, self.args[start:stop], self.kwargs[start:stop], self.ids[start:stop]
        )

    def specs(self) -> list[JobSpec]:
        """The same jobs, one :class:`JobSpec` each."""
        return [
            replace(self.template, args=args, kwargs=kwargs, id=job_id)
            for args, kwargs, job_id in zip(self.args, self.kwargs, self.ids, strict=True)
        ]

    def fields(self, now: datetime) -> dict[str, list[Any]]:
        """:func:`new_jobs_columns` of :meth:`specs` enqueued at ``now``: a field of the
        template is one object repeated (which a store encodes once)."""
        count = len(self.ids)
        columns = {
            name: [value] * count
            for name, value in zip(_JOB_SPEC_FIELDS, _job_spec_values(self.template), strict=True)
        }
        columns["args"] = self.args
        columns["kwargs"] = self.kwargs
        columns["id"] = self.ids
        columns["run_at"] = [self.template.run_at or now] * count
        return _with_new_state(columns, [_first_status(self.template)] * count, now)


_NO_KWARGS: Mapping[str, JSONValue] = {}


def keyword_sets(
    count: int, kwargs: Sequence[Mapping[str, JSONValue]] | None
) -> Sequence[Mapping[str, JSONValue]]:
    """The keyword arguments of each of ``count`` jobs given argument sets: ``kwargs``,
    if it has one per job, or none for each.

    :raises InvalidJobError: ``kwargs`` is not as long as the argument sets."""
    if kwargs is None:
        return [_NO_KWARGS] * count
    if len(kwargs) != count:
        raise InvalidJobError(f"{len(kwargs)} keyword argument sets for {count} argument sets")
    return kwargs


_JOB_SPEC_FIELDS = tuple(name for name in SPEC_FIELDS if name not in DEPENDENCY_FIELDS)
"""The :class:`JobSpec` fields a :class:`Job` keeps."""
_job_spec_values = operator.attrgetter(*_JOB_SPEC_FIELDS)
NEW_JOB_FIELDS = (*_JOB_SPEC_FIELDS, "status", "attempts", "created_at", "updated_at")
"""The :class:`Job` fields a new job sets (:func:`new_job_values`), in its order: the
spec's, then what every new job starts with."""
_RUN_AT = NEW_JOB_FIELDS.index("run_at")
_AS_SPECIFIED = frozenset(_JOB_SPEC_FIELDS) - {"run_at", "kwargs"}
"""The fields a new job holds exactly as its spec does (:func:`new_job_fields`: its
``run_at`` may be the enqueue's time, its ``kwargs`` a copy)."""


IDEMPOTENCY_FIELDS = (
    "task",
    "args",
    "kwargs",
    "queue",
    "priority",
    "max_attempts",
    "timeout",
    "execution_mode",
    "concurrency_key",
    "concurrency_limit",
    "unique_key",
)
"""What a repeat of an enqueue must match to be the same request as the job holding its
idempotency key. Left out: ``run_at`` (a client repeating a ``delay`` after a timeout
resolves it again, later), ``id`` (each call may mint a fresh one) and the key itself."""


def check_idempotent_repeat(spec: JobSpec, existing: JobSpec | Job) -> None:
    """Refuse ``spec`` when it takes the idempotency key of ``existing`` (a stored job, or
    an earlier spec of the same batch) but asks for something else: returning the old
    job as if it were this one would silently drop the caller's request.

    Values are compared as JSON holds them (``(1, 2)`` and ``[1, 2]`` are one list, keys
    in any order), since that is all a store keeps.

    :raises IdempotencyConflictError: naming the fields that differ and the job's id.
    """
    if spec.idempotency_key is None or existing.idempotency_key != spec.idempotency_key:
        return
    differ = [
        name
        for name in IDEMPOTENCY_FIELDS
        if _as_stored(getattr(spec, name)) != _as_stored(getattr(existing, name))
    ]
    if differ:
        raise IdempotencyConflictError(
            f"idempotency key {spec.idempotency_key!r} is held by job {existing.id} with a "
            f"different {', '.join(differ)}; a repeat must ask for the same job (use "
            "another key for another job)",
            existing_id=existing.id,
        )


def _as_stored(value: Any) -> Any:
    if isinstance(value, tuple | list | dict):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def spec_from(source: object, **differ: Any) -> JobSpec:
    """A :class:`JobSpec` from the same-named attributes of ``source`` (a schedule's job
    options, say) and ``differ``; a spec field that ``source`` lacks keeps its default."""
    values = {f.name: getattr(source, f.name) for f in fields(JobSpec) if hasattr(source, f.name)}
    return JobSpec(**{**values, **differ})


def json_field(value: Any) -> Any:
    """A job field's value as JSON holds it: ids and times as text, modes and statuses by
    value. Payloads (args, kwargs, result) are JSON already and pass as they are."""
    match value:
        case uuid.UUID():
            return str(value)
        case datetime():
            return value.isoformat()
        case enum.Enum():
            return value.value
        case tuple():
            return list(value)
    return value


PAYLOAD_FIELDS = frozenset({"args", "kwargs", "result", "checkpoint"})
"""The fields of :meth:`Job.to_dict` a summary listing leaves out: each may be megabytes."""


def summary_dict(job: Job) -> dict[str, JSONValue]:
    """:meth:`Job.to_dict` without :data:`PAYLOAD_FIELDS`: how a summary listing shows a job
    (the keys are left out rather than emptied, so no one mistakes them for empty args)."""
    return {key: value for key, value in job.to_dict().items() if key not in PAYLOAD_FIELDS}


@dataclass(frozen=True, slots=True)
class Claim:
    """One handoff the main wants to make: the lease is minted before the store sees it."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    worker_id: str


class Outcome(enum.StrEnum):
    """How a handoff ends; every one is fenced by the handoff's lease."""

    COMPLETE = "complete"
    FAIL = "fail"
    RESCHEDULE = "reschedule"
    RETURN = "return"
    LOST = "lost"
    """The attempt was lost (its worker, child or connection died, or the main took its
    lease back): a recovery is counted, and the job runs again at once or, past its
    recovery limit, is dead."""


@dataclass(frozen=True, slots=True)
class Settlement:
    """One fenced move out of ``handed_off``, for batching many into one commit.

    ``run_at`` is the retry time for ``FAIL`` and ``LOST`` (``None``: the job is dead) and
    the new start for ``RESCHEDULE``; ``RETURN`` makes the job due at once. ``state_holder``
    is, for ``LOST``, the worker id whose local state the recovery should wait for.
    """

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    outcome: Outcome
    result: JSONValue = None
    error: str | None = None
    run_at: datetime | None = None
    state_holder: str | None = None

    def __post_init__(self) -> None:
        # Every error text reaches a store through here, whoever reported it, so a NUL
        # or a lone surrogate in a task's exception message can never fail the write.
        if self.error is not None:
            object.__setattr__(self, "error", storable_text(self.error))


@dataclass(frozen=True, slots=True)
class CheckpointSave:
    """A checkpoint a run saves under its lease: fenced like a :class:`Settlement`, and
    taken only if ``seq`` is above the job's stored ``checkpoint_seq``."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    seq: int
    state: JSONValue


MAX_PROGRESS_CHARS = 200
"""Longest progress message kept: it is a status line, not a log."""


@dataclass(frozen=True, slots=True)
class ProgressUpdate:
    """A run's latest progress under its lease (fenced, never acknowledged)."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    fraction: float
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", storable_text(self.message, MAX_PROGRESS_CHARS))


class EnqueueResult:
    """What an enqueue did with one job: ``job``, the job as stored, and ``duplicate``:
    true when an existing job was returned instead (the one holding the same idempotency
    key, or the active one holding the same unique key).

    A store that wrote the job from its field values (:meth:`inserted`) builds the
    :class:`Job` when ``job`` is first read. A bulk enqueue through the main reads only
    each job's id, and building a 31-field value per job cost the main about 2 us of
    its 17 per job.
    """

    __slots__ = ("_fields", "_job", "_spec", "duplicate")

    def __init__(self, job: Job, duplicate: bool) -> None:
        self._job: Job | None = job
        self._fields: dict[str, Any] | None = None
        self._spec: tuple[JobSpec, datetime] | None = None
        self.duplicate = duplicate

    @classmethod
    def inserted(cls, job_fields: dict[str, Any]) -> EnqueueResult:
        """A job just written, as its fields by name (:func:`new_job_fields`, after any
        move the store applied to them); the dict becomes this result's own."""
        result = cls.__new__(cls)
        result._job = None
        result._fields = job_fields
        result._spec = None
        result.duplicate = False
        return result

    @classmethod
    def inserted_new(cls, spec: JobSpec, now: datetime) -> EnqueueResult:
        """``spec``'s job just written as :func:`new_job_fields` makes it at ``now``
        (nothing moved), its fields made only when read: a bulk enqueue written column
        by column (:func:`new_jobs_columns`) built no dict per job, and its caller reads
        only each job's id."""
        result = cls.__new__(cls)
        result._job = None
        result._fields = None
        result._spec = (spec, now)
        result.duplicate = False
        return result

    def _own_fields(self) -> dict[str, Any] | None:
        """The job's fields by name, made now if they wait on the spec; ``None`` once the
        job is built."""
        if self._spec is not None:
            self._fields = new_job_fields(*self._spec)
            self._spec = None
        return self._fields

    @property
    def job(self) -> Job:
        if self._job is None:
            job_fields = self._own_fields()
            assert job_fields is not None
            self._job = Job(**job_fields)
            self._fields = None
        return self._job

    def field(self, name: str) -> Any:
        """The field ``name`` of ``job``, without building the job (nor, for a field
        its spec holds as the job keeps it, the job's fields: the main's dispatcher reads
        each new job's mode)."""
        if self._spec is not None and name in _AS_SPECIFIED:
            return getattr(self._spec[0], name)
        job_fields = self._own_fields()
        if job_fields is None:
            return getattr(self.job, name)
        return job_fields.get(name, JOB_DEFAULTS.get(name))

    @property
    def job_id(self) -> uuid.UUID:
        """``job.id``, without building the job."""
        if self._spec is not None:
            return self._spec[0].id
        job_fields = self._fields
        return self.job.id if job_fields is None else job_fields["id"]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EnqueueResult):
            return NotImplemented
        return (self.job, self.duplicate) == (other.job, other.duplicate)

    __hash__ = None  # type: ignore[assignment]  # its job holds a dict

    def __repr__(self) -> str:
        return f"EnqueueResult(job={self.job!r}, duplicate={self.duplicate!r})"
