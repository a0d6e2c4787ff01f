"""Affinity: which worker may run the recovery of a job that keeps local state.

A task declared with ``local_state=True`` keeps state on its worker's machine (files, a
warm cache) that its next attempt wants. When such an attempt is lost, the store names
the worker that ran it as the job's ``state_holder`` (see :func:`broker.retry.lost_attempt`),
and the recovery is offered to that worker id first:

* while the holder is connected (any session, even draining or busy), only it may take
  the job: the wait lasts as long as the holder stays alive and connected;
* once it has left, the job waits ``grace`` seconds more for it to come back (a main that
  never saw the holder counts from its own start);
* if the holder says its local state is gone (it came back without its state directory,
  or its task said so), or the grace has passed, any worker may take the job, and is told
  the state is gone.

The rules are pure: times are the event loop's, fed in by the shell, and nothing here
touches the store. :class:`broker.core.handoff.Handoff` keeps one :class:`Affinity` and asks it
about every job it plans.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from broker.jobs import Job


@dataclass(frozen=True, slots=True)
class Route:
    """A worker may take the job; ``state_lost`` when it runs without the job's state."""

    state_lost: bool


ANY_WORKER = Route(state_lost=False)
"""A job without a state holder: any worker, nothing to lose."""


@dataclass
class Affinity:
    """Where the state holders are (see the module docstring)."""

    grace: float
    """Seconds a recovery waits for its holder after the holder left."""
    started: float
    """When this main started: the holders it never saw left at the latest then."""
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

    def route(self, job: Job, worker_id: str, now: float) -> Route | None:
        """Whether ``worker_id`` may take ``job`` at ``now``: how, or ``None`` (wait)."""
        holder = job.state_holder
        if holder is None:
            return ANY_WORKER
        if holder in self.state_gone:
            return Route(state_lost=True)
        if worker_id == holder:
            return Route(state_lost=False)
        if now < self.deadline(holder):
            return None
        return Route(state_lost=True)

    def forget_departed(self, now: float) -> None:
        """Drop the departures whose grace is over: they decide nothing any more (without
        one, a holder counts as gone since ``started``, which is earlier still)."""
        for worker_id, at in list(self.left_at.items()):
            if at + self.grace <= now:
                del self.left_at[worker_id]
