from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from broker.core.handoff import Handoff
from broker.exceptions import ProtocolError
from broker.main.sessions import Session
from broker.wire import codec
from broker.wire import framing as wire
from broker.wire import messages as p


def feed(data: bytes, *, eof: bool = True, limit: int = wire.STREAM_LIMIT) -> wire.LineReader:
    stream = asyncio.StreamReader(limit=limit)
    stream.feed_data(data)
    if eof:
        stream.feed_eof()
    return wire.LineReader(stream, max_line_bytes=min(limit, wire.PREAUTH_MAX_LINE_BYTES))


@asynccontextmanager
async def connected(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A real loopback TCP connection: yields the client end, runs ``handler`` on the server."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0, limit=wire.STREAM_LIMIT)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=wire.STREAM_LIMIT)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        server.close()
        await server.wait_closed()


# --------------------------------------------------------------------------- LineReader


async def test_reads_lines_and_returns_none_at_clean_eof() -> None:
    reader = feed(b'{"a":1}\n\n  \r\n{"b":2}\r\n')
    assert await reader.read_line() == b'{"a":1}'
    assert await reader.read_line() == b'{"b":2}\r'  # JSON ignores the \r; blank lines skipped
    assert await reader.read_line() is None
    assert await reader.read_line() is None


async def test_empty_stream_is_clean_eof() -> None:
    assert await feed(b"").read_line() is None


async def test_unterminated_last_line_raises() -> None:
    reader = feed(b'{"type":"ping","nonce":1}\n{"type":"ping","no')
    assert await reader.read_line() == b'{"type":"ping","nonce":1}'
    with pytest.raises(wire.UnterminatedLineError) as info:
        await reader.read_line()
    assert isinstance(info.value, ProtocolError)
    assert info.value.code == p.ErrorCode.UNTERMINATED


async def test_line_exactly_at_the_cap_is_accepted() -> None:
    reader = feed(b"x" * 100 + b"\n")
    reader.max_line_bytes = 100
    assert await reader.read_line() == b"x" * 100


async def test_line_over_the_cap_raises_even_below_the_stream_limit() -> None:
    reader = feed(b"x" * 101 + b"\n")
    reader.max_line_bytes = 100
    with pytest.raises(wire.LineTooLongError) as info:
        await reader.read_line()
    assert info.value.code == p.ErrorCode.LINE_TOO_LONG


async def test_line_over_the_stream_limit_raises_without_waiting_for_a_newline() -> None:
    # No newline and no EOF: readuntil's LimitOverrunError must be mapped, not waited out.
    reader = feed(b"x" * 300, eof=False, limit=256)
    reader.max_line_bytes = 256
    with pytest.raises(wire.LineTooLongError):
        await asyncio.wait_for(reader.read_line(), 1)


async def test_preauth_cap_is_the_default_and_raising_it_admits_larger_lines() -> None:
    big = b"y" * (wire.PREAUTH_MAX_LINE_BYTES + 10)
    reader = feed(b"small\n" + big + b"\n" + big + b"\n")
    assert reader.max_line_bytes == wire.PREAUTH_MAX_LINE_BYTES
    assert await reader.read_line() == b"small"
    with pytest.raises(wire.LineTooLongError):
        await reader.read_line()

    reader = feed(b"small\n" + big + b"\n")
    assert await reader.read_line() == b"small"
    reader.max_line_bytes = wire.MAX_LINE_BYTES  # the peer authenticated
    assert await reader.read_line() == big


async def test_cap_may_exceed_the_stream_limit_but_not_be_zero() -> None:
    # The stream's limit is only its read-ahead: a small one (cheap before authentication)
    # still admits lines up to a cap raised later.
    reader = feed(b"x" * 5000 + b"\n", limit=1000)
    reader.max_line_bytes = 5000
    assert await reader.read_line() == b"x" * 5000
    with pytest.raises(ValueError, match="positive"):
        reader.max_line_bytes = 0


async def test_tiny_fragments_are_reassembled() -> None:
    msgs = [p.Ping(nonce=i) for i in range(50)] + [p.Error("internal", "é" * 300, fatal=False)]
    data = b"".join(codec.encode(m) for m in msgs)
    stream = asyncio.StreamReader(limit=wire.STREAM_LIMIT)
    reader = wire.LineReader(stream)

    async def dribble() -> None:
        rng = random.Random(1)
        i = 0
        while i < len(data):
            n = rng.randint(1, 3)
            stream.feed_data(data[i : i + n])
            i += n
            await asyncio.sleep(0)
        stream.feed_eof()

    task = asyncio.create_task(dribble())
    got = []
    while (msg := await wire.read_message(reader)) is not None:
        got.append(msg)
    await task
    assert got == msgs


async def test_tiny_fragments_over_a_real_socket() -> None:
    msgs = [p.Ping(nonce=i) for i in range(20)]
    data = b"".join(codec.encode(m) for m in msgs)
    received: asyncio.Future[list[p.Message]] = asyncio.get_running_loop().create_future()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        reader = wire.LineReader(r)
        got = []
        while (msg := await wire.read_message(reader)) is not None:
            got.append(msg)
        received.set_result(got)
        w.close()

    async with connected(handler) as (_, writer):
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rng = random.Random(2)
        i = 0
        while i < len(data):
            n = rng.randint(1, 3)
            writer.write(data[i : i + n])
            await writer.drain()
            await asyncio.sleep(0.0005)
            i += n
        writer.write_eof()
        assert await asyncio.wait_for(received, 10) == msgs


async def test_unterminated_line_over_a_real_socket() -> None:
    outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        reader = wire.LineReader(r)
        try:
            await wire.read_message(reader)
            await wire.read_message(reader)
        except ProtocolError as exc:
            outcome.set_result(exc)
        else:
            outcome.set_result(None)
        w.close()

    async with connected(handler) as (_, writer):
        writer.write(codec.encode(p.Ping(nonce=1)) + b'{"type":"pi')
        await writer.drain()
        writer.write_eof()
        assert isinstance(await asyncio.wait_for(outcome, 10), wire.UnterminatedLineError)


async def test_read_message_decodes_and_propagates_decode_errors() -> None:
    reader = feed(b'{"type":"pong","nonce":4}\n{"type":"pong"}\n')
    assert await wire.read_message(reader) == p.Pong(nonce=4)
    with pytest.raises(codec.DecodeError, match=r"pong\.nonce is required"):
        await wire.read_message(reader)
    assert await wire.read_message(reader) is None


# --------------------------------------------------------------------------- MessageWriter


async def test_concurrent_senders_never_interleave_lines() -> None:
    senders, per_sender = 40, 25
    # Lines larger than the socket buffers force partial writes and real drain() waits.
    payload = "z" * 40_000
    done: asyncio.Future[list[p.Message]] = asyncio.get_running_loop().create_future()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        reader = wire.LineReader(r, max_line_bytes=wire.MAX_LINE_BYTES)
        got = []
        try:
            while (msg := await wire.read_message(reader)) is not None:
                got.append(msg)
                if len(got) % 97 == 0:
                    await asyncio.sleep(0.001)  # a slow reader keeps the writer's buffer full
        except ProtocolError as exc:
            done.set_exception(exc)
        else:
            done.set_result(got)
        w.close()

    async with connected(handler) as (_, raw_writer):
        writer = wire.MessageWriter(raw_writer)

        async def sender(s: int) -> None:
            for i in range(per_sender):
                msg = p.Error(code=f"{s}:{i}", message=payload, fatal=False)
                if i % 5 == 0:
                    await writer.send_many([msg, p.Ping(nonce=s * 1000 + i)])
                else:
                    await writer.send(msg)

        await asyncio.gather(*(sender(s) for s in range(senders)))
        raw_writer.write_eof()
        got = await asyncio.wait_for(done, 30)

    errors = [m for m in got if isinstance(m, p.Error)]
    assert len(errors) == senders * per_sender
    assert all(m.message == payload for m in errors)
    for s in range(senders):  # each sender's own messages arrive in the order it sent them
        mine = [int(m.code.split(":")[1]) for m in errors if m.code.startswith(f"{s}:")]
        assert mine == list(range(per_sender))
    pings = [m for m in got if isinstance(m, p.Ping)]
    assert len(pings) == senders * per_sender // 5


async def test_send_many_of_nothing_writes_nothing() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    async with connected(handler) as (_, raw_writer):
        await wire.MessageWriter(raw_writer).send_many([])


async def test_unencodable_message_sends_nothing() -> None:
    received: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        reader = wire.LineReader(r)
        lines = []
        while (line := await reader.read_line()) is not None:
            lines.append(line)
        received.set_result(lines)
        w.close()

    async with connected(handler) as (_, raw_writer):
        writer = wire.MessageWriter(raw_writer)
        bad = p.CompletedReport(uuid.uuid4(), uuid.uuid4(), result={1})
        with pytest.raises(ValueError, match="cannot encode"):
            await writer.send_many([p.Ping(nonce=1), bad])
        await writer.send(p.Ping(nonce=2))
        raw_writer.write_eof()
        assert await asyncio.wait_for(received, 10) == [codec.encode(p.Ping(nonce=2)).rstrip()]


async def test_write_raw_takes_whole_lines_only() -> None:
    received: asyncio.Future[list[p.Message]] = asyncio.get_running_loop().create_future()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        reader = wire.LineReader(r)
        got = []
        while (msg := await wire.read_message(reader)) is not None:
            got.append(msg)
        received.set_result(got)
        w.close()

    async with connected(handler) as (_, raw_writer):
        writer = wire.MessageWriter(raw_writer)
        with pytest.raises(ValueError, match="whole lines"):
            await writer.write_raw(b'{"type":"ping","nonce":1}')
        await writer.write_raw(codec.encode(p.Ping(nonce=2)) + codec.encode(p.Pong(nonce=3)))
        raw_writer.write_eof()
        assert await asyncio.wait_for(received, 10) == [p.Ping(nonce=2), p.Pong(nonce=3)]


async def test_close_is_idempotent_and_send_after_close_raises() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read()
        w.close()

    async with connected(handler) as (_, raw_writer):
        writer = wire.MessageWriter(raw_writer)
        assert not writer.is_closing
        await writer.send(p.Ping(nonce=1))
        await writer.close()
        assert writer.is_closing
        await writer.close()
        with pytest.raises(ConnectionResetError):
            await writer.send(p.Ping(nonce=2))


async def test_close_swallows_a_reset_connection() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        sock = w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.transport.abort()  # RST instead of FIN

    async with connected(handler) as (reader, raw_writer):
        with contextlib.suppress(ConnectionError):
            await reader.read()  # wait for the reset to arrive
        writer = wire.MessageWriter(raw_writer)
        await writer.close()
        assert writer.is_closing


async def test_close_aborts_when_the_peer_never_reads() -> None:
    stop = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await stop.wait()  # never reads: the client's send buffer fills up
        w.close()

    async with connected(handler) as (_, raw_writer):
        writer = wire.MessageWriter(raw_writer)
        raw_writer.write(b"x" * 50_000_000)  # more than any socket buffer holds
        await asyncio.wait_for(writer.close(grace=0.2), 5)
        assert writer.is_closing
        stop.set()


async def test_write_now_writes_at_once_only_when_nothing_is_unsent() -> None:
    reading = asyncio.Event()
    received: asyncio.Future[list[p.Message]] = asyncio.get_running_loop().create_future()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await reading.wait()  # until then the client's lines pile up unread
        reader = wire.LineReader(r, max_line_bytes=wire.MAX_LINE_BYTES)
        got = []
        while (msg := await wire.read_message(reader)) is not None:
            got.append(msg)
        received.set_result(got)
        w.close()

    async with connected(handler) as (_, raw_writer):
        writer = wire.MessageWriter(raw_writer)
        assert writer.write_now(codec.encode(p.Ping(nonce=1)))
        big = codec.encode(p.Error(code="big", message="z" * 900_000, fatal=False))
        while raw_writer.transport.get_write_buffer_size() == 0:  # the socket buffers fill
            assert writer.write_now(big)
        assert not writer.write_now(codec.encode(p.Ping(nonce=2)))  # it would pile up unsent
        reading.set()
        await writer.send(p.Ping(nonce=3))
        raw_writer.write_eof()
        got = await asyncio.wait_for(received, 30)
    pings = [m.nonce for m in got if isinstance(m, p.Ping)]
    assert pings == [1, 3] and got[0] == p.Ping(nonce=1)


async def _what_the_peer_reads(send: Callable[[Session], None]) -> list[p.Message]:
    """The messages a peer reads after ``send`` used a main's session on its connection,
    and the session's writer task (played here) wrote what ``send`` left queued."""
    received: asyncio.Future[list[p.Message]] = asyncio.get_running_loop().create_future()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        reader = wire.LineReader(r, max_line_bytes=wire.MAX_LINE_BYTES)
        got = []
        while (msg := await wire.read_message(reader)) is not None:
            got.append(msg)
        received.set_result(got)
        w.close()

    async with connected(handler) as (_, raw_writer):
        core = Handoff()
        session = Session(
            state=core.new_peer(1, now=0.0),
            core=core,
            peer="test",
            writer=wire.MessageWriter(raw_writer),
            max_outbox_bytes=4 << 20,
            max_line_bytes=wire.MAX_LINE_BYTES,
            max_requests=10,
        )
        send(session)
        while session.outbox:  # what the writer task does
            data = await session.next_write()
            await session.writer.write_raw(data)
            session.written(len(data))
        raw_writer.write_eof()
        return await asyncio.wait_for(received, 30)


async def test_a_reply_goes_out_at_once_unless_it_is_long_or_lines_are_queued() -> None:
    long = p.Error(code="long", message="z" * wire.BATCH_LINE_BYTES, fatal=False)

    def send(session: Session) -> None:
        session.reply(p.Pong(nonce=1))
        assert not session.outbox  # written at once: no wake-up of the writer task
        session.reply(long)
        assert len(session.outbox) == 1  # through the outbox, which back-pressure watches
        session.reply(p.Pong(nonce=2))
        assert len(session.outbox) == 2  # behind what is queued

    assert await _what_the_peer_reads(send) == [p.Pong(nonce=1), long, p.Pong(nonce=2)]


async def test_a_batch_goes_out_at_once_unless_lines_are_queued() -> None:
    """A ``report_acks`` (or ``jobs``) line is written in the caller's own loop turn when
    the connection's outbox is empty, not one turn later by the writer task; behind a
    queued line it queues, so the peer still receives every line in order."""

    def ack() -> p.ReportAck:
        return p.ReportAck(job_id=uuid.uuid4(), handoff_id=uuid.uuid4(), status=p.AckStatus.APPLIED)

    first, second = [ack(), ack()], [ack()]

    def send(session: Session) -> None:
        session.send_batch(p.ReportAcks, first)
        assert not session.outbox  # written at once: no wake-up of the writer task
        session.send(p.Ping(nonce=1))
        assert len(session.outbox) == 1
        session.send_batch(p.ReportAcks, second)
        assert len(session.outbox) == 2  # behind what is queued

    got = await _what_the_peer_reads(send)
    assert got == [p.ReportAcks(acks=first), p.Ping(nonce=1), second[0]]  # one goes alone
