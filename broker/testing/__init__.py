"""Public testing aids: a clock you move by hand and the adapter conformance suite.

Nothing here imports pytest, so any test runner can drive it.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from broker.jobs import utcnow


class FakeClock:
    """A clock that stands still until told to move; pass it as an adapter's ``clock``."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or utcnow()

    def __call__(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)

    def set(self, when: datetime) -> None:
        self._now = when


__all__ = ["FakeClock"]
