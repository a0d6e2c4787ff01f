"""The worker's connection to the main: connect, greet, keep alive, and connect again.

A worker holds one connection to the main and keeps it. :class:`Link` opens it
(:class:`Network`: TCP, or a test's memory streams), drives the handshake
(:mod:`broker.wire.handshake`), then runs four loops on it until one ends: the reader
hands each message to the worker, the sender writes what the worker has to say when woken,
the pinger proves the connection from this side, and the watch ends the connection once
the main has been silent, or a send stuck, for the liveness timeout. When the connection
ends it reconnects. When, to which main and how long a connection counts as alive are
decided in :mod:`broker.core.reconnect`; what is said on the connection is the worker's
(:mod:`broker.worker.worker`, over :mod:`broker.core.worker_state`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from broker.core.reconnect import Reconnect, alive_for
from broker.exceptions import (
    AuthenticationError,
    ConfigurationError,
    NotLeaderError,
    ProtocolError,
)
from broker.payload import MAX_LINE_BYTES_CEILING
from broker.wire import codec, tls
from broker.wire import framing as wire
from broker.wire import messages as protocol
from broker.wire.addresses import MainAddresses
from broker.wire.handshake import PeerHandshake


class Stream(wire.StreamSink, Protocol):
    """The writing half of a connection as the link uses it."""

    def get_extra_info(self, name: str, default: Any = None) -> Any: ...


class Network(Protocol):
    """How the link opens a connection (httpcore's network backend): TCP unless a test
    puts memory streams in its place (``Worker.network``)."""

    async def connect(
        self, host: str, port: int, tls: ssl.SSLContext | None
    ) -> tuple[asyncio.StreamReader, Stream]: ...


class TCP:
    """Connections over TCP, with TLS when given a context."""

    async def connect(
        self, host: str, port: int, tls: ssl.SSLContext | None
    ) -> tuple[asyncio.StreamReader, Stream]:
        return await asyncio.open_connection(host, port, limit=MAX_LINE_BYTES_CEILING + 2, ssl=tls)


@dataclass(eq=False)
class Connection:
    """What lives and dies with one connection to the main (its protocol state is in
    :class:`~broker.core.worker_state.WorkerState`)."""

    lines: wire.LineReader
    writer: wire.MessageWriter
    welcome: protocol.Welcome
    ping_interval: float
    status_sent: tuple[object, ...] | None = None
    """What the last ``worker_status`` said about capacity and start-up errors."""
    heard: float = 0.0
    """Loop time when the read loop last had a message from the main (see
    :meth:`Link._watch_liveness`)."""
    sending: float | None = None
    """Loop time when the send under way began (``None``: no send is waiting on the
    socket); the liveness watch ends a send blocked for the liveness timeout."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What the worker says and hears on each connection, as callbacks to the link."""

    hello: Callable[[], protocol.Hello]
    """The hello for a new connection (without its proof)."""
    joined: Callable[[Connection], Awaitable[None]]
    """The main welcomed this worker: what comes first on the connection."""
    handle: Callable[[protocol.Message], None]
    """A message from the main."""
    outgoing: Callable[[Connection], bytes]
    """The whole lines to send now, once the wake event was set."""
    left: Callable[[], None]
    """The connection is over."""


class Link:
    """Keeps one worker connected to a main of ``mains`` until cancelled, or until the
    main refuses it for good (raised)."""

    def __init__(
        self,
        mains: MainAddresses,
        endpoint: Endpoint,
        wake: asyncio.Event,
        *,
        network: Network,
        token: str | None,
        tls: ssl.SSLContext | None,
        ping_interval: float,
        liveness_timeout: float,
        reconnect_max_delay: float,
        logger: logging.Logger,
    ) -> None:
        self._mains = mains
        self._endpoint = endpoint
        self._wake = wake
        """Set when the worker has something to send (see :meth:`_send_loop`)."""
        self._network = network
        self._token = token
        self._tls = tls
        self._ping_interval = ping_interval
        self._liveness_timeout = liveness_timeout
        self._reconnect_max_delay = reconnect_max_delay
        self._logger = logger

    async def stay_connected(self) -> None:
        """Connect, serve, and connect again, as :class:`~broker.core.reconnect.Reconnect`
        says; raises :class:`~broker.exceptions.AuthenticationError` or
        :class:`~broker.exceptions.ConfigurationError`, which retrying would not change."""
        policy = Reconnect(self._mains, self._reconnect_max_delay)
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn = await self._connect()
            except (AuthenticationError, ConfigurationError) as exc:
                self._logger.error("giving up on the main: %s", exc, extra={"event": "fatal"})
                raise
            except NotLeaderError as exc:
                where = str(self._mains)
                delay = policy.not_leader(exc.leader)
                self._logger.info(
                    "the main at %s is a standby (leader: %s); connecting there in %.2f s",
                    where,
                    exc.leader or "none elected yet",
                    delay,
                    extra={"event": "not_leader"},
                )
                await asyncio.sleep(delay)
                continue
            except (OSError, TimeoutError, ProtocolError) as exc:
                where = str(self._mains)
                delay = policy.unreachable()
                self._logger.warning(
                    "cannot reach the main at %s (%s); retrying in %.2f s",
                    where,
                    _describe(exc),
                    delay,
                    extra={"event": "connect_failed"},
                )
                await asyncio.sleep(delay)
                continue
            connected_at = loop.time()
            policy.connected(connected_at, conn.welcome.main_id)
            why = "the connection ended"
            try:
                await self._serve(conn)
            except (OSError, TimeoutError, ProtocolError) as exc:
                why = _describe(exc)
            now = loop.time()
            delay = policy.lost(now)
            # How long the connection lasted and the wait it earned: a takeover's follow
            # time is read from these lines.
            self._logger.warning(
                "connection to the main lost after %.1f s (%s); reconnecting in %.2f s",
                now - connected_at,
                why,
                delay,
                extra={"event": "disconnected"},
            )
            await asyncio.sleep(delay)

    async def _connect(self) -> Connection:
        host, port = self._mains.current
        try:
            async with asyncio.timeout(self._liveness_timeout):
                reader, stream = await self._network.connect(host, port, self._tls)
        except ssl.SSLError as exc:
            # Retried like an unreachable main (a certificate may be renewed meanwhile),
            # but logged as what it is.
            raise ConnectionError(tls.describe(exc, f"{host}:{port}")) from exc
        self._enable_keepalive(stream.get_extra_info("socket"))
        lines = wire.LineReader(reader)
        writer = wire.MessageWriter(stream)
        hello = self._endpoint.hello()
        try:
            async with asyncio.timeout(self._liveness_timeout):
                welcome = await self._handshake(lines, writer, hello)
        except ssl.SSLError as exc:  # TLS 1.3 sends a refused client certificate's alert late
            writer.abort()
            raise ConnectionError(tls.describe(exc, f"{host}:{port}")) from exc
        except BaseException:
            writer.abort()
            raise
        lines.max_line_bytes = min(welcome.max_line_bytes, MAX_LINE_BYTES_CEILING)
        held = {(ref.job_id, ref.handoff_id) for ref in hello.held_leases}
        adopted = {(ref.job_id, ref.handoff_id) for ref in welcome.adopted}
        self._logger.info(
            "connected to main %s at %s:%d (held %d leases, %d adopted)",
            welcome.main_id,
            host,
            port,
            len(held),
            len(adopted & held),
            extra={"event": "connected", "main_id": welcome.main_id},
        )
        return Connection(
            lines=lines,
            writer=writer,
            welcome=welcome,
            ping_interval=min(self._ping_interval, welcome.ping_interval),
        )

    def _enable_keepalive(self, sock: socket.socket | None) -> None:
        """Let the kernel probe an idle connection too, in case pings cannot get out."""
        if sock is None:
            return
        options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
        for name, value in (
            ("TCP_KEEPIDLE", self._liveness_timeout),
            ("TCP_KEEPINTVL", self._ping_interval),
            ("TCP_KEEPCNT", 3),
        ):
            if hasattr(socket, name):
                options.append((socket.IPPROTO_TCP, getattr(socket, name), max(1, int(value))))
        with contextlib.suppress(OSError):
            for level, option, value in options:
                sock.setsockopt(level, option, value)

    async def _handshake(
        self, lines: wire.LineReader, writer: wire.MessageWriter, hello: protocol.Hello
    ) -> protocol.Welcome:
        host, port = self._mains.current
        handshake = PeerHandshake(hello, self._token)
        greeting = await wire.read_greeting(
            lines, f"{host}:{port}", wire.GREETING_TIMEOUT, tls=self._tls is not None
        )
        await writer.send(handshake.challenged(greeting))
        return handshake.answered(await wire.read_message(lines))

    async def _serve(self, conn: Connection) -> None:
        await self._endpoint.joined(conn)
        tasks = [
            asyncio.create_task(self._read_loop(conn), name="broker-worker-read"),
            asyncio.create_task(self._send_loop(conn), name="broker-worker-send"),
            asyncio.create_task(self._ping_loop(conn), name="broker-worker-ping"),
            asyncio.create_task(self._watch_liveness(conn), name="broker-worker-liveness"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            self._endpoint.left()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await conn.writer.close(grace=1.0)

    async def _watch_liveness(self, conn: Connection) -> None:
        """Ends the connection once nothing has come from the main for the liveness
        timeout, or a send has waited on the socket that long: one timer per connection,
        where a timeout around every read cost a timer and three ``getpid`` calls per
        message, and one around every send a timer per batch of reports."""
        loop = asyncio.get_running_loop()
        conn.heard = loop.time()
        limit = self._liveness_timeout
        while True:
            left = alive_for(loop.time(), heard=conn.heard, sending=conn.sending, limit=limit)
            await asyncio.sleep(left)

    async def _read_loop(self, conn: Connection) -> None:
        loop = asyncio.get_running_loop()
        handle = self._endpoint.handle
        while True:
            conn.heard = loop.time()  # the previous message (or the welcome) just came
            try:
                msg = await wire.read_message(conn.lines)
            except codec.UnknownTypeError as exc:
                # A newer main may send messages this worker does not know; skip them.
                self._logger.warning("ignoring a message from the main: %s", exc)
                continue
            except codec.DecodeError as exc:
                if exc.msg_type not in (protocol.ReportAck.type, protocol.ReportAcks.type):
                    raise
                # A newer main may answer with a status this worker does not know. Keep
                # the connection (and the leases on it); the report stays in the outbox
                # and is sent again on the next connection.
                self._logger.warning("ignoring a report_ack from the main: %s", exc)
                continue
            if msg is None:
                raise ConnectionResetError("the main closed the connection")
            handle(msg)

    async def _send_loop(self, conn: Connection) -> None:
        """The one sender of everything except pings: each time the worker wakes it, the
        lines the worker has to say then, in one write."""
        loop = asyncio.get_running_loop()
        outgoing = self._endpoint.outgoing
        while True:
            await self._wake.wait()
            # One more turn lets a job that just freed its slot file its report, so the
            # report and the ``ready`` counting its slot go out together.
            await asyncio.sleep(0)
            self._wake.clear()
            data = outgoing(conn)
            conn.sending = loop.time()
            await conn.writer.write_raw(data)
            conn.sending = None

    async def _ping_loop(self, conn: Connection) -> None:
        for nonce in itertools.count(1):
            await asyncio.sleep(conn.ping_interval)
            async with asyncio.timeout(self._liveness_timeout):
                await conn.writer.send(protocol.Ping(nonce=nonce))


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
