"""A worker's adaptive prefetch window: how many jobs beyond its free slots a mode may
hold, grown from the pace its jobs finish at and from how long they run; and when a
run's end is worth a ``ready`` of its own.

:class:`~broker.core.worker_state.WorkerState` advertises ``free slots + window - held``
per mode (its module docstring says why a worker prefetches at all); this module is the
one rule for how large the window is, fed the loop time of each job's end and its run's
length, and for when a run's end is worth a ``ready`` (:func:`ready_worth`).

**Lines per job.** Everything a main does per line (read, decode, route; encode, queue,
write) and per dispatch pass looking at a worker, a one-slot worker made it do per job:
each job's end sent a report and a ``ready`` freeing one credit, which came back as a
``jobs`` line of one job. 64 such workers cost the main 2.7 times the CPU per job of one
worker of 64 slots (issue 35). So a window whose jobs run short holds at least
:data:`LINE_WINDOW` jobs, or :data:`WIDE_LINE_WINDOW` for the shortest
(:func:`line_window`), however few the slots, and in a window that small the credit
run ends free waits until half the window has run, a line of several jobs, while the
window still holds a job to run meanwhile: the half left covers the refill, as the
window's size is twice what a refill needs; an empty window's ``ready`` waits too while
the main knows of credit enough to send the next jobs. The reports of short runs wait
for the line's last run, or the ``ready``, at most :data:`REPORT_HOLD`
(:func:`report_waits`): the main then reads one ``reports`` line per line of jobs it
sent, and a ``ready`` per half window, instead of a report line per job and two
``ready`` per line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PREFETCH_REFILL = 0.02
"""Seconds of this worker's completions an adaptive prefetch window grows to hold. A
slot's next job should be here when its job ends, and getting one from the main (a
``ready``, a claim committed on the store, the job's trip back) took 5 to 15 ms in a
pooled drain on PostgreSQL: by Little's law the jobs that covers are the completion rate
times that time, doubled for the spread. Jobs of 10 ms or more never grow the window
past its default start (two per slot), so long jobs are not held here while another
worker idles."""

SHORT_RUN = 0.005
"""Seconds under which a run counts as short: its window grows to :data:`LINE_WINDOW`
(:data:`WIDE_LINE_WINDOW` under half of it). Such jobs held here cost another worker at
most ``LINE_WINDOW * SHORT_RUN`` (80 ms), what eight jobs of 10 ms cost when the line
window was eight."""

LINE_WINDOW = 16
"""The window, in jobs per mode (not per slot), of a mode whose runs are short. With the
``ready`` waiting until half of it has run (:func:`ready_worth`), a one-slot worker takes
up to eight jobs per ``jobs`` line and sends a ``ready`` per eight reports, instead of
one of each per job. Sixteen against eight, 64 one-slot workers draining 20,000 no-op
jobs (branch ``fleet2``, alternating, load 18-35): the main's CPU per job 54 / 61, 60 /
69.5, 66 / 68, 60 / 67.5 µs, the workers' 11% lower. A wider worker's window is larger
anyway."""

WIDE_LINE_WINDOW = 32
"""The window of a mode whose runs are under half :data:`SHORT_RUN` (2.5 ms): the same
80 ms of short work held at most, in lines of sixteen jobs or more; a default window's cap
is at least this (:func:`line_cap`). 32 against 16 showed no difference in ``fleet2``,
while a dispatch pass of 256 jobs spread over 64 workers handed each four whatever its
credit; once a pass takes a line per worker (:func:`broker.core.handoff.pass_size`),
64 one-slot workers of no-op jobs, 20,000 jobs, alternating (branch ``fleet3``, load
7-23): the main's CPU per job 51 / 55, 56 / 57.5, 50.5 / 56.5, 51 / 58 µs, the
workers' 30% lower; 64 against 32, 51 / 53.5 and 49 / 49.5 µs, so 32."""


def line_window(ran: float) -> int:
    """The window a run of ``ran`` seconds grows its mode's to at once (within its cap):
    :data:`WIDE_LINE_WINDOW` under half :data:`SHORT_RUN`, :data:`LINE_WINDOW` under
    :data:`SHORT_RUN`, none (0: the pace rule alone) otherwise."""
    if ran < SHORT_RUN / 2:
        return WIDE_LINE_WINDOW
    return LINE_WINDOW if ran < SHORT_RUN else 0


