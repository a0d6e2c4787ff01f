"""The messages between a client and the main: each request and the reply that answers
it (``docs/protocol.md``, *Client ↔ main*).

A request carries a ``request_id`` its reply (or a ``request_error``) names, so a
client may have several in flight on one connection. :class:`JobRequest` is a
:class:`~broker.jobs.JobSpec` as JSON, mapped to and from the spec by field name.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Collection, Mapping
from datetime import datetime, timedelta
from typing import Annotated, Any

import msgspec

from broker.dependencies import WorkflowStatus
from broker.exceptions import InvalidJobError
from broker.jobs import (
    SPEC_DEFAULTS,
    SPEC_FIELDS,
    TERMINAL_STATUSES,
    ExecutionMode,
    JobSpec,
    JobStatus,
    JSONValue,
    ParentFailure,
    ParentResults,
    spec_fields,
)
from broker.model.bounds import (
    MAX_AGE_SECONDS,
    MAX_LIST_ITEMS,
    MAX_PARENTS,
    MAX_WAIT_SECONDS,
    MAX_WORKFLOW_EDGES,
    MAX_WORKFLOW_MEMBERS,
)
from broker.model.rates import Rate, parse_rate
from broker.model.values import check_delay
from broker.wire.fields import Float, Int, Name, Names, Nested, Tagged, require


class JobRequest(Nested, frozen=True, omit_defaults=True):
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
    depends_on: Annotated[tuple[uuid.UUID, ...], msgspec.Meta(max_length=MAX_PARENTS)] = ()
    """Jobs that must end first (see :mod:`broker.dependencies`); an older main refuses
    nothing but ignores it, so a client checks the main's version before relying on it."""
    on_parent_failure: ParentFailure = ParentFailure.CANCEL
    parent_results: ParentResults = ParentResults.NONE
    workflow_id: uuid.UUID | None = None
    trace_context: dict[str, str] | None = None
    """The W3C trace context (``traceparent``, ``tracestate``) of the span that enqueued
    the job; an older main ignores the field."""
    rate_key: Name | None = None
    """The job's key for its task's per-key rate limit, filled by a client that has the
    task; left out, the main fills it from the task's declared template
    (:mod:`broker.core.catalog`). An older main ignores the field."""

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
        # Positionally: by keyword (a dict of the fields said) a bulk enqueue's main spent
        # twice as long here, every job passing; and only where a default is not None
        # (half the fields), the task's first, so a spec's default fills only what the
        # task's left.
        fills = _FILLS
        if defaults:
            tasks = [(_REQUESTED_AT[n], v) for n, v in defaults.items() if v is not None]
            fills = (*tasks, *_FILLS)
        values = list(_requested(self))
        for at, default in fills:
            if values[at] is None:
                values[at] = default
        values.insert(_RUN_AT, run_at)
        return JobSpec(*values)

    @classmethod
    def from_spec(cls, spec: JobSpec, *, said: Collection[str] | None = None) -> JobRequest:
        """The request for ``spec``; with ``said``, a field the task's defaults may fill
        (:data:`TASK_DEFAULTS`) is sent only if named there, so a job enqueued by name
        takes the task's declared defaults for the rest."""
        # Positionally, in the order checked below the class: a bulk enqueue's client
        # builds one per job, and by keywords (a dict of the spec's fields) that cost
        # three times as much. A job enqueued by name takes the same path, its fields
        # left to the task blanked by position: 3.5 us a request where the keywords
        # took 9 (issue 35, one enqueue at a time).
        v: tuple[Any, ...] | list[Any] = spec_fields(spec)
        if said is not None:
            v = list(v)
            for at, name in _TASK_DEFAULT_AT:
                if name not in said:
                    v[at] = None
        run_at = None if v[5] is None else v[5].isoformat()
        return cls(v[0], list(v[1]), dict(v[2]), v[3], v[4], run_at, None, *v[6:])


