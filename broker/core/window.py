"""A worker's adaptive prefetch window: how many jobs beyond its free slots a mode may
hold, grown from the pace its jobs finish at.

:class:`~broker.core.worker_state.WorkerState` advertises ``free slots + window - held``
per mode (its module docstring says why a worker prefetches at all); this module is the
one rule for how large the window is, fed the loop time of each job's end.
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

PREFETCH_MEASURE = 0.1
"""Seconds of completions an adaptive window is resized from (at the first completion
after that long): short enough to follow a drain starting, long enough to count many."""


@dataclass(slots=True)
class AdaptiveWindow:
    """A mode's prefetch window, grown from its completion rate (see
    :data:`PREFETCH_REFILL`): ``size`` starts as given and grows up to ``cap`` while the
    jobs finish fast enough to need it.

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

    def finished(self, now: float) -> bool:
        """A job of the mode ended at ``now`` (loop time); ``True`` if the size changed."""
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
