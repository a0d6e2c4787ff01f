"""One connection of the main, as the transport holds it: its outbox and back-pressure,
its requests in flight, and the views the main reads (:class:`Joined`, the connections
past their hello; :class:`Gathered`, messages batched per connection for one write).

What the connection means to the handoff is its :class:`broker.core.peers.Peer`
(``state``); a pause, a resume or a write goes to the core as an event
(:meth:`Session.written`, :meth:`Session.update_readable`), never as a write to the peer.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.core.handoff import Handoff, HandoffEffect
from broker.core.peers import Peer
from broker.wire import codec
from broker.wire import framing as wire
from broker.wire import messages as protocol

_WRITE_BATCH_BYTES = 256 << 10
"""A writer joins queued lines into one write up to about this size; bigger batches would
hold a second copy of the queue in memory."""


class RequestBytes:
    """The bytes of client requests in progress across all connections (their lines'
    lengths, a measure of what their decoded messages hold). At ``limit`` a connection
    with requests of its own in progress stops reading until the total is under it
    again; one with none still reads (its next request, and its pongs), so a few large
    requests never stall every client, nor get idle ones dropped for unanswered pings.
    The count cap per connection alone let 16 requests of 15 MiB on one connection
    hold hundreds of MiB."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self.waiting: set[Session] = set()
        """Connections not read because the total is at ``limit``."""

    @property
    def full(self) -> bool:
        return self.bytes >= self.limit

    def add(self, size: int) -> None:
        self.bytes += size

    def remove(self, size: int) -> None:
        self.bytes -= size
        if not self.full:
            for session in list(self.waiting):
                session.update_readable()