TASK_DEFAULTS = (
    "queue",
    "priority",
    "max_attempts",
    "timeout",
    "execution_mode",
    "concurrency_key",
    "concurrency_limit",
    "unique_key",
    "rate_key",
)
"""The job fields a task's declaration fills in when an enqueue by name leaves them out."""
_TASK_DEFAULT_AT = tuple((SPEC_FIELDS.index(name), name) for name in TASK_DEFAULTS)
"""Where each of :data:`TASK_DEFAULTS` stands among a spec's fields."""


if JobRequest.__struct_fields__ != (*SPEC_FIELDS[:6], "delay", *SPEC_FIELDS[6:]):
    raise ImportError("JobRequest's fields must be JobSpec's, with delay after run_at")
_REQUESTED = tuple(name for name in SPEC_FIELDS if name != "run_at")
"""The spec fields a request carries as they are (its ``run_at`` is text, or a ``delay``)."""
_requested = operator.attrgetter(*_REQUESTED)
_REQUESTED_AT = {name: i for i, name in enumerate(_REQUESTED)}
_FALLBACK = tuple(d for name, d in zip(SPEC_FIELDS, SPEC_DEFAULTS, strict=True) if name != "run_at")
"""The spec's default for each of :data:`_REQUESTED`, in order."""
_FILLS = tuple((at, default) for at, default in enumerate(_FALLBACK) if default is not None)
"""Where a request's ``None`` takes the spec's default (elsewhere the default is ``None``)."""
_RUN_AT = SPEC_FIELDS.index("run_at")


class EnqueuedRef(Nested, frozen=True):
    job_id: uuid.UUID
    duplicate: bool
    """True when an existing job was returned instead: the holder of the same idempotency
    key, or the queued or running holder of the same unique key."""


class Enqueue(Tagged, frozen=True, tag="enqueue"):
    request_id: Name
    jobs: list[JobRequest]
    allow_unknown_tasks: bool = False
    """Store jobs of tasks no worker has declared yet (a deliberate cold start); by
    default such an enqueue is refused with ``unknown_task``."""


class EnqueuedReply(Tagged, frozen=True, tag="enqueued"):
    """One ref per requested job, in request order."""

    request_id: str
    jobs: list[EnqueuedRef]


class EnqueueEach(Tagged, frozen=True, tag="enqueue_each"):
    """One job of ``job``'s task and options for each of ``arg_sets`` (with the keyword
    arguments at the same place in ``kwarg_sets``, if given: as many), stored all or
    none; answered with ``enqueued_each``, the new jobs' ids in order.

    A bulk enqueue of one task with many argument sets, as PgQueuer's list-taking
    ``enqueue`` is one: the task and its options travel, and are checked, once, and the
    main builds no :class:`~broker.jobs.JobSpec` per job (it decodes the request into a
    :class:`~broker.jobs.SpecColumns`). ``job`` carries no ``args`` or ``kwargs`` of its
    own, and no option that names one job (``idempotency_key``, ``unique_key``) or links
    it (``depends_on``, ``workflow_id``): each is refused ``invalid_job``. Its ``id``, if
    any, is not used: each job gets a fresh one. Only a main
    whose ``welcome.features`` lists ``enqueue_each`` knows this request (an older one
    answers ``unknown_type``); a client asks an older one with ``enqueue`` instead.

    Bounded as every client request is: the line by ``max_line_bytes``, and the jobs by
    the container bound (each argument set is a list, each keyword set an object), both
    counted on the line's bytes before anything in it is built."""

    request_id: Name
    job: JobRequest
    arg_sets: list[tuple[JSONValue, ...]]
    kwarg_sets: list[dict[str, JSONValue]] | None = None
    allow_unknown_tasks: bool = False


class EnqueuedEach(Tagged, frozen=True, tag="enqueued_each"):
    """The jobs of an ``enqueue_each``, in its order: each is a new job (no key names
    one), so it needs no ``duplicate`` flag, unless its task declares keys made from each
    job's arguments (then each went the way of an ``enqueue``, and an active holder of
    its unique key is returned in its place)."""

    request_id: str
    job_ids: list[uuid.UUID]


