"""Dispatch pacing: when the dispatcher reads the store again.

Rule: every "when does the dispatcher read again" decision lives in this module. The
dispatcher (:mod:`broker.main.dispatcher`) only awaits: it reads, has the handoff core
plan, claims, and between those asks :class:`Pacing` (whether to listen, whether a wake
is worth a pass, whether a pass must pause or poll, whether a second read is worth it,
whether the next run time it read still holds, how long to sleep) and :class:`ReadAhead`
(whether a pass may take its jobs from an earlier read, and how many to read). Nothing
here waits or touches the store: times are given, through the two injected clocks (the
event loop's, in seconds, and the wall clock the jobs' run times are on).

Why in one place: each rule trades the store's load against how soon a job goes out, and
they lean on each other (the read-ahead is served only while nothing changed; a poll is a
change; listening makes the cached next run time safe), so they are read and tested
together, without an event loop or a store.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import NamedTuple

from broker.core.handoff import PlannedClaim
from broker.jobs import (
    DISPATCH_KEY_FIELDS,
    Clock,
    DispatchKey,
    EnqueueResult,
    ExecutionMode,
    Job,
    dispatch_key,
)

LISTEN_LINGER = 2.0
"""Seconds without free credit before the dispatcher stops listening to the store."""

READ_AHEAD_MAX_AGE = 0.05
"""Seconds a read-ahead serves passes: a job that became due by time alone (a scheduled
job, a retry's back-off ending), which no notification announces, waits at most this long
behind jobs read before it, however busy the dispatcher is."""

MERGED_MAX = 2
"""A read-ahead holds at most this many times the jobs its read asked for, counting the
jobs the main enqueued before it that took their place in it (:meth:`ReadAhead.inserted`):
while no worker has a free slot no pass takes from it, and a stream of urgent jobs would
otherwise grow it without end."""


class NextRun(NamedTuple):
    """A next run time read from the store, and what it was read under."""

    changes: int
    """The core's change count (:attr:`Handoff.queue_changes`) when the read began."""
    modes: frozenset[ExecutionMode]
    queues: frozenset[str] | None
    """The queues it was read for (``None``: every queue)."""
    at: datetime | None


class Pacing:
    """The dispatcher's timing rules and the little state they need.

    ``now`` is the event loop's clock (seconds; the handoff core's times are on it too),
    ``clock`` the wall clock of the jobs' run times.
    """

    def __init__(
        self,
        *,
        now: Callable[[], float],
        clock: Clock,
        poll_interval: float,
        notify_fallback_interval: float,
        retry_interval: float,
    ) -> None:
        self._now = now
        self._clock = clock
        self._poll_interval = poll_interval
        self._notify_fallback_interval = notify_fallback_interval
        self._retry_interval = retry_interval
        self.listening = False
        """The store's notifications are live: every insert, by any process, wakes the
        dispatcher. Set by the listener (:meth:`listened`, :meth:`stopped_listening`)."""
        self._credit_seen = 0.0
        """When free credit (or a nudge, while listening) was last seen."""
        self._polled = 0.0
        """When a poll last counted as a queue change (see :meth:`poll_due`)."""
        self._failed_at: float | None = None
        """When the last claim that raised answered (see :meth:`pause`)."""
        self._next_run: NextRun | None = None

    # -- listening ------------------------------------------------------------------

    def listen(self, credit: int) -> bool:
        """Whether to listen to the store, with ``credit`` free slots now: only while some
        worker has one. A notification only helps a main that can hand the job off;
        without free credit every insert by another process still woke the listening
        backend, the main and a pass that found nothing to do (with no worker connected,
        that cost producers writing straight to the store about a sixth of their rate on
        two cores)."""
        if credit > 0:
            self._credit_seen = self._now()
            return True
        return False

    def stop_listening(self, credit: int) -> bool:
        """Whether to stop listening: no free slot now, and neither a free slot nor a
        nudge for the last :data:`LISTEN_LINGER` seconds (slots freed and spent again
        within it keep the notifications on: a busy drain never stops listening)."""
        if self.listen(credit):
            return False
        return self._now() - self._credit_seen >= LISTEN_LINGER

    def listened(self) -> None:
        """The notifications are live (the dispatcher then wakes itself: an insert made
        while nobody listened went unannounced)."""
        self.listening = True

    def stopped_listening(self) -> None:
        self.listening = False

    def nudged(self) -> bool:
        """A nudge (which any change of free credit comes with): whether the listener
        must look at the credit now. While listening it is only noted, and looked at every
        :data:`LISTEN_LINGER` seconds, so a busy drain (a nudge per report) costs the
        listener no wake-up."""
        if self.listening:
            self._credit_seen = self._now()
            return False
        return True

    # -- passes ---------------------------------------------------------------------

    @staticmethod
    def worth_a_pass(credit: int) -> bool:
        """Whether a wake (an insert, a return: anything that may make a job eligible)
        asks for a pass, with ``credit`` free slots: not with none. That pass could place
        nothing, and the slot that frees comes with a nudge, whose pass reads again (the
        modes proven drained forgotten by the wake). Each enqueue wakes the dispatcher,
        and while the workers were busy every one of them cost the main a pass for
        nothing."""
        return credit > 0

    def claim_failed(self) -> None:
        """A claim raised: passes pause (:meth:`pause`), so a store in trouble is not
        hammered."""
        self._failed_at = self._now()

    def pause(self) -> float:
        """Seconds the pass about to read waits first: what is left of
        ``retry_interval`` since the last claim that raised (0 when none did, or it has
        passed). Each failure pauses one pass: asked again, this answers 0 until another
        claim raises."""
        failed_at, self._failed_at = self._failed_at, None
        if failed_at is None:
            return 0.0
        return max(0.0, failed_at + self._retry_interval - self._now())

    def poll_due(self) -> bool:
        """Whether this pass counts as a queue change (every mode proven drained is read
        again). Without live notifications another process's insert is found only by
        looking: at least every ``poll_interval``, even while freed slots keep the
        dispatcher busy (it never goes idle to time out)."""
        if self.listening:
            return False
        now = self._now()
        if now - self._polled >= self._poll_interval:
            self._polled = now
            return True
        return False

    @staticmethod
    def express(overtaking: int, claims: int, cap: int) -> int:
        """How many jobs a pass reads for an express claim (0: none), with ``overtaking``
        jobs enqueued that stand before the backlog being drained (issue 35) and
        ``claims`` under way of at most ``cap``.

        Why: such a job (an urgent one) would otherwise wait for a claim in flight to
        answer, then go out in the next pass's claim with as many of the backlog's jobs
        as there are free slots (up to the claim batch): a larger claim to commit and
        send. An express pass takes just that many of the best jobs (the urgent ones
        first, being the best), from the read-ahead when their insert kept it current
        (:meth:`ReadAhead.inserted`), else from a read of the store, and claims them
        apart, one claim beyond the cap. (An urgent job that finds a free slot at its
        enqueue needs no pass at all: :meth:`ReadAhead.leads`.)

        Its jobs, the best waiting, overtake no waiting job: they may take a worker's
        spare credit (:class:`broker.core.peers.Credits`), as a job handed off at its
        enqueue may. Without, an urgent job whose enqueue found the read-ahead stale
        waited for a ``ready`` during a drain, since the backlog's passes spend every
        other credit as soon as it frees."""
        if overtaking <= 0 or claims > cap:
            return 0
        return overtaking

    @staticmethod
    def read_again(left: set[ExecutionMode], read: int, planned: int, held: int) -> bool:
        """Whether a pass reads a second time, for the modes ``left`` with credit (and not
        proven drained), after a first read of ``read`` jobs (``held`` of them held back
        for their state holder) of which it planned ``planned``: when one mode's backlog
        filled the read while other modes still have free slots. One read for all of
        them, not one per mode: in a pooled drain the worker's inline and forked slots
        cost two empty reads per pass."""
        return bool(left) and planned < read - held

    # -- idle -----------------------------------------------------------------------

    def known_next_run(
        self, modes: set[ExecutionMode], queues: set[str] | None, changes: int
    ) -> NextRun | None:
        """The last next run time read, when it may be used for ``modes`` and ``queues``
        instead of reading again: the notifications were live all along, nothing changed
        since the read began (no insert, return, retry, reschedule or timeout: see
        :meth:`Handoff.queue_changed`), it was read for these modes and queues, and it is
        still ahead. Each read scanned every queued row on PostgreSQL."""
        last = self._next_run
        if (
            last is not None
            and self.listening
            and last.changes == changes
            and last.modes == modes
            and last.queues == (None if queues is None else frozenset(queues))
            and (last.at is None or last.at > self._clock())
        ):
            return last
        return None

    def next_run_read(
        self,
        modes: set[ExecutionMode],
        queues: set[str] | None,
        started: int,
        at: datetime | None,
    ) -> None:
        """The store answered ``at`` for ``modes`` and ``queues``, to a read begun at
        change count ``started``."""
        self._next_run = NextRun(
            started, frozenset(modes), None if queues is None else frozenset(queues), at
        )

    def after_failed_read(self) -> float:
        """How long an idle dispatcher sleeps when it could not read the next run time:
        ``retry_interval``, as after any store error (a wake still cuts it short)."""
        return self._retry_interval

    def idle_timeout(
        self, next_at: datetime | None, *, polling: bool, affinity_wake: float | None
    ) -> float:
        """How long an idle dispatcher sleeps unless woken: until the next scheduled job
        (``next_at``), but no longer than ``poll_interval`` when other processes' inserts
        cannot wake it (``polling``), or than ``notify_fallback_interval`` when they can;
        nor past ``affinity_wake``, when a held-back job's grace ends and it may go
        elsewhere.

        Nothing scheduled, or jobs already due that could not go out (their concurrency
        key is full), sleep the ceiling: a report or a ``ready`` wakes the dispatcher, so
        a timer of zero would spin."""
        ceiling = self._poll_interval if polling else self._notify_fallback_interval
        if affinity_wake is not None:
            ceiling = min(ceiling, max(0.0, affinity_wake - self._now()))
        if next_at is None:
            return ceiling
        delay = (next_at - self._clock()).total_seconds()
        if delay <= 0:
            return ceiling
        return min(delay, ceiling)


_ordered_by = operator.attrgetter(*DISPATCH_KEY_FIELDS)


def _dispatch_order(job: Job) -> DispatchKey:
    """Where ``job`` stands in the dispatch order."""
    return dispatch_key(*_ordered_by(job))


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
        held = self._jobs
        # Every job held is of a mode read for: when the pass wants all those modes (a
        # drain's every pass), the best are the first held, without a look at the rest.
        jobs = (
            held[:size]
            if self._modes <= modes
            else [j for j in held if j.execution_mode in modes][:size]
        )
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
        self._cutoff = None if last is None else _dispatch_order(last)
        self._keep = all(job.concurrency_key is None for job in jobs)

    def inserted(self, before: int, after: int, added: Sequence[EnqueueResult]) -> int:
        """The change from count ``before`` to ``after`` was the insert of the queued jobs
        ``added`` (:meth:`Handoff.jobs_added`). When the read held was current before it,
        it stays current: each of them is of another mode, or stands after everything the
        read held (then the read no longer holds every job of its modes), or stands
        before where the read ended and takes its place among the jobs held, in the
        dispatch order, so the read still holds the store's best jobs. Not when one of
        them ties with where the read ended (the store's insert order decides the tie,
        and jobs of that key the read left out may come first) or has a concurrency key
        (a read holding one serves a single pass), nor past :data:`MERGED_MAX` times
        the read's size: the next pass reads the store.

        Why: producers enqueueing one job at a time while the workers drain made every
        pass read the store again, at the smallest size. And an urgent job, enqueued
        before what the read held, made it out of date until the next pass read again,
        so the next urgent job could not be handed off at its enqueue
        (:meth:`leads`): at one every 25 ms during a drain, four in five waited for a
        pass and a claim of their own.

        Returns how many of ``added`` stand before what the read held, or tie with where
        it ended (0 when it was out of date already): jobs that overtake the backlog the
        dispatcher is working through, for an express pass (:meth:`Pacing.express`)."""
        if self._started != before or not self._keep or self._cutoff is None:
            return 0
        cutoff = self._cutoff
        overtaking = 0
        kept = True
        behind = False
        merged: list[Job] = []
        for result in added:
            if result.field("execution_mode") not in self._modes:
                continue
            key = dispatch_key(*(result.field(name) for name in DISPATCH_KEY_FIELDS))
            if key > cutoff:
                behind = True
                continue
            overtaking += 1
            if key == cutoff or result.field("concurrency_key") is not None:
                kept = False
            else:
                merged.append(result.job)
        if len(self._jobs) + len(merged) > MERGED_MAX * self._limit:
            kept = False  # a burst while no pass takes from it: bounded, not grown for ever
        if kept:
            self._started = after
            if merged:
                held = list(self._jobs)  # the read's list is the caller's: not in place
                for job in merged:
                    bisect.insort(held, job, key=_dispatch_order)
                self._jobs = held
                self._held += len(merged)
            if behind:
                self._complete = False
        return overtaking

    def leads(
        self, mode: ExecutionMode, queue: str, key: DispatchKey, started: int, now: float
    ) -> bool:
        """Whether a job of ``mode`` in ``queue`` that stands at ``key`` in the dispatch
        order, enqueued now, stands before every job of its mode still waiting in the
        store, as the read held tells (at change count ``started`` and loop time
        ``now``): the read is current and kept (the same terms as :meth:`serve`), it was
        read for that mode and queue, and the job stands before the first job of its mode
        the read still holds (the store's best one not yet planned); when it holds none,
        before where the read ended, or before anything when the read held every
        eligible job. A tie is not a lead: the store's insert order decides it.

        Why: in a drain no mode is ever proven drained, so the enqueue could hand no job
        off at once (:meth:`Handoff.plan_at_enqueue
        <broker.core.handoff.Handoff.plan_at_enqueue>`), and an urgent job waited for a
        pass to read it and a claim of its own: two more round trips to the store, each
        behind the drain's work on the main's loop (issue 35: half of its wait). Handed
        off in its own insert, it overtakes only jobs that stand after it."""
        if not self._keep or self._started != started or self._aged(now):
            return False
        if mode not in self._modes or (self._queues is not None and queue not in self._queues):
            return False
        for job in self._jobs:
            if job.execution_mode is mode:
                return key < _dispatch_order(job)
        if self._complete:
            return True
        return self._cutoff is not None and key < self._cutoff

    def planned(self, plan: Sequence[PlannedClaim]) -> None:
        """These jobs are being claimed: never serve them again."""
        if plan and self._jobs:
            gone = {planned.job.id for planned in plan}
            self._jobs = [job for job in self._jobs if job.id not in gone]
