"""A SQLite store takes one main: a second ``broker-main`` on the same file refuses to
start with a message that says why, while the first keeps serving, and the operator's
command and an application's transactional enqueue still reach the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from adapters.sql import SQLAlchemyAdapter
from broker.jobs import JobSpec

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}


def _main_argv(url: str) -> list[str]:
    return [sys.executable, "-m", "broker.ops.cli", "main", "--database-url", url, "--port", "0"]


def _broker_argv(main: str) -> list[str]:
    return [sys.executable, "-m", "broker.ops.cli", "broker", "--main", main]


@contextmanager
def _first_main(url: str) -> Iterator[int]:
    """A running broker-main on ``url``; yields its port once it listens."""
    proc = subprocess.Popen(
        [*_main_argv(url), "--log-format", "json"],
        cwd=REPO,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    reader: threading.Thread | None = None
    try:
        assert proc.stderr is not None
        port = None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            record = json.loads(line)
            if record.get("event") == "listening":
                port = int(record["port"])
                break
        assert port is not None, f"the first main did not start: {''.join(seen)}"
        # Keep reading its log, so a full pipe never blocks it.
        reader = threading.Thread(target=proc.stderr.read, daemon=True)
        reader.start()
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if reader is not None:
            reader.join(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()


def test_a_second_main_on_one_sqlite_file_refuses_to_start(tmp_path: Path) -> None:
    db = tmp_path / "broker.db"
    url = f"sqlite+aiosqlite:///{db}"
    with _first_main(url) as port:
        second = subprocess.run(
            _main_argv(url), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 1, second.stderr
        assert "another broker-main (pid " in second.stderr
        assert "already running on this SQLite store" in second.stderr
        assert f"{db}.main.lock" in second.stderr
        assert "Traceback" not in second.stderr

        # The first main still serves, and the operator's command reads through it.
        status = subprocess.run(
            [*_broker_argv(f"127.0.0.1:{port}"), "status", "--json"],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr


async def test_apps_and_the_store_fallback_still_open_a_locked_file(tmp_path: Path) -> None:
    db = tmp_path / "broker.db"
    url = f"sqlite+aiosqlite:///{db}"
    with _first_main(url):
        # An application's transactional enqueue opens the file, not the main's lock.
        store = SQLAlchemyAdapter(url)
        try:
            await store.setup()
            engine = sa.create_engine(f"sqlite:///{db}")
            with engine.begin() as conn:
                store.enqueue_in_sync_transaction(conn, [JobSpec(task="tests.e2e_app.noop")])
            engine.dispose()
        finally:
            await store.close()
        # The operator's command on the store itself, as when the main is unreachable.
        listing = subprocess.run(
            [*_broker_argv("127.0.0.1:1"), "--database-url", url, "jobs", "--json"],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listing.returncode == 0, listing.stderr
        assert "tests.e2e_app.noop" in listing.stdout


def test_the_lock_is_dropped_when_the_main_stops(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}"
    with _first_main(url):
        pass
    with _first_main(url):  # would refuse if the first had left its lock held
        pass
