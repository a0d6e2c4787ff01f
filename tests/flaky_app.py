"""A task module whose import fails while the file named by FLAKY_APP_FAIL_IMPORT exists.

The failing import deletes the file when ``FLAKY_APP_FAIL_ONCE`` is set, so the module
fails on its first import only, like an app whose dependency comes up a little late.
"""

from __future__ import annotations

import os

from broker.tasks import task

_marker = os.environ.get("FLAKY_APP_FAIL_IMPORT")
if _marker and os.path.exists(_marker):
    if os.environ.get("FLAKY_APP_FAIL_ONCE"):
        os.remove(_marker)
    raise ImportError(f"simulated start-up failure ({_marker} exists)")


@task(mode="pooled")
def ok() -> int:
    return os.getpid()
