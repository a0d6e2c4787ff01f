"""The election's rules (:mod:`broker.core.election`) against a model of the leader row: the
row's lease runs out by the store's clock, a takeover grows the epoch, and a main's
rounds reach the store some time after it sent them. Single events first, then a
hypothesis run of several mains, crashes and slow rounds included: never two leaders
at once, by the mains' own clocks, and a standby takes over within the bound."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.core.election import (
    Election,
    Lead,
    MainRole,
    Phase,
    Renew,
    RoundBudget,
    Standing,
    StepDown,
    Timing,
    TryElect,
    not_leader,
    standing,
)
from broker.exceptions import ConfigurationError
from broker.main.election import within_running_time
from broker.wire.messages import ErrorCode


@dataclass
class Row:
    """The leader row as ``adapters/sql/postgres_sql.py`` keeps it, by the store's clock."""

    epoch: int = 0
    holder: str = ""
    address: str = ""
    expires: float = -math.inf

    def elect(self, holder: str, ttl: float, now: float) -> tuple[str, int, str, bool]:
        if self.expires <= now:
            self.epoch, self.holder, self.address = self.epoch + 1, holder, f"{holder}:7600"
            self.expires = now + ttl
        return self.holder, self.epoch, self.address, self.expires > now

    def renew(self, holder: str, epoch: int, ttl: float, now: float) -> bool:
        """Renewed while the row still names ``holder`` and ``epoch``, run out or not."""
        if self.holder == holder and self.epoch == epoch and self.expires > -math.inf:
            self.expires = now + ttl
            return True
        return False


def answer(e: Election, row: Row, effect: TryElect | Renew, now: float) -> list[object]:
    """``effect`` reaches the store at ``now``; the main gets the answer."""
    ttl = e.timing.ttl
    if isinstance(effect, TryElect):
        return list(e.elected(*row.elect(e.holder, ttl, now), started=effect.started))
    return list(e.renewed(effect.started, row.renew(e.holder, effect.epoch, ttl, now)))


TIMING = Timing(5.0)


def test_timing_derives_from_the_bound() -> None:
    assert (TIMING.ttl, TIMING.renew_every, TIMING.poll_every) == pytest.approx((3.0, 1.0, 0.5))
    assert TIMING.ttl + TIMING.poll_every < TIMING.failover_timeout
    with pytest.raises(ConfigurationError):
        Timing(0)


def test_a_main_that_does_not_dispatch_answers_hellos_with_where_the_leader_is() -> None:
    """``not_leader``: a standby names the leader it last saw (or none yet); a main just
    elected, still loading the handoffs in flight, names itself, so the worker comes
    back to it once it is ready. Every answer closes the connection."""
    alone = not_leader(Election("a", TIMING), "a:7600")
    assert (alone.code, alone.leader, alone.fatal) == (ErrorCode.NOT_LEADER, None, True)
    assert "no main is elected yet" in alone.message

    standby = Election("a", TIMING)
    standby.elected("b", 1, "b:7600", live=True, started=0.0)
    told = not_leader(standby, "a:7600")
    assert (told.leader, told.message) == (
        "b:7600",
        "this main is a standby; the leader is at b:7600",
    )

    elected = Election("a", TIMING)
    assert elected.elected("a", 2, "a:7600", live=True, started=0.0) == [Lead(2)]
    loading = not_leader(elected, "a:7600")
    assert loading.leader == "a:7600" and "just elected" in loading.message


def test_a_main_says_its_role_and_where_the_leader_is() -> None:
    """``standing``: what ``/healthz``, ``broker_main_leader`` and ``broker status`` say.
    Only a main that dispatches is the leader; elected but loading, it is still a
    standby (naming itself, as ``not_leader`` does); stepped down, it names no one."""
    assert standing(None, dispatching=False, address="a:1") == Standing(MainRole.LEADER, "a:1")
    e = Election("a", TIMING)
    assert standing(e, dispatching=False, address="a:1") == Standing(MainRole.STANDBY, None)
    e.elected("b", 1, "b:1", live=True, started=0.0)
    assert standing(e, dispatching=False, address="a:1") == Standing(MainRole.STANDBY, "b:1")
    e.elected("b", 1, "b:1", live=False, started=1.0)
    assert standing(e, dispatching=False, address="a:1") == Standing(MainRole.STANDBY, None)
    e.elected("a", 2, "a:1", live=True, started=2.0)
    assert standing(e, dispatching=False, address="a:1") == Standing(MainRole.STANDBY, "a:1")
    assert standing(e, dispatching=True, address="a:1") == Standing(MainRole.LEADER, "a:1")
    e.resigned()
    assert standing(e, dispatching=True, address="a:1") == Standing(MainRole.DEPOSED, None)


