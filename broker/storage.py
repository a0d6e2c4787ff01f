"""The storage contract: what the main needs from a job store, and nothing about SQL.

An adapter is any object with these methods; it does not inherit from anything.
``broker.testing.conformance`` checks that an adapter *behaves* as described here,
and a custom adapter is certified by passing it (see ``docs/adapters.md``).

The rules every implementation must keep:

* **Exact leases.** ``mark_handed_off`` persists the handoff id it is given, never
  one of its own. The main minted it before the call so that, if the call raises
  and nobody knows whether it committed, the main can still name the lease and
  take it back with ``return_to_queue``.
* **Fencing in the same statement.** ``complete``, ``fail``, ``reschedule`` and
  ``return_to_queue`` change a job only when its id, its current handoff id and
  the status ``handed_off`` all match, checked atomically with the change. They
  return ``False`` (and change nothing) otherwise.
* **Recoveries.** A ``LOST`` settlement adds one to ``recoveries`` (never to
  ``attempts``) in the same fenced statement as its move, sets the job's
  ``state_holder``, and every claim clears ``state_holder`` (see
  :mod:`broker.settlement`).
* **Idempotent return.** ``return_to_queue`` for a lease whose claim never
  committed, or was already returned, or was superseded by a newer lease, is a
  harmless no-op that returns ``False``. Any answer that is not an exception
  counts as the store's acknowledgement.
* **Concurrency keys.** At most ``concurrency_limit`` jobs sharing a
  ``concurrency_key`` are ``handed_off`` at once. The slot is taken inside the
  claim and given back by every transition out of ``handed_off``.
* **Unique keys.** At most one job holding a given ``unique_key`` is active
  (``queued`` or ``handed_off``) at a time; enqueueing another returns the active one
  as a duplicate, and once it is terminal a new one may be enqueued.
* **Dependencies.** A job enqueued with ``depends_on`` is stored ``waiting`` (never
  selected nor claimed) and its parents must be stored already (else
  ``InvalidJobError``, nothing of the batch stored). Whatever ends a parent (an
  accepted settle, a cancel; the child's enqueue for a parent ended before) carries out
  :func:`broker.dependencies.propagate` in the same transaction as that move, so a
  child is made due exactly once; ``prune`` keeps a parent while a child waits on it.
* **Raise only for transient trouble** (wrap it in ``StorageError``): the main
  treats an exception as "outcome unknown" and retries or recovers. The
  deliberate exceptions are ``retry_dead`` refusing with ``UniqueKeyTakenError``,
  and ``StorageRejectedError`` for a value the store can never hold (the same call
  would fail every time): the main does not retry that, it isolates the one report
  or claim that carries the value so the others still go through.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, TypeVar, runtime_checkable

from broker.dependencies import Edge
from broker.exceptions import StorageRejectedError
from broker.jobs import (
    CheckpointSave,
    Claim,
    EnqueueResult,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
    JSONValue,
    ProgressUpdate,
    Settlement,
    SpecColumns,
)
from broker.model.logs import log_event
from broker.model.rates import Rate

logger = logging.getLogger("broker.main")

SCHEMA_VERSION = 19
"""The schema version this code writes and understands; stores record theirs."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """Optional behaviours an adapter declares; the conformance suite skips the rest.

    ``skip_locked``: several processes can claim from the store at once without
    blocking one another (PostgreSQL ``FOR UPDATE SKIP LOCKED``).
    ``listen_notify``: the adapter implements :class:`SupportsNotify`, so the main
    is woken when another process inserts a job, instead of polling.
    ``shared_between_processes``: two adapter instances opened on the same URL see
    the same jobs (false for the in-memory adapter).
    ``leader_election``: the adapter implements :class:`SupportsLeadership`, so several
    mains may share the store, one of them elected to dispatch.
    """

    skip_locked: bool = False
    listen_notify: bool = False
    shared_between_processes: bool = False
    leader_election: bool = False


@dataclass(frozen=True, slots=True)
class JobFilter:
    """Which jobs ``list_jobs`` returns; ``None`` means "any"."""

    statuses: Collection[JobStatus] | None = None
    queues: Collection[str] | None = None
    tasks: Collection[str] | None = None


@dataclass(frozen=True, slots=True)
class JobPage:
    """One page of jobs, newest first; pass ``next_cursor`` back for the next page."""

    jobs: list[Job]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class QueueCount:
    queue: str
    status: JobStatus
    count: int
    oldest_run_at: datetime | None
    """For ``queued`` rows, the earliest ``run_at``; lets an operator see a stuck queue."""


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """One worker's declaration of one task, as the task catalog keeps it."""

    task: str
    worker_id: str
    declaration: dict[str, JSONValue]
    """The task's defaults as the worker declared them (see :mod:`broker.core.catalog`); the
    store keeps it as given and never reads inside it."""
    seen_at: datetime
    """When this worker last declared the task."""


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """One queue's operator settings, as stored (see :class:`SupportsQueueSettings`) and as
    the main enforces them (:mod:`broker.core.flow`): paused, and a rate limit."""

    queue: str
    paused: bool = False
    rate: Rate | None = None
    """At most this many dispatches a second, minute or hour, with its burst."""

    @property
    def empty(self) -> bool:
        """Nothing set: the queue is as if it had no settings (the store keeps no row)."""
        return not self.paused and self.rate is None


