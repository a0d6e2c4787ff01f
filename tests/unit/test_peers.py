"""A connection's record in the main's handoff core (broker/core/peers.py) and the events
the transport reports about it: pings, pauses and writes. No socket, no loop, no sleep."""

from __future__ import annotations

import itertools

from broker.core.handoff import Handoff, Send
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
