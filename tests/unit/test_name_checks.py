"""``check_name``: the fast path for printable ASCII says what the full rule says."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.model.bounds import MAX_NAME_BYTES
from broker.model.values import _FORBIDDEN, check_name


@given(st.text(), st.integers(min_value=0, max_value=40))
def test_a_name_is_refused_exactly_when_the_rule_says(value: str, max_bytes: int) -> None:
    too_long = len(value.encode("utf-8", "surrogatepass")) > max_bytes
    if too_long or _FORBIDDEN.search(value):
        with pytest.raises(ValueError):
            check_name("name", value, max_bytes)
    else:
        check_name("name", value, max_bytes)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("t" * MAX_NAME_BYTES, True),
        ("t" * (MAX_NAME_BYTES + 1), False),
        ("é" * (MAX_NAME_BYTES // 2), True),  # two bytes each
        ("é" * (MAX_NAME_BYTES // 2 + 1), False),
        ("x" * (40 << 20), False),  # refused by its length alone, without a scan
    ],
)
def test_every_name_is_at_most_1024_bytes(value: str, ok: bool) -> None:
    if ok:
        check_name("task", value)
    else:
        with pytest.raises(ValueError, match="at most 1024 bytes"):
            check_name("task", value)


@pytest.mark.parametrize("value", ["a\x00b", "tab\there", "del\x7f", "line\nbreak"])
def test_ascii_controls_are_refused(value: str) -> None:
    with pytest.raises(ValueError, match="control characters"):
        check_name("task", value)
