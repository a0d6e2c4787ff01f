"""An in-process job store for tests, examples and trying the broker out.

It models what each storage operation *means*, not the SQL that implements it, and
passes the same conformance suite as the SQL stores. Jobs live in a dict and are
gone when the process exits, so never use it where a lost job matters.

Every public method runs without an ``await`` between reading and writing its
state, so on one event loop each operation is atomic, which is exactly the
guarantee the SQL stores get from transactions.

Large values are offloaded as in the SQL stores, into a dict of their own: the job
kept in ``_jobs`` holds an empty value in their place, so the offload rules (what moves
out, when it is loaded, that pruning takes it along) are exercised here too. An
offloaded value is kept as the SQL stores keep it, as JSON text beside its SHA-256, and
checked and decoded at every load, so the integrity rules hold here as well.
"""

from __future__ import annotations

import base64
import copy
import json
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from datetime import datetime

from broker import dependencies, settlement
from broker.dependencies import Edge, Waiting
from broker.exceptions import UniqueKeyTakenError
from broker.jobs import (
    ACTIVE_STATUSES,
    TERMINAL_STATUSES,
    CheckpointSave,
    Claim,
    Clock,
    EnqueueResult,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
    JSONValue,
    Outcome,
    ParentFailure,
    ParentResults,
    ProgressUpdate,
    Settlement,
    check_idempotent_repeat,
    compact_json,
    dispatch_key,
    utcnow,
)
from broker.payload import DEFAULT_OFFLOAD_BYTES, encoded_size
from broker.storage import (
    Capabilities,
    JobFilter,
    JobPage,
    PayloadIntegrityError,
    QueueCount,
    QueueSettings,
    StoredWorkflow,
    TaskRecord,
    check_payload,
    log_refused_at_claim,
    payload_digest,
)

_HOLLOW: dict[str, JSONValue] = {"args": (), "kwargs": {}, "result": None, "checkpoint": None}
"""What an offloaded field of a kept job holds; also how a summary shows a job."""


_DECODE: dict[str, Callable[[str], JSONValue]] = {
    "args": lambda text: tuple(json.loads(text)),
    "kwargs": json.loads,
    "result": json.loads,
    "checkpoint": json.loads,
}
"""How each offloaded field is decoded from its stored text (args are a tuple in a job)."""