ENQUEUE_EACH = "enqueue_each"
"""The feature a main lists in ``welcome.features`` when it answers :class:`EnqueueEach`."""


class GetJob(Tagged, frozen=True, tag="get_job"):
    request_id: Name
    job_id: uuid.UUID


class GetWorkflow(Tagged, frozen=True, tag="get_workflow"):
    """A workflow's members and edges; answered with ``workflow_info``."""

    request_id: Name
    workflow_id: uuid.UUID


class RetryWorkflow(Tagged, frozen=True, tag="retry_workflow"):
    """Queue a workflow's dead members again, and make the dependents they cancelled wait
    for them again (:func:`broker.dependencies.retry_plan`); answered with
    ``workflow_info``, the workflow as it stands after."""

    request_id: Name
    workflow_id: uuid.UUID


class WorkflowMember(Nested, frozen=True):
    """One job of a workflow, as a workflow view shows it."""

    job_id: uuid.UUID
    task: str
    status: JobStatus
    attempts: int
    error: str | None = None
    """The first line of its ``last_error``, cut to ``WORKFLOW_ERROR_CHARS``."""


class WorkflowEdge(Nested, frozen=True):
    """``child`` waits for ``parent`` (``done``: the parent's end has been counted)."""

    parent: uuid.UUID
    child: uuid.UUID
    done: bool


class WorkflowView(Nested, frozen=True):
    """A workflow: its id, its status (``running`` while a member has not ended, then
    ``completed``, ``failed`` or ``cancelled``, :func:`broker.dependencies.workflow_status`),
    its members (parents first, else in enqueue order) and edges; ``truncated``: more
    members or edges exist than a view carries."""

    workflow_id: uuid.UUID
    status: WorkflowStatus
    members: Annotated[list[WorkflowMember], msgspec.Meta(max_length=MAX_WORKFLOW_MEMBERS)]
    edges: Annotated[list[WorkflowEdge], msgspec.Meta(max_length=MAX_WORKFLOW_EDGES)]
    truncated: bool = False

    def member(self, job_id: uuid.UUID) -> WorkflowMember | None:
        return next((m for m in self.members if m.job_id == job_id), None)

    def parents(self, job_id: uuid.UUID) -> list[uuid.UUID]:
        """The parents of ``job_id`` among the edges, in ``depends_on`` order."""
        return [e.parent for e in self.edges if e.child == job_id]


class WorkflowInfo(Tagged, frozen=True, tag="workflow_info"):
    """``workflow`` is null when no job carries that workflow id."""

    request_id: str
    workflow: WorkflowView | None


class Cancel(Tagged, frozen=True, tag="cancel"):
    request_id: Name
    job_id: uuid.UUID


class WaitJob(Tagged, frozen=True, tag="wait_job"):
    """Answer when the job has ended: ``job_info`` with the job once it is terminal (or
    ``null`` if there is no such job), or ``wait_pending`` if ``timeout`` seconds pass
    first. The main subscribes before it reads the job, so an end in between is not
    missed (:mod:`broker.core.waiters`)."""

    request_id: Name
    job_id: uuid.UUID
    timeout: Float = 60.0

    def __post_init__(self) -> None:
        require(
            0 <= self.timeout <= MAX_WAIT_SECONDS,
            f"timeout must be 0-{MAX_WAIT_SECONDS:g} seconds",
        )


class WaitPending(Tagged, frozen=True, tag="wait_pending"):
    """The ``wait_job``'s ``timeout`` passed and the job has not ended yet."""

    request_id: str


class JobInfo(Tagged, frozen=True, tag="job_info"):
    """``job`` is :meth:`broker.jobs.Job.to_dict`, or null when no such job exists."""

    request_id: str
    job: dict[str, JSONValue] | None


