"""One way to check a setting, wherever it is set (the main, a worker, a runner, retention).

Each check returns the value it accepts, so it can stand where the value is stored, and
refuses a bad one with a :class:`~broker.exceptions.ConfigurationError` worded the same
way everywhere: ``<name> must be <rule> (got <value>)``. Settings are checked when they
are built, before anything starts, so a typo in a flag fails at once and by name instead
of as a stuck loop later. ``bool`` is refused where a number is wanted: ``True`` is an
``int`` to Python but never a count anyone meant.

The wire's values are checked elsewhere (:mod:`broker.model.values`), as ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from broker.exceptions import ConfigurationError

_T = TypeVar("_T")


def refuse(name: str, rule: str, value: object, why: str | None = None) -> ConfigurationError:
    """The one wording of a refused setting, with the reason for the rule if it is not
    plain."""
    return ConfigurationError(
        f"{name} must be {rule} (got {value!r})" + (f": {why}" if why else "")
    )


def require(condition: bool, message: str) -> None:
    """For a rule between settings (one longer than another), which has no one value."""
    if not condition:
        raise ConfigurationError(message)


def _number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)


def positive(name: str, value: float) -> float:
    """A finite number above zero (a duration, a size)."""
    if not (_number(value) and value > 0):
        raise refuse(name, "positive", value)
    return value


def non_negative(name: str, value: float) -> float:
    """A finite number of at least zero (a grace period, where zero means none)."""
    if not (_number(value) and value >= 0):
        raise refuse(name, "zero or positive", value)
    return value


def positive_int(name: str, value: int) -> int:
    """A whole count of at least one."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise refuse(name, "a positive integer", value)
    return value


def non_negative_int(name: str, value: int) -> int:
    """A whole count where zero means off."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise refuse(name, "zero or a positive integer", value)
    return value


def int_in_range(name: str, value: int, low: int, high: int, *, why: str | None = None) -> int:
    """A whole number from ``low`` to ``high``, both included."""
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
        raise refuse(name, f"{low}-{high}", value, why)
    return value


def positive_duration(name: str, value: timedelta) -> timedelta:
    if not (isinstance(value, timedelta) and value > timedelta(0)):
        raise refuse(name, "a positive duration", value)
    return value


def optional(check: Callable[[str, _T], _T], name: str, value: _T | None) -> _T | None:
    """``check`` for a setting where ``None`` means "no limit" (or "use the default")."""
    return None if value is None else check(name, value)