def test_a_standby_is_elected_when_the_row_is_free() -> None:
    row, e = Row(), Election("a", TIMING)
    [ask] = e.due(0.0)
    assert isinstance(ask, TryElect)
    assert e.due(0.1) == [], "one round at a time"
    assert answer(e, row, ask, 0.0) == [Lead(1)]
    assert e.phase is Phase.LEADER and e.epoch == 1 and e.lease_until == 3.0
    assert e.wake_at() == 1.0
    [renew] = e.due(1.0)
    assert renew == Renew(1, 1.0)
    assert answer(e, row, renew, 1.2) == []
    assert e.lease_until == 4.0, "counted from when the renewal was sent"


def test_a_standby_names_the_leader_and_waits() -> None:
    row, a, b = Row(), Election("a", TIMING), Election("b", TIMING)
    answer(a, row, a.due(0.0)[0], 0.0)  # type: ignore[arg-type]
    assert answer(b, row, b.due(0.0)[0], 0.0) == []  # type: ignore[arg-type]
    assert b.phase is Phase.STANDBY and b.leader == "a:7600"
    assert b.wake_at() == 0.5


def test_a_refused_renewal_steps_down_at_once() -> None:
    row, a, b = Row(), Election("a", TIMING), Election("b", TIMING)
    answer(a, row, a.due(0.0)[0], 0.0)  # type: ignore[arg-type]
    renew = a.due(1.0)[0]
    row.expires = 0.5  # the lease ran out in the store (say, a partition)
    assert answer(b, row, b.due(1.0)[0], 1.0) == [Lead(2)]  # type: ignore[arg-type]
    [down] = answer(a, row, renew, 1.1)  # type: ignore[arg-type]
    assert isinstance(down, StepDown) and down.epoch == 1 and "took over" in down.reason
    assert a.phase is Phase.DEPOSED and a.due(100.0) == [] and a.wake_at() == math.inf


def test_a_leader_that_cannot_renew_steps_down_when_its_lease_runs_out() -> None:
    row, a = Row(), Election("a", TIMING)
    answer(a, row, a.due(0.0)[0], 0.0)  # type: ignore[arg-type]
    assert isinstance(a.due(1.0)[0], Renew)
    a.failed()  # the store did not answer
    assert isinstance(a.due(2.0)[0], Renew)
    a.failed()
    [last] = a.due(3.0)  # the lease ran out by its clock: one more renewal, at once
    assert last == Renew(1, 3.0)
    assert a.due(3.5) == [], "its answer decides"
    a.failed()
    [down] = a.due(3.6)
    assert isinstance(down, StepDown) and "lease ran out" in down.reason


def test_a_starved_leader_keeps_the_lead_if_the_store_renews_it() -> None:
    row, a = Row(), Election("a", TIMING)
    answer(a, row, a.due(0.0)[0], 0.0)  # type: ignore[arg-type]
    [last] = a.due(3.5)  # its loop was stalled past the lease; nobody took over
    assert isinstance(last, Renew)
    row.expires = 10.0  # renewed by the store while the main was stalled
    assert answer(a, row, last, 3.6) == []
    assert a.phase is Phase.LEADER and a.lease_until == 6.5


def test_a_leader_paused_past_its_lease_keeps_the_lead_when_nobody_took_over() -> None:
    row, a = Row(), Election("a", TIMING)
    answer(a, row, a.due(0.0)[0], 0.0)  # type: ignore[arg-type]
    [last] = a.due(4.0)  # paused for 4 s: the lease ran out in the store too
    assert row.expires < 4.0
    assert answer(a, row, last, 4.1) == []
    assert a.phase is Phase.LEADER and a.lease_until == 7.0
    assert row.expires == pytest.approx(4.1 + TIMING.ttl)


def test_a_leader_paused_past_its_lease_steps_down_when_a_standby_took_over() -> None:
    row, a, b = Row(), Election("a", TIMING), Election("b", TIMING)
    answer(a, row, a.due(0.0)[0], 0.0)  # type: ignore[arg-type]
    assert answer(b, row, b.due(3.5)[0], 3.5) == [Lead(2)]  # type: ignore[arg-type]
    [last] = a.due(4.0)
    [down] = answer(a, row, last, 4.1)
    assert isinstance(down, StepDown) and "another main took over" in down.reason


def test_a_round_is_given_its_budget_in_running_time_not_in_stalls() -> None:
    """A step that took longer than planned was the loop's stall: only the plan counts, so
    an answer read after a long stall is used; a store that hangs runs the budget out."""
    budget = RoundBudget(1.0)
    assert budget.step == pytest.approx(0.1)
    assert not budget.waited(0.1, 20.0), "a 20 s stall costs one step"
    for _ in range(8):
        assert not budget.waited(0.1, 0.1)
    assert budget.waited(0.1, 0.1), "ten steps of running time: out of time"


