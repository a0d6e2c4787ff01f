"""Rich argument and result types (``broker.tasks.arguments``): the JSON form a producer
writes (the table of ``docs/reference/arguments.md``), the typed values the runner gives
the task by its annotations, and the refusals at both ends."""

from __future__ import annotations

import dataclasses
import enum
import json
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.exceptions import InvalidJobError
from broker.jobs import ExecutionMode
from broker.tasks.arguments import encode_arguments, plan_for, to_json_form
from broker.tasks.registry import TaskRegistry, default_unique_key, task
from broker.tasks.runner import Assignment, Completed, Failed
from runners.inline import InlineRunner


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclasses.dataclass(frozen=True)
class Window:
    start: datetime
    days: list[date]


class Price(msgspec.Struct, frozen=True):
    amount: Decimal
    currency: str


WHEN = datetime(2026, 3, 1, 12, 30, 15, 250, tzinfo=UTC)
ID = uuid.UUID("6f1d3c3e-6c3b-4c4e-9d63-2b2a4e1b9c10")

# The table of docs/reference/arguments.md: a value and its JSON form, as written.
JSON_FORMS: list[tuple[Any, Any]] = [
    (WHEN, "2026-03-01T12:30:15.000250Z"),
    (datetime(2026, 3, 1, 8, 0, tzinfo=timezone(timedelta(hours=-5))), "2026-03-01T08:00:00-05:00"),
    (date(2026, 3, 1), "2026-03-01"),
    (ID, "6f1d3c3e-6c3b-4c4e-9d63-2b2a4e1b9c10"),
    (Decimal("19.90"), "19.90"),
    (b"\x00\xffbroker", "AP9icm9rZXI="),
    (Color.RED, "red"),
    (Level.HIGH, 2),
    (
        Window(WHEN, [date(2026, 3, 2)]),
        {"start": "2026-03-01T12:30:15.000250Z", "days": ["2026-03-02"]},
    ),
    (Price(Decimal("5"), "EUR"), {"amount": "5", "currency": "EUR"}),
    ((1, "a"), [1, "a"]),
    ({"k": [WHEN]}, {"k": ["2026-03-01T12:30:15.000250Z"]}),
]


@pytest.mark.parametrize(("value", "form"), JSON_FORMS)
def test_each_type_is_written_in_its_documented_json_form(value: Any, form: Any) -> None:
    written = to_json_form(value, "it")
    assert json.loads(json.dumps(written, allow_nan=False)) == form, "plain JSON, as documented"


def test_a_datetime_in_a_named_zone_is_written_with_its_offset() -> None:
    paris = datetime(2026, 7, 1, 9, 0, tzinfo=ZoneInfo("Europe/Paris"))
    assert to_json_form(paris, "it") == "2026-07-01T09:00:00+02:00"


registry = TaskRegistry()


@task(name="typed", registry=registry)
def typed(
    when: datetime,
    day: date,
    ident: uuid.UUID,
    amount: Decimal,
    blob: bytes,
    color: Color,
    window: Window,
    price: Price,
    loose: Any = None,
    bare=None,  # type: ignore[no-untyped-def]  # unannotated: gets the JSON form
    *more: uuid.UUID,
    **extra: date,
) -> Window:
    return window


@task(name="plain", registry=registry)
def plain(a: int, b: str = "", c: list[dict[str, int]] | None = None) -> dict[str, int]:
    return {}


@task(name="unannotated", registry=registry)
def unannotated(a, b=None):  # type: ignore[no-untyped-def]
    return a


TYPED_ARGS = (WHEN, date(2026, 3, 1), ID, Decimal("1.10"), b"x", Color.BLUE)
WINDOW = Window(WHEN, [date(2026, 3, 2)])
PRICE = Price(Decimal("2.50"), "EUR")


