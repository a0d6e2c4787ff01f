"""The unit tier's ground rules: no process is started, and the hypothesis profiles.

A unit test runs in this process: a test that needs a child (a fresh interpreter, a
fork, a runner) belongs in ``tests/integration``, and :func:`no_processes` fails it here.

The hypothesis profiles of the property tests:

``ci`` (the default, used by ``make test`` and CI) is derandomized and bounded, so a run
is the same every time and a failure is reproducible from the log, and short enough for
``make test``'s three minutes; ``slow`` (set
``HYPOTHESIS_PROFILE=slow``, as ``make test-slow`` does) is random and far longer.
The chosen profile is loaded for every test, so a ``@given`` without settings of its own
runs it too (hypothesis's default, random and health-checked for speed, failed a property
once on a loaded machine: "input generation is slow").
"""

from __future__ import annotations

import os
import subprocess
from typing import NoReturn

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "slow",
    database=None,
    max_examples=2000,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way a test could start a process fails: ``subprocess`` (which asyncio's
    subprocesses use too), ``os.fork`` and the ``posix_spawn`` calls."""

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError("the unit tier starts no process: this test goes in tests/integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
