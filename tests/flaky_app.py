"""A task module whose import fails while the file named by FLAKY_APP_FAIL_IMPORT exists.

The failing import deletes the file when ``FLAKY_APP_FAIL_ONCE`` is set, so the module
fails on its first import only, like an app whose dependency comes up a little late.

With ``FLAKY_APP_ALTERNATE`` naming a file, every other import fails (the 1st, the 3rd,
...; each import adds a byte to the file): with one forked slot, every process started
for a job fails while every probe process between them starts, the way a start-up that
fails now and then keeps handing one job back.
"""

from __future__ import annotations

import os

from broker.tasks.registry import task

_marker = os.environ.get("FLAKY_APP_FAIL_IMPORT")
if _marker and os.path.exists(_marker):
    if os.environ.get("FLAKY_APP_FAIL_ONCE"):
        os.remove(_marker)
    raise ImportError(f"simulated start-up failure ({_marker} exists)")

_alternate = os.environ.get("FLAKY_APP_ALTERNATE")
if _alternate:
    with open(_alternate, "ab") as _imports:
        _imports.write(b".")
        _count = _imports.tell()
    if _count % 2:
        raise ImportError(f"simulated start-up failure (import {_count})")


@task(mode="pooled")
def ok() -> int:
    return os.getpid()
