"""When a schedule fires: cron expressions in a time zone, and fixed intervals.

Every tick is a UTC instant. Cron expressions are evaluated by cronsim, which follows
Debian's (Vixie) cron, daylight-saving quirks included; this module adds the shorthands
(``@daily``...), insists on five fields and one explicit IANA time zone, and turns
cronsim's answers into the two questions the scheduler asks: the first tick strictly after
an instant, and the last one at or before it.

Across daylight-saving changes (Debian cron's rule): an expression whose minute and hour
fields both name times (``30 2 * * *``, ``0 2,14 * * *``) runs at wall-clock times, so a
time the clocks skip over runs once, at the first minute after the gap, and a time that
happens twice runs once, at its first occurrence. An expression whose minute or hour
field starts with ``*`` (``0 * * * *``, ``0 */6 * * *``, ``*/15 1 * * *``) follows
elapsed time: a repeated hour runs again, and a skipped hour does not run.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from broker.exceptions import ConfigurationError

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
"""Where fixed intervals are anchored: every main derives the same ticks from it."""

_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
_VALUES = {
    "minute": "0-59",
    "hour": "0-23",
    "day-of-month": "1-31, on a day the given month(s) have",
    "month": "1-12 or jan-dec",
    "day-of-week": "0-7 (0 and 7 are Sunday) or sun-sat",
}
_SEARCH_YEARS = 50
"""cronsim's horizon: an expression with no tick within it never fires in practice."""


def aware(name: str, value: datetime) -> datetime:
    """``value`` in UTC; a naive datetime is refused, as its instant is unknown."""
    if value.tzinfo is None:
        raise ValueError(f"{name} must be timezone-aware (got naive {value.isoformat()})")
    return value.astimezone(UTC)


def _zone(timezone: str) -> ZoneInfo:
    try:
        return ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ConfigurationError(
            f"timezone {timezone!r} is not a known IANA time zone (such as 'UTC' or "
            "'Europe/Paris'); on systems without a zone database, install the tzdata package"
        ) from exc


class Trigger(Protocol):
    """When a schedule fires: every tick is a UTC instant."""

    def next_after(self, when: datetime) -> datetime:
        """The first tick strictly after ``when``."""

    def latest_at_or_before(self, when: datetime) -> datetime:
        """The last tick at or before ``when``."""


class CronExpression:
    """A 5-field cron expression evaluated in one explicit time zone."""

    def __init__(self, expression: str, timezone: str) -> None:
        if not isinstance(expression, str) or not expression.strip():
            raise ConfigurationError("cron expression must be a non-empty string")
        self.expression = expression.strip()
        self.timezone = timezone
        self.zone = _zone(timezone)
        text = self.expression
        if text.startswith("@"):
            if text.lower() not in _ALIASES:
                raise ConfigurationError(
                    f"cron expression {text!r}: unknown shorthand; use one of "
                    + ", ".join(_ALIASES)
                )
            text = _ALIASES[text.lower()]
        parts = text.split()
        # cronsim also takes a leading seconds field; a 6-field line is a mistake here.
        if len(parts) != len(_FIELDS):
            raise ConfigurationError(
                f"cron expression {self.expression!r} has {len(parts)} fields; expected 5: "
                "minute hour day-of-month month day-of-week"
            )
        self._text = text
        try:
            CronSim(text, EPOCH)
        except CronSimError as exc:
            # cronsim names the field only ("Bad minute"); point at its text and the values.
            field = str(exc).removeprefix("Bad ")
            part = parts[_FIELDS.index(field)] if field in _FIELDS else text
            raise ConfigurationError(
                f"cron expression {self.expression!r}: {field} field {part!r} is not valid; "
                f"use {_VALUES.get(field, 'the values of that field')}, *, lists a,b, "
                "ranges a-b or steps */n, a-b/n, a/n"
            ) from None

    def __repr__(self) -> str:
        return f"CronExpression({self.expression!r}, {self.timezone!r})"

    def _first(self, start: datetime, *, reverse: bool = False) -> datetime:
        try:
            return next(CronSim(self._text, start.astimezone(self.zone), reverse=reverse))
        except StopIteration:
            raise ConfigurationError(f"{self!r} has no tick within {_SEARCH_YEARS} years") from None

    def next_after(self, when: datetime) -> datetime:
        after = aware("when", when)
        tick = self._first(after).astimezone(UTC)
        # cronsim walks wall-clock time for fixed-time expressions, so from inside a
        # repeated hour it can answer the hour's first pass, which is already past.
        while tick <= after:
            tick = self._first(tick).astimezone(UTC)
        return tick

    def latest_at_or_before(self, when: datetime) -> datetime:
        until = aware("when", when)
        # cronsim steps back one second before searching unless it drops microseconds:
        # start a second on so that ``when`` itself can match.
        start = until.replace(microsecond=0) + timedelta(seconds=1)
        tick = self._first(start, reverse=True).astimezone(UTC)
        # Walking wall-clock time backwards from inside a repeated hour can skip that
        # hour's first-pass ticks; going forward from the answer finds them.
        while (later := self.next_after(tick)) <= until:
            tick = later
        return tick


class Interval:
    """Ticks every ``every``, at whole multiples of it since the Unix epoch (UTC)."""

    def __init__(self, every: timedelta) -> None:
        if not isinstance(every, timedelta):
            raise ConfigurationError(f"every must be a datetime.timedelta (got {every!r})")
        if every < timedelta(seconds=1):
            raise ConfigurationError(f"every must be at least one second (got {every})")
        self.every = every

    def __repr__(self) -> str:
        return f"Interval({self.every!r})"

    def latest_at_or_before(self, when: datetime) -> datetime:
        return EPOCH + ((aware("when", when) - EPOCH) // self.every) * self.every

    def next_after(self, when: datetime) -> datetime:
        return self.latest_at_or_before(when) + self.every
