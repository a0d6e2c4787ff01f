"""The messages the main and its workers exchange, with no I/O.

Every message is a frozen :class:`msgspec.Struct` tagged by a ``type`` string;
:mod:`broker.wire.codec` turns one into a single NDJSON line and a line back into a
message (or a :class:`~broker.wire.codec.DecodeError` naming the offending field).
Keeping this free of sockets (as hypercorn keeps its HTTP state machines) lets the
main, the worker and the tests agree on the wire format without a network in sight.
``docs/protocol.md`` is the specification; this module is its executable form: the
handshake and the worker's messages are here, a client's requests and their replies in
:mod:`broker.wire.requests` (named here too, so :data:`Message` is every message), and
the field types they share in :mod:`broker.wire.fields`.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import secrets
import string
import typing
import uuid
from collections.abc import Mapping
from typing import Annotated, TypeAlias

import msgspec

from broker.jobs import DEFAULT_MAX_RETRIES, DEFAULT_QUEUE, ExecutionMode, JSONValue
from broker.model.bounds import MAX_LIST_ITEMS
from broker.model.rates import Rate, parse_rate
from broker.model.values import check_delay
from broker.payload import DEFAULT_MAX_PAYLOAD_DEPTH
from broker.wire.fields import Float, Int, Name, Names, Nested, Tagged, require
from broker.wire.requests import (
    ENQUEUE_EACH,
    MAX_LIST_LIMIT,
    TASK_DEFAULTS,
    Cancel,
    Enqueue,
    EnqueuedEach,
    EnqueuedRef,
    EnqueuedReply,
    EnqueueEach,
    GetJob,
    GetWorkflow,
    JobInfo,
    JobList,
    JobRequest,
    LimitQueue,
    ListJobs,
    ListTasks,
    PauseQueue,
    Prune,
    Pruned,
    QueueInfo,
    RequestError,
    ResumeQueue,
    Retry,
    RetryWorkflow,
    Status,
    StatusInfo,
    TaskList,
    WaitJob,
    WaitPending,
    WorkflowEdge,
    WorkflowInfo,
    WorkflowMember,
    WorkflowView,
    check_prune,
)

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
    INVALID_ARGUMENTS = "invalid_arguments"
    SCHEMA_VERSION = "schema_version"
    STORAGE_REJECTED = "storage_rejected"
    TASK_NOT_FOUND = "task_not_found"
    JOB_TIMEOUT = "job_timeout"
    RUNNER_CRASHED = "runner_crashed"
    PERMISSION_DENIED = "permission_denied"
    CHECKPOINT_REJECTED = "checkpoint_rejected"
    NOT_LEADER = "not_leader"
    DEPOSED = "deposed"
    UNAVAILABLE = "unavailable"
    CONNECTION_LOST = "connection_lost"
    JOB_FAILED = "job_failed"


# --------------------------------------------------------------------------- handshake


class LeaseRef(Nested, frozen=True):
    job_id: uuid.UUID
    handoff_id: uuid.UUID


class Challenge(Tagged, frozen=True, tag="challenge"):
    nonce: str
    protocol: Int
    auth_required: bool

    def __post_init__(self) -> None:
        require(
            bool(self.nonce) and all(c in string.hexdigits for c in self.nonce),
            "nonce must be a non-empty hex string",
        )


class Hello(Tagged, frozen=True, tag="hello"):
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
    prefetch_modes: Annotated[list[ExecutionMode], msgspec.Meta(max_length=MAX_LIST_ITEMS)] = (
        msgspec.field(default_factory=list)
    )
    """The modes whose prefetch window holds a job or more (it never shrinks): the last
    credit of such a mode is window room, never a free slot, so the main keeps it for a
    job that overtakes no waiting job (:class:`broker.core.peers.Credits`). ``[]`` (an
    older worker, or ``--prefetch 0``): every credit goes to the backlog."""

    def spoken(self) -> list[Int]:
        """The versions this peer speaks."""
        return [self.protocol] if self.protocols is None else self.protocols

    def __post_init__(self) -> None:
        if self.role == Role.WORKER:
            require(bool(self.worker_id), "worker_id is required for role worker")


class Welcome(Tagged, frozen=True, tag="welcome"):
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
    features: Names = msgspec.field(default_factory=list)
    """The optional requests this main answers beyond its protocol version's (today
    :data:`~broker.wire.requests.ENQUEUE_EACH`), so a client sends one only to a main that
    knows it: an older main sends none, and a request it does not know would be answered
    ``unknown_type``."""

    def __post_init__(self) -> None:
        require(
            math.isfinite(self.ping_interval) and self.ping_interval > 0,
            "ping_interval must be positive",
        )
        require(self.max_line_bytes > 0, "max_line_bytes must be positive")
        require(
            self.max_payload_bytes is None or self.max_payload_bytes > 0,
            "max_payload_bytes must be positive or null",
        )
        require(self.max_payload_depth > 0, "max_payload_depth must be positive")


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


class Ready(Tagged, frozen=True, tag="ready"):
    """Free slots per mode as of the ``job`` numbered ``seen``.

    ``seen`` is what makes credit exact: the main subtracts the jobs it sent after
    ``seen`` (the worker had not counted them yet), so a ``ready`` that crossed
    jobs on the wire can never grant more work than the worker has room for.
    """

    slots: dict[ExecutionMode, Int]
    seen: Int

    def __post_init__(self) -> None:
        for mode, free in self.slots.items():
            require(free >= 0, f"slots[{mode}] must not be negative")
        require(self.seen >= 0, "seen must not be negative")


class JobHandoff(Tagged, frozen=True, tag="job", omit_defaults=True):
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
    priority: Int = 0
    """The job's priority (higher first): a worker starts the jobs it holds in its prefetch
    window highest priority first (:mod:`broker.core.worker_state`), so an urgent job
    handed over after a backlog's never waits behind it. Left off the line at 0."""
    checkpoint: JSONValue = None
    """The last checkpoint the job's runs saved (meaningful when ``checkpoint_seq > 0``)."""
    checkpoint_seq: Int = 0
    """How many checkpoints the job's runs saved; 0: this attempt starts afresh."""
    recoveries: Int = 0
    """Attempts of this job lost before this one: more than 0 makes this one a recovery."""
    state_lost: bool = False
    """The job keeps local state, and this worker does not have it (see
    :attr:`broker.tasks.runner.Assignment.state_lost`)."""
    trace_context: dict[str, str] | None = None
    """The W3C trace context of the span that enqueued the job: the parent of its run's
    span (see ``docs/howto/tracing.md``)."""

    def __post_init__(self) -> None:
        require(self.seq >= 1, "seq must be at least 1")
        require(self.checkpoint_seq >= 0, "checkpoint_seq must not be negative")
        require(self.attempt >= 1, "attempt must be at least 1")
        require(self.max_attempts >= 1, "max_attempts must be at least 1")
        require(self.timeout is None or self.timeout > 0, "timeout must be positive")


