"""Client requests as the main serves them: each in a task of its own, bounded per
connection and in total, answered from the request service or with the code of the
exception that stopped it.

The rules of each request (checks before the store, paging by bytes, prune's limits)
are :mod:`broker.main.operations`; this module is the I/O around them, and the two things only
a running main can add: waking the dispatcher, and stopping a cancelled job on its
worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from broker.core import catalog
from broker.exceptions import InvalidJobError, ProtocolError
from broker.jobs import Job, JobStatus
from broker.main.operations import Operations
from broker.main.queues import QUEUE_REQUESTS, QueueControl
from broker.main.sessions import Session
from broker.main.waits import Waits, job_info
from broker.model.logs import log_event
from broker.storage import JobFilter
from broker.wire import codec
from broker.wire import errors as error_codes
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")


class _InProgress:
    """A client request in progress, counted in its connection's caps and in the requests
    a stopping main waits for, until :meth:`ended`."""

    __slots__ = ("_all", "_size", "_task", "session")

    def __init__(self, all_tasks: set[asyncio.Task[None]], session: Session) -> None:
        self._all = all_tasks
        self.session = session
        self._size = 0
        self._task: asyncio.Task[None] | None = None

    def started(self, task: asyncio.Task[None]) -> None:
        """Count ``task``, the request's, before its first step."""
        self._task = task
        self._all.add(task)
        self._size = self.session.add_request(task)
        task.add_done_callback(self.ended)

    def ended(self, _: object = None) -> None:
        """Take the counts back, once: as the request's coroutine ends (its ``finally``,
        which also drops the done callback, so the end costs no loop turn), or from the
        task's done callback when the coroutine never ran (cancelled before its first
        step, as a connection closes)."""
        task = self._task
        assert task is not None
        task.remove_done_callback(self.ended)
        self._all.discard(task)
        self.session.request_done(task, self._size)


