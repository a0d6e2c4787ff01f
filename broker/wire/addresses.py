"""The mains a peer may reach, and which one to try next.

Several mains may share one PostgreSQL store, one of them elected to dispatch (see
:mod:`broker.core.election`). A worker or a client is given every main's address
(``--main a:7600,b:7600``, ``BROKER_MAIN``, ``Client("a:7600,b:7600")``): it tries them in
turn, and a standby that answers ``not_leader`` names the leader, which is tried next.
"""

from __future__ import annotations

from broker.exceptions import ConfigurationError
from broker.wire import messages as protocol


def parse_address(text: str, default_port: int = protocol.DEFAULT_PORT) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT``, or a bare host or IPv6 address, which means
    ``default_port``; a port outside 1-65535 is refused here, with the text that named it,
    rather than deep in the socket layer. A URL (``http://host:7390``, ``tcp://...``) is
    refused as such: its colons made it a bare IPv6 address, tried for ever."""
    scheme, slashes, rest = text.partition("://")
    if slashes:
        bare = rest.split("/", 1)[0] or "HOST:PORT"
        raise ConfigurationError(
            f"expected HOST:PORT, not a URL (got {text!r}): drop the {scheme}:// and give {bare!r}"
        )
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ConfigurationError(f"expected HOST:PORT or [IPv6]:PORT (got {text!r})")
        port = rest[1:]
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:  # a bare host, or a bare IPv6 address
        host, port = text, ""
    if not host:
        raise ConfigurationError(f"expected HOST:PORT (got {text!r})")
    if port == "" and not text.endswith(":"):
        return host, default_port
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigurationError(f"the port in {text!r} must be a number from 1 to 65535")
    return host, int(port)


def parse_addresses(text: str, default_port: int = protocol.DEFAULT_PORT) -> list[tuple[str, int]]:
    """A comma-separated list of :func:`parse_address` addresses (at least one)."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ConfigurationError(f"expected HOST:PORT[,HOST:PORT...] (got {text!r})")
    return [parse_address(item, default_port) for item in items]


def main_addresses(host: str, port: int) -> list[tuple[str, int]]:
    """``host`` and ``port`` as a peer's constructor takes them: one host, one
    ``HOST:PORT``, or a comma-separated list of them (each without a port takes
    ``port``). ``Client("main.internal:7600")`` named a host called
    ``main.internal:7600`` before, and failed in the resolver."""
    return parse_addresses(host, port)


def peer_arguments(text: str) -> tuple[str, int]:
    """``--main``'s text as the ``host`` and ``port`` of a worker or a client: one address
    parsed, or a list kept whole for :class:`MainAddresses`."""
    addresses = parse_addresses(text)
    return (text, protocol.DEFAULT_PORT) if len(addresses) > 1 else addresses[0]


class MainAddresses:
    """The mains to try, in turn, and the leader a standby named, tried first.

    ``host`` is one host (with ``port``) or a comma-separated list of ``HOST:PORT``
    (each without a port takes ``port``).
    """

    def __init__(self, host: str, port: int) -> None:
        self.all = main_addresses(host, port)
        self._next = 0
        self._leader: tuple[str, int] | None = None

    @property
    def current(self) -> tuple[str, int]:
        """The address to connect to now."""
        return self._leader or self.all[self._next]

    def __str__(self) -> str:
        host, port = self.current
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def failed(self) -> None:
        """The current address could not be reached, or its connection was lost: the next
        one in the list is tried (a leader named earlier is forgotten)."""
        if self._leader is not None:
            self._leader = None
        else:
            self._next = (self._next + 1) % len(self.all)

    def follow(self, leader: str | None) -> None:
        """A standby answered: connect to ``leader`` next, or, when it named none (no main
        is elected yet, or its address cannot be read), to the next address."""
        if leader is None:
            self.failed()
            return
        try:
            self._leader = parse_address(leader)
        except ConfigurationError:
            self.failed()
