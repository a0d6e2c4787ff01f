"""Issue 15, findings 7 (log and terminal output), 10, 11 and 12: what children inherit,
the child-output relay, file modes, URL redaction, the module path, SQL identifiers and
control characters in the log and the operator's CLI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import sqlite3
import stat
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.jobs import Job, JobSpec, JobStatus
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.model.untrusted import escape_control, redact_url
from broker.ops import cli
from runners.process import OutputRelay
from tests.conftest import POSTGRES_URL, fresh_schema_name, require_postgres
from tests.e2e.test_e2e import spawn_cli
from tests.integration.test_operator import _closed_port, _run_cli
from tests.support import until

REPO = Path(__file__).resolve().parents[2]
APP = "tests.hardening_app"
TOKEN = "s3cret-token"
DATABASE_URL = "postgresql+asyncpg://broker:db-pa55word@db.internal/broker"


def _env(**extra: str) -> dict[str, str]:
    """This environment, with the checkout importable from any working directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


@dataclass
class WorkerProcess:
    main: Main
    store: MemoryAdapter
    process: asyncio.subprocess.Process
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def logged(self, needle: str) -> str:
        """The worker's log once it holds ``needle``."""

        def seen() -> str | None:
            if self.process.returncode is not None:
                raise AssertionError(f"worker exited {self.process.returncode}:\n{self.output()}")
            text = self.output()
            return text if needle in text else None

        found: str = await until(seen, timeout=30)
        return found

    async def run(self, task: str, *args: Any) -> Job:
        [result] = await self.store.enqueue_many([JobSpec(task=f"{APP}.{task}", args=list(args))])
        self.main.wake()

        async def finished() -> Job | None:
            job = await self.store.get_job(result.job.id)
            return job if job is not None and job.status.is_terminal else None

        job: Job = await until(finished, timeout=60)
        return job


@contextlib.asynccontextmanager
async def _worker_process(tmp_path: Path) -> AsyncIterator[WorkerProcess]:
    """A real main in this process and a real ``broker-worker`` process started the way an
    operator would: its token and a database URL in ``BROKER_*`` variables."""
    store = MemoryAdapter()
    main = Main(store, MainSettings(port=0, token=TOKEN, ping_interval=0.5, liveness_timeout=5))
    await main.start()
    log = tmp_path / "worker.log"
    env = _env(
        BROKER_TOKEN=TOKEN,
        BROKER_DATABASE_URL=DATABASE_URL,
        BROKER_MAIN=f"127.0.0.1:{main.port}",
    )
    argv = ["worker", "--app", APP, "--inline-concurrency", "0"]
    argv += ["--pooled-runner-count", "1", "--forked-concurrency", "1"]
    process = await spawn_cli(log, argv, env)
    worker = WorkerProcess(main, store, process, log)
    try:
        await worker.logged("connected to main")
        yield worker
    finally:
        if process.returncode is None:
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 20)
        except TimeoutError:
            process.kill()
            await process.wait()
        await main.stop()


# ------------------------------------------------------------------ children (10, 11)


@pytest.mark.slow
async def test_children_inherit_no_broker_secret(tmp_path: Path) -> None:
    async with _worker_process(tmp_path) as worker:
        for task in ("pooled_environment", "forked_environment"):
            job = await worker.run(task)
            assert job.status is JobStatus.COMPLETED, job.last_error
            environment = job.result
            assert isinstance(environment, dict) and "PATH" in environment
            leaked = sorted(k for k in environment if k.startswith("BROKER_"))
            assert leaked == [], f"{task}: {leaked}"
            assert TOKEN not in str(environment) and "db-pa55word" not in str(environment)


@pytest.mark.slow
async def test_a_70_mb_output_line_is_truncated_and_the_next_job_runs(tmp_path: Path) -> None:
    async with _worker_process(tmp_path) as worker:
        job = await worker.run("long_line", 70)
        assert job.status is JobStatus.COMPLETED and job.result == 70, job.last_error
        # The relay read on: the same child's next job runs and its line reaches the log.
        job = await worker.run("say", "after the long line \x1b[31mred\x07 end")
        assert job.status is JobStatus.COMPLETED, job.last_error
        log = await worker.logged("after the long line")
        [line] = [line for line in log.splitlines() if "bytes truncated" in line]
        assert len(line) < 9 << 10, "only the head of the line is logged"
        truncated = re.search(r" \.\.\. \((\d+) bytes truncated\)$", line)
        assert truncated is not None, line
        assert 70 * (1 << 20) - 8192 <= int(truncated.group(1)) <= 70 * (1 << 20), line
        # Control characters from the child are escaped: one line, no raw escape.
        assert "after the long line \\x1b[31mred\\x07 end" in log
        assert "\x1b" not in log and "\x07" not in log


