"""``python -m broker.cli main|worker|broker [options]`` (the documented form, which runs
this) or ``python -m broker.ops.cli ...``: the three commands without their installed
scripts (the working directory is off the path: ``broker/__init__``). Only the named
command's module is imported."""

from __future__ import annotations

import importlib
import sys

_COMMANDS = ("main", "worker", "broker")

if len(sys.argv) < 2 or sys.argv[1] not in _COMMANDS:
    print(f"usage: python -m broker.cli {{{','.join(_COMMANDS)}}} [options]", file=sys.stderr)
    raise SystemExit(2)
_module = importlib.import_module(f"broker.ops.cli.{sys.argv[1]}")
raise SystemExit(getattr(_module, f"{sys.argv[1]}_entry")(sys.argv[2:]))