@dataclass(eq=False)
class Session:
    """One connection's transport. What the handoff knows of it (role, credits, leases,
    liveness) is its :class:`broker.core.peers.Peer`, ``state``, kept by :attr:`Main.handoff`.

    Everything the main sends goes through :meth:`send` into ``outbox``, which one writer
    task drains. Its size in bytes is what back-pressure acts on: over
    ``max_outbox_bytes`` the session is *paused* (no more jobs, and the main stops reading
    its messages) until half of it has been written.
    """

    state: Peer
    core: Handoff
    """The handoff core, told of this connection's pauses and resumes."""
    peer: str
    writer: wire.MessageWriter
    max_outbox_bytes: int
    max_line_bytes: int
    """The longest line the peer accepts (the main's cap, which its welcome announces)."""
    max_requests: int
    """Client requests this connection may have in progress before reading pauses."""
    max_request_bytes: int = 1 << 62
    """Bytes of this connection's requests in progress (their lines) before reading pauses."""
    read_ahead: RequestBytes | None = None
    """The bytes of every connection's requests in progress (:class:`RequestBytes`)."""
    line_bytes: int = 0
    """The length of the line just read: what a request it starts is counted as."""
    request_bytes: int = 0
    """Bytes of this connection's requests in progress."""
    host: str | None = None
    rights: frozenset[protocol.Role] = frozenset()
    """The roles whose requests this connection may make, set at its hello
    (:meth:`broker.wire.credentials.Credentials.rights`)."""
    reported_status: dict[str, Any] | None = None
    """The worker's last ``worker_status`` (its runners' capacity and start-up errors)."""
    closed: bool = False
    dropped: bool = False
    """The main judged the peer dead and aborted the connection; stop reading it."""
    errors: int = 0
    outbox: deque[bytes] = field(default_factory=deque)
    outbox_bytes: int = 0
    """Queued bytes, plus those of the write in progress until it has drained."""
    requests: set[asyncio.Task[None]] = field(default_factory=set)
    """This connection's client requests in progress (cancelled when it closes)."""
    readable: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while the main may read this connection's next message."""
    _queued: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        self.readable.set()

    # What the main routes every message by, read-only here (only the core changes it);
    # the rest of the handoff's view is read from ``state``.
    @property
    def id(self) -> int:
        return self.state.id

    @property
    def role(self) -> protocol.Role | None:
        return self.state.role

    @property
    def worker_id(self) -> str | None:
        return self.state.worker_id

    def summary(self) -> dict[str, Any]:
        """This worker as ``broker status`` shows it: what the handoff knows of it, and the
        capacity and start-up errors its last ``worker_status`` reported."""
        reported = self.reported_status or {}
        runners = reported.get("runners")
        runners = runners if isinstance(runners, dict) else {}
        capacity: dict[str, Any] = {}
        busy: dict[str, Any] = {}
        startup_errors: dict[str, Any] = {}
        for mode, runner in runners.items():
            if not isinstance(runner, dict):
                continue
            capacity[mode] = runner.get("capacity")
            busy[mode] = runner.get("busy")
            if runner.get("startup_error"):
                startup_errors[mode] = runner["startup_error"]
        peer = self.state
        return {
            "session": peer.id,
            "worker_id": peer.worker_id,
            "host": self.host,
            "modes": sorted(m.value for m in peer.modes),
            "queues": sorted(peer.queues) if peer.queues is not None else None,
            "draining": peer.draining,
            "in_flight": len(peer.leases),
            "in_flight_by_mode": self._in_flight_by_mode(),
            # What the worker has free, the spare kept for a leading job included.
            "credits": {m.value: peer.credits.available(m, leading=True) for m in peer.modes},
            "capacity": capacity,
            "busy": busy,
            "startup_errors": startup_errors,
            "status_reported": self.reported_status is not None,
        }

    def _in_flight_by_mode(self) -> dict[str, int]:
        """The leases held, by the execution mode of their jobs (every mode it serves,
        zeros included): with ``credits`` and ``capacity``, figures that add up by mode."""
        counts = {m.value: 0 for m in self.state.modes}
        for job in self.state.leases.values():
            mode = job.execution_mode.value
            counts[mode] = counts.get(mode, 0) + 1
        return counts

    def send(self, msg: protocol.Message) -> None:
        """Queue a message for this connection's writer task; never blocks the caller, so
        one slow peer cannot stall dispatch to the others."""
        if self.closed:
            return
        self._queue(codec.encode(msg))

    def reply(self, msg: protocol.Message) -> None:
        """Send a request's answer, at once if it can (:meth:`_write_or_queue`)."""
        if self.closed:
            return
        self._write_or_queue(codec.encode(msg))

    def send_batch(self, kind: type[protocol.Batch], msgs: Sequence[protocol.Message]) -> None:
        """Send ``msgs`` (the messages a ``kind`` batch carries) in as few lines as the
        line limit allows, each message encoded once (:func:`broker.wire.codec.pack`): the
        first at once if it can (:meth:`_write_or_queue`), so a job handed off reaches its
        worker in the dispatcher's own loop turn, not one turn later in the writer task's
        (a turn that waits behind every callback ready meanwhile: a settled batch's, a
        claim's, the reports read; bench/README.md, "urgent2")."""
        if self.closed or not msgs:
            return
        limit = min(self.max_line_bytes, wire.BATCH_LINE_BYTES)
        for line in codec.pack(kind, [codec.encode_item(msg) for msg in msgs], limit):
            self._write_or_queue(line)

    def _write_or_queue(self, data: bytes) -> None:
        """Write ``data`` (whole lines) at once when nothing is queued or being written,
        which spares the writer task a wake-up; queue it as :meth:`send` does otherwise,
        behind what is already queued. A long one (over a batch line) always goes through
        the outbox, whose size back-pressure and the liveness checks watch."""
        if (
            self.outbox_bytes
            or len(data) > wire.BATCH_LINE_BYTES
            or not self.writer.write_now(data)
        ):
            self._queue(data)

    def _queue(self, data: bytes) -> None:
        self.outbox.append(data)
        self.outbox_bytes += len(data)
        self._queued.set()
        if not self.state.paused and self.outbox_bytes > self.max_outbox_bytes:
            self.core.paused(self.state, asyncio.get_running_loop().time())
            self.update_readable()

    async def next_write(self) -> bytes:
        """The next lines to write, joined: all that is queued, up to about 256 KiB."""
        while not self.outbox:
            self._queued.clear()
            await self._queued.wait()
        chunks = [self.outbox.popleft()]
        size = len(chunks[0])
        while self.outbox and size < _WRITE_BATCH_BYTES:
            chunks.append(self.outbox.popleft())
            size += len(chunks[-1])
        return b"".join(chunks)

    def written(self, size: int) -> list[HandoffEffect]:
        """``size`` bytes have left the outbox; a pause ends once half the cap is free,
        with the core's effects of that (a wake when a worker can take jobs again)."""
        self.outbox_bytes -= size
        if not self.state.paused or self.outbox_bytes > self.max_outbox_bytes // 2:
            return []
        effects = self.core.resumed(self.state)
        self.update_readable()
        return effects

    def add_request(self, task: asyncio.Task[None]) -> int:
        """Count a request in progress, as many bytes as the line that carried it; those
        bytes, which :meth:`request_done` takes back once it ends (the caller's to tell:
        :class:`broker.main.requests.Requests` does as the request's coroutine ends,
        with no done callback's loop turn)."""
        size = self.line_bytes
        self.requests.add(task)
        self.request_bytes += size
        if self.read_ahead is not None:
            self.read_ahead.add(size)
        self.update_readable()
        return size

    def request_done(self, task: asyncio.Task[None], size: int) -> None:
        self.requests.discard(task)
        self.request_bytes -= size
        self.update_readable()
        if self.read_ahead is not None:
            self.read_ahead.remove(size)

    def update_readable(self) -> None:
        """Let the read loop read on, or not: it waits while the outbox is over its cap,
        and while this connection's requests in progress are at their caps (count or
        bytes) or, with some in progress, all connections' are at theirs."""
        paused = self.state.paused
        total = self.read_ahead
        waiting = bool(self.requests) and total is not None and total.full
        if total is not None and waiting and not self.dropped:
            total.waiting.add(self)
        elif total is not None:
            total.waiting.discard(self)
        if self.dropped or (
            not paused
            and not waiting
            and len(self.requests) < self.max_requests
            and self.request_bytes < self.max_request_bytes
        ):
            self.readable.set()
        else:
            self.readable.clear()

    def abort(self) -> None:
        """Drop the connection now, unsent data and all; the read loop ends at once."""
        self.dropped = True
        self.writer.abort()
        self.update_readable()


