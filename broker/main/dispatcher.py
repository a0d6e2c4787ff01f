"""The dispatcher: passes that read eligible jobs, plan them with the handoff core and
claim them in the store, with up to ``max_claims_in_flight`` claims under way at once.

It holds no handoff state: credits, leases and claims in flight are the core's
(:mod:`broker.core.handoff`), and the effects of a claim (jobs to send, leases to return) are
carried out by the main. Between passes it sleeps until woken (a ``ready``, a report, an
insert the store notified, a lease returned, a claim answered) or until the next
scheduled job is due.

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
import operator
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime

from broker.core.handoff import ClaimJobs, Handoff, HandoffEffect, PlannedClaim
from broker.exceptions import transient
from broker.jobs import (
    DISPATCH_KEY_FIELDS,
    Clock,
    DispatchKey,
    EnqueueResult,
    ExecutionMode,
    Job,
    dispatch_key,
)
from broker.main.loops import retrying
from broker.model.logs import log_event
from broker.storage import StorageAdapter, SupportsNotify

logger = logging.getLogger("broker.main")

LISTEN_LINGER = 2.0
"""Seconds without free credit before the dispatcher stops listening to the store."""


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
    ) -> None:
        self._store = store
        self._handoff = handoff
        self._carry = carry
        self._stopping = stopping
        self._clock = clock
        self._claim_batch = claim_batch
        self._poll_interval = poll_interval
        self._notify_fallback_interval = notify_fallback_interval
        self._retry_interval = retry_interval
        self._max_claims_in_flight = max_claims_in_flight
        self._wake = asyncio.Event()
        self._claims: set[asyncio.Task[None]] = set()
        self._failed_at: float | None = None
        """Loop time of the last claim that raised: passes pause for ``retry_interval``
        after it, so a store in trouble is not hammered."""
        self._listening = False
        """The store's notifications are live: every insert, by any process, wakes us."""
        self._credit_changed = asyncio.Event()
        """Set by a nudge (which any change of free credit comes with) while not
        listening: the listener looks at the credit again (a wake changes none)."""
        self._credit_seen = 0.0
        """Loop time free credit (or a nudge, while listening) was last seen (see
        :meth:`_listen_once`)."""
        self._polled = 0.0
        """Loop time a poll last counted as a change (see ``_poll``)."""
        self._ahead = ReadAhead()
        self._next_run: tuple[int, _ReadFor, datetime | None] | None = None
        """The last next run time read (the core's change count when the read began, what
        it was read for, the answer), reused while nothing changed (see ``_next_run_at``)."""

    def enqueued(self, added: Sequence[EnqueueResult]) -> None:
        """The main stored the queued jobs ``added`` (its own enqueue, committed): a wake
        that only their modes stop counting as drained for, and that keeps a read-ahead
        they do not stand before (see :meth:`ReadAhead.inserted`)."""
        if not added:
            return
        core = self._handoff
        before = core.queue_changes
        core.jobs_added({result.field("execution_mode") for result in added})
        self._ahead.inserted(before, core.queue_changes, added)
        if core.credit() > 0:
            self._wake.set()

    def wake(self) -> None:
        """Ask for another pass (coalesced: many wakes, one pass). Whatever woke us may
        have made jobs eligible, so the core stops counting any mode as drained.

        With no free slot anywhere the pass is left out: it could place nothing, and
        the slot that frees comes with a nudge, whose pass reads again (the drained
        modes forgotten here). Each enqueue wakes the dispatcher, and while the workers
        were busy every one of them cost the main a pass for nothing."""
        self._handoff.queue_changed()
        if self._handoff.credit() > 0:
            self._wake.set()

    def nudge(self) -> None:
        """Ask for another pass because more jobs may be placed (a slot was freed, a claim
        answered), not because any job changed: modes proven drained stay so."""
        self._wake.set()
        if self._listening:
            # Only noted: the listener looks at it every LISTEN_LINGER seconds, so a busy
            # drain (a nudge per report) costs it no wake-up.
            self._credit_seen = asyncio.get_running_loop().time()
        else:
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
        """Listen while some worker has a free slot, and for ``LISTEN_LINGER`` seconds
        after the last one was seen.

        A notification only helps a main that can hand the job off. Without free credit
        every insert by another process still woke the listening backend, the main and a
        pass that found nothing to do: with no worker connected, that cost producers
        writing straight to the store (``enqueue_in_async``) about a sixth of their rate
        on two cores. Free credit always comes with a nudge (a ``ready``, a report, a
        claim answered), and listening again starts with a wake that forgets every mode
        proven drained, so an insert made while nobody listened is found by the next
        pass.
        """
        assert isinstance(self._store, SupportsNotify)
        while True:
            await self._until(self._has_credit)
            async with self._store.listen(self.wake):
                self._listening = True
                # An insert while the notifications were down went unannounced.
                self.wake()
                try:
                    await self._until(self._credit_gone)
                finally:
                    self._listening = False

    def _has_credit(self) -> bool:
        if self._handoff.credit() > 0:
            self._credit_seen = asyncio.get_running_loop().time()
            return True
        return False

    def _credit_gone(self) -> bool:
        """No free slot now, and neither a free slot nor a nudge for the last
        ``LISTEN_LINGER`` seconds (slots freed and spent again within it keep the
        notifications on: a busy drain never stops listening)."""
        if self._has_credit():
            return False
        return asyncio.get_running_loop().time() - self._credit_seen >= LISTEN_LINGER

    async def _until(self, condition: Callable[[], bool]) -> None:
        """Until ``condition()`` holds, looked at every ``LISTEN_LINGER`` seconds and
        after every nudge while not listening."""
        while not condition():
            self._credit_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LISTEN_LINGER):  # not wait_for: see run()
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
                    # again once no claim is under way).
                    await self._wake.wait()
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

    async def _idle_timeout(self) -> float | None:
        """How long to sleep when there is nothing to dispatch: until the next scheduled
        job, or the poll interval when other processes' inserts cannot wake us."""
        modes = self._handoff.modes_with_credit()
        if not modes:
            return None
        polling = not self._store.capabilities.listen_notify
        try:
            next_at = await self._next_run_at(modes, self._handoff.served_queues())
        except Exception as exc:
            log_event(logger, logging.WARNING, "could not read the next run time", error=repr(exc))
            return self._retry_interval
        delay = None if next_at is None else (next_at - self._clock()).total_seconds()
        ceiling = self._poll_interval if polling else self._notify_fallback_interval
        wake = self._handoff.affinity_wake()
        if wake is not None:  # a held-back job's grace ends then: it may go elsewhere
            ceiling = min(ceiling, max(0.0, wake - asyncio.get_running_loop().time()))
        if delay is None or delay <= 0:
            # Nothing scheduled, or due jobs that could not go out (their concurrency key is
            # full): a report or a readiness message wakes us, so a timer of zero would spin.
            return ceiling
        return min(delay, ceiling)

    async def _next_run_at(
        self, modes: set[ExecutionMode], queues: set[str] | None
    ) -> datetime | None:
        """The store's next run time for ``modes`` and ``queues``, or the last one read for
        them when it still holds: the notifications were live all along, nothing changed
        since the read began (no insert, return, retry, reschedule or timeout: see
        :meth:`Handoff.queue_changed`), and it is still ahead."""
        core = self._handoff
        read_for = (frozenset(modes), None if queues is None else frozenset(queues))
        last = self._next_run
        if (
            last is not None
            and self._listening
            and last[0] == core.queue_changes
            and last[1] == read_for
            and (last[2] is None or last[2] > self._clock())
        ):
            return last[2]
        started = core.queue_changes
        next_at = await self._store.next_run_at(modes=modes, queues=queues)
        self._next_run = (started, read_for, next_at)
        return next_at

    async def dispatch_once(self) -> bool:
        """One dispatch pass: read, plan, and start the claim without waiting for it.

        Returns ``True`` when another pass may find more work right away (the read was
        full and credit is left). A pass is skipped while the claims in flight are at
        their cap (the first to answer wakes the dispatcher) or shortly after a claim
        raised.
        """
        if self._stopping() or len(self._claims) >= self._max_claims_in_flight:
            return False
        if self._failed_at is not None:
            pause = self._failed_at + self._retry_interval - asyncio.get_running_loop().time()
            if pause > 0:
                await asyncio.sleep(pause)
            self._failed_at = None
        core = self._handoff
        self._poll()
        queues = core.served_queues()
        modes = core.modes_with_credit() - core.drained
        if not modes:
            return False
        # Jobs being claimed still look queued to the store: the read leaves them out, or
        # a pass during a claim would find only those. Jobs held back for their state
        # holder are planned again (see broker.core.affinity): read past them.
        held = len(core.awaiting)
        size = core.read_limit(self._claim_batch, modes) + held
        started = core.queue_changes
        jobs, full = await self._eligible(modes, queues, size, started)
        now = asyncio.get_running_loop().time()
        plan = core.plan(jobs, now)
        core.read_eligible(started, modes, full=full or len(plan) < len(jobs), queues=queues)
        left = core.modes_with_credit() - core.drained
        if left and len(plan) < len(jobs) - held:
            # One mode's backlog filled the read while other modes still have free slots:
            # read again for those modes alone, in one read (not one per mode: in a
            # pooled drain the worker's inline and forked slots cost two empty reads per
            # pass). This read covers every mode with credit left, so whether it came
            # back full says whether another pass may find more.
            size = core.read_limit(self._claim_batch, left) + len(core.awaiting)
            found = await self._store.select_eligible(
                modes=left, queues=queues, limit=size, skip=self._claiming()
            )
            full = len(found) == size
            placed = core.plan(found, now)
            core.read_eligible(started, left, full=full or len(placed) < len(found), queues=queues)
            plan += placed
        self._ahead.planned(plan)
        if not plan:
            return False
        self._claims.add(asyncio.create_task(self._claim_and_wake(plan), name="broker-claim"))
        return full and core.credit() > 0

    def _poll(self) -> None:
        """Without live notifications, another process's insert is found only by looking:
        at least every ``poll_interval`` a pass reads the modes proven drained again, even
        while freed slots keep the dispatcher busy (it never goes idle to time out)."""
        if self._listening:
            return
        now = asyncio.get_running_loop().time()
        if now - self._polled >= self._poll_interval:
            self._polled = now
            self._handoff.queue_changed()

    async def _eligible(
        self, modes: set[ExecutionMode], queues: set[str] | None, size: int, started: int
    ) -> tuple[list[Job], bool]:
        """The best ``size`` eligible jobs of ``modes`` (and whether there were that many):
        from the read-ahead while it holds, else from a read of the store, which may ask
        for more than ``size`` (see :class:`ReadAhead`)."""
        now = asyncio.get_running_loop().time()
        served = self._ahead.serve(modes, queues, size, started, now)
        if served is not None:
            return served
        limit = self._ahead.read_size(modes, queues, size, started, self._claim_batch, now)
        jobs = await self._store.select_eligible(
            modes=modes, queues=queues, limit=limit, skip=self._claiming()
        )
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
            self._failed_at = asyncio.get_running_loop().time()
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
        self._carry(self._handoff.claimed(plan, claimed))
        return None


