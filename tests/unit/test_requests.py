"""A client request's counts in its connection's caps (:class:`broker.main.requests.Requests`):
taken as it starts, given back as it ends, however it ends."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from broker.core.handoff import Handoff
from broker.main.operations import Operations
from broker.main.queues import QueueControl
from broker.main.requests import Requests
from broker.main.sessions import Session
from broker.main.waits import Waits
from broker.wire import codec
from broker.wire import framing as wire
from broker.wire import messages as protocol


class _Writer:
    """A connection's writer that takes every line at once."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write_now(self, data: bytes) -> bool:
        self.lines.append(data)
        return True


def _session(writer: _Writer) -> Session:
    core = Handoff()
    return Session(
        state=core.new_peer(1, now=0.0),
        core=core,
        peer="test",
        writer=cast(wire.MessageWriter, writer),
        max_outbox_bytes=4 << 20,
        max_line_bytes=wire.MAX_LINE_BYTES,
        max_requests=2,
    )


def _requests(status: Any) -> Requests:
    """Requests that answer ``status`` alone (nothing else is asked here)."""
    return Requests(
        cast(Operations, None),
        max_in_progress=4,
        wake=lambda: None,
        stop_cancelled=lambda job: None,
        status=status,
        live_workers=lambda: (),
        queues=cast(QueueControl, None),
        waits=cast(Waits, None),
    )


async def test_a_request_counts_until_it_is_answered() -> None:
    writer = _Writer()
    session = _session(writer)
    answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def status() -> dict[str, Any]:
        return await answer

    requests = _requests(status)
    session.line_bytes = 100
    requests.start(session, protocol.Status(request_id="a"))
    session.line_bytes = 50
    requests.start(session, protocol.Status(request_id="b"))
    assert session.request_bytes == 150 and len(session.requests) == 2
    assert not session.readable.is_set()  # at the connection's cap of two
    tasks = list(session.requests)
    answer.set_result({"ok": True})
    await asyncio.wait(tasks)
    assert session.request_bytes == 0 and not session.requests
    assert session.readable.is_set()
    await asyncio.wait_for(requests.wait_idle(), 10)
    replies = [codec.decode(line) for line in writer.lines]
    assert {r.request_id for r in replies if isinstance(r, protocol.StatusInfo)} == {"a", "b"}


async def test_a_request_cancelled_gives_its_counts_back_whether_it_ran_or_not() -> None:
    """Cancelled before its first step, its coroutine never runs (nor its ``finally``):
    the task's done callback gives the counts back. Cancelled while it waits, its
    coroutine does, once."""
    writer = _Writer()
    session = _session(writer)
    never: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    entered = asyncio.Event()

    async def status() -> dict[str, Any]:
        entered.set()
        return await never

    requests = _requests(status)
    session.line_bytes = 100
    requests.start(session, protocol.Status(request_id="before"))
    [before] = session.requests
    before.cancel()
    await asyncio.wait([before])
    assert before.cancelled()
    assert session.request_bytes == 0 and not session.requests

    requests.start(session, protocol.Status(request_id="while"))
    [waiting] = session.requests
    await entered.wait()  # the request waits on the status
    waiting.cancel()
    await asyncio.wait([waiting])
    assert session.request_bytes == 0 and not session.requests
    await asyncio.wait_for(requests.wait_idle(), 10)
    assert writer.lines == []