def _through_the_wire(args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What a runner receives: the job's arguments as JSON text, read back."""
    text = json.dumps([list(args), kwargs], allow_nan=False)
    wire_args, wire_kwargs = json.loads(text)
    return tuple(wire_args), wire_kwargs


def test_a_typed_enqueue_writes_the_json_form_and_the_runner_gives_back_the_types() -> None:
    spec = typed.spec((*TYPED_ARGS, WINDOW, PRICE, {"x": 1}, [1], ID), {"due": date(2026, 4, 1)})
    assert spec.args[:4] == ("2026-03-01T12:30:15.000250Z", "2026-03-01", str(ID), "1.10")
    args, kwargs = plan_for(typed.func).decode("typed", *_through_the_wire(spec.args, spec.kwargs))
    assert args == (*TYPED_ARGS, WINDOW, PRICE, {"x": 1}, [1], ID)
    assert kwargs == {"due": date(2026, 4, 1)}
    assert type(args[0]) is datetime and args[0].utcoffset() == timedelta(0)


def test_arguments_by_keyword_are_converted_by_their_parameter() -> None:
    kwargs = {"when": WHEN, "window": WINDOW, "bare": [1], "loose": {"a": 1}}
    spec = typed.spec(TYPED_ARGS[1:2], {})  # any spec: only the keyword path is read here
    assert spec.args == ("2026-03-01",)
    _, encoded = encode_arguments("typed", typed.func, (), kwargs)
    _, decoded = plan_for(typed.func).decode("typed", (), dict(encoded))
    assert decoded == kwargs


def test_unannotated_and_plain_parameters_get_the_json_form_untouched() -> None:
    args = ("2026-03-01", {"x": "1"})
    assert plan_for(unannotated.func).decode("unannotated", args, {}) == (args, {})
    plan = plan_for(plain.func)
    assert not plan.converts, "plain JSON annotations plan no conversion"
    same_args, same_kwargs = (1, "b"), {"c": [{"k": 1}]}
    decoded = plan.decode("plain", same_args, same_kwargs)
    assert decoded[0] is same_args and decoded[1] is same_kwargs, "passed on as they came"


def test_the_plan_is_built_once_per_function() -> None:
    assert plan_for(typed.func) is plan_for(typed.func)


def test_plain_arguments_are_taken_as_they_are() -> None:
    args, kwargs = (1, "a", None, True, 2.5), {"k": "v"}
    assert encode_arguments("plain", plain.func, args, kwargs) == (args, kwargs)
    assert encode_arguments("plain", plain.func, args, kwargs)[0] is args


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (datetime(2026, 1, 1), "naive"),
        ([1, [datetime(2026, 1, 1)]], "naive"),
        ({"w": Window(datetime(2026, 1, 1), [])}, "naive"),
        (Price(Decimal(1), "EUR").__class__(Decimal(1), {1}), "set"),  # type: ignore[arg-type]
        ({1, 2}, "set"),
        (frozenset({1}), "set"),
        (object(), "type object has no JSON form"),
        (Decimal, "type"),
    ],
)
def test_a_typed_enqueue_refuses_what_json_would_not_read_back(value: Any, why: str) -> None:
    with pytest.raises(InvalidJobError, match=why) as raised:
        typed.spec((value,))
    assert "argument 'when' of task 'typed'" in str(raised.value), "names the parameter"
    with pytest.raises(InvalidJobError, match="argument 'loose'"):
        typed.spec((), {"loose": value})


def test_a_value_that_contains_itself_is_refused() -> None:
    loop: list[Any] = [WHEN]
    loop.append(loop)
    with pytest.raises(InvalidJobError, match="contains itself"):
        typed.spec((loop,))


def test_a_value_shared_twice_is_not_taken_for_a_loop() -> None:
    shared = [WHEN]
    spec = typed.spec(({"a": shared, "b": shared},))
    assert spec.args == (
        {"a": ["2026-03-01T12:30:15.000250Z"], "b": ["2026-03-01T12:30:15.000250Z"]},
    )