class Requests:
    def __init__(
        self,
        operations: Operations,
        *,
        max_in_progress: int,
        wake: Callable[[], None],
        stop_cancelled: Callable[[Job], None],
        status: Callable[[], Awaitable[dict[str, Any]]],
        live_workers: Callable[[], Collection[str]],
        queues: QueueControl,
        waits: Waits,
        why: Callable[[Job], str | None] = lambda job: None,
    ) -> None:
        """``waits`` answers ``wait_job`` and hears of jobs a request ended (a cancel);
        ``why`` says why a job waits, as the dispatching main knows it
        (:func:`broker.core.why.wait_reason`), for ``get_job``."""
        self._why = why
        self._operations = operations
        self._queues = queues
        self._waits = waits
        self._slots = asyncio.Semaphore(max_in_progress)
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = wake
        self._stop_cancelled = stop_cancelled
        self._status = status
        self._live_workers = live_workers
        """The worker ids connected now, for the catalog's ``connected``."""

    def start(self, session: Session, msg: protocol.Message) -> None:
        """Run a client request in its own task, counted against the connection's cap (the
        read loop waits at it) and cancelled if the connection closes first.

        An enqueue goes straight to :meth:`_enqueue`, past the dispatch on the message's
        type that every other request takes. The counts are taken back as the request's
        coroutine ends (:class:`_InProgress`), not by a done callback, which would cost
        a loop turn of its own after the answer: one at a time, the producer waits on
        every step of this path (bench/README.md, "relay1")."""
        request = _InProgress(self._tasks, session)
        if type(msg) is protocol.Enqueue:
            task = asyncio.create_task(self._enqueue(request, msg))
        else:
            task = asyncio.create_task(self._run(request, msg))
        request.started(task)

    async def wait_idle(self) -> None:
        """Return once the requests in progress have finished (a stopping main bounds it)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    async def answer(self, msg: protocol.Message) -> protocol.Message:
        """A request from the main's own web dashboard (:mod:`broker.ops.web`): answered as a
        client's is, with the same wake-ups and stops; an error is raised, not sent. It
        takes none of the clients' slots: the dashboard bounds its own requests
        (:data:`broker.model.bounds.DASHBOARD_REQUESTS`), so its reads, which need no client
        credential, can never hold a client back."""
        return await self._answer(msg)

    async def _run(self, request: _InProgress, msg: protocol.Message) -> None:
        try:
            async with self._slots:  # requests never take every database connection
                await self._apply(request.session, msg)
        finally:
            request.ended()

    async def _enqueue(self, request: _InProgress, msg: protocol.Enqueue) -> None:
        """:meth:`_apply` of an enqueue. Enqueues are group-committed
        (:mod:`broker.main.operations`): however many wait, they use one database
        connection, so they need no slot, and taking one would cap a group commit at the
        slot count."""
        session = request.session
        try:
            reply = await self._enqueued(msg)
        except Exception as exc:
            self._refused(session, msg, exc)
            return
        finally:
            request.ended()
        session.reply(reply)

    async def _apply(self, session: Session, msg: protocol.Message) -> None:
        """Answer a client request; a failure is answered with the code of its exception
        (:mod:`broker.wire.errors`), so the client raises the same one. A ``wait_job``
        whose job has not ended is answered later, by :class:`Waits`."""
        try:
            if isinstance(msg, protocol.WaitJob):
                reply = await self._waits.wait(session, msg)
                if reply is None:
                    return
            else:
                reply = await self._answer(msg)
        except Exception as exc:
            self._refused(session, msg, exc)
            return
        session.reply(reply)

    def _refused(self, session: Session, msg: protocol.Message, exc: Exception) -> None:
        """Log a request that ``exc`` stopped and answer it with ``exc``'s code."""
        if isinstance(exc, InvalidJobError | ProtocolError):  # the client's mistake
            log_event(
                logger,
                logging.WARNING,
                "request refused",
                session=session.id,
                type=msg.type,
                reason=exc,
            )
        else:
            log_event(
                logger,
                logging.ERROR,
                "request failed",
                exc_info=exc,
                session=session.id,
                type=msg.type,
            )
        request_id = getattr(msg, "request_id", None)
        if request_id is not None:
            session.reply(error_codes.request_error(request_id, exc))

    async def _answer(self, msg: protocol.Message) -> protocol.Message:
        """The reply to a client request: a queue's settings are
        :class:`~broker.main.queues.QueueControl`'s, the rest :meth:`_answer_jobs`'s."""
        if isinstance(msg, QUEUE_REQUESTS):
            return await self._queues.answer(msg)
        if isinstance(msg, protocol.EnqueueEach):
            return await self._enqueue_each(msg)
        if isinstance(msg, protocol.GetWorkflow):
            view = await self._operations.get_workflow(msg.workflow_id)
            return protocol.WorkflowInfo(request_id=msg.request_id, workflow=view)
        if isinstance(msg, protocol.RetryWorkflow):
            view = await self._operations.retry_workflow(msg.workflow_id)
            if view is not None:
                log_event(logger, logging.INFO, "workflow retried", workflow_id=msg.workflow_id)
                self._wake()
            return protocol.WorkflowInfo(request_id=msg.request_id, workflow=view)
        return await self._answer_jobs(msg)

    async def _enqueue_each(self, msg: protocol.EnqueueEach) -> protocol.EnqueuedEach:
        """Store a bulk request's jobs (:meth:`Operations.enqueue_each
        <broker.main.operations.Operations.enqueue_each>`) and tell the dispatcher.

        They are written past the group commit and the hand-off at enqueue, as another
        process's insert is, and the dispatcher is told as of one: a wake, which drops
        its read-ahead and counts no mode drained, before the reply, so no enqueue after
        it is handed off at once ahead of these jobs, and the next pass reads them in
        dispatch order (priority, run time, insert order) among the rest. Not
        ``Dispatcher.enqueued`` and the plan at enqueue, which take each job's spec or
        result: a bulk request's jobs rarely find a free slot each, and planning them
        one by one would cost the spec per job the columns spare (``bench/README.md``,
        "Bulk enqueue through the main by column")."""
        ids = await self._operations.enqueue_each(
            msg.job, msg.arg_sets, msg.kwarg_sets, allow_unknown_tasks=msg.allow_unknown_tasks
        )
        self._wake()
        return protocol.EnqueuedEach(request_id=msg.request_id, job_ids=ids)

    async def _enqueued(self, msg: protocol.Enqueue) -> protocol.EnqueuedReply:
        """Store an enqueue's jobs; the reply."""
        results = await self._operations.enqueue(
            msg.jobs, allow_unknown_tasks=msg.allow_unknown_tasks
        )
        if logger.isEnabledFor(logging.DEBUG):  # one line per job: off by default
            for result in results:
                log_event(
                    logger,
                    logging.DEBUG,
                    "job enqueued",
                    job_id=result.job.id,
                    task=result.job.task,
                    queue=result.job.queue,
                    attempt=result.job.attempts + 1,
                    duplicate=result.duplicate,
                )
        # The store's commit woke the dispatcher already (handoffs.EnqueueHandoff).
        refs = [protocol.EnqueuedRef(job_id=r.job_id, duplicate=r.duplicate) for r in results]
        return protocol.EnqueuedReply(request_id=msg.request_id, jobs=refs)

    def _job_info(self, request_id: str, job: Job | None) -> protocol.JobInfo:
        """``get_job``'s answer: the job, and why it waits when the main knows
        (``wait_reason``, beside its status, where ``broker job`` shows it)."""
        reason = None if job is None else self._why(job)
        if job is None or reason is None:
            return job_info(request_id, job)
        shown: dict[str, Any] = {}
        for key, value in job.to_dict().items():
            shown[key] = value
            if key == "status":
                shown["wait_reason"] = reason
        return protocol.JobInfo(request_id=request_id, job=shown)

    async def _answer_jobs(self, msg: protocol.Message) -> protocol.Message:
        """The reply to a client request, from the request service (:mod:`broker.main.operations`);
        what only the main can do (wake the dispatcher, stop a cancelled job on its
        worker) happens here."""
        ops = self._operations
        match msg:
            case protocol.Enqueue():
                return await self._enqueued(msg)
            case protocol.GetJob(request_id=rid, job_id=job_id):
                return self._job_info(rid, await ops.get(job_id))
            case protocol.Cancel(request_id=rid, job_id=job_id):
                job = await ops.cancel(job_id)
                if job is not None:
                    self._stop_cancelled(job)
                    self._waits.ended([job.id])
                return job_info(rid, job)
            case protocol.Retry(request_id=rid, job_id=job_id):
                job = await ops.retry(job_id)
                if job is not None and job.status is JobStatus.QUEUED:
                    log_event(
                        logger,
                        logging.INFO,
                        "job retried",
                        job_id=job.id,
                        task=job.task,
                        queue=job.queue,
                        attempt=job.attempts + 1,
                    )
                    self._wake()
                return job_info(rid, job)
            case protocol.Status(request_id=rid):
                return protocol.StatusInfo(request_id=rid, status=await self._status())
            case protocol.ListJobs(request_id=rid):
                empty = protocol.JobList(request_id=rid, jobs=[], next_cursor=None)
                try:
                    page = await ops.list_jobs(
                        JobFilter(statuses=msg.statuses, queues=msg.queues, tasks=msg.tasks),
                        limit=msg.limit,
                        cursor=msg.cursor,
                        include_payload=msg.include_payload,
                        reply_bytes=len(codec.encode(empty)) - len("null"),
                    )
                except ValueError as exc:  # only the client's cursor can be unreadable
                    raise ProtocolError(f"list_jobs.cursor is not valid: {exc}"[:200]) from None
                return protocol.JobList(
                    request_id=rid, jobs=page.jobs, next_cursor=page.next_cursor
                )
            case protocol.ListTasks(request_id=rid):
                records = await ops.tasks()
                live = self._live_workers()
                return protocol.TaskList(
                    request_id=rid, tasks=[catalog.entry(r, live) for r in records]
                )
            case protocol.Prune(request_id=rid):
                deleted = await ops.prune(
                    older_than_seconds=msg.older_than_seconds,
                    keep_latest=msg.keep_latest,
                    statuses=msg.statuses,
                )
                log_event(logger, logging.INFO, "jobs pruned", deleted=deleted)
                return protocol.Pruned(request_id=rid, deleted=deleted)
            case _:
                raise ProtocolError(f"{msg.type!r} is not a client request")
