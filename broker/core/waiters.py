"""Who waits for which job to end, bounded per connection: the rule of pushed results.

A client's ``wait_job`` subscribes here before the main reads the job from the store
once, so a job that ends between the two is never missed: either the read sees it
ended, or the end's notice finds the subscription. Every path that ends a job in the
main (a settled report, a cancel, a lease given back past its recovery limit) calls
one notice, and the main's shell answers whom :meth:`Waiters.ended` names; a waiter is
answered at most once, since answering takes it out (:meth:`Waiters.take`). Each
connection may hold ``per_connection`` waiters; one more is refused, so a client that
waits on everything at once cannot grow the main's memory without bound.

Times are the main's loop time, fed in by its events; nothing here does I/O.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from broker.exceptions import OverLimitError


@dataclass(frozen=True, slots=True)
class Waiter:
    """One ``wait_job`` request: connection ``peer`` waits, as ``request_id``, for
    ``job_id`` to end, until ``until`` (loop time)."""

    peer: int
    request_id: str
    job_id: uuid.UUID
    until: float


class Waiters:
    """The waiters of every connection (see the module docstring)."""

    def __init__(self, per_connection: int) -> None:
        self.per_connection = per_connection
        self._by_job: dict[uuid.UUID, dict[tuple[int, str], Waiter]] = {}
        self._by_peer: dict[int, dict[str, Waiter]] = {}

    def subscribe(self, peer: int, request_id: str, job_id: uuid.UUID, until: float) -> Waiter:
        """Connection ``peer`` waits for ``job_id`` as ``request_id``.

        :raises OverLimitError: the connection holds ``per_connection`` waiters already,
            or one with this ``request_id``.
        """
        mine = self._by_peer.setdefault(peer, {})
        if request_id in mine:
            raise OverLimitError(f"request {request_id!r} is waiting already")
        if len(mine) >= self.per_connection:
            if not mine:
                del self._by_peer[peer]
            raise OverLimitError(
                f"this connection waits for {len(mine)} jobs already, its limit (waiters "
                "per connection); wait for fewer at once, or over more connections"
            )
        waiter = Waiter(peer, request_id, job_id, until)
        mine[request_id] = waiter
        self._by_job.setdefault(job_id, {})[peer, request_id] = waiter
        return waiter

    def waited_on(self, job_ids: Iterable[uuid.UUID]) -> list[uuid.UUID]:
        """Which of ``job_ids`` (jobs that may have ended) someone waits for: only those
        are worth reading from the store."""
        return [job_id for job_id in job_ids if job_id in self._by_job]

    def ended(self, job_id: uuid.UUID) -> list[Waiter]:
        """``job_id`` ended (or is gone): every waiter on it, taken out, to answer."""
        waiting = self._by_job.pop(job_id, {})
        for waiter in waiting.values():
            self._forget(waiter)
        return list(waiting.values())

    def take(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out to answer it (its read found the job ended, or its time
        is up: the main's timer calls this at ``until``); ``False`` when it was answered
        already, by a notice in between, or its connection ended."""
        waiting = self._by_job.get(waiter.job_id)
        if waiting is None or waiting.get((waiter.peer, waiter.request_id)) is not waiter:
            return False
        del waiting[waiter.peer, waiter.request_id]
        if not waiting:
            del self._by_job[waiter.job_id]
        self._forget(waiter)
        return True

    def disconnected(self, peer: int) -> None:
        """Connection ``peer`` ended: nobody is left to answer on it."""
        for waiter in list(self._by_peer.get(peer, {}).values()):
            self.take(waiter)
        self._by_peer.pop(peer, None)

    def _forget(self, waiter: Waiter) -> None:
        mine = self._by_peer.get(waiter.peer)
        if mine is not None:
            mine.pop(waiter.request_id, None)
            if not mine:
                del self._by_peer[waiter.peer]