@runtime_checkable
class StorageAdapter(Protocol):
    """A job store. All methods but ``cursor_after`` are coroutines; all are safe to
    call concurrently."""

    @property
    def capabilities(self) -> Capabilities: ...

    async def setup(self) -> None:
        """Create or migrate the schema to :data:`SCHEMA_VERSION`.

        :raises SchemaVersionError: the store was written by a newer broker.
        """

    async def close(self) -> None: ...

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        """Store one job, unless its idempotency key is already taken.

        A key stays taken as long as the job holding it is in the store, whatever its
        status, so a client that repeats an enqueue after a timeout never makes a
        second job; the result then carries that job and ``duplicate=True``.

        A ``unique_key`` is taken only while its job is active (queued or handed off):
        an enqueue with the key of an active job returns that job with
        ``duplicate=True`` and stores nothing (its idempotency key stays free); once
        that job is completed, failed or cancelled, the next enqueue makes a new job.
        The idempotency key is checked first, then the id, then the unique key.
        """

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """Store many jobs in one transaction; results are in the order of ``specs``."""

    async def select_eligible(
        self,
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        limit: int = 100,
        skip: Collection[uuid.UUID] = (),
        tasks: Collection[str] | None = None,
    ) -> list[Job]:
        """Queued jobs whose ``run_at`` has come, best first.

        Ordered by priority (higher first), then ``run_at``, then creation time.
        Jobs of other execution modes or queues, jobs whose concurrency key is at
        its limit, and the jobs in ``skip`` are left out. The result is advice: a claim
        may still lose the job.

        ``skip`` is what the dispatcher is claiming right now: the store still shows
        those jobs queued, and reading past them cost a pooled drain about 2.4 rows
        read and decoded per job dispatched.

        ``tasks`` (``None``: any) are the tasks some connected worker declared: a job of
        another task is left out, so a backlog of jobs no worker can run (a rolling
        deploy's new task, before its workers start) never fills the read and hides the
        jobs behind it (see :mod:`broker.core.placement`).

        A job's payloads (``args``, ``kwargs``, ``result``, ``checkpoint``) may be left
        out, as empty values: dispatch never needs them, since the claim returns each
        job in full.
        """

    async def next_run_at(
        self, *, modes: Collection[ExecutionMode], queues: Collection[str] | None = None
    ) -> datetime | None:
        """The earliest ``run_at`` among queued jobs of these modes, for a wake-up timer."""

    async def mark_handed_off(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, worker_id: str
    ) -> Job | None:
        """Claim one queued job under the supplied lease.

        Returns the job as now stored (``handoff_id`` equal to the one given), or
        ``None`` when the job is no longer claimable (not queued, not due, or its
        concurrency key is full).
        """

    async def mark_handed_off_many(self, claims: Sequence[Claim]) -> list[Job]:
        """Claim many jobs in one round trip; returns the ones that were claimed.

        Each claim succeeds or fails on its own, exactly as ``mark_handed_off``.
        """

    async def settle_many(self, settlements: Sequence[Settlement]) -> list[bool]:
        """Apply many fenced moves out of ``handed_off`` in one transaction (one commit).

        Each is accepted or fenced out on its own, exactly as the single methods below;
        results are in input order. This is how the main group-commits reports.
        """

    async def save_checkpoints(self, saves: Sequence[CheckpointSave]) -> list[bool]:
        """Store each checkpoint under its lease, in one transaction, in order; results in
        input order. One is taken (``True``) only when the job is ``handed_off`` under
        ``save.handoff_id`` and ``save.seq`` is above its ``checkpoint_seq``
        (:func:`broker.settlement.accepts_checkpoint`, checked in the same statement as
        the write); it sets ``checkpoint``, ``checkpoint_seq`` and ``checkpoint_at`` and
        nothing else. A checkpoint outlives its run: later attempts and the finished job
        keep it until the job is pruned. The main acknowledges a save to its task only
        after this returns, so it must be durable by then.
        """

    async def save_progress(self, updates: Sequence[ProgressUpdate]) -> list[bool]:
        """Record each run's latest progress under its lease (fenced as a settlement),
        in one transaction; results in input order. Nothing waits on it being durable."""

    async def complete(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, result: JSONValue = None
    ) -> bool:
        """``handed_off`` → ``completed`` under this lease; ``False`` if fenced out."""

    async def fail(
        self,
        job_id: uuid.UUID,
        handoff_id: uuid.UUID,
        error: str,
        retry_at: datetime | None,
    ) -> bool:
        """Record a failed run under this lease; ``False`` if fenced out.

        ``attempts`` goes up by one and ``last_error`` is kept. With ``retry_at`` the
        job is queued again for then; with ``None`` it is dead (``failed``).
        """

    async def reschedule(self, job_id: uuid.UUID, handoff_id: uuid.UUID, run_at: datetime) -> bool:
        """Queue the job again for ``run_at`` without counting an attempt."""

    async def return_to_queue(self, job_id: uuid.UUID, handoff_id: uuid.UUID) -> bool:
        """Give this exact lease back: the job is queued again, due at once.

        Idempotent: a lease that never committed, was already returned, or was
        replaced by a newer one leaves the store untouched and returns ``False``.
        """

    async def handoffs_for_worker(self, worker_id: str) -> list[Job]:
        """Jobs currently ``handed_off`` to this worker id."""

    async def cancel(self, job_id: uuid.UUID) -> Job | None:
        """Cancel a queued or handed-off job; returns the job as it now stands.

        A handed-off job becomes ``cancelled`` at once, so its worker's later report is
        fenced out. A terminal job is returned unchanged; ``None`` if there is no job.
        """

    async def retry_dead(self, job_id: uuid.UUID) -> Job | None:
        """Put a ``failed`` (dead) job back in the queue with a fresh attempt count.

        Any other job is returned unchanged; ``None`` if there is no job.

        :raises UniqueKeyTakenError: the job has a ``unique_key`` that another active
            job holds now; nothing changes (retry again once that job has finished).
        """

    async def get_job(self, job_id: uuid.UUID) -> Job | None: ...

    async def declare_tasks(
        self,
        worker_id: str,
        declarations: Mapping[str, Mapping[str, JSONValue]],
        seen_at: datetime,
    ) -> None:
        """Record that ``worker_id`` serves these tasks (name to declaration), as of
        ``seen_at``, in place of what it declared before: each ``(task, worker_id)`` row is
        written or replaced, and the worker's rows of tasks not in ``declarations`` are
        deleted, all in one transaction. The main bounds what a worker declares
        (:mod:`broker.model.bounds`), so the store holds a bounded catalog."""

    async def task_catalog(
        self, *, tasks: Collection[str] | None = None, limit: int | None = None
    ) -> list[TaskRecord]:
        """The declarations recorded, ordered by task, then worker id: those of ``tasks``
        only (a read by the primary key's first column), and at most ``limit`` of them,
        the most recently seen (``None``: no limit)."""

    async def forget_tasks(
        self, live_workers: Collection[str], seen_at: datetime, gone_before: datetime
    ) -> int:
        """The task grace's pass, in one transaction: the rows of ``live_workers`` (connected
        now) are seen at ``seen_at``, then every row last seen before ``gone_before`` is
        deleted. Returns how many were deleted."""

    async def list_jobs(
        self,
        job_filter: JobFilter | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
        include_payload: bool = True,
    ) -> JobPage:
        """Jobs matching ``job_filter``, newest first, ``limit`` at a time.

        With ``include_payload=False`` (a summary listing) every job comes back with
        empty ``args``, ``kwargs`` and ``result``, and the store should not even read
        them: they may be megabytes per job, and a listing is for finding jobs, not
        for reading them (``get_job`` returns everything).
        """

    def cursor_after(self, job: Job) -> str:
        """The cursor that continues a listing right after ``job``, one of its jobs.

        It is the ``next_cursor`` a page ending with ``job`` would carry, so a caller
        can cut a page short (the main does, to keep a reply within its byte budget)
        and continue from there without losing or repeating a job.
        """

    async def count_jobs(self) -> list[QueueCount]:
        """Counts by queue and status (statuses with no jobs are left out)."""

    async def prune(
        self,
        *,
        older_than: datetime | None = None,
        keep_latest: int | None = None,
        statuses: Collection[JobStatus] | None = None,
        batch_size: int = 1000,
    ) -> int:
        """Delete terminal jobs; never a queued or handed-off one. Returns how many.

        ``older_than`` deletes terminal jobs last updated before that time;
        ``keep_latest`` keeps only the newest N terminal jobs. ``statuses`` narrows
        which terminal statuses are pruned (default: all three). Deletes happen in
        batches of ``batch_size`` so a large prune never holds long locks.
        """


