"""The hypothesis profiles of the property tests.

``ci`` (the default, used by ``make test`` and CI) is derandomized and bounded, so a run
is the same every time and a failure is reproducible from the log, and short enough for
``make test``'s three minutes; ``slow`` (set
``HYPOTHESIS_PROFILE=slow``, as ``make test-slow`` does) is random and far longer.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=200,
    stateful_step_count=50,
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
