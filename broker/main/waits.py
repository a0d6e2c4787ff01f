"""Pushed results: the I/O of the waiter registry (:mod:`broker.core.waiters`).

A ``wait_job`` subscribes, then reads the job once; every path that may end a job in the
main calls :meth:`Waits.ended` with the job ids (the report settler after the store
confirmed the settle, a cancel, the recovery ledger when a lost attempt ends a job dead,
the store's end notice for the dependents such an end cancelled),
and only the ids someone waits for are read back and answered. A waiter whose time is up
reads the job once more (an end no notice carried is answered then), else is answered
``wait_pending``; its client asks again.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable

from broker.core.waiters import Waiter, Waiters
from broker.jobs import Job
from broker.main.sessions import Session
from broker.model.logs import log_event
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")


def job_info(request_id: str, job: Job | None) -> protocol.JobInfo:
    return protocol.JobInfo(request_id=request_id, job=job.to_dict() if job else None)


class Waits:
    def __init__(
        self,
        read: Callable[[uuid.UUID], Awaitable[Job | None]],
        session: Callable[[int], Session | None],
        *,
        per_connection: int,
    ) -> None:
        """``read`` reads a job from the store; ``session`` finds a connection by id."""
        self.waiters = Waiters(per_connection)
        self._read = read
        self._session = session
        self._tasks: set[asyncio.Task[None]] = set()

    async def wait(self, session: Session, msg: protocol.WaitJob) -> protocol.Message | None:
        """Subscribe, then read the job once: the answer if it has ended already, else
        ``None`` (a notice or the timer answers later).

        :raises OverLimitError: the connection waits for as many jobs as it may.
        """
        loop = asyncio.get_running_loop()
        waiter = self.waiters.subscribe(
            session.id, msg.request_id, msg.job_id, loop.time() + msg.timeout
        )
        loop.call_at(waiter.until, self._expire, waiter)
        try:
            job = await self._read(msg.job_id)
        except BaseException:
            self.waiters.take(waiter)
            raise
        if (job is None or job.status.is_terminal) and self.waiters.take(waiter):
            return job_info(msg.request_id, job)
        return None

    def ended(self, job_ids: Iterable[uuid.UUID]) -> None:
        """Jobs that may have ended (the one notice every ending path calls): those
        someone waits for are read back, and their waiters answered if they did."""
        waited = self.waiters.waited_on(job_ids)
        if waited:
            task = asyncio.get_running_loop().create_task(self._deliver(waited))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def disconnected(self, peer: int) -> None:
        self.waiters.disconnected(peer)

    async def _deliver(self, job_ids: list[uuid.UUID]) -> None:
        for job_id in job_ids:
            try:
                job = await self._read(job_id)
            except Exception as exc:  # its waiters' timers answer them; the client asks again
                log_event(
                    logger, logging.WARNING, "reading an ended job failed", job_id=job_id, error=exc
                )
                continue
            if job is not None and not job.status.is_terminal:
                continue  # it runs again (a retry): its waiters keep waiting
            for waiter in self.waiters.ended(job_id):
                self._answer(waiter, job_info(waiter.request_id, job))

    def _expire(self, waiter: Waiter) -> None:
        if self.waiters.take(waiter):
            task = asyncio.get_running_loop().create_task(self._last_look(waiter))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _last_look(self, waiter: Waiter) -> None:
        """A waiter whose time is up: the job is read once more, so an end no notice
        carried (a write by another process; a dependent cancelled inside its parent's
        settle by a store without :class:`~broker.storage.SupportsEndNotice`) is answered
        now rather than taken for a timeout."""
        reply: protocol.Message = protocol.WaitPending(request_id=waiter.request_id)
        try:
            job = await self._read(waiter.job_id)
        except Exception as exc:  # the client asks again; that wait reads it once more
            log_event(
                logger,
                logging.WARNING,
                "reading a waited job failed",
                job_id=waiter.job_id,
                error=exc,
            )
        else:
            if job is None or job.status.is_terminal:
                reply = job_info(waiter.request_id, job)
        self._answer(waiter, reply)

    def _answer(self, waiter: Waiter, reply: protocol.Message) -> None:
        session = self._session(waiter.peer)
        if session is not None:
            session.reply(reply)