def contract_gaps(store: object) -> list[str]:
    """The :class:`StorageAdapter` members ``store`` lacks, in the contract's order.

    ``isinstance(store, StorageAdapter)`` only says no; a custom adapter is refused at
    start-up with this list, rather than with an ``AttributeError`` at its first use.
    """
    members = [name for name in vars(StorageAdapter) if not name.startswith("_")]
    return [name for name in members if not hasattr(store, name)]


class SelectEligible(Protocol):
    """A :meth:`StorageAdapter.select_eligible` that takes ``skip=`` and ``tasks=``."""

    async def __call__(
        self,
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        limit: int = 100,
        skip: Collection[uuid.UUID] = (),
        tasks: Collection[str] | None = None,
    ) -> list[Job]: ...


def eligible_reader(store: StorageAdapter) -> SelectEligible:
    """``store.select_eligible``, taking ``skip=`` and ``tasks=`` even from an adapter
    written before them (a user's own): that one is read past the skipped jobs and the
    other tasks' jobs instead, as dispatch did then, rather than failing every pass with
    a ``TypeError`` (a backlog of jobs no worker runs may then hide the jobs behind it,
    as before routing by task)."""
    parameters = inspect.signature(store.select_eligible).parameters
    if "skip" in parameters and "tasks" in parameters:
        return store.select_eligible
    takes_skip = "skip" in parameters

    async def read_past(
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        limit: int = 100,
        skip: Collection[uuid.UUID] = (),
        tasks: Collection[str] | None = None,
    ) -> list[Job]:
        if takes_skip:
            read = await store.select_eligible(modes=modes, queues=queues, limit=limit, skip=skip)
        else:
            read = await store.select_eligible(modes=modes, queues=queues, limit=limit + len(skip))
        left_out = set(skip)
        return [
            job for job in read if job.id not in left_out and (tasks is None or job.task in tasks)
        ][:limit]

    return read_past