def test_a_late_answer_of_the_last_chance_keeps_the_lead() -> None:
    """The lease ran out by this main's clock while it was stalled; its last renewal is
    answered late (after another stall): granted, it keeps leading, from when it was sent."""
    timing = Timing(6.0)
    election = Election("me", timing)
    election.due(0.0)
    election.elected("me", 1, "a:1", True, 0.0)
    [renew] = election.due(10.0)  # stalled past the lease: the last chance
    assert isinstance(renew, Renew)
    assert election.due(30.0) == [], "its answer decides, however late"
    assert election.renewed(renew.started, True) == []
    assert election.phase is Phase.LEADER
    assert election.lease_until == pytest.approx(10.0 + timing.ttl)


async def test_an_answer_that_came_during_a_stall_is_used_and_a_silent_store_times_out() -> None:
    """The shell's wait (``broker.main.election.within_running_time``) on a real socket: the answer
    arrives while the loop is blocked for ten times the budget, and is read when it runs
    again (``asyncio.timeout`` cancelled the read there: its timer and the socket became
    ready in the same pass); a peer that never answers runs the budget out."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=a)
    try:
        loop.call_soon(time.sleep, 0.5)  # blocks the loop once the read below is waiting
        loop.call_soon(b.send, b"granted\n")
        assert await within_running_time(reader.readline(), 0.05) == b"granted\n"
        started = loop.time()
        with pytest.raises(TimeoutError):
            await within_running_time(reader.readline(), 0.05)
        assert loop.time() - started < 5.0
    finally:
        writer.close()
        b.close()


def test_a_fenced_statement_steps_the_leader_down_once() -> None:
    row, a = Row(), Election("a", TIMING)
    answer(a, row, a.due(0.0)[0], 0.0)  # type: ignore[arg-type]
    assert [type(x) for x in a.fenced()] == [StepDown]
    assert a.fenced() == [], "already deposed"
    assert Election("b", TIMING).fenced() == [], "a standby has nothing to step down from"


@dataclass
class Sim:
    """Several mains, one row; each round reaches the store after ``delay`` seconds."""

    mains: list[Election]
    row: Row
    crashed: set[int]
    inflight: list[tuple[float, int, TryElect | Renew]]
    now: float = 0.0

    def leaders(self) -> list[int]:
        """The live mains sure to lead now, by their own clocks."""
        return [
            i
            for i, e in enumerate(self.mains)
            if i not in self.crashed and e.phase is Phase.LEADER and self.now < e.lease_until
        ]

    def deliver(self, until: float) -> None:
        """The rounds that reach the store by ``until``, in order of arrival."""
        self.inflight.sort(key=lambda x: x[0])
        while self.inflight and self.inflight[0][0] <= until:
            at, i, effect = self.inflight.pop(0)
            if i not in self.crashed:
                answer(self.mains[i], self.row, effect, max(at, self.now))

    def tick(self, who: int = -1, delay: float = 0.0, fail: bool = False) -> None:
        """Every live main does what is due; ``who``'s rounds take ``delay`` (or fail)."""
        for i, e in enumerate(self.mains):
            if i in self.crashed:
                continue
            for effect in e.due(self.now):
                if not isinstance(effect, TryElect | Renew):
                    continue
                if fail and i == who:
                    e.failed()
                else:
                    self.inflight.append((self.now + (delay if i == who else 0.0), i, effect))


@given(
    n=st.integers(2, 3),
    steps=st.lists(
        st.tuples(
            st.floats(0.01, 1.5),  # time passing
            st.integers(0, 2),  # which main acts
            st.floats(0.0, 4.0),  # its round's trip to the store
            st.sampled_from(["run", "run", "run", "crash", "fail"]),
        ),
        max_size=60,
    ),
)
def test_never_two_leaders_and_a_standby_takes_over(
    n: int, steps: list[tuple[float, int, float, str]]
) -> None:
    sim = Sim([Election(f"m{i}", TIMING) for i in range(n)], Row(), set(), [])
    for dt, who, delay, action in steps:
        sim.now += dt
        sim.deliver(sim.now)
        if action == "crash" and len(sim.crashed) < n - 1:
            sim.crashed.add(who % n)
        sim.tick(who % n, delay, fail=action == "fail")
        assert len(sim.leaders()) <= 1, (sim.now, [(e.phase, e.lease_until) for e in sim.mains])
    # Then the store answers at once and nothing fails: a live main leads within the
    # bound (after the longest lease a slow renewal may have left in the row), unless
    # every live main was deposed, to be restarted by its supervisor.
    sim.deliver(math.inf)
    start = sim.now
    while not sim.leaders():
        if all(e.phase is Phase.DEPOSED for i, e in enumerate(sim.mains) if i not in sim.crashed):
            return
        assert sim.now - start <= TIMING.failover_timeout + TIMING.ttl, "no takeover"
        sim.now += TIMING.poll_every / 5
        sim.tick()
        sim.deliver(sim.now)
