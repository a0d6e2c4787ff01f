"""The messages the main, its workers and its clients exchange, with no I/O.

Every message is a frozen dataclass tagged by a ``type`` string; :func:`encode`
turns one into a single NDJSON line and :func:`decode` turns a line back into a
message or raises :class:`DecodeError` naming the offending field. Keeping this
free of sockets (as hypercorn keeps its HTTP state machines) lets the main, the
worker and the tests agree on the wire format without a network in sight.
``docs/protocol.md`` is the specification; this module is its executable form.

Decoding is strict about types because the main is the only writer to the job
store: a ``true`` where a count belongs, or a lease id that is not a UUID, must be
turned away at the edge rather than discovered in the store. It is lenient about
*extra* fields, so a newer peer can add one without breaking an older one.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import math
import secrets
import string
import types
import typing
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Annotated, Any, ClassVar, TypeAlias, TypeVar

from broker.exceptions import InvalidJobError, ProtocolError
from broker.jobs import (
    DEFAULT_QUEUE,
    TERMINAL_STATUSES,
    ExecutionMode,
    JobSpec,
    JobStatus,
    JSONValue,
    spec_values,
)
from broker.payload import DEFAULT_MAX_PAYLOAD_DEPTH
from broker.values import MAX_AGE_SECONDS, check_delay, check_key, check_name

PROTOCOL_VERSION = 2
"""Bumped on any change an older peer would misread; extra fields do not need it."""

DEFAULT_PORT = 7390
"""The TCP port a main listens on and peers dial unless told otherwise. It lives with the
protocol, not the main, so a client can know it without importing the main."""


class Role(enum.StrEnum):
    WORKER = "worker"
    CLIENT = "client"


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
    SCHEMA_VERSION = "schema_version"
    STORAGE_REJECTED = "storage_rejected"
    TASK_NOT_FOUND = "task_not_found"
    JOB_TIMEOUT = "job_timeout"
    RUNNER_CRASHED = "runner_crashed"


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


Name: TypeAlias = Annotated[str, check_name]
"""A name or id (task, queue, worker id, key, request id, cursor): a string the decoder
refuses when it holds a control character or a lone surrogate (:mod:`broker.values`).
Free texts (an error message, a reason) stay plain ``str``."""

Key: TypeAlias = Annotated[str, check_key]
"""A :data:`Name` that is also stored in an index, so its length is capped too."""


def _check(ok: bool, message: str) -> None:
    # ValueError, not ProtocolError: a local caller building a bad message has a bug;
    # decode() re-raises it as DecodeError because there the peer is at fault.
    if not ok:
        raise ValueError(message)


# --------------------------------------------------------------------------- handshake


@dataclass(frozen=True, slots=True)
class LeaseRef:
    job_id: uuid.UUID
    handoff_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class Challenge:
    type: ClassVar[str] = "challenge"
    nonce: str
    protocol: int
    auth_required: bool

    def __post_init__(self) -> None:
        _check(
            bool(self.nonce) and all(c in string.hexdigits for c in self.nonce),
            "nonce must be a non-empty hex string",
        )


@dataclass(frozen=True, slots=True)
class Hello:
    type: ClassVar[str] = "hello"
    role: Role
    protocol: int
    proof: str | None = None
    worker_id: Key | None = None
    host: Name | None = None
    pid: int | None = None
    modes: list[ExecutionMode] = field(default_factory=list)
    queues: list[Name] | None = None
    """``None`` serves every queue; a list restricts the worker to those queues."""
    held_leases: list[LeaseRef] = field(default_factory=list)
    """Leases the worker still holds from an earlier connection, so a restarted main
    can adopt them instead of running those jobs a second time."""

    def __post_init__(self) -> None:
        if self.role == Role.WORKER:
            _check(bool(self.worker_id), "worker_id is required for role worker")


@dataclass(frozen=True, slots=True)
class Welcome:
    type: ClassVar[str] = "welcome"
    main_id: str
    protocol: int
    ping_interval: float
    adopted: list[LeaseRef]
    max_line_bytes: int
    max_payload_bytes: int | None = None
    """The main's payload limit, so a worker fails an oversized result itself instead of
    sending it (``None``: no limit, or a main too old to say)."""
    max_payload_depth: int = DEFAULT_MAX_PAYLOAD_DEPTH
    """How deep a payload may nest; a worker fails a deeper result before encoding it."""

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


@dataclass(frozen=True, slots=True)
class Ready:
    """Free slots per mode as of the ``job`` numbered ``seen``.

    ``seen`` is what makes credit exact: the main subtracts the jobs it sent after
    ``seen`` (the worker had not counted them yet), so a ``ready`` that crossed
    jobs on the wire can never grant more work than the worker has room for.
    """

    type: ClassVar[str] = "ready"
    slots: dict[ExecutionMode, int]
    seen: int

    def __post_init__(self) -> None:
        for mode, free in self.slots.items():
            _check(free >= 0, f"slots[{mode}] must not be negative")
        _check(self.seen >= 0, "seen must not be negative")


@dataclass(frozen=True, slots=True)
class JobHandoff:
    type: ClassVar[str] = "job"
    seq: int
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    task: str
    args: list[JSONValue]
    kwargs: dict[str, JSONValue]
    execution_mode: ExecutionMode
    attempt: int
    max_attempts: int
    timeout: float | None
    queue: str

    def __post_init__(self) -> None:
        _check(self.seq >= 1, "seq must be at least 1")
        _check(self.attempt >= 1, "attempt must be at least 1")
        _check(self.max_attempts >= 1, "max_attempts must be at least 1")
        _check(self.timeout is None or self.timeout > 0, "timeout must be positive")


@dataclass(frozen=True, slots=True)
class CompletedReport:
    type: ClassVar[str] = "completed"
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    result: JSONValue = None


@dataclass(frozen=True, slots=True)
class FailedReport:
    type: ClassVar[str] = "failed"
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    error: str
    retry: bool = True
    """False for failures no retry can fix (an unknown task, bad arguments)."""


@dataclass(frozen=True, slots=True)
class RescheduleReport:
    type: ClassVar[str] = "reschedule"
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    delay: float

    def __post_init__(self) -> None:
        check_delay("delay", self.delay)


@dataclass(frozen=True, slots=True)
class ReleaseReport:
    """A job the worker will not run (it arrived while draining); no attempt is counted."""

    type: ClassVar[str] = "release"
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    reason: str


@dataclass(frozen=True, slots=True)
class ReportAck:
    """Sent once the outcome is settled, so the worker may forget the report."""

    type: ClassVar[str] = "report_ack"
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    status: AckStatus


@dataclass(frozen=True, slots=True)
class Draining:
    type: ClassVar[str] = "draining"


@dataclass(frozen=True, slots=True)
class CancelJob:
    """The job under this lease was cancelled: stop running it. Its report, if any, will be
    acknowledged ``stale`` (the store already says ``cancelled``)."""

    type: ClassVar[str] = "cancel_job"
    job_id: uuid.UUID
    handoff_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """The worker's own view (``Worker.status()``) for operators; the main keeps the last one."""

    type: ClassVar[str] = "worker_status"
    status: dict[str, JSONValue]