@runtime_checkable
class SupportsSchemaCheck(Protocol):
    """Adapters that can tell whether a store is ready without changing it.

    The operator's command opens a store only this way (see :mod:`broker.ops.admin`): it
    must never create or migrate a schema, in a database that may not be the broker's
    or under a main of another version. ``broker-main`` calls ``setup()`` instead.
    """

    async def check_schema(self) -> None:
        """Return if the store holds the current schema; create nothing, change nothing.

        :raises SchemaVersionError: no broker schema (or, for a file, no file), an older
            schema not migrated yet, or a newer one than this code understands; the
            message says which and what to do.
        """


@runtime_checkable
class SupportsEnqueueColumns(Protocol):
    """Optional: store jobs held by column (:class:`~broker.jobs.SpecColumns`: one task
    and its options, many argument sets), without a :class:`JobSpec` per job.

    The main's ``enqueue_each`` decodes a bulk request into columns; a store that writes
    them as they are spares the main a spec, a fields dict and a row per job. Adapters
    without this method get ``enqueue_many`` of the same jobs, one spec each.
    """

    async def enqueue_columns(self, chunks: Iterator[SpecColumns], count: int) -> list[uuid.UUID]:
        """``enqueue_many`` of every chunk's ``specs()``, all or none, every job new (no
        key names one, none has parents): the jobs' ids, in order. ``count`` jobs in
        all. Taking the next chunk may make and check it (the main's do, so a store may
        write one chunk while the next is checked): a chunk that raises refuses the
        whole request, and nothing of it may be stored. Take every chunk, once."""


