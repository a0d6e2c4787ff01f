"""NDJSON framing over asyncio streams: whole lines in, whole lines out, or an error.

``StreamReader.readline()`` is unsafe for a network peer: on an oversized line it
drops the buffer and carries on mid-line, and at EOF it hands back a partial line
(see ``docs/protocol.md``, "Framing"). :class:`LineReader` reads chunks and splits
lines itself, and turns both cases into a :class:`~broker.exceptions.ProtocolError`
after which the caller closes the connection; it never resynchronises and never
returns half a line.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Protocol

from broker.exceptions import ProtocolError
from broker.model.bounds import PREAUTH_MAX_LINE_BYTES
from broker.wire.codec import HEAD_BYTES, decode, encode
from broker.wire.messages import Challenge, Error, ErrorCode, Message

MAX_LINE_BYTES = 1024 * 1024
"""The cap once authenticated; it bounds a job's arguments and a job's result."""

STREAM_LIMIT = MAX_LINE_BYTES
"""A ``limit=`` for ``asyncio.start_server``/``open_connection``. The stream's limit is only
its read-ahead (asyncio stops reading the socket once about twice the limit is buffered);
:class:`LineReader` enforces line caps itself, so any limit works with any cap."""

BATCH_LINE_BYTES = 256 * 1024
"""Where a batch line (``jobs``, ``reports``, ``report_acks``) is cut, below the line cap:
past a few hundred messages a bigger line saves nothing, and the peer could act on
the first of them sooner. A single message longer than this still goes alone."""

READ_CHUNK_BYTES = 64 * 1024
"""How much :class:`LineReader` takes from the stream at a time."""


class LineTooLongError(ProtocolError):
    """The peer sent a line longer than allowed; the connection is closed."""

    code: str = ErrorCode.LINE_TOO_LONG


class TooManyContainersError(ProtocolError):
    """The peer sent a line with more ``[`` and ``{`` than :attr:`LineReader.max_containers`.

    Not fatal: the line was read to its end and dropped as it came, so the stream is at a
    line boundary again, and the line never took more memory than a read. ``head`` is
    its first :data:`~broker.wire.codec.HEAD_BYTES`, from which the main says whose it was
    (:func:`broker.wire.codec.container_refusal`)."""

    code: str = ErrorCode.PAYLOAD_TOO_LARGE

    def __init__(self, head: bytes) -> None:
        super().__init__("the line holds too many lists and objects")
        self.head = head


class UnterminatedLineError(ProtocolError):
    """The peer closed the connection in the middle of a line; the partial line is dropped."""

    code: str = ErrorCode.UNTERMINATED


class LineReader:
    """Reads newline-terminated lines with a cap that can be raised after authentication.

    The lines are assembled here, from chunks of at most :data:`READ_CHUNK_BYTES`, rather
    than with ``StreamReader.readuntil``: ``readuntil`` measures lines against the
    stream's ``limit``, which is fixed when the stream is created, so a stream made for
    the post-authentication cap (2 MiB) would let an unauthenticated peer make it buffer
    that much before its line were refused. Here the cap in force is checked as bytes
    arrive, so before authentication a connection holds at most the pre-auth cap plus one
    byte in this buffer, plus the stream's own read-ahead (up to twice its ``limit``, plus
    one socket read of up to 256 KiB); raising the cap after ``welcome`` takes effect at
    once, whatever limit the stream was created with.
    """

    def __init__(
        self, reader: asyncio.StreamReader, max_line_bytes: int = PREAUTH_MAX_LINE_BYTES
    ) -> None:
        self._reader = reader
        self._buffer = bytearray()
        self._scanned = 0
        """Bytes at the start of the buffer already known to hold no newline."""
        self._eof = False
        self._max = 0
        self.max_line_bytes = max_line_bytes
        self.max_containers: int | None = None
        """With a number, a line holding more ``[`` and ``{`` is dropped as it arrives and
        reported (:class:`TooManyContainersError`) instead of returned: counted a read at a
        time (two ``count`` calls in C), so neither the count nor the line ever costs the
        loop more than a read does. The main sets it after ``welcome``."""
        self._containers = 0
        """``[`` and ``{`` in the scanned part of the current line."""
        self._head: bytes | None = None
        """The start of a line over the container bound, being dropped."""
        self._dropped = 0
        """Bytes of the current line already dropped."""

    @property
    def max_line_bytes(self) -> int:
        """The longest line accepted, in bytes, not counting the newline."""
        return self._max

    @max_line_bytes.setter
    def max_line_bytes(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"max_line_bytes must be positive (got {value})")
        self._max = value

    async def read_line(self) -> bytes | None:
        """The next non-blank line without its newline, or ``None`` at a clean EOF.

        Raises :class:`LineTooLongError` or :class:`UnterminatedLineError`; after
        either, the stream is not at a line boundary and must not be read again.
        """
        while True:
            line = await self._next_line()
            if line is None:
                return None
            if line.strip():
                return line

    async def _next_line(self) -> bytes | None:
        buffer = self._buffer
        while True:
            end = buffer.find(b"\n", self._scanned)
            if self.max_containers is not None and self._head is None:
                upto = len(buffer) if end < 0 else end
                self._containers += buffer.count(b"[", self._scanned, upto)
                self._containers += buffer.count(b"{", self._scanned, upto)
                if self._containers > self.max_containers:
                    self._head = bytes(buffer[: min(upto, HEAD_BYTES)])
            if end >= 0:
                length = self._dropped + end
                if length > self._max:
                    raise LineTooLongError(f"line of {length} bytes exceeds {self._max}")
                head = self._head
                with memoryview(buffer) as view:  # one copy, not a slice and then a copy
                    line = b"" if head is not None else bytes(view[:end])
                del buffer[: end + 1]  # cheap: bytearray trims its front in place
                self._scanned = self._containers = self._dropped = 0
                self._head = None
                if head is not None:
                    raise TooManyContainersError(head)
                return line
            if self._head is not None:  # over the container bound: keep nothing more
                self._dropped += len(buffer)
                del buffer[:]
            self._scanned = len(buffer)
            if self._dropped + self._scanned > self._max:
                raise LineTooLongError(f"line exceeds {self._max} bytes without a newline")
            if self._eof:
                if not buffer and not self._dropped:
                    return None
                raise UnterminatedLineError(
                    f"connection closed after {self._dropped + len(buffer)} bytes of an "
                    "unterminated line"
                )
            # Never more than the cap needs: the buffer stays within one byte over it.
            want = self._max + 1 - self._dropped - self._scanned
            chunk = await self._reader.read(min(READ_CHUNK_BYTES, want))
            if chunk:
                buffer += chunk
            else:
                self._eof = True


async def read_message(reader: LineReader) -> Message | None:
    """The next message, or ``None`` at a clean EOF; raises ``ProtocolError`` subclasses."""
    line = await reader.read_line()
    return None if line is None else decode(line)


GREETING_TIMEOUT = 2.0
"""How long a main may take to send its challenge after accepting a connection. It sends
it at once, so a peer silent this long is some other service (PostgreSQL and Redis wait
for the client to speak first), or a main too stalled to serve anyway."""


_OR_TLS = ", or a main serving TLS (a peer connects to it with --tls-ca)"


async def read_greeting(
    reader: LineReader, where: str, wait: float, *, tls: bool = False
) -> Challenge | Error:
    """The main's first message (a challenge, or an error such as a connection cap); any
    other answer, silence for ``wait`` seconds, or a close means ``where`` is not a broker
    main, and the :class:`~broker.exceptions.ProtocolError` raised says so.

    A main serving TLS also looks like that to a peer without TLS (it says nothing until
    the peer's TLS handshake, then closes), and a main with mutual TLS closes a TLS
    connection whose client certificate it refused: the messages name both, since the
    peer cannot tell them apart (``tls``: whether this connection is TLS)."""
    try:
        first = await asyncio.wait_for(read_message(reader), wait)
    except TimeoutError:
        raise ProtocolError(
            f"{where} accepted the connection but sent no broker greeting within "
            f"{wait:g} s: this is not a broker main (another service on that port?), "
            f"or a main too stalled to answer{'' if tls else _OR_TLS}; check --main"
        ) from None
    except ProtocolError as exc:
        raise ProtocolError(
            f"{where} answered with something that is not the broker protocol: this is "
            f"not a broker main; check --main ({exc})"
        ) from None
    if first is None and tls:
        raise ProtocolError(
            f"{where} closed the TLS connection without a broker greeting: a main with "
            "mutual TLS (--tls-client-ca) does so when it does not accept this peer's "
            "client certificate (none, expired, or signed by another CA: check "
            "--tls-client-cert and --tls-client-key); or this is not a broker main "
            "(check --main)"
        )
    if first is None:
        raise ProtocolError(
            f"{where} closed the connection without a broker greeting: this is not a "
            f"broker main{_OR_TLS}; check --main"
        )
    if not isinstance(first, Challenge | Error):
        raise ProtocolError(f"expected a challenge from the main at {where}, got {first.type}")
    return first


class Transport(Protocol):
    """What :class:`MessageWriter` asks of a stream's transport."""

    def get_write_buffer_size(self) -> int: ...

    def abort(self) -> None: ...


class StreamSink(Protocol):
    """The writing half of a connection as :class:`MessageWriter` uses it: an asyncio
    ``StreamWriter``, or a test's memory stream (as httpcore's network stream seam lets
    its mock backend stand in for a socket)."""

    @property
    def transport(self) -> Transport: ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def is_closing(self) -> bool: ...

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


class MessageWriter:
    """Writes whole messages, one line each, from any number of tasks.

    Each message is encoded completely before anything is written, so a payload
    that cannot be encoded sends nothing; the lock makes concurrent senders take
    turns through ``drain()``, so back-pressure is shared fairly and lines stay whole.
    """

    def __init__(self, writer: StreamSink) -> None:
        self._writer = writer
        self._lock = asyncio.Lock()

    @property
    def is_closing(self) -> bool:
        return self._writer.is_closing()

    async def send(self, msg: Message) -> None:
        await self.send_many((msg,))

    async def send_many(self, msgs: Iterable[Message]) -> None:
        """One write and one drain for a batch, so a burst of jobs costs one wake-up.

        Raises ``ConnectionResetError`` once the connection is closing, so a caller
        never believes a message went out when it was silently dropped.
        """
        await self.write_raw(b"".join(encode(msg) for msg in msgs))

    async def write_raw(self, data: bytes) -> None:
        """Write lines that were already encoded, e.g. by a sender that queues bytes.

        ``data`` must be whole lines (it must end with ``\\n``): a partial line would
        merge with the next sender's and corrupt both.
        """
        if not data:
            return
        if not data.endswith(b"\n"):
            raise ValueError("write_raw needs whole lines ending in a newline")
        async with self._lock:
            if self._writer.is_closing():
                raise ConnectionResetError("connection is closing")
            self._writer.write(data)
            await self._writer.drain()

    def write_now(self, data: bytes) -> bool:
        """Write whole lines at once, without a turn of the event loop, when no sender is
        writing and the transport holds nothing unsent: they then go out in order, and
        cannot pile up behind a peer that stopped reading (a second call finds the first
        one's rest unsent). ``False``: nothing was written; send them the usual way."""
        if not data.endswith(b"\n"):
            raise ValueError("write_now needs whole lines ending in a newline")
        writer = self._writer
        if self._lock.locked() or writer.is_closing() or writer.transport.get_write_buffer_size():
            return False
        writer.write(data)
        return True

    async def close(self, grace: float = 5.0) -> None:
        """Close, giving buffered lines ``grace`` seconds to flush before aborting.

        Deliberately does not take the send lock: a peer that stopped reading would
        hold a sender in ``drain()`` forever, and closing is what releases it.
        """
        if not self._writer.is_closing():
            self._writer.close()
        # Waiting through a task, not on wait_closed() directly: cancelling a direct wait
        # would cancel the stream's shared close future and break every other waiter.
        waiter = asyncio.ensure_future(self._writer.wait_closed())
        waiter.add_done_callback(_consume_exception)
        done, _ = await asyncio.wait({waiter}, timeout=grace)
        if not done:
            self._writer.transport.abort()
        with contextlib.suppress(OSError):  # the peer already went away: still closed
            await waiter

    def abort(self) -> None:
        """Drop the connection at once, discarding unsent data."""
        with contextlib.suppress(OSError):
            self._writer.transport.abort()


def _consume_exception(future: asyncio.Future[None]) -> None:
    # Marks the exception as retrieved even if close() itself was cancelled meanwhile.
    if not future.cancelled():
        future.exception()
