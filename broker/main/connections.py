"""The main's connections: accepting them under caps, the handshake, reading and writing.

This is transport only. What a connection means to the handoff (role, credits, leases,
liveness) is its :class:`broker.core.peers.Peer`; what its messages mean is decided by the
main, which :class:`Connections` calls back: ``welcome`` once a hello passed the
checks, ``handle`` for each later message, ``closed`` when the connection ends, ``carry``
for the effects of the transport's own events. Those (a pause, a resume, a write begun or
ended) go to the handoff core as events: the transport never writes the peer's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from broker.core.admission import Admission
from broker.core.handoff import Handoff, HandoffEffect
from broker.exceptions import ProtocolError
from broker.main.sessions import Joined, RequestBytes, Session
from broker.model.bounds import (
    AUTH_FAILURE_LOG_BURST,
    AUTH_FAILURE_LOG_PER_SECOND,
    MESSAGE_CONTAINERS,
)
from broker.model.logs import log_event
from broker.model.untrusted import RateLimit
from broker.wire import codec, tls
from broker.wire import errors as error_codes
from broker.wire import framing as wire
from broker.wire import messages as protocol
from broker.wire.credentials import Credentials
from broker.wire.handshake import Accepted, Refused, ServerHandshake

logger = logging.getLogger("broker.main")


class ConnectionSettings(Protocol):
    """The main's settings that its connections read
    (:class:`broker.main.settings.MainSettings`)."""

    @property
    def credentials(self) -> Credentials: ...
    @property
    def preauth_max_line_bytes(self) -> int: ...
    @property
    def max_line_bytes(self) -> int: ...
    @property
    def handshake_timeout(self) -> float: ...
    @property
    def max_errors_per_connection(self) -> int: ...
    @property
    def max_outbox_bytes(self) -> int: ...
    @property
    def max_requests_per_connection(self) -> int: ...
    @property
    def max_request_bytes_per_connection(self) -> int: ...
    @property
    def max_request_bytes(self) -> int: ...
    @property
    def max_payload_containers(self) -> int: ...
    @property
    def max_connections(self) -> int: ...
    @property
    def max_connections_per_address(self) -> int: ...
    @property
    def max_unauthenticated(self) -> int: ...
    @property
    def max_unauthenticated_per_address(self) -> int: ...


def _address(peername: object) -> str:
    """The IP address of a peer (``peername`` as asyncio gives it), which the limits per
    address count."""
    return str(peername[0]) if isinstance(peername, tuple) else str(peername)


class _TLSHandshake(asyncio.Protocol):
    """A connection just accepted on a TLS port, until :meth:`Connections._start_tls`
    takes it over. It stops reading at once, so the peer's first TLS record stays in the
    socket for the handshake to read."""

    def __init__(self, connections: Connections, context: ssl.SSLContext) -> None:
        self._connections = connections
        self._context = context

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()
        connections = self._connections
        task = asyncio.get_running_loop().create_task(
            connections._start_tls(transport, self._context)
        )
        connections.tls_handshakes.add(task)
        task.add_done_callback(connections.tls_handshakes.discard)
        # A handshake cancelled (the main stopping) before it began has nobody else to
        # close its connection.
        task.add_done_callback(lambda done: transport.abort() if done.cancelled() else None)


class Connections:
    """Every connection of one main, from accept to close."""

    def __init__(
        self,
        settings: ConnectionSettings,
        *,
        core: Handoff,
        welcome: Callable[[Session, protocol.Hello], bool | protocol.Error],
        handle: Callable[[Session, protocol.Message], None],
        closed: Callable[[Session], None],
        carry: Callable[[Sequence[HandoffEffect]], None],
        stopping: Callable[[], bool],
    ) -> None:
        self.settings = settings
        self._core = core
        self._welcome = welcome
        self._handle = handle
        self._closed = closed
        self._carry = carry
        self._stopping = stopping
        self._ids = itertools.count(1)
        self.tasks: set[asyncio.Task[None]] = set()
        """One task per connection, from accept to close."""
        self._open: dict[int, Session] = {}
        """Every connection's transport by id, from accept to close (in the handshake
        too: where the core has no peer for it yet)."""
        self.joined = Joined(core.peers, self._open)
        """The connections past their hello (:class:`Joined`)."""
        self.admission: Admission[asyncio.Future[None]] = Admission(
            settings.max_unauthenticated, settings.max_unauthenticated_per_address
        )
        """The handshake slots, TLS's and the protocol's, and the connections waiting
        for one (:mod:`broker.core.admission`)."""
        self._unauthenticated: set[asyncio.Task[None]] = set()
        """Connection tasks holding a handshake slot."""
        self.tls_handshakes: set[asyncio.Task[None]] = set()
        """TLS handshakes waiting or under way (:meth:`tls_server`), before their
        connection's task."""
        self._per_address: Counter[str] = Counter()
        self._auth_failures = RateLimit(AUTH_FAILURE_LOG_PER_SECOND, AUTH_FAILURE_LOG_BURST)
        self._refusals = RateLimit(AUTH_FAILURE_LOG_PER_SECOND, AUTH_FAILURE_LOG_BURST)
        self.read_ahead = RequestBytes(settings.max_request_bytes)
        """The bytes of client requests in progress on every connection."""

    def tls_server(self, context: ssl.SSLContext) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` that runs each connection's TLS
        handshake here rather than in asyncio's TLS server, which drops a failed one
        without a word: the main logs it with the peer and the reason, then closes only
        that connection. A connection whose handshake succeeds goes on to :meth:`accept`
        as with plain TCP."""
        return lambda: _TLSHandshake(self, context)

    async def _start_tls(self, transport: asyncio.Transport, context: ssl.SSLContext) -> None:
        loop = asyncio.get_running_loop()
        settings = self.settings
        reader = asyncio.StreamReader(limit=settings.preauth_max_line_bytes)
        streams = asyncio.StreamReaderProtocol(reader, self.accept)
        address = _address(transport.get_extra_info("peername"))
        refusal = await self._admit(address)
        if refusal is not None:
            # Like a connection refused in the protocol's own handshake, but without the
            # error line: the peer expects TLS records, not text.
            self.log_refusal(address, refusal)
            transport.abort()
            return
        try:
            secured = await loop.start_tls(
                transport,
                streams,
                context,
                server_side=True,
                ssl_handshake_timeout=settings.handshake_timeout,
            )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            log_event(
                logger,
                logging.WARNING,
                "TLS handshake failed",
                peer=address,
                reason=tls.describe_peer_failure(exc, settings.handshake_timeout),
            )
            transport.abort()
            return
        finally:
            self._leave(address)  # the protocol's handshake takes a slot of its own
        if secured is None:  # the peer went away as the handshake ended
            transport.abort()
            return
        streams.connection_made(secured)  # start_tls leaves this to its caller

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        address = _address(writer.get_extra_info("peername"))
        refusal = self._connection_refusal(address)
        if refusal is not None:
            await self._refuse(writer, address, refusal)
            return
        self.tasks.add(task)
        self._per_address[address] += 1
        try:
            refusal = await self._admit(address)
            if refusal is not None:
                await self._refuse(writer, address, refusal)
                return
            self._unauthenticated.add(task)
            await self._serve(reader, writer, address)
        except asyncio.CancelledError:
            if not self._stopping():
                raise
        finally:
            self.tasks.discard(task)
            self._authenticated(task, address)
            self._per_address[address] -= 1
            if not self._per_address[address]:
                del self._per_address[address]

    def _authenticated(self, task: asyncio.Task[None], address: str) -> None:
        """``task``'s connection has left the handshake (passed it, or closed)."""
        if task in self._unauthenticated:
            self._unauthenticated.discard(task)
            self._leave(address)

    async def _admit(self, address: str) -> str | None:
        """Take a handshake slot for a connection from ``address``, waiting in line for
        one for up to the handshake deadline (a fleet restarting at once gets in); why it
        was refused when none came, else ``None`` (it holds a slot: give it back with
        :meth:`_leave`)."""
        ticket = asyncio.get_running_loop().create_future()
        if self.admission.enter(address, ticket):
            return None
        why = self.admission.blocked(address)
        try:
            async with asyncio.timeout(self.settings.handshake_timeout):
                await ticket
        except TimeoutError:
            if self.admission.withdraw(ticket):
                return f"{why}; no slot came free within the handshake deadline"
            # Admitted just as the wait ran out: it holds its slot.
        except BaseException:
            if not self.admission.withdraw(ticket):
                self._leave(address)
            raise
        return None

    def _leave(self, address: str) -> None:
        """A connection from ``address`` gave its handshake slot back: the first that fits
        among those waiting takes it."""
        for ticket in self.admission.leave(address):
            if not ticket.done():
                ticket.set_result(None)

    def _connection_refusal(self, address: str) -> str | None:
        """Why a new connection from ``address`` is over a connection limit, or ``None``
        (the handshake's limits make it wait instead: :meth:`_admit`)."""
        settings = self.settings
        if len(self.tasks) >= settings.max_connections:
            return f"the main has {len(self.tasks)} connections, its limit (--max-connections)"
        if self._per_address[address] >= settings.max_connections_per_address:
            return (
                f"{self._per_address[address]} connections from {address} already, the limit "
                "per address (--max-connections-per-address)"
            )
        return None

    async def _refuse(self, writer: asyncio.StreamWriter, address: str, reason: str) -> None:
        """Say why in one fatal ``error`` line (sent before any challenge), then close."""
        self.log_refusal(address, reason)
        out = wire.MessageWriter(writer)
        with contextlib.suppress(ConnectionError, OSError):
            await out.send(
                protocol.Error(
                    code=protocol.ErrorCode.OVER_LIMIT,
                    message=f"connection refused: {reason}",
                    fatal=True,
                )
            )
        await out.close(grace=self.settings.handshake_timeout)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str
    ) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        peername = writer.get_extra_info("peername")
        session = Session(
            state=self._core.new_peer(next(self._ids), asyncio.get_running_loop().time()),
            core=self._core,
            peer=str(peername),
            writer=wire.MessageWriter(writer),
            max_outbox_bytes=self.settings.max_outbox_bytes,
            max_line_bytes=self.settings.max_line_bytes,
            max_requests=self.settings.max_requests_per_connection,
            max_request_bytes=self.settings.max_request_bytes_per_connection,
            read_ahead=self.read_ahead,
        )
        lines = wire.LineReader(reader, max_line_bytes=self.settings.preauth_max_line_bytes)
        sender = asyncio.create_task(self._write_loop(session))
        self._open[session.id] = session
        try:
            if await self._handshake(session, lines):
                task = asyncio.current_task()
                assert task is not None
                self._authenticated(task, address)
                lines.max_line_bytes = self.settings.max_line_bytes
                await self._read_loop(session, lines)
        except wire.UnterminatedLineError as exc:
            log_event(
                logger, logging.INFO, "connection ended mid-line", session=session.id, error=exc
            )
        except ProtocolError as exc:  # a line too long, a bad message, too many errors
            await self._fatal(session, error_codes.code_of(exc), str(exc))
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
            log_event(logger, logging.INFO, "connection lost", session=session.id, error=repr(exc))
        finally:
            self._closed(session)
            del self._open[session.id]
            for request in session.requests:
                request.cancel()  # nobody is left to answer
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
            await session.writer.close()

    async def _write_loop(self, session: Session) -> None:
        """Writes this session's queued lines in order, batching whatever is ready.

        A write that stays stuck in ``drain()`` (the peer does not read) is judged by the
        liveness loop, which allows for the main's own stalls, not by a timer here.
        """
        loop = asyncio.get_running_loop()
        core, peer = self._core, session.state
        try:
            while True:
                data = await session.next_write()
                core.write_started(peer, loop.time())
                await session.writer.write_raw(data)
                core.write_ended(peer)
                if effects := session.written(len(data)):
                    self._carry(effects)  # the peer is dispatchable again
        except (ConnectionError, OSError) as exc:
            log_event(
                logger, logging.INFO, "send failed, closing", session=session.id, error=repr(exc)
            )
            session.abort()

    async def _fatal(
        self, session: Session, code: protocol.ErrorCode, message: str, *, log: bool = True
    ) -> None:
        if log:
            log_event(
                logger,
                logging.WARNING,
                "closing connection",
                session=session.id,
                code=code,
                reason=message,
            )
        with contextlib.suppress(Exception):
            await session.writer.send(protocol.Error(code=code, message=message, fatal=True))

    async def _handshake(self, session: Session, lines: wire.LineReader) -> bool:
        handshake = ServerHandshake(self.settings.credentials, protocol.make_nonce())
        await session.writer.send(handshake.challenge())
        try:
            first = await asyncio.wait_for(
                wire.read_message(lines), timeout=self.settings.handshake_timeout
            )
        except TimeoutError:
            await self._fatal(
                session,
                protocol.ErrorCode.HANDSHAKE_TIMEOUT,
                "no hello within the handshake deadline",
            )
            return False
        if first is None:
            return False
        match handshake.received(first):
            case Refused(code=code, message=message, role=protocol.Role() as role):
                self._log_auth_failure(session, role, message)
                await self._fatal(session, code, message, log=False)
                return False
            case Refused(code=code, message=message):
                await self._fatal(session, code, message)
                return False
            case Accepted(hello=hello, rights=rights):
                session.rights = rights
        answer = self._welcome(session, hello)
        if isinstance(answer, protocol.Error):  # a standby naming the leader
            with contextlib.suppress(Exception):
                await session.writer.send(answer)
            return False
        return answer

    def log_refusal(self, address: str, reason: str) -> None:
        """Log a connection refused over a limit, within a rate: a peer opening sockets
        in a loop must not flood the log."""
        _log_within(self._refusals, "connection refused", peer=address, reason=reason)

    def _log_auth_failure(self, session: Session, role: protocol.Role, reason: str) -> None:
        """Log a refused hello with the peer's address, within a rate: a peer guessing
        secrets must not flood the log."""
        _log_within(
            self._auth_failures,
            "authentication failed",
            peer=session.peer,
            session=session.id,
            role=role,
            reason=reason,
        )

    async def _read_loop(self, session: Session, lines: wire.LineReader) -> None:
        """Reads and handles messages one at a time. It waits, without reading, while the
        session is paused or at its request caps (count and bytes), or has requests in
        progress while all connections' hold the total byte cap: the
        peer's further messages then stay in its socket (TCP back-pressure) rather than
        in the main's memory. Each line is held to the container bound as it is read
        (:attr:`broker.wire.framing.LineReader.max_containers`), before anything in it is built."""
        containers = self.settings.max_payload_containers
        lines.max_containers = containers + MESSAGE_CONTAINERS
        while True:
            await session.readable.wait()
            try:
                line = await lines.read_line()
            except wire.TooManyContainersError as exc:  # dropped as it came: answer it
                self._reply_error(session, codec.container_refusal(exc.head, containers))
                continue
            if line is None or session.dropped:
                return
            try:
                msg = codec.decode_from_peer(line)
            except codec.DecodeError as exc:
                self._reply_error(session, exc)
                continue
            session.line_bytes = len(line)
            self._handle(session, msg)

    def _reply_error(self, session: Session, exc: codec.DecodeError) -> None:
        if isinstance(exc, codec.OverBoundError) and exc.instead is not None:
            # A worker's result over the container bound (an older worker does not check
            # it): its job fails in its place. An outcome, not a bad message.
            log_event(logger, logging.WARNING, "report refused", session=session.id, reason=exc)
            self._handle(session, exc.instead)
            return
        if isinstance(exc, codec.OverBoundError) and exc.reply is not None:
            log_event(logger, logging.WARNING, "checkpoint refused", session=session.id, reason=exc)
            session.send(exc.reply)
            return
        session.errors += 1
        if exc.request_id is not None:
            session.send(
                protocol.RequestError(request_id=exc.request_id, code=exc.code, message=str(exc))
            )
        else:
            session.send(protocol.Error(code=exc.code, message=str(exc), fatal=False))
        if session.errors >= self.settings.max_errors_per_connection:
            raise ProtocolError(f"too many bad messages ({session.errors}); closing")


def _log_within(rate: RateLimit, message: str, **fields: Any) -> None:
    """A WARNING line, unless ``rate`` says this one is over it; how many it left out
    before rides on the next line it lets through (``not_logged_before``, only when some
    were), so a quiet log stays uncluttered and a flood is still counted."""
    if not rate.allow():
        return
    if unlogged := rate.take_suppressed():
        fields["not_logged_before"] = unlogged
    log_event(logger, logging.WARNING, message, **fields)
