"""What importing a module drags in: a client must not load the main, the adapters, the
runners or SQLAlchemy, so that a web app enqueueing jobs pays for the protocol only; a
runner's child must not load the client or the cron library. Each is asked of a fresh
interpreter, so these live in the integration tier."""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_after_import(module: str) -> set[str]:
    """The modules a fresh interpreter holds after importing ``module`` (a fresh one, since
    this test process has long since imported everything)."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    return set(json.loads(out.stdout))


def test_importing_the_client_does_not_import_the_main_or_the_store() -> None:
    # The package loads its modules on first use: import both clients themselves.
    loaded = _modules_after_import("broker.client.client, broker.client.sync")
    assert "broker.client.client" in loaded
    # The one rule of the core the client shares: when to try a main again (a pure module
    # of a few lines, the worker's reconnect backoff); nothing of the main's core.
    shared = {"broker.core", "broker.core.reconnect"}
    unwanted = sorted(
        name
        for name in loaded - shared
        if name in {"adapters", "runners", "sqlalchemy"}
        or name.startswith(
            ("broker.main", "broker.worker", "broker.core", "adapters.", "runners.", "sqlalchemy.")
        )
    )
    assert unwanted == []


def test_importing_broker_loads_neither_the_client_nor_the_cron_library() -> None:
    loaded = _modules_after_import("broker.tasks.runner")
    assert loaded.isdisjoint({"broker.client.client", "broker.tasks.registry", "anyio", "cronsim"})


def test_the_main_and_the_operators_command_load_no_runner() -> None:
    # The runners (child processes, their pipes) are the worker's: the main's command and
    # the ``broker`` command import the composition root for the store alone.
    for command in ("broker.ops.cli.main", "broker.ops.cli.broker"):
        loaded = _modules_after_import(command)
        assert "broker.ops.composition" in loaded
        assert sorted(name for name in loaded if name.split(".")[0] == "runners") == [], command


def test_the_sqlite_store_loads_no_postgresql_dialect() -> None:
    # SQLAlchemy's PostgreSQL dialect imports every PostgreSQL driver's module: about
    # 30 ms of each SQLite main's start-up, for index options only PostgreSQL's DDL reads.
    loaded = _modules_after_import("adapters.sql.adapter, adapters.sql.sqlite")
    assert "sqlalchemy.dialects.sqlite" in loaded
    assert sorted(n for n in loaded if n.startswith("sqlalchemy.dialects.postgresql")) == []