@runtime_checkable
class SupportsEnqueueHandedOff(Protocol):
    """Optional: store jobs already handed off, in the enqueue's own transaction.

    When a worker has a free slot at the moment a job is enqueued, the main mints the
    lease first and asks for the job to be written handed off under it: one transaction
    (one fsync) and no dispatch pass between the enqueue and the job's start. Adapters
    without this method get the job through the dispatcher as usual.
    """

    async def enqueue_handed_off(
        self, specs: Sequence[JobSpec], claims: Sequence[Claim | None]
    ) -> list[EnqueueResult]:
        """``enqueue_many(specs)``, except that a job stored fresh whose claim is not
        ``None`` (``claims[i]`` for ``specs[i]``, naming that job's id) is written handed
        off under it, as :func:`broker.settlement.enqueued` describes, when
        :func:`broker.settlement.claimable_at_enqueue` holds at the store's clock; else it
        is stored queued and the claim is simply not won. A duplicate is returned as it
        is stored: its claim is not won either. The main knows a claim won by the result's
        ``handoff_id``, as for :meth:`StorageAdapter.mark_handed_off_many`.
        """


@runtime_checkable
class SupportsDueNotice(Protocol):
    """Optional, for a store without notifications (``listen_notify`` false) that makes
    jobs due by itself: a settle that completes a job's last parent makes the waiting
    child queued in the same transaction (:mod:`broker.dependencies`), which no enqueue
    of the main announced. Without a notice the main would find the child at its next
    poll (``--poll-interval``), so each step of a chain waited about that long."""

    def on_due(self, notice: Callable[[], None]) -> None:
        """Call ``notice`` (on the event loop, after the commit) whenever a write of this
        process made waiting jobs due; it replaces the notice set before (a main that
        leads again sets its new dispatcher's)."""


@dataclass(frozen=True, slots=True)
class StoredWorkflow:
    """A workflow as the store holds it (see :class:`SupportsWorkflows`)."""

    workflow_id: uuid.UUID
    members: list[Job]
    """Its jobs without their payloads (``args``, ``kwargs``, ``result`` left empty),
    parents before children, else in enqueue order."""
    edges: list[Edge]
    """The parents of every member that has some, each member's in ``depends_on`` order."""
    truncated: bool
    """More members than the read's ``limit`` exist; ``members`` holds the first ones."""


