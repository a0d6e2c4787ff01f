"""The new release of a rolling deploy (``tests/e2e/test_routing.py``): the tasks of
``tests.e2e_app`` (the old release) and one task the old release does not have."""

from __future__ import annotations

import os

from broker import task
from tests.e2e_app import _log


@task(mode="inline")
async def new_report(key: str) -> int:
    """A task only the new release's workers run: logs the run, returns its pid."""
    _log("start", key)
    _log("end", key)
    return os.getpid()
