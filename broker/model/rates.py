"""A rate limit as an operator writes it (``"50/s"``, ``"600/m"``, ``"1000/h"``), and its
burst: the one parser and the one check, for the CLI, the client, the wire and the store.

The limit itself (which dispatch it lets through, and when the next one may go) is
:mod:`broker.core.flow`'s; this is only the value, so that everything below the core (the
wire, the store, the client) can refuse a bad one with the same words.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from broker.model.bounds import MAX_RATE_BURST, MAX_RATE_PER_SECOND

PERIODS = {"s": 1, "m": 60, "h": 3600}
"""The units a rate may be given in, in seconds."""

_RATE = re.compile(r"\s*(\d{1,9})\s*/\s*([smh])\s*")

NANOS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``count`` dispatches every ``per`` (``"s"``, ``"m"`` or ``"h"``), and at most
    ``burst`` at once after a quiet spell: over any window of ``W`` seconds, at most
    ``count / seconds(per) * W + burst`` go."""

    count: int
    per: str
    burst: int = 1

    def __post_init__(self) -> None:
        check_rate(self.count, self.per, self.burst)

    @property
    def per_second(self) -> float:
        return self.count / PERIODS[self.per]

    @property
    def interval_ns(self) -> int:
        """Nanoseconds between two dispatches at the steady rate, rounded up: the limiter
        counts in whole nanoseconds, so no rounding ever lets one more through."""
        return math.ceil(PERIODS[self.per] * NANOS / self.count)

    def __str__(self) -> str:
        return f"{self.count}/{self.per}"


def check_rate(count: int, per: str, burst: int) -> None:
    """Refuse a rate outside 1/h to :data:`MAX_RATE_PER_SECOND`, an unknown unit or a
    burst outside 1 to :data:`MAX_RATE_BURST`; raises ``ValueError``."""
    if per not in PERIODS:
        raise ValueError(f"a rate's unit must be s, m or h (got {per!r})")
    if count < 1 or count / PERIODS[per] > MAX_RATE_PER_SECOND:
        raise ValueError(
            f"a rate must be from 1/h to {MAX_RATE_PER_SECOND:.0f}/s (got {count}/{per})"
        )
    if not 1 <= burst <= MAX_RATE_BURST:
        raise ValueError(f"a rate's burst must be from 1 to {MAX_RATE_BURST} (got {burst})")


def parse_rate(text: str, burst: int = 1) -> Rate:
    """``"50/s"`` (or ``/m``, ``/h``) as a :class:`Rate`; raises ``ValueError``, saying what
    is expected, for anything else."""
    found = _RATE.fullmatch(text)
    if found is None:
        raise ValueError(f"a rate is written COUNT/s, COUNT/m or COUNT/h, like 50/s (got {text!r})")
    return Rate(int(found[1]), found[2], burst)