class CompletedReport(Tagged, frozen=True, tag="completed"):
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    result: JSONValue = None


class FailedReport(Tagged, frozen=True, tag="failed"):
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


class RescheduleReport(Tagged, frozen=True, tag="reschedule"):
    job_id: uuid.UUID
    handoff_id: uuid.UUID
    delay: Float

    def __post_init__(self) -> None:
        check_delay("delay", self.delay)


class ReleaseReport(Tagged, frozen=True, tag="release"):
    """A job the worker will not run (it arrived while draining); no attempt is counted."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    reason: str


class SaveCheckpoint(Tagged, frozen=True, tag="checkpoint"):
    """A running job's checkpoint, numbered: the job's ``checkpoint_seq`` plus one for
    the first its run saves, and so on. Answered by ``checkpoint_ack`` once it is durable
    (or refused); the worker sends it again on a new connection until then."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    seq: Int
    state: JSONValue = None

    def __post_init__(self) -> None:
        require(self.seq >= 1, "seq must be at least 1")


class CheckpointAck(Tagged, frozen=True, tag="checkpoint_ack"):
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


class Progress(Tagged, frozen=True, tag="progress"):
    """A running job's latest progress; never answered, and may be dropped."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    fraction: Float
    message: str = ""

    def __post_init__(self) -> None:
        require(0.0 <= self.fraction <= 1.0, "fraction must be from 0 to 1")


class ReportAck(Tagged, frozen=True, tag="report_ack"):
    """Sent once the outcome is settled, so the worker may forget the report."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    status: AckStatus


