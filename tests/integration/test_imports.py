"""What importing a module drags in: a client must not load the main, the adapters, the
runners or SQLAlchemy, so that a web app enqueueing jobs pays for the protocol only; a
runner's child must not load the client or the cron library. Each is asked of a fresh
interpreter, so these live in the integration tier."""

from __future__ import annotations

import json
import os
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


_UNTRACED = """
import json, os, sys
import broker.client.client, broker.ops.cli.broker, broker.ops.cli.main, runners.child
from broker.model import tracing
assert tracing.ENABLED and tracing.current_ids() is None and tracing.inject() is None
span = tracing.start_run("t", "job-1", "default", 1, None)
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
print(json.dumps([span is not None, loaded]))
"""


def _untraced(env: dict[str, str]) -> tuple[bool, list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", _UNTRACED], check=True, capture_output=True, text=True, env=env
    )
    spanned, modules = json.loads(out.stdout)
    return spanned, modules


def test_opentelemetry_is_imported_only_once_the_process_uses_it() -> None:
    """Installed but unused (no span started, no provider set): no process imports it,
    and a run starts no span. A provider named in the environment, which the API loads
    on first use, is a use: a run's span is then the provider's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    assert _untraced(env) == (False, [])
    spanned, modules = _untraced({**env, "OTEL_PYTHON_TRACER_PROVIDER": "sdk_tracer_provider"})
    assert spanned and "opentelemetry.sdk.trace" in modules