class RequestError(Tagged, frozen=True, tag="request_error"):
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


class Retry(Tagged, frozen=True, tag="retry"):
    """Put a dead (``failed``) job back in the queue; answered with ``job_info``."""

    request_id: Name
    job_id: uuid.UUID


class Status(Tagged, frozen=True, tag="status"):
    request_id: Name


class StatusInfo(Tagged, frozen=True, tag="status_info"):
    """``status`` is the main's operator snapshot (``docs/reference/cli.md`` shows it)."""

    request_id: str
    status: dict[str, JSONValue]


class ListJobs(Tagged, frozen=True, tag="list_jobs"):
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
        require(1 <= self.limit <= MAX_LIST_LIMIT, f"limit must be 1-{MAX_LIST_LIMIT}")


class JobList(Tagged, frozen=True, tag="job_list"):
    """``jobs`` are :meth:`broker.jobs.Job.to_dict` (without its payload fields unless the
    request asked for them); ``next_cursor`` is null on the last page."""

    request_id: str
    jobs: list[dict[str, JSONValue]]
    next_cursor: str | None


class ListTasks(Tagged, frozen=True, tag="list_tasks"):
    """The task catalog: every task a worker has declared; answered with ``task_list``."""

    request_id: Name


class TaskList(Tagged, frozen=True, tag="task_list"):
    """One entry per task and worker that declared it: ``task``, ``worker_id``,
    ``seen_at`` (ISO-8601) and ``declaration`` (a ``TaskDeclaration``), by task name."""

    request_id: str
    tasks: list[dict[str, JSONValue]]


class Prune(Tagged, frozen=True, tag="prune"):
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
    require(
        older_than_seconds is not None or keep_latest is not None,
        "give older_than_seconds or keep_latest (or both)",
    )
    require(
        older_than_seconds is None or 0 <= older_than_seconds <= MAX_AGE_SECONDS,
        f"older_than_seconds must be from 0 to {MAX_AGE_SECONDS} (a hundred years)",
    )
    require(keep_latest is None or keep_latest >= 0, "keep_latest must not be negative")
    require(
        statuses is None or all(s in TERMINAL_STATUSES for s in statuses),
        "statuses must be terminal (completed, failed, cancelled)",
    )


class Pruned(Tagged, frozen=True, tag="pruned"):
    request_id: str
    deleted: Int


class PauseQueue(Tagged, frozen=True, tag="pause_queue"):
    """Dispatch no more jobs of ``queue`` (its running jobs finish; new ones are stored and
    wait); kept in the store, so it outlives the main. Answered with ``queue_info``."""

    request_id: Name
    queue: Name


class ResumeQueue(Tagged, frozen=True, tag="resume_queue"):
    """Dispatch ``queue``'s jobs again, at once. Answered with ``queue_info``."""

    request_id: Name
    queue: Name


class LimitQueue(Tagged, frozen=True, tag="limit_queue"):
    """Dispatch at most ``rate`` (``"50/s"``, ``"600/m"``, ``"100/h"``) of ``queue``'s jobs,
    and ``burst`` at once after a quiet spell; ``rate`` ``null`` clears the limit. Kept in
    the store. Answered with ``queue_info``."""

    request_id: Name
    queue: Name
    rate: Name | None
    burst: Int = 1

    def __post_init__(self) -> None:
        if self.rate is not None:
            parse_rate(self.rate, self.burst)  # its ValueError says what is expected

    def limit(self) -> Rate | None:
        """The rate asked for (checked when the message was decoded)."""
        return None if self.rate is None else parse_rate(self.rate, self.burst)


class QueueInfo(Tagged, frozen=True, tag="queue_info"):
    """A queue's settings after the change: ``queue``, ``paused`` (bool), ``rate_limit``
    (``"50/s"`` or null) and ``rate_burst`` (null without a limit)."""

    request_id: str
    queue: dict[str, JSONValue]
