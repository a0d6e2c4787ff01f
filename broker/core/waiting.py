"""Leases no connection holds, waiting for their worker's hello.

Two kinds, one rule: the worker that ran them may say hello again with them among its
held leases and adopts them then (:meth:`broker.core.handoff.Handoff.hello`); otherwise
they go back to the queue after a grace.

- *Orphans*: the handoffs found in the store when this main began to dispatch (it
  restarted, or was elected), all waiting until the orphans' deadline.
- *Parked* leases: those of a connection that ended while the main itself was stalled.
  A worker whose main did not answer for its liveness timeout gives its socket up but
  keeps running its jobs; returning their leases would hand them out a second time while
  they run. Each waits ``reconnect_grace`` from its disconnect, and a further stall of
  the main adds to that wait (the worker could not reconnect meanwhile either).

Times are the main's loop time, fed in by its events.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from broker.jobs import Job, JobStatus

STALL = 1.0
"""A lag of the main's own loop at least this long (seconds) counts as a stall: it is
logged, and a worker connection that ends during one, or within :data:`STALL_AFTERMATH`
after it, has its leases parked instead of returned (see
:meth:`broker.core.handoff.Handoff.disconnect`)."""

STALL_AFTERMATH = 2.0
"""Seconds after the end of a stall during which a connection that ends still counts as
ended by it: when the loop runs again it first reads what piled up meanwhile, the end of
every socket a worker gave up on while the main could not answer its pings included."""


@dataclass(slots=True)
class Parked:
    """A lease of a connection that ended while the main was stalled: ``job`` as it was
    handed off, waiting until ``until`` (loop time) for ``worker_id`` to say hello again
    with it in its held leases."""

    job: Job
    worker_id: str
    until: float


class WaitingLeases:
    """The orphans and the parked leases (see the module docstring)."""

    def __init__(self, reconnect_grace: float) -> None:
        self.reconnect_grace = reconnect_grace
        """How long the leases of a connection that ended during a stall of the main wait
        for their worker to reconnect (the orphans' grace: the same wait, for the same
        workers, as after a restart)."""
        self.orphans: dict[uuid.UUID, Job] = {}
        """Handoffs found in the store at start-up, by lease."""
        self.parked: dict[uuid.UUID, Parked] = {}
        """Leases of connections that ended while the main was stalled, by lease."""
        self._stall_ended = -math.inf
        """When the last stall of the main's loop that :meth:`expire` measured ended."""

    def load(self, jobs: Iterable[Job]) -> None:
        """Handoffs the store holds at start-up become orphans."""
        for job in jobs:
            if job.status is JobStatus.HANDED_OFF and job.handoff_id is not None:
                self.orphans[job.handoff_id] = job

    def take(self, worker_id: str | None) -> list[tuple[uuid.UUID, Job]]:
        """The orphans and parked leases of ``worker_id``, which said hello: none waits
        any longer (what its hello does not hold goes back now, not after the grace)."""
        mine = [
            *((lease, job) for lease, job in self.orphans.items() if job.worker_id == worker_id),
            *((lease, p.job) for lease, p in self.parked.items() if p.worker_id == worker_id),
        ]
        for lease, _ in mine:
            self.orphans.pop(lease, None)
            self.parked.pop(lease, None)
        return mine

    def stalled(self, now: float, stall: float) -> bool:
        """Whether a connection ending at ``now`` may have been given up on because the
        main could not answer: its loop is late by ``stall``, or a stall just ended."""
        return stall >= STALL or now - self._stall_ended <= STALL_AFTERMATH

    def park(self, worker_id: str, leases: Mapping[uuid.UUID, Job], now: float) -> None:
        """The connection holding ``leases`` for ``worker_id`` ended at ``now``, during a
        stall: they wait for that worker's hello, each under its own lease."""
        until = now + self.reconnect_grace
        for lease, job in leases.items():
            self.parked[lease] = Parked(job, worker_id, until)

    def expire(self, now: float, stall: float) -> list[tuple[uuid.UUID, Job]]:
        """A liveness check at ``now``, ``stall`` late: a stall extends every parked wait
        (and is remembered, see :meth:`stalled`); the parked leases whose wait is over
        stop waiting and are returned."""
        if stall >= STALL:
            self._stall_ended = now
        over: list[tuple[uuid.UUID, Job]] = []
        for lease, parked in list(self.parked.items()):
            if stall > 0:
                parked.until += stall
            if parked.until <= now:
                del self.parked[lease]
                over.append((lease, parked.job))
        return over

    def drop(self, lease: uuid.UUID) -> None:
        """``lease``'s job was cancelled or finished: it waits for nobody."""
        self.orphans.pop(lease, None)
        self.parked.pop(lease, None)
