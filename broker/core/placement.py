"""Which worker takes a job the handoff plans.

The worker with the most free credit for the job's mode among those serving its queue,
to spread load; ties go round in turns, so equal workers share the jobs evenly instead of
the first connected taking all. A job whose local state a worker holds goes where
:class:`broker.core.affinity.Affinity` lets it: to that worker while it may take it,
anywhere once the affinity lets any worker, nowhere meanwhile (the job is *awaiting*).
Whether the chosen worker has a free slot is the caller's check: it reserves the credit
(:meth:`broker.core.handoff.Handoff.plan`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from broker.core.affinity import Affinity, Route
from broker.core.peers import Peer
from broker.jobs import Job


class Placement:
    """The worker rotation, the affinity and the jobs awaiting their state holder."""

    def __init__(self, affinity_grace: float) -> None:
        self.affinity = Affinity(affinity_grace, started=0.0)
        """Where the holders of local state are; decides who may take their recoveries."""
        self.awaiting: dict[uuid.UUID, str] = {}
        """Jobs the last plans held back for their state holder (job id -> holder): the
        dispatcher reads past them, and wakes when one of their graces ends."""
        self._turn = 0
        """Where the search for a worker starts, moved on for every job picked for."""

    def pick(
        self, workers: Sequence[Peer], job: Job, now: float
    ) -> tuple[Peer | None, Route | None]:
        """The worker among the dispatchable ``workers`` for ``job`` at ``now``, and how
        its state goes with it (``None`` for a job without a state holder); no worker
        while the job awaits its holder, noted in :attr:`awaiting`."""
        self._turn += 1
        holder = job.state_holder
        if holder is None:
            return _most_free(workers, job, self._turn), None
        route = self.affinity.route(job, holder, now)
        own = [peer for peer in workers if peer.worker_id == holder and peer.serves(job)]
        if own and route is not None and not route.state_lost:
            self.awaiting[job.id] = holder  # until a slot there is reserved for it
            return _most_free(own, job, self._turn), route
        elsewhere = self.affinity.route(job, "", now)
        if elsewhere is None:
            self.awaiting[job.id] = holder
            return None, None
        self.awaiting.pop(job.id, None)
        return _most_free(workers, job, self._turn), elsewhere

    def wake_at(self) -> float | None:
        """The earliest end of a grace that an awaiting job waits on (loop time), or
        ``None`` when none will end by itself (every holder awaited is connected)."""
        deadlines = [self.affinity.deadline(holder) for holder in set(self.awaiting.values())]
        finite = [d for d in deadlines if d != float("inf")]
        return min(finite) if finite else None


def _most_free(workers: Sequence[Peer], job: Job, turn: int) -> Peer | None:
    """The serving worker with the most free credit for the job's mode (whether it has
    any is the caller's credit check). Ties go to the first in the rotation that starts
    at ``turn``."""
    best: Peer | None = None
    best_free = -1
    count = len(workers)
    for i in range(count):
        peer = workers[(turn + i) % count]
        free = peer.credits.available(job.execution_mode)
        if free > best_free and peer.serves(job):
            best, best_free = peer, free
    return best
