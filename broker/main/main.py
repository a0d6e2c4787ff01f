"""broker-main: owns the job store and hands jobs to workers under fenced leases.

The main is the only process that moves a job into or out of ``handed_off``
through its dispatcher, and it does so in a fixed order for every handoff:

1. reserve one of the worker's credits (see :mod:`broker.core.peers`);
2. mint the lease (a fresh UUID) *before* touching the store;
3. claim the job under that lease (batched with other claims of the same pass);
4. only then send the job on that worker's connection.

Anything that goes wrong between 2 and 4 ends in the recovery ledger
(:mod:`broker.main.recovery`), which gives that exact lease back; a newer lease is
never touched because every return is fenced in the store.

Several mains may share one PostgreSQL store: every one listens, exactly one (elected
through the store, see :mod:`broker.core.election`) dispatches, and the others answer peers
with where the leader is. The elected main fences every claim and settle with its
epoch, and steps down (stops, for a supervisor to start it again as a standby) the
moment it learns another main took over.

Those rules, and all the state they act on, live in :mod:`broker.core.handoff`, which does no
I/O. This module is the shell around it: the settings, the server, the loops that feed it
events (liveness ticks, the orphans' deadline) and the carrying out of its effects.
Dispatch passes are in :mod:`broker.main.dispatcher`, connections in :mod:`broker.main.connections`,
the settlement of reports in :mod:`broker.main.settler`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import secrets
import socket
import uuid
from collections.abc import Awaitable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from broker.core import jobfields as codec
from broker.core.catalog import CatalogLimitError
from broker.core.election import (
    Effect,
    Election,
    Lead,
    Phase,
    Renew,
    RoundBudget,
    StepDown,
    Timing,
    TryElect,
)
from broker.core.handoff import (
    STALL,
    Abort,
    ClaimJobs,
    Dispatch,
    Handoff,
    HandoffEffect,
    ReturnLease,
    Send,
    Settle,
    StoreCheckpoint,
    StoreProgress,
    WakeDispatcher,
)
from broker.core.peers import CreditLimitError
from broker.credentials import role_needed
from broker.exceptions import PermissionDeniedError, ProtocolError, StorageError, transient
from broker.jobs import Clock, EnqueueResult, Job, JobSpec, JobStatus, utcnow
from broker.main.checkpoints import CheckpointSaver, ProgressWriter
from broker.main.connections import Connections, Gathered, Session
from broker.main.dispatcher import Dispatcher
from broker.main.group_commit import GroupCommit
from broker.main.metrics import MainMetrics, MeasuredStore
from broker.main.operations import LiveState, Operations
from broker.main.recovery import RecoveryLedger
from broker.main.requests import Requests
from broker.main.retention import Retention, run_retention
from broker.main.scheduler import Scheduler, catch_up_window
from broker.main.settings import MainSettings
from broker.main.settler import ReportSettler
from broker.model.logs import log_event
from broker.retry import RetryDelay, retry_delay
from broker.storage import (
    JobFilter,
    StorageAdapter,
    SupportsEnqueueHandedOff,
    SupportsLeadership,
    SupportsNotify,
)
from broker.tasks.schedule import Schedule
from broker.wire import errors as error_codes
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")

_T = TypeVar("_T")

DEFAULT_RETENTION = Retention()
"""Completed and cancelled jobs kept 7 days, dead ones 30 days, no row cap."""

_LIVENESS_TICKS = 4
"""Liveness checks per ping interval: frequent enough that a dead peer is dropped soon
after its deadline and a stall of the main is measured closely."""

_TASK_GRACE_PASS_MAX = 3600.0
"""Seconds, at most, between two passes of the task grace: a declaration outlives its
worker by the grace, less at most this (a connected worker's rows are marked seen on
each pass, so a main that restarts keeps them for the grace)."""


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
        self._enqueue_store = store if isinstance(store, SupportsEnqueueHandedOff) else None
        """The store, if it can hand jobs off at enqueue (checked once: a runtime protocol
        check costs as much as a small enqueue's other bookkeeping)."""
        self.settings = settings or MainSettings()
        self.settings.validate()
        tls = self.settings.tls
        self._tls = None if tls is None else tls.context()
        """Built here, so a certificate that cannot be loaded is refused before anything
        listens or touches the store."""
        self._clock = clock
        self._retry_delay = retry_delay_fn
        self.metrics = MainMetrics()
        """The event counters for ``/metrics`` (see :mod:`broker.main.metrics`)."""
        measured: StorageAdapter = MeasuredStore(store, self.metrics)
        self.operations = Operations(
            store,
            self.settings,
            clock=clock,
            enqueue=GroupCommit(
                self._enqueue_now,
                max_batch=self.settings.enqueue_batch,
                shared_failure=transient,
            ).submit,
            metrics=self.metrics,
        )
        self.requests = Requests(
            self.operations,
            max_in_progress=self.settings.max_requests,
            wake=self.wake,
            stop_cancelled=self._stop_cancelled,
            status=self.status,
        )
        """The client requests (:mod:`broker.main.operations`), under this main's limits."""
        self.main_id = f"main-{uuid.uuid4().hex[:12]}"
        self.handoff = Handoff(
            max_credit=self.settings.max_credit,
            affinity_grace=self.settings.affinity_grace,
            reconnect_grace=self.settings.orphan_grace,
        )
        """The handoff rules and state; this class only feeds it events and carries out
        its effects (see :mod:`broker.core.handoff`)."""
        self.ledger = RecoveryLedger(
            store,
            self.handoff,
            retry_interval=self.settings.error_retry_interval,
            on_returned=self.wake,
            clock=clock,
            max_recoveries=self.settings.max_recoveries,
        )
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._saving: set[asyncio.Task[None]] = set()
        """Task catalogs being written to the store (:meth:`_declare`)."""
        self._stopping = False
        self._dispatching = False
        """The dispatching tasks run: the handoffs in flight (the orphans) are loaded, so
        a worker's hello can adopt its leases."""
        """No new dispatch, connection or request: the main is stopping, or was deposed."""
        self._stop_started = False
        self._tick_due = math.inf
        """When the liveness loop's next check is due (loop time): a disconnect read later
        than that comes while the loop is still catching up on a stall."""
        self.dispatcher = Dispatcher(
            measured,
            self.handoff,
            carry=self._carry,
            stopping=lambda: self._stopping,
            clock=clock,
            claim_batch=self.settings.claim_batch,
            max_claims_in_flight=self.settings.max_claims_in_flight,
            poll_interval=self.settings.poll_interval,
            notify_fallback_interval=self.settings.notify_fallback_interval,
            retry_interval=self.settings.error_retry_interval,
        )
        self.connections = Connections(
            self.settings,
            core=self.handoff,
            welcome=self._welcome,
            handle=self._handle,
            closed=self._disconnect,
            carry=self._carry,
            stopping=lambda: self._stopping,
        )
        self.sessions = self.connections.joined
        """The connections past their hello, by id: a view of the core's peers."""
        self.settler = ReportSettler(
            measured,
            self.handoff,
            acknowledged=self._acknowledge,
            stopping=lambda: self._stopping,
            clock=clock,
            retry_delay=retry_delay_fn,
            max_recoveries=self.settings.max_recoveries,
            batch=self.settings.report_batch,
            retry_interval=self.settings.error_retry_interval,
            max_payload_bytes=self.settings.max_payload_bytes,
            max_payload_depth=self.settings.max_payload_depth,
            max_payload_containers=self.settings.max_payload_containers,
            metrics=self.metrics,
        )
        self.checkpoints = CheckpointSaver(
            measured,
            answer=self._answer_checkpoints,
            stopping=lambda: self._stopping,
            batch=self.settings.report_batch,
            retry_interval=self.settings.error_retry_interval,
            max_checkpoint_bytes=self.settings.checkpoint_limit,
            max_payload_depth=self.settings.max_payload_depth,
            max_payload_containers=self.settings.max_payload_containers,
        )
        """Checkpoints, group-committed and acknowledged once durable."""
        self.progress = ProgressWriter(measured)
        self.retention = retention
        """Pruning of finished jobs (see :mod:`broker.main.retention`); ``None``: never prune."""
        self.scheduler = Scheduler(
            store,
            schedules,
            clock=clock,
            on_enqueued=self.wake,
            error_retry_interval=self.settings.error_retry_interval,
            catch_up_window=catch_up_window(retention),
        )
        """Enqueues the periodic jobs' ticks, each once (see :mod:`broker.tasks.schedule`)."""
        self.election: Election | None = None
        """Who dispatches among the mains on this store (``None``: a store that holds one
        main only, which always dispatches)."""
        if store.capabilities.leader_election and isinstance(store, SupportsLeadership):
            self.election = Election(self.main_id, Timing(self.settings.failover_timeout))
        self.deposed = asyncio.Event()
        """Set when this main stepped down (another main took over, or its lease ran out
        while the store could not renew it); :meth:`serve` returns."""
        self.step_down_reason: str | None = None
        """Why this main stepped down, for its exit message; ``None`` while it did not."""

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
        # The port is bound before the store is touched, so a port clash (or an address
        # that cannot be bound) fails before any schema or SQLite file is created; peers
        # are answered only once the store is ready.
        # The stream's limit is only its read-ahead (wire.LineReader enforces the line caps):
        # the pre-auth cap keeps what an unauthenticated peer can make us buffer small.
        if self._tls is None:
            server = await asyncio.start_server(
                self.connections.accept,
                self.settings.host,
                self.settings.port,
                limit=self.settings.preauth_max_line_bytes,
                start_serving=False,
            )
        else:  # each TLS handshake also has the handshake deadline
            server = await asyncio.get_running_loop().create_server(
                self.connections.tls_server(self._tls),
                self.settings.host,
                self.settings.port,
                start_serving=False,
            )
        self._server = server
        try:
            await self.store.setup()
            if self.election is None:
                await self._load_orphans()
            else:
                await self._first_round()
            await self.operations.catalog.load()
        except BaseException:
            self._server = None
            server.close()
            await server.wait_closed()
            raise
        await server.start_serving()
        if self.election is None:
            self._dispatch()
        else:
            if self.election.epoch is not None:
                self._lead_now(self.election.epoch)
            self._tasks.append(asyncio.create_task(self._elect(), name="broker-election"))
        log_event(
            logger,
            logging.INFO,
            "main listening",
            main_id=self.main_id,
            host=self.settings.host,
            port=self.port,
            orphans=len(self.orphans),
        )

    def _dispatch(self) -> None:
        """Start what only the dispatching main runs (the orphans are loaded)."""
        self._dispatching = True
        self.handoff.serving(asyncio.get_running_loop().time())
        self._tasks += [
            asyncio.create_task(self.dispatcher.run(), name="broker-dispatch"),
            asyncio.create_task(self.ledger.run(), name="broker-recovery"),
            asyncio.create_task(self.settler.run(), name="broker-reports"),
            asyncio.create_task(self.checkpoints.run(), name="broker-checkpoints"),
            asyncio.create_task(self.progress.run(), name="broker-progress"),
            asyncio.create_task(self._liveness_loop(), name="broker-liveness"),
            asyncio.create_task(self._forget_gone_workers(), name="broker-task-grace"),
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

    # ------------------------------------------------------------------ election

    @property
    def leading(self) -> bool:
        """Whether this main dispatches (always, on a store that holds one main): elected,
        and done loading the orphans."""
        return self.election is None or (self.election.phase is Phase.LEADER and self._dispatching)

    @property
    def address(self) -> str:
        """Where peers reach this main, as a standby names it to them: ``advertise``, or
        the listen address (this host's name for a wildcard one) and the bound port."""
        if self.settings.advertise is not None:
            return self.settings.advertise
        host = self.settings.host
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def _elect(self) -> None:
        """The election's shell: asks the store when :class:`Election` says so, and
        carries out its answers, until this main stops or steps down."""
        election = self.election
        assert election is not None
        loop = asyncio.get_running_loop()
        while True:
            for effect in election.due(loop.time()):
                for outcome in await self._ask(effect):
                    match outcome:
                        case Lead(epoch=epoch):
                            # Its own task: the election keeps renewing while it loads.
                            self._tasks.append(
                                asyncio.create_task(self._lead(epoch), name="broker-lead")
                            )
                        case StepDown(epoch=epoch, reason=reason):
                            self._step_down(epoch, reason)
            wake = election.wake_at()
            if wake == math.inf:
                return
            await asyncio.sleep(max(0.0, wake - loop.time()))

    async def _ask(self, effect: Effect) -> list[Effect]:
        """Carry out one round the election asked for; returns what its answer decides.
        A round gets the renewal interval of the main's running time (see
        :class:`broker.core.election.RoundBudget`): a store that hangs is a failed round, and
        the lease keeps running out; an answer that came while the loop was stalled is
        used."""
        election = self.election
        assert election is not None
        try:
            return await _within_running_time(self._round(effect), election.timing.renew_every)
        except (TimeoutError, OSError, StorageError) as exc:
            election.failed()
            log_event(
                logger, logging.WARNING, "election round failed", main_id=self.main_id, error=exc
            )
            return []

    async def _round(self, effect: Effect) -> list[Effect]:
        election, store = self.election, self.store
        assert election is not None and isinstance(store, SupportsLeadership)
        timing = election.timing
        match effect:
            case TryElect(started=started):
                row = await store.elect(self.main_id, self.address, timing.ttl)
                if row is None:
                    election.failed()
                    return []
                return election.elected(row.holder, row.epoch, row.address, row.live, started)
            case Renew(epoch=epoch, started=started):
                ok = await store.renew(self.main_id, epoch, timing.ttl)
                return election.renewed(started, ok)
            case _:
                return [effect]

    async def _first_round(self) -> None:
        """At start-up, before peers are answered: one election round, and if it elects
        this main, the orphans, so a main alone on its store is ready as soon as
        :meth:`start` returns, as it always was."""
        election = self.election
        assert election is not None
        for effect in election.due(asyncio.get_running_loop().time()):
            for outcome in await self._ask(effect):
                if isinstance(outcome, Lead):
                    self._fence(outcome.epoch)
                    await self._load_orphans()

    def _fence(self, epoch: int) -> None:
        store = self.store
        assert isinstance(store, SupportsLeadership)
        store.fence(epoch, self._fenced)

    async def _resign(self) -> None:
        """A leader that stops cleanly ends its lease, so a standby takes over at its next
        round instead of after the lease; a failure only costs that wait."""
        election, store = self.election, self.store
        if election is None or election.phase is not Phase.LEADER:
            return
        assert election.epoch is not None and isinstance(store, SupportsLeadership)
        election.resigned()
        try:
            async with asyncio.timeout(election.timing.renew_every):
                await store.resign(self.main_id, election.epoch)
        except (TimeoutError, OSError, StorageError) as exc:
            log_event(
                logger,
                logging.WARNING,
                "could not resign the lead",
                main_id=self.main_id,
                error=exc,
            )
        else:
            log_event(
                logger,
                logging.INFO,
                "resigned the lead",
                main_id=self.main_id,
                epoch=election.epoch,
            )

    async def _lead(self, epoch: int) -> None:
        """Elected: load the orphans, as a restarted main does, then dispatch."""
        self._fence(epoch)
        while True:
            try:
                await self._load_orphans()
                break
            except (OSError, StorageError) as exc:
                log_event(
                    logger, logging.WARNING, "loading the orphans failed, retrying", error=repr(exc)
                )
                self.handoff.orphans_unloaded()
                await asyncio.sleep(self.settings.error_retry_interval)
        if not self._stopping:
            self._lead_now(epoch)

    def _lead_now(self, epoch: int) -> None:
        log_event(
            logger,
            logging.WARNING,
            "elected leader",
            main_id=self.main_id,
            epoch=epoch,
            address=self.address,
            orphans=len(self.orphans),
        )
        self._dispatch()

    def _fenced(self, op: str) -> None:
        """The store refused ``op`` under this main's epoch: another main took over."""
        log_event(logger, logging.WARNING, "epoch fence refused", op=op, main_id=self.main_id)
        if self.election is not None:
            for effect in self.election.fenced():
                if isinstance(effect, StepDown):
                    self._step_down(effect.epoch, effect.reason)

    def _step_down(self, epoch: int, reason: str) -> None:
        """Stop dispatching at once; :meth:`serve` then stops this main."""
        log_event(
            logger,
            logging.ERROR,
            "deposed: this main stops dispatching and exits (start it again to stand by)",
            main_id=self.main_id,
            epoch=epoch,
            reason=reason,
        )
        self._stopping = True
        self.step_down_reason = reason
        self.deposed.set()

    async def stop(self, *, report_grace: float = 5.0) -> None:
        """Stop accepting, let in-flight reports land, then close connections and the store.

        Leases are *not* returned: the workers keep running their jobs and the next main
        adopts them when they reconnect.
        """
        if self._stop_started:
            return
        self._stop_started = True
        self._stopping = True
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.settler.wait_idle(), timeout=report_grace)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.requests.wait_idle(), timeout=report_grace)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ledger.flush(), timeout=report_grace)
        if self._saving:
            await asyncio.wait(self._saving, timeout=report_grace)
            for saving in self._saving:
                saving.cancel()
        handshakes = list(self.connections.tls_handshakes)
        for task in [*self._tasks, *handshakes, *self.connections.tasks]:
            task.cancel()
        await asyncio.gather(
            *self._tasks, *handshakes, *self.connections.tasks, return_exceptions=True
        )
        if self._server is not None:
            await self._server.wait_closed()
        await self._resign()
        await self.store.close()
        log_event(logger, logging.INFO, "main stopped", main_id=self.main_id)

    async def serve(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, or until this main is deposed."""
        await self.start()
        try:
            await self.wait(stop)
        finally:
            await self.stop()

    async def wait(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set or this main is deposed (:attr:`deposed`)."""
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self.deposed.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()

    def wake(self) -> None:
        """Ask the dispatcher for another pass (coalesced: many wakes, one pass)."""
        self.dispatcher.wake()

    async def _enqueue_now(self, specs: list[JobSpec]) -> list[EnqueueResult]:
        """One group commit of enqueues. Jobs that can start at once (a worker has a free
        slot and no waiting job would be overtaken, see :meth:`Handoff.plan_at_enqueue`)
        are written already handed off, under leases minted before the insert, and sent
        right after the commit: one transaction and no dispatch pass between the enqueue
        and the start. An unknown outcome sends their leases to the ledger, as for any
        claim."""
        store = self._enqueue_store
        plans = (
            []
            if store is None or self._stopping
            else self.handoff.plan_at_enqueue(specs, self._clock())
        )
        planned = [p for p in plans if p is not None]
        leased: set[uuid.UUID] = set()
        if store is None or not planned:
            results = await self.store.enqueue_many(specs)
        else:
            try:
                results = await store.enqueue_handed_off(
                    specs, [None if p is None else p.claim for p in plans]
                )
            except BaseException:
                self._carry(self.handoff.claim_unknown(planned))
                raise
            # Only the jobs planned are looked at (reading a result's job builds it).
            leased = {p.job.id for p in planned}
            won = [r.job for r in results if not r.duplicate and r.job_id in leased]
            self._carry(self.handoff.claimed(planned, won))
        # The jobs stored queued (not those handed off at once) wake the dispatcher.
        self.dispatcher.enqueued([r for r in results if not r.duplicate and r.job_id not in leased])
        return results

    def _carry(self, effects: Sequence[HandoffEffect]) -> None:
        """Carry out the handoff's effects, in order (the dispatcher makes the claims).

        The jobs, and the acknowledgements, that one call sends a peer go out together as
        batch lines (see :class:`broker.main.connections.Gathered`).
        """
        out = Gathered(self.sessions)
        for effect in effects:
            # The three effects every job makes come first: each case is a type test.
            match effect:
                case Dispatch(peer=peer, seq=seq, job=job, state_lost=state_lost):
                    out.add(peer, protocol.Jobs, codec.job_message(seq, job, state_lost=state_lost))
                    self.metrics.handed_off(job)
                case Settle(peer=peer, report=report):
                    self.settler.add(peer, report)
                case Send(peer=peer, message=protocol.ReportAck() as ack):
                    out.add(peer, protocol.ReportAcks, ack)
                case Send(peer=peer, message=protocol.CheckpointAck() as ack):
                    self.metrics.checkpoint_answered(ack.status.value)
                    out.send(peer, ack)
                case Send(peer=peer, message=message):
                    out.send(peer, message)
                case ReturnLease():
                    self.ledger.kick()
                case Abort(peer=peer, reason=reason):
                    out.drop(peer)
                    if (session := self.sessions.get(peer)) is not None:
                        log_event(
                            logger,
                            logging.WARNING,
                            "peer unresponsive, treating as disconnected",
                            session=peer,
                            worker_id=session.worker_id,
                            reason=reason,
                        )
                        session.abort()
                case WakeDispatcher():
                    self.dispatcher.nudge()
                case ClaimJobs():
                    pass  # a store call to await: the dispatcher makes it
                case StoreCheckpoint(peer=peer, message=message):
                    self.checkpoints.add(peer, message)
                case StoreProgress(update=update):
                    self.metrics.progress_received()
                    self.progress.add(update)
        out.send_all()

    async def _load_orphans(self) -> None:
        """The handoffs in flight, as summaries: a held lease needs no payload (a job sent
        again is claimed again, which loads it), so a start never loads megabytes per
        running job, nor fails on a value that no longer passes its integrity check."""
        cursor: str | None = None
        while True:
            page = await self.store.list_jobs(
                JobFilter(statuses=[JobStatus.HANDED_OFF]),
                limit=1000,
                cursor=cursor,
                include_payload=False,
            )
            self.handoff.load_orphans(page.jobs)
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def _orphan_deadline(self) -> None:
        await asyncio.sleep(self.settings.orphan_grace)
        effects = self.handoff.orphan_deadline()
        log_event(logger, logging.INFO, "orphan grace over", returned=len(effects))
        self._carry(effects)

    # ------------------------------------------------------------------ connections

    def _welcome(self, session: Session, hello: protocol.Hello) -> bool | protocol.Error:
        """A hello passed the handshake's checks: the peer joins and is welcomed, with the
        leases it adopted; ``False`` (the connection closes) while the main is stopping.
        A standby answers with ``not_leader`` and where the leader is, and closes."""
        if self._stopping:
            return False
        if not self.leading:
            # Elected but still loading the handoffs in flight: a worker welcomed now
            # would adopt none of its leases, and they would go back to the queue at the
            # orphans' deadline while it ran them. It comes back here after its backoff.
            assert self.election is not None
            loading = self.election.phase is Phase.LEADER
            leader = self.address if loading else self.election.leader
            return protocol.Error(
                code=protocol.ErrorCode.NOT_LEADER,
                message=(
                    "this main was just elected and is loading the handoffs in flight; try again"
                    if loading
                    else f"this main is a standby; the leader is at {leader}"
                    if leader is not None
                    else "this main is a standby and no main is elected yet; try again"
                ),
                fatal=True,
                leader=leader,
            )
        session.host = hello.host
        adopted, effects = self.handoff.hello(session.state, hello)
        self._carry(effects)
        session.send(
            protocol.Welcome(
                main_id=self.main_id,
                protocol=protocol.choose_protocol(hello) or protocol.PROTOCOL_VERSION,
                ping_interval=self.settings.ping_interval,
                adopted=adopted,
                max_line_bytes=self.settings.max_line_bytes,
                max_payload_bytes=self.settings.max_payload_bytes,
                max_payload_depth=self.settings.max_payload_depth,
                max_checkpoint_bytes=self.settings.checkpoint_limit,
                max_payload_containers=self.settings.max_payload_containers,
            )
        )
        log_event(
            logger,
            logging.INFO,
            "peer connected",
            session=session.id,
            role=hello.role,
            worker_id=hello.worker_id,
            adopted=len(adopted),
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
                protocol.CompletedReport()
                | protocol.FailedReport()
                | protocol.RescheduleReport()
                | protocol.ReleaseReport()
            ) if worker:
                self._carry(self.handoff.report(session.id, msg))
            case protocol.Reports(reports=reports) if worker:
                self._carry(
                    [
                        effect
                        for report in reports
                        for effect in self.handoff.report(session.id, report)
                    ]
                )
            case protocol.SaveCheckpoint() if worker:
                self._carry(self.handoff.checkpoint(session.id, msg))
            case protocol.Progress() if worker:
                self._carry(self.handoff.progress(session.id, msg))
            case protocol.WorkerStatus(status=status) if worker:
                session.reported_status = status
            case protocol.TaskCatalog(tasks=tasks) if worker and session.worker_id:
                self._declare(session, tasks)
            case (
                protocol.Enqueue()
                | protocol.GetJob()
                | protocol.Cancel()
                | protocol.Retry()
                | protocol.Status()
                | protocol.ListJobs()
                | protocol.ListTasks()
                | protocol.Prune()
            ):
                self._request(session, msg)
            case _:
                session.errors += 1
                session.send(
                    protocol.Error(
                        code=protocol.ErrorCode.NOT_ALLOWED,
                        message=f"{msg.type!r} is not allowed from a {session.role} connection",
                        fatal=False,
                    )
                )

    def _declare(self, session: Session, tasks: list[protocol.TaskDeclaration]) -> None:
        """A worker declared the tasks it serves: the catalog in memory takes them at once
        (an enqueue that follows sees them), the store in the background, retried while
        its trouble is transient (the next declaration would record them anyway). Over a
        bound of the catalog, nothing is recorded and the worker is told (``over_limit``,
        not fatal: it keeps working, and its earlier declarations stay)."""
        worker_id = session.worker_id
        assert worker_id is not None
        now = self._clock()
        try:
            declared = self.operations.catalog.record(worker_id, tasks, now)
        except CatalogLimitError as exc:
            log_event(
                logger, logging.WARNING, "task catalog refused", worker_id=worker_id, error=str(exc)
            )
            session.send(
                protocol.Error(code=protocol.ErrorCode.OVER_LIMIT, message=str(exc), fatal=False)
            )
            return
        log_event(logger, logging.INFO, "tasks declared", worker_id=worker_id, tasks=len(tasks))

        async def save() -> None:
            while True:
                try:
                    await self.operations.catalog.save(worker_id, declared, now)
                    return
                except Exception as exc:
                    if not transient(exc) or self._stopping:
                        log_event(
                            logger,
                            logging.ERROR,
                            "storing the task catalog failed",
                            worker_id=worker_id,
                            error=repr(exc),
                        )
                        return
                    log_event(
                        logger,
                        logging.WARNING,
                        "storing the task catalog failed, retrying",
                        error=repr(exc),
                    )
                    await asyncio.sleep(self.settings.error_retry_interval)

        task = asyncio.create_task(save(), name="broker-declare-tasks")
        self._saving.add(task)
        task.add_done_callback(self._saving.discard)

    def _request(self, session: Session, msg: protocol.Message) -> None:
        """Start a client request if the connection's role may make it; else answer
        ``permission_denied`` (the connection stays open)."""
        needed = role_needed(msg)
        if needed in session.rights:
            self.requests.start(session, msg)
            return
        log_event(
            logger,
            logging.WARNING,
            "request denied",
            session=session.id,
            type=msg.type,
            role=session.role,
            needs=needed,
        )
        denied = PermissionDeniedError(
            f"{msg.type!r} needs the {needed} role; this connection said hello as "
            f"{session.role} (use a credential of that role: the operator's command uses "
            "the operator secret)"
        )
        session.send(error_codes.request_error(getattr(msg, "request_id", ""), denied))

    def _stop_cancelled(self, job: Job) -> None:
        """The store has cancelled ``job``: its worker stops it (see :meth:`Handoff.cancelled`)."""
        self._carry(self.handoff.cancelled(job))

    def _acknowledge(
        self, batch: list[tuple[int, protocol.Report]], statuses: list[protocol.AckStatus]
    ) -> None:
        self._carry(
            self.handoff.settled(
                [(peer, msg, status) for (peer, msg), status in zip(batch, statuses, strict=True)]
            )
        )

    def _answer_checkpoints(self, acks: list[tuple[int, protocol.CheckpointAck]]) -> None:
        self._carry([Send(peer, ack) for peer, ack in acks])

    # ------------------------------------------------------------------ liveness and exits

    async def _liveness_loop(self) -> None:
        """Pings every peer each ``ping_interval`` and drops one that has not answered a
        ping, or whose write has been stuck or outbox over its cap, for ``liveness_timeout``.

        The loop also measures the main's own lag (when it wakes against when it asked
        to): while the main was stalled, say by a slow request, it could neither read the
        peers' answers nor write to them, so that time is excused rather than judged
        (:meth:`broker.core.peers.Liveness.excuse`). A slow moment in the main never returns
        live workers' leases, nor those of a worker that gave its socket up meanwhile
        (:meth:`broker.core.handoff.Handoff.disconnect` parks them for its hello).
        """
        loop = asyncio.get_running_loop()
        tick = self.settings.ping_interval / _LIVENESS_TICKS
        for n in itertools.count(1):
            planned = self._tick_due = loop.time() + tick
            await asyncio.sleep(tick)
            now = loop.time()
            stall = now - planned
            if stall >= STALL:
                log_event(
                    logger, logging.WARNING, "the main's loop was stalled", seconds=round(stall, 1)
                )
            self._carry(
                self.handoff.tick(
                    now,
                    stall=stall,
                    timeout=self.settings.liveness_timeout,
                    ping=n % _LIVENESS_TICKS == 0,
                )
            )

    async def _forget_gone_workers(self) -> None:
        """Drop the task declarations of workers gone for the task grace, a pass every
        quarter of it (at most an hour), the first one a pass after this main began to
        dispatch, so workers that were connected to the main before it have reconnected
        (:meth:`Catalog.forget <broker.core.catalog.Catalog.forget>`)."""
        grace = timedelta(seconds=self.settings.task_grace)
        interval = min(self.settings.task_grace / 4, _TASK_GRACE_PASS_MAX)
        while True:
            await asyncio.sleep(interval)
            live = {
                s.worker_id
                for s in self.sessions.values()
                if s.role is protocol.Role.WORKER and s.worker_id is not None
            }
            try:
                await self.operations.catalog.forget(live, self._clock(), grace)
            except Exception as exc:  # the next pass tries again
                log_event(
                    logger,
                    logging.WARNING,
                    "dropping gone workers' task declarations failed",
                    error=repr(exc),
                )

    def _disconnect(self, session: Session) -> None:
        if session.closed:
            return
        session.closed = True
        now = asyncio.get_running_loop().time()
        stall = max(0.0, now - self._tick_due)  # the liveness check is overdue by this much
        self._carry(self.handoff.disconnect(session.id, now, stall=stall, stopping=self._stopping))

    async def status(self) -> dict[str, Any]:
        """The operators' snapshot (``broker status``): :meth:`Operations.status` with what
        only the running main knows, its workers and pending recoveries."""
        workers = self.sessions.values()
        live = LiveState(
            main_id=self.main_id,
            dispatched=self.dispatched,
            orphans=len(self.orphans),
            workers=[s.summary() for s in workers if s.role is protocol.Role.WORKER],
            # Job ids only: a client is never shown a lease (see ``Job.to_dict``).
            pending_recoveries=[
                {"job_id": str(job_id)} for job_id in self.ledger.pending().values()
            ],
        )
        return await self.operations.status(live)


async def _within_running_time(step: Awaitable[_T], budget: float) -> _T:
    """``step``'s answer, or ``TimeoutError`` once it has had ``budget`` seconds of this
    loop's running time (time the loop was stalled does not count, see
    :class:`broker.core.election.RoundBudget`). Given up on, it is cancelled."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(step)
    spent = RoundBudget(budget)
    try:
        while True:
            started = loop.time()
            done, _ = await asyncio.wait({task}, timeout=spent.step)
            if done:
                return task.result()
            if spent.waited(spent.step, loop.time() - started):
                raise TimeoutError(f"no answer within {budget:g} s of the main's running time")
    finally:
        task.cancel()


def new_token() -> str:
    """A fresh random token, for operators setting up ``BROKER_TOKEN``."""
    return secrets.token_urlsafe(32)
