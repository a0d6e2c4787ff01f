"""One row of a settings table: a dataclass field that also carries its flag, its help and
its rule.

Each process has one settings dataclass (the main's, the worker's, the runners', retention's).
A field made with :func:`setting` holds its default once; the command line
(:mod:`broker.ops.cli.options`) builds each flag and its ``BROKER_*`` variable from the
row, and the dataclass's ``validate`` runs the same row's ``check``, so a rule and its
wording (:mod:`broker.model.checks`) are written once, and a bad flag or variable is refused
in the words a bad constructor argument gets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from broker.exceptions import ConfigurationError

Check = Callable[[str, Any], object]
"""``check(name, value)``: a rule from :mod:`broker.model.checks`; raises to refuse."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """What the command line needs to know about a field (its default is the field's)."""

    help: str | None = None
    """The flag's help; ``None``: the field has no flag (only its rule)."""
    flag: str | None = None
    """``--the-flag``; default: the field's name with dashes."""
    parse: Callable[[str], Any] = str
    """Text (of the flag or its variable) to value; ``bool`` makes a switch, ``list`` a
    repeatable flag whose variable is comma-separated."""
    check: Check | None = None
    """The rule, run on a value that is not ``None`` (``None`` means "none" or "derived")."""
    metavar: str | None = None
    derived: bool = False
    """The flag's default is ``None``: when it is not given, the value is derived from other
    flags (``max_line_bytes`` from the payload and checkpoint limits)."""


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Callable[[], Any] | None = None,
    help: str | None = None,
    flag: str | None = None,
    parse: Callable[[str], Any] = str,
    check: Check | None = None,
    metavar: str | None = None,
    derived: bool = False,
) -> Any:
    """A dataclass field with its row of the table (see :class:`Setting`)."""
    row = Setting(help, flag, parse, check, metavar, derived)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"setting": row})
    return dataclasses.field(default=default, metadata={"setting": row})


def rows(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    """The fields of a settings dataclass that are rows of its table, in order."""
    for field in dataclasses.fields(cls):
        row = field.metadata.get("setting")
        if isinstance(row, Setting):
            yield field, row


def default_of(field: dataclasses.Field[Any]) -> Any:
    """The field's default, made now if it has a factory."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def check_rows(settings: object) -> None:
    """Run every row's rule on the value ``settings`` holds (a ``validate`` calls this
    first, then checks the rules between fields)."""
    for field, row in rows(type(settings)):
        value = getattr(settings, field.name)
        if row.check is not None and value is not None:
            row.check(field.name, value)


def flag_of(field: dataclasses.Field[Any], row: Setting) -> str:
    return row.flag or "--" + field.name.replace("_", "-")


def comma_list(text: str) -> tuple[str, ...]:
    """``a, b,,c`` to ``("a", "b", "c")``."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def seconds(text: str) -> float:
    """Seconds, written as a number of seconds or with a unit: ``30s``, ``15m``, ``12h``, ``7d``."""
    number, unit = text.strip(), 1.0
    if number[-1:].lower() in _UNITS:
        number, unit = number[:-1], _UNITS[number[-1].lower()]
    try:
        value = float(number) * unit
    except ValueError:
        raise ConfigurationError(
            f"expected a duration such as 90, 30s, 15m, 12h or 7d (got {text!r})"
        ) from None
    if not 0 <= value < float("inf"):
        raise ConfigurationError(f"a duration must be 0 or more (got {text!r})")
    return value


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def age(text: str) -> timedelta | None:
    """A retention age (:func:`seconds`); 0 keeps that class of jobs forever (``None``)."""
    value = seconds(text)
    return timedelta(seconds=value) if value > 0 else None
