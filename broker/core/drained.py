"""Which execution modes the dispatcher has proven drained, and for which queues.

A dispatch read that comes back short, every job in it placed, with no queue change
since it began, proves its modes drained: the dispatcher reads them no more until the
next change, and an enqueue of those modes may take a free slot at once without
overtaking a waiting job (:meth:`broker.core.handoff.Handoff.plan_at_enqueue`). Whether
"no change since" holds is read from a short log of changes, each with the modes it
touched, so that an enqueue of one mode spoils no proof about another; which settled
reports count as a change is :func:`may_requeue`'s to say.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Set

from broker.jobs import ExecutionMode, Job
from broker.wire import messages as protocol

CHANGE_LOG = 64
"""Queue changes remembered (see :meth:`DrainedModes.unchanged_since`): a read spanning
more changes than this proves nothing, as any read spanning a change once did."""


class DrainedModes:
    """The change log and the drained proofs built on it (see the module docstring)."""

    def __init__(self) -> None:
        self._count = 0
        """Bumped whenever jobs may have become eligible (every dispatcher wake-up)."""
        self._changes: deque[tuple[int, frozenset[ExecutionMode] | None]] = deque(maxlen=CHANGE_LOG)
        """The latest changes: the count each brought, and the only modes it touched
        (``None``: it may have touched any)."""
        self._drained: frozenset[ExecutionMode] = frozenset()
        """Modes whose eligible jobs the last read found all claimed or being claimed, with
        nothing changed since."""
        self._drained_for: frozenset[str] | None = None
        """The queues every read behind :attr:`_drained` covered (``None``: all). A read
        covers the queues the dispatchable workers serve, so a worker serving more (one
        that resumes after a pause, or says hello) may serve jobs no proof looked at."""

    @property
    def modes(self) -> frozenset[ExecutionMode]:
        """The modes proven drained."""
        return self._drained

    @property
    def count(self) -> int:
        """The change count a read started now passes to :meth:`read`."""
        return self._count

    def changed(self) -> None:
        """Jobs may have become eligible (an insert, a return, a retry, a report...): no
        mode counts as drained until a read started after this says so."""
        self._count += 1
        self._drained = frozenset()
        self._changes.append((self._count, None))

    def added(self, modes: Iterable[ExecutionMode]) -> None:
        """Queued jobs of ``modes`` were stored, and nothing else changed: those modes stop
        counting as drained, the others stay so.

        Why not :meth:`changed`: while producers enqueue one job at a time during a
        drain, every enqueue forgot every drained mode, and the next pass read each empty
        mode (a pooled worker's inline and forked slots) again, for nothing."""
        touched = frozenset(modes)
        self._count += 1
        self._drained = self._drained.difference(touched)
        self._changes.append((self._count, touched))

    def unchanged_since(self, started: int, modes: Iterable[ExecutionMode]) -> bool:
        """Whether no change since change count ``started`` can have touched ``modes``
        (false when the log no longer reaches back that far)."""
        if started == self._count:
            return True
        if not self._changes or self._changes[0][0] > started + 1:
            return False
        wanted = frozenset(modes)
        for count, touched in reversed(self._changes):
            if count <= started:
                break
            if touched is None or not touched.isdisjoint(wanted):
                return False
        return True

    def read(
        self,
        started: int,
        modes: Iterable[ExecutionMode],
        *,
        full: bool,
        queues: Collection[str] | None,
    ) -> None:
        """A read of eligible jobs for ``modes`` and ``queues`` (``None``: every queue),
        begun at change count ``started``, came back and was planned; ``full`` when it
        returned as many as it asked for, or some of them found no slot (jobs wait). Short
        and all placed, with nothing changed meanwhile, it proves those modes drained in
        those queues, beside those proven since the last change. (Jobs added meanwhile to
        other modes only do not spoil the proof: see :meth:`added`.) The proofs hold
        together for the queues all of them covered, or this one's when it proves every
        drained mode."""
        modes = frozenset(modes)
        if not self.unchanged_since(started, modes):
            return
        if full:
            self._drained = self._drained.difference(modes)
            return
        covered = None if queues is None else frozenset(queues)
        if modes >= self._drained:  # this proof alone holds every drained mode
            self._drained_for = covered
        elif covered is not None:
            mine = self._drained_for
            self._drained_for = covered if mine is None else mine & covered
        self._drained = self._drained.union(modes)

    def covers(self, served: Set[str] | None) -> bool:
        """Whether the proofs covered every queue in ``served`` (those a dispatchable
        worker serves now; ``None``: every queue), so that a job handed off at once can
        overtake none a worker could have taken."""
        proven = self._drained_for
        if proven is None:
            return True
        return served is not None and served <= proven


def may_requeue(msg: protocol.Report, job: Job | None) -> bool:
    """Whether an applied report may have made a job eligible: any outcome but a
    completion puts its job back in the queue (or may: a retry, a reschedule, a release,
    a lost attempt), and any settlement of a keyed job frees its key's slot for the jobs
    waiting on it (a job the core no longer holds counts as keyed)."""
    if not isinstance(msg, protocol.CompletedReport):
        return True
    return job is None or job.concurrency_key is not None
