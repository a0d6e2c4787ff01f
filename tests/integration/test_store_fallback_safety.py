"""The operator's ``broker`` never harms a store: with the main down it opens the store
as it stands, never creates a file, a table or a schema, never migrates, and says
which of missing, older or newer it found. Only ``broker migrate`` (and broker-main)
create or migrate."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import sqlalchemy as sa

from adapters.sql import SQLAlchemyAdapter
from broker.jobs import JobSpec
from broker.ops import cli
from broker.storage import SCHEMA_VERSION
from tests.conftest import require_postgres


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.broker_entry(["--main", f"127.0.0.1:{_closed_port()}", *argv])
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


async def _broker(*argv: str) -> tuple[int, str, str]:
    return await asyncio.to_thread(_run, *argv)


# ------------------------------------------------------------------------ SQLite


@pytest.mark.parametrize(
    "command",
    [("status",), ("jobs",), ("enqueue", "app.x"), ("prune", "--older-than", "7d")],
    ids=lambda c: c[0],
)
async def test_a_missing_sqlite_file_is_refused_and_not_created(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    path = tmp_path / "typo.db"
    code, out, err = await _broker("--database-url", f"sqlite+aiosqlite:///{path}", *command)
    assert code == 1 and out == ""
    assert "there is no store at" in err and "does not exist" in err
    assert list(tmp_path.iterdir()) == [], "no file, no -wal, no -shm left behind"


async def _store_at(path: Path) -> str:
    url = f"sqlite+aiosqlite:///{path}"
    store = SQLAlchemyAdapter(url)
    await store.setup()
    await store.enqueue(JobSpec(task="app.x"))
    await store.close()
    return url


async def _set_version(url: str, version: int) -> None:
    engine = sa.create_engine(url.replace("+aiosqlite", ""))
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE broker_schema SET version = ?", (version,))
    engine.dispose()


async def test_a_newer_schema_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    url = await _store_at(tmp_path / "b.db")
    await _set_version(url, SCHEMA_VERSION + 1)
    code, _, err = await _broker("--database-url", url, "status")
    assert code == 1
    assert f"schema version {SCHEMA_VERSION + 1}" in err and "upgrade the broker" in err


async def test_an_older_schema_is_refused_not_migrated(tmp_path: Path) -> None:
    url = await _store_at(tmp_path / "b.db")
    await _set_version(url, SCHEMA_VERSION - 1)
    for command in (("status",), ("cancel", str(uuid.uuid4()))):
        code, _, err = await _broker("--database-url", url, *command)
        assert code == 1
        assert f"schema version {SCHEMA_VERSION - 1}, older" in err
        assert "broker --database-url URL migrate" in err and "broker-main" in err
    engine = sa.create_engine(url.replace("+aiosqlite", ""))
    with engine.connect() as conn:
        version = conn.exec_driver_sql("SELECT version FROM broker_schema").scalar_one()
    engine.dispose()
    assert version == SCHEMA_VERSION - 1, "the CLI did not migrate it"


async def test_a_file_that_is_not_a_broker_store_is_refused_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE notes (body TEXT)")
    engine.dispose()
    before = path.read_bytes()
    code, _, err = await _broker("--database-url", f"sqlite+aiosqlite:///{path}", "enqueue", "a.b")
    assert code == 1 and "holds no broker schema" in err
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]


async def test_migrate_is_the_explicit_way_to_create_or_migrate(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'new.db'}"
    code, out, _ = await _broker("--database-url", url, "migrate", "--json")
    assert code == 0 and f'"schema_version": {SCHEMA_VERSION}' in out
    code, out, err = await _broker("--database-url", url, "status", "--json")
    assert code == 0 and '"source": "store"' in out, err


async def test_a_memory_store_cannot_be_a_fallback() -> None:
    code, _, err = await _broker("--database-url", "memory://", "status")
    assert code == 1 and "memory:// lives inside the broker-main process" in err


# ------------------------------------------------------------------------ PostgreSQL


@contextlib.asynccontextmanager
async def _fresh_database() -> AsyncIterator[str]:
    """A new, empty PostgreSQL database, dropped afterwards; yields its URL."""
    url = require_postgres()
    name = f"broker_empty_{uuid.uuid4().hex[:10]}"
    admin_dsn = url.replace("postgresql+asyncpg://", "postgresql://", 1)
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    base = url.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        conn = await asyncpg.connect(admin_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


async def _tables(url: str) -> list[str]:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        rows = await conn.fetch(
            "SELECT table_schema || '.' || table_name AS t FROM information_schema.tables "
            "WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
        )
    finally:
        await conn.close()
    return [r["t"] for r in rows]


@pytest.mark.postgres
async def test_an_empty_postgres_database_is_refused_and_left_empty() -> None:
    async with _fresh_database() as url:
        for command in (("status",), ("jobs", "--json"), ("enqueue", "app.x", "[1]")):
            code, out, err = await _broker("--database-url", url, *command)
            assert code == 1 and out == "", command
            assert "holds no broker schema" in err and "Check the store URL" in err
        assert await _tables(url) == [], "not one table was created"


@pytest.mark.postgres
async def test_a_reading_command_on_postgres_runs_read_only() -> None:
    async with _fresh_database() as url:
        store = SQLAlchemyAdapter(url)
        await store.setup()
        await store.close()
        code, out, err = await _broker("--database-url", url, "status", "--json")
        assert code == 0 and '"source": "store"' in out, err
        # The read-only handle the reading commands get cannot write even if asked to.
        reader = SQLAlchemyAdapter(url, read_only=True)
        try:
            await reader.check_schema()
            with pytest.raises(Exception, match="read-only"):
                await reader.enqueue(JobSpec(task="app.x"))
        finally:
            await reader.close()


async def test_under_json_logs_the_fallback_note_and_a_refusal_are_json_lines(
    tmp_path: Path,
) -> None:
    url = await _store_at(tmp_path / "b.db")
    code, out, err = await _broker(
        "--log-format", "json", "--database-url", url, "status", "--json"
    )
    assert code == 0 and '"source": "store"' in out
    [note] = [json.loads(line) for line in err.splitlines()]
    assert note["event"] == "store_fallback" and note["level"] == "WARNING"
    assert "working on the store directly" in note["message"]

    missing = f"sqlite+aiosqlite:///{tmp_path / 'nope.db'}"
    code, _, err = await _broker("--log-format", "json", "--database-url", missing, "jobs")
    [fatal] = [json.loads(line) for line in err.splitlines()]
    assert code == 1 and fatal["event"] == "fatal"
    assert "SchemaVersionError: there is no store at" in fatal["error"]
