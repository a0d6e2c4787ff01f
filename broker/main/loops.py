"""How the main's background work survives failure: the one retry loop, and the two
ways of writing many small things to the store in few transactions.

The main's long-lived tasks (the store listener, retention, lease recovery, loading the
orphans, storing a task catalog) must outlive any error in one pass: a task that died of
a lost database connection would leave the broker running without it and nobody told.
:func:`retrying` is the single place that decides how such a failure is handled, so every
loop logs it the same way (``"<what> failed, retrying error=..."``) and none can swallow a
cancellation by mistake.

:class:`GroupCommit` batches callers that wait for their answer (enqueues);
:class:`BatchWriter` batches work queued by the main itself (reports, checkpoints), retries
a batch while the store's trouble is transient and isolates any other failure by halving
the batch, so one bad item never holds up the others; its retries are :func:`retrying`'s.
A group commit's failure goes back to its callers instead, who each decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Generic, TypeVar

from broker.exceptions import transient
from broker.model.logs import log_event

T = TypeVar("T")
R = TypeVar("R")

Sleep = Callable[[float], Awaitable[None]]

Spawn = Callable[[Coroutine[Any, Any, None], str], None]
"""Start a background task the main cancels when it stops (the coroutine, its name)."""


def _always(_exc: Exception) -> bool:
    return True


def _never() -> bool:
    return False


async def retrying(
    what: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    interval: float,
    logger: logging.Logger,
    on_error: Callable[[], None] | None = None,
    wake: asyncio.Event | None = None,
    retry_if: Callable[[Exception], bool] = _always,
    stopping: Callable[[], bool] = _never,
    fields: Mapping[str, Any] | None = None,
    sleep: Sleep = asyncio.sleep,
) -> T:
    """Await ``attempt()`` until it returns, and return what it returned.

    Each failure is logged as a warning (``"<what> failed, retrying"``, with the error
    and ``fields``), then ``on_error`` is called (say, to fall back to polling while a
    listener is down), and the next attempt comes ``interval`` seconds later, or as
    soon as ``wake`` is set (it is cleared then, so one wake-up shortens one wait).

    A failure ``retry_if`` refuses (one that would recur: retrying cannot help) is raised
    at once, unlogged, for the caller to handle; so is any failure once ``stopping()``
    (the main is stopping: whatever is left is the next main's). Cancellation is never
    caught: it ends the retries at once.
    """
    while True:
        try:
            return await attempt()
        except Exception as exc:  # not CancelledError, a BaseException: that ends the loop
            if not retry_if(exc):
                raise
            log_event(
                logger,
                logging.WARNING,
                f"{what} failed, retrying",
                **(fields or {}),
                error=repr(exc),
            )
            if on_error is not None:
                on_error()
            if stopping():
                raise
        if wake is None:
            await sleep(interval)
        else:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation
            # that arrives as ``wake`` is set.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await wake.wait()
            wake.clear()


class BatchWriter(Generic[T, R]):
    """Writes queued items to the store in group commits: every item queued while a
    batch was being written goes into the next (up to ``batch`` items), so one fsync
    stores many under load.

    A batch is retried while the store's trouble is transient (:func:`retrying`); any
    other failure would recur on every attempt, so the batch is split in halves, each
    written on its own, until the item behind the failure stands alone and is handed to
    ``unstorable``. Once the main is stopping, a batch that fails is left unanswered
    (its peer sends it again to the next main).
    """

    def __init__(
        self,
        what: str,
        *,
        write: Callable[[list[T]], Awaitable[R]],
        written: Callable[[list[T], R], None],
        unstorable: Callable[[T, Exception], Awaitable[None]],
        batch: int,
        retry_interval: float,
        stopping: Callable[[], bool],
        logger: logging.Logger,
        count_as: str,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        """``write(items)`` stores a batch and returns its answer, which
        ``written(items, answer)`` then hands on; ``what`` names the write in log lines
        (``"<what> failed, retrying"``), with the batch's size as field ``count_as``."""
        self._what = what
        self._write = write
        self._written = written
        self._unstorable = unstorable
        self._batch = batch
        self._retry_interval = retry_interval
        self._stopping = stopping
        self._logger = logger
        self._count_as = count_as
        self._sleep = sleep
        self.queued: list[T] = []
        """Items waiting for the next batch."""
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def add(self, item: T) -> None:
        self.queued.append(item)
        self._idle.clear()
        self._ready.set()

    async def wait_idle(self) -> None:
        """Until every queued item has been written and handed on."""
        await self._idle.wait()

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self.queued:
                size = self._batch
                batch, self.queued = self.queued[:size], self.queued[size:]
                await self.write(batch)
            self._idle.set()

    async def write(self, batch: list[T]) -> None:
        """Write ``batch`` and hand its answer on; see the class for what a failure does."""
        try:
            answer = await retrying(
                self._what,
                lambda: self._write(batch),
                interval=self._retry_interval,
                logger=self._logger,
                retry_if=transient,
                stopping=self._stopping,
                fields={self._count_as: len(batch)},
                sleep=self._sleep,
            )
        except Exception as exc:
            if transient(exc):  # given up on because the main is stopping
                return
            await self._isolate(batch, exc)
            return
        # A loop turn before handing the answer on and one after: a batch's answer and
        # the next batch's making are each a long step at a drain's rate, and a client's
        # line or an enqueue's commit that arrives meanwhile waits for the rest of the
        # loop's turn (issue 35, the urgent job; bench/README.md, "Loop turns").
        await asyncio.sleep(0)
        self._written(batch, answer)
        await asyncio.sleep(0)

    async def _isolate(self, batch: list[T], exc: Exception) -> None:
        if len(batch) == 1:
            await self._unstorable(batch[0], exc)
            return
        size: dict[str, Any] = {self._count_as: len(batch)}
        log_event(
            self._logger,
            logging.WARNING,
            f"{self._what} failed, splitting the batch to isolate the cause",
            **size,
            error=repr(exc),
        )
        half = len(batch) // 2
        await self.write(batch[:half])
        await self.write(batch[half:])


class GroupCommit(Generic[T, R]):
    """Group commit for independent callers: the items of every caller that arrives while
    a commit is running go into the next one, so a thousand clients enqueueing one job
    each cost a handful of transactions (and fsyncs) instead of a thousand, and never hold
    a thousand database connections.

    A caller's items stay all-or-none: when a shared commit fails for a reason that would
    recur (a value the store refuses, say), each caller's items are committed again on
    their own, so one caller's bad job fails that caller alone. A transient failure (the
    store is unreachable) is everybody's: every caller in the batch gets it, as it would
    have alone.

    A caller that finds no commit running commits its own items at once, in its own
    task: a lone enqueue then costs no task and no wake-up beyond its own statement.
    Callers that arrive meanwhile wait for the runner task that takes over once it is
    done.
    """

    def __init__(
        self,
        commit: Callable[[list[T]], Awaitable[list[R]]],
        *,
        max_batch: int,
        shared_failure: Callable[[Exception], bool],
    ) -> None:
        """``commit`` stores items in one transaction and returns one result per item, in
        order; ``shared_failure(exc)`` says whether a failed shared commit failed for all
        its callers alike (then each gets ``exc``) rather than for one caller's items."""
        self._commit = commit
        self._max_batch = max_batch
        self._shared_failure = shared_failure
        self._waiting: deque[tuple[list[T], asyncio.Future[list[R]]]] = deque()
        self._busy = False
        """A commit is running, in a caller's task or in the runner's; while it is, callers
        wait in ``_waiting`` (which is empty whenever this is false)."""
        self._runner: asyncio.Task[None] | None = None

    async def submit(self, items: Sequence[T]) -> list[R]:
        """Commit ``items`` (all or none) with whatever else is waiting; their results."""
        if self._busy or self._waiting:
            future: asyncio.Future[list[R]] = asyncio.get_running_loop().create_future()
            self._waiting.append((list(items), future))
            if not self._busy:  # the runner was cancelled with callers left: a new one
                self._hand_over()
            return await future
        self._busy = True  # nothing running, nobody waiting: this caller commits now
        try:
            # Its own items alone, so its failure is its own (as _commit_batch settles a
            # batch of one caller), with no future to settle and read back.
            return await self._commit(list(items))
        finally:
            self._hand_over()

    def _hand_over(self) -> None:
        """No commit is running: the runner takes whoever is waiting."""
        if self._waiting:
            self._busy = True
            self._runner = asyncio.create_task(self._run(), name="broker-group-commit")
        else:
            self._busy = False

    async def _run(self) -> None:
        try:
            while self._waiting:
                batch = self._take()
                if batch:
                    await self._commit_batch(batch)
        finally:
            self._runner = None
            self._busy = False

    def _take(self) -> list[tuple[list[T], asyncio.Future[list[R]]]]:
        """The next callers, up to ``max_batch`` items (at least one caller); callers that
        gave up meanwhile (their connection closed) are dropped before their items are
        written."""
        batch: list[tuple[list[T], asyncio.Future[list[R]]]] = []
        size = 0
        while self._waiting:
            items, future = self._waiting[0]
            if batch and size + len(items) > self._max_batch:
                break
            self._waiting.popleft()
            if not future.done():
                batch.append((items, future))
                size += len(items)
        return batch

    async def _commit_batch(self, batch: list[tuple[list[T], asyncio.Future[list[R]]]]) -> None:
        try:
            results = await self._commit([item for items, _ in batch for item in items])
        except Exception as exc:
            if len(batch) == 1 or self._shared_failure(exc):
                for _, future in batch:
                    _settle(future, exc)
                return
            for caller in batch:  # each caller's items alone: only the bad ones fail
                await self._commit_batch([caller])
            return
        at = 0
        for items, future in batch:
            _settle(future, results[at : at + len(items)])
            at += len(items)


def _settle(future: asyncio.Future[list[R]], outcome: list[R] | Exception) -> None:
    if future.done():  # the caller gave up while its items were being written
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


__all__ = ["BatchWriter", "GroupCommit", "Spawn", "retrying"]
