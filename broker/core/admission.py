"""Admission to the handshake: connections over its limits wait their turn, in order.

A connection in its handshake (TLS's, then the protocol's) holds one of ``total`` slots,
and at most ``per_address`` from one IP address, so idle sockets from one address cannot
lock every other address out. A connection over either limit used to be refused at once,
so a fleet of 500 clients and workers restarting in the same second lost most of its
connections; now it waits in line for a slot (the main's shell bounds the wait by the
handshake deadline and the line by its connection limit), and each slot freed goes to the
first waiting connection whose address is under its own limit.

Nothing here does I/O: a ticket is whatever the shell wakes a waiting connection with.
"""

from __future__ import annotations

from collections import Counter
from typing import Generic, TypeVar

T = TypeVar("T")


class Admission(Generic[T]):
    """The handshake slots and the line of connections waiting for one."""

    def __init__(self, total: int, per_address: int) -> None:
        self.total = total
        self.per_address = per_address
        self.held: Counter[str] = Counter()
        """Slots held, by address."""
        self._in_use = 0
        self._line: list[tuple[str, T]] = []

    @property
    def waiting(self) -> int:
        """Connections waiting in line for a slot."""
        return len(self._line)

    def blocked(self, address: str) -> str | None:
        """Which limit keeps a new connection from ``address`` out now (the flag that sets
        it, for the log and the refusal), or ``None`` when it may take a slot."""
        if self._in_use >= self.total:
            return (
                f"{self._in_use} connections are in the handshake, the limit "
                "(--max-unauthenticated)"
            )
        if self.held[address] >= self.per_address:
            return (
                f"{self.held[address]} handshakes are under way from {address}, the limit per "
                "address (--max-unauthenticated-per-address)"
            )
        return None

    def enter(self, address: str, ticket: T) -> bool:
        """A connection from ``address`` wants a slot: ``True`` when it took one now, else
        it waits in line until :meth:`leave` names its ticket, or the shell gives up on it
        (:meth:`withdraw`). Nobody in line fits a free slot (each slot freed goes to the
        first that fits), so a newcomer that fits passes only those whose own address
        is at its limit."""
        if self.blocked(address) is None:
            self._take(address)
            return True
        self._line.append((address, ticket))
        return False

    def leave(self, address: str) -> list[T]:
        """A connection from ``address`` left the handshake (passed it, failed, closed):
        its slot goes to the first in line that fits. The tickets admitted now, each
        holding its slot already."""
        self.held[address] -= 1
        if not self.held[address]:
            del self.held[address]
        self._in_use -= 1
        admitted: list[T] = []
        for entry in list(self._line):
            if self._in_use >= self.total:
                break
            waiting_address, ticket = entry
            if self.held[waiting_address] < self.per_address:
                self._line.remove(entry)
                self._take(waiting_address)
                admitted.append(ticket)
        return admitted

    def withdraw(self, ticket: T) -> bool:
        """The shell gives up on a waiting ticket (its wait ran out, or its connection
        closed): ``False`` when :meth:`leave` admitted it meanwhile (it holds a slot, to
        give back with :meth:`leave`)."""
        for entry in self._line:
            if entry[1] is ticket:
                self._line.remove(entry)
                return True
        return False

    def _take(self, address: str) -> None:
        self.held[address] += 1
        self._in_use += 1
