"""A custom storage adapter: counts, times and logs every store operation.

It wraps any other adapter (the in-memory one, SQLite, PostgreSQL) and passes each
call straight through, so it keeps every rule of the storage contract that the
wrapped store keeps, and adds one thing: a record of what the main asked of the
store and how long it took. A fenced-out move (``False`` from ``complete``,
``fail``, ``reschedule``, ``return_to_queue`` or an entry of ``settle_many``) is
logged at INFO, because it means a stale lease was refused.

It does not inherit from anything: the contract is structural (``typing.Protocol``).

Plug it into ``broker-main`` with ``--adapter logging_adapter:create`` (the module
must be importable, e.g. ``PYTHONPATH=docs/examples``). ``docs/adapters.md`` walks
through it; ``tests/integration/test_docs_example.py`` certifies it with the conformance suite.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import TypeVar

import adapters
from broker.exceptions import ConfigurationError
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
)
from broker.storage import (
    Capabilities,
    JobFilter,
    JobPage,
    QueueCount,
    StorageAdapter,
    SupportsNotify,
    TaskRecord,
)

logger = logging.getLogger("logging_adapter")
T = TypeVar("T")

FENCED = frozenset({"complete", "fail", "reschedule", "return_to_queue"})


class LoggingAdapter:
    """Delegates to ``inner``; ``calls`` and ``errors`` count operations by name."""

    def __init__(self, inner: StorageAdapter) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.fenced_out: Counter[str] = Counter()

    async def _call(self, op: str, call: Awaitable[T]) -> T:
        self.calls[op] += 1
        started = time.perf_counter()
        try:
            result = await call
        except Exception as exc:
            # Never swallow: the main reads an exception as "outcome unknown".
            self.errors[op] += 1
            logger.warning("store %s raised %r", op, exc)
            raise
        elapsed_ms = (time.perf_counter() - started) * 1000
        if op in FENCED and result is False:
            self.fenced_out[op] += 1
            logger.info("store %s fenced out a stale lease (%.2f ms)", op, elapsed_ms)
        else:
            logger.debug("store %s ok (%.2f ms)", op, elapsed_ms)
        return result

    # -- lifecycle -----------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        # Declare exactly what the wrapped store can do: the conformance suite
        # checks (or skips) behaviour by these flags.
        return self.inner.capabilities

    async def setup(self) -> None:
        await self._call("setup", self.inner.setup())

    async def close(self) -> None:
        await self._call("close", self.inner.close())

    def listen(self, on_wake: Callable[[], None]) -> AbstractAsyncContextManager[None]:
        if not isinstance(self.inner, SupportsNotify):
            raise ConfigurationError(f"{self.inner!r} cannot notify; check listen_notify")
        self.calls["listen"] += 1
        return self.inner.listen(on_wake)

    # -- enqueue and dispatch --------------------------------------------------------

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        return await self._call("enqueue", self.inner.enqueue(spec))

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        return await self._call("enqueue_many", self.inner.enqueue_many(specs))

    async def select_eligible(
        self,
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        limit: int = 100,
        skip: Collection[uuid.UUID] = (),
        tasks: Collection[str] | None = None,
    ) -> list[Job]:
        call = self.inner.select_eligible(
            modes=modes, queues=queues, limit=limit, skip=skip, tasks=tasks
        )
        return await self._call("select_eligible", call)

    async def next_run_at(
        self, *, modes: Collection[ExecutionMode], queues: Collection[str] | None = None
    ) -> datetime | None:
        return await self._call("next_run_at", self.inner.next_run_at(modes=modes, queues=queues))

    async def mark_handed_off(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, worker_id: str
    ) -> Job | None:
        call = self.inner.mark_handed_off(job_id, handoff_id, worker_id)
        return await self._call("mark_handed_off", call)

    async def mark_handed_off_many(self, claims: Sequence[Claim]) -> list[Job]:
        return await self._call("mark_handed_off_many", self.inner.mark_handed_off_many(claims))

    # -- fenced transitions ------------------------------------------------------------

    async def settle_many(self, settlements: Sequence[Settlement]) -> list[bool]:
        accepted = await self._call("settle_many", self.inner.settle_many(settlements))
        for settlement, ok in zip(settlements, accepted, strict=True):
            if not ok:
                self.fenced_out[f"settle_many:{settlement.outcome}"] += 1
                logger.info("store settle_many fenced out a stale lease (%s)", settlement.outcome)
        return accepted

    async def save_checkpoints(self, saves: Sequence[CheckpointSave]) -> list[bool]:
        taken = await self._call("save_checkpoints", self.inner.save_checkpoints(saves))
        for save, ok in zip(saves, taken, strict=True):
            if not ok:
                self.fenced_out["save_checkpoints"] += 1
                logger.info("store save_checkpoints fenced out checkpoint %d", save.seq)
        return taken

    async def save_progress(self, updates: Sequence[ProgressUpdate]) -> list[bool]:
        return await self._call("save_progress", self.inner.save_progress(updates))

    async def complete(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, result: JSONValue = None
    ) -> bool:
        return await self._call("complete", self.inner.complete(job_id, handoff_id, result))

    async def fail(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, error: str, retry_at: datetime | None
    ) -> bool:
        return await self._call("fail", self.inner.fail(job_id, handoff_id, error, retry_at))

    async def reschedule(self, job_id: uuid.UUID, handoff_id: uuid.UUID, run_at: datetime) -> bool:
        return await self._call("reschedule", self.inner.reschedule(job_id, handoff_id, run_at))

    async def return_to_queue(self, job_id: uuid.UUID, handoff_id: uuid.UUID) -> bool:
        call = self.inner.return_to_queue(job_id, handoff_id)
        return await self._call("return_to_queue", call)

    # -- operators -------------------------------------------------------------------

    async def handoffs_for_worker(self, worker_id: str) -> list[Job]:
        return await self._call("handoffs_for_worker", self.inner.handoffs_for_worker(worker_id))

    async def cancel(self, job_id: uuid.UUID) -> Job | None:
        return await self._call("cancel", self.inner.cancel(job_id))

    async def retry_dead(self, job_id: uuid.UUID) -> Job | None:
        return await self._call("retry_dead", self.inner.retry_dead(job_id))

    async def get_job(self, job_id: uuid.UUID) -> Job | None:
        return await self._call("get_job", self.inner.get_job(job_id))

    async def declare_tasks(
        self,
        worker_id: str,
        declarations: Mapping[str, Mapping[str, JSONValue]],
        seen_at: datetime,
    ) -> None:
        await self._call(
            "declare_tasks", self.inner.declare_tasks(worker_id, declarations, seen_at)
        )

    async def task_catalog(
        self, *, tasks: Collection[str] | None = None, limit: int | None = None
    ) -> list[TaskRecord]:
        return await self._call("task_catalog", self.inner.task_catalog(tasks=tasks, limit=limit))

    async def forget_tasks(
        self, live_workers: Collection[str], seen_at: datetime, gone_before: datetime
    ) -> int:
        return await self._call(
            "forget_tasks", self.inner.forget_tasks(live_workers, seen_at, gone_before)
        )

    async def list_jobs(
        self,
        job_filter: JobFilter | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
        include_payload: bool = True,
    ) -> JobPage:
        call = self.inner.list_jobs(
            job_filter, limit=limit, cursor=cursor, include_payload=include_payload
        )
        return await self._call("list_jobs", call)

    def cursor_after(self, job: Job) -> str:
        return self.inner.cursor_after(job)  # pure encoding: nothing to count or time

    async def count_jobs(self) -> list[QueueCount]:
        return await self._call("count_jobs", self.inner.count_jobs())

    async def prune(
        self,
        *,
        older_than: datetime | None = None,
        keep_latest: int | None = None,
        statuses: Collection[JobStatus] | None = None,
        batch_size: int = 1000,
    ) -> int:
        call = self.inner.prune(
            older_than=older_than, keep_latest=keep_latest, statuses=statuses, batch_size=batch_size
        )
        return await self._call("prune", call)


def create(url: str) -> LoggingAdapter:
    """The factory ``broker-main --adapter logging_adapter:create`` calls with its URL."""
    return LoggingAdapter(adapters.open_store(url))