@dataclass(frozen=True, slots=True)
class Ping:
    type: ClassVar[str] = "ping"
    nonce: int


@dataclass(frozen=True, slots=True)
class Pong:
    type: ClassVar[str] = "pong"
    nonce: int


@dataclass(frozen=True, slots=True)
class Error:
    """A connection-level error; after a fatal one the sender closes the connection."""

    type: ClassVar[str] = "error"
    code: str
    message: str
    fatal: bool


# --------------------------------------------------------------------------- client ↔ main


@dataclass(frozen=True, slots=True)
class JobRequest:
    """A :class:`~broker.jobs.JobSpec` as JSON; only ``task`` is required on the wire.

    ``run_at`` and ``delay`` are alternatives: ``delay`` is resolved against the
    main's clock, so a client with a skewed clock still gets the delay it asked for.
    """

    task: Name
    args: list[JSONValue] = field(default_factory=list)
    kwargs: dict[str, JSONValue] = field(default_factory=dict)
    queue: Name = DEFAULT_QUEUE
    priority: int = 0
    run_at: str | None = None
    delay: float | None = None
    max_attempts: int | None = None
    idempotency_key: Name | None = None
    concurrency_key: Name | None = None
    concurrency_limit: int | None = None
    timeout: float | None = None
    execution_mode: ExecutionMode = ExecutionMode.POOLED
    id: uuid.UUID | None = None
    unique_key: Name | None = None
    """At most one queued or running job per key; an older main ignores the field."""

    def to_spec(self, now: datetime) -> JobSpec:
        """Raises :class:`InvalidJobError`, which the main answers with ``invalid_job``."""
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
        # A field the request leaves out (None) takes the spec's default.
        values = {
            name: value
            for name in _SPEC_FIELDS
            if name != "run_at" and (value := getattr(self, name)) is not None
        }
        return JobSpec(**values, run_at=run_at)

    @classmethod
    def from_spec(cls, spec: JobSpec) -> JobRequest:
        values = spec_values(spec)
        values.update(args=list(spec.args), kwargs=dict(spec.kwargs))
        values["run_at"] = None if spec.run_at is None else spec.run_at.isoformat()
        return cls(**values)


