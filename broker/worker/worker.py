"""The worker: one per machine, it takes jobs from the main and runs them on its runners.

A worker holds one TCP connection to the main and keeps it: it reconnects with
capped, jittered backoff whenever the connection is lost, and it decides the
connection is lost when nothing at all has come from the main for
``liveness_timeout`` seconds (the main answers every ``ping``), because TCP alone
can take many minutes to notice a peer that vanished.

**Credits are exact.** Each ``ready`` carries the free slots per mode *and* ``seen``,
the ``seq`` of the last ``job`` message this worker had decided on when it counted
them; the main subtracts what it sent since (``broker.core.peers``). A job's fate is
decided, and its slot taken, in the same step that advances ``seen``, so no
``ready`` can ever count a slot twice.

**Reports are kept until acknowledged.** Every outcome goes into an ordered outbox
and stays there until the main's ``report_ack`` says it is settled; after a
reconnect the whole outbox is sent again (the main fences by lease, so a repeat is
harmless). The outbox lives in memory only: if the worker process dies, reports
not yet acknowledged are lost and the main runs those jobs again. Delivery is
at-least-once, never at-most-once.

**Leases survive reconnects.** ``hello`` lists every lease this worker still holds
(running, or reported but unacknowledged), so a main that restarted, or one that
was stalled past this worker's liveness timeout, can adopt those jobs instead of
running them a second time.

The worker never imports a runner: the composition root hands it one ``Runner``
per execution mode it serves.

The rules above live in :mod:`broker.core.worker_state`, which does no I/O; this module
owns the connection, the reconnect loop, the timers and the runners' tasks, feeds
events into the state and carries its effects out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import random
import signal
import socket
import ssl
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker.core import catalog
from broker.core.worker_state import (
    AdaptiveWindow,
    CheckpointSettled,
    Drain,
    ProgressLater,
    StartRun,
    StopFast,
    StopRun,
    WakeSender,
    WorkerEffect,
    WorkerState,
    log_job,
)
from broker.exceptions import (
    AuthenticationError,
    ConfigurationError,
    NotLeaderError,
    ProtocolError,
)
from broker.jobs import ExecutionMode, JSONValue
from broker.model import checks
from broker.model.bounds import MAX_WORKER_STATUS_BYTES
from broker.payload import MAX_LINE_BYTES_CEILING
from broker.tasks.registry import TaskRegistry, default_registry
from broker.tasks.runner import Assignment, Failed, LeaseKey, Runner, RunOutcome
from broker.wire import errors as error_codes
from broker.wire import framing as wire
from broker.wire import messages as protocol
from broker.wire import tls
from broker.wire.addresses import MainAddresses
from broker.wire.tls import PeerTLS

FLUSH_TIMEOUT = 10.0
"""How long a draining worker waits for the main to acknowledge its last reports."""

FAST_FLUSH_TIMEOUT = 2.0
"""The same wait when told to stop fast: long enough to hand back what it gave up."""

CANCEL_WAIT = 5.0
"""How long to wait for cancelled jobs to come back with an outcome before exiting."""


PREFETCH_PER_SLOT = 2
"""Unless told otherwise, a worker's window for a mode starts at two jobs per slot and
grows with the jobs' pace (:class:`~broker.core.worker_state.AdaptiveWindow`) up to
:data:`PREFETCH_MAX_PER_SLOT` per slot. The window has to cover what a slot waits for its
next job (a ``ready``, a claim committed on the store, the job's trip back), during which
a slot can finish many short jobs. Draining 10,000 no-op jobs through 2 pooled children x
10 on PostgreSQL (one run each, the machine nearly quiet): a window of 1, 2,407 jobs/s;
one per slot (20), 3,187 to 3,355; two per slot (40), 4,173; five per slot (100), 4,711.
A window costs fairness (a prefetched job waits behind this worker's long jobs while
another worker may idle), so it grows only for jobs short enough to need it (see
:data:`~broker.core.worker_state.PREFETCH_REFILL`); ``--prefetch N`` fixes it at N (0: none,
for long jobs)."""

PREFETCH_MAX_PER_SLOT = 8
"""The most an adaptive window grows to, per slot (reached by jobs of 2.5 ms or less).
Draining 5,000 no-op jobs through 2 pooled children x 10 on PostgreSQL, alternated runs:
five per slot against two, 4,719 -> 5,557 jobs/s (four pairs, the machine busy with a
test suite); eight against five, 8,423 -> 9,082 (four pairs, quiet), and the main's and
the store's CPU per job fell with the larger batches; twelve against eight, no difference
beyond the run-to-run spread (four pairs)."""


def _default_window(slots: int) -> AdaptiveWindow:
    return AdaptiveWindow(size=PREFETCH_PER_SLOT * slots, cap=PREFETCH_MAX_PER_SLOT * slots)


_FIRST_RECONNECT_DELAY = 0.1
_STABLE_CONNECTION = 5.0
"""A connection that lasted this long resets the backoff; shorter ones keep growing it,
so a main that accepts and then drops at once is not hammered ten times a second."""


@dataclass(eq=False)
class _Connection:
    """What lives and dies with one connection to the main (its protocol state is in
    :class:`~broker.core.worker_state.WorkerState`)."""

    lines: wire.LineReader
    writer: wire.MessageWriter
    welcome: protocol.Welcome
    ping_interval: float
    status_sent: tuple[object, ...] | None = None
    """What the last ``worker_status`` said about capacity and start-up errors."""
    heard: float = 0.0
    """Loop time when the read loop last had a message from the main (see
    :meth:`Worker._watch_liveness`)."""
    sending: float | None = None
    """Loop time when the send under way began (``None``: no send is waiting on the
    socket); the liveness watch ends a send blocked for the liveness timeout."""


class Worker:
    """Connects to the main at ``main_host:main_port`` and runs the jobs it hands over.

    ``main_host`` may list several mains sharing one store (``"a:7600,b:7600"``): the
    worker connects to the elected one, which a standby names, and after a lost
    connection tries the next; its running jobs carry on meanwhile and are reported to
    whichever main leads next, which adopts their leases.

    :param runners: one runner per execution mode this worker serves.
    :param registry: the tasks this worker may run; a job naming any other task fails
        at once without retry, and nothing is ever imported by a name from the wire.
    :param token: the worker secret (or the main's shared token), proved to the main with
        an HMAC of its nonce.
    :param tls: connect over TLS, verifying the main's certificate and host name (a
        :class:`~broker.wire.tls.PeerTLS`, or a context of your own); ``None``: plain TCP.
    :param queues: serve only these queues (``None``: every queue).
    :param drain_timeout: how long a graceful stop waits for running jobs before
        cancelling them (``None``: as long as they take).
    :param prefetch: jobs per mode this worker may hold beyond its free slots, so a
        finished job's slot is refilled without waiting for the main (see
        :mod:`broker.core.worker_state`); ``None``: sized to the jobs' pace, from
        :data:`PREFETCH_PER_SLOT` per slot of each mode up to :data:`PREFETCH_MAX_PER_SLOT`.
        A prefetched job's lease goes back to the queue if the connection drops.
    """

    def __init__(
        self,
        main_host: str,
        main_port: int,
        *,
        worker_id: str,
        runners: Mapping[ExecutionMode, Runner],
        registry: TaskRegistry | None = None,
        token: str | None = None,
        queues: Sequence[str] | None = None,
        ping_interval: float = 5.0,
        liveness_timeout: float = 15.0,
        reconnect_max_delay: float = 10.0,
        drain_timeout: float | None = None,
        logger: logging.Logger | None = None,
        prefetch: int | None = None,
        tls: PeerTLS | ssl.SSLContext | None = None,
        local_state_lost: bool = False,
    ) -> None:
        """``local_state_lost``: this process starts without the local state an earlier
        one with the same ``worker_id`` left (its state directory is new), so the main
        stops holding recoveries for it; said in the first hello only, since a reconnect
        of the same process still has whatever it built since."""
        if not worker_id:
            raise ConfigurationError("worker_id must be a non-empty string")
        if not runners:
            raise ConfigurationError("a worker needs at least one runner")
        for mode, runner in runners.items():
            if runner.mode != mode:
                raise ConfigurationError(f"the runner for {mode} jobs serves {runner.mode}")
        if queues is not None and (not queues or not all(queues)):
            raise ConfigurationError("queues must name at least one queue (None serves all)")
        checks.positive("ping_interval", ping_interval)
        checks.positive("liveness_timeout", liveness_timeout)
        checks.require(
            liveness_timeout > ping_interval, "liveness_timeout must be longer than ping_interval"
        )
        checks.positive("reconnect_max_delay", reconnect_max_delay)
        checks.optional(checks.non_negative, "drain_timeout", drain_timeout)
        checks.optional(checks.non_negative_int, "prefetch", prefetch)
        self.worker_id = worker_id
        self._mains = MainAddresses(main_host, main_port)
        """Every main given; a standby's ``not_leader`` names the one to try next."""
        self._runners = dict(runners)
        self._registry = default_registry if registry is None else registry
        self._token = token
        self._tls = tls.context() if isinstance(tls, PeerTLS) else tls
        self._queues = None if queues is None else list(queues)
        self._ping_interval = ping_interval
        self._liveness_timeout = liveness_timeout
        self._reconnect_max_delay = reconnect_max_delay
        self._drain_timeout = drain_timeout
        self._local_state_lost = local_state_lost
        self._logger = logger or logging.getLogger("broker.worker")

        self._state = WorkerState(
            modes=self._runners,
            queues=self._queues,
            lookup_task=self._registry.get,
            logger=self._logger,
            prefetch={
                mode: _default_window(runner.status().capacity) if prefetch is None else prefetch
                for mode, runner in self._runners.items()
            },
        )
        self._conn: _Connection | None = None
        self._runs: dict[LeaseKey, asyncio.Future[RunOutcome]] = {}
        """The outcome of each running job, as its runner will give it (the state knows the
        leases, this knows the futures)."""
        self._wake = asyncio.Event()
        """Something is waiting to be sent: a report, a ``ready``, a ``pong``, ``draining``."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._flushed = asyncio.Event()
        self._flushed.set()
        self._stop_requested = asyncio.Event()
        self._fast_requested = asyncio.Event()
        self._cancels: set[asyncio.Task[bool]] = set()
        """Cancellations the main asked for, while their runner stops the job."""
        self._checkpoint_waiters: dict[tuple[LeaseKey, int], asyncio.Future[None]] = {}
        """The task waiting on each checkpoint sent (see :meth:`save_checkpoint`)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """Kept by :meth:`run`: on 3.11 each ``get_running_loop()`` is a ``getpid`` call,
        and a job's start should not pay for one."""
        self._runners_changed = True
        """A runner said its slots may have changed (see :meth:`_capacity_changed`) since
        the runners' statuses were last looked at. Only then can a runner's capacity or
        start-up error differ, so a ``ready`` without it does not build every runner's
        status (the pooled one walks its children) just to find nothing new."""

    # ------------------------------------------------------------------ public

    async def run(self) -> None:
        """Serve until stopped, then drain and return.

        Raises :class:`~broker.exceptions.AuthenticationError` if the main rejects the
        token and :class:`~broker.exceptions.ConfigurationError` if the two sides
        cannot work together (auth required but no token, protocol versions differ):
        retrying would not change either answer.
        """
        connection: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        stop = asyncio.create_task(self._stop_requested.wait())
        try:
            for runner in self._runners.values():
                runner.set_capacity_listener(self._capacity_changed)
                runner.set_job_channel(self)
            await asyncio.gather(*(runner.start() for runner in self._runners.values()))
            connection = asyncio.create_task(
                self._stay_connected(), name="broker-worker-connection"
            )
            await asyncio.wait({connection, stop}, return_when=asyncio.FIRST_COMPLETED)
            if connection.done():
                connection.result()
            await self._drain()
            if connection.done():
                connection.result()  # a fatal refusal while draining still fails the run
        finally:
            stop.cancel()
            await self._shut_down(connection)

    def request_stop(self, fast: bool = False) -> None:
        """Start draining; a second call (or ``fast=True``) cancels running jobs and gives
        them back to the main instead of waiting for them."""
        self._apply(self._state.drain_requested(fast))

    def status(self) -> dict[str, Any]:
        """A snapshot for operators; ``runners`` maps each mode to its ``RunnerStatus``."""
        conn = self._conn
        return {
            "worker_id": self.worker_id,
            "connected": conn is not None,
            "main_id": conn.welcome.main_id if conn is not None else None,
            "draining": self._state.draining,
            "runners": {mode.value: runner.status() for mode, runner in self._runners.items()},
            "running": len(self._state.running),
            "prefetched": len(self._state.queued),
            "outbox": len(self._state.outbox),
        }

    # ------------------------------------------------------------------ the jobs' channel

    def save_checkpoint(self, key: LeaseKey, seq: int, state: JSONValue) -> asyncio.Future[None]:
        """A running job's checkpoint (the runners' :class:`~broker.tasks.runner.JobChannel`):
        resolves once the main has stored it, or fails with the reason it did not."""
        loop = self._loop or asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._checkpoint_waiters[(key, seq)] = waiter
        self._apply(self._state.checkpoint_requested(key, seq, state))
        return waiter

    def report_progress(self, key: LeaseKey, fraction: float, message: str) -> None:
        loop = self._loop or asyncio.get_running_loop()
        self._apply(self._state.progress_reported(key, fraction, message, loop.time()))

    def _progress_due(self) -> None:
        loop = self._loop or asyncio.get_running_loop()
        self._apply(self._state.progress_due(loop.time()))

    # ------------------------------------------------------------------ stopping

    async def _drain(self) -> None:
        if not await self._wait_for(self._idle, self._drain_timeout, interruptible=True):
            await self._cancel_running(give_up=self._state.fast)
            if not await self._wait_for(self._idle, CANCEL_WAIT, interruptible=False):
                self._logger.error(
                    "%d jobs did not stop when cancelled; leaving them unreported "
                    "(the main will run them again)",
                    len(self._state.running),
                )
        fast = self._state.fast
        limit = FAST_FLUSH_TIMEOUT if fast else FLUSH_TIMEOUT
        if not await self._wait_for(self._flushed, limit, interruptible=not fast):
            for key in self._state.outbox:
                self._log_job(logging.ERROR, "report not acknowledged before exit", key)
        self._logger.info("drained", extra={"event": "drained"})

    async def _wait_for(
        self, event: asyncio.Event, limit: float | None, *, interruptible: bool
    ) -> bool:
        """Wait until ``event`` is set, ``limit`` seconds pass, or (if ``interruptible``)
        a fast stop is requested; says whether the event was set."""
        waiters = {asyncio.ensure_future(event.wait())}
        if interruptible:
            waiters.add(asyncio.ensure_future(self._fast_requested.wait()))
        try:
            await asyncio.wait(waiters, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        return event.is_set()

    async def _cancel_running(self, *, give_up: bool) -> None:
        """Cancel every running job: a cancelled job fails (it ran past the drain
        deadline), unless ``give_up``, when it is released back to the queue unharmed.
        Prefetched jobs go back first, so none starts in a cancelled job's slot."""
        self._apply(self._state.give_back_queued())
        for key in list(self._state.running):
            # Awaited one by one, not through ``_apply``: the drain waits for them.
            stop = self._state.stop_run(key, give_up=give_up)
            if stop is not None:
                cancelled = await self._runners[stop.mode].cancel(key[0])
                self._log_job(logging.WARNING, "job cancelled", key, known_to_runner=cancelled)

    async def _shut_down(self, connection: asyncio.Task[None] | None) -> None:
        # Anything still running at this point is abandoned; grace would only wait on it.
        await asyncio.gather(
            *(runner.stop(grace=0) for runner in self._runners.values()), return_exceptions=True
        )
        tasks: list[asyncio.Future[Any]] = list(self._runs.values())
        tasks.extend(self._cancels)
        if connection is not None:
            tasks.append(connection)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ connection

    async def _stay_connected(self) -> None:
        failures = 0
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn = await self._connect()
            except (AuthenticationError, ConfigurationError) as exc:
                self._logger.error("giving up on the main: %s", exc, extra={"event": "fatal"})
                raise
            except NotLeaderError as exc:
                failures += 1
                delay = self._backoff(failures)
                self._logger.info(
                    "the main at %s is a standby (leader: %s); connecting there in %.2f s",
                    self._mains,
                    exc.leader or "none elected yet",
                    delay,
                    extra={"event": "not_leader"},
                )
                self._mains.follow(exc.leader)
                await asyncio.sleep(delay)
                continue
            except (OSError, TimeoutError, ProtocolError) as exc:
                failures += 1
                delay = self._backoff(failures)
                self._logger.warning(
                    "cannot reach the main at %s (%s); retrying in %.2f s",
                    self._mains,
                    _describe(exc),
                    delay,
                    extra={"event": "connect_failed"},
                )
                self._mains.failed()
                await asyncio.sleep(delay)
                continue
            started = loop.time()
            try:
                await self._serve(conn)
            except (OSError, TimeoutError, ProtocolError) as exc:
                self._logger.warning(
                    "connection to the main lost (%s); reconnecting",
                    _describe(exc),
                    extra={"event": "disconnected"},
                )
            failures = 0 if loop.time() - started >= _STABLE_CONNECTION else failures + 1
            self._mains.failed()  # the leader may be gone: the next main names the new one
            await asyncio.sleep(self._backoff(max(failures, 1)))

    def _backoff(self, failures: int) -> float:
        ceiling = min(
            self._reconnect_max_delay, _FIRST_RECONNECT_DELAY * 2 ** min(failures - 1, 30)
        )
        return random.uniform(ceiling / 2, ceiling)

    async def _connect(self) -> _Connection:
        host, port = self._mains.current
        try:
            async with asyncio.timeout(self._liveness_timeout):
                reader, raw_writer = await asyncio.open_connection(
                    host, port, limit=MAX_LINE_BYTES_CEILING + 2, ssl=self._tls
                )
        except ssl.SSLError as exc:
            # Retried like an unreachable main (a certificate may be renewed meanwhile),
            # but logged as what it is.
            raise ConnectionError(tls.describe(exc, f"{host}:{port}")) from exc
        self._enable_keepalive(raw_writer.get_extra_info("socket"))
        lines = wire.LineReader(reader)
        writer = wire.MessageWriter(raw_writer)
        try:
            async with asyncio.timeout(self._liveness_timeout):
                welcome = await self._handshake(lines, writer)
        except ssl.SSLError as exc:  # TLS 1.3 sends a refused client certificate's alert late
            writer.abort()
            raise ConnectionError(tls.describe(exc, f"{host}:{port}")) from exc
        except BaseException:
            writer.abort()
            raise
        lines.max_line_bytes = min(welcome.max_line_bytes, MAX_LINE_BYTES_CEILING)
        held = set(self._state.held_leases())
        adopted = {(ref.job_id, ref.handoff_id) for ref in welcome.adopted}
        self._logger.info(
            "connected to main %s at %s:%d (held %d leases, %d adopted)",
            welcome.main_id,
            host,
            port,
            len(held),
            len(adopted & held),
            extra={"event": "connected", "main_id": welcome.main_id},
        )
        return _Connection(
            lines=lines,
            writer=writer,
            welcome=welcome,
            ping_interval=min(self._ping_interval, welcome.ping_interval),
        )

    def _enable_keepalive(self, sock: socket.socket | None) -> None:
        """Let the kernel probe an idle connection too, in case pings cannot get out."""
        if sock is None:
            return
        options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
        for name, value in (
            ("TCP_KEEPIDLE", self._liveness_timeout),
            ("TCP_KEEPINTVL", self._ping_interval),
            ("TCP_KEEPCNT", 3),
        ):
            if hasattr(socket, name):
                options.append((socket.IPPROTO_TCP, getattr(socket, name), max(1, int(value))))
        with contextlib.suppress(OSError):
            for level, option, value in options:
                sock.setsockopt(level, option, value)

    async def _handshake(
        self, lines: wire.LineReader, writer: wire.MessageWriter
    ) -> protocol.Welcome:
        host, port = self._mains.current
        match await wire.read_greeting(
            lines, f"{host}:{port}", wire.GREETING_TIMEOUT, tls=self._tls is not None
        ):
            case protocol.Challenge() as challenge:
                pass
            case refusal:
                raise self._refusal(refusal, "challenge")
        if challenge.auth_required and not self._token:
            raise ConfigurationError(
                "the main requires a token: set the worker secret of the main "
                "(BROKER_WORKER_TOKEN), or its shared BROKER_TOKEN"
            )
        await writer.send(
            protocol.Hello(
                role=protocol.Role.WORKER,
                protocol=protocol.PROTOCOL_VERSION,
                protocols=list(protocol.SUPPORTED_PROTOCOLS),
                proof=protocol.make_proof(self._token, challenge.nonce) if self._token else None,
                worker_id=self.worker_id,
                host=socket.gethostname(),
                pid=os.getpid(),
                modes=list(self._runners),
                queues=self._queues,
                held_leases=[
                    protocol.LeaseRef(job, lease) for job, lease in self._state.held_leases()
                ],
                local_state_lost=self._local_state_lost,
            )
        )
        match await wire.read_message(lines):
            case protocol.Welcome() as welcome if welcome.protocol in protocol.SUPPORTED_PROTOCOLS:
                self._local_state_lost = False
                return welcome
            case protocol.Welcome() as welcome:
                raise ConfigurationError(
                    f"the main chose protocol {welcome.protocol}, which this worker does not "
                    "speak: run the same broker version on both"
                )
            case reply:
                raise self._refusal(reply, "welcome")

    @staticmethod
    def _refusal(msg: protocol.Message | None, expected: str) -> Exception:
        match msg:
            case None:
                return ConnectionResetError(f"the main closed the connection before {expected}")
            case protocol.Error() as error:
                return error_codes.refusal(error)
            case _:
                return ProtocolError(f"expected {expected} from the main, got {msg.type}")

    async def _serve(self, conn: _Connection) -> None:
        self._conn = conn
        await self._declare_tasks(conn)
        self._apply(self._state.connected(conn.welcome))
        tasks = [
            asyncio.create_task(self._read_loop(conn), name="broker-worker-read"),
            asyncio.create_task(self._send_loop(conn), name="broker-worker-send"),
            asyncio.create_task(self._ping_loop(conn), name="broker-worker-ping"),
            asyncio.create_task(self._watch_liveness(conn), name="broker-worker-liveness"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            self._conn = None
            self._apply(self._state.disconnected())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await conn.writer.close(grace=1.0)

    async def _declare_tasks(self, conn: _Connection) -> None:
        """Tell the main the tasks this worker serves and their defaults (its task
        catalog, :mod:`broker.core.catalog`), before anything else on the connection."""
        tasks = catalog.declarations(self._registry)
        if not tasks:
            return
        line = protocol.encode(protocol.TaskCatalog(tasks=tasks))
        if len(line) > conn.welcome.max_line_bytes:
            self._logger.error(
                "task catalog not sent: %d bytes, over the main's line limit of %d",
                len(line),
                conn.welcome.max_line_bytes,
                extra={"event": "task_catalog_too_long"},
            )
            return
        await conn.writer.write_raw(line)

    async def _watch_liveness(self, conn: _Connection) -> None:
        """Ends the connection once nothing has come from the main for the liveness
        timeout, or a send has waited on the socket that long: one timer per connection,
        where a timeout around every read cost a timer and three ``getpid`` calls per
        message, and one around every send a timer per batch of reports."""
        loop = asyncio.get_running_loop()
        limit = self._liveness_timeout
        conn.heard = loop.time()
        while True:
            now = loop.time()
            silent = now - conn.heard
            if silent >= limit:
                raise TimeoutError(f"nothing from the main for {limit} s")
            wait = limit - silent
            sending = conn.sending
            if sending is not None:
                if now - sending >= limit:
                    raise TimeoutError(f"a send to the main waited {limit} s on the socket")
                wait = min(wait, limit - (now - sending))
            await asyncio.sleep(wait)

    async def _read_loop(self, conn: _Connection) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn.heard = loop.time()  # the previous message (or the welcome) just came
            try:
                msg = await wire.read_message(conn.lines)
            except protocol.UnknownTypeError as exc:
                # A newer main may send messages this worker does not know; skip them.
                self._logger.warning("ignoring a message from the main: %s", exc)
                continue
            except protocol.DecodeError as exc:
                if exc.msg_type not in (protocol.ReportAck.type, protocol.ReportAcks.type):
                    raise
                # A newer main may answer with a status this worker does not know. Keep
                # the connection (and the leases on it); the report stays in the outbox
                # and is sent again on the next connection.
                self._logger.warning("ignoring a report_ack from the main: %s", exc)
                continue
            if msg is None:
                raise ConnectionResetError("the main closed the connection")
            self._handle(msg)

    async def _send_loop(self, conn: _Connection) -> None:
        """The one sender of everything except pings: reports in outbox order (as few
        ``reports`` lines as the line limit allows, each report encoded once), then at
        most one ``ready`` per wake-up, computed at the moment it is sent."""
        batch_bytes = min(conn.welcome.max_line_bytes, wire.BATCH_LINE_BYTES)
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            # One more turn lets a job that just freed its slot file its report, so the
            # report and the ``ready`` counting its slot go out together.
            await asyncio.sleep(0)
            self._wake.clear()
            lines: list[bytes] = []
            reports: list[bytes] = []
            for msg in self._state.outgoing(loop.time()):
                if isinstance(msg, protocol.Report):
                    reports.append(self._state.encoded(msg))
                else:
                    lines.append(protocol.encode(msg))
            lines.extend(
                protocol.pack(
                    protocol.Reports, reports, batch_bytes, conn.welcome.max_payload_containers
                )
            )
            ready = self._state.take_ready(self._free_slots())
            if ready is not None or conn.status_sent is None:
                status = self._status_message(conn)
                if status is not None:
                    lines.append(status)
            if ready is not None:
                lines.append(protocol.encode(ready))
            conn.sending = loop.time()
            await conn.writer.write_raw(b"".join(lines))
            conn.sending = None

    async def _ping_loop(self, conn: _Connection) -> None:
        for nonce in itertools.count(1):
            await asyncio.sleep(conn.ping_interval)
            async with asyncio.timeout(self._liveness_timeout):
                await conn.writer.send(protocol.Ping(nonce=nonce))

    def _capacity_changed(self) -> None:
        """A runner's free slots may have changed (called on the loop's thread)."""
        self._runners_changed = True
        self._apply(self._state.capacity_changed(self._free_slots()))

    def _free_slots(self) -> _FreeSlots:
        return _FreeSlots(self._runners)

    # ------------------------------------------------------------------ effects

    def _apply(self, effects: list[WorkerEffect]) -> None:
        """Carry out what the state decided, then mirror its idle/flushed for the drain."""
        for effect in effects:
            match effect:
                case StartRun(assignment=assignment):
                    self._start(assignment)
                case StopRun(key=key, mode=mode):
                    self._stop(key, mode)
                case WakeSender():
                    self._wake.set()
                case Drain():
                    self._stop_requested.set()
                case StopFast():
                    self._fast_requested.set()
                case CheckpointSettled(key=key, seq=seq, code=code, message=message):
                    waiter = self._checkpoint_waiters.pop((key, seq), None)
                    if waiter is not None and not waiter.done():
                        if code is None:
                            waiter.set_result(None)
                        else:
                            waiter.set_exception(
                                error_codes.exception_for(code, message or "not saved")
                            )
                case ProgressLater(delay=delay):
                    (self._loop or asyncio.get_running_loop()).call_later(delay, self._progress_due)
        _mirror(self._idle, self._state.idle)
        _mirror(self._flushed, self._state.flushed)

    def _stop(self, key: LeaseKey, mode: ExecutionMode) -> None:
        """Stop a job the main cancelled, in the background: the read loop must not wait."""
        task = asyncio.create_task(
            self._runners[mode].cancel(key[0]), name=f"broker-cancel-{key[0]}"
        )
        self._cancels.add(task)
        task.add_done_callback(functools.partial(self._cancel_done, key))

    def _cancel_done(self, key: LeaseKey, task: asyncio.Task[bool]) -> None:
        self._cancels.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._log_job(logging.ERROR, "stopping a cancelled job failed", key, error=repr(exc))

    def _start(self, assignment: Assignment) -> None:
        """Hand a job to its runner, which takes its slot at once and gives back the future
        of its outcome; a callback on that future settles the job, with no task per job."""
        key = (assignment.job_id, assignment.handoff_id)
        mode = assignment.execution_mode
        try:
            outcome = self._runners[mode].run(assignment)
        except Exception as exc:  # a runner bug must still end in a report
            loop = self._loop or asyncio.get_running_loop()
            outcome = loop.create_future()
            outcome.set_exception(exc)  # settled by the same callback, in a later step
        self._runs[key] = outcome
        self._apply(self._state.run_entered(key))
        outcome.add_done_callback(functools.partial(self._finished, key, mode))

    def _finished(
        self, key: LeaseKey, mode: ExecutionMode, future: asyncio.Future[RunOutcome]
    ) -> None:
        del self._runs[key]
        outcome: RunOutcome | None = None  # cancelled: abandoned at shut-down, no report
        if not future.cancelled():
            exc = future.exception()
            if exc is None:
                outcome = future.result()
            else:
                self._log_job(logging.ERROR, "runner failed", key, exc_info=exc)
                outcome = Failed(f"the {mode} runner failed: {exc!r}")
        now = asyncio.get_running_loop().time()
        self._apply(self._state.run_finished(key, outcome, self._free_slots(), now))

    # ------------------------------------------------------------------ messages

    def _handle(self, msg: protocol.Message) -> None:
        match msg:
            case protocol.JobHandoff():
                self._apply(self._state.job_received(msg, self._free_slots()))
            case protocol.Jobs(jobs=jobs):
                self._apply(self._state.jobs_received(jobs, self._free_slots()))
            case protocol.ReportAck():
                self._apply(self._state.ack_received(msg))
            case protocol.ReportAcks(acks=acks):
                self._apply([e for ack in acks for e in self._state.ack_received(ack)])
            case protocol.CancelJob():
                self._apply(self._state.cancel_received(msg))
            case protocol.CheckpointAck():
                self._apply(self._state.checkpoint_ack_received(msg))
            case protocol.Ping(nonce=nonce):
                self._apply(self._state.ping_received(nonce))
            case protocol.Pong():
                pass
            case protocol.Error(code=code, message=message, fatal=fatal):
                self._logger.log(
                    logging.ERROR if fatal else logging.WARNING,
                    "the main reported an error (%s): %s",
                    code,
                    message,
                    extra={"event": "main_error", "code": code},
                )
            case _:
                self._logger.warning("ignoring an unexpected %s message from the main", msg.type)

    def _status_message(self, conn: _Connection) -> bytes | None:
        """A ``worker_status`` line when capacity or a start-up error changed since the last
        one sent on this connection (always the first time), else ``None``."""
        sent = conn.status_sent
        if sent is not None and not self._runners_changed and sent[0] == self._state.draining:
            return None
        self._runners_changed = False
        runners = {mode: runner.status() for mode, runner in self._runners.items()}
        signature = (
            self._state.draining,
            *((mode, st.capacity, st.startup_error) for mode, st in runners.items()),
        )
        if signature == conn.status_sent:
            return None
        conn.status_sent = signature
        status = self.status()
        status["runners"] = {mode.value: dataclasses.asdict(st) for mode, st in runners.items()}
        try:
            line = protocol.encode(protocol.WorkerStatus(status=status))
            if len(line) <= MAX_WORKER_STATUS_BYTES:
                return line
        except ValueError:  # a runner's details that are not JSON must not cost the status
            pass
        # Too long for the main (MAX_WORKER_STATUS_BYTES), or not JSON: the capacity and
        # the start of each start-up error are what operators need (a few KiB at most).
        for runner_status in status["runners"].values():
            runner_status["details"] = {}
            if runner_status.get("startup_error"):
                runner_status["startup_error"] = str(runner_status["startup_error"])[:2000]
        return protocol.encode(protocol.WorkerStatus(status=status))

    def _log_job(
        self,
        level: int,
        event: str,
        key: LeaseKey,
        *,
        exc_info: BaseException | None = None,
        **fields: Any,
    ) -> None:
        if self._logger.isEnabledFor(level):
            job = self._state.job_of(key)
            log_job(self._logger, level, event, key, job, exc_info=exc_info, **fields)


class _FreeSlots(Mapping[ExecutionMode, int]):
    """Each runner's free slots now, asked of a runner only once the state looks at its
    mode, and once: the state looks only at the modes it holds jobs of, and the pooled
    runner walks its children to count (a worker counts for every job it receives and
    every job that ends)."""

    __slots__ = ("_counted", "_runners")

    def __init__(self, runners: Mapping[ExecutionMode, Runner]) -> None:
        self._runners = runners
        self._counted: dict[ExecutionMode, int] = {}

    def __getitem__(self, mode: ExecutionMode) -> int:
        try:
            return self._counted[mode]
        except KeyError:
            free = self._counted[mode] = self._runners[mode].free_slots()
            return free

    def get(self, mode: ExecutionMode, default: int | None = None) -> int | None:  # type: ignore[override]
        return self[mode] if mode in self._runners else default

    def __iter__(self) -> Iterator[ExecutionMode]:
        return iter(self._runners)

    def __len__(self) -> int:
        return len(self._runners)


def _mirror(event: asyncio.Event, value: bool) -> None:
    if value:
        event.set()
    else:
        event.clear()


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def install_signal_handlers(worker: Worker) -> None:
    """SIGTERM or SIGINT drains the worker; a second one stops it fast.

    Call from inside the running event loop (the CLI does, just before ``run()``).
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, functools.partial(_on_signal, worker, sig))


def _on_signal(worker: Worker, sig: signal.Signals) -> None:
    logging.getLogger("broker.worker").info("received %s", sig.name)
    worker.request_stop()