class MemoryAdapter:
    """A complete :class:`broker.storage.StorageAdapter` held in memory.

    ``offload_threshold``: args, kwargs, a result or a checkpoint larger than this (as
    stored JSON, measured like the SQL stores) is kept apart from its job; ``None`` never
    offloads.
    """

    def __init__(
        self, *, clock: Clock = utcnow, offload_threshold: int | None = DEFAULT_OFFLOAD_BYTES
    ) -> None:
        self._clock = clock
        self._offload_threshold = offload_threshold
        self._jobs: dict[uuid.UUID, Job] = {}
        self._payloads: dict[tuple[uuid.UUID, str], tuple[str, str]] = {}
        """Offloaded values by ``(job id, field)``: their JSON text and its SHA-256."""
        self._by_idempotency_key: dict[str, uuid.UUID] = {}
        self._tasks: dict[tuple[str, str], TaskRecord] = {}
        """The task catalog, by ``(task, worker_id)``."""
        self._active_by_unique_key: dict[str, uuid.UUID] = {}
        self._active_by_key: Counter[str] = Counter()
        self._listeners: list[Callable[[], None]] = []
        self._parents: dict[uuid.UUID, tuple[uuid.UUID, ...]] = {}
        """Each job's ``depends_on``, in order (only jobs that have some)."""
        self._children: defaultdict[uuid.UUID, list[uuid.UUID]] = defaultdict(list)
        self._open: set[tuple[uuid.UUID, uuid.UUID]] = set()
        """Edges ``(child, parent)`` not counted yet."""
        self._waits: dict[uuid.UUID, tuple[int, ParentFailure, ParentResults]] = {}
        """Each job with parents: how many it still waits for, and its options."""
        self._workflows: dict[uuid.UUID, uuid.UUID] = {}
        """Each workflow member's workflow id."""
        self._deps = _Dependencies(self)
        self._end_notice: Callable[[list[uuid.UUID]], None] | None = None
        self._queue_settings: dict[str, QueueSettings] = {}

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(listen_notify=True)

    @property
    def offload_threshold(self) -> int | None:
        return self._offload_threshold

    async def count_payloads(self) -> int:
        return len(self._payloads)

    async def setup(self) -> None:
        """Nothing to create: the schema is the ``Job`` dataclass."""

    async def close(self) -> None:
        self._listeners.clear()

    def listen(self, on_wake: Callable[[], None]) -> AbstractAsyncContextManager[None]:
        @asynccontextmanager
        async def listening() -> AsyncIterator[None]:
            self._listeners.append(on_wake)
            try:
                yield
            finally:
                self._listeners.remove(on_wake)

        return listening()

    def _check_repeats(self, specs: Sequence[JobSpec]) -> None:
        """Refuse the batch, before anything is stored, when a spec takes an idempotency
        key (stored, or earlier in the batch) with a different request."""
        first: dict[str, JobSpec] = {}
        for spec in specs:
            key = spec.idempotency_key
            if key is None:
                continue
            held = self._by_idempotency_key.get(key)
            if held is not None:
                check_idempotent_repeat(spec, self._snapshot(held))
            elif key in first:
                check_idempotent_repeat(spec, first[key])
            else:
                first[key] = spec

    async def declare_tasks(
        self,
        worker_id: str,
        declarations: Mapping[str, Mapping[str, JSONValue]],
        seen_at: datetime,
    ) -> None:
        for key in [k for k in self._tasks if k[1] == worker_id and k[0] not in declarations]:
            del self._tasks[key]
        for name, declaration in declarations.items():
            self._tasks[name, worker_id] = TaskRecord(
                name, worker_id, copy.deepcopy(dict(declaration)), seen_at
            )

    async def task_catalog(
        self, *, tasks: Collection[str] | None = None, limit: int | None = None
    ) -> list[TaskRecord]:
        wanted = None if tasks is None else set(tasks)
        records = [r for r in self._tasks.values() if wanted is None or r.task in wanted]
        if limit is not None:
            records = sorted(records, key=lambda r: r.seen_at, reverse=True)[:limit]
        return [copy.deepcopy(r) for r in sorted(records, key=lambda r: (r.task, r.worker_id))]

    async def forget_tasks(
        self, live_workers: Collection[str], seen_at: datetime, gone_before: datetime
    ) -> int:
        live = set(live_workers)
        for key, record in list(self._tasks.items()):
            if key[1] in live:
                self._tasks[key] = replace(record, seen_at=seen_at)
        gone = [key for key, record in self._tasks.items() if record.seen_at < gone_before]
        for key in gone:
            del self._tasks[key]
        return len(gone)

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        return (await self.enqueue_many([spec]))[0]

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        return await self.enqueue_handed_off(specs, [None] * len(specs))

    async def enqueue_handed_off(
        self, specs: Sequence[JobSpec], claims: Sequence[Claim | None]
    ) -> list[EnqueueResult]:
        now = self._clock()
        self._check_repeats(specs)
        self._check_parents(specs)
        results: list[EnqueueResult] = []
        for spec, claim in zip(specs, claims, strict=True):
            holder = settlement.blocking_holder(
                spec,
                self._by_idempotency_key.get,
                lambda job_id: job_id if job_id in self._jobs else None,
                self._active_by_unique_key.get,
            )
            if holder is not None:
                results.append(EnqueueResult(self._snapshot(holder), duplicate=True))
                continue
            job = settlement.enqueued(spec, now, claim)
            self._put(self._stow(job, ("args", "kwargs")))
            if spec.idempotency_key is not None:
                self._by_idempotency_key[spec.idempotency_key] = job.id
            if spec.workflow_id is not None:
                self._workflows[job.id] = spec.workflow_id
            if spec.depends_on:
                await self._wait_for_parents(spec)
            results.append(EnqueueResult(self._snapshot(job.id), duplicate=False))
        if any(not r.duplicate for r in results):
            for wake in list(self._listeners):
                wake()
        return results

    def _check_parents(self, specs: Sequence[JobSpec]) -> None:
        """Refuse the batch, before anything is stored, when a spec names a parent that is
        neither stored nor earlier in the batch (as a SQL store's rollback would)."""
        earlier: set[uuid.UUID] = set()
        for spec in specs:
            status_of = {p: JobStatus.QUEUED for p in spec.depends_on if p in earlier}
            status_of.update((p, self._jobs[p].status) for p in spec.depends_on if p in self._jobs)
            dependencies.ended_at_enqueue(spec.depends_on, status_of)
            earlier.add(spec.id)

    async def _wait_for_parents(self, spec: JobSpec) -> None:
        """Record a new child's edges, then count the parents that have already ended."""
        child = spec.id
        self._parents[child] = spec.depends_on
        self._waits[child] = (len(spec.depends_on), spec.on_parent_failure, spec.parent_results)
        for parent in spec.depends_on:
            self._children[parent].append(child)
            self._open.add((child, parent))
        status_of = {p: self._jobs[p].status for p in spec.depends_on}
        ended = dependencies.ended_at_enqueue(spec.depends_on, status_of)
        if ended:
            await dependencies.propagate(self._deps, ended)

    async def _ended(self, job_id: uuid.UUID) -> None:
        """The job has just moved: if that ended it, carry it to its children."""
        status = self._jobs[job_id].status
        if job_id in self._children and dependencies.ends_parent(status):
            carried = await dependencies.propagate(self._deps, [(job_id, status)])
            if carried.cancelled and self._end_notice is not None:
                self._end_notice(list(carried.cancelled))

    def on_ended(self, notice: Callable[[list[uuid.UUID]], None]) -> None:
        """:class:`broker.storage.SupportsEndNotice`."""
        self._end_notice = notice

    def _eligible(
        self,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None,
        exclude_queues: Collection[str] = (),
    ) -> list[Job]:
        return [
            job
            for job in self._jobs.values()
            if job.status is JobStatus.QUEUED
            and job.execution_mode in modes
            and (queues is None or job.queue in queues)
            and job.queue not in exclude_queues
        ]

    async def select_eligible(
        self,
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        limit: int = 100,
        skip: Collection[uuid.UUID] = (),
        exclude_queues: Collection[str] = (),
        tasks: Collection[str] | None = None,
        exclude_keys: Collection[tuple[str, str]] = (),
    ) -> list[Job]:
        now = self._clock()
        skipped = set(skip)
        keys = set(exclude_keys)
        due = [
            job
            for job in self._eligible(modes, queues, exclude_queues)
            if job.run_at <= now
            and self._key_has_room(job)
            and job.id not in skipped
            and (tasks is None or job.task in tasks)
            and (not keys or (job.task, job.rate_key or "") not in keys)
        ]
        due.sort(key=lambda job: dispatch_key(job.priority, job.run_at, job.created_at))
        return [self._snapshot(job.id, payloads=False) for job in due[:limit]]

    async def next_run_at(
        self,
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        exclude_queues: Collection[str] = (),
    ) -> datetime | None:
        return min(
            (job.run_at for job in self._eligible(modes, queues, exclude_queues)), default=None
        )

    async def queue_settings(self) -> list[QueueSettings]:
        return [self._queue_settings[queue] for queue in sorted(self._queue_settings)]

    async def save_queue_settings(self, settings: QueueSettings) -> None:
        if settings.empty:
            self._queue_settings.pop(settings.queue, None)
        else:
            self._queue_settings[settings.queue] = settings

    def _key_has_room(self, job: Job) -> bool:
        if job.concurrency_key is None or job.concurrency_limit is None:
            return True
        return self._active_by_key[job.concurrency_key] < job.concurrency_limit

    async def mark_handed_off(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, worker_id: str
    ) -> Job | None:
        claimed = await self.mark_handed_off_many([Claim(job_id, handoff_id, worker_id)])
        return claimed[0] if claimed else None

    async def mark_handed_off_many(self, claims: Sequence[Claim]) -> list[Job]:
        now = self._clock()
        claimed: list[Job] = []
        for claim in claims:
            job = self._jobs.get(claim.job_id)
            if (
                job is None
                or job.status is not JobStatus.QUEUED
                or job.run_at > now
                or not self._key_has_room(job)
            ):
                continue
            if job.concurrency_key is not None:
                self._active_by_key[job.concurrency_key] += 1
            job = settlement.apply(job, settlement.hand_off(claim, now))
            self._put(job)
            try:
                claimed.append(self._snapshot(job.id))
            except PayloadIntegrityError as exc:
                log_refused_at_claim(claim, exc)
                self._settle(settlement.payload_refused(claim, exc))
        return claimed

    def _release_key(self, job: Job) -> None:
        if job.concurrency_key is not None:
            self._active_by_key[job.concurrency_key] -= 1
            if self._active_by_key[job.concurrency_key] <= 0:
                del self._active_by_key[job.concurrency_key]

    def _move(self, job: Job, move: settlement.Move) -> None:
        if move.releases_slot:
            self._release_key(job)
        self._put(
            self._stow(settlement.apply(job, move), [f for f in move.changes if f in _HOLLOW])
        )

    def _settle(self, s: Settlement) -> bool:
        job = self._jobs.get(s.job_id)
        if job is None or not settlement.accepts(job.status, job.handoff_id, s):
            return False
        # The store keeps its own copy: the caller may go on using its result.
        s = replace(s, result=copy.deepcopy(s.result))
        self._move(job, settlement.settle(s, self._clock()))
        return True

    async def settle_many(self, settlements: Sequence[Settlement]) -> list[bool]:
        applied = []
        for s in settlements:
            ok = self._settle(s)
            if ok:
                await self._ended(s.job_id)
            applied.append(ok)
        return applied

    async def save_checkpoints(self, saves: Sequence[CheckpointSave]) -> list[bool]:
        return [self._save_checkpoint(save) for save in saves]

    def _save_checkpoint(self, save: CheckpointSave) -> bool:
        job = self._jobs.get(save.job_id)
        if job is None or not settlement.accepts_checkpoint(
            job.status, job.handoff_id, job.checkpoint_seq, save
        ):
            return False
        save = replace(save, state=copy.deepcopy(save.state))
        self._move(job, settlement.save_checkpoint(save, self._clock()))
        return True

    async def save_progress(self, updates: Sequence[ProgressUpdate]) -> list[bool]:
        accepted = []
        for update in updates:
            job = self._jobs.get(update.job_id)
            ok = job is not None and settlement.accepts(job.status, job.handoff_id, update)
            if job is not None and ok:
                self._move(job, settlement.record_progress(update))
            accepted.append(ok)
        return accepted

    async def complete(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, result: JSONValue = None
    ) -> bool:
        [ok] = await self.settle_many(
            [Settlement(job_id, handoff_id, Outcome.COMPLETE, result=result)]
        )
        return ok

    async def fail(
        self,
        job_id: uuid.UUID,
        handoff_id: uuid.UUID,
        error: str,
        retry_at: datetime | None,
    ) -> bool:
        [ok] = await self.settle_many(
            [Settlement(job_id, handoff_id, Outcome.FAIL, error=error, run_at=retry_at)]
        )
        return ok

    async def reschedule(self, job_id: uuid.UUID, handoff_id: uuid.UUID, run_at: datetime) -> bool:
        return self._settle(Settlement(job_id, handoff_id, Outcome.RESCHEDULE, run_at=run_at))

    async def return_to_queue(self, job_id: uuid.UUID, handoff_id: uuid.UUID) -> bool:
        return self._settle(Settlement(job_id, handoff_id, Outcome.RETURN))

    async def handoffs_for_worker(self, worker_id: str) -> list[Job]:
        return [
            self._snapshot(job.id)
            for job in self._jobs.values()
            if job.status is JobStatus.HANDED_OFF and job.worker_id == worker_id
        ]

    async def cancel(self, job_id: uuid.UUID) -> Job | None:
        job = self._jobs.get(job_id)
        if job is None:
            return None
        move = settlement.cancel(job.status, self._clock())
        if move is not None:
            self._move(job, move)
            await self._ended(job_id)
        return self._snapshot(job_id)

    async def retry_dead(self, job_id: uuid.UUID) -> Job | None:
        job = self._jobs.get(job_id)
        if job is None:
            return None
        if job.status is JobStatus.FAILED:
            holder = (
                self._active_by_unique_key.get(job.unique_key)
                if job.unique_key is not None
                else None
            )
            if holder is not None:
                raise UniqueKeyTakenError(
                    f"job {job_id} cannot be retried: job {holder} holds its unique key "
                    f"{job.unique_key!r} while it is queued or running",
                    holder_id=holder,
                )
            self._move(job, settlement.revive(self._clock()))
        return self._snapshot(job_id)

    async def get_job(self, job_id: uuid.UUID) -> Job | None:
        return self._snapshot(job_id) if job_id in self._jobs else None

    def _workflow(self, workflow_id: uuid.UUID) -> tuple[list[uuid.UUID], list[Edge]]:
        """A workflow's members in enqueue order, and their edges (``workflow_id`` may name
        one of its jobs)."""
        workflow_id = self._workflows.get(workflow_id, workflow_id)
        members = [j for j, w in self._workflows.items() if w == workflow_id]
        edges = [
            Edge(child, parent, (child, parent) not in self._open)
            for child in members
            for parent in self._parents.get(child, ())
        ]
        return members, edges

    async def get_workflow(self, workflow_id: uuid.UUID, *, limit: int) -> StoredWorkflow | None:
        members, edges = self._workflow(workflow_id)
        if not members:
            return None
        shown = set(members[:limit])
        return StoredWorkflow(
            self._workflows[members[0]],
            [_summary(self._jobs[j]) for j in dependencies.parents_first(members[:limit], edges)],
            [e for e in edges if e.child in shown],
            truncated=len(members) > limit,
        )

    async def retry_workflow(self, workflow_id: uuid.UUID) -> list[uuid.UUID]:
        ids, edges = self._workflow(workflow_id)
        members = [
            dependencies.Member(j, self._jobs[j].status, self._jobs[j].last_error) for j in ids
        ]
        parent_status = {
            e.parent: self._jobs[e.parent].status for e in edges if e.parent in self._jobs
        }
        plan = dependencies.retry_plan(members, edges, parent_status)
        for job_id in plan.requeue:  # refused before anything changes, as one transaction
            job = self._jobs[job_id]
            holder = self._active_by_unique_key.get(job.unique_key) if job.unique_key else None
            if holder is not None:
                raise UniqueKeyTakenError(
                    f"job {job_id} cannot be retried: job {holder} holds its unique key "
                    f"{job.unique_key!r} while it is queued or running",
                    holder_id=holder,
                )
        now = self._clock()
        for job_id in plan.requeue:
            self._move(self._jobs[job_id], settlement.revive(now))
        for job_id in plan.revive:
            self._put(
                replace(
                    self._jobs[job_id], status=JobStatus.WAITING, last_error=None, updated_at=now
                )
            )
        self._open.update(plan.reopen)
        for child, pending in plan.pending.items():
            _, on_failure, mode = self._waits[child]
            self._waits[child] = (pending, on_failure, mode)
        if plan.requeue:
            for wake in list(self._listeners):
                wake()
        return [*plan.requeue, *plan.revive]

    async def list_jobs(
        self,
        job_filter: JobFilter | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
        include_payload: bool = True,
    ) -> JobPage:
        f = job_filter or JobFilter()
        rows = sorted(
            (
                job
                for job in self._jobs.values()
                if (f.statuses is None or job.status in f.statuses)
                and (f.queues is None or job.queue in f.queues)
                and (f.tasks is None or job.task in f.tasks)
            ),
            key=_newest_first_key,
            reverse=True,
        )
        if cursor is not None:
            after = _decode_cursor(cursor)
            rows = [job for job in rows if _newest_first_key(job) < after]
        page = rows[:limit]
        more = len(rows) > limit
        return JobPage(
            jobs=[self._snapshot(job.id) if include_payload else _summary(job) for job in page],
            next_cursor=_encode_cursor(page[-1]) if more and page else None,
        )

    def cursor_after(self, job: Job) -> str:
        return _encode_cursor(job)

    async def count_jobs(self) -> list[QueueCount]:
        counts: Counter[tuple[str, JobStatus]] = Counter()
        oldest: defaultdict[str, datetime | None] = defaultdict(lambda: None)
        for job in self._jobs.values():
            counts[(job.queue, job.status)] += 1
            if job.status is JobStatus.QUEUED:
                current = oldest[job.queue]
                oldest[job.queue] = job.run_at if current is None else min(current, job.run_at)
        return [
            QueueCount(
                queue=queue,
                status=status,
                count=n,
                oldest_run_at=oldest[queue] if status is JobStatus.QUEUED else None,
            )
            for (queue, status), n in sorted(counts.items())
        ]

    async def prune(
        self,
        *,
        older_than: datetime | None = None,
        keep_latest: int | None = None,
        statuses: Collection[JobStatus] | None = None,
        batch_size: int = 1000,
    ) -> int:
        prunable = TERMINAL_STATUSES if statuses is None else TERMINAL_STATUSES & set(statuses)
        terminal = sorted(
            (
                job
                for job in self._jobs.values()
                if job.status in prunable and not self._awaited(job.id)
            ),
            key=lambda job: (job.updated_at, job.id.bytes),
            reverse=True,
        )
        doomed: list[Job] = []
        for index, job in enumerate(terminal):
            too_old = older_than is not None and job.updated_at < older_than
            beyond_keep = keep_latest is not None and index >= keep_latest
            if too_old or beyond_keep:
                doomed.append(job)
        for job in doomed:
            del self._jobs[job.id]
            for field in _HOLLOW:
                self._payloads.pop((job.id, field), None)
            if job.idempotency_key is not None:
                self._by_idempotency_key.pop(job.idempotency_key, None)
            self._forget_edges(job.id)
        return len(doomed)

    def _awaited(self, job_id: uuid.UUID) -> bool:
        """Whether a waiting child will still need this job's result: then retention keeps it."""
        return any(
            self._jobs[c].status is JobStatus.WAITING
            for c in self._children.get(job_id, ())
            if c in self._jobs
        )

    def _forget_edges(self, job_id: uuid.UUID) -> None:
        """A pruned job's own edges and workflow membership go with it."""
        self._children.pop(job_id, None)
        self._waits.pop(job_id, None)
        self._workflows.pop(job_id, None)
        for parent in self._parents.pop(job_id, ()):
            self._open.discard((job_id, parent))

    def _put(self, job: Job) -> None:
        """Store ``job``, keeping the index of active unique keys in step with its status."""
        self._jobs[job.id] = job
        key = job.unique_key
        if key is None:
            return
        if job.status in ACTIVE_STATUSES:
            self._active_by_unique_key[key] = job.id
        elif self._active_by_unique_key.get(key) == job.id:
            del self._active_by_unique_key[key]

    def _stow(self, job: Job, fields: Collection[str]) -> Job:
        """``job`` as kept: each of ``fields`` (just set) larger than the threshold moves to
        the payloads, and one now small enough drops the payload it replaces."""
        moved: dict[str, JSONValue] = {}
        for field in fields:
            value = getattr(job, field)
            self._payloads.pop((job.id, field), None)
            stored = list(value) if field == "args" else value
            limit = self._offload_threshold
            if limit is not None and value is not None and encoded_size(stored) > limit:
                text = compact_json(stored)
                self._payloads[(job.id, field)] = (text, payload_digest(text))
                moved[field] = _HOLLOW[field]
        return replace(job, **moved) if moved else job

    def _snapshot(self, job_id: uuid.UUID, *, payloads: bool = True) -> Job:
        """A deep copy, so callers can never mutate the store through a returned job; with
        ``payloads=False`` offloaded values stay out (as dispatch's selection reads it).
        Offloaded values are checked and decoded anew (so they are copies already), and
        one that fails its check raises :class:`~broker.storage.PayloadIntegrityError`."""
        job = copy.deepcopy(self._jobs[job_id])
        if payloads:
            loaded = {
                f: check_payload(job_id, f, *self._payloads[(job_id, f)], _DECODE[f])
                for f in _HOLLOW
                if (job_id, f) in self._payloads
            }
            if loaded:
                job = replace(job, **loaded)
        return job


