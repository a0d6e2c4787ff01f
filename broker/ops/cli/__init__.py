"""Command-line entry points: ``broker-main``, ``broker-worker`` and ``broker``.

Every option can also come from a ``BROKER_*`` environment variable, named in
``--help``; the flags of a process's settings are built from its settings table
(:mod:`broker.ops.cli.options`). The ``*_entry`` functions only parse and run; they return
an exit code so tests can call them in-process.

``options`` holds the one mechanism for flags and variables, ``main``, ``worker`` and
``broker`` one parser each, and ``run`` what a parsed command runs. Each command imports
only its own module (``__main__``, :mod:`broker.ops.launch`): the names below load on
first use, so ``broker status`` never loads the main and a worker never loads the
operator's commands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.model.lazy import lazy_exports

if TYPE_CHECKING:
    from broker.ops.cli.broker import (
        broker_entry,
        broker_parser,
        operator_credential,
        run_broker,
    )
    from broker.ops.cli.main import DEFAULT_DATABASE_URL, main_entry, main_parser
    from broker.ops.cli.options import parse
    from broker.ops.cli.run import load_apps, run_main, run_worker, use_app_directory
    from broker.ops.cli.worker import worker_entry, worker_parser

__getattr__ = lazy_exports(
    globals(),
    {
        "broker_entry": "broker.ops.cli.broker",
        "broker_parser": "broker.ops.cli.broker",
        "operator_credential": "broker.ops.cli.broker",
        "run_broker": "broker.ops.cli.broker",
        "DEFAULT_DATABASE_URL": "broker.ops.cli.main",
        "main_entry": "broker.ops.cli.main",
        "main_parser": "broker.ops.cli.main",
        "parse": "broker.ops.cli.options",
        "load_apps": "broker.ops.cli.run",
        "run_main": "broker.ops.cli.run",
        "run_worker": "broker.ops.cli.run",
        "use_app_directory": "broker.ops.cli.run",
        "worker_entry": "broker.ops.cli.worker",
        "worker_parser": "broker.ops.cli.worker",
    },
)

__all__ = [
    "DEFAULT_DATABASE_URL",
    "broker_entry",
    "broker_parser",
    "load_apps",
    "main_entry",
    "main_parser",
    "operator_credential",
    "parse",
    "run_broker",
    "run_main",
    "run_worker",
    "use_app_directory",
    "worker_entry",
    "worker_parser",
]
