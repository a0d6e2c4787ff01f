"""Which main dispatches, when several share one store: the rules, without I/O.

The store holds the election (:class:`broker.storage.SupportsLeadership`): a leader row
with an epoch and a lease that runs out by the database's clock. This state machine
decides *when* a main asks the store, and what it makes of the answers:

* a standby asks to take the row over every ``poll_every`` seconds; it is elected when
  the answer names it, and then leads under the answer's epoch;
* the leader renews its lease every ``renew_every`` seconds; a renewal the store
  refuses means another main took over, and the leader steps down at once;
* when its lease, counted from the start of its last successful renewal, has run out
  by its own clock (the store was unreachable, the process paused or starved), the
  leader does not guess: it asks the store once more, at once, and steps down unless
  the store renews the lease, which it does unless another main took over (a lease
  that ran out there with nobody taking it is renewed: nobody led meanwhile, so a
  paused main with no standby keeps leading instead of exiting). While it asks, it
  keeps serving: every claim and settle is fenced, so a main that was deposed
  meanwhile changes nothing, and learns it from the first refused statement;
* a statement refused by the epoch fence (``DeposedError``) steps it down too.

The store's answer is what counts, not the main's own timers: a round that is out is
given up on only after ``renew_every`` of the main's *running* time (:class:`RoundBudget`),
so an answer that arrived while the main's loop was stalled (a slow request, a starved
or paused process) is read and used, never discarded by a timer that fired late. A
renewal the store granted holds the lease from when it was *sent*, which is never later
than the store counted it from; and a stall the store did not see as a takeover (the row
still names this main) does not depose it.

A main that steps down does not dispatch again (:class:`StepDown`): its shell stops it,
and a supervisor starts it afresh, as a standby. The lease is only the timing: what
keeps a deposed main from changing jobs is the fence in every claim and settle.

Times are the shell's monotonic clock, in seconds; :class:`Timing` derives every
interval from the one bound an operator sets, the longest a takeover may take.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from broker.model import checks
from broker.wire import messages as protocol

DEFAULT_FAILOVER_TIMEOUT = 5.0
"""Seconds from the leader's death to a standby dispatching, at most (with a healthy
store): Oban and River take over within a few seconds too."""


@dataclass(frozen=True, slots=True)
class Timing:
    """The election's intervals, from ``failover_timeout``, the takeover bound.

    The lease is 60% of the bound and a standby asks every 10% of it, so a standby
    takes over at most lease + one poll (70%) after the leader's last renewal, leaving
    the rest for the statements' own time. The leader renews three times per lease, so
    two renewals in a row may fail before it must step down.
    """

    failover_timeout: float = DEFAULT_FAILOVER_TIMEOUT

    def __post_init__(self) -> None:
        checks.positive("failover_timeout", self.failover_timeout)

    @property
    def ttl(self) -> float:
        return self.failover_timeout * 0.6

    @property
    def renew_every(self) -> float:
        return self.ttl / 3

    @property
    def poll_every(self) -> float:
        return self.failover_timeout * 0.1


@dataclass(slots=True)
class RoundBudget:
    """How long a round may wait for the store's answer, in the main's running time.

    The shell waits in steps of :attr:`step` and reports each (:meth:`waited`). Only the
    planned length of a step counts: the rest is time the loop itself could not run, in
    which the answer may well have come and waited in the socket to be read. A timer
    that fires late because the loop was stalled must not throw that answer away, for
    the store did renew, and a leader told "failed" at its last chance steps down.
    """

    budget: float
    spent: float = 0.0

    STEPS = 10
    """Steps per budget: a stall costs a round at most one of them."""

    @property
    def step(self) -> float:
        return self.budget / self.STEPS

    def waited(self, planned: float, took: float) -> bool:
        """A wait planned for ``planned`` seconds took ``took``; whether the round is now
        out of time."""
        self.spent += min(planned, took)
        return self.spent >= self.budget * (1 - 1e-9)  # ten steps of a tenth add up short


class Phase(enum.StrEnum):
    STANDBY = "standby"
    LEADER = "leader"
    DEPOSED = "deposed"


@dataclass(frozen=True, slots=True)
class TryElect:
    """Ask the store to take the leader row over (``SupportsLeadership.elect``)."""

    started: float


@dataclass(frozen=True, slots=True)
class Renew:
    """Renew the lease of ``epoch`` (``SupportsLeadership.renew``)."""

    epoch: int
    started: float


@dataclass(frozen=True, slots=True)
class Lead:
    """This main is elected under ``epoch``: fence the store with it, load the orphans,
    start dispatching."""

    epoch: int


@dataclass(frozen=True, slots=True)
class StepDown:
    """This main must stop dispatching at once (it was the leader)."""

    epoch: int
    reason: str


Effect = TryElect | Renew | Lead | StepDown


class Election:
    """One main's view of the election. Feed it the clock (:meth:`due`) and the
    store's answers; carry out the effects it returns, in order."""

    def __init__(self, holder: str, timing: Timing) -> None:
        self.holder = holder
        self.timing = timing
        self.phase = Phase.STANDBY
        self.epoch: int | None = None
        """The epoch this main leads (or led) under; ``None`` while it never led."""
        self.leader: str | None = None
        """The leader's address as last seen, for a standby to name to peers."""
        self._lease_until = -math.inf
        self._next = -math.inf
        self._asking = False
        """A round is out: no second one until its answer (or failure) comes back."""
        self._last_chance = False
        """The lease ran out by this main's clock and one more renewal is out: unless it
        succeeds, the next :meth:`due` steps down."""

    @property
    def lease_until(self) -> float:
        """Until when this main is sure to be the leader, by its own clock: the start of
        its last successful renewal (or election) plus the lease. The store started
        counting the same lease later, so this ends first."""
        return self._lease_until if self.phase is Phase.LEADER else -math.inf

    def due(self, now: float) -> list[Effect]:
        """What is due at ``now``: a round, a renewal, or stepping down."""
        if self.phase is Phase.LEADER and now >= self._lease_until:
            if self._last_chance:
                if self._asking:
                    return []  # its answer decides
                return self._step_down(
                    f"the lease ran out at this main's clock ({self.timing.ttl:g} s without "
                    "a renewal) and the store did not renew it"
                )
            if not self._asking:
                self._last_chance = True
                self._asking = True
                assert self.epoch is not None
                return [Renew(self.epoch, now)]
        if self._asking or now < self._next or self.phase is Phase.DEPOSED:
            return []
        self._asking = True
        if self.phase is Phase.LEADER:
            assert self.epoch is not None
            self._next = now + self.timing.renew_every
            return [Renew(self.epoch, now)]
        self._next = now + self.timing.poll_every
        return [TryElect(now)]

    def wake_at(self) -> float:
        """When :meth:`due` next has something to do (``inf``: never again)."""
        if self.phase is Phase.DEPOSED:
            return math.inf
        if self.phase is Phase.LEADER:
            return min(self._next, self._lease_until)
        return self._next

    def elected(
        self, holder: str, epoch: int, address: str, live: bool, started: float
    ) -> list[Effect]:
        """The answer to :class:`TryElect`: the row names ``holder`` under ``epoch``, its
        lease ``live`` or run out."""
        self._asking = False
        if self.phase is not Phase.STANDBY:
            return []
        self.leader = address if live else None
        if holder != self.holder or not live:
            return []
        self.phase = Phase.LEADER
        self.epoch = epoch
        self._lease_until = started + self.timing.ttl
        self._next = started + self.timing.renew_every
        return [Lead(epoch)]

    def renewed(self, started: float, ok: bool) -> list[Effect]:
        """The answer to :class:`Renew` started at ``started``: ``ok`` or refused."""
        self._asking = False
        if self.phase is not Phase.LEADER:
            return []
        if not ok:
            return self._step_down("the store refused the renewal: another main took over")
        self._lease_until = max(self._lease_until, started + self.timing.ttl)
        self._last_chance = False
        return []

    def failed(self) -> None:
        """A round or renewal raised (the store unreachable): try again when due; a
        leader's lease keeps running out meanwhile."""
        self._asking = False

    def fenced(self) -> list[Effect]:
        """A claim or settle was refused by the epoch fence: another main took over."""
        if self.phase is not Phase.LEADER:
            return []
        return self._step_down("a statement was refused by the epoch fence")

    def resigned(self) -> None:
        """The main stops cleanly; it leads no more."""
        self.phase = Phase.DEPOSED

    def _step_down(self, reason: str) -> list[Effect]:
        assert self.epoch is not None
        self.phase = Phase.DEPOSED
        return [StepDown(self.epoch, reason)]


