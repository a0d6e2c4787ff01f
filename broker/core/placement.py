"""Which worker takes a job the handoff plans.

The worker with the most free credit for the job's mode among those serving its queue
and its task (:meth:`Peer.serves <broker.core.peers.Peer.serves>`: a job is never handed
to a worker that did not declare its task), to spread load; ties go round in turns, so
equal workers share the jobs evenly instead of the first connected taking all. A job
whose local state a worker holds goes where :class:`broker.core.affinity.Affinity` lets
it: to that worker while it may take it, anywhere once the affinity lets any worker,
nowhere meanwhile (the job is *awaiting*).
Whether the chosen worker has a free slot is the caller's check: it reserves the credit
(:meth:`broker.core.handoff.Handoff.plan`).

A plan ranks its workers once (:meth:`Placement.start`), per mode and queue, by free
credit, and keeps the ranking as it reserves slots (:meth:`Placement.reserved`): each
job's pick looks the most free up instead of asking every worker for its credit, which
at 64 workers was most of the main's cost per job (issue 35). The pick is the same.
A plan over a few workers (:data:`FEW`) asks each of them instead, which costs less than
keeping the ranking.
"""

from __future__ import annotations

import uuid
from bisect import bisect_left, insort
from collections.abc import Collection, Sequence

from broker.core.affinity import DEFAULT_MAX_WAIT, Affinity, Route
from broker.core.peers import Peer
from broker.jobs import ExecutionMode, Job

FEW = 4
"""Up to this many workers, a plan asks each for its credit for every job (cheaper than
a ranking); past it, it ranks them (:class:`_Ranking`)."""


class Placement:
    """The worker rotation, the affinity and the jobs awaiting their state holder."""

    def __init__(self, affinity_grace: float, affinity_max_wait: float = DEFAULT_MAX_WAIT) -> None:
        self.affinity = Affinity(affinity_grace, started=0.0, max_wait=affinity_max_wait)
        """Where the holders of local state are; decides who may take their recoveries."""
        self.awaiting: dict[uuid.UUID, str] = {}
        """Jobs the last plans held back for their state holder (job id -> holder): the
        dispatcher reads past them, and wakes when one of their graces ends."""
        self.paused_queues: Collection[str] = frozenset()
        """The queues paused now, which the shell that pauses queues keeps here: a
        recovery of a paused queue keeps waiting for its holder at its deadline (an
        extension), as with its holder connected (:meth:`Affinity.route`)."""
        self._turn = 0
        """Where the search for a worker starts, moved on for every job picked for."""
        self._workers: Sequence[Peer] = ()
        """The dispatchable workers of the plan under way, in rotation order."""
        self._leading = False
        """Whether the plan under way places jobs that overtake no waiting job: they may
        take a worker's spare credit (:class:`broker.core.peers.Credits`)."""
        self._restricted: bool | None = None
        """Whether one of them serves only some queues (else one ranking per mode); made
        at the plan's first ranking."""
        self._task_key: dict[str, str | None] = {}
        """Task name -> itself when some worker of the plan did not declare it (its jobs
        are ranked among the workers that did), ``None`` when every worker runs it (they
        share the ranking of their queue): a fleet whose workers all serve the same tasks
        keeps one ranking per mode and queue."""
        self._rankings: dict[ExecutionMode, dict[tuple[str | None, str | None], _Ranking]] = {}
        """The plan's rankings, by mode and (queue, task) (made as its jobs need them)."""
        self._by_worker_id: dict[str | None, list[Peer]] | None = None
        """The plan's workers by worker id, in rotation order (made at its first job
        with a state holder)."""

    def start(self, workers: Sequence[Peer], *, leading: bool = False) -> None:
        """A plan begins over the dispatchable ``workers``, in rotation order; their
        credits change only by :meth:`reserved` until the next start. ``leading``: its
        jobs overtake no waiting job, and the workers are ranked by their credit with
        the spare."""
        self._workers = workers
        self._leading = leading
        self._restricted = None
        self._task_key = {}
        self._rankings = {}
        self._by_worker_id = None

    def reserved(self, peer: Peer, mode: ExecutionMode) -> None:
        """A credit of ``mode`` was reserved on ``peer`` for the job just picked."""
        if not self._rankings:
            return
        for ranking in self._rankings.get(mode, {}).values():
            ranking.update(peer)

    def pick(self, job: Job, now: float) -> tuple[Peer | None, Route | None]:
        """The worker among the plan's workers (:meth:`start`) for ``job`` at ``now``, and
        how its state goes with it (``None`` for a job without a state holder); no worker
        while the job awaits its holder, noted in :attr:`awaiting`. A holder without a
        free slot keeps its job only while the affinity's wait lasts (its cap,
        :mod:`broker.core.affinity`)."""
        self._turn += 1
        holder = job.state_holder
        if holder is None:
            return self._most_free(job), None
        route = self.affinity.route(job, holder, now)
        if self._by_worker_id is None:
            self._by_worker_id = {}
            for peer in self._workers:
                self._by_worker_id.setdefault(peer.worker_id, []).append(peer)
        own = [peer for peer in self._by_worker_id.get(holder, ()) if peer.serves(job)]
        paused = job.queue in self.paused_queues
        elsewhere = self.affinity.route(job, "", now, queue_paused=paused)
        if own and route is not None and not route.state_lost:
            best = _most_free(own, job, self._turn, self._leading)
            if elsewhere is None or (
                best is not None
                and best.credits.available(job.execution_mode, leading=self._leading) > 0
            ):
                self.awaiting[job.id] = holder  # until a slot there is reserved for it
                return best, route
        if elsewhere is None:
            self.awaiting[job.id] = holder
            return None, None
        self.awaiting.pop(job.id, None)
        chosen = self._most_free(job)
        if chosen is not None and chosen.worker_id == holder and route is not None:
            return chosen, route  # the holder itself, after all: its state is there
        return chosen, elsewhere

    def placed(self, job: Job) -> None:
        """A slot was reserved for ``job``: it awaits nothing any more."""
        self.awaiting.pop(job.id, None)
        if job.state_holder is not None:
            self.affinity.placed(job.id)

    def _most_free(self, job: Job) -> Peer | None:
        """:func:`_most_free` over every worker of the plan, from its ranking."""
        if len(self._workers) <= FEW:
            return _most_free(self._workers, job, self._turn, self._leading)
        if self._restricted is None:
            self._restricted = any(peer.queues is not None for peer in self._workers)
        mode = job.execution_mode
        if job.task in self._task_key:
            task = self._task_key[job.task]
        else:
            task = self._task_key[job.task] = (
                None if all(peer.serves_task(job.task) for peer in self._workers) else job.task
            )
        key = (job.queue if self._restricted else None, task)
        rankings = self._rankings.setdefault(mode, {})
        ranking = rankings.get(key)
        if ranking is None:
            ranking = rankings[key] = _Ranking(self._workers, mode, *key, self._leading)
        return ranking.best(self._turn)

    def wake_at(self, modes: Collection[ExecutionMode]) -> float | None:
        """The earliest time an awaiting job's wait must be looked at again (loop time):
        a grace that ends, a deadline to extend or the maximum wait, for jobs of the
        ``modes`` some worker has a free slot of (:meth:`Affinity.wake_at`); ``None`` when
        none will end by itself."""
        times = [
            self.affinity.wake_at(job_id, holder, modes) for job_id, holder in self.awaiting.items()
        ]
        finite = [t for t in times if t != float("inf")]
        return min(finite) if finite else None


