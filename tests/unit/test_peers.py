"""A connection's record in the main's handoff core (broker/core/peers.py) and the events
the transport reports about it: pings, pauses and writes. No socket, no sleep."""

from __future__ import annotations

import itertools
from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.core.handoff import Abort, Handoff, HandoffEffect, Send, WakeDispatcher
from broker.core.peers import Peer
from broker.jobs import ExecutionMode
from broker.main.sessions import Session
from broker.wire import codec
from broker.wire import framing as wire
from broker.wire import messages as protocol


def test_the_ping_nonces_come_from_the_injected_base() -> None:
    bases = itertools.count(1000, 1000)
    core = Handoff(new_ping_base=lambda: next(bases))
    first, second = core.new_peer(1, now=0.0), core.new_peer(2, now=0.0)
    assert (first.liveness.ping_base, second.liveness.ping_base) == (1000, 2000)
    core.hello(first, protocol.Hello(role=protocol.Role.CLIENT, protocol=protocol.PROTOCOL_VERSION))
    assert core.tick(1.0, stall=0.0, timeout=15.0, ping=True) == [
        Send(1, protocol.Ping(nonce=1001))
    ]
    core.pong(1, 1000, now=20.0)  # not one of ours: proves nothing
    assert core.peers[1].liveness.problem(20.0, timeout=15.0) is not None
    core.pong(1, 1001, now=20.0)
    assert core.peers[1].liveness.problem(20.0, timeout=15.0) is None


POOLED = ExecutionMode.POOLED


def _hello(role: protocol.Role) -> protocol.Hello:
    worker = role is protocol.Role.WORKER
    return protocol.Hello(
        role=role,
        protocol=protocol.PROTOCOL_VERSION,
        worker_id="w" if worker else None,
        modes=[POOLED] if worker else [],
    )


def _joined(core: Handoff, peer_id: int = 1, role: protocol.Role = protocol.Role.WORKER) -> Peer:
    peer = core.new_peer(peer_id, now=0.0)
    core.hello(peer, _hello(role))
    if role is protocol.Role.WORKER:
        core.ready(peer_id, {POOLED: 2}, seen=0)
    return peer


def test_a_paused_worker_takes_no_jobs_and_its_resume_wakes_the_dispatcher() -> None:
    core = Handoff()
    peer = _joined(core)
    assert core.credit(POOLED) == 2
    [sent] = core.tick(1.0, stall=0.0, timeout=15.0, ping=True)
    core.paused(peer, 5.0)
    assert not peer.dispatchable and core.credit(POOLED) == 0 and core.workers() == []
    core.paused(peer, 7.0)  # still over its cap: the pause dates from the first
    assert isinstance(sent, Send) and isinstance(sent.message, protocol.Ping)
    core.pong(1, sent.message.nonce, now=20.5)  # alive, but not reading enough
    assert core.tick(20.5, stall=0.0, timeout=15.0, ping=False) == [
        Abort(1, "over its outbox limit for 15.5 s")
    ]
    assert core.resumed(peer) == [WakeDispatcher()]
    assert peer.dispatchable and core.credit(POOLED) == 2
    assert core.resumed(peer) == [], "not paused: nothing became dispatchable"


def test_a_resume_forgets_the_modes_proven_drained() -> None:
    """The proof was made while the paused worker was not served: the queues only it
    serves were not read, so the dispatcher must read them again."""
    core = Handoff()
    peer = _joined(core)
    core.paused(peer, 0.0)
    _joined(core, 2)
    core.read_eligible(core.queue_changes, [POOLED], full=False, queues=core.served_queues())
    assert core.drained == {POOLED}
    core.resumed(peer)
    assert core.drained == frozenset()


@pytest.mark.parametrize(
    "setup",
    ["client", "draining", "before hello", "after disconnect"],
)
def test_a_resume_wakes_nothing_when_no_worker_became_dispatchable(setup: str) -> None:
    core = Handoff()
    if setup == "client":
        peer = _joined(core, role=protocol.Role.CLIENT)
    elif setup == "before hello":
        peer = core.new_peer(1, now=0.0)
    else:
        peer = _joined(core)
    if setup == "draining":
        core.draining(1)
    core.paused(peer, 0.0)
    if setup == "after disconnect":
        core.disconnect(1, 1.0)
    drained = core.drained
    assert core.resumed(peer) == []
    assert not peer.paused and core.drained == drained


def test_a_write_stuck_for_the_timeout_drops_the_peer_and_an_ended_one_does_not() -> None:
    core = Handoff()
    peer = _joined(core)
    [sent] = core.tick(0.5, stall=0.0, timeout=15.0, ping=True)
    core.write_started(peer, 1.0)
    assert peer.dispatchable, "a write in progress does not stop dispatch"
    assert isinstance(sent, Send) and isinstance(sent.message, protocol.Ping)
    core.pong(1, sent.message.nonce, now=16.5)  # alive, but not reading
    assert core.tick(16.5, stall=0.0, timeout=15.0, ping=False) == [
        Abort(1, "a write has not completed for 15.5 s")
    ]
    core.write_ended(peer)
    assert core.tick(16.5, stall=0.0, timeout=15.0, ping=False) == []


EVENTS = st.sampled_from(["pause", "resume", "write started", "write ended", "drain"])


@given(st.lists(EVENTS, max_size=12))
def test_the_transports_events_wake_the_dispatcher_exactly_when_a_worker_can_take_jobs_again(
    events: list[str],
) -> None:
    core = Handoff()
    peer = _joined(core)
    now = 0.0
    for name in events:
        now += 1.0
        before = peer.dispatchable
        effects: list[HandoffEffect] = []
        if name == "pause":
            core.paused(peer, now)
        elif name == "resume":
            effects = core.resumed(peer)
        elif name == "write started":
            core.write_started(peer, now)
        elif name == "write ended":
            core.write_ended(peer)
        else:
            effects = core.draining(1)
        woke = effects == [WakeDispatcher()]
        assert woke == (not before and peer.dispatchable), (name, effects)
        assert not effects or woke


async def test_a_session_over_its_outbox_cap_pauses_and_half_written_resumes() -> None:
    """The transport's side: it counts the outbox and tells the core; reading stops with
    the pause, and the resume's wake comes back for the main to carry."""
    core = Handoff()
    peer = _joined(core)
    line = protocol.Error(code="x", message="y" * 40, fatal=False)
    size = len(codec.encode(line))
    session = Session(
        state=peer,
        core=core,
        peer="test",
        writer=cast(wire.MessageWriter, None),  # nothing is written here
        max_outbox_bytes=2 * size,
        max_line_bytes=wire.MAX_LINE_BYTES,
        max_requests=10,
    )
    session.send(line)
    session.send(line)
    assert not peer.paused and session.readable.is_set()
    session.send(line)
    assert peer.paused and not peer.dispatchable and not session.readable.is_set()
    assert session.written(size) == [], "still over half the cap"
    assert session.written(size) == [WakeDispatcher()]
    assert peer.dispatchable and session.readable.is_set()


def test_a_stall_of_the_main_is_not_held_against_a_silent_paused_or_writing_peer() -> None:
    """While the main's loop could not run it could neither read pongs nor write: the
    stall's length is excused from each clock the liveness check judges by."""
    core = Handoff()
    peer = _joined(core)
    core.paused(peer, 1.0)
    core.write_started(peer, 1.0)
    assert core.tick(30.0, stall=20.0, timeout=15.0, ping=False) == [], "all three excused"
    assert core.tick(35.5, stall=0.0, timeout=15.0, ping=False) == [
        Abort(1, "no answer to pings for 15.5 s")
    ]