def test_the_relay_splits_truncates_and_rate_limits_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:

    now = [0.0]
    relay = OutputRelay(7, line_bytes=10, rate=2.0, burst=3, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="broker.runner")
    relay.feed(b"short\nabcdefgh")
    relay.feed(b"ijklmnop\nsecond")
    relay.feed(b" half\n")
    relay.feed(b"".join(b"flood %d\n" % i for i in range(10)))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "runner output pid=7 line=short",
        "runner output pid=7 line=abcdefghij ... (6 bytes truncated)",
        "runner output pid=7 line=second hal ... (1 bytes truncated)",
    ], "three lines fill the burst; the flood is counted, not logged"
    assert relay.suppressed == 10
    now[0] += 1.0  # two lines' worth of tokens
    relay.feed(b"later\n")
    messages = [r.getMessage() for r in caplog.records[3:]]
    assert messages == [
        "runner output suppressed (over its lines a second) pid=7 lines=10 per_second=2.0",
        "runner output pid=7 line=later",
    ]
    relay.feed(b"no newline at the end")
    relay.close()
    assert (
        caplog.records[-1].getMessage()
        == "runner output pid=7 line=no newline ... (11 bytes truncated)"
    )


# ------------------------------------------------------------------ files, URLs, path (12)


async def test_a_sqlite_store_creates_its_files_for_its_owner_only(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)
    try:
        store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'jobs.db'}")
        await store.setup()
        await store.enqueue(JobSpec(task="t.x"))
        files = sorted(tmp_path.iterdir())
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in files}
        await store.close()
    finally:
        os.umask(old_umask)
    assert {"jobs.db", "jobs.db-wal", "jobs.db-shm"} <= set(modes), modes
    assert all(mode == 0o600 for mode in modes.values()), {k: oct(v) for k, v in modes.items()}


@pytest.mark.parametrize(
    "url",
    [
        "postgresql:/broker:s3cr3t-pw@db/broker",  # unparseable
        "postgresql://broker:s3cr3t-pw@db:port/broker",  # a port that is no number
        "mysql://broker:s3cr3t-pw@db/broker",  # unsupported
    ],
)
def test_a_bad_store_url_is_reported_without_its_password(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main_entry(["--database-url", url, "--port", "0"])
    err = capsys.readouterr().err
    assert code == 1 and "store URL" in err, err
    assert "s3cr3t-pw" not in err, err
    assert "***@db" in err, err


def test_redact_url_hides_whatever_could_be_the_password() -> None:
    assert redact_url("postgresql://u:p@ss@h/db") == "postgresql://u:***@h/db"
    assert redact_url("postgresql://u:***@ss@h/db") == "postgresql://u:***@h/db"
    assert redact_url("u:pw@h/db") == "u:***@h/db"
    assert redact_url("postgresql://u@h/db?password=pw&x=1") == (
        "postgresql://u@h/db?password=***&x=1"
    )
    assert redact_url("sqlite+aiosqlite:///./broker.db") == "sqlite+aiosqlite:///./broker.db"


def _plant(directory: Path) -> Path:
    """An ``aiosqlite.py`` that leaves a marker behind if it is ever imported."""
    marker = directory / "planted-module-ran"
    (directory / "aiosqlite.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise ImportError('planted')\n"
    )
    return marker


async def _start_main(cwd: Path, *extra: str) -> str:
    """Start ``python -m broker.ops.cli main`` in ``cwd`` until it listens; return its output."""
    log = cwd / "main.log"
    argv = ["main", "--database-url", f"sqlite+aiosqlite:///{cwd / 'b.db'}", "--port", "0"]
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "broker.ops.cli",
            *argv,
            *extra,
            cwd=cwd,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def listening() -> bool:
            if process.returncode is not None:
                raise AssertionError(f"exited {process.returncode}: {log.read_text()}")
            return "listening on" in log.read_text()

        await until(listening, timeout=30)
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.wait(), 20)
    return log.read_text()


