"""Exact credit accounting for one worker connection.

A worker's ``ready`` message says how many slots it has free per execution mode
*and* the sequence number of the last ``job`` message it had taken in when it
counted them. The main therefore knows exactly which of its sends the count
already reflects, so a readiness message that crosses jobs on the wire can never
over-credit the worker (the race velocious has with absolute, unsequenced
readiness). Available credit is derived, never stored::

    available(mode) = slots(mode) - sent_but_unseen(mode) - claiming(mode)

where ``claiming`` counts handoffs reserved for this worker whose claim is still
in flight. Restoring admission after a failed or lost claim is just dropping the
reservation: if a newer ``ready`` arrived meanwhile, its count did not include
the reserved job either, so nothing is refunded twice.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping

from broker.exceptions import ProtocolError
from broker.jobs import ExecutionMode
from broker.model.bounds import MAX_CREDIT


class CreditLimitError(ProtocolError):
    """A ``ready`` announced more free slots than the main accepts; it is not applied."""

    code = "over_limit"
    """Not ``malformed``: the worker is told, not dropped (its ``ready`` was readable)."""


class Credits:
    def __init__(self, max_slots: int = MAX_CREDIT) -> None:
        self._max_slots = max_slots
        self._slots: dict[ExecutionMode, int] = {}
        self._seen = 0
        self._last_sent = 0
        self._unseen: deque[tuple[int, ExecutionMode]] = deque()
        self._unseen_by_mode: Counter[ExecutionMode] = Counter()
        self._claiming: Counter[ExecutionMode] = Counter()

    def on_ready(self, slots: Mapping[ExecutionMode, int], seen: int) -> None:
        """Apply a readiness report; ``seen`` must not go backwards nor run ahead of sends,
        and no mode may announce more than ``max_slots`` (the whole report is refused)."""
        over = {str(mode): n for mode, n in slots.items() if n > self._max_slots}
        if over:
            raise CreditLimitError(
                f"ready.slots {over} is over this main's limit of {self._max_slots} free "
                "slots per mode (--max-credit); the ready was not applied"
            )
        if seen < self._seen or seen > self._last_sent:
            raise ProtocolError(
                f"ready.seen={seen} is outside the jobs sent on this connection "
                f"(already seen {self._seen}, last sent {self._last_sent})"
            )
        self._seen = seen
        while self._unseen and self._unseen[0][0] <= seen:
            _, mode = self._unseen.popleft()
            self._unseen_by_mode[mode] -= 1
        self._slots = {ExecutionMode(mode): max(0, int(n)) for mode, n in slots.items()}

    def available(self, mode: ExecutionMode) -> int:
        free = self._slots.get(mode, 0) - self._unseen_by_mode[mode] - self._claiming[mode]
        return max(0, free)

    def total_available(self) -> int:
        return sum(self.available(mode) for mode in ExecutionMode)

    def modes_with_credit(self) -> set[ExecutionMode]:
        return {mode for mode in ExecutionMode if self.available(mode) > 0}

    def reserve(self, mode: ExecutionMode) -> bool:
        """Hold one credit for a claim about to be made; ``False`` if there is none."""
        if self.available(mode) <= 0:
            return False
        self._claiming[mode] += 1
        return True

    def release(self, mode: ExecutionMode) -> None:
        """The reserved claim did not produce a job for this worker: drop the hold."""
        if self._claiming[mode] <= 0:
            raise RuntimeError(f"no {mode} credit is reserved")
        self._claiming[mode] -= 1

    def commit(self, mode: ExecutionMode) -> int:
        """The reserved claim succeeded and its job is being sent: returns its ``seq``."""
        self.release(mode)
        self._last_sent += 1
        self._unseen.append((self._last_sent, mode))
        self._unseen_by_mode[mode] += 1
        return self._last_sent

    @property
    def in_flight_unseen(self) -> int:
        return len(self._unseen)
