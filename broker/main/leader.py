"""What only the dispatching main runs: built with the main, started once it leads and
its orphans are loaded (at once on a store that holds one main).

These are the shells that carry the handoff core's effects to the store (dispatch
passes, lease recovery, the report, checkpoint and progress writers) and the loops that
feed it events (the liveness ticks, the orphans' deadline), with the task grace,
retention and the schedules. The main routes peers' messages into the core and carries
its effects here (``Main._carry``); a standby builds all of this and runs none of it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import uuid
from collections.abc import Callable, Collection, Sequence

from broker.core.handoff import STALL, Handoff, HandoffEffect, Send
from broker.jobs import Clock
from broker.main.catalog import Declarations
from broker.main.checkpoints import CheckpointSaver, ProgressWriter
from broker.main.dispatcher import Dispatcher
from broker.main.loops import Spawn
from broker.main.metrics import MainMetrics, MeasuredStore
from broker.main.recovery import RecoveryLedger
from broker.main.retention import Retention, run_retention
from broker.main.scheduler import Scheduler, catch_up_window
from broker.main.settings import MainSettings
from broker.main.settler import ReportSettler
from broker.model.logs import log_event
from broker.retry import RetryDelay
from broker.storage import StorageAdapter, SupportsDueNotice, SupportsEndNotice, SupportsNotify
from broker.tasks.schedule import Schedule
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")

_LIVENESS_TICKS = 4
"""Liveness checks per ping interval: frequent enough that a dead peer is dropped soon
after its deadline and a stall of the main is measured closely."""


class Leader:
    """The dispatching main's loops and store writers."""

    def __init__(
        self,
        store: StorageAdapter,
        handoff: Handoff,
        settings: MainSettings,
        *,
        metrics: MainMetrics,
        clock: Clock,
        retry_delay: RetryDelay,
        carry: Callable[[Sequence[HandoffEffect]], None],
        stopping: Callable[[], bool],
        declarations: Declarations,
        live_workers: Callable[[], Collection[str]],
        schedules: Sequence[Schedule],
        retention: Retention | None,
        ended: Callable[[list[uuid.UUID]], None],
    ) -> None:
        """``carry`` carries out the core's effects; ``live_workers()`` names the workers
        connected now; ``ended`` hears of jobs that may have ended (the waiters' notice,
        :meth:`broker.main.waits.Waits.ended`)."""
        self._store = store
        self._handoff = handoff
        self._settings = settings
        self._clock = clock
        self._carry = carry
        self._declarations = declarations
        self._live_workers = live_workers
        measured: StorageAdapter = MeasuredStore(store, metrics)
        self.dispatcher = Dispatcher(
            measured,
            handoff,
            carry=carry,
            stopping=stopping,
            clock=clock,
            claim_batch=settings.claim_batch,
            max_claims_in_flight=settings.max_claims_in_flight,
            poll_interval=settings.poll_interval,
            notify_fallback_interval=settings.notify_fallback_interval,
            retry_interval=settings.error_retry_interval,
        )
        if isinstance(store, SupportsDueNotice):
            store.on_due(self.dispatcher.wake)
        if isinstance(store, SupportsEndNotice):
            store.on_ended(ended)  # dependents a parent's end cancelled: their waiters
        self.ledger = RecoveryLedger(
            store,
            handoff,
            retry_interval=settings.error_retry_interval,
            on_returned=self.dispatcher.wake,
            ended=ended,
            clock=clock,
            max_recoveries=settings.max_recoveries,
        )
        self.settler = ReportSettler(
            measured,
            handoff,
            acknowledged=self._acknowledge,
            ended=ended,
            stopping=stopping,
            clock=clock,
            retry_delay=retry_delay,
            max_recoveries=settings.max_recoveries,
            batch=settings.report_batch,
            retry_interval=settings.error_retry_interval,
            max_payload_bytes=settings.max_payload_bytes,
            max_payload_depth=settings.max_payload_depth,
            max_payload_containers=settings.max_payload_containers,
            metrics=metrics,
        )
        self.checkpoints = CheckpointSaver(
            measured,
            answer=self._answer_checkpoints,
            stopping=stopping,
            batch=settings.report_batch,
            retry_interval=settings.error_retry_interval,
            max_checkpoint_bytes=settings.checkpoint_limit,
            max_payload_depth=settings.max_payload_depth,
            max_payload_containers=settings.max_payload_containers,
        )
        """Checkpoints, group-committed and acknowledged once durable."""
        self.progress = ProgressWriter(measured)
        self.retention = retention
        """Pruning of finished jobs (see :mod:`broker.main.retention`); ``None``: never prune."""
        self.scheduler = Scheduler(
            store,
            schedules,
            clock=clock,
            on_enqueued=self.dispatcher.wake,
            error_retry_interval=settings.error_retry_interval,
            catch_up_window=catch_up_window(retention),
        )
        """Enqueues the periodic jobs' ticks, each once (see :mod:`broker.tasks.schedule`)."""
        self.tick_due = math.inf
        """When the liveness loop's next check is due (loop time): a disconnect read later
        than that comes while the loop is still catching up on a stall."""

    def start(self, spawn: Spawn) -> None:
        """Start every loop (the orphans are loaded)."""
        self._handoff.serving(asyncio.get_running_loop().time())
        spawn(self.dispatcher.run(), "broker-dispatch")
        spawn(self.ledger.run(), "broker-recovery")
        spawn(self.settler.run(), "broker-reports")
        spawn(self.checkpoints.run(), "broker-checkpoints")
        spawn(self.progress.run(), "broker-progress")
        spawn(self._liveness_loop(), "broker-liveness")
        spawn(self._declarations.forget_gone_workers(self._live_workers), "broker-task-grace")
        if self._handoff.orphans:
            spawn(self._orphan_deadline(), "broker-orphans")
        if self._store.capabilities.listen_notify and isinstance(self._store, SupportsNotify):
            spawn(self.dispatcher.listen(), "broker-listen")
        if self.retention is not None:
            spawn(run_retention(self._store, self.retention, self._clock), "broker-retention")
        if self.scheduler.schedules:
            spawn(self.scheduler.run(), "broker-schedule")

    def _acknowledge(
        self, batch: list[tuple[int, protocol.Report]], statuses: list[protocol.AckStatus]
    ) -> None:
        self._carry(
            self._handoff.settled(
                [(peer, msg, status) for (peer, msg), status in zip(batch, statuses, strict=True)]
            )
        )

    def _answer_checkpoints(self, acks: list[tuple[int, protocol.CheckpointAck]]) -> None:
        self._carry([Send(peer, ack) for peer, ack in acks])

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
        tick = self._settings.ping_interval / _LIVENESS_TICKS
        for n in itertools.count(1):
            planned = self.tick_due = loop.time() + tick
            await asyncio.sleep(tick)
            now = loop.time()
            stall = now - planned
            if stall >= STALL:
                log_event(
                    logger, logging.WARNING, "the main's loop was stalled", seconds=round(stall, 1)
                )
            self._carry(
                self._handoff.tick(
                    now,
                    stall=stall,
                    timeout=self._settings.liveness_timeout,
                    ping=n % _LIVENESS_TICKS == 0,
                )
            )

    async def _orphan_deadline(self) -> None:
        await asyncio.sleep(self._settings.orphan_grace)
        effects = self._handoff.orphan_deadline()
        log_event(logger, logging.INFO, "orphan grace over", returned=len(effects))
        self._carry(effects)
