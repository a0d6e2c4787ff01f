"""A task's argument check, which a worker runs on every job: bound once per call shape
(the number of positional arguments and the keywords' names), it must answer exactly as
binding every call would."""

from __future__ import annotations

import inspect
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from broker.tasks.registry import TaskRegistry, task

registry = TaskRegistry()


@task(name="shapes", registry=registry)
def shapes(a: int, b: int = 0, /, c: int = 0, *, d: int, e: int = 0) -> None:
    """Positional-only, either-way and keyword-only parameters, with and without defaults."""


NAMES = ["a", "b", "c", "d", "e", "f"]
calls = st.tuples(
    st.integers(min_value=0, max_value=4),
    st.lists(st.sampled_from(NAMES), unique=True, max_size=4),
)


def _binds(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        inspect.signature(shapes.func).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _checks(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        shapes.check_arguments(args, kwargs)
    except TypeError as exc:
        assert "cannot take these arguments" in str(exc)
        return False
    return True


@given(st.lists(calls, min_size=1, max_size=12))
def test_every_call_is_judged_as_binding_it_would(sequence: list[Any]) -> None:
    # A sequence of calls, so later ones meet shapes an earlier one left remembered.
    for count, names in sequence:
        args = tuple(range(count))
        kwargs = dict.fromkeys(names, 1)
        assert _checks(args, kwargs) == _binds(args, kwargs), (count, names)