class MainRole(enum.StrEnum):
    """A main's part, as ``/healthz``, ``/metrics`` (``broker_main_leader``) and ``broker
    status`` say it."""

    LEADER = "leader"
    """It dispatches (elected and done loading the handoffs in flight, or alone on a
    store without an election)."""
    STANDBY = "standby"
    """It answers peers ``not_leader``: waiting to be elected, or elected and still
    loading."""
    DEPOSED = "deposed"
    """It stepped down (or resigned) and is stopping."""


@dataclass(frozen=True, slots=True)
class Standing:
    """What a main says of itself to operators and peers: its role, and the leader's
    address as it knows it (``None``: no leader elected, as far as it saw)."""

    role: MainRole
    leader: str | None


def standing(election: Election | None, *, dispatching: bool, address: str) -> Standing:
    """The standing of a main reached at ``address`` that holds ``election`` (``None``: its
    store holds one main) and ``dispatching`` or not.

    Elected but still loading the handoffs in flight, it is a standby that names itself:
    a worker welcomed now would adopt none of its leases, and they would go back to the
    queue at the orphans' deadline while it ran them; it comes back after its backoff
    instead."""
    if election is None or (election.phase is Phase.LEADER and dispatching):
        return Standing(MainRole.LEADER, address)
    if election.phase is Phase.DEPOSED:
        return Standing(MainRole.DEPOSED, None)
    loading = election.phase is Phase.LEADER
    return Standing(MainRole.STANDBY, address if loading else election.leader)


def not_leader(election: Election, address: str) -> protocol.Error:
    """The answer to a peer's hello while this main, reached at ``address``, does not
    dispatch (the connection then closes): where the leader is, if it knows
    (:func:`standing`)."""
    loading = election.phase is Phase.LEADER
    leader = standing(election, dispatching=False, address=address).leader
    return protocol.Error(
        code=protocol.ErrorCode.NOT_LEADER,
        message=(
            "this main was just elected and is loading the handoffs in flight; try again"
            if loading
            else f"this main is a standby; the leader is at {leader}"
            if leader is not None
            else "this main is a standby and no main is elected yet; try again"
        ),
        fatal=True,
        leader=leader,
    )
