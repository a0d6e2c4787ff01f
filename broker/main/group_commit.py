"""Group commit for independent callers: the items of every caller that arrives while a
commit is running go into the next one, so a thousand clients enqueueing one job each cost
a handful of transactions (and fsyncs) instead of a thousand, and never hold a thousand
database connections.

A caller's items stay all-or-none: when a shared commit fails for a reason that would
recur (a value the store refuses, say), each caller's items are committed again on their
own, so one caller's bad job fails that caller alone. A transient failure (the store is
unreachable) is everybody's: every caller in the batch gets it, as it would have alone.

A caller that finds no commit running commits its own items at once, in its own task:
a lone enqueue then costs no task and no wake-up beyond its own statement. Callers that
arrive meanwhile wait for the runner task that takes over once it is done.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
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
        future: asyncio.Future[list[R]] = asyncio.get_running_loop().create_future()
        if self._busy or self._waiting:
            self._waiting.append((list(items), future))
            if not self._busy:  # the runner was cancelled with callers left: a new one
                self._hand_over()
            return await future
        self._busy = True  # nothing running, nobody waiting: this caller commits now
        try:
            await self._commit_batch([(list(items), future)])
        finally:
            self._hand_over()
        return future.result()

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