@runtime_checkable
class SupportsWorkflows(Protocol):
    """Optional: read a workflow whole, and retry its failed members.

    A main on an adapter without it answers ``get_workflow`` and ``retry_workflow`` with
    a ``configuration`` error saying so; every other workflow feature (dependencies,
    chains, fan-in, cancel) needs only :class:`StorageAdapter`.
    """

    async def get_workflow(self, workflow_id: uuid.UUID, *, limit: int) -> StoredWorkflow | None:
        """The members of ``workflow_id`` (at most ``limit``) and their edges, read in one
        transaction; ``None`` when no job carries that workflow id (never enqueued, or
        every member pruned). ``workflow_id`` may also be the id of one of the workflow's
        jobs (a job page knows only its job): the workflow read is then that job's."""

    async def retry_workflow(self, workflow_id: uuid.UUID) -> list[uuid.UUID]:
        """Apply :func:`broker.dependencies.retry_plan` to the workflow (``workflow_id``
        as for :meth:`get_workflow`) in one transaction, its members' rows locked: dead
        members queued again (as ``retry_dead``), the dependents cancelled because of
        them ``waiting`` again, their edges from those members counted anew. Returns the
        ids changed (requeued first, then revived); empty when nothing had failed.

        :raises UniqueKeyTakenError: a dead member's ``unique_key`` is held by another
            active job; nothing changes.
        """


@runtime_checkable
class SupportsEndNotice(Protocol):
    """Optional: tell the main of jobs a write ended by itself. When a parent ends dead
    or cancelled, its dependents are cancelled inside the same transaction
    (:mod:`broker.dependencies`), a move no request of the main named; the main's
    waiters on them (``wait_job``) are answered when told, else only when their wait's
    time is up."""

    def on_ended(self, notice: Callable[[list[uuid.UUID]], None]) -> None:
        """Call ``notice`` (on the event loop, after the commit) with the ids of the jobs
        a write of this handle cancelled because a parent ended; it replaces the notice
        set before (a main that leads again sets its own)."""


@runtime_checkable
class SupportsQueueSettings(Protocol):
    """Optional: keep each queue's settings (paused, rate limit) so they outlive a main, and
    leave the queues named in ``exclude_queues`` out of dispatch reads.

    A main reads the settings when it starts to lead (a restart, a standby's takeover)
    and writes each change before it applies it. An adapter without this capability
    still works: a main on it refuses to pause or limit a queue, saying why.
    ``select_eligible`` and ``next_run_at`` of such an adapter also take
    ``exclude_queues`` (a collection of queue names, default empty): jobs of those
    queues are left out, as jobs of queues not in ``queues`` are. ``select_eligible``
    also takes ``exclude_keys`` (``(task, rate key)`` pairs, default empty): a job of
    that task with that ``rate_key`` (``""`` for a job without one) is left out, so a
    tenant whose per-key limit has no token never hides the others' jobs. The conformance kit
    (:mod:`broker.testing.conformance`) checks both.
    """

    async def queue_settings(self) -> list[QueueSettings]:
        """Every queue's stored settings (at most ``MAX_QUEUE_SETTINGS``), by queue name."""

    async def save_queue_settings(self, settings: QueueSettings) -> None:
        """Store ``settings`` for its queue, replacing what was there; settings with
        nothing set (:attr:`QueueSettings.empty`) delete the queue's row."""


@dataclass(frozen=True, slots=True)
class LeaderRecord:
    """The store's leader row, as one election round left it."""

    epoch: int
    """Grows by one at every takeover; the elected main fences its statements with it."""
    holder: str
    """The elected main's id (``Main.main_id``)."""
    address: str
    """Where peers reach the elected main (``HOST:PORT``)."""
    live: bool
    """Its lease had not run out, by the store's clock."""


