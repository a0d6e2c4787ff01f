"""A task taking and returning every rich argument type, for
``tests/e2e/test_argument_types.py`` (loaded by worker processes with
``--app tests.argtypes_app``)."""

from __future__ import annotations

import dataclasses
import enum
import uuid
from datetime import date, datetime, timedelta
from decimal import Decimal

import msgspec

from broker.tasks.registry import task


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class Window:
    start: datetime
    days: list[date]


class Price(msgspec.Struct, frozen=True):
    amount: Decimal
    currency: str


@dataclasses.dataclass(frozen=True)
class Report:
    """What the task saw (the types it received, by name) and values made from them."""

    seen: list[str]
    later: datetime
    next_day: date
    ident: uuid.UUID
    doubled: Decimal
    reversed_blob: bytes
    color: Color
    window: Window
    price: Price


@task(name="argtypes.report")
def report(
    when: datetime,
    day: date,
    ident: uuid.UUID,
    amount: Decimal,
    blob: bytes,
    color: Color,
    window: Window,
    *,
    price: Price,
) -> Report:
    values = [when, day, ident, amount, blob, color, window, price]
    return Report(
        seen=[type(v).__name__ for v in values],
        later=when + timedelta(hours=1),
        next_day=day + timedelta(days=1),
        ident=ident,
        doubled=amount * 2,
        reversed_blob=blob[::-1],
        color=color,
        window=window,
        price=price,
    )
