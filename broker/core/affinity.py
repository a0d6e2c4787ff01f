"""Affinity: which worker may run the recovery of a job that keeps local state.

A task declared with ``local_state=True`` keeps state on its worker's machine (files, a
warm cache) that its next attempt wants. When such an attempt is lost, the store names
the worker that ran it as the job's ``state_holder`` (see :func:`broker.retry.lost_attempt`),
and the recovery is offered to that worker id first:

* while the holder is connected (any session, even draining or busy), only it may take
  the job, within a cap (below);
* once it has left, the job waits ``grace`` seconds more for it to come back (a main that
  never saw the holder counts from its own start);
* if the holder says its local state is gone (it came back without its state directory,
  or its task said so), or the grace has passed, any worker may take the job, and is told
  the state is gone.

**The cap** (the pi-dispatch rule): a wait has a deadline, ``grace`` seconds after this
main first held the job back. At the deadline the wait is *extended* by ``grace`` only
while the holder is connected or the job's queue is paused (``queue_paused``, an input:
the shell says which queues are paused; nothing pauses a queue on its own), each
extension logged with its reason, and never past ``max_wait`` after the wait began:
then any worker may take the job, told the state is gone, whatever the holder says. A
deadline is not a verdict (a connected holder may just be busy), but a holder that never
frees a slot must not keep its recovery forever. The wait is counted by this main: one
that takes over (a restart, a failover) starts it again.

The rules are pure: times are the event loop's, fed in by the shell, and nothing here
touches the store. :class:`broker.core.handoff.Handoff` keeps one :class:`Affinity` and asks it
about every job it plans.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

from broker.jobs import ExecutionMode, Job
from broker.model.logs import log_event

logger = logging.getLogger("broker.main")

DEFAULT_MAX_WAIT = 3600.0
"""Seconds a recovery waits for its state holder at most (``--affinity-max-wait``)."""


@dataclass(frozen=True, slots=True)
class Route:
    """A worker may take the job; ``state_lost`` when it runs without the job's state."""

    state_lost: bool


ANY_WORKER = Route(state_lost=False)
"""A job without a state holder: any worker, nothing to lose."""


@dataclass
class Wait:
    """A recovery held back for its state holder: since when (this main's loop time), and
    its deadline, moved on by each extension."""

    since: float
    until: float
    seen: float
    mode: ExecutionMode
    """The job's mode: while no worker has a free slot of it, no plan looks at the job."""
    """When a plan last asked about it: a wait not asked about for ``max_wait`` is of a
    job that has gone (run, cancelled), and is dropped."""


