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
I/O. This module is the shell around it: the server and the main's lifecycle, the welcome
of peers, and the carrying out of the core's effects. What each peer's message does is
:mod:`broker.main.routing`; what only the dispatching main runs (dispatch passes, the
store writers, the loops that feed the core events) :mod:`broker.main.leader`; the
election's shell :mod:`broker.main.election`; connections :mod:`broker.main.connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

from broker.core.election import Election, MainRole, Standing, Timing, not_leader, standing
from broker.core.handoff import (
    Handoff,
    HandoffEffect,
)
from broker.core.why import wait_reason
from broker.exceptions import StorageError, transient
from broker.jobs import Clock, Job, utcnow
from broker.main.carrier import carry
from broker.main.catalog import Declarations
from broker.main.connections import Connections
from broker.main.election import Leadership
from broker.main.handoffs import EnqueueHandoff, load_orphans
from broker.main.leader import Leader
from broker.main.loops import GroupCommit
from broker.main.metrics import MainMetrics
from broker.main.operations import LiveState, Operations
from broker.main.queues import QueueControl
from broker.main.requests import Requests
from broker.main.retention import Retention
from broker.main.routing import Router
from broker.main.sessions import Session
from broker.main.settings import MainSettings
from broker.main.waits import Waits
from broker.model.bounds import MAX_WAITERS_PER_CONNECTION
from broker.model.logs import log_event
from broker.retry import RetryDelay, retry_delay
from broker.storage import StorageAdapter, SupportsLeadership, SupportsWarmUp
from broker.tasks.schedule import Schedule
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")

