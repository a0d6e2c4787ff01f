"""When a worker connects again, to which main, and when it gives a connection up.

Rule: every decision of the worker's connection loop that is not I/O is here; the loop
(:mod:`broker.worker.link`) only connects, sleeps the delays said here and feeds the times
in. A worker keeps one connection to the main and, whenever it is lost, tries again with
capped, jittered, exponential backoff. It decides a connection is lost when nothing at all
has come from the main for the liveness timeout (the main answers every ``ping``), or a
send has waited that long on the socket, because TCP alone can take many minutes to notice
a peer that vanished. The main judges its peers by the same timeout, in its own core
(:meth:`broker.core.peers.Liveness.problem`), from pongs rather than any message: it
pings, and a worker that sends but never reads cannot answer.

During a failover the backoff must not grow as if the mains were down: the old leader
refuses, the standby answers ``not_leader`` (naming the old leader while its lease runs,
then no one, then itself while it loads), and every one of those answers used to double
the delay, so a worker found a leader elected in 2.9 s only after 5.4 s; and since the
count carried over into the next connection, a failover soon after another cost the
backoff's longest wait. A standby that answers proves a main is up and an election under
way, so from then on until the next connection the delay is capped at
:data:`FOLLOW_DELAY`, a leader it names (other than itself) is tried at once, like a
redirect, and the welcome forgives those attempts. A worker thus follows a new leader
within about one :data:`FOLLOW_DELAY` of its election.

A welcome from a main other than the one that welcomed the last connection forgives
everything counted before it, short connections included. A connection that ends before
:data:`STABLE_CONNECTION` counts as a failure, so that a main that welcomes and drops
at once is backed off from; but a leader killed less than a second after its workers
arrived (takeovers back to back) also ended its connections early, and each such
failure was carried through the next failover (restored at the welcome) into the wait
before the first attempt of the one after: the first wait after a loss is not capped, as
no standby has answered yet, so it doubled with every takeover (a worker followed the
new leaders 1.9, 2.7, 5.0, 8.1 s after their elections while the other, whose
connections happened to last a second, stayed under 0.3 s). A new main's welcome says
that whatever ended the connections before it was not this main's doing; the same main
welcoming again keeps the count, so one that drops at once is still backed off from.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from broker.wire.addresses import MainAddresses

FIRST_RECONNECT_DELAY = 0.1
"""The backoff's first ceiling, doubled by each failure up to the worker's
``reconnect_max_delay``."""

FOLLOW_DELAY = 0.4
"""The backoff's ceiling once a standby has answered since the last connection: a
failover is under way, and the new leader is due within the election's bound. A standby
answers a refused hello cheaply, so a few attempts a second per worker for those seconds
cost little; a worker whose every main is unreachable still backs off to its
``reconnect_max_delay``."""

STABLE_CONNECTION = 1.0
"""A connection that lasted this long resets the backoff; shorter ones keep growing it,
so a main that accepts and then drops at once is not hammered ten times a second. It
was 5 s, and a leader that died within 5 s of the workers' arrival (ten takeovers in a
row) left them its failures to count: each next failover began with a longer wait, up
to 5.7 s after the election; a connection that lasted a second was welcomed and served,
and says nothing against the next main."""


class Reconnect:
    """The worker's reconnect policy over the mains it was given: each outcome of a
    connection says which main to try next and returns the seconds to wait first.

    ``uniform`` draws the jitter (``random.uniform``; a test passes its own): a delay is
    drawn between half its ceiling and the ceiling, so workers cut off together do not all
    come back in the same instant.
    """

    def __init__(
        self,
        mains: MainAddresses,
        max_delay: float,
        *,
        uniform: Callable[[float, float], float] = random.uniform,
    ) -> None:
        self.mains = mains
        self._max_delay = max_delay
        self._uniform = uniform
        self.failures = 0
        """Attempts failed, and connections lost before they were stable, in a row."""
        self._connected_at: float | None = None
        self._before_failover: int | None = None
        """:attr:`failures` when a standby first answered since the last connection
        (``None``: none did): the delay is capped at :data:`FOLLOW_DELAY` meanwhile, and a
        welcome forgives the attempts since (see :meth:`connected`)."""
        self._redirected = False
        """The last attempt went, at once, to the leader a standby named."""
        self._main: str | None = None
        """The main (its ``main_id``) that welcomed the last connection."""

    def unreachable(self) -> float:
        """Connecting failed (no answer, a refused or broken handshake, a TLS error): the
        next main in the list is tried."""
        self.failures += 1
        self._redirected = False
        self.mains.failed()
        return self._delay(self.failures)

    def not_leader(self, leader: str | None) -> float:
        """A standby answered: the leader it named is tried next (the next main in the
        list when it named none). A leader named elsewhere is tried at once, unless the
        attempt that got this answer was already such a redirect (two standbys naming each
        other, however briefly, are never asked in a busy loop)."""
        if self._before_failover is None:
            self._before_failover = self.failures
        self.failures += 1
        asked = self.mains.current
        self.mains.follow(leader)
        redirect = leader is not None and self.mains.current != asked and not self._redirected
        self._redirected = redirect
        return 0.0 if redirect else self._delay(self.failures)

    def connected(self, now: float, main: str) -> None:
        """The main ``main`` (its ``main_id``) welcomed this worker at ``now``.

        A main other than the last one to welcome it forgives every failure counted: the
        attempts, and the connections that ended early, were all about other mains (a
        leader killed soon after its workers arrived ends their connections early too).
        The same main again forgives only the attempts made while following it (a
        standby named it): they said nothing against it, while its own connections that
        ended at once still count, so a main that welcomes and drops is backed off from.
        """
        self._connected_at = now
        if main != self._main:
            self.failures = 0
        elif self._before_failover is not None:
            self.failures = self._before_failover
        self._main = main
        self._before_failover = None
        self._redirected = False

    def lost(self, now: float) -> float:
        """The connection ended at ``now``. The leader may be gone, so the next main is
        tried (a standby names the new one); the backoff starts over only if the connection
        was stable, and a reconnect always waits at least the first delay."""
        started = now if self._connected_at is None else self._connected_at
        self._connected_at = None
        self.failures = 0 if now - started >= STABLE_CONNECTION else self.failures + 1
        self.mains.failed()
        return self._delay(max(self.failures, 1))

    def _delay(self, failures: int) -> float:
        ceiling = min(self._max_delay, FIRST_RECONNECT_DELAY * 2 ** min(failures - 1, 30))
        if self._before_failover is not None:
            ceiling = min(ceiling, FOLLOW_DELAY)
        return self._uniform(ceiling / 2, ceiling)


def alive_for(now: float, *, heard: float, sending: float | None, limit: float) -> float:
    """How much longer the connection to the main counts as alive at ``now``: ``heard`` is
    when the last message came from it, ``sending`` when the send under way began
    (``None``: none is waiting on the socket), ``limit`` the liveness timeout.

    :raises TimeoutError: the connection is lost, saying why.
    """
    silent = now - heard
    if silent >= limit:
        raise TimeoutError(f"nothing from the main for {limit} s")
    left = limit - silent
    if sending is not None:
        if now - sending >= limit:
            raise TimeoutError(f"a send to the main waited {limit} s on the socket")
        left = min(left, limit - (now - sending))
    return left


__all__ = ["FIRST_RECONNECT_DELAY", "FOLLOW_DELAY", "STABLE_CONNECTION", "Reconnect", "alive_for"]