@pytest.mark.slow
async def test_a_module_planted_in_the_working_directory_is_never_imported(
    tmp_path: Path,
) -> None:
    marker = _plant(tmp_path)
    await _start_main(tmp_path)
    assert not marker.exists(), "without --schedules the working directory is not on the path"
    (tmp_path / "my_schedules.py").write_text(
        textwrap.dedent(
            f"""
            from datetime import timedelta
            from broker.tasks.registry import task
            open({str(tmp_path / "schedules-loaded")!r}, "w").close()

            @task(every=timedelta(hours=1))
            def tick() -> None: ...
            """
        )
    )
    await _start_main(tmp_path, "--schedules", "my_schedules")
    assert (tmp_path / "schedules-loaded").exists(), "--schedules imports from the directory"
    assert not marker.exists(), "the directory comes after the installed modules"
    (tmp_path / "my_adapter.py").write_text(
        "import adapters\n\ndef create(url):\n    return adapters.open_store(url)\n"
    )
    await _start_main(tmp_path, "--adapter", "my_adapter:create")
    assert not marker.exists(), "--adapter imports from the directory, after installed modules"


# ------------------------------------------------------------------ control characters (7)


def test_a_log_record_with_control_characters_is_one_escaped_line() -> None:
    script = textwrap.dedent(
        """
        import logging
        from broker.model import logs
        logs.configure("INFO", "text")
        log = logging.getLogger("broker.main")
        log.info("enqueued task=%s", "evil\\n2026-01-01 00:00:00 INFO forged\\x1b[2J")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed %s", "x\\ry")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].endswith(
        "INFO broker.main enqueued task=evil\\n2026-01-01 00:00:00 INFO forged\\x1b[2J"
    ), lines
    assert "\x1b" not in done.stderr and "\r" not in done.stderr
    assert lines[1].endswith("ERROR broker.main failed x\\ry"), lines
    assert lines[2] == "    Traceback (most recent call last):", "readable, indented"
    assert lines[-1] == "    ValueError: boom"


def test_escape_control_is_idempotent_and_leaves_ordinary_text_alone() -> None:
    assert escape_control("a\tb\x00c\x7f\x9b\u2028") == "a\\tb\\x00c\\x7f\\x9b\\u2028"
    assert escape_control(escape_control("x\ny")) == "x\\ny"
    assert escape_control("C:\\path ünïcode ✓") == "C:\\path ünïcode ✓"


async def test_the_operator_cli_escapes_control_characters_it_prints(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'jobs.db'}"
    store = SQLAlchemyAdapter(url)
    await store.setup()
    job = (await store.enqueue(JobSpec(task="app.plain"))).job
    await store.close()
    evil = "app.evil\x1b[2J\x1b[31mFAKE\nnext line"
    # Straight into the store: whatever validation enqueue does, old rows and other
    # writers can still hold such a name.
    with sqlite3.connect(tmp_path / "jobs.db") as db:
        db.execute("UPDATE broker_jobs SET task = ? WHERE id = ?", (evil, job.id.hex))
        assert db.total_changes == 1
    common = ["--main", f"127.0.0.1:{_closed_port()}", "--database-url", url, "--timeout", "2"]
    for command in (["jobs"], ["job", str(job.id)]):
        code, out, err = await asyncio.to_thread(_run_cli, [*common, *command])
        assert code == 0, err
        assert "app.evil\\x1b[2J\\x1b[31mFAKE\\nnext line" in out, out
        assert "\x1b" not in out and "FAKE\n" not in out, out


# ------------------------------------------------------------------ SQL identifiers (12)


async def test_analyze_quotes_a_schema_name_that_needs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = require_postgres()
    schema = fresh_schema_name() + '-Odd"Name'
    store = SQLAlchemyAdapter(url, schema=schema)
    caplog.set_level(logging.WARNING, logger="adapters")
    conn = await asyncpg.connect(POSTGRES_URL.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await store.setup()
        await store.enqueue_many([JobSpec(task="t.x") for _ in range(600)])
        analyzing = store._dialect._analyzing
        assert analyzing is not None, "a bulk insert starts an ANALYZE"
        await analyzing
        assert "planner statistics" not in caplog.text, caplog.text
        rows = await conn.fetchval(
            "SELECT c.reltuples FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = $1 AND c.relname = 'broker_jobs'",
            schema,
        )
        assert rows == 600, "ANALYZE counted the rows"
    finally:
        await store.close()
        quoted = schema.replace('"', '""')
        await conn.execute(f'DROP SCHEMA IF EXISTS "{quoted}" CASCADE')
        await conn.close()