DEFAULT_RETENTION = Retention()
"""Completed and cancelled jobs kept 7 days, dead ones 30 days, no row cap."""


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
        tls = self.settings.tls
        self._tls = None if tls is None else tls.context()
        """Built here, so a certificate that cannot be loaded is refused before anything
        listens or touches the store."""
        self._clock = clock
        self.metrics = MainMetrics()
        """The event counters for ``/metrics`` (see :mod:`broker.main.metrics`)."""
        self.handoff = Handoff(
            max_credit=self.settings.max_credit,
            affinity_grace=self.settings.affinity_grace,
            affinity_max_wait=self.settings.affinity_max_wait,
            reconnect_grace=self.settings.orphan_grace,
        )
        """The handoff rules and state; this class only feeds it events and carries out
        its effects (see :mod:`broker.core.handoff`)."""
        self.operations = Operations(
            store,
            self.settings,
            clock=clock,
            enqueue=GroupCommit(
                EnqueueHandoff(
                    store,
                    self.handoff,
                    carry=self._carry,
                    enqueued=lambda results: self.leader.dispatcher.enqueued(results),
                    leads=lambda mode, queue, key: self.leader.dispatcher.leads(mode, queue, key),
                    stopping=lambda: self._stopping,
                    clock=clock,
                ).commit,
                max_batch=self.settings.enqueue_batch,
                shared_failure=transient,
            ).submit,
            metrics=self.metrics,
        )
        self.queues = QueueControl(store, self.handoff.flow, wake=self.wake)
        """The queues' settings: paused, rate limits (see :mod:`broker.main.queues`)."""
        self.waits = Waits(
            store.get_job,
            lambda peer: self.sessions.get(peer),
            per_connection=MAX_WAITERS_PER_CONNECTION,
        )
        """Who waits for which job to end (``wait_job``), answered when it does."""
        self.requests = Requests(
            self.operations,
            queues=self.queues,
            max_in_progress=self.settings.max_requests,
            wake=self.wake,
            stop_cancelled=self._stop_cancelled,
            status=self.status,
            live_workers=self._live_workers,
            waits=self.waits,
            why=self._wait_reason,
        )
        """The client requests (:mod:`broker.main.operations`), under this main's limits."""
        self.declarations = Declarations(
            self.operations.catalog, self.settings, clock=clock, stopping=lambda: self._stopping
        )
        """The workers' task declarations, stored in the background."""
        self.router = Router(
            self.handoff,
            carry=self._carry,
            requests=self.requests,
            declarations=self.declarations,
        )
        """What each peer message does (see :mod:`broker.main.routing`)."""
        self.main_id = f"main-{uuid.uuid4().hex[:12]}"
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        """No new dispatch, connection or request: the main is stopping, or was deposed."""
        self._dispatching = False
        """The dispatching tasks run: the handoffs in flight (the orphans) are loaded, so
        a worker's hello can adopt its leases."""
        self._stop_started = False
        self.connections = Connections(
            self.settings,
            core=self.handoff,
            welcome=self._welcome,
            handle=self.router.handle,
            closed=self._disconnect,
            carry=self._carry,
            stopping=lambda: self._stopping,
        )
        self.sessions = self.connections.joined
        """The connections past their hello, by id: a view of the core's peers."""
        self.leader = Leader(
            store,
            self.handoff,
            self.settings,
            metrics=self.metrics,
            clock=clock,
            retry_delay=retry_delay_fn,
            carry=self._carry,
            stopping=lambda: self._stopping,
            declarations=self.declarations,
            live_workers=self._live_workers,
            schedules=schedules,
            retention=retention,
            ended=self.waits.ended,
        )
        """What only the dispatching main runs (see :mod:`broker.main.leader`)."""
        self.election: Election | None = None
        """Who dispatches among the mains on this store (``None``: a store that holds one
        main only, which always dispatches)."""
        self.leadership: Leadership | None = None
        """The election's shell, when there is an election."""
        if store.capabilities.leader_election and isinstance(store, SupportsLeadership):
            self.election = Election(self.main_id, Timing(self.settings.failover_timeout))
            self.leadership = Leadership(
                self.election,
                store,
                self.handoff,
                main_id=self.main_id,
                address=lambda: self.address,
                load_orphans=self._load_orphans,
                dispatch=self._dispatch,
                deposed=self._deposed,
                stopping=lambda: self._stopping,
                spawn=self._spawn,
                retry_interval=self.settings.error_retry_interval,
            )
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
        # The listen backlog holds as many connections as the main may hold: with asyncio's
        # 100, a fleet of 500 connecting in the same moment overflowed the kernel's accept
        # queue, and a peer whose connection the kernel dropped waited for a greeting that
        # never came (the kernel caps it at net.core.somaxconn).
        backlog = self.settings.max_connections
        if self._tls is None:
            server = await asyncio.start_server(
                self.connections.accept,
                self.settings.host,
                self.settings.port,
                limit=self.settings.preauth_max_line_bytes,
                start_serving=False,
                backlog=backlog,
            )
        else:  # each TLS handshake also has the handshake deadline
            server = await asyncio.get_running_loop().create_server(
                self.connections.tls_server(self._tls),
                self.settings.host,
                self.settings.port,
                start_serving=False,
                backlog=backlog,
            )
        self._server = server
        try:
            await self.store.setup()
            if self.leadership is None:
                await self._load_orphans()
            else:
                await self.leadership.first_round()
            await self.operations.catalog.load()
        except BaseException:
            self._server = None
            server.close()
            await server.wait_closed()
            raise
        await server.start_serving()
        if self.leadership is None:
            self._dispatch()
        else:
            self.leadership.begin()
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
        self.leader.start(self._spawn)

    # ------------------------------------------------------------------ election

    @property
    def standing(self) -> Standing:
        """This main's role and the leader's address as it knows them (the rule is
        :func:`broker.core.election.standing`): it dispatches (always, on a store that
        holds one main) once elected and done loading the orphans."""
        return standing(self.election, dispatching=self._dispatching, address=self.address)

    @property
    def leading(self) -> bool:
        """Whether this main dispatches (its :attr:`standing` is the leader's)."""
        return self.standing.role is MainRole.LEADER

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

    def _deposed(self, reason: str) -> None:
        """This main stepped down (:class:`broker.main.election.Leadership`): no more
        dispatch; :meth:`serve` then stops it."""
        self._stopping = True
        self.step_down_reason = reason
        self.deposed.set()

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` until this main stops."""
        self._tasks.append(asyncio.create_task(work, name=name))

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
            await asyncio.wait_for(self.leader.settler.wait_idle(), timeout=report_grace)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.requests.wait_idle(), timeout=report_grace)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.leader.ledger.flush(), timeout=report_grace)
        await self.declarations.finish(report_grace)
        handshakes = list(self.connections.tls_handshakes)
        for task in [*self._tasks, *handshakes, *self.connections.tasks]:
            task.cancel()
        await asyncio.gather(
            *self._tasks, *handshakes, *self.connections.tasks, return_exceptions=True
        )
        if self._server is not None:
            await self._server.wait_closed()
        if self.leadership is not None:
            await self.leadership.resign()
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
        self.leader.dispatcher.wake()

    def _carry(self, effects: Sequence[HandoffEffect]) -> None:
        """Carry out the handoff's effects, in order (:func:`broker.main.carrier.carry`)."""
        carry(effects, self.sessions, self.leader, self.metrics)

    async def _load_orphans(self) -> None:
        """What a main reads when it starts to lead (at start, or on a standby's
        takeover): the handoffs in flight, and the queues' settings; meanwhile the store
        opens the connections the requests will use (:class:`broker.storage.SupportsWarmUp`)."""
        await asyncio.gather(load_orphans(self.store, self.handoff), self._warm_up())
        await self.queues.load()

    async def _warm_up(self) -> None:
        """Open the store's connections ahead of the first requests; one that cannot be
        opened now is opened when a request needs it, as it always was."""
        if not isinstance(self.store, SupportsWarmUp):
            return
        try:
            await self.store.warm_up()
        except (OSError, StorageError) as exc:
            log_event(logger, logging.WARNING, "could not open the store's connections", error=exc)

    # ------------------------------------------------------------------ connections

    def _welcome(self, session: Session, hello: protocol.Hello) -> bool | protocol.Error:
        """A hello passed the handshake's checks: the peer joins and is welcomed, with the
        leases it adopted; ``False`` (the connection closes) while the main is stopping.
        A standby answers with ``not_leader`` and where the leader is, and closes."""
        if self._stopping:
            return False
        if not self.leading:
            assert self.election is not None
            return not_leader(self.election, self.address)
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
                features=[protocol.ENQUEUE_EACH],
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

    def _stop_cancelled(self, job: Job) -> None:
        """The store has cancelled ``job``: its worker stops it (see :meth:`Handoff.cancelled`)."""
        self._carry(self.handoff.cancelled(job))

    # ------------------------------------------------------------------ liveness and exits

    def _wait_reason(self, job: Job) -> str | None:
        """Why ``job`` waits (:func:`broker.core.why.wait_reason`), when this main knows:
        only the dispatching one does (a standby's core has no workers)."""
        if not self.leading:
            return None
        return wait_reason(job, self.handoff, asyncio.get_running_loop().time(), self._clock())

    def _live_workers(self) -> set[str]:
        """The workers connected now."""
        return {
            s.worker_id
            for s in self.sessions.values()
            if s.role is protocol.Role.WORKER and s.worker_id is not None
        }

    def _disconnect(self, session: Session) -> None:
        if session.closed:
            return
        session.closed = True
        self.waits.disconnected(session.id)
        now = asyncio.get_running_loop().time()
        stall = max(0.0, now - self.leader.tick_due)  # the liveness check is overdue by this much
        self._carry(self.handoff.disconnect(session.id, now, stall=stall, stopping=self._stopping))

    async def status(self) -> dict[str, Any]:
        """The operators' snapshot (``broker status``): :meth:`Operations.status` with what
        only the running main knows, its workers and pending recoveries."""
        workers = self.sessions.values()
        now = self.standing
        live = LiveState(
            main_id=self.main_id,
            role=now.role.value,
            leader=now.leader,
            dispatched=self.dispatched,
            orphans=len(self.orphans),
            workers=[s.summary() for s in workers if s.role is protocol.Role.WORKER],
            # Job ids only: a client is never shown a lease (see ``Job.to_dict``).
            pending_recoveries=[
                {"job_id": str(job_id)} for job_id in self.leader.ledger.pending().values()
            ],
            unserved_tasks=self.handoff.unserved(
                record.task for record in self.operations.catalog.records()
            ),
            queue_settings=self.queues.status(),
        )
        return await self.operations.status(live)