def _most_free(workers: Sequence[Peer], job: Job, turn: int, leading: bool) -> Peer | None:
    """The serving worker with the most free credit for the job's mode (whether it has
    any is the caller's credit check; ``leading``: counting the spare). Ties go to the
    first in the rotation that starts at ``turn``."""
    best: Peer | None = None
    best_free = -1
    count = len(workers)
    for i in range(count):
        peer = workers[(turn + i) % count]
        free = peer.credits.available(job.execution_mode, leading=leading)
        if free > best_free and peer.serves(job):
            best, best_free = peer, free
    return best


class _Ranking:
    """The workers of a plan that serve ``queue`` and ``task`` (``None``: whichever), by
    their free credit for ``mode`` (``leading``: counting the spare): for each free
    count, their places in the rotation, sorted."""

    def __init__(
        self,
        workers: Sequence[Peer],
        mode: ExecutionMode,
        queue: str | None,
        task: str | None,
        leading: bool,
    ) -> None:
        self._workers = workers
        self._mode = mode
        self._leading = leading
        self._place: dict[int, int] = {}
        """Peer id -> its place in the rotation."""
        self._free: dict[int, int] = {}
        """Peer id -> its free credit for the mode, as ranked."""
        self._by_free: dict[int, list[int]] = {}
        for place, peer in enumerate(workers):
            if (queue is None or peer.serves_queue(queue)) and (
                task is None or peer.serves_task(task)
            ):
                free = peer.credits.available(mode, leading=leading)
                self._place[peer.id] = place
                self._free[peer.id] = free
                self._by_free.setdefault(free, []).append(place)
        self._top = max(self._by_free, default=-1)

    def best(self, turn: int) -> Peer | None:
        """What :func:`_most_free` picks at ``turn``: of the most free, the first in the
        rotation that starts at ``turn``."""
        if not self._by_free:
            return None
        places = self._by_free[self._top]
        i = bisect_left(places, turn % len(self._workers))
        return self._workers[places[i] if i < len(places) else places[0]]

    def update(self, peer: Peer) -> None:
        """``peer``'s credit changed: it moves to its new rank (if it is ranked here)."""
        place = self._place.get(peer.id)
        if place is None:
            return
        old, new = self._free[peer.id], peer.credits.available(self._mode, leading=self._leading)
        if old == new:
            return
        places = self._by_free[old]
        if len(places) == 1:
            del self._by_free[old]
        else:
            del places[bisect_left(places, place)]
        others = self._by_free.get(new)
        if others is None:
            self._by_free[new] = [place]
        else:
            insort(others, place)
        self._free[peer.id] = new
        if new > self._top:
            self._top = new
        elif old == self._top and old not in self._by_free:
            self._top = max(self._by_free)