@runtime_checkable
class SupportsWarmUp(Protocol):
    """Optional: connections opened ahead of need.

    A main calls :meth:`warm_up` when it starts to lead (as it loads the handoffs in
    flight, before it welcomes a peer), so the first requests of a just-elected main do
    not each wait for a connection to open."""

    async def warm_up(self) -> None:
        """Open the connections the main's requests use; raises what the store raises."""


@runtime_checkable
class SupportsLeadership(Protocol):
    """Optional: several mains on one store, exactly one of them dispatching.

    The election and its fence live in the store itself (no consensus of the mains'
    own): a main holds the leader row for ``ttl`` seconds at a time and renews it;
    when a lease runs out another main takes the row over and the epoch grows. An
    adapter without this method holds one main only (SQLite: a file lock; memory: one
    process), with no epoch.

    The fence is the guarantee, the lease only the timing: once :meth:`fence` has set
    an epoch, every claim (``mark_handed_off*``, ``enqueue_handed_off`` with a claim)
    and every settle (``settle_many`` and the single moves, ``return_to_queue``
    included) checks, *in the same statement* as its change, that the epoch is still
    the leader's, and under an older one changes nothing and raises
    :class:`~broker.exceptions.DeposedError` (not ``False``: a deposed main must tell
    "I am no longer the leader" apart from "this lease is stale"). ``cancel`` is not
    fenced: an operator's request is valid whichever main serves it, and a cancelled
    job is terminal for every lease. Reads and plain enqueues are not fenced either.
    """

    async def elect(self, holder: str, address: str, ttl: float) -> LeaderRecord | None:
        """Take the leader row for ``ttl`` seconds if there is none or its lease has run
        out (the epoch grows by one); returns the row as it stands after this round.
        ``holder`` leads when the answer names it; else the answer names the leader."""

    async def renew(self, holder: str, epoch: int, ttl: float) -> bool:
        """Extend ``holder``'s lease of ``epoch`` by ``ttl`` from now, by the store's clock;
        ``False`` if another main took over meanwhile (it is deposed) or it resigned. A
        lease that ran out with nobody taking over is renewed: no other main can have led
        since, so a leader paused past its lease (a stall, a starved process) with no
        standby to replace it keeps leading instead of exiting."""

    async def resign(self, holder: str, epoch: int) -> None:
        """End ``holder``'s lease of ``epoch`` now, so a standby takes over at its next
        round (a main that stops cleanly); a no-op if it no longer holds it."""

    def fence(self, epoch: int | None, on_fenced: Callable[[str], None] | None = None) -> None:
        """Make every later claim and settle of this handle check ``epoch`` (``None``: no
        check, the default); ``on_fenced`` is called with the operation's name each time
        the fence refuses one, before its ``DeposedError`` is raised."""


_V = TypeVar("_V")

INTEGRITY_ERROR = "payload failed its integrity check"
"""The error of a job whose offloaded value no longer matches what was stored: its text
was changed (its SHA-256 differs) or is not JSON. The job's ``last_error`` starts with it."""


class PayloadIntegrityError(StorageRejectedError):
    """An offloaded value failed its check when loaded (see :func:`check_payload`).

    A :class:`~broker.exceptions.StorageRejectedError`: reading it again gives the same
    answer, so nothing retries it. A claim never raises it (it fails that one job dead
    instead); any other read of the job does, naming the job and the value."""

    def __init__(self, job_id: uuid.UUID, kind: str, reason: str) -> None:
        self.job_id = job_id
        self.kind = kind
        self.detail = f"{INTEGRITY_ERROR}: its offloaded {kind} {reason}"
        """What the job's ``last_error`` says when a claim fails it for this."""
        super().__init__(f"job {job_id}: {self.detail}")


