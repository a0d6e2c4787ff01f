"""broker-main: owns the job store and hands jobs to workers under fenced leases.

The main is the only process that moves a job into or out of ``handed_off``
through its dispatcher, and it does so in a fixed order for every handoff:

1. reserve one of the worker's credits (see :mod:`broker.admission`);
2. mint the lease (a fresh UUID) *before* touching the store;
3. claim the job under that lease (batched with other claims of the same pass);
4. only then send the job on that worker's connection.

Anything that goes wrong between 2 and 4 ends in the recovery ledger
(:mod:`broker.recovery`), which gives that exact lease back; a newer lease is
never touched because every return is fenced in the store.

Those rules, and all the state they act on, live in :mod:`broker.handoff`, which does no
I/O. This module is the shell around it: the settings, the server, the loops that feed it
events (liveness ticks, the orphans' deadline) and the carrying out of its effects.
Dispatch passes are in :mod:`broker.dispatch`, connections in :mod:`broker.connection`,
the settlement of reports in :mod:`broker.reports`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker import checks, codec, error_codes, protocol
from broker.admission import DEFAULT_MAX_CREDIT, CreditLimitError
from broker.connection import Connections, Session
from broker.dispatch import Dispatcher
from broker.exceptions import InvalidJobError, ProtocolError
from broker.handoff import (
    Abort,
    ClaimJobs,
    Dispatch,
    Effect,
    Handoff,
    Report,
    ReturnLease,
    Send,
    Settle,
    Wake,
)
from broker.jobs import Clock, Job, JobStatus, utcnow
from broker.operations import LiveState, Operations
from broker.payload import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_MAX_PAYLOAD_DEPTH,
    LINE_HEADROOM_BYTES,
    MAX_PAYLOAD_DEPTH_CEILING,
)
from broker.protocol import DEFAULT_PORT
from broker.recovery import RecoveryLedger
from broker.reports import ReportSettler
from broker.retention import Retention, run_retention
from broker.retry import RetryDelay, retry_delay
from broker.schedule import Schedule
from broker.scheduler import Scheduler, catch_up_window
from broker.storage import JobFilter, StorageAdapter, SupportsNotify

logger = logging.getLogger("broker.main")

DEFAULT_MAX_LINE_BYTES = 2 << 20
"""2 MiB: the default payload limit (1 MiB) plus ample room for the rest of a message."""

DEFAULT_LIST_PAGE_BYTES = 1 << 20
"""1 MiB: a page of jobs that a client decodes, and the main encodes, in a few milliseconds."""

DEFAULT_RETENTION = Retention()
"""Completed and cancelled jobs kept 7 days, dead ones 30 days, no row cap."""

DEFAULT_MAX_OUTBOX_BYTES = 8 << 20
"""8 MiB queued for one peer: four replies at the default line cap, far more than a peer
that reads ever has waiting."""

_LIVENESS_TICKS = 4
"""Liveness checks per ping interval: frequent enough that a dead peer is dropped soon
after its deadline and a stall of the main is measured closely."""


def line_limit_for(max_payload_bytes: int | None) -> int:
    """The default ``max_line_bytes`` for a payload limit: at least 1 MiB above it."""
    if max_payload_bytes is None:
        return DEFAULT_MAX_LINE_BYTES
    return max(DEFAULT_MAX_LINE_BYTES, max_payload_bytes + (1 << 20))


@dataclass(frozen=True)
class MainSettings:
    """Every knob of the main; the CLI fills it from flags and ``BROKER_*`` variables."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    token: str | None = None
    allow_unauthenticated: bool = False
    """Permit a non-loopback listen address without a token (say, inside a private network)."""
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    """Longest line accepted after the handshake; must exceed ``max_payload_bytes`` by at
    least 64 KiB so a job at the payload limit still fits in one message."""
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES
    """Largest args + kwargs of a job, and largest result, as JSON; ``None``: no limit."""
    max_payload_depth: int = DEFAULT_MAX_PAYLOAD_DEPTH
    """How many lists and objects deep each argument and each result may nest; workers
    learn it from ``welcome``."""
    preauth_max_line_bytes: int = 64 << 10
    handshake_timeout: float = 2.0
    ping_interval: float = 5.0
    liveness_timeout: float = 15.0
    orphan_grace: float = 30.0
    """How long handoffs found in the store at start-up wait for their worker to come back."""
    error_retry_interval: float = 1.0
    poll_interval: float = 0.5
    """How often to look for jobs other processes wrote, when the store cannot notify."""
    notify_fallback_interval: float = 30.0
    """A slow safety poll for stores that notify, in case a notification is ever lost."""
    claim_batch: int = 256
    report_batch: int = 512
    max_errors_per_connection: int = 20
    list_page_bytes: int = DEFAULT_LIST_PAGE_BYTES
    """About how many bytes of jobs one ``list_jobs`` reply may carry (never more than fits
    in ``max_line_bytes``); the page ends early, with a cursor, once they are used up."""
    max_outbox_bytes: int = DEFAULT_MAX_OUTBOX_BYTES
    """Bytes queued for one peer before the main stops reading its messages (until half
    have been sent); a peer over it for ``liveness_timeout`` is disconnected."""
    max_requests_per_connection: int = 16
    """Client requests one connection may have in progress; at the cap the main stops
    reading that connection, so TCP holds the rest back at the peer."""
    max_requests: int = 8
    """Client requests in progress across all connections. Below the SQL adapter's pool
    (5 connections plus 10 overflow), so requests can never take every database connection
    from dispatch, settlement, recovery and the listener."""
    max_connections: int = 1024
    max_connections_per_address: int = 64
    max_unauthenticated: int = 64
    """Connections that have not finished the handshake yet, from all addresses."""
    max_credit: int = DEFAULT_MAX_CREDIT
    """Free slots a worker may announce per mode in ``ready``; a larger ``ready`` is refused."""

    def validate(self) -> None:
        positive = {
            "max_line_bytes": self.max_line_bytes,
            "preauth_max_line_bytes": self.preauth_max_line_bytes,
            "handshake_timeout": self.handshake_timeout,
            "ping_interval": self.ping_interval,
            "liveness_timeout": self.liveness_timeout,
            "error_retry_interval": self.error_retry_interval,
            "poll_interval": self.poll_interval,
            "notify_fallback_interval": self.notify_fallback_interval,
            "claim_batch": self.claim_batch,
            "report_batch": self.report_batch,
            "max_errors_per_connection": self.max_errors_per_connection,
            "list_page_bytes": self.list_page_bytes,
            "max_outbox_bytes": self.max_outbox_bytes,
            "max_requests_per_connection": self.max_requests_per_connection,
            "max_requests": self.max_requests,
            "max_connections": self.max_connections,
            "max_connections_per_address": self.max_connections_per_address,
            "max_unauthenticated": self.max_unauthenticated,
            "max_credit": self.max_credit,
        }
        for name, value in positive.items():
            checks.positive(name, value)
        checks.non_negative("orphan_grace", self.orphan_grace)
        if self.max_payload_bytes is not None:
            checks.positive("max_payload_bytes", self.max_payload_bytes)
            checks.require(
                self.max_line_bytes >= self.max_payload_bytes + LINE_HEADROOM_BYTES,
                f"max_line_bytes ({self.max_line_bytes}) must exceed max_payload_bytes "
                f"({self.max_payload_bytes}) by at least {LINE_HEADROOM_BYTES} bytes, so "
                "a job at the payload limit fits in one message; raise --max-line-bytes "
                f"(e.g. to {line_limit_for(self.max_payload_bytes)}) or lower "
                "--max-payload-bytes",
            )
        checks.int_in_range(
            "max_payload_depth",
            self.max_payload_depth,
            1,
            MAX_PAYLOAD_DEPTH_CEILING,
            why="Python's json cannot reliably handle deeper values",
        )
        checks.require(
            self.liveness_timeout > self.ping_interval,
            "liveness_timeout must be longer than ping_interval",
        )
        checks.int_in_range("port", self.port, 0, 65535)
        checks.require(
            bool(self.token) or self.allow_unauthenticated or _is_loopback(self.host),
            f"refusing to listen on {self.host!r} without a token: set BROKER_TOKEN, "
            "listen on 127.0.0.1, or pass --allow-unauthenticated if the network is private",
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Main:
    def __init__(
        self,
        store: StorageAdapter,
        settings: MainSettings | None = None,
        *,
        clock: Clock = utcnow,
        retry_delay_fn: RetryDelay = retry_delay,
        schedules: Sequence[Schedule] = (),
        retention: Retention | None = DEFAULT_RETENTION,
    ) -> None:
        self.store = store
        self.settings = settings or MainSettings()
        self.settings.validate()
        self._clock = clock
        self._retry_delay = retry_delay_fn
        self.operations = Operations(store, self.settings, clock=clock)
        """The client requests (:mod:`broker.operations`), under this main's limits."""
        self.main_id = f"main-{uuid.uuid4().hex[:12]}"
        self.sessions: dict[int, Session] = {}
        self.handoff = Handoff(max_credit=self.settings.max_credit)
        """The handoff rules and state; this class only feeds it events and carries out
        its effects (see :mod:`broker.handoff`)."""
        self.ledger = RecoveryLedger(
            store,
            self.handoff,
            retry_interval=self.settings.error_retry_interval,
            on_returned=self.wake,
        )
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._report_tasks: set[asyncio.Task[None]] = set()
        self._request_slots = asyncio.Semaphore(self.settings.max_requests)
        self._stopping = False
        self.dispatcher = Dispatcher(
            store,
            self.handoff,
            carry=self._carry,
            stopping=lambda: self._stopping,
            clock=clock,
            claim_batch=self.settings.claim_batch,
            poll_interval=self.settings.poll_interval,
            notify_fallback_interval=self.settings.notify_fallback_interval,
            retry_interval=self.settings.error_retry_interval,
        )
        self.connections = Connections(
            self.settings,
            new_peer=self.handoff.new_peer,
            welcome=self._welcome,
            handle=self._handle,
            closed=self._disconnect,
            wake=self.wake,
            stopping=lambda: self._stopping,
        )
        self.settler = ReportSettler(
            store,
            self.handoff,
            acknowledged=self._acknowledge,
            stopping=lambda: self._stopping,
            clock=clock,
            retry_delay=retry_delay_fn,
            batch=self.settings.report_batch,
            retry_interval=self.settings.error_retry_interval,
            max_payload_bytes=self.settings.max_payload_bytes,
            max_payload_depth=self.settings.max_payload_depth,
        )
        self.retention = retention
        """Pruning of finished jobs (see :mod:`broker.retention`); ``None``: never prune."""
        self.scheduler = Scheduler(
            store,
            schedules,
            clock=clock,
            on_enqueued=self.wake,
            error_retry_interval=self.settings.error_retry_interval,
            catch_up_window=catch_up_window(retention),
        )
        """Enqueues the periodic jobs' ticks, each once (see :mod:`broker.schedule`)."""

    # ------------------------------------------------------------------ lifecycle

    @property
    def orphans(self) -> dict[uuid.UUID, Job]:
        """Handoffs found in the store at start-up, waiting for their worker's hello."""
        return self.handoff.orphans

    @property
    def dispatched(self) -> int:
        return self.handoff.dispatched

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the main is not listening")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        await self.store.setup()
        await self._load_orphans()
        # The stream's limit is only its read-ahead (wire.LineReader enforces the line caps):
        # the pre-auth cap keeps what an unauthenticated peer can make us buffer small.
        self._server = await asyncio.start_server(
            self.connections.accept,
            self.settings.host,
            self.settings.port,
            limit=self.settings.preauth_max_line_bytes,
        )
        self._tasks = [
            asyncio.create_task(self.dispatcher.run(), name="broker-dispatch"),
            asyncio.create_task(self.ledger.run(), name="broker-recovery"),
            asyncio.create_task(self.settler.run(), name="broker-reports"),
            asyncio.create_task(self._liveness_loop(), name="broker-liveness"),
        ]
        if self.orphans:
            self._tasks.append(asyncio.create_task(self._orphan_deadline(), name="broker-orphans"))
        if self.store.capabilities.listen_notify and isinstance(self.store, SupportsNotify):
            self._tasks.append(asyncio.create_task(self.dispatcher.listen(), name="broker-listen"))
        if self.retention is not None:
            self._tasks.append(
                asyncio.create_task(
                    run_retention(self.store, self.retention, self._clock), name="broker-retention"
                )
            )
        if self.scheduler.schedules:
            self._tasks.append(asyncio.create_task(self.scheduler.run(), name="broker-schedule"))
        logger.info(
            "main listening main_id=%s host=%s port=%s orphans=%d",
            self.main_id,
            self.settings.host,
            self.port,
            len(self.orphans),
        )

    async def stop(self, *, report_grace: float = 5.0) -> None:
        """Stop accepting, let in-flight reports land, then close connections and the store.

        Leases are *not* returned: the workers keep running their jobs and the next main
        adopts them when they reconnect.
        """
        if self._stopping:
            return
        self._stopping = True
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.settler.wait_idle(), timeout=report_grace)
        if self._report_tasks:
            await asyncio.wait(list(self._report_tasks), timeout=report_grace)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ledger.flush(), timeout=report_grace)
        for task in [*self._tasks, *self.connections.tasks]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self.connections.tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        await self.store.close()
        logger.info("main stopped main_id=%s", self.main_id)

    async def serve(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()

    def wake(self) -> None:
        """Ask the dispatcher for another pass (coalesced: many wakes, one pass)."""
        self.dispatcher.wake()

    def _carry(self, effects: Sequence[Effect]) -> None:
        """Carry out the handoff's effects, in order (the dispatcher makes the claims)."""
        for effect in effects:
            match effect:
                case Send(peer=peer, message=message):
                    if (session := self.sessions.get(peer)) is not None:
                        session.send(message)
                case Dispatch(peer=peer, seq=seq, job=job):
                    self.sessions[peer].send(codec.job_message(seq, job))
                case ReturnLease():
                    self.ledger.kick()
                case Abort(peer=peer, reason=reason):
                    if (session := self.sessions.get(peer)) is not None:
                        logger.warning(
                            "peer unresponsive, treating as disconnected "
                            "session=%d worker_id=%s reason=%s",
                            peer,
                            session.worker_id,
                            reason,
                        )
                        session.abort()
                case Settle(peer=peer, report=report):
                    self.settler.add(peer, report)
                case Wake():
                    self.wake()
                case ClaimJobs():
                    pass  # a store call to await: the dispatcher makes it

    async def _load_orphans(self) -> None:
        cursor: str | None = None
        while True:
            page = await self.store.list_jobs(
                JobFilter(statuses=[JobStatus.HANDED_OFF]), limit=1000, cursor=cursor
            )
            self.handoff.load_orphans(page.jobs)
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def _orphan_deadline(self) -> None:
        await asyncio.sleep(self.settings.orphan_grace)
        self._carry(self.handoff.orphan_deadline())

    # ------------------------------------------------------------------ connections

    def _welcome(self, session: Session, hello: protocol.Hello) -> bool:
        """A hello passed the handshake's checks: the peer joins and is welcomed, with the
        leases it adopted; ``False`` (the connection closes) while the main is stopping."""
        if self._stopping:
            return False
        session.host = hello.host
        self.sessions[session.id] = session
        adopted, effects = self.handoff.hello(session.state, hello)
        self._carry(effects)
        session.send(
            protocol.Welcome(
                main_id=self.main_id,
                protocol=protocol.PROTOCOL_VERSION,
                ping_interval=self.settings.ping_interval,
                adopted=adopted,
                max_line_bytes=self.settings.max_line_bytes,
                max_payload_bytes=self.settings.max_payload_bytes,
                max_payload_depth=self.settings.max_payload_depth,
            )
        )
        logger.info(
            "peer connected session=%d role=%s worker_id=%s adopted=%d",
            session.id,
            hello.role,
            hello.worker_id,
            len(adopted),
        )
        return True

    def _handle(self, session: Session, msg: protocol.Message) -> None:
        worker = session.role is protocol.Role.WORKER
        match msg:
            case protocol.Ping(nonce=nonce):
                session.send(protocol.Pong(nonce=nonce))
            case protocol.Pong(nonce=nonce):
                self.handoff.pong(session.id, nonce, asyncio.get_running_loop().time())
            case protocol.Ready(slots=slots, seen=seen) if worker:
                try:
                    self._carry(self.handoff.ready(session.id, slots, seen))
                except ProtocolError as exc:
                    session.errors += 1
                    code = (
                        protocol.ErrorCode.OVER_LIMIT
                        if isinstance(exc, CreditLimitError)
                        else protocol.ErrorCode.MALFORMED
                    )
                    session.send(protocol.Error(code=code, message=str(exc), fatal=False))
            case protocol.Draining() if worker:
                self._carry(self.handoff.draining(session.id))
            case (
                protocol.Completed()
                | protocol.Failed()
                | protocol.Reschedule()
                | protocol.Release()
            ) if worker:
                self._carry(self.handoff.report(session.id, msg))
            case protocol.WorkerStatus(status=status) if worker:
                session.reported_status = status
            case (
                protocol.Enqueue()
                | protocol.GetJob()
                | protocol.Cancel()
                | protocol.Retry()
                | protocol.Status()
                | protocol.ListJobs()
                | protocol.Prune()
            ):
                self._start_request(session, msg)
            case _:
                session.errors += 1
                session.send(
                    protocol.Error(
                        code=protocol.ErrorCode.NOT_ALLOWED,
                        message=f"{msg.type!r} is not allowed from a {session.role} connection",
                        fatal=False,
                    )
                )

    def _start_request(self, session: Session, msg: protocol.Message) -> None:
        """Run a client request in its own task, counted against the connection's cap (the
        read loop waits at it) and cancelled if the connection closes first."""
        task = asyncio.create_task(self._run_request(session, msg))
        self._report_tasks.add(task)
        task.add_done_callback(self._report_tasks.discard)
        session.add_request(task)

    async def _run_request(self, session: Session, msg: protocol.Message) -> None:
        async with self._request_slots:  # requests never take every database connection
            await self._apply(session, msg)

    # ------------------------------------------------------------------ reports and requests

    async def _apply(self, session: Session, msg: protocol.Message) -> None:
        """Answer a client request; a failure is answered with the code of its exception
        (:mod:`broker.error_codes`), so the client raises the same one."""
        try:
            reply = await self._answer(msg)
        except Exception as exc:
            if isinstance(exc, InvalidJobError | ProtocolError):  # the client's mistake
                logger.warning(
                    "request refused session=%d type=%s reason=%s", session.id, msg.type, exc
                )
            else:
                logger.exception("request failed session=%d type=%s", session.id, msg.type)
            request_id = getattr(msg, "request_id", None)
            if request_id is not None:
                session.send(error_codes.request_error(request_id, exc))
            return
        session.send(reply)

    async def _answer(self, msg: protocol.Message) -> protocol.Message:
        """The reply to a client request, from the request service (:mod:`broker.operations`);
        what only the main can do (wake the dispatcher, stop a cancelled job on its
        worker) happens here."""
        ops = self.operations
        match msg:
            case protocol.Enqueue(request_id=rid, jobs=requests):
                results = await ops.enqueue(requests)
                for result in results:
                    logger.info(
                        "job enqueued job_id=%s task=%s duplicate=%s",
                        result.job.id,
                        result.job.task,
                        result.duplicate,
                    )
                self.wake()
                refs = [
                    protocol.EnqueuedRef(job_id=r.job.id, duplicate=r.duplicate) for r in results
                ]
                return protocol.Enqueued(request_id=rid, jobs=refs)
            case protocol.GetJob(request_id=rid, job_id=job_id):
                return _job_info(rid, await ops.get(job_id))
            case protocol.Cancel(request_id=rid, job_id=job_id):
                job = await ops.cancel(job_id)
                if job is not None:
                    self._stop_cancelled(job)
                return _job_info(rid, job)
            case protocol.Retry(request_id=rid, job_id=job_id):
                job = await ops.retry(job_id)
                if job is not None and job.status is JobStatus.QUEUED:
                    logger.info("job retried job_id=%s", job.id)
                    self.wake()
                return _job_info(rid, job)
            case protocol.Status(request_id=rid):
                return protocol.StatusInfo(request_id=rid, status=await self.status())
            case protocol.ListJobs(request_id=rid):
                empty = protocol.JobList(request_id=rid, jobs=[], next_cursor=None)
                try:
                    page = await ops.list_jobs(
                        JobFilter(statuses=msg.statuses, queues=msg.queues, tasks=msg.tasks),
                        limit=msg.limit,
                        cursor=msg.cursor,
                        include_payload=msg.include_payload,
                        reply_bytes=len(protocol.encode(empty)) - len("null"),
                    )
                except ValueError as exc:  # only the client's cursor can be unreadable
                    raise ProtocolError(f"list_jobs.cursor is not valid: {exc}"[:200]) from None
                return protocol.JobList(
                    request_id=rid, jobs=page.jobs, next_cursor=page.next_cursor
                )
            case protocol.Prune(request_id=rid):
                deleted = await ops.prune(
                    older_than_seconds=msg.older_than_seconds,
                    keep_latest=msg.keep_latest,
                    statuses=msg.statuses,
                )
                logger.info("jobs pruned deleted=%d", deleted)
                return protocol.Pruned(request_id=rid, deleted=deleted)
            case _:
                raise ProtocolError(f"{msg.type!r} is not a client request")

    def _stop_cancelled(self, job: Job) -> None:
        """The store has cancelled ``job``: its worker stops it (see :meth:`Handoff.cancelled`)."""
        self._carry(self.handoff.cancelled(job))

    def _acknowledge(
        self, batch: list[tuple[int, Report]], statuses: list[protocol.AckStatus]
    ) -> None:
        self._carry(
            self.handoff.settled(
                [(peer, msg, status) for (peer, msg), status in zip(batch, statuses, strict=True)]
            )
        )

    # ------------------------------------------------------------------ liveness and exits

    async def _liveness_loop(self) -> None:
        """Pings every peer each ``ping_interval`` and drops one that has not answered a
        ping, or whose write has been stuck or outbox over its cap, for ``liveness_timeout``.

        The loop also measures the main's own lag (when it wakes against when it asked
        to): while the main was stalled, say by a slow request, it could neither read the
        peers' answers nor write to them, so that time is excused rather than judged
        (:meth:`broker.handoff.Liveness.excuse`). A slow moment in the main never returns
        live workers' leases.
        """
        loop = asyncio.get_running_loop()
        tick = self.settings.ping_interval / _LIVENESS_TICKS
        for n in itertools.count(1):
            planned = loop.time() + tick
            await asyncio.sleep(tick)
            now = loop.time()
            stall = now - planned
            if stall > 1.0:
                logger.warning("the main's loop was stalled for %.1f s", stall)
            self._carry(
                self.handoff.tick(
                    now,
                    stall=stall,
                    timeout=self.settings.liveness_timeout,
                    ping=n % _LIVENESS_TICKS == 0,
                )
            )

    def _disconnect(self, session: Session) -> None:
        if session.closed:
            return
        session.closed = True
        self.sessions.pop(session.id, None)
        self._carry(self.handoff.disconnect(session.id, stopping=self._stopping))

    async def status(self) -> dict[str, Any]:
        """The operators' snapshot (``broker status``): :meth:`Operations.status` with what
        only the running main knows, its workers and pending recoveries."""
        workers = self.sessions.values()
        live = LiveState(
            main_id=self.main_id,
            dispatched=self.dispatched,
            orphans=len(self.orphans),
            workers=[_worker_summary(s) for s in workers if s.role is protocol.Role.WORKER],
            # Job ids only: a client is never shown a lease (see ``Job.to_dict``).
            pending_recoveries=[
                {"job_id": str(job_id)} for job_id in self.ledger.pending().values()
            ],
        )
        return await self.operations.status(live)


def _worker_summary(session: Session) -> dict[str, Any]:
    reported = session.reported_status or {}
    runners = reported.get("runners")
    runners = runners if isinstance(runners, dict) else {}
    capacity: dict[str, Any] = {}
    busy: dict[str, Any] = {}
    startup_errors: dict[str, Any] = {}
    for mode, runner in runners.items():
        if not isinstance(runner, dict):
            continue
        capacity[mode] = runner.get("capacity")
        busy[mode] = runner.get("busy")
        if runner.get("startup_error"):
            startup_errors[mode] = runner["startup_error"]
    return {
        "session": session.id,
        "worker_id": session.worker_id,
        "host": session.host,
        "modes": sorted(m.value for m in session.modes),
        "queues": sorted(session.queues) if session.queues is not None else None,
        "draining": session.draining,
        "in_flight": len(session.leases),
        "credits": {m.value: session.credits.available(m) for m in session.modes},
        "capacity": capacity,
        "busy": busy,
        "startup_errors": startup_errors,
        "status_reported": session.reported_status is not None,
    }


def _job_info(request_id: str, job: Job | None) -> protocol.JobInfo:
    return protocol.JobInfo(request_id=request_id, job=job.to_dict() if job else None)


def new_token() -> str:
    """A fresh random token, for operators setting up ``BROKER_TOKEN``."""
    return secrets.token_urlsafe(32)