def test_keys_are_made_from_the_json_form() -> None:
    local = TaskRegistry()

    @task(name="once", registry=local, unique=True, concurrency_key="k:{when}", concurrency_limit=1)
    def once(when: datetime) -> None: ...

    spec = once.spec((WHEN,))
    assert spec.unique_key == default_unique_key("once", ["2026-03-01T12:30:15.000250Z"], {})
    assert spec.concurrency_key == "k:2026-03-01T12:30:15.000250Z"


@pytest.mark.parametrize(
    ("args", "kwargs", "parameter"),
    [
        (("not a time",), {}, "when"),
        ((WHEN.isoformat(), "2026-13-01"), {}, "day"),
        ((), {"ident": "nope"}, "ident"),
        ((), {"color": "green"}, "color"),
        ((), {"window": {"start": "2026-03-01T00:00:00Z"}}, "window"),
        ((), {"due": 5}, "due"),
    ],
)
def test_an_argument_that_does_not_fit_its_annotation_names_the_parameter(
    args: tuple[Any, ...], kwargs: dict[str, Any], parameter: str
) -> None:
    with pytest.raises(InvalidJobError, match=f"argument '{parameter}' of task 'typed'"):
        plan_for(typed.func).decode("typed", args, kwargs)


def test_a_result_is_read_back_typed_by_the_return_annotation() -> None:
    form = to_json_form(WINDOW, "the result")
    assert typed.decode_result(form) == WINDOW
    assert typed.decode_result(None) is None
    assert plain.decode_result({"a": "1"}) == {"a": "1"}, "plain annotation: the JSON form"
    assert unannotated.decode_result(form) == form
    with pytest.raises(InvalidJobError, match="the result of task 'typed'"):
        typed.decode_result({"start": "yesterday", "days": []})


def _assignment(name: str, *args: Any, **kwargs: Any) -> Assignment:
    return Assignment(
        job_id=uuid.uuid4(),
        handoff_id=uuid.uuid4(),
        task=name,
        args=args,
        kwargs=kwargs,
        execution_mode=ExecutionMode.INLINE,
        attempt=1,
        max_attempts=3,
        timeout=None,
        queue="default",
    )


async def test_the_runner_gives_typed_arguments_and_sends_the_json_form_back() -> None:
    local = TaskRegistry()
    seen: list[Any] = []

    @task(name="shift", registry=local, mode="inline")
    async def shift(when: datetime, window: Window) -> Window:
        seen.extend([when, window])
        return Window(when + timedelta(days=1), window.days)

    form = to_json_form(WINDOW, "it")
    outcome = await InlineRunner(local).run(_assignment("shift", WHEN.isoformat(), window=form))
    assert seen == [WHEN, WINDOW]
    assert outcome == Completed({"start": "2026-03-02T12:30:15.000250Z", "days": ["2026-03-02"]}), (
        "the result leaves the runner as JSON"
    )
    assert shift.decode_result(outcome.result) == Window(WHEN + timedelta(days=1), WINDOW.days)


async def test_the_runner_fails_a_bad_argument_without_retry_naming_it() -> None:
    local = TaskRegistry()
    ran: list[Any] = []

    @task(name="daily", registry=local, mode="inline")
    def daily(day: date) -> None:
        ran.append(day)

    outcome = await InlineRunner(local).run(_assignment("daily", "someday"))
    assert isinstance(outcome, Failed)
    assert outcome.retry is False
    assert "argument 'day' of task 'daily'" in outcome.error
    assert ran == [], "the task never ran"


# ------------------------------------------------------------------ the round trip


offsets = st.integers(min_value=-23 * 60 - 59, max_value=23 * 60 + 59).map(
    lambda minutes: timezone(timedelta(minutes=minutes))
)
"""RFC 3339 offsets are whole minutes."""
aware = st.datetimes(
    min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=offsets
)
decimals = st.decimals(allow_nan=False)
windows = st.builds(Window, aware, st.lists(st.dates(), max_size=3))
prices = st.builds(Price, decimals, st.text(max_size=5))