_SPEC_FIELDS = tuple(f.name for f in fields(JobSpec))
"""What a :class:`JobRequest` passes on to its spec (``delay`` is resolved into ``run_at``)."""


@dataclass(frozen=True, slots=True)
class EnqueuedRef:
    job_id: uuid.UUID
    duplicate: bool
    """True when an existing job was returned instead: the holder of the same idempotency
    key, or the queued or running holder of the same unique key."""


@dataclass(frozen=True, slots=True)
class Enqueue:
    type: ClassVar[str] = "enqueue"
    request_id: Name
    jobs: list[JobRequest]


@dataclass(frozen=True, slots=True)
class EnqueuedReply:
    """One ref per requested job, in request order."""

    type: ClassVar[str] = "enqueued"
    request_id: str
    jobs: list[EnqueuedRef]


@dataclass(frozen=True, slots=True)
class GetJob:
    type: ClassVar[str] = "get_job"
    request_id: Name
    job_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class Cancel:
    type: ClassVar[str] = "cancel"
    request_id: Name
    job_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class JobInfo:
    """``job`` is :meth:`broker.jobs.Job.to_dict`, or null when no such job exists."""

    type: ClassVar[str] = "job_info"
    request_id: str
    job: dict[str, JSONValue] | None


@dataclass(frozen=True, slots=True)
class RequestError:
    """One request failed; unlike ``error`` it never closes the connection.

    ``details`` carries the fields of an exception that has some (the ``holder_id`` of a
    ``unique_key_taken``), so the client raises it whole (see :mod:`broker.error_codes`).
    """

    type: ClassVar[str] = "request_error"
    request_id: str
    code: str
    message: str
    details: dict[str, JSONValue] | None = None


MAX_LIST_LIMIT = 1000
"""The most jobs one ``list_jobs`` page may carry."""


@dataclass(frozen=True, slots=True)
class Retry:
    """Put a dead (``failed``) job back in the queue; answered with ``job_info``."""

    type: ClassVar[str] = "retry"
    request_id: Name
    job_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class Status:
    type: ClassVar[str] = "status"
    request_id: Name


@dataclass(frozen=True, slots=True)
class StatusInfo:
    """``status`` is the main's operator snapshot (``docs/reference/cli.md`` shows it)."""

    type: ClassVar[str] = "status_info"
    request_id: str
    status: dict[str, JSONValue]


@dataclass(frozen=True, slots=True)
class ListJobs:
    """One page of jobs, newest first; ``null`` filters match anything.

    Without ``include_payload`` each job comes without ``args``, ``kwargs`` and
    ``result`` (they may be megabytes each); ``get_job`` returns a job whole."""

    type: ClassVar[str] = "list_jobs"
    request_id: Name
    statuses: list[JobStatus] | None = None
    queues: list[Name] | None = None
    tasks: list[Name] | None = None
    limit: int = 50
    cursor: Name | None = None
    include_payload: bool = False

    def __post_init__(self) -> None:
        _check(1 <= self.limit <= MAX_LIST_LIMIT, f"limit must be 1-{MAX_LIST_LIMIT}")


