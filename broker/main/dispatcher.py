"""The dispatcher: passes that read eligible jobs, plan them with the handoff core and
claim them in the store, with up to ``max_claims_in_flight`` claims under way at once.

It holds no handoff state: credits, leases and claims in flight are the core's
(:mod:`broker.core.handoff`), and the effects of a claim (jobs to send, leases to return) are
carried out by the main. Between passes it sleeps until woken (a ``ready``, a report, an
insert the store notified, a lease returned, a claim answered) or until the next
scheduled job is due. Every decision of when to read again (listen or not, pause, poll,
a second read, the read-ahead, the next run time kept, how long to sleep) is
:mod:`broker.core.pacing`'s: this module only awaits, and asks.

**Pipelining.** A pass does not wait for its claim to answer before the next pass reads:
the credit a report freed while a claim was in flight is used at once, instead of after
a full round trip. The core already keeps the two passes apart (a job being claimed is
never planned again, and every reserved credit is counted), so the only care here is to
read far enough past the jobs still being claimed, which the store still shows queued.

**What a wake-up re-reads.** A freed slot or an answered claim (:meth:`Dispatcher.nudge`)
changes no job: the next pass skips the modes the core has proven drained, and an idle
dispatcher reuses the next run time it last read, while the store's notifications are live
(any insert wakes it through :meth:`Dispatcher.wake`, which forgets both); without them
(SQLite, or a listener being restored), the drained modes are read again at least every
``poll_interval``, and the next run time at every idle pass, as before. In a pooled
drain of 40,000 jobs on PostgreSQL, the worker's inline and forked slots, free all along,
cost 1,500 empty reads, and the next run time, a scan of every queued row, 640 reads of
about 15 ms each: about 240 us of the database's CPU per job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from broker.core import pacing
from broker.core.handoff import ClaimJobs, Handoff, HandoffEffect, PlannedClaim
from broker.core.pacing import Pacing, ReadAhead
from broker.exceptions import transient
from broker.jobs import Clock, DispatchKey, EnqueueResult, ExecutionMode, Job
from broker.main.loops import retrying
from broker.model.logs import log_event
from broker.storage import StorageAdapter, SupportsNotify

logger = logging.getLogger("broker.main")


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


class Dispatcher:
    def __init__(
        self,
        store: StorageAdapter,
        handoff: Handoff,
        *,
        carry: Callable[[Sequence[HandoffEffect]], None],
        stopping: Callable[[], bool],
        clock: Clock,
        claim_batch: int,
        poll_interval: float,
        notify_fallback_interval: float,
        retry_interval: float,
        max_claims_in_flight: int = 2,
        now: Callable[[], float] = _loop_time,
    ) -> None:
        """``now`` is the clock of the handoff core's times and of the read-ahead's age:
        the event loop's, but a test of the pipeline's steps gives one that stands still,
        so that a loaded machine taking 50 ms between two steps does not age a read."""
        self._now = now
        self._store = store
        self._handoff = handoff
        self._carry = carry
        self._stopping = stopping
        self._claim_batch = claim_batch
        self._retry_interval = retry_interval
        self._max_claims_in_flight = max_claims_in_flight
        self._wake = asyncio.Event()
        self._claims: set[asyncio.Task[None]] = set()
        self.pacing = Pacing(
            now=now,
            clock=clock,
            poll_interval=poll_interval,
            notify_fallback_interval=notify_fallback_interval,
            retry_interval=retry_interval,
        )
        """When to read again (see :mod:`broker.core.pacing`)."""
        self._credit_changed = asyncio.Event()
        """Set by a nudge (which any change of free credit comes with) while not
        listening: the listener looks at the credit again (a wake changes none)."""
        self._ahead = ReadAhead()
        self._overtaking = 0
        """Jobs the main enqueued that stand before the read-ahead (urgent ones), not yet
        read by a pass: the next pass is an express one (:meth:`Pacing.express`)."""

    def enqueued(self, added: Sequence[EnqueueResult]) -> None:
        """The main stored the queued jobs ``added`` (its own enqueue, committed): a wake
        that only their modes stop counting as drained for, and that keeps a read-ahead
        they do not stand before (see :meth:`ReadAhead.inserted`)."""
        if not added:
            return
        core = self._handoff
        before = core.queue_changes
        core.jobs_added({result.field("execution_mode") for result in added})
        self._overtaking += self._ahead.inserted(before, core.queue_changes, added)
        # An express pass may take a spare credit (Pacing.express): worth a pass with one.
        if Pacing.worth_a_pass(core.credit(leading=self._overtaking > 0)):
            self._wake.set()

    def leads(self, mode: ExecutionMode, queue: str, key: DispatchKey) -> bool:
        """Whether a job about to be enqueued would stand before every job of its mode
        still waiting in the store, as the read-ahead knows (:meth:`ReadAhead.leads`):
        the enqueue may then hand it off at once (:meth:`Handoff.plan_at_enqueue`). Never
        while some queue has settings or some task a rate limit: every pass then reads
        the store, and the read-ahead is not kept."""
        core = self._handoff
        if core.flow.limiting:
            return False
        return self._ahead.leads(mode, queue, key, core.queue_changes, self._now())

    def wake(self) -> None:
        """Ask for another pass (coalesced: many wakes, one pass) if it is worth one
        (:meth:`Pacing.worth_a_pass`). Whatever woke us may have made jobs eligible, so
        the core stops counting any mode as drained."""
        self._handoff.queue_changed()
        if Pacing.worth_a_pass(self._handoff.credit()):
            self._wake.set()

    def nudge(self) -> None:
        """Ask for another pass because more jobs may be placed (a slot was freed, a claim
        answered), not because any job changed: modes proven drained stay so."""
        self._wake.set()
        if self.pacing.nudged():
            self._credit_changed.set()

    async def listen(self) -> None:
        """Keep the store's notifications on while they can help (see
        :meth:`_listen_once`); while they are down, each failure wakes the dispatcher for
        a pass, since an enqueue may have gone unannounced."""
        await retrying(
            "store listener",
            self._listen_once,
            interval=self._retry_interval,
            logger=logger,
            on_error=self.wake,
        )

    async def _listen_once(self) -> None:
        """Listen while :meth:`Pacing.listen` says (while some worker has a free slot, and
        a while after). Free credit always comes with a nudge (a ``ready``, a report, a
        claim answered), and listening again starts with a wake that forgets every mode
        proven drained, so an insert made while nobody listened is found by the next
        pass.
        """
        assert isinstance(self._store, SupportsNotify)
        rules = self.pacing
        while True:
            await self._until(lambda: rules.listen(self._handoff.credit()))
            async with self._store.listen(self.wake):
                rules.listened()
                # An insert while the notifications were down went unannounced.
                self.wake()
                try:
                    await self._until(lambda: rules.stop_listening(self._handoff.credit()))
                finally:
                    rules.stopped_listening()

    async def _until(self, condition: Callable[[], bool]) -> None:
        """Until ``condition()`` holds, looked at every ``LISTEN_LINGER`` seconds and
        after every nudge while not listening."""
        while not condition():
            self._credit_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pacing.LISTEN_LINGER):  # not wait_for: see run()
                    await self._credit_changed.wait()

    async def run(self) -> None:
        """Pass after pass; between them, sleep until woken or the next job is due."""
        try:
            while True:
                self._wake.clear()
                more = await retrying(
                    "dispatch pass",
                    self.dispatch_once,
                    interval=self._retry_interval,
                    logger=logger,
                )
                if more:
                    continue
                if self._claims:
                    # The first claim to answer wakes us for another pass, which looks
                    # again. Reading the next run time meanwhile would cost the store a
                    # scan of the queued rows per pass for nothing (it is worked out
                    # again once no claim is under way). A rate-limited queue's next
                    # token does not wait for the claim: a slow claim would lose tokens.
                    await self._until_woken(self._handoff.flow.wake_at(self._now()))
                    continue
                timeout = await self._idle_timeout()
                try:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a
                    # cancellation that arrives as the event is set, and the loop would
                    # outlive the main's shutdown.
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
                except TimeoutError:
                    # Time alone makes jobs due (and ends an affinity's grace): no mode
                    # counts as drained, and the next run time is read again.
                    self._handoff.queue_changed()
        finally:
            for task in self._claims:
                task.cancel()
            await asyncio.gather(*self._claims, return_exceptions=True)

    async def _until_woken(self, at: float | None) -> None:
        """Until woken, or until loop time ``at`` (when a queue held back gets a token:
        no queue counts as drained then, see :meth:`FlowControl.wake_at`)."""
        if at is None:
            await self._wake.wait()
            return
        try:
            async with asyncio.timeout_at(at):
                await self._wake.wait()
        except TimeoutError:
            self._handoff.queue_changed()

    async def _idle_timeout(self) -> float | None:
        """How long to sleep when there is nothing to dispatch (see
        :meth:`Pacing.idle_timeout`); ``None`` (until woken) with no free slot."""
        modes = self._handoff.modes_with_credit()
        if not modes:
            return None
        now = self._now()
        try:
            next_at = await self._next_run_at(
                modes, self._handoff.served_queues(), self._handoff.flow.blocked(now)
            )
        except Exception as exc:
            log_event(logger, logging.WARNING, "could not read the next run time", error=repr(exc))
            return self.pacing.after_failed_read()
        return self.pacing.idle_timeout(
            next_at,
            polling=not self._store.capabilities.listen_notify,
            affinity_wake=self._handoff.wake_at(now),
        )

    async def _next_run_at(
        self, modes: set[ExecutionMode], queues: set[str] | None, blocked: frozenset[str]
    ) -> datetime | None:
        """The store's next run time for ``modes`` and ``queues``, or the last one read
        when it still holds (:meth:`Pacing.known_next_run`). Queues held back
        (``blocked``, see :mod:`broker.core.flow`) are left out: their due jobs would make
        the next run time now, and the dispatcher spin; the flow's own wake covers them."""
        if blocked:
            return await self._store.next_run_at(  # type: ignore[call-arg]
                modes=modes, queues=queues, exclude_queues=blocked
            )
        changes = self._handoff.queue_changes
        known = self.pacing.known_next_run(modes, queues, changes)
        if known is not None:
            return known.at
        next_at = await self._store.next_run_at(modes=modes, queues=queues)
        self.pacing.next_run_read(modes, queues, changes, next_at)
        return next_at

    async def dispatch_once(self) -> bool:
        """One dispatch pass: read, plan, and start the claim without waiting for it.

        Returns ``True`` when another pass may find more work right away (the read was
        full and credit is left). A pass is skipped while the claims in flight are at
        their cap (the first to answer wakes the dispatcher) or shortly after a claim
        raised.
        """
        rules = self.pacing
        express = rules.express(self._overtaking, len(self._claims), self._max_claims_in_flight)
        if self._stopping() or (len(self._claims) >= self._max_claims_in_flight and not express):
            return False
        pause = rules.pause()
        if pause > 0:
            await asyncio.sleep(pause)
        core = self._handoff
        leading = bool(express)  # its jobs stand before every job waiting: spares too
        if rules.poll_due():
            core.queue_changed()
        queues = core.served_queues()
        modes = core.modes_with_credit(leading=leading) - core.drained
        if not modes:
            return False
        # Jobs being claimed still look queued to the store: the read leaves them out, or
        # a pass during a claim would find only those. Jobs held back for their state
        # holder are planned again (see broker.core.affinity): read past them.
        held = len(core.awaiting)
        size = core.read_limit(self._claim_batch, modes, leading=leading) + held
        started = core.queue_changes
        now = self._now()
        blocked = core.flow.leave_out(now)
        self._overtaking = 0  # this pass finds them first
        if express:
            # The read-ahead holds the overtaking jobs when the insert kept it current
            # (ReadAhead.inserted): no read then, just their claim.
            size = min(size, express + held)
            served = (
                None if core.flow.limiting else self._ahead.serve(modes, queues, size, started, now)
            )
            if served is None:
                jobs = await self._read(modes, queues, size, blocked)
                full = len(jobs) == size
            else:
                jobs, full = served
        else:
            jobs, full = await self._eligible(modes, queues, size, started, blocked)
        now = self._now()
        plan = core.plan(jobs, now, leading=leading)
        core.read_eligible(started, modes, full=full or len(plan) < len(jobs), queues=queues)
        left = core.modes_with_credit() - core.drained
        if not express and rules.read_again(left, len(jobs), len(plan), held):
            # This read covers every mode with credit left, so whether it came back full
            # says whether another pass may find more.
            size = core.read_limit(self._claim_batch, left) + len(core.awaiting)
            found = await self._read(left, queues, size, core.flow.leave_out(now))
            full = len(found) == size
            placed = core.plan(found, now)
            core.read_eligible(started, left, full=full or len(placed) < len(found), queues=queues)
            plan += placed
        self._ahead.planned(plan)
        if not plan:
            return False
        self._claims.add(asyncio.create_task(self._claim_and_wake(plan), name="broker-claim"))
        return (full or bool(express)) and core.credit() > 0

    async def _read(
        self, modes: set[ExecutionMode], queues: set[str] | None, size: int, blocked: frozenset[str]
    ) -> list[Job]:
        """A read of the store: the best ``size`` eligible jobs of ``modes`` in ``queues``,
        but those being claimed, those of the queues held back (``blocked``), those of
        tasks no connected worker declared or whose rate limit has no token
        (:meth:`Handoff.tasks_to_read <broker.core.handoff.Handoff.tasks_to_read>`) and
        those of the keys of per-key limits with no token
        (:meth:`FlowControl.leave_out_keys <broker.core.flow.FlowControl.leave_out_keys>`)."""
        tasks = self._handoff.tasks_to_read(self._now())
        keys = self._handoff.flow.leave_out_keys(self._now())
        # Only what some limit needs: a store without queue settings takes neither.
        extra: dict[str, Any] = {}
        if blocked:
            extra["exclude_queues"] = blocked
        if keys:
            extra["exclude_keys"] = keys
        return await self._store.select_eligible(
            modes=modes, queues=queues, limit=size, skip=self._claiming(), tasks=tasks, **extra
        )

    async def _eligible(
        self,
        modes: set[ExecutionMode],
        queues: set[str] | None,
        size: int,
        started: int,
        blocked: frozenset[str],
    ) -> tuple[list[Job], bool]:
        """The best ``size`` eligible jobs of ``modes`` (and whether there were that many):
        from the read-ahead while it holds, else from a read of the store, which may ask
        for more than ``size`` (see :class:`ReadAhead`). While some queue has settings
        (paused, limited) or some task a rate limit, every pass reads the store: jobs read
        ahead may belong to a queue or task that has since run out of tokens, and would be
        served again and again."""
        if self._handoff.flow.limiting:
            jobs = await self._read(modes, queues, size, blocked)
            return jobs, len(jobs) == size
        now = self._now()
        served = self._ahead.serve(modes, queues, size, started, now)
        if served is not None:
            return served
        limit = self._ahead.read_size(modes, queues, size, started, self._claim_batch, now)
        jobs = await self._read(modes, queues, limit, blocked)
        self._ahead.fill(jobs, modes, queues, limit, started, now)
        served = self._ahead.serve(modes, queues, size, started, now)
        assert served is not None  # just filled for these modes, queues and change count
        return served

    def _claiming(self) -> list[uuid.UUID]:
        """The jobs of the claims under way (and of the plan just made)."""
        return [planned.job.id for planned in self._handoff.claiming.values()]

    async def _claim_and_wake(self, plan: Sequence[PlannedClaim]) -> None:
        """A claim under way: when it answers, a pass may start (its slot in the pipeline
        is free, and a failure pauses the next pass instead of being retried at once)."""
        try:
            error = await self._claim(plan)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: say so and keep dispatching
            logger.exception("claim failed unexpectedly")
            error = exc
        if error is not None:
            self.pacing.claim_failed()
        # Out of the pipeline before the wake (a done callback would run too late: the
        # woken pass would still see the pipeline full, and sleep).
        task = asyncio.current_task()
        assert task is not None
        self._claims.discard(task)
        self.nudge()

    async def _claim(self, plan: Sequence[PlannedClaim]) -> Exception | None:
        """Claim the planned jobs in one call and send the ones won; returns the first
        error met, if any.

        When the call raises, nobody knows whether it committed, so the core sends each
        of its leases to the ledger. An error that is not transient (a value the store
        refuses, say) would recur forever, so the core has the batch claimed again in
        halves under fresh leases until the job or worker behind it stands alone: one bad
        row or worker id never stops dispatch to the others.
        """
        try:
            claimed = await self._store.mark_handed_off_many([p.claim for p in plan])
        except Exception as exc:
            if transient(exc) or len(plan) == 1:
                log_event(
                    logger,
                    logging.WARNING,
                    "claim outcome unknown",
                    jobs=len(plan),
                    error=repr(exc),
                )
                self._carry(self._handoff.claim_unknown(plan))
                return exc
            log_event(
                logger,
                logging.WARNING,
                "claiming a batch failed, splitting it to isolate the cause",
                jobs=len(plan),
                error=repr(exc),
            )
            effects = self._handoff.claim_refused(plan)
            self._carry(effects)
            for effect in effects:
                if isinstance(effect, ClaimJobs):
                    await self._claim(effect.claims)
            return exc
        # A loop turn between the claim's answer (its rows made into jobs) and the jobs
        # sent: each is a long step at a drain's rate (see BatchWriter.write).
        await asyncio.sleep(0)
        self._carry(self._handoff.claimed(plan, claimed))
        return None
