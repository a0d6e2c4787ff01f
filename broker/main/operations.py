"""The client requests, written once: enqueue, get, list, cancel, retry, prune, status.

Two fronts apply them: the main, answering its clients' messages, and the operator
CLI when the main is down, working on the store directly (``broker.ops.admin``). Both go
through :class:`Operations`, so a job refused by one is refused by the other, and a
listing is paged the same way. The service holds the store, the clock and the limits;
it knows no socket and no message. It returns domain values (jobs, counts, pages)
and raises the exceptions of :mod:`broker.exceptions`; the caller turns them into
replies. What only a running main can do (stop a cancelled job on its worker, wake
the dispatcher, describe its workers) stays with the main.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

import msgspec

from broker import dependencies
from broker.core.why import undeclared
from broker.exceptions import ConfigurationError
from broker.jobs import (
    Clock,
    EnqueueResult,
    Job,
    JobSpec,
    JobStatus,
    JSONValue,
    SpecColumns,
    keyword_sets,
    summary_dict,
)
from broker.main.catalog import StoredCatalog
from broker.main.metrics import MainMetrics
from broker.model.bounds import MAX_WORKFLOW_EDGES, MAX_WORKFLOW_MEMBERS, WORKFLOW_ERROR_CHARS
from broker.payload import check_args, check_columns, encoded_size
from broker.storage import (
    JobFilter,
    QueueCount,
    StorageAdapter,
    StoredWorkflow,
    SupportsEnqueueColumns,
    SupportsWorkflows,
    TaskRecord,
)
from broker.wire import messages as protocol


class Limits(Protocol):
    """The limits the requests obey; ``broker.main.settings.MainSettings`` is one."""

    @property
    def max_payload_bytes(self) -> int | None:
        """Largest args + kwargs of a job as JSON; ``None``: no limit."""

    @property
    def max_payload_depth(self) -> int:
        """How many lists and objects deep each argument may nest."""

    @property
    def max_payload_containers(self) -> int:
        """How many lists and objects a job's args and kwargs may hold together."""

    @property
    def max_line_bytes(self) -> int:
        """Longest protocol line: every job must fit in one ``job`` message."""

    @property
    def list_page_bytes(self) -> int:
        """About how many bytes of jobs one listing page may carry."""


@dataclass(frozen=True, slots=True)
class JobListing:
    """One page of a listing: each job as ``Job.to_dict()`` shows it (without its payload
    unless asked for), newest first, and the cursor of the next page (``None``: last)."""

    jobs: list[dict[str, JSONValue]]
    next_cursor: str | None


EACH_CHUNK = 1000
"""Jobs of an ``enqueue_each`` made and checked at a time, as many as the SQL store's
column insert writes in one statement: a store writing one chunk while the next is
checked (:meth:`Operations.enqueue_each`)."""

WAITING_TASKS_CHECKED = 50
"""Tasks without a connected worker that a status looks for queued jobs of, at most (a
read each)."""


@dataclass(frozen=True, slots=True)
class LiveState:
    """What only a running main knows, for :meth:`Operations.status`."""

    main_id: str
    role: str
    """Its :class:`~broker.core.election.MainRole`: ``leader`` for a main that answers a client."""
    leader: str | None
    """The leader's address as this main knows it (its own, when it leads)."""
    dispatched: int
    orphans: int
    workers: list[dict[str, Any]]
    pending_recoveries: list[dict[str, Any]]
    unserved_tasks: list[str] = field(default_factory=list)
    """Tasks of the catalog that no connected worker declares
    (:meth:`Handoff.unserved <broker.core.handoff.Handoff.unserved>`): their queued jobs
    wait."""
    queue_settings: list[dict[str, Any]] = field(default_factory=list)
    """The queues paused or rate limited (:meth:`broker.main.queues.QueueControl.status`)."""