class Joined(Mapping[int, Session]):
    """The connections past their hello, by id: the handoff core's peers (the one registry
    of who has joined, :attr:`Handoff.peers <broker.core.handoff.Handoff.peers>`), each
    seen through its transport. A peer joins and leaves in the core alone, so nothing here
    is kept in step with it by hand."""

    def __init__(self, peers: Mapping[int, Peer], open_sessions: Mapping[int, Session]) -> None:
        self._peers = peers
        self._open = open_sessions

    def __getitem__(self, peer_id: int) -> Session:
        if peer_id not in self._peers:
            raise KeyError(peer_id)
        return self._open[peer_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._peers)

    def __len__(self) -> int:
        return len(self._peers)


class Gathered:
    """The messages one batch of effects sends each peer, joined into batch lines.

    Jobs and acknowledgements are gathered per peer and sent as ``jobs`` and
    ``report_acks`` lines by :meth:`send_all`; any other message for a peer first sends
    what was gathered for it, so each peer still receives its messages in order.
    """

    def __init__(self, sessions: Mapping[int, Session]) -> None:
        self._sessions = sessions
        self._gathered: dict[int, tuple[type[protocol.Batch], list[protocol.Message]]] = {}

    def add(self, peer: int, kind: type[protocol.Batch], msg: protocol.Message) -> None:
        if peer in self._gathered and self._gathered[peer][0] is not kind:
            self._send_gathered(peer)
        self._gathered.setdefault(peer, (kind, []))[1].append(msg)

    def send(self, peer: int, msg: protocol.Message) -> None:
        self._send_gathered(peer)
        if (session := self._sessions.get(peer)) is not None:
            session.send(msg)

    def drop(self, peer: int) -> None:
        """Forget what was gathered for ``peer`` (its connection is being aborted)."""
        self._gathered.pop(peer, None)

    def send_all(self) -> None:
        for peer in list(self._gathered):
            self._send_gathered(peer)

    def _send_gathered(self, peer: int) -> None:
        batch = self._gathered.pop(peer, None)
        if batch is not None and (session := self._sessions.get(peer)) is not None:
            session.send_batch(*batch)