def line_cap(cap: int) -> int:
    """A default window's cap (``cap``: its slots' share) raised to
    :data:`WIDE_LINE_WINDOW`, so that a worker of few slots takes its short jobs in lines
    too."""
    return max(cap, WIDE_LINE_WINDOW)


REPORT_HOLD = 0.005
"""Seconds the report of a short run may wait for the next ``ready`` to go out with it
(:func:`report_waits`), so that the jobs of a small window settle in one ``reports``
line per half window. A bound on the completion's delay, not the usual wait: the half
window of short runs that makes the ``ready`` due takes well under it, so it matters
only when a job after them runs long (its start cannot tell)."""

PREFETCH_MEASURE = 0.1
"""Seconds of completions an adaptive window is resized from (at the first completion
after that long): short enough to follow a drain starting, long enough to count many."""


@dataclass(slots=True)
class AdaptiveWindow:
    """A mode's prefetch window, grown from its completion rate (see
    :data:`PREFETCH_REFILL`): ``size`` starts as given and grows up to ``cap`` while the
    jobs finish fast enough to need it, and at once to :func:`line_window` (within
    ``cap``) at a run shorter than :data:`SHORT_RUN`.

    It never shrinks: the main may already have sent jobs against the credit a larger
    window advertised, and a worker refuses (releases) a job beyond its credit, so a
    shrinking window would send jobs back and forth. Nor can it stall: with a window of
    ``w`` over ``s`` slots a drain of short jobs completes about ``s + w`` jobs per
    refill, which asks for a window about twice that, until the cap.
    """

    size: int
    cap: int
    _done: int = 0
    _since: float | None = None

    def finished(self, now: float, ran: float | None = None) -> bool:
        """A job of the mode ended at ``now`` (loop time) after a run of ``ran`` seconds
        (``None``: not known); ``True`` if the size changed."""
        line = 0 if ran is None else min(self.cap, line_window(ran))
        if self.size < line:
            self.size = line
            self._measured(now)
            return True
        return self._measured(now)

    def _measured(self, now: float) -> bool:
        """The pace rule (:data:`PREFETCH_REFILL`), fed one end of a job at ``now``."""
        if self._since is None:
            self._since = now
            return False
        self._done += 1
        elapsed = now - self._since
        if elapsed < PREFETCH_MEASURE:
            return False
        wanted = math.ceil(self._done / elapsed * PREFETCH_REFILL)
        self._done, self._since = 0, now
        if wanted <= self.size or self.size >= self.cap:
            return False
        self.size = min(self.cap, wanted)
        return True


def ready_worth(window: int, held: int, freed: int, unspent: int) -> bool:
    """Whether a run's end is worth a ``ready`` now, for a mode whose ``window`` holds
    ``held`` jobs, whose runs ended ``freed`` times since its last ``ready``, and of whose
    credit the main knows ``unspent`` (the last ``ready``'s, less the jobs received since):
    once half the window has run (the half left covers the refill: :data:`PREFETCH_REFILL`
    sizes windows at twice what one needs), or at once when the window holds no job and
    the main knows of one credit at most (the slot would idle after its run: the main
    keeps the last credit of a prefetching mode for an urgent job, see
    :class:`~broker.core.peers.Credits`). With two or more known, the main hands this
    worker its next jobs without one: a ``ready`` each time the window emptied sent two
    per line of jobs, one as its last job started and one as it ended. Every run's end
    for a window larger than :data:`WIDE_LINE_WINDOW` (a wide worker's: its slots free
    several credits per ``ready`` anyway, and a pooled drain ran slower when its ``ready``
    waited for eight) or of one job. See the module docstring."""
    return window > WIDE_LINE_WINDOW or freed >= window // 2 or (held == 0 and unspent <= 1)


def report_waits(ready_due: bool, ran: float | None, more: bool) -> bool:
    """Whether the report of a run that ended after ``ran`` seconds (``None``: not known)
    waits for the next ``ready``, which no run's end has made due yet
    (:func:`ready_worth`), instead of going out at once on a line of its own: only a
    short run's (:data:`SHORT_RUN`) while its mode has ``more`` runs to end (a job held
    or running), and for :data:`REPORT_HOLD` at most. A long run's report goes at once,
    and takes any waiting with it: a run as long as the bound already costs more than a
    line; so does the last run's, with no end coming to send it."""
    return not ready_due and more and ran is not None and ran < SHORT_RUN