class Operations:
    def __init__(
        self,
        store: StorageAdapter,
        limits: Limits,
        *,
        clock: Clock,
        enqueue: Callable[[list[JobSpec]], Awaitable[list[EnqueueResult]]] | None = None,
        metrics: MainMetrics | None = None,
    ) -> None:
        """``enqueue`` writes checked jobs, all or none (default: the store's
        ``enqueue_many``); the main passes its group commit, which may also hand jobs off
        at once. ``metrics``: the main's counters (jobs enqueued and cancelled); ``None``
        in the CLI's fallback."""
        self.store = store
        self.limits = limits
        self._clock = clock
        self._enqueue = enqueue or store.enqueue_many
        self._metrics = metrics
        self.catalog = StoredCatalog(store)
        """The task catalog: the defaults of jobs enqueued by name (:mod:`broker.core.catalog`)."""

    async def enqueue(
        self, requests: Sequence[protocol.JobRequest], *, allow_unknown_tasks: bool = False
    ) -> list[EnqueueResult]:
        """Store the requested jobs, all or none, in request order. Each takes its task's
        declared defaults where the request says nothing, and a task no worker has
        declared is refused unless ``allow_unknown_tasks`` (see :mod:`broker.core.catalog`).
        Every job is checked before any is stored (see :meth:`check_payload`); a
        ``delay`` runs from this service's clock, so a client's skewed clock does not
        matter."""
        now = self._clock()
        catalog = self.catalog
        await catalog.load()
        if not allow_unknown_tasks and catalog.in_use:
            # Only a name this copy does not know costs a read, of that name's rows alone.
            await catalog.refresh({r.task for r in requests if catalog.declared(r.task) is None})
        specs = [
            self.catalog.job_spec(request, now, allow_unknown=allow_unknown_tasks)
            for request in requests
        ]
        for spec in specs:
            self.check_payload(spec)
        results = await self._enqueue(specs)
        if self._metrics is not None:  # one increment per (queue, task), not per job
            # A job written is its spec's (reading the result's job would build it). A
            # plain dict: a Counter of a generator cost a one-job enqueue 2-3 times as much.
            counted: dict[tuple[str, str], int] = {}
            for spec, result in zip(specs, results, strict=True):
                if not result.duplicate:
                    key = (spec.queue, spec.task)
                    counted[key] = counted.get(key, 0) + 1
            for (queue, task), n in counted.items():
                self._metrics.enqueued.inc(queue, task, n)
        return results

    async def enqueue_each(
        self,
        template: protocol.JobRequest,
        arg_sets: Sequence[Sequence[JSONValue]],
        kwarg_sets: Sequence[Mapping[str, JSONValue]] | None = None,
        *,
        allow_unknown_tasks: bool = False,
    ) -> list[uuid.UUID]:
        """Store one job of ``template``'s task and options for each of ``arg_sets`` (and
        ``kwarg_sets``), all or none; the new jobs' ids, in order.

        The template goes through the catalog once (:meth:`Catalog.job_template
        <broker.core.catalog.Catalog.job_template>`) and the jobs stay columns, made and
        checked :data:`EACH_CHUNK` at a time (their arguments, the declared signature,
        each job's payload as :meth:`check_payload` checks a spec's) as a store that
        writes columns (:class:`~broker.storage.SupportsEnqueueColumns`) takes them: on
        PostgreSQL each chunk while the chunk before is written, where checking every
        job first left the store idle meanwhile (bench/README.md, "Bulk enqueue through
        the main by column"). They pass by the group commit and the hand-off at
        enqueue: the caller (the main) tells the dispatcher, as of another process's
        insert. A store without columns, or a task whose keys are made from each job's
        arguments, gets the same jobs one spec each, the way :meth:`enqueue` stores
        them.

        :raises InvalidJobError: (and its kinds) a job or the template is refused;
            nothing is stored.
        """
        now = self._clock()
        catalog = self.catalog
        await catalog.load()
        task = template.task
        if not allow_unknown_tasks and catalog.in_use and catalog.declared(task) is None:
            await catalog.refresh({task})
        each = catalog.job_template(template, now, allow_unknown=allow_unknown_tasks)
        kwargs = keyword_sets(len(arg_sets), kwarg_sets)
        if each is None:  # keys per job: each job as its own request
            requests = [
                msgspec.structs.replace(template, args=list(a), kwargs=dict(k), id=None)
                for a, k in zip(arg_sets, kwargs, strict=True)
            ]
            results = await self.enqueue(requests, allow_unknown_tasks=allow_unknown_tasks)
            return [result.job_id for result in results]
        limits = self.limits

        def chunks() -> Iterator[SpecColumns]:
            for at in range(0, len(arg_sets), EACH_CHUNK):
                jobs = each.columns(
                    arg_sets[at : at + EACH_CHUNK],
                    None if kwarg_sets is None else kwargs[at : at + EACH_CHUNK],
                )
                check_columns(
                    jobs,
                    limits.max_payload_bytes,
                    limits.max_payload_depth,
                    limits.max_payload_containers,
                )
                yield jobs

        count = len(arg_sets)
        if isinstance(self.store, SupportsEnqueueColumns):
            ids = await self.store.enqueue_columns(chunks(), count)
        else:
            specs = [spec for jobs in chunks() for spec in jobs.specs()]
            ids = [result.job_id for result in await self._enqueue(specs)]
        if self._metrics is not None and ids:
            self._metrics.enqueued.inc(each.spec.queue, task, len(ids))
        return ids

    def check_payload(self, spec: JobSpec) -> None:
        """Refuse a job nested too deeply, with too many lists and objects, or over the
        payload limit. A request from a peer was already held to the container bound
        as it was read (:attr:`broker.wire.framing.LineReader.max_containers`), so the walk here
        is short. Its job message always fits in a line: the line limit exceeds the
        payload limit by 64 KiB (``MainSettings.validate``), and every name in it is at
        most 1024 bytes."""
        check_args(
            spec,
            self.limits.max_payload_bytes,
            self.limits.max_payload_depth,
            self.limits.max_payload_containers,
        )

    async def tasks(self) -> list[TaskRecord]:
        """The task catalog: every task and worker that declared it."""
        await self.catalog.load()
        return self.catalog.records()

    async def get(self, job_id: uuid.UUID) -> Job | None:
        return await self.store.get_job(job_id)

    async def cancel(self, job_id: uuid.UUID) -> Job | None:
        """Cancel a queued or running job; one that has ended comes back unchanged. A
        running job's worker is the caller's to tell (the store has fenced its lease)."""
        if self._metrics is None:
            return await self.store.cancel(job_id)
        # Read first, so the count is of jobs this request cancelled, not of requests
        # (cancels are rare operator actions: the extra read costs nothing that matters).
        before = await self.store.get_job(job_id)
        job = await self.store.cancel(job_id)
        if (
            job is not None
            and job.status is JobStatus.CANCELLED
            and before is not None
            and before.status.is_active
        ):
            self._metrics.cancelled.inc(job.queue, job.task)
        return job

    async def retry(self, job_id: uuid.UUID) -> Job | None:
        """Queue a dead (``failed``) job again with a fresh attempt count; a job in any
        other status comes back unchanged."""
        return await self.store.retry_dead(job_id)

    def _workflows(self) -> SupportsWorkflows:
        if not isinstance(self.store, SupportsWorkflows):
            raise ConfigurationError(
                f"this store ({type(self.store).__name__}) cannot read or retry a workflow "
                "whole (it does not implement SupportsWorkflows); read its jobs one by one"
            )
        return self.store

    async def get_workflow(self, workflow_id: uuid.UUID) -> protocol.WorkflowView | None:
        """The workflow's members and edges, bounded (``MAX_WORKFLOW_MEMBERS``); ``None``
        when no job carries that workflow id."""
        stored = await self._workflows().get_workflow(workflow_id, limit=MAX_WORKFLOW_MEMBERS)
        return None if stored is None else workflow_view(stored)

    async def retry_workflow(self, workflow_id: uuid.UUID) -> protocol.WorkflowView | None:
        """Retry the workflow's dead members (:meth:`SupportsWorkflows.retry_workflow`);
        the workflow as it then stands."""
        await self._workflows().retry_workflow(workflow_id)
        return await self.get_workflow(workflow_id)

    async def list_jobs(
        self,
        job_filter: JobFilter,
        *,
        limit: int,
        cursor: str | None,
        include_payload: bool,
        reply_bytes: int = 0,
    ) -> JobListing:
        """One page of at most ``limit`` jobs and about ``list_page_bytes``, and its cursor.

        ``reply_bytes`` is the size of the reply carrying no jobs (the ``null`` of its
        cursor counted), so jobs, cursor and reply together fit in ``max_line_bytes``.

        Each job's encoded size is measured once, as it is added (the reply is never encoded
        whole to find out it is too big); the page ends where the budget runs out, with a
        cursor right after its last job, so a reply never exceeds a line and no job is lost
        between pages. Payloads are read only when asked for, and then a few rows
        per read, so one request never holds many large jobs in memory and the loop gets a
        turn between reads (one request with 1 MiB arguments and limit 1000 used to take
        1.65 GB and block the loop for 15 s).

        :raises ValueError: ``cursor`` is not one this store wrote.
        """
        room = self.limits.max_line_bytes - reply_bytes
        budget = min(self.limits.list_page_bytes, room)
        rows_per_read = limit if not include_payload else self._payload_rows_per_read()
        entries: list[dict[str, JSONValue]] = []
        used = 0
        while len(entries) < limit:
            page = await self.store.list_jobs(
                job_filter,
                limit=min(limit - len(entries), rows_per_read),
                cursor=cursor,
                include_payload=include_payload,
            )
            for job in page.jobs:
                entry = job.to_dict() if include_payload else summary_dict(job)
                cost = encoded_size(entry) + 1  # and its comma
                after = self.store.cursor_after(job)
                tail = encoded_size(after)
                if used + cost + tail > budget:
                    if entries:  # full: the next page starts with this job
                        return JobListing(entries, cursor)
                    if include_payload and cost + tail > room:
                        # Too big for a line even alone: list it without its payload
                        # (get_job has it) rather than stop every later page here.
                        entry = {**summary_dict(job), "payload_omitted": True}
                        cost = encoded_size(entry) + 1
                entries.append(entry)
                used += cost
                cursor = after
            cursor = page.next_cursor
            if cursor is None:
                break
        return JobListing(entries, cursor)

    def _payload_rows_per_read(self) -> int:
        """How many rows a payload listing reads at once: as many as fit in the page
        budget when every row is at the payload limit (args, kwargs and a result)."""
        limit = self.limits.max_payload_bytes
        if limit is None:
            return 1
        return max(1, self.limits.list_page_bytes // (2 * limit))

    async def prune(
        self,
        *,
        older_than_seconds: float | None,
        keep_latest: int | None,
        statuses: Collection[JobStatus] | None,
    ) -> int:
        """Delete terminal jobs last updated over ``older_than_seconds`` ago, and those
        beyond the newest ``keep_latest``; returns how many went.

        :raises ValueError: the arguments break the rule of ``protocol.check_prune``.
        """
        protocol.check_prune(older_than_seconds, keep_latest, statuses)
        cutoff = (
            None
            if older_than_seconds is None
            else self._clock() - timedelta(seconds=older_than_seconds)
        )
        return await self.store.prune(older_than=cutoff, keep_latest=keep_latest, statuses=statuses)

    async def status(self, live: LiveState | None = None) -> dict[str, Any]:
        """A JSON-ready snapshot for operators (``broker status``): job counts per queue,
        and from a running main (``live``) its workers and pending recoveries; without
        one those keys are ``None``. The shape is documented in ``docs/reference/cli.md``.
        """
        queues = queue_summary(await self.store.count_jobs(), self._clock())
        return {
            "main_id": None if live is None else live.main_id,
            "role": None if live is None else live.role,
            "leader": None if live is None else live.leader,
            "dispatched": None if live is None else live.dispatched,
            "orphans": None if live is None else live.orphans,
            "queues": queues,
            "workers": None if live is None else live.workers,
            "pending_recoveries": None if live is None else live.pending_recoveries,
            "waiting": None if live is None else await self._waiting(live.unserved_tasks),
            "queue_settings": None if live is None else live.queue_settings,
        }

    async def _waiting(self, unserved: Sequence[str]) -> list[dict[str, Any]]:
        """The tasks whose queued jobs wait because no connected worker declares them
        (routing by task, :mod:`broker.core.placement`), each with why: one read per task,
        for at most :data:`WAITING_TASKS_CHECKED` of them, so a status stays cheap."""
        waiting: list[dict[str, Any]] = []
        for task in unserved[:WAITING_TASKS_CHECKED]:
            queued = JobFilter(statuses=[JobStatus.QUEUED], tasks=[task])
            page = await self.store.list_jobs(queued, limit=1, include_payload=False)
            if page.jobs:
                waiting.append({"task": task, "reason": undeclared(task)})
        return waiting


def error_summary(error: str | None) -> str | None:
    """A member's ``last_error`` as a workflow view carries it: its first line, cut."""
    if not error:
        return None
    line = error.strip().splitlines()[0] if error.strip() else ""
    return line if len(line) <= WORKFLOW_ERROR_CHARS else line[: WORKFLOW_ERROR_CHARS - 1] + "…"


def workflow_view(stored: StoredWorkflow) -> protocol.WorkflowView:
    """The wire's view of a workflow read from the store; its status is derived from the
    members shown (:func:`broker.dependencies.workflow_status`)."""
    members = [
        protocol.WorkflowMember(
            job_id=job.id,
            task=job.task,
            status=job.status,
            attempts=job.attempts,
            error=error_summary(job.last_error),
        )
        for job in stored.members
    ]
    edges = [
        protocol.WorkflowEdge(parent=e.parent, child=e.child, done=e.done) for e in stored.edges
    ]
    return protocol.WorkflowView(
        workflow_id=stored.workflow_id,
        status=dependencies.workflow_status([job.status for job in stored.members]),
        members=members,
        edges=edges[:MAX_WORKFLOW_EDGES],
        truncated=stored.truncated or len(edges) > MAX_WORKFLOW_EDGES,
    )


def queue_summary(counts: list[QueueCount], now: datetime) -> list[dict[str, Any]]:
    """Per queue: a count for every status, and how long its oldest queued job has been
    due (``null`` when nothing is queued; ``0`` when the queued jobs are all scheduled)."""
    queues: dict[str, dict[str, Any]] = {}
    for row in counts:
        entry = queues.setdefault(
            row.queue,
            {
                "queue": row.queue,
                "counts": {status.value: 0 for status in JobStatus},
                "oldest_queued_run_at": None,
                "oldest_queued_age_seconds": None,
            },
        )
        entry["counts"][row.status.value] += row.count
        if row.status is JobStatus.QUEUED and row.oldest_run_at is not None:
            age = max(0.0, (now - row.oldest_run_at).total_seconds())
            entry["oldest_queued_run_at"] = row.oldest_run_at.isoformat()
            entry["oldest_queued_age_seconds"] = round(age, 3)
    return [queues[name] for name in sorted(queues)]


__all__ = ["JobListing", "Limits", "LiveState", "Operations", "queue_summary"]