class Draining(Tagged, frozen=True, tag="draining"):
    """The worker stopped taking jobs; it still sends the reports of those it runs."""


class CancelJob(Tagged, frozen=True, tag="cancel_job"):
    """The job under this lease was cancelled: stop running it. Its report, if any, will be
    acknowledged ``stale`` (the store already says ``cancelled``)."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID


ParameterKind: TypeAlias = typing.Literal[
    "positional_only", "positional_or_keyword", "var_positional", "keyword_only", "var_keyword"
]
"""The kinds of a function's parameters (``inspect.Parameter.kind``), as declared."""


class ParameterDeclaration(Nested, frozen=True):
    """One parameter of a task's function, as the main needs it to check a job's arguments
    (``inspect.Parameter``: its name, its kind, and whether it has no default)."""

    name: Name
    kind: ParameterKind
    required: bool = False


class TaskDeclaration(Nested, frozen=True):
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
    signature: list[ParameterDeclaration] | None = None
    """Every parameter of the function, in order, for the main to check a job's arguments
    at enqueue (``None``: a worker of a release before it, or a function without a
    signature; such a task's arguments are not checked at the main). Its size is bounded
    with the declaration's (:data:`~broker.model.bounds.MAX_DECLARATION_BYTES`)."""
    rate_limit: Name | None = None
    """``@task(rate_limit=...)``: ``"100/s"``, ``"600/m"`` or ``"1000/h"``, checked by
    :func:`broker.model.rates.parse_rate` (the bounds of a queue's limit); the main keeps
    a bucket for it (:mod:`broker.core.flow`). ``None``: no limit of its own."""
    rate_burst: Int | None = None
    """The limit's burst (``None`` without a limit, 1 if left out with one)."""
    rate_key: Name | None = None
    """``@task(rate_key=...)``: a template such as ``"{tenant}"``; the limit then holds
    for each key apart, the main filling each job's key from its arguments at enqueue
    when the request leaves it out. ``None``: the limit is the task's as a whole."""

    def __post_init__(self) -> None:
        if self.rate_limit is not None:
            self.limit()  # parse_rate's ValueError says what is expected
        require(
            self.rate_limit is not None or self.rate_burst is None,
            "rate_burst needs a rate_limit",
        )
        require(
            self.rate_limit is not None or self.rate_key is None,
            "rate_key needs a rate_limit",
        )
        require(self.max_attempts >= 1, "max_attempts must be at least 1")
        require(self.timeout is None or self.timeout > 0, "timeout must be positive")
        require(
            (self.concurrency_key is None) == (self.concurrency_limit is None),
            "concurrency_key and concurrency_limit go together",
        )

    def limit(self) -> Rate | None:
        """The task's rate limit (checked when the declaration was decoded)."""
        if self.rate_limit is None:
            return None
        return parse_rate(self.rate_limit, 1 if self.rate_burst is None else self.rate_burst)


class TaskCatalog(Tagged, frozen=True, tag="tasks"):
    """The tasks this worker serves, sent once right after ``welcome`` (not in ``hello``,
    whose line is capped at the pre-authentication limit, 64 KiB by default)."""

    tasks: list[TaskDeclaration]


class WorkerStatus(Tagged, frozen=True, tag="worker_status"):
    """The worker's own view (``Worker.status()``) for operators; the main keeps the last one."""

    status: dict[str, JSONValue]


class Ping(Tagged, frozen=True, tag="ping"):
    nonce: Int


class Pong(Tagged, frozen=True, tag="pong"):
    nonce: Int


