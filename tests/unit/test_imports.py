"""What importing a module drags in: a client must not load the main, the adapters, the
runners or SQLAlchemy, so that a web app enqueueing jobs pays for the protocol only."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path


def _modules_after_import(module: str) -> set[str]:
    """The modules a fresh interpreter holds after importing ``module`` (a fresh one, since
    this test process has long since imported everything)."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    return set(json.loads(out.stdout))


def test_importing_the_client_does_not_import_the_main_or_the_store() -> None:
    loaded = _modules_after_import("broker.client")
    assert "broker.client" in loaded
    unwanted = sorted(
        name
        for name in loaded
        if name in {"broker.main", "broker.worker", "adapters", "runners", "sqlalchemy"}
        or name.startswith(("adapters.", "runners.", "sqlalchemy."))
    )
    assert unwanted == []


PURE = ("handoff", "worker_state", "settlement", "codec", "operations", "error_codes", "values")
"""The rule modules: events in, effects out, no I/O (see docs/contributing.md)."""

IO = {"asyncio", "socket", "selectors", "ssl", "subprocess", "sqlalchemy", "asyncpg", "aiosqlite"}


def test_the_rule_modules_import_no_io() -> None:
    """Checked on the source, since ``broker`` as a whole does import asyncio: what matters
    is that a rule module never reaches for it itself (the shells around it do)."""
    root = Path(__file__).resolve().parents[2] / "broker"
    for name in PURE:
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert not imported & IO, (name, sorted(imported & IO))
