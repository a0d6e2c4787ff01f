"""A connection in memory: two ends, each an asyncio ``StreamReader`` and a writer feeding
the other end's reader (httpcore's mock backend, ``httpcore/_backends/mock.py``).

A peer speaking through :class:`broker.wire.framing.LineReader` and
:class:`~broker.wire.framing.MessageWriter` cannot tell it from TCP, but nothing waits on
a socket: what one end writes is readable by the other at the next turn of the loop. So a
test drives the worker through a whole drain with no port and no fixed sleep
(:class:`MemoryNetwork` stands where :class:`broker.worker.link.TCP` would).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Coroutine
from typing import Any

Serve = Callable[[asyncio.StreamReader, "MemoryStream"], Coroutine[Any, Any, None]]
"""What answers a connection, as ``asyncio.start_server`` calls it."""


class _Connection:
    """Both directions of one connection, closed together (as a TCP close ends both)."""

    def __init__(self) -> None:
        self.readers = (asyncio.StreamReader(), asyncio.StreamReader())
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for reader in self.readers:
                reader.feed_eof()


class MemoryStream:
    """The writing half of one end: what it writes, the other end reads. It is its own
    transport (``abort``, ``get_write_buffer_size``) and never pushes back."""

    def __init__(self, connection: _Connection, side: int) -> None:
        self._connection = connection
        self._peer = connection.readers[1 - side]

    @property
    def transport(self) -> MemoryStream:
        return self

    def write(self, data: bytes) -> None:
        if not self._connection.closed:  # as a closed transport, drops what comes after
            self._peer.feed_data(data)

    async def drain(self) -> None:
        return None

    def is_closing(self) -> bool:
        return self._connection.closed

    def close(self) -> None:
        self._connection.close()

    def abort(self) -> None:
        self._connection.close()

    async def wait_closed(self) -> None:
        return None

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket, no peer name


def memory_pair() -> tuple[
    tuple[asyncio.StreamReader, MemoryStream], tuple[asyncio.StreamReader, MemoryStream]
]:
    """The two ends of a new connection, each a reader and a writer."""
    connection = _Connection()
    return (
        (connection.readers[0], MemoryStream(connection, 0)),
        (connection.readers[1], MemoryStream(connection, 1)),
    )


class MemoryNetwork:
    """A :class:`broker.worker.link.Network` whose every connection is answered by
    ``serve`` in a task of its own, as a server's handler would be."""

    def __init__(self, serve: Serve) -> None:
        self._serve = serve
        self.handlers: set[asyncio.Task[None]] = set()

    async def connect(
        self, host: str, port: int, tls: ssl.SSLContext | None
    ) -> tuple[asyncio.StreamReader, MemoryStream]:
        ours, theirs = memory_pair()
        handler = asyncio.create_task(self._serve(*theirs))
        self.handlers.add(handler)
        handler.add_done_callback(self.handlers.discard)
        return ours

    async def aclose(self) -> None:
        for handler in self.handlers:
            handler.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