class Error(Tagged, frozen=True, tag="error"):
    """A connection-level error; after a fatal one the sender closes the connection."""

    code: str
    message: str
    fatal: bool
    leader: str | None = None
    """With code ``not_leader``: the elected main's ``HOST:PORT`` for the peer to connect
    to instead (``None``: no main is elected yet; try the others)."""


Report: TypeAlias = CompletedReport | FailedReport | RescheduleReport | ReleaseReport
"""What a worker says of one lease's run; accepted only from the connection holding it."""


# --------------------------------------------------------------------------- batches (version 3)


class Jobs(Tagged, frozen=True, tag="jobs"):
    """Several ``job`` messages in one line (main to worker), in ``seq`` order.

    Each item is a whole ``job`` object, ``type`` included, so a batch line is its items
    encoded once each and joined (:func:`~broker.wire.codec.pack`), and a receiver
    handles a batch exactly as it would the same messages on separate lines."""

    jobs: list[JobHandoff]

    def __post_init__(self) -> None:
        require(bool(self.jobs), "jobs must not be empty")


class Reports(Tagged, frozen=True, tag="reports"):
    """Several outcomes in one line (worker to main), in outbox order."""

    reports: list[Report]

    def __post_init__(self) -> None:
        require(bool(self.reports), "reports must not be empty")


class ReportAcks(Tagged, frozen=True, tag="report_acks"):
    """Several ``report_ack`` messages in one line (main to worker)."""

    acks: list[ReportAck]

    def __post_init__(self) -> None:
        require(bool(self.acks), "acks must not be empty")


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
    | EnqueueEach
    | EnqueuedEach
    | GetJob
    | WaitJob
    | WaitPending
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
    | PauseQueue
    | ResumeQueue
    | LimitQueue
    | QueueInfo
    | GetWorkflow
    | RetryWorkflow
    | WorkflowInfo
)

for _cls in typing.get_args(Message):
    _cls.type = typing.cast(str, _cls.__struct_config__.tag)

MESSAGE_TYPES: Mapping[str, type[Message]] = {cls.type: cls for cls in typing.get_args(Message)}
"""Every message class by its tag: the walker's dispatch table."""


# The requests are named here too, so a module that speaks the protocol imports one module.
__all__ = [
    "DEFAULT_PORT",
    "ENQUEUE_EACH",
    "MAX_LIST_LIMIT",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "SUPPORTED_PROTOCOLS",
    "TASK_DEFAULTS",
    "AckStatus",
    "Batch",
    "Cancel",
    "CancelJob",
    "Challenge",
    "CheckpointAck",
    "CompletedReport",
    "Draining",
    "Enqueue",
    "EnqueueEach",
    "EnqueuedEach",
    "EnqueuedRef",
    "EnqueuedReply",
    "Error",
    "ErrorCode",
    "FailedReport",
    "GetJob",
    "GetWorkflow",
    "Hello",
    "JobHandoff",
    "JobInfo",
    "JobList",
    "JobRequest",
    "Jobs",
    "LeaseRef",
    "LimitQueue",
    "ListJobs",
    "ListTasks",
    "Message",
    "ParameterDeclaration",
    "PauseQueue",
    "Ping",
    "Pong",
    "Progress",
    "Prune",
    "Pruned",
    "QueueInfo",
    "Ready",
    "ReleaseReport",
    "Report",
    "ReportAck",
    "ReportAcks",
    "Reports",
    "RequestError",
    "RescheduleReport",
    "ResumeQueue",
    "Retry",
    "RetryWorkflow",
    "Role",
    "SaveCheckpoint",
    "Status",
    "StatusInfo",
    "TaskCatalog",
    "TaskDeclaration",
    "TaskList",
    "WaitJob",
    "WaitPending",
    "Welcome",
    "WorkerStatus",
    "WorkflowEdge",
    "WorkflowInfo",
    "WorkflowMember",
    "WorkflowView",
    "check_proof",
    "check_prune",
    "choose_protocol",
    "make_nonce",
    "make_proof",
]
