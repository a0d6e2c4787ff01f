"""``python -m broker.cli main|worker|broker [options]`` (the documented form, which runs
this) or ``python -m broker.ops.cli ...``: the three commands without their installed
scripts (the working directory is off the path: ``broker/__init__``)."""

from __future__ import annotations

import sys

from broker.ops.cli import broker_entry, main_entry, worker_entry

_COMMANDS = {"main": main_entry, "worker": worker_entry, "broker": broker_entry}

if len(sys.argv) < 2 or sys.argv[1] not in _COMMANDS:
    print(f"usage: python -m broker.cli {{{','.join(_COMMANDS)}}} [options]", file=sys.stderr)
    raise SystemExit(2)
raise SystemExit(_COMMANDS[sys.argv[1]](sys.argv[2:]))