VALUES: dict[Any, st.SearchStrategy[Any]] = {
    datetime: aware,
    date: st.dates(),
    uuid.UUID: st.uuids(),
    Decimal: decimals,
    bytes: st.binary(max_size=32),
    Color: st.sampled_from(Color),
    Level: st.sampled_from(Level),
    Window: windows,
    Price: prices,
    list[datetime]: st.lists(aware, max_size=3),
    dict[str, Decimal]: st.dictionaries(st.text(max_size=5), decimals, max_size=3),
    datetime | None: st.none() | aware,
}


def _same(a: Any, b: Any) -> bool:
    """Equal, and an aware datetime keeps its offset (not only its instant)."""
    if isinstance(a, datetime):
        return a == b and a.utcoffset() == b.utcoffset()
    if isinstance(a, Decimal):
        return a.as_tuple() == b.as_tuple() or (a == b and str(a) == str(b))
    return bool(a == b)


@given(st.sampled_from(list(VALUES)).flatmap(lambda tp: st.tuples(st.just(tp), VALUES[tp])))
def test_every_supported_value_round_trips_by_its_annotation(case: tuple[Any, Any]) -> None:
    annotation, value = case

    def takes(value: Any) -> Any:
        return value

    takes.__annotations__ = {"value": annotation, "return": annotation}
    args, _ = encode_arguments("takes", takes, (value,), {})
    wire_args, _ = _through_the_wire(args, {})
    (decoded,), _ = plan_for(takes).decode("takes", wire_args, {})
    assert _same(value, decoded), (value, wire_args, decoded)
    result = json.loads(json.dumps(to_json_form(value, "result")))
    assert _same(value, plan_for(takes).decode_result("takes", result))


class Opaque:
    """A class of the app's own that msgspec cannot make."""


def test_a_parameter_msgspec_cannot_make_gets_the_json_form_and_the_others_are_converted() -> None:
    def mixed(a: Opaque, b: list[Opaque], c: Unresolvable, d: datetime) -> None:  # type: ignore[name-defined]  # noqa: F821
        ...

    args, _ = plan_for(mixed).decode("mixed", ("x", ["y"], "z", WHEN.isoformat()), {})
    assert args == ("x", ["y"], "z", WHEN)


def test_int_keys_and_tuples_are_converted_plain_dicts_and_lists_are_not() -> None:
    def shapes(a: dict[int, str], b: tuple[int, int], c: dict[str, list[int]]) -> None: ...

    plan = plan_for(shapes)
    assert plan.positional == ("a", "b", None)
    args, _ = plan.decode("shapes", ({"1": "x"}, [1, 2], {"k": [1]}), {})
    assert args == ({1: "x"}, (1, 2), {"k": [1]})


def test_every_typed_enqueue_door_writes_the_json_form() -> None:
    """The transactional enqueue (``enqueue_in``, Django's ``enqueue``) and
    ``task.options(...)`` make their jobs through ``Task.spec`` too."""
    from broker.client.transactional import job_spec

    local = TaskRegistry()

    @task(name="charge", registry=local)
    def charge(when: datetime, *, price: Price) -> None: ...

    by_transaction = job_spec(charge, (WHEN,), {"price": PRICE})
    by_options = charge.options(queue="q").spec(WHEN, price=PRICE)
    for spec in (by_transaction, by_options):
        assert spec.args == ("2026-03-01T12:30:15.000250Z",)
        assert spec.kwargs == {"price": {"amount": "2.50", "currency": "EUR"}}
    with pytest.raises(InvalidJobError, match=r"argument 'when' of task 'charge'.*naive"):
        job_spec(charge, (datetime(2026, 1, 1),), {"price": PRICE})
