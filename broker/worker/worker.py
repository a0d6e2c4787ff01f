"""The worker: one per machine, it takes jobs from the main and runs them on its runners.

A worker holds one connection to the main and keeps it (:mod:`broker.worker.link`,
reconnecting as :mod:`broker.core.reconnect` says).

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
owns the timers and the runners' tasks, feeds the connection's messages and the jobs'
outcomes into the state and carries its effects out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import socket
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

from broker.core import catalog
from broker.core.job_log import log_job
from broker.core.window import AdaptiveWindow, line_cap
from broker.core.worker_effects import (
    CheckpointSettled,
    Drain,
    ProgressLater,
    ReportsLater,
    StartRun,
    StopFast,
    StopRun,
    WakeSender,
    WorkerEffect,
)
from broker.core.worker_state import WorkerState
from broker.exceptions import ConfigurationError
from broker.jobs import ExecutionMode, JSONValue
from broker.model.bounds import MAX_WORKER_STATUS_BYTES
from broker.tasks.registry import TaskRegistry, default_registry
from broker.tasks.runner import Assignment, Failed, LeaseKey, Runner, RunOutcome
from broker.wire import codec
from broker.wire import errors as error_codes
from broker.wire import framing as wire
from broker.wire import messages as protocol
from broker.wire.addresses import MainAddresses
from broker.wire.tls import PeerTLS
from broker.worker.link import TCP, Endpoint, Link, Network
from broker.worker.link import Connection as _Connection
from broker.worker.settings import PREFETCH_MAX_PER_SLOT, PREFETCH_PER_SLOT, WorkerSettings
from broker.worker.slots import FreeSlots

FLUSH_TIMEOUT = 10.0
"""How long a draining worker waits for the main to acknowledge its last reports."""

FAST_FLUSH_TIMEOUT = 2.0
"""The same wait when told to stop fast: long enough to hand back what it gave up."""

CANCEL_WAIT = 5.0
"""How long to wait for cancelled jobs to come back with an outcome before exiting."""


def _default_window(slots: int) -> AdaptiveWindow:
    return AdaptiveWindow(
        size=PREFETCH_PER_SLOT * slots, cap=line_cap(PREFETCH_MAX_PER_SLOT * slots)
    )


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

    network: Network = TCP()
    """How connections to a main are opened; a test puts memory streams here."""

    def __init__(
        self,
        main_host: str,
        main_port: int,
        *,
        worker_id: str,
        runners: Mapping[ExecutionMode, Runner],
        registry: TaskRegistry | None = None,
        token: str | None = None,
        queues: Sequence[str] | None = WorkerSettings.queues,
        ping_interval: float = WorkerSettings.ping_interval,
        liveness_timeout: float = WorkerSettings.liveness_timeout,
        reconnect_max_delay: float = WorkerSettings.reconnect_max_delay,
        drain_timeout: float | None = WorkerSettings.drain_timeout,
        logger: logging.Logger | None = None,
        prefetch: int | None = WorkerSettings.prefetch,
        tls: PeerTLS | ssl.SSLContext | None = None,
        local_state_lost: bool = False,
    ) -> None:
        """``local_state_lost``: this process starts without the local state an earlier
        one with the same ``worker_id`` left (its state directory is new), so the main
        stops holding recoveries for it; said in the first hello only, since a reconnect
        of the same process still has whatever it built since. The tunables' defaults and
        rules are :class:`~broker.worker.settings.WorkerSettings`' (``broker-worker``
        passes its settings as ``**settings.keywords()``)."""
        if not worker_id:
            raise ConfigurationError("worker_id must be a non-empty string")
        if not runners:
            raise ConfigurationError("a worker needs at least one runner")
        for mode, runner in runners.items():
            if runner.mode != mode:
                raise ConfigurationError(f"the runner for {mode} jobs serves {runner.mode}")
        WorkerSettings(
            queues=queues,
            ping_interval=ping_interval,
            liveness_timeout=liveness_timeout,
            reconnect_max_delay=reconnect_max_delay,
            drain_timeout=drain_timeout,
            prefetch=prefetch,
        ).validate()
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
            link = Link(
                self._mains,
                Endpoint(
                    hello=self._hello,
                    joined=self._joined,
                    handle=self._handle,
                    outgoing=self._outgoing,
                    left=self._left,
                ),
                self._wake,
                network=self.network,
                token=self._token,
                tls=self._tls,
                ping_interval=self._ping_interval,
                liveness_timeout=self._liveness_timeout,
                reconnect_max_delay=self._reconnect_max_delay,
                logger=self._logger,
            )
            connection = asyncio.create_task(link.stay_connected(), name="broker-worker-connection")
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

    def _reports_due(self) -> None:
        self._apply(self._state.reports_due())

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

    def _hello(self) -> protocol.Hello:
        """What this worker says of itself to each main: the leases it holds among it."""
        return protocol.Hello(
            role=protocol.Role.WORKER,
            protocol=protocol.PROTOCOL_VERSION,
            protocols=list(protocol.SUPPORTED_PROTOCOLS),
            worker_id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            modes=list(self._runners),
            queues=self._queues,
            held_leases=[protocol.LeaseRef(job, lease) for job, lease in self._state.held_leases()],
            local_state_lost=self._local_state_lost,
            prefetch_modes=self._state.prefetching(),
        )

    async def _joined(self, conn: _Connection) -> None:
        self._local_state_lost = False  # the main has heard it
        self._conn = conn
        await self._declare_tasks(conn)
        self._apply(self._state.connected(conn.welcome))

    def _left(self) -> None:
        self._conn = None
        self._apply(self._state.disconnected())

    async def _declare_tasks(self, conn: _Connection) -> None:
        """Tell the main the tasks this worker serves and their defaults (its task
        catalog, :mod:`broker.core.catalog`), before anything else on the connection."""
        tasks = catalog.declarations(self._registry)
        if not tasks:
            return
        line = codec.encode(protocol.TaskCatalog(tasks=tasks))
        if len(line) > conn.welcome.max_line_bytes:
            self._logger.error(
                "task catalog not sent: %d bytes, over the main's line limit of %d",
                len(line),
                conn.welcome.max_line_bytes,
                extra={"event": "task_catalog_too_long"},
            )
            return
        await conn.writer.write_raw(line)

    def _outgoing(self, conn: _Connection) -> bytes:
        """What the sender writes when woken: reports in outbox order (as few ``reports``
        lines as the line limit allows, each report encoded once), then at most one
        ``ready``, computed at the moment it is sent."""
        batch_bytes = min(conn.welcome.max_line_bytes, wire.BATCH_LINE_BYTES)
        lines: list[bytes] = []
        reports: list[bytes] = []
        for msg in self._state.outgoing((self._loop or asyncio.get_running_loop()).time()):
            if isinstance(msg, protocol.Report):
                reports.append(self._state.encoded(msg))
            else:
                lines.append(codec.encode(msg))
        lines.extend(
            codec.pack(protocol.Reports, reports, batch_bytes, conn.welcome.max_payload_containers)
        )
        ready = self._state.take_ready(self._free_slots())
        if ready is not None or conn.status_sent is None:
            status = self._status_message(conn)
            if status is not None:
                lines.append(status)
        if ready is not None:
            lines.append(codec.encode(ready))
        return b"".join(lines)

    def _capacity_changed(self) -> None:
        """A runner's free slots may have changed (called on the loop's thread)."""
        self._runners_changed = True
        self._apply(self._state.capacity_changed(self._free_slots()))

    def _free_slots(self) -> FreeSlots:
        return FreeSlots(self._runners)

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
                case ReportsLater(delay=delay):
                    (self._loop or asyncio.get_running_loop()).call_later(delay, self._reports_due)
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
        loop = self._loop or asyncio.get_running_loop()
        try:
            outcome = self._runners[mode].run(assignment)
        except Exception as exc:  # a runner bug must still end in a report
            outcome = loop.create_future()
            outcome.set_exception(exc)  # settled by the same callback, in a later step
        self._runs[key] = outcome
        self._apply(self._state.run_entered(key, loop.time()))
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
            line = codec.encode(protocol.WorkerStatus(status=status))
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
        return codec.encode(protocol.WorkerStatus(status=status))

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


def _mirror(event: asyncio.Event, value: bool) -> None:
    if value:
        event.set()
    else:
        event.clear()


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