class _Dependencies:
    """:class:`broker.dependencies.DependencyStore` over a memory store: nothing in it
    suspends, so a walk is atomic with the move that started it."""

    def __init__(self, store: MemoryAdapter) -> None:
        self._store = store

    async def open_edges(
        self, parent_ids: Sequence[uuid.UUID]
    ) -> list[tuple[uuid.UUID, uuid.UUID]]:
        s = self._store
        edges = [(c, p) for p in parent_ids for c in s._children.get(p, ()) if (c, p) in s._open]
        s._open.difference_update(edges)
        return edges

    async def count_down(self, child_id: uuid.UUID, parents: int) -> Waiting | None:
        s = self._store
        job = s._jobs.get(child_id)
        if job is None or child_id not in s._waits:
            return None
        pending, on_failure, mode = s._waits[child_id]
        s._waits[child_id] = (pending - parents, on_failure, mode)
        args = s._snapshot(child_id).args
        return Waiting(job.status, pending - parents, on_failure, mode, args)

    async def parent_results(self, child_id: uuid.UUID) -> list[JSONValue]:
        s = self._store
        results: list[JSONValue] = []
        for parent in s._parents[child_id]:
            job = s._jobs.get(parent)
            done = job is not None and job.status is JobStatus.COMPLETED
            results.append(s._snapshot(parent).result if done else None)
        return results

    async def release(self, child_id: uuid.UUID, args: tuple[JSONValue, ...]) -> None:
        s = self._store
        now = s._clock()
        job = replace(s._jobs[child_id], args=args, status=JobStatus.QUEUED, updated_at=now)
        s._put(s._stow(job, ["args"]))
        for wake in list(s._listeners):
            wake()

    async def cancel_waiting(self, child_id: uuid.UUID, reason: str) -> None:
        s = self._store
        now = s._clock()
        job = s._jobs[child_id]
        s._put(replace(job, status=JobStatus.CANCELLED, last_error=reason, updated_at=now))


def _summary(job: Job) -> Job:
    """``job`` without its payload; every field left is immutable, so unlike
    :meth:`MemoryAdapter._snapshot` it needs no deep copy (the costly part of a listing)."""
    return replace(job, **_HOLLOW)


def _newest_first_key(job: Job) -> tuple[datetime, bytes]:
    return (job.created_at, job.id.bytes)


def _encode_cursor(job: Job) -> str:
    raw = f"{job.created_at.isoformat()}|{job.id}".encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, bytes]:
    created, job_id = base64.urlsafe_b64decode(cursor.encode()).decode().split("|")
    return (datetime.fromisoformat(created), uuid.UUID(job_id).bytes)
