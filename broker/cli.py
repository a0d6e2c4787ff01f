"""``python -m broker.cli {main,worker,broker} [options]``: the documented way to run the
three commands without their console scripts. The commands live in :mod:`broker.ops.cli`;
this path stays so that scripts and service files written against it keep working."""

from __future__ import annotations

import runpy

if __name__ == "__main__":  # the working directory is off the path (``broker/__init__``)
    runpy.run_module("broker.ops.cli", run_name="__main__", alter_sys=True)