@dataclass
class Affinity:
    """Where the state holders are (see the module docstring)."""

    grace: float
    """Seconds a recovery waits for its holder after the holder left, and each extension."""
    started: float
    """When this main started: the holders it never saw left at the latest then."""
    max_wait: float = DEFAULT_MAX_WAIT
    """Seconds at most a recovery waits for its holder, extensions included."""
    waits: dict[uuid.UUID, Wait] = field(default_factory=dict)
    """The recoveries held back for their holder (by job id), for the cap."""
    sessions: Counter[str] = field(default_factory=Counter)
    """Worker id -> its connected sessions."""
    left_at: dict[str, float] = field(default_factory=dict)
    """Worker id -> when its last session ended."""
    state_gone: set[str] = field(default_factory=set)
    """Worker ids that said the local state their lost attempts left behind is gone."""

    def joined(self, worker_id: str, *, state_kept: bool = True) -> None:
        """A session of ``worker_id`` passed its hello; without ``state_kept`` the worker
        came back without the local state of its earlier sessions."""
        self.sessions[worker_id] += 1
        if not state_kept:
            self.state_gone.add(worker_id)

    def left(self, worker_id: str, now: float) -> None:
        """A session of ``worker_id`` ended at ``now``."""
        self.sessions[worker_id] -= 1
        if self.sessions[worker_id] <= 0:
            del self.sessions[worker_id]
            self.left_at[worker_id] = now

    def holds_again(self, worker_id: str) -> None:
        """A local-state attempt on ``worker_id`` was lost after it said its state was
        gone: that attempt's state is on the worker again, so its recovery waits."""
        self.state_gone.discard(worker_id)

    def deadline(self, holder: str) -> float:
        """Until when a job held by ``holder`` waits for it (``inf`` while connected)."""
        if self.sessions[holder] > 0:
            return math.inf
        return self.left_at.get(holder, self.started) + self.grace

    def route(
        self, job: Job, worker_id: str, now: float, *, queue_paused: bool = False
    ) -> Route | None:
        """Whether ``worker_id`` may take ``job`` at ``now``: how, or ``None`` (wait).
        ``queue_paused``: the job's queue is paused, which extends a wait at its deadline
        as a connected holder does."""
        holder = job.state_holder
        if holder is None:
            return ANY_WORKER
        if holder in self.state_gone:
            return Route(state_lost=True)
        if worker_id == holder:
            return Route(state_lost=False)
        if self._waiting(job, holder, now, queue_paused):
            return None
        return Route(state_lost=True)

    def _waiting(self, job: Job, holder: str, now: float, queue_paused: bool) -> bool:
        """Whether ``job`` still waits for ``holder`` at ``now`` (see the module docstring):
        its wait is extended (and logged) when its deadline has come while the holder is
        connected or the queue paused; past ``max_wait`` it waits no more."""
        wait = self.waits.get(job.id)
        if wait is None:
            wait = Wait(since=now, until=now + self._step, seen=now, mode=job.execution_mode)
            self.waits[job.id] = wait
        wait.seen = now
        hard = wait.since + self.max_wait
        if now >= hard:
            if not wait.until > hard:  # logged once
                wait.until = math.inf
                log_event(
                    logger,
                    logging.WARNING,
                    "recovery released at the affinity's maximum wait: any worker may run "
                    "it, without its local state",
                    job_id=job.id,
                    holder=holder,
                    waited=round(now - wait.since, 3),
                    max_wait=self.max_wait,
                )
            return False
        connected = self.sessions[holder] > 0
        if not connected and not queue_paused:
            return now < self.deadline(holder)
        if now >= wait.until:
            wait.until = min(now + self._step, hard)
            log_event(
                logger,
                logging.INFO,
                "recovery wait extended",
                job_id=job.id,
                holder=holder,
                reason="holder connected" if connected else "queue paused",
                waited=round(now - wait.since, 3),
                until=round(wait.until - wait.since, 3),
                max_wait=self.max_wait,
            )
        return True

    @property
    def _step(self) -> float:
        """How far a deadline moves at each extension: the grace (with none, the rest of
        the maximum, so a grace of 0 does not log an extension at every plan)."""
        return self.grace if self.grace > 0 else self.max_wait

    def placed(self, job_id: uuid.UUID) -> None:
        """``job_id`` was handed to a worker: its wait, if any, is over."""
        self.waits.pop(job_id, None)

    def wake_at(self, job_id: uuid.UUID, holder: str, modes: Collection[ExecutionMode]) -> float:
        """When the wait of ``job_id`` for ``holder`` must be looked at again: its grace's
        end once the holder left, its deadline (an extension is due, or its end at the
        maximum) while the holder is connected; ``inf``: never by itself, or not while
        no worker has a free slot of its mode (not in ``modes``): no plan would look at
        it, and a wake for it would come round again at once (a ``ready`` with a slot of
        its mode wakes the dispatcher anyway)."""
        wait = self.waits.get(job_id)
        if wait is None:
            return self.deadline(holder)
        if wait.mode not in modes:
            return math.inf
        hard = wait.since + self.max_wait
        if wait.until > hard:
            return math.inf  # released: it waits for a free slot, which wakes a plan
        # Only what lies past the last look: a time it already saw pass and that still
        # left the job waiting (a deadline not extended because the holder had gone, a
        # grace over while the queue is paused) decides nothing any more, and waking
        # for it would spin.
        times = [t for t in (self.deadline(holder), wait.until, hard) if t > wait.seen]
        return min(times, default=math.inf)

    def forget_departed(self, now: float) -> None:
        """Drop the departures whose grace is over: they decide nothing any more (without
        one, a holder counts as gone since ``started``, which is earlier still). Drop the
        waits no plan asked about for ``max_wait``: their jobs have gone."""
        for worker_id, at in list(self.left_at.items()):
            if at + self.grace <= now:
                del self.left_at[worker_id]
        for job_id, wait in list(self.waits.items()):
            if wait.seen + self.max_wait <= now:
                del self.waits[job_id]