@dataclass(frozen=True, slots=True)
class JobList:
    """``jobs`` are :meth:`broker.jobs.Job.to_dict` (without its payload fields unless the
    request asked for them); ``next_cursor`` is null on the last page."""

    type: ClassVar[str] = "job_list"
    request_id: str
    jobs: list[dict[str, JSONValue]]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class Prune:
    """Delete terminal jobs: those last updated over ``older_than_seconds`` ago, and those
    beyond the newest ``keep_latest``; ``statuses`` narrows which terminal statuses."""

    type: ClassVar[str] = "prune"
    request_id: Name
    older_than_seconds: float | None = None
    keep_latest: int | None = None
    statuses: list[JobStatus] | None = None

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
    :meth:`broker.operations.Operations.prune`."""
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


@dataclass(frozen=True, slots=True)
class Pruned:
    type: ClassVar[str] = "pruned"
    request_id: str
    deleted: int


Report: TypeAlias = CompletedReport | FailedReport | RescheduleReport | ReleaseReport
"""What a worker says of one lease's run; accepted only from the connection holding it."""

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
    | Retry
    | Status
    | StatusInfo
    | ListJobs
    | JobList
    | Prune
    | Pruned
)

MESSAGE_TYPES: Mapping[str, type[Message]] = {cls.type: cls for cls in typing.get_args(Message)}
"""Every message class by its tag: the decoder's dispatch table."""


# --------------------------------------------------------------------------- encode / decode

_T = TypeVar("_T")
_INT_RANGE = range(-(2**63), 2**63)
"""Integers must fit a signed 64-bit column in any store and any peer's language."""

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
    if cls in _FIELDS:
        return _FIELDS[cls]
    hints = typing.get_type_hints(cls, include_extras=True)
    _FIELDS[cls] = tuple(
        (
            f.name,
            hints[f.name],
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    )
    return _FIELDS[cls]


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
            try:
                check(where, loaded)
            except ValueError as exc:
                raise DecodeError(str(exc)) from None
        return loaded
    if origin is types.UnionType or origin is typing.Union:
        if value is None:
            return None
        (inner,) = (a for a in args if a is not type(None))
        return _load(value, inner, where, nullable=True)
    if origin is list and isinstance(value, list):
        return [_load(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict and isinstance(value, dict):
        return {
            _load(k, args[0], f"{where} key"): _load(v, args[1], f"{where}.{k}")
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return _build(typing.cast(type[Any], tp), value, where)
    try:
        return _load_leaf(value, tp)
    except (TypeError, ValueError, AttributeError) as exc:
        null = " or null" if nullable else ""
        raise DecodeError(f"{where} must be {exc}{null}, got {_describe(value)}") from None


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
    if origin is dict or dataclasses.is_dataclass(tp):
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


def _dump(value: Any, tp: Any) -> Any:
    """The JSON form of a field, driven by its annotation so payloads pass through as-is."""
    if value is None or tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _dump(value, args[0])
    if origin is types.UnionType or origin is typing.Union:
        (inner,) = (a for a in args if a is not type(None))
        return _dump(value, inner)
    if origin is list:
        return [_dump(v, args[0]) for v in value]
    if origin is dict:
        return {_dump(k, args[0]): _dump(v, args[1]) for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return {name: _dump(getattr(value, name), t) for name, t, _ in _fields(tp)}
    if tp is uuid.UUID:
        return str(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value).value
    return value


def encode(msg: Message) -> bytes:
    """One compact JSON line ending in ``\\n``.

    Raises ``ValueError`` if a payload (``args``, ``result``…) is not plain JSON, so
    the caller can report that instead of sending something the peer would reject.
    """
    body = {"type": msg.type, **_dump(msg, type(msg))}
    try:
        text = json.dumps(body, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot encode {msg.type} message: {exc}") from exc
    except RecursionError:
        # A payload nested ~1,000 deep: the caller's ValueError path (fail that job, skip
        # that field) must handle it, not let it escape and take down its loop.
        raise ValueError(f"cannot encode {msg.type} message: it nests too deeply") from None
    return text.encode("ascii") + b"\n"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text} is out of range")
    return number


def decode(line: bytes | str) -> Message:
    """Parse one line (with or without its newline) into a message.

    Raises :class:`DecodeError` (``code`` says which error code to reply with);
    ``msg_type`` and ``request_id`` are filled in when they could be read.
    """
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
