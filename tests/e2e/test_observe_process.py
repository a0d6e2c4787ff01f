"""Watching the broker as an operator does, with real processes: ``broker-main
--log-format json`` writes nothing but JSON lines on stderr, and ``broker top`` redraws
in place on a terminal and prints plain frames into a pipe."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

from adapters.memory import MemoryAdapter
from broker.jobs import ExecutionMode, Job, JobSpec, JobStatus
from tests.support import running_main, until

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "broker.ops.cli", *argv]


@contextmanager
def _main_process(*argv: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        _cli("main", "--database-url", "memory://", "--port", "0", *argv),
        cwd=REPO,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_broker_main_writes_only_json_lines() -> None:
    with _main_process("--log-format", "json") as proc:
        assert proc.stderr is not None
        seen: list[dict[str, object]] = []
        for line in proc.stderr:
            seen.append(json.loads(line))
            if seen[-1]["event"] == "listening":
                break
        port = seen[-1]["port"]
        status = subprocess.run(
            _cli("broker", "--main", f"127.0.0.1:{port}", "status", "--json"),
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    lines = [json.loads(line) for line in rest.splitlines()]
    records = seen + lines
    assert proc.returncode == 0
    assert all({"time", "level", "event", "message"} <= set(r) for r in records)
    assert any(r["event"] == "main listening" for r in records)
    assert any(r["event"] == "main stopped" for r in records)


def test_a_fatal_start_up_error_is_a_json_line_too() -> None:
    with _main_process("--log-format", "json", "--adapter", "nowhere:factory") as proc:
        _, err = proc.communicate(timeout=60)
    [line] = [json.loads(text) for text in err.splitlines()]
    assert proc.returncode == 1
    assert line["level"] == "ERROR" and line["event"] == "fatal"
    assert "cannot import 'nowhere' (named by --adapter nowhere:factory)" in str(line["error"])
    assert line["traceback"] == "ModuleNotFoundError: No module named 'nowhere'"


@asynccontextmanager
async def _busy_main() -> AsyncIterator[int]:
    store = MemoryAdapter()
    await store.enqueue_many([JobSpec(task="app.x", queue="mail") for _ in range(3)])
    async with running_main(store) as main:
        yield main.port


async def test_top_prints_plain_frames_into_a_pipe() -> None:
    async with _busy_main() as port:
        proc = await asyncio.create_subprocess_exec(
            *_cli(
                "broker", "--main", f"127.0.0.1:{port}", "top", "--count", "2", "--interval", "0.1"
            ),
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0, err
    assert "\x1b" not in text, "no terminal control sequences into a pipe"
    assert text.count("broker top ") == 2, text
    first, second = text.split("broker top ")[1:]
    assert "QUEUE" in first and "mail" in first and "no workers connected" in first
    mail = [line.split() for line in first.splitlines() if line.startswith("mail")]
    assert mail[0][:3] == ["mail", "3", "0"], "3 queued, none running"
    assert "DONE/S" in second and "mail" in second


async def test_top_redraws_in_place_on_a_terminal() -> None:
    async with _busy_main() as port:
        leader, follower = pty.openpty()
        proc = await asyncio.create_subprocess_exec(
            *_cli(
                "broker", "--main", f"127.0.0.1:{port}", "top", "--count", "2", "--interval", "0.1"
            ),
            cwd=REPO,
            env=_env(),
            stdout=follower,
            stderr=subprocess.PIPE,
        )
        os.close(follower)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other end is closed and drained
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(leader)
    text = b"".join(chunks).decode()
    assert proc.returncode == 0, err
    assert text.count("\x1b[H\x1b[2J") == 2, "each frame starts by clearing the screen"


async def test_broker_worker_writes_json_lines_with_its_id_on_each() -> None:
    store = MemoryAdapter()
    [made] = await store.enqueue_many(
        [JobSpec(task="tests.pool_app.inline_pid", execution_mode=ExecutionMode.INLINE)]
    )
    async with running_main(store) as main:
        proc = await asyncio.create_subprocess_exec(
            *_cli(
                "worker",
                "--main",
                f"127.0.0.1:{main.port}",
                "--app",
                "tests.pool_app",
                "--worker-id",
                "json-worker",
                "--pooled-runner-count",
                "0",
                "--forked-concurrency",
                "0",
                "--log-format",
                "json",
                "--log-level",
                "DEBUG",  # a job's own lines ("job completed") are DEBUG: one per job
            ),
            cwd=REPO,
            env=_env(),
            stderr=subprocess.PIPE,
        )
        try:
            done = await until(lambda: _settled(store, made.job.id), timeout=60)
            assert done.status is JobStatus.COMPLETED
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
    records = [json.loads(line) for line in err.decode().splitlines()]
    assert proc.returncode == 0
    ours = [r for r in records if r["logger"].split(".")[0] in {"broker", "runners"}]
    assert ours and all(r["worker_id"] == "json-worker" for r in ours), records
    [completed] = [r for r in records if r["event"] == "job completed"]
    assert completed["job_id"] == str(made.job.id) and "lease" in completed


async def _settled(store: MemoryAdapter, job_id: uuid.UUID) -> Job | None:
    job = await store.get_job(job_id)
    return job if job is not None and job.status.is_terminal else None