_ReadFor = tuple[frozenset[ExecutionMode], frozenset[str] | None]
"""The modes and queues a next run time was read for (``None``: every queue)."""


_ordered_by = operator.attrgetter(*DISPATCH_KEY_FIELDS)


READ_AHEAD_MAX_AGE = 0.05
"""Seconds a read-ahead serves passes: a job that became due by time alone (a scheduled
job, a retry's back-off ending), which no notification announces, waits at most this long
behind jobs read before it, however busy the dispatcher is."""


class ReadAhead:
    """Eligible jobs read beyond what one pass could place, served to the next passes
    while nothing changed in the queue. Pure: no I/O, times are given.

    Why: in a drain, each pass places the few slots freed since the last (about 20 of a
    pooled worker's), and a read of the store per pass was a third of the main's round
    trips to PostgreSQL and most of its row decoding. Here a read that the next pass
    finds still valid asks for twice as many as the last (up to the claim batch), so a
    steady drain reads a few hundred jobs at a time; a read that grew old before its
    jobs were taken is followed by one of the size it served (see :meth:`read_size`).

    It is only advice, as every read is: the claim decides, under its own fence and its
    own check that each job is still queued and due. What keeps the advice as good as a
    fresh read:

    * it is served only while the core's change count (:attr:`Handoff.queue_changes`) is
      the one its read began at: any insert the store announced, any job requeued, any
      claim that lost its job, any hello, makes the next pass read the store again (and
      the next read asks for no more than the pass needs);
    * for at most :data:`READ_AHEAD_MAX_AGE` seconds;
    * only for the queues it was read for and modes among those it was read for;
    * a read holding a job with a concurrency key is not kept past its first pass: the
      store leaves out keys at their limit when it reads, and claims fill keys;
    * the jobs a pass plans leave it at once (:meth:`planned`), so no later pass plans
      them again.
    """

    def __init__(self) -> None:
        self._jobs: list[Job] = []
        self._modes: frozenset[ExecutionMode] = frozenset()
        self._queues: frozenset[str] | None = None
        self._started = -1
        self._read_at = 0.0
        self._limit = 0
        self._held = 0
        """How many jobs the read brought (the jobs planned since have left ``_jobs``)."""
        self._complete = False
        """The read came back short: it holds every eligible job of its modes."""
        self._cutoff: DispatchKey | None = None
        """Where the last job of the read stands in the dispatch order: no job it left out
        stands before it."""
        self._keep = False

    def _read_for(self, modes: set[ExecutionMode], queues: set[str] | None, started: int) -> bool:
        """Whether the last read covers ``modes`` and ``queues`` with nothing changed since."""
        return (
            self._started == started
            and modes <= self._modes
            and (None if queues is None else frozenset(queues)) == self._queues
        )

    def _aged(self, now: float) -> bool:
        """Whether the read held is older than :data:`READ_AHEAD_MAX_AGE` at ``now``."""
        return now - self._read_at > READ_AHEAD_MAX_AGE

    def serve(
        self,
        modes: set[ExecutionMode],
        queues: set[str] | None,
        size: int,
        started: int,
        now: float,
    ) -> tuple[list[Job], bool] | None:
        """The best ``size`` jobs of ``modes`` held, and whether there were ``size``;
        ``None`` when what is held may not be the store's best ``size`` (stale, read for
        other modes or queues, or too few without being all there is)."""
        if not self._read_for(modes, queues, started) or self._aged(now):
            return None
        jobs = [job for job in self._jobs if job.execution_mode in modes][:size]
        if len(jobs) < size and not self._complete:
            return None
        if not self._keep:
            self._jobs = []
            self._started = -1
        return jobs, len(jobs) == size

    def read_size(
        self,
        modes: set[ExecutionMode],
        queues: set[str] | None,
        size: int,
        started: int,
        batch: int,
        now: float,
    ) -> int:
        """How many jobs to read for a pass that needs ``size``. While nothing changed
        since the last read (a steady drain): twice as many when that read ran out, and
        as many as it served when it grew older than :data:`READ_AHEAD_MAX_AGE` with jobs
        left; else ``size``.

        Why the second: jobs that take milliseconds free slots a few at a time, and the
        doubling went on while each read aged out all but unused; in a drain of 5 ms CPU
        jobs on two pooled children, every read asked for the claim batch (256 rows),
        about 17 rows decoded per job claimed, and the main spent a third of its time
        decoding them."""
        if not (self._keep and self._read_for(modes, queues, started)):
            return size
        if self._jobs and self._aged(now):
            return max(size, min(batch, self._held - len(self._jobs)))
        return max(size, min(batch, 2 * self._limit))

    def fill(
        self,
        jobs: list[Job],
        modes: set[ExecutionMode],
        queues: set[str] | None,
        limit: int,
        started: int,
        now: float,
    ) -> None:
        """A read of at most ``limit`` jobs, begun at change count ``started``, answered."""
        self._jobs = jobs
        self._modes = frozenset(modes)
        self._queues = None if queues is None else frozenset(queues)
        self._started = started
        self._read_at = now
        self._limit = limit
        self._held = len(jobs)
        self._complete = len(jobs) < limit
        last = jobs[-1] if jobs else None
        self._cutoff = None if last is None else dispatch_key(*_ordered_by(last))
        self._keep = all(job.concurrency_key is None for job in jobs)

    def inserted(self, before: int, after: int, added: Sequence[EnqueueResult]) -> None:
        """The change from count ``before`` to ``after`` was the insert of the queued jobs
        ``added`` (:meth:`Handoff.jobs_added`). When the read held was current before it,
        and each of them is of another mode or stands after everything the read held,
        the read still holds the store's best jobs: it stays current (but no longer holds
        every job of its modes).

        Why: producers enqueueing one job at a time while the workers drain made every
        pass read the store again, at the smallest size."""
        if self._started != before or not self._keep or self._cutoff is None:
            return
        cutoff = self._cutoff
        for result in added:
            if result.field("execution_mode") not in self._modes:
                continue
            key = dispatch_key(*(result.field(name) for name in DISPATCH_KEY_FIELDS))
            if key <= cutoff:  # a tie may go either way: the store's insert order decides
                return
        self._started = after
        self._complete = False

    def planned(self, plan: Sequence[PlannedClaim]) -> None:
        """These jobs are being claimed: never serve them again."""
        if plan and self._jobs:
            gone = {planned.job.id for planned in plan}
            self._jobs = [job for job in self._jobs if job.id not in gone]
