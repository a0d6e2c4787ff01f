"""The messages the main, its workers and its clients exchange, with no I/O.

Every message is a frozen :class:`msgspec.Struct` tagged by a ``type`` string;
:func:`encode` turns one into a single NDJSON line and :func:`decode` turns a line back
into a message or raises :class:`DecodeError` naming the offending field. Keeping this
free of sockets (as hypercorn keeps its HTTP state machines) lets the main, the
worker and the tests agree on the wire format without a network in sight.
``docs/protocol.md`` is the specification; this module is its executable form.

Decoding is strict about types because the main is the only writer to the job
store: a ``true`` where a count belongs, or a lease id that is not a UUID, must be
turned away at the edge rather than discovered in the store. It is lenient about
*extra* fields, so a newer peer can add one without breaking an older one.

Two decoders share the one set of message classes. msgspec decodes and checks a line
in one C call (a job or a report in a microsecond or two, where walking the JSON in
Python cost about 70 µs); its constraints (``Int``, ``Float``, ``Name``) are set
stricter than or equal to the rules, never looser. Only a line msgspec refuses goes to
the hand-written walker (:func:`_explain`), which applies the rules exactly as
specified and either accepts the line (a value msgspec is stricter about, such as a
lone surrogate escape or a non-canonical UUID) or refuses it with a message naming
the field (``hello.modes[1] must be one of ...``), which peers log and tests match.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import math
import operator
import re
import secrets
import string
import types
import typing
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Annotated, Any, ClassVar, TypeAlias, TypeVar

import msgspec

from broker.exceptions import InvalidJobError, ProtocolError
from broker.jobs import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_QUEUE,
    SPEC_FIELDS,
    TERMINAL_STATUSES,
    ExecutionMode,
    JobSpec,
    JobStatus,
    JSONValue,
    spec_fields,
    spec_values,
)
from broker.model.bounds import (
    MAX_AGE_SECONDS,
    MAX_LIST_ITEMS,
    MAX_NAME_BYTES,
    MAX_WORKER_STATUS_BYTES,
    MESSAGE_CONTAINERS,
)
from broker.model.untrusted import CONTROL_CHARACTERS
from broker.model.values import check_delay, check_name
from broker.payload import DEFAULT_MAX_PAYLOAD_DEPTH, containers_in, too_many_containers

PROTOCOL_VERSION = 3
"""Bumped on any change an older peer would misread; extra fields do not need it.
Version 3 added the batch messages (``jobs``, ``reports``, ``report_acks``) and
``hello.protocols``."""

SUPPORTED_PROTOCOLS: tuple[int, ...] = (PROTOCOL_VERSION,)
"""The versions this release speaks; ``hello`` lists them and the main picks one."""

DEFAULT_PORT = 7390
"""The TCP port a main listens on and peers dial unless told otherwise. It lives with the
protocol, not the main, so a client can know it without importing the main."""


class Role(enum.StrEnum):
    """What a peer says hello as; each role proves its own secret
    (:mod:`broker.wire.credentials`)."""

    WORKER = "worker"
    CLIENT = "client"
    OPERATOR = "operator"
    """A client that may also cancel, retry and prune (the operator's command)."""


class AckStatus(enum.StrEnum):
    """How the main disposed of a worker's report, so the worker knows it may forget it."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    STALE = "stale"
    REFUSED = "refused"
    """The main can never store this report (nor the failure it tried in its place); the
    job's lease goes back to the queue and the worker forgets the report."""


class ErrorCode(enum.StrEnum):
    """Codes for ``error`` and ``request_error`` messages; a peer may receive codes it does
    not know (from a newer version) and must treat them like ``internal``."""

    MALFORMED = "malformed"
    UNKNOWN_TYPE = "unknown_type"
    LINE_TOO_LONG = "line_too_long"
    UNTERMINATED = "unterminated"
    AUTH_FAILED = "auth_failed"
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    PROTOCOL_VERSION = "protocol_version"
    NOT_ALLOWED = "not_allowed"
    INTERNAL = "internal"
    INVALID_JOB = "invalid_job"
    NOT_FOUND = "not_found"
    STORAGE = "storage"
    OVER_LIMIT = "over_limit"
    CONFIGURATION = "configuration"
    MISSING_DRIVER = "missing_driver"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNIQUE_KEY_TAKEN = "unique_key_taken"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    UNKNOWN_TASK = "unknown_task"
    SCHEMA_VERSION = "schema_version"
    STORAGE_REJECTED = "storage_rejected"
    TASK_NOT_FOUND = "task_not_found"
    JOB_TIMEOUT = "job_timeout"
    RUNNER_CRASHED = "runner_crashed"
    PERMISSION_DENIED = "permission_denied"
    CHECKPOINT_REJECTED = "checkpoint_rejected"
    NOT_LEADER = "not_leader"
    DEPOSED = "deposed"


class DecodeError(ProtocolError):
    """The peer sent a line that is not a valid broker message."""

    code: str = ErrorCode.MALFORMED

    def __init__(
        self, message: str, *, msg_type: str | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.msg_type = msg_type
        """The message's ``type`` when it could be read, so the reply can be specific."""
        self.request_id = request_id
        """The request's id when it could be read, so the main can answer with
        ``request_error`` and keep a client's connection instead of dropping it."""


class UnknownTypeError(DecodeError):
    """The peer sent a message type this version does not know."""

    code = ErrorCode.UNKNOWN_TYPE


class OverBoundError(DecodeError):
    """A line over a bound that is checked before (or instead of) keeping its message:
    too many lists and objects (``payload_too_large``), or a ``worker_status`` too long
    (``over_limit``). Never fatal: the line was read whole, so the stream is intact.

    ``instead`` is a message the main handles in the line's place (a worker's oversized
    ``completed`` becomes a failure of that job, so the job ends cleanly and the worker's
    report is answered), ``reply`` one it answers with (a ``checkpoint`` refused)."""

    def __init__(
        self,
        message: str,
        *,
        code: str,
        msg_type: str | None = None,
        request_id: str | None = None,
        instead: Message | None = None,
        reply: Message | None = None,
    ) -> None:
        super().__init__(message, msg_type=msg_type, request_id=request_id)
        self.code = code
        self.instead = instead
        self.reply = reply


_NAME_PATTERN = f"\\A[^{CONTROL_CHARACTERS}]*\\Z"
"""msgspec's form of :func:`broker.model.values.check_name` (msgspec already refuses lone
surrogates in any string), so names are checked inside the fast decode."""

Name: TypeAlias = Annotated[
    str, msgspec.Meta(pattern=_NAME_PATTERN, max_length=MAX_NAME_BYTES // 4), check_name
]
"""A name or id (task, queue, worker id, host, key, request id, cursor): a string the
decoder refuses when it holds a control character or a lone surrogate, or is over
:data:`~broker.model.bounds.MAX_NAME_BYTES` in UTF-8 (:mod:`broker.model.values`). The fast decoder
counts characters (a quarter of the byte cap, so never over it); a longer name goes to
the walker, which counts its UTF-8 bytes. Free texts (an error message, a reason) stay
plain ``str``, bounded by the line."""

_T = TypeVar("_T")

Names: TypeAlias = Annotated[list[Name], msgspec.Meta(max_length=MAX_LIST_ITEMS)]
"""A list of names, at most :data:`~broker.model.bounds.MAX_LIST_ITEMS` long: a list of strings
costs a check and an object per item, and no other bound (the container count) sees it."""

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

Int: TypeAlias = Annotated[int, msgspec.Meta(ge=_INT64_MIN, le=_INT64_MAX)]
"""Integers must fit a signed 64-bit column in any store and any peer's language."""

Float: TypeAlias = Annotated[float, msgspec.Meta(ge=-(2.0**62), le=2.0**62)]
"""A number. The bound only keeps an integer too big for 64 bits out of the fast decode
(the walker refuses it, and accepts a genuine float beyond the bound); it sits well
inside 2**63 because msgspec compares after rounding to a float, where 2**63 and
2**63 - 1 are the same number."""


class _Struct(msgspec.Struct, frozen=True):
    """A value nested in messages (a lease, a job request)."""


class _Message(msgspec.Struct, frozen=True, tag_field="type"):
    """A message: one JSON object tagged by its ``type``, set per class by ``tag=``."""

    type: ClassVar[str]
    """The tag (``job``, ``ready``...), also readable on the class; set below from ``tag=``."""


def _check(ok: bool, message: str) -> None:
    # ValueError, not ProtocolError: a local caller building a bad message has a bug;
    # decode() re-raises it as DecodeError because there the peer is at fault.
    if not ok:
        raise ValueError(message)


# --------------------------------------------------------------------------- handshake


class LeaseRef(_Struct, frozen=True):
    job_id: uuid.UUID
    handoff_id: uuid.UUID


class Challenge(_Message, frozen=True, tag="challenge"):
    nonce: str
    protocol: Int
    auth_required: bool

    def __post_init__(self) -> None:
        _check(
            bool(self.nonce) and all(c in string.hexdigits for c in self.nonce),
            "nonce must be a non-empty hex string",
        )


class Hello(_Message, frozen=True, tag="hello"):
    role: Role
    protocol: Int
    proof: str | None = None
    worker_id: Name | None = None
    host: Name | None = None
    pid: Int | None = None
    modes: Annotated[list[ExecutionMode], msgspec.Meta(max_length=MAX_LIST_ITEMS)] = msgspec.field(
        default_factory=list
    )
    queues: Names | None = None
    """``None`` serves every queue; a list restricts the worker to those queues."""
    held_leases: list[LeaseRef] = msgspec.field(default_factory=list)
    """Leases the worker still holds from an earlier connection, so a restarted main
    can adopt them instead of running those jobs a second time."""
    protocols: Annotated[list[Int], msgspec.Meta(max_length=MAX_LIST_ITEMS)] | None = None
    """Every version the peer speaks (``None``: only ``protocol``, its newest); the main
    picks the newest it speaks too and names it in ``welcome``."""
    local_state_lost: bool = False
    """The worker comes back without the local state its earlier sessions left (a new
    state directory): recoveries waiting for this worker id's state stop waiting."""

    def spoken(self) -> list[Int]:
        """The versions this peer speaks."""
        return [self.protocol] if self.protocols is None else self.protocols

    def __post_init__(self) -> None:
        if self.role == Role.WORKER:
            _check(bool(self.worker_id), "worker_id is required for role worker")


class Welcome(_Message, frozen=True, tag="welcome"):
    main_id: str
    protocol: Int
    ping_interval: Float
    adopted: list[LeaseRef]
    max_line_bytes: Int
    max_payload_bytes: Int | None = None
    """The main's payload limit, so a worker fails an oversized result itself instead of
    sending it (``None``: no limit, or a main too old to say)."""
    max_payload_depth: Int = DEFAULT_MAX_PAYLOAD_DEPTH
    """How deep a payload may nest; a worker fails a deeper result before encoding it."""
    max_checkpoint_bytes: Int | None = None
    """The main's checkpoint limit, so a worker refuses a larger checkpoint to its task
    at once (``None``: no limit, or a main too old to say)."""
    max_payload_containers: Int | None = None
    """How many lists and objects (``[`` and ``{``) a line to the main may hold, plus
    :data:`~broker.model.bounds.MESSAGE_CONTAINERS` for the message itself: a worker fails a
    result over it and packs its report lines within it, a client refuses an enqueue over
    it (``None``: a main too old to say)."""

    def __post_init__(self) -> None:
        _check(
            math.isfinite(self.ping_interval) and self.ping_interval > 0,
            "ping_interval must be positive",
        )
        _check(self.max_line_bytes > 0, "max_line_bytes must be positive")
        _check(
            self.max_payload_bytes is None or self.max_payload_bytes > 0,
            "max_payload_bytes must be positive or null",
        )
        _check(self.max_payload_depth > 0, "max_payload_depth must be positive")


def choose_protocol(hello: Hello) -> int | None:
    """The newest version both this release and the peer of ``hello`` speak, or ``None``."""
    common = set(SUPPORTED_PROTOCOLS) & set(hello.spoken())
    return max(common) if common else None


def make_nonce() -> str:
    """A fresh challenge nonce; 128 random bits make replaying an old proof useless."""
    return secrets.token_hex(16)


def make_proof(token: str, nonce: str) -> str:
    """Proves knowledge of ``token`` without sending it: HMAC-SHA256 over the nonce as sent."""
    return hmac.new(token.encode("utf-8"), nonce.encode("utf-8"), hashlib.sha256).hexdigest()


def check_proof(token: str, nonce: str, proof: str | None) -> bool:
    """Constant-time, so the time taken does not leak how much of a guessed proof was right."""
    if proof is None:
        return False
    expected = make_proof(token, nonce).encode("ascii")
    # "replace" because a proof decoded from JSON may hold lone surrogates; it then
    # simply fails to match instead of raising.
    return hmac.compare_digest(expected, proof.encode("utf-8", "replace"))


# --------------------------------------------------------------------------- worker ↔ main


class Ready(_Message, frozen=True, tag="ready"):
    """Free slots per mode as of the ``job`` numbered ``seen``.

    ``seen`` is what makes credit exact: the main subtracts the jobs it sent after
    ``seen`` (the worker had not counted them yet), so a ``ready`` that crossed
    jobs on the wire can never grant more work than the worker has room for.
    """

    slots: dict[ExecutionMode, Int]
    seen: Int

    def __post_init__(self) -> None:
        for mode, free in self.slots.items():
            _check(free >= 0, f"slots[{mode}] must not be negative")
        _check(self.seen >= 0, "seen must not be negative")


class JobHandoff(_Message, frozen=True, tag="job", omit_defaults=True):
    """A job for the worker, under its lease. Fields at their defaults are left off the
    line (only ``checkpoint`` and ``checkpoint_seq`` have one), so a job without a
    checkpoint costs no more bytes than before they existed."""

    seq: Int
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    task: str
    args: list[JSONValue]
    kwargs: dict[str, JSONValue]
    execution_mode: ExecutionMode
    attempt: Int
    max_attempts: Int
    timeout: Float | None
    queue: str
    checkpoint: JSONValue = None
    """The last checkpoint the job's runs saved (meaningful when ``checkpoint_seq > 0``)."""
    checkpoint_seq: Int = 0
    """How many checkpoints the job's runs saved; 0: this attempt starts afresh."""
    recoveries: Int = 0
    """Attempts of this job lost before this one: more than 0 makes this one a recovery."""
    state_lost: bool = False
    """The job keeps local state, and this worker does not have it (see
    :attr:`broker.tasks.runner.Assignment.state_lost`)."""

    def __post_init__(self) -> None:
        _check(self.seq >= 1, "seq must be at least 1")
        _check(self.checkpoint_seq >= 0, "checkpoint_seq must not be negative")
        _check(self.attempt >= 1, "attempt must be at least 1")
        _check(self.max_attempts >= 1, "max_attempts must be at least 1")
        _check(self.timeout is None or self.timeout > 0, "timeout must be positive")


class CompletedReport(_Message, frozen=True, tag="completed"):
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    result: JSONValue = None


class FailedReport(_Message, frozen=True, tag="failed"):
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    error: str
    retry: bool = True
    """False for failures no retry can fix (an unknown task, bad arguments)."""
    retry_delay: Float | None = None
    """Seconds to wait before the next run, from the task's own backoff (``None``: the
    main's backoff). From 0 to ten years, like any delay; an older main ignores it."""
    lost: bool = False
    """The process running the job died under it: the main counts a recovery, not a
    failure (an older main ignores the field and counts a failure)."""

    def __post_init__(self) -> None:
        if self.retry_delay is not None:
            check_delay("retry_delay", self.retry_delay)


class RescheduleReport(_Message, frozen=True, tag="reschedule"):
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    delay: Float

    def __post_init__(self) -> None:
        check_delay("delay", self.delay)


class ReleaseReport(_Message, frozen=True, tag="release"):
    """A job the worker will not run (it arrived while draining); no attempt is counted."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    reason: str


class SaveCheckpoint(_Message, frozen=True, tag="checkpoint"):
    """A running job's checkpoint, numbered: the job's ``checkpoint_seq`` plus one for
    the first its run saves, and so on. Answered by ``checkpoint_ack`` once it is durable
    (or refused); the worker sends it again on a new connection until then."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    seq: Int
    state: JSONValue = None

    def __post_init__(self) -> None:
        _check(self.seq >= 1, "seq must be at least 1")


class CheckpointAck(_Message, frozen=True, tag="checkpoint_ack"):
    """The main's answer to a ``checkpoint``: ``applied`` (durable), ``duplicate`` (this
    or a newer one was already stored under the lease), ``stale`` (the lease is no longer
    the job's) or ``refused`` (never storable, too large say); ``code`` and ``message``
    say why for the last two, as a ``request_error`` does."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    seq: Int
    status: AckStatus
    code: str | None = None
    message: str | None = None


class Progress(_Message, frozen=True, tag="progress"):
    """A running job's latest progress; never answered, and may be dropped."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    fraction: Float
    message: str = ""

    def __post_init__(self) -> None:
        _check(0.0 <= self.fraction <= 1.0, "fraction must be from 0 to 1")


class ReportAck(_Message, frozen=True, tag="report_ack"):
    """Sent once the outcome is settled, so the worker may forget the report."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    status: AckStatus


class Draining(_Message, frozen=True, tag="draining"):
    """The worker stopped taking jobs; it still sends the reports of those it runs."""


class CancelJob(_Message, frozen=True, tag="cancel_job"):
    """The job under this lease was cancelled: stop running it. Its report, if any, will be
    acknowledged ``stale`` (the store already says ``cancelled``)."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID


class TaskDeclaration(_Struct, frozen=True):
    """A task a worker serves and the defaults ``@task`` gives its jobs: the main fills
    them into a job enqueued by name where the request leaves a field out. The rest
    describes the task for operators (``broker tasks``)."""

    name: Name
    execution_mode: ExecutionMode = ExecutionMode.POOLED
    queue: Name = DEFAULT_QUEUE
    priority: Int = 0
    max_attempts: Int = DEFAULT_MAX_RETRIES + 1
    timeout: Float | None = None
    concurrency_key: Name | None = None
    """A template such as ``"sync:{account_id}"`` is filled from each job's arguments."""
    concurrency_limit: Int | None = None
    unique: bool = False
    """Each job gets the task's default unique key (its name and arguments)."""
    parameters: Names = msgspec.field(default_factory=list)
    """The function's positional parameters in order, to name a job's positional
    arguments when a concurrency-key template needs them."""
    retry_on: Names | None = None
    """The exception classes worth a retry (``None``: any ``Exception``)."""
    dont_retry_on: Names = msgspec.field(default_factory=list)
    backoff: str | None = None
    """The task's own backoff, described (``None``: the main's ``--retry-backoff``)."""

    def __post_init__(self) -> None:
        _check(self.max_attempts >= 1, "max_attempts must be at least 1")
        _check(self.timeout is None or self.timeout > 0, "timeout must be positive")
        _check(
            (self.concurrency_key is None) == (self.concurrency_limit is None),
            "concurrency_key and concurrency_limit go together",
        )


class TaskCatalog(_Message, frozen=True, tag="tasks"):
    """The tasks this worker serves, sent once right after ``welcome`` (not in ``hello``,
    whose line is capped at the pre-authentication limit, 64 KiB by default)."""

    tasks: list[TaskDeclaration]


class WorkerStatus(_Message, frozen=True, tag="worker_status"):
    """The worker's own view (``Worker.status()``) for operators; the main keeps the last one."""

    status: dict[str, JSONValue]


class Ping(_Message, frozen=True, tag="ping"):
    nonce: Int


class Pong(_Message, frozen=True, tag="pong"):
    nonce: Int


class Error(_Message, frozen=True, tag="error"):
    """A connection-level error; after a fatal one the sender closes the connection."""

    code: str
    message: str
    fatal: bool
    leader: str | None = None
    """With code ``not_leader``: the elected main's ``HOST:PORT`` for the peer to connect
    to instead (``None``: no main is elected yet; try the others)."""


# --------------------------------------------------------------------------- client ↔ main


class JobRequest(_Struct, frozen=True, omit_defaults=True):
    """A :class:`~broker.jobs.JobSpec` as JSON; only ``task`` is required on the wire.

    ``run_at`` and ``delay`` are alternatives: ``delay`` is resolved against the
    main's clock, so a client with a skewed clock still gets the delay it asked for.

    Fields at their defaults (``null``, ``false``, empty) are left off the line, which
    reads them back the same: a typical job's request is half as long, and a bulk
    enqueue's line (355 kB for 1,000 small jobs, 170 kB without) is written, read and
    decoded for less.
    """

    task: Name
    args: list[JSONValue] = msgspec.field(default_factory=list)
    kwargs: dict[str, JSONValue] = msgspec.field(default_factory=dict)
    queue: Name | None = None
    priority: Int | None = None
    run_at: str | None = None
    delay: Float | None = None
    max_attempts: Int | None = None
    idempotency_key: Name | None = None
    concurrency_key: Name | None = None
    concurrency_limit: Int | None = None
    timeout: Float | None = None
    execution_mode: ExecutionMode | None = None
    id: uuid.UUID | None = None
    unique_key: Name | None = None
    """At most one queued or running job per key; an older main ignores the field."""
    max_recoveries: Int | None = None
    """Lost attempts the job may recover from (``None``: the main's default)."""
    local_state: bool = False
    """Recoveries wait for the worker holding the job's local state first."""

    def to_spec(self, now: datetime, defaults: Mapping[str, Any] | None = None) -> JobSpec:
        """The job this request asks for. A field it leaves out (``null``) takes its value
        from ``defaults`` (the task's, from the catalog: see :mod:`broker.core.catalog`), else
        the :class:`~broker.jobs.JobSpec` default.

        Raises :class:`InvalidJobError`, which the main answers with ``invalid_job``."""
        if self.run_at is not None and self.delay is not None:
            raise InvalidJobError("give run_at or delay, not both")
        run_at: datetime | None = None
        if self.run_at is not None:
            try:
                run_at = datetime.fromisoformat(self.run_at)
            except ValueError:
                raise InvalidJobError(
                    f"run_at must be an ISO-8601 timestamp (got {self.run_at!r})"
                ) from None
        elif self.delay is not None:
            try:
                check_delay("delay", self.delay)
            except ValueError as exc:
                raise InvalidJobError(str(exc)) from None
            run_at = now + timedelta(seconds=self.delay)
        # A field the request leaves out (None) takes the task's default, else the spec's.
        values = {
            name: value
            for name, value in zip(_REQUESTED, _requested(self), strict=True)
            if value is not None
        }
        if defaults:
            for name, value in defaults.items():
                if value is not None:
                    values.setdefault(name, value)
        return JobSpec(**values, run_at=run_at)

    @classmethod
    def from_spec(cls, spec: JobSpec, *, said: Collection[str] | None = None) -> JobRequest:
        """The request for ``spec``; with ``said``, a field the task's defaults may fill
        (:data:`TASK_DEFAULTS`) is sent only if named there, so a job enqueued by name
        takes the task's declared defaults for the rest."""
        if said is None:
            # Positionally, in the order checked below the class: a bulk enqueue's client
            # builds one per job, and by keywords (a dict of the spec's fields) that cost
            # three times as much.
            v = spec_fields(spec)
            run_at = None if v[5] is None else v[5].isoformat()
            return cls(v[0], list(v[1]), dict(v[2]), v[3], v[4], run_at, None, *v[6:])
        values = spec_values(spec)
        values.update({name: None for name in TASK_DEFAULTS if name not in said})
        values.update(args=list(spec.args), kwargs=dict(spec.kwargs))
        values["run_at"] = None if spec.run_at is None else spec.run_at.isoformat()
        return cls(**values)


TASK_DEFAULTS = (
    "queue",
    "priority",
    "max_attempts",
    "timeout",
    "execution_mode",
    "concurrency_key",
    "concurrency_limit",
    "unique_key",
)
"""The job fields a task's declaration fills in when an enqueue by name leaves them out."""


if JobRequest.__struct_fields__ != (*SPEC_FIELDS[:6], "delay", *SPEC_FIELDS[6:]):
    raise ImportError("JobRequest's fields must be JobSpec's, with delay after run_at")
_REQUESTED = tuple(name for name in SPEC_FIELDS if name != "run_at")
"""The spec fields a request carries as they are (its ``run_at`` is text, or a ``delay``)."""
_requested = operator.attrgetter(*_REQUESTED)


class EnqueuedRef(_Struct, frozen=True):
    job_id: uuid.UUID
    duplicate: bool
    """True when an existing job was returned instead: the holder of the same idempotency
    key, or the queued or running holder of the same unique key."""


class Enqueue(_Message, frozen=True, tag="enqueue"):
    request_id: Name
    jobs: list[JobRequest]
    allow_unknown_tasks: bool = False
    """Store jobs of tasks no worker has declared yet (a deliberate cold start); by
    default such an enqueue is refused with ``unknown_task``."""


class EnqueuedReply(_Message, frozen=True, tag="enqueued"):
    """One ref per requested job, in request order."""

    request_id: str
    jobs: list[EnqueuedRef]


class GetJob(_Message, frozen=True, tag="get_job"):
    request_id: Name
    job_id: uuid.UUID


class Cancel(_Message, frozen=True, tag="cancel"):
    request_id: Name
    job_id: uuid.UUID


class JobInfo(_Message, frozen=True, tag="job_info"):
    """``job`` is :meth:`broker.jobs.Job.to_dict`, or null when no such job exists."""

    request_id: str
    job: dict[str, JSONValue] | None


class RequestError(_Message, frozen=True, tag="request_error"):
    """One request failed; unlike ``error`` it never closes the connection.

    ``details`` carries the fields of an exception that has some (the ``holder_id`` of a
    ``unique_key_taken``), so the client raises it whole (see :mod:`broker.wire.errors`).
    """

    request_id: str
    code: str
    message: str
    details: dict[str, JSONValue] | None = None


MAX_LIST_LIMIT = 1000
"""The most jobs one ``list_jobs`` page may carry."""


class Retry(_Message, frozen=True, tag="retry"):
    """Put a dead (``failed``) job back in the queue; answered with ``job_info``."""

    request_id: Name
    job_id: uuid.UUID


class Status(_Message, frozen=True, tag="status"):
    request_id: Name


class StatusInfo(_Message, frozen=True, tag="status_info"):
    """``status`` is the main's operator snapshot (``docs/reference/cli.md`` shows it)."""

    request_id: str
    status: dict[str, JSONValue]


class ListJobs(_Message, frozen=True, tag="list_jobs"):
    """One page of jobs, newest first; ``null`` filters match anything.

    Without ``include_payload`` each job comes without ``args``, ``kwargs`` and
    ``result`` (they may be megabytes each); ``get_job`` returns a job whole."""

    request_id: Name
    statuses: Annotated[list[JobStatus], msgspec.Meta(max_length=MAX_LIST_ITEMS)] | None = None
    queues: Names | None = None
    tasks: Names | None = None
    limit: Int = 50
    cursor: Name | None = None
    include_payload: bool = False

    def __post_init__(self) -> None:
        _check(1 <= self.limit <= MAX_LIST_LIMIT, f"limit must be 1-{MAX_LIST_LIMIT}")


class JobList(_Message, frozen=True, tag="job_list"):
    """``jobs`` are :meth:`broker.jobs.Job.to_dict` (without its payload fields unless the
    request asked for them); ``next_cursor`` is null on the last page."""

    request_id: str
    jobs: list[dict[str, JSONValue]]
    next_cursor: str | None


class ListTasks(_Message, frozen=True, tag="list_tasks"):
    """The task catalog: every task a worker has declared; answered with ``task_list``."""

    request_id: Name


class TaskList(_Message, frozen=True, tag="task_list"):
    """One entry per task and worker that declared it: ``task``, ``worker_id``,
    ``seen_at`` (ISO-8601) and ``declaration`` (a ``TaskDeclaration``), by task name."""

    request_id: str
    tasks: list[dict[str, JSONValue]]


class Prune(_Message, frozen=True, tag="prune"):
    """Delete terminal jobs: those last updated over ``older_than_seconds`` ago, and those
    beyond the newest ``keep_latest``; ``statuses`` narrows which terminal statuses."""

    request_id: Name
    older_than_seconds: Float | None = None
    keep_latest: Int | None = None
    statuses: Annotated[list[JobStatus], msgspec.Meta(max_length=MAX_LIST_ITEMS)] | None = None

    def __post_init__(self) -> None:
        check_prune(self.older_than_seconds, self.keep_latest, self.statuses)


def check_prune(
    older_than_seconds: float | None,
    keep_latest: int | None,
    statuses: Collection[JobStatus] | None,
) -> None:
    """Refuse a prune with nothing to prune by, an age outside 0 to a hundred years (an
    older cut-off would overflow a date), a negative count, or a status that is not
    terminal; raises ``ValueError``. The one rule for a ``prune`` message and for
    :meth:`broker.main.operations.Operations.prune`."""
    _check(
        older_than_seconds is not None or keep_latest is not None,
        "give older_than_seconds or keep_latest (or both)",
    )
    _check(
        older_than_seconds is None or 0 <= older_than_seconds <= MAX_AGE_SECONDS,
        f"older_than_seconds must be from 0 to {MAX_AGE_SECONDS} (a hundred years)",
    )
    _check(keep_latest is None or keep_latest >= 0, "keep_latest must not be negative")
    _check(
        statuses is None or all(s in TERMINAL_STATUSES for s in statuses),
        "statuses must be terminal (completed, failed, cancelled)",
    )


class Pruned(_Message, frozen=True, tag="pruned"):
    request_id: str
    deleted: Int


Report: TypeAlias = CompletedReport | FailedReport | RescheduleReport | ReleaseReport
"""What a worker says of one lease's run; accepted only from the connection holding it."""


# --------------------------------------------------------------------------- batches (version 3)


class Jobs(_Message, frozen=True, tag="jobs"):
    """Several ``job`` messages in one line (main to worker), in ``seq`` order.

    Each item is a whole ``job`` object, ``type`` included, so a batch line is its items
    encoded once each and joined (:func:`pack`), and a receiver handles a batch exactly
    as it would the same messages on separate lines."""

    jobs: list[JobHandoff]

    def __post_init__(self) -> None:
        _check(bool(self.jobs), "jobs must not be empty")


class Reports(_Message, frozen=True, tag="reports"):
    """Several outcomes in one line (worker to main), in outbox order."""

    reports: list[Report]

    def __post_init__(self) -> None:
        _check(bool(self.reports), "reports must not be empty")


class ReportAcks(_Message, frozen=True, tag="report_acks"):
    """Several ``report_ack`` messages in one line (main to worker)."""

    acks: list[ReportAck]

    def __post_init__(self) -> None:
        _check(bool(self.acks), "acks must not be empty")


Batch: TypeAlias = Jobs | Reports | ReportAcks

Message: TypeAlias = (
    Challenge
    | Hello
    | Welcome
    | Ready
    | JobHandoff
    | CompletedReport
    | FailedReport
    | RescheduleReport
    | ReleaseReport
    | ReportAck
    | SaveCheckpoint
    | CheckpointAck
    | Progress
    | Jobs
    | Reports
    | ReportAcks
    | Draining
    | Ping
    | Pong
    | Error
    | Enqueue
    | EnqueuedReply
    | GetJob
    | JobInfo
    | Cancel
    | RequestError
    | CancelJob
    | WorkerStatus
    | TaskCatalog
    | ListTasks
    | TaskList
    | Retry
    | Status
    | StatusInfo
    | ListJobs
    | JobList
    | Prune
    | Pruned
)

for _cls in typing.get_args(Message):
    _cls.type = typing.cast(str, _cls.__struct_config__.tag)

MESSAGE_TYPES: Mapping[str, type[Message]] = {cls.type: cls for cls in typing.get_args(Message)}
"""Every message class by its tag: the walker's dispatch table."""


# --------------------------------------------------------------------------- encode

_ENCODER = msgspec.json.Encoder()

_SCALAR_TYPES = frozenset({str, int, bool, type(None)})


def _check_json(value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is plain JSON as :func:`json.dumps` would take
    it: msgspec would quietly write NaN as ``null`` and a set, a datetime or a UUID as a
    list or a string, and a result must never change on its way to the store. A value
    that nests past the recursion limit (or contains itself) raises ``RecursionError``."""
    kind = type(value)
    if kind in _SCALAR_TYPES:
        return
    if kind is list or kind is tuple:
        for item in typing.cast(Sequence[object], value):
            if type(item) not in _SCALAR_TYPES:
                _check_json(item)
    elif kind is dict:
        for key, item in typing.cast(dict[object, object], value).items():
            if type(key) is not str and (type(key) is not int):
                raise ValueError(f"keys must be strings, not {type(key).__name__}")
            if type(item) not in _SCALAR_TYPES:
                _check_json(item)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not valid JSON")
    elif isinstance(value, str | int):
        return
    elif isinstance(value, dict):
        _check_json(dict(value))  # a subclass: check it as a plain one
    elif isinstance(value, list | tuple):
        _check_json(list(value))
    else:
        raise ValueError(f"Object of type {kind.__name__} is not JSON serializable")


def _payload_fields(cls: type) -> tuple[tuple[str, bool], ...]:
    """``(field, nested)`` for each field of ``cls`` that holds a payload (``nested``:
    messages or structs that may hold payloads themselves), resolved once per class."""
    if cls not in _PAYLOADS:
        found: list[tuple[str, bool]] = []
        for name, tp, _ in _fields(cls):
            if _mentions(tp, lambda t: t is Any):
                found.append((name, False))
            elif _mentions(tp, lambda t: _is_struct(t) and bool(_payload_fields(t))):
                found.append((name, True))
        _PAYLOADS[cls] = tuple(found)
    return _PAYLOADS[cls]


_PAYLOADS: dict[type, tuple[tuple[str, bool], ...]] = {}


def _mentions(tp: Any, test: Callable[[Any], bool]) -> bool:
    return test(tp) or any(_mentions(arg, test) for arg in typing.get_args(tp))


def _check_payloads(value: object) -> None:
    for name, nested in _payload_fields(type(value)):
        field_value = getattr(value, name)
        if not nested:
            _check_json(field_value)
        elif isinstance(field_value, list):
            for item in field_value:
                _check_payloads(item)
        elif field_value is not None:
            _check_payloads(field_value)


def encode_item(msg: Message) -> bytes:
    """One message as compact JSON, without the newline: the unit :func:`pack` joins.

    Raises ``ValueError`` if a payload (``args``, ``result``...) is not plain JSON, so
    the caller can report that instead of sending something the peer would reject.
    """
    try:
        _check_payloads(msg)
        return _ENCODER.encode(msg)
    except UnicodeEncodeError:
        # A lone surrogate (from an exception text, say) has no UTF-8 form; json writes
        # it as its \\udXXX escape, which the peer's walker reads back unchanged.
        return json.dumps(msgspec.to_builtins(msg), separators=(",", ":")).encode("ascii")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot encode {msg.type} message: {exc}") from exc
    except RecursionError:
        # A payload nested ~1,000 deep: the caller's ValueError path (fail that job, skip
        # that field) must handle it, not let it escape and take down its loop.
        raise ValueError(f"cannot encode {msg.type} message: it nests too deeply") from None


def encode(msg: Message) -> bytes:
    """One compact JSON line ending in ``\\n`` (raises ``ValueError`` as :func:`encode_item`)."""
    return encode_item(msg) + b"\n"


def pack(
    kind: type[Batch],
    items: Sequence[bytes],
    max_line_bytes: int,
    max_containers: int | None = None,
) -> list[bytes]:
    """Lines that carry ``items`` (from :func:`encode_item`, of the messages ``kind``
    holds) in order: one item alone as its own message, several as ``kind`` batches,
    none longer than ``max_line_bytes`` before its newline and, with ``max_containers``
    (the main's, from ``welcome``), none holding more lists and objects than the main
    reads (:func:`decode_from_peer`). An item too long on its own goes alone (its sender
    checks single messages against the limits: a ``job`` always fits, a report too long
    or too full is replaced by a failure before it gets here)."""
    (name,) = kind.__struct_fields__
    head = b'{"type":"%s","%s":[' % (kind.type.encode(), name.encode())
    room = max_line_bytes - len(head) - 2  # 2: the closing "]}"
    # The batch's own object and list count against the main's bound too.
    shelves = None if max_containers is None else max_containers + MESSAGE_CONTAINERS - 2
    lines: list[bytes] = []
    start, size, held = 0, 0, 0
    for end, item in enumerate(items):
        grown = size + len(item) + (1 if end > start else 0)
        fuller = held + (0 if shelves is None else containers_in(item))
        if end > start and (grown > room or (shelves is not None and fuller > shelves)):
            lines.append(_line(head, items[start:end]))
            start, grown, fuller = end, len(item), fuller - held
        size, held = grown, fuller
    if start < len(items):
        lines.append(_line(head, items[start:]))
    return lines


def _line(head: bytes, items: Sequence[bytes]) -> bytes:
    if len(items) == 1:
        return items[0] + b"\n"
    return head + b",".join(items) + b"]}\n"


def unbatch(msg: Message) -> Iterable[Message]:
    """The messages a line carried: a batch's items, or the message itself."""
    match msg:
        case Jobs(jobs=items):
            return items
        case Reports(reports=reports):
            return reports
        case ReportAcks(acks=acks):
            return acks
        case _:
            return (msg,)


# --------------------------------------------------------------------------- decode

_DECODER = msgspec.json.Decoder(Message)


HEAD_BYTES = 8 << 10
"""How far into a refused line :func:`container_refusal` looks for the fields that say
whose it is: every sender of this package writes the tag, ``request_id``, ``job_id``,
``handoff_id`` and ``seq`` before any payload (msgspec keeps the declared field order)."""

_HEAD_FIELDS = re.compile(
    rb'"(type|request_id|job_id|handoff_id)"\s*:\s*"([^"\\]{1,1024})"'
    rb'|"(seq)"\s*:\s*(\d{1,18})\s*[,}]'
)
"""A top-level field of the head, as JSON writes it: inside a string every quote is
escaped, so this never matches a string's content."""


def _lease_in(head: Mapping[str, str]) -> tuple[uuid.UUID, uuid.UUID] | None:
    try:
        return uuid.UUID(head["job_id"]), uuid.UUID(head["handoff_id"])
    except (KeyError, ValueError):
        return None


def _name_or_none(text: str | None) -> str | None:
    """``text`` if it is a name a reply may carry back (JSON escapes aside), else ``None``."""
    try:
        check_name("request_id", text)
    except ValueError:
        return None
    return text


def decode_from_peer(line: bytes) -> Message:
    """:func:`decode` for the main's reading of an authenticated peer (whose lines its
    reader already held to the container bound): a ``worker_status`` over
    :data:`~broker.model.bounds.MAX_WORKER_STATUS_BYTES` is refused rather than kept, and echoed
    in every ``status`` reply. Raises :class:`OverBoundError`, or :class:`DecodeError` as
    :func:`decode` does."""
    msg = decode(line)
    if type(msg) is WorkerStatus and len(line) > MAX_WORKER_STATUS_BYTES:
        raise OverBoundError(
            f"worker_status is {len(line)} bytes, over the limit of {MAX_WORKER_STATUS_BYTES} "
            "bytes; it was not kept (a status is capacity and start-up errors, a few hundred "
            "bytes)",
            code=ErrorCode.OVER_LIMIT,
            msg_type=WorkerStatus.type,
        )
    return msg


def container_refusal(line: bytes, max_containers: int) -> OverBoundError:
    """The refusal of a line over the container bound (``line``: its start, the rest was
    dropped as it was read, see :class:`broker.wire.framing.TooManyContainersError`), as specific
    as its head allows: an
    enqueue's is answered as its request (``payload_too_large``), a ``completed`` report
    fails its job (:attr:`OverBoundError.instead`), a ``checkpoint`` is answered
    ``refused`` (:attr:`OverBoundError.reply`). The head is read from the line's first
    :data:`HEAD_BYTES` (microseconds, where even msgspec, skipping the rest unbuilt, took
    50 ms on 15 MiB); a sender that puts it later gets a plain ``error`` instead."""
    head: dict[str, str] = {}
    for match in _HEAD_FIELDS.finditer(line, 0, HEAD_BYTES):
        name = (match.group(1) or match.group(3)).decode()
        head.setdefault(name, (match.group(2) or match.group(4)).decode(errors="replace"))
    kind = head.get("type") if head.get("type") in MESSAGE_TYPES else None
    what = {
        CompletedReport.type: "the job's result",
        SaveCheckpoint.type: "the checkpoint",
        Enqueue.type: "the enqueue request (its jobs' args and kwargs together)",
    }.get(kind or "", f"the {kind or 'message'}")
    message = too_many_containers(what, max_containers)
    instead: Message | None = None
    reply: Message | None = None
    lease = _lease_in(head)
    if lease is not None and kind == CompletedReport.type:
        instead = FailedReport(
            *lease, error=f"{message}; the result was not stored (return flatter data)", retry=False
        )
    elif lease is not None and kind == SaveCheckpoint.type and int(head.get("seq", 0)) >= 1:
        reply = CheckpointAck(
            *lease,
            int(head["seq"]),
            AckStatus.REFUSED,
            code=ErrorCode.PAYLOAD_TOO_LARGE,
            message=message,
        )
    return OverBoundError(
        message,
        code=ErrorCode.PAYLOAD_TOO_LARGE,
        msg_type=kind,
        request_id=_name_or_none(head.get("request_id")),
        instead=instead,
        reply=reply,
    )


def decode(line: bytes | str) -> Message:
    """Parse one line (with or without its newline) into a message.

    Raises :class:`DecodeError` (``code`` says which error code to reply with);
    ``msg_type`` and ``request_id`` are filled in when they could be read.
    """
    try:
        return _DECODER.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return _explain(line)


def _explain(line: bytes | str) -> Message:
    """The rules applied field by field: a line msgspec refused is either accepted after
    all (msgspec is stricter in places) or refused with the field that is wrong."""
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except ValueError as exc:
        raise DecodeError(f"invalid JSON: {exc}") from None
    except RecursionError:
        # A few KiB of "[[[[" must not take the connection handler down.
        raise DecodeError("invalid JSON: it nests too deeply to decode") from None
    match data:
        case {"type": str(tag)} if tag in MESSAGE_TYPES:
            request_id = data.get("request_id")
            try:
                return _build(MESSAGE_TYPES[tag], data, tag)
            except DecodeError as exc:
                exc.msg_type = tag
                exc.request_id = request_id if isinstance(request_id, str) else None
                raise
        case {"type": str(tag)}:
            raise UnknownTypeError(f"unknown message type {tag[:40]!r}", msg_type=tag[:40])
        case {"type": other}:
            raise DecodeError(f"type must be a string, got {_describe(other)}")
        case dict():
            raise DecodeError("message has no type")
        case _:
            raise DecodeError(f"message must be a JSON object, got {_describe(data)}")


_INT_RANGE = range(_INT64_MIN, _INT64_MAX + 1)

_SCALARS: dict[Any, tuple[str, Callable[[object], bool]]] = {
    bool: ("a boolean", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: type(v) is int and v in _INT_RANGE),
    # An int beyond 64 bits would overflow float(); a float from JSON is already finite.
    float: ("a number", lambda v: type(v) is float or (type(v) is int and v in _INT_RANGE)),
    str: ("a string", lambda v: isinstance(v, str)),
}


_FIELDS: dict[type, tuple[tuple[str, Any, bool], ...]] = {}


def _fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, resolved type, required on the wire) for each field, resolved once per class."""
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls, include_extras=True)
        _FIELDS[cls] = tuple(
            (f.name, hints[f.name], f.required) for f in msgspec.structs.fields(cls)
        )
    return _FIELDS[cls]


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _describe(value: object) -> str:
    kind = {
        type(None): "null",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)
    shown = repr(value)
    # Never echo a peer's large payload back into logs or error replies.
    return kind if len(shown) > 40 or isinstance(value, list | dict) else f"{kind} ({shown})"


def _load(value: object, tp: Any, where: str, nullable: bool = False) -> Any:
    """Check one JSON value against a field's annotation and convert it (UUIDs, enums)."""
    if tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        loaded = _load(value, args[0], where, nullable)
        for check in args[1:]:
            if isinstance(check, msgspec.Meta):
                if isinstance(loaded, list) and len(loaded) > (check.max_length or len(loaded)):
                    raise DecodeError(f"{where} must hold at most {check.max_length} items")
                continue  # else the fast decoder's form of the same rule, or a looser one
            try:
                check(where, loaded)
            except ValueError as exc:
                raise DecodeError(str(exc)) from None
        return loaded
    if origin is types.UnionType or origin is typing.Union:
        if value is None and type(None) in args:
            return None
        choices = [a for a in args if a is not type(None)]
        if len(choices) > 1:  # messages told apart by their tag (a batch's reports)
            return _load_tagged(value, choices, where)
        return _load(value, choices[0], where, nullable=type(None) in args)
    if origin is list and isinstance(value, list):
        return [_load(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict and isinstance(value, dict):
        return {
            _load(k, args[0], f"{where} key"): _load(v, args[1], f"{where}.{k}")
            for k, v in value.items()
        }
    if _is_struct(tp) and isinstance(value, dict):
        return _build(typing.cast(type[Any], tp), value, where)
    try:
        return _load_leaf(value, tp)
    except (TypeError, ValueError, AttributeError) as exc:
        null = " or null" if nullable else ""
        raise DecodeError(f"{where} must be {exc}{null}, got {_describe(value)}") from None


def _load_tagged(value: object, choices: list[Any], where: str) -> Any:
    by_tag = {cls.type: cls for cls in choices}
    tag = value.get("type") if isinstance(value, dict) else None
    if not isinstance(value, dict) or tag not in by_tag:
        raise DecodeError(
            f"{where} must be an object whose type is one of "
            + ", ".join(repr(t) for t in by_tag)
            + f", got {_describe(tag if isinstance(value, dict) else value)}"
        )
    return _build(by_tag[tag], value, where)


def _load_leaf(value: object, tp: Any) -> Any:
    """Convert a scalar, or raise with what was expected as the message."""
    if tp in _SCALARS:
        expected, ok = _SCALARS[tp]
        if not ok(value):
            raise ValueError(expected)
        return float(typing.cast(float, value)) if tp is float else value
    if tp is uuid.UUID:
        if not isinstance(value, str):
            raise ValueError("a UUID string")
        try:
            return uuid.UUID(value)
        except ValueError:
            raise ValueError("a UUID string") from None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ValueError("one of " + ", ".join(repr(m.value) for m in tp)) from None
    origin = typing.get_origin(tp)
    if origin is list:
        raise ValueError("a list")
    if origin is dict or _is_struct(tp):
        raise ValueError("an object")
    raise RuntimeError(f"no wire form for {tp!r}")  # a bug in this module, not the peer's


def _build(cls: type[_T], data: Mapping[str, object], where: str) -> _T:
    values: dict[str, Any] = {}
    for name, tp, required in _fields(cls):
        if name in data:
            values[name] = _load(data[name], tp, f"{where}.{name}")
        elif required:
            raise DecodeError(f"{where}.{name} is required")
    try:
        return cls(**values)
    except ValueError as exc:
        raise DecodeError(f"{where}: {exc}") from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text} is out of range")
    return number