def log_refused_at_claim(claim: Claim, error: PayloadIntegrityError) -> None:
    """Say that a store failed a just-claimed job whose offloaded value failed its check
    (:func:`broker.settlement.payload_refused`), the same way for every store, so an
    operator sees which job and why wherever it was claimed."""
    log_event(
        logger,
        logging.WARNING,
        "job failed at claim",
        job_id=error.job_id,
        handoff_id=claim.handoff_id,
        worker_id=claim.worker_id,
        reason=error.detail,
    )


def payload_digest(text: str) -> str:
    """The SHA-256 of an offloaded value's stored text (ASCII JSON), as 64 hex digits:
    what a store keeps beside the text and :func:`check_payload` compares. Only offloaded
    values (over the offload threshold) are hashed, so a common claim's rows cost what
    they did; an offloaded one costs about 0.6 ms of CPU per MiB more at its write and
    at each load (hashlib, with the CPU's SHA instructions): less than decoding as much
    structured JSON, more than decoding one long string."""
    return hashlib.sha256(text.encode()).hexdigest()


def check_payload(
    job_id: uuid.UUID, kind: str, text: str, digest: str | None, decode: Callable[[str], _V]
) -> _V:
    """``text`` decoded, once it matches ``digest``; else :class:`PayloadIntegrityError`.

    A value without a digest fails too: every writer stores one, and stores written
    before digests existed have theirs computed by their migration, so a missing one
    means the row was written by hand."""
    if digest is None:
        raise PayloadIntegrityError(job_id, kind, "has no SHA-256 stored beside it")
    if payload_digest(text) != digest:
        raise PayloadIntegrityError(job_id, kind, "does not match its stored SHA-256")
    try:
        return decode(text)
    except (ValueError, TypeError, RecursionError) as exc:
        raise PayloadIntegrityError(job_id, kind, "is not JSON") from exc


@runtime_checkable
class SupportsOffload(Protocol):
    """Optional: large values kept out of the rows that claims and settles rewrite.

    A job's ``args``, ``kwargs`` or ``result`` larger than ``offload_threshold`` bytes (as
    compact, ASCII-escaped JSON, see :func:`broker.payload.encoded_size`) is stored
    apart from the job's own record (the SQL stores: a row of ``broker_payloads``), and
    the record keeps a mark in its place. What callers see does not change:

    * ``mark_handed_off``, ``get_job``, a full ``list_jobs``, ``handoffs_for_worker``,
      ``cancel``, ``retry_dead`` and a duplicate's ``EnqueueResult`` carry every value,
      loaded back; ``select_eligible`` (advice for dispatch, which may leave out any
      payload) and a summary listing may leave offloaded values out, as empty ones.
    * An offloaded value is written in the transaction that writes its job (the enqueue,
      or the fenced settle): a fenced-out report, a duplicate or a rolled-back enqueue
      leaves none behind, and ``prune`` deletes a job's values with it.
    * **Integrity.** An offloaded value is stored with the SHA-256 of its text
      (:func:`payload_digest`) and checked against it, and decoded, wherever it is loaded
      (:func:`check_payload`). A claim that loads one that fails (edited, or not JSON)
      does not hand its job off: it fails the job dead in the same call, under the lease
      it was given, with :data:`INTEGRITY_ERROR` (see :func:`broker.settlement.payload_refused`),
      gives back its concurrency slot, and hands off the rest of the batch as usual.
      Every other read of such a value raises :class:`PayloadIntegrityError`.

    Adapters without it keep every value in the job's record, as before.
    """

    @property
    def offload_threshold(self) -> int | None:
        """Largest value kept inline, in bytes; ``None``: nothing is offloaded."""

    async def count_payloads(self) -> int:
        """How many offloaded values the store holds (for tests, retention checks and
        operators: it must fall to zero once every job is pruned)."""


@runtime_checkable
class SupportsNotify(Protocol):
    """Adapters with ``capabilities.listen_notify`` also wake listeners on enqueue."""

    def listen(self, on_wake: Callable[[], None]) -> AbstractAsyncContextManager[None]:
        """While the context is open, call ``on_wake`` when any process enqueues a job."""
