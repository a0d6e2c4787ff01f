"""The one style of settings checks (broker/model/checks.py): what each accepts and its wording."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest

from broker.exceptions import ConfigurationError
from broker.main.retention import Retention
from broker.main.settings import MainSettings
from broker.model import checks

CASES: list[tuple[Any, list[Any], list[Any], str]] = [
    (checks.positive, [0.1, 1, 10**30], [0, -1, math.inf, math.nan, True, "1"], "positive"),
    (checks.non_negative, [0, 0.5], [-0.1, math.inf, math.nan, False], "zero or positive"),
    (checks.positive_int, [1, 7], [0, -1, 1.5, True, "4"], "a positive integer"),
    (checks.non_negative_int, [0, 3], [-1, 0.5, True], "zero or a positive integer"),
    (checks.positive_duration, [timedelta(seconds=1)], [timedelta(0), 5], "a positive duration"),
]


@pytest.mark.parametrize(("check", "good", "bad", "rule"), CASES)
def test_each_check(check: Any, good: list[Any], bad: list[Any], rule: str) -> None:
    for value in good:
        assert check("x", value) == value
    for value in bad:
        with pytest.raises(ConfigurationError) as caught:
            check("x", value)
        assert str(caught.value) == f"x must be {rule} (got {value!r})"


def test_range_optional_and_require() -> None:
    assert checks.int_in_range("port", 0, 0, 65535) == 0
    with pytest.raises(ConfigurationError, match=r"^port must be 0-65535 \(got 65536\): why$"):
        checks.int_in_range("port", 65536, 0, 65535, why="why")
    assert checks.optional(checks.positive, "t", None) is None
    with pytest.raises(ConfigurationError, match=r"^t must be positive \(got 0\)$"):
        checks.optional(checks.positive, "t", 0)
    checks.require(True, "never shown")
    with pytest.raises(ConfigurationError, match=r"^a before b$"):
        checks.require(False, "a before b")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MainSettings(poll_interval=math.inf).validate(), "poll_interval must be positive"),
        (lambda: MainSettings(orphan_grace=-1).validate(), "orphan_grace must be zero or positive"),
        (lambda: MainSettings(port=70000).validate(), "port must be 0-65535"),
        (lambda: Retention(batch_size=0), "batch_size must be a positive integer"),
        (lambda: Retention(dead_ttl=timedelta(0)), "dead_ttl must be a positive duration"),
    ],
)
def test_settings_use_the_one_wording(build: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=f"^{message} "):
        build()
