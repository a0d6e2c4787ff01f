"""The operator CLI (`broker status|jobs|job|retry|cancel|enqueue|prune`) and cancellation.

Each command runs against a real main over TCP with ``--json`` output parsed and
checked, and its human output smoke-checked; then against the store directly when no
main answers (SQLite and PostgreSQL). Cancelling a running job goes through a real
worker: the inline coroutine is cancelled, the pooled child is stopped, the job ends
``cancelled`` and the worker's late report is acknowledged ``stale``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.jobs import Claim, ExecutionMode, JobSpec, JobStatus
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.ops import cli
from broker.payload import DEFAULT_MAX_PAYLOAD_BYTES
from broker.storage import StorageAdapter
from broker.tasks.registry import task
from broker.wire import codec
from broker.wire import messages as protocol
from tests.conftest import drop_schema, fresh_schema_name, require_postgres
from tests.support import FakeWorker, until

POOLED = ExecutionMode.POOLED
INLINE = ExecutionMode.INLINE


# ------------------------------------------------------------------------ helpers


def _run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.broker_entry(list(argv))
        except SystemExit as exc:  # a usage error, as argparse reports it
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


async def _cli(*argv: str) -> tuple[int, str, str]:
    """The ``broker`` command in-process, on a thread so this loop keeps serving."""
    return await asyncio.to_thread(_run_cli, argv)


async def _cli_json(*argv: str) -> Any:
    code, out, err = await _cli(*argv, "--json")
    assert code == 0, f"broker {' '.join(argv)} exited {code}: {err}"
    return json.loads(out)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def _main(store: StorageAdapter) -> AsyncIterator[Main]:
    main = Main(
        store,
        MainSettings(port=0, ping_interval=0.5, liveness_timeout=5, error_retry_interval=0.05),
        retry_delay_fn=lambda n: timedelta(0),
    )
    await main.start()
    try:
        yield main
    finally:
        await main.stop()


# ------------------------------------------------------------------------ against a main


async def test_every_command_against_a_running_main(tmp_path: Path) -> None:
    store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'ops.db'}")
    async with _main(store) as main:
        main_opt = ("--main", f"127.0.0.1:{main.port}")

        # enqueue
        made = await _cli_json(
            *main_opt, "enqueue", "app.mail", "[1]", "--queue", "mail", "--priority", "3"
        )
        assert made["duplicate"] is False
        mail_id = made["job_id"]
        ids = [
            (await _cli_json(*main_opt, "enqueue", "app.report", f"[{i}]", "--delay", "3600"))[
                "job_id"
            ]
            for i in range(3)
        ]
        code, out, _ = await _cli(*main_opt, "enqueue", "app.report", "--mode", "inline")
        assert code == 0 and uuid.UUID(out.strip())
        ids.append(out.strip())

        # job
        job = await _cli_json(*main_opt, "job", mail_id)
        assert job["id"] == mail_id and job["queue"] == "mail" and job["priority"] == 3
        code, out, _ = await _cli(*main_opt, "job", mail_id)
        assert code == 0 and "status" in out and "queued" in out
        code, _, err = await _cli(*main_opt, "job", str(uuid.uuid4()), "--json")
        assert code == 1 and "no such job" in err

        # jobs: filters and pages
        listing = await _cli_json(*main_opt, "jobs")
        assert [j["id"] for j in listing["jobs"]] == [*reversed(ids), mail_id]
        assert listing["next_cursor"] is None
        mail_only = await _cli_json(*main_opt, "jobs", "--queue", "mail")
        assert [j["id"] for j in mail_only["jobs"]] == [mail_id]
        by_task = await _cli_json(*main_opt, "jobs", "--task", "app.report", "--limit", "2")
        assert [j["id"] for j in by_task["jobs"]] == [ids[3], ids[2]]
        assert by_task["next_cursor"] is not None
        rest = await _cli_json(
            *main_opt,
            "jobs",
            "--task",
            "app.report",
            "--limit",
            "2",
            "--cursor",
            by_task["next_cursor"],
        )
        assert [j["id"] for j in rest["jobs"]] == [ids[1], ids[0]]
        everything = await _cli_json(*main_opt, "jobs", "--limit", "1", "--all")
        assert len(everything["jobs"]) == 5 and everything["next_cursor"] is None
        code, out, _ = await _cli(*main_opt, "jobs", "--limit", "2")
        assert code == 0 and "STATUS" in out and "app.report" in out and "more: --cursor" in out
        none = await _cli_json(*main_opt, "jobs", "--status", "failed")
        assert none == {"jobs": [], "next_cursor": None}

        # a worker, so status has one to show; it takes the mail job and kills it for good
        fake = FakeWorker(main.port, worker_id="fake-1")
        await fake.connect(modes=(POOLED,))
        await fake.send(
            protocol.WorkerStatus(
                status={
                    "worker_id": "fake-1",
                    "runners": {
                        "pooled": {
                            "mode": "pooled",
                            "capacity": 4,
                            "busy": 0,
                            "startup_error": "ImportError: no module named app\n  more",
                            "details": {},
                        }
                    },
                }
            )
        )
        await fake.ready(pooled=1)
        handed = await fake.next_job()
        assert str(handed.job_id) == mail_id
        status = await _cli_json(*main_opt, "status")
        assert status["source"] == "main" and status["main_error"] is None
        assert status["main_id"] == main.main_id and status["dispatched"] == 1
        queues = {q["queue"]: q for q in status["queues"]}
        assert queues["mail"]["counts"] == {
            "waiting": 0,
            "queued": 0,
            "handed_off": 1,
            "completed": 0,
            "failed": 0,
            "cancelled": 0,
        }
        assert queues["mail"]["oldest_queued_age_seconds"] is None
        assert queues["default"]["counts"]["queued"] == 4
        assert queues["default"]["oldest_queued_age_seconds"] >= 0
        [worker] = status["workers"]
        assert worker["worker_id"] == "fake-1" and worker["in_flight"] == 1
        assert worker["capacity"] == {"pooled": 4} and worker["status_reported"] is True
        assert worker["startup_errors"]["pooled"].startswith("ImportError")
        assert worker["credits"] == {"pooled": 0} and worker["draining"] is False
        assert status["pending_recoveries"] == []
        code, out, _ = await _cli(*main_opt, "status")
        assert code == 0 and "up" in out and "fake-1" in out and "pooled=4" in out
        assert "ImportError" in out and "pending recoveries: 0" in out and "HANDED_OFF" in out

        ack = await fake.report(
            protocol.FailedReport(handed.job_id, handed.handoff_id, error="boom", retry=False)
        )
        assert ack.status is protocol.AckStatus.APPLIED

        # retry: a dead job goes back to the queue; anything else is refused
        dead = await _cli_json(*main_opt, "jobs", "--status", "failed")
        assert [j["id"] for j in dead["jobs"]] == [mail_id]
        retried = await _cli_json(*main_opt, "retry", mail_id)
        assert retried["status"] == "queued" and retried["attempts"] == 0
        code, out, err = await _cli(*main_opt, "retry", ids[0], "--json")
        assert code == 1 and out == "" and "only a failed" in err

        # cancel a queued job (the retried one, which the fake worker gets offered again)
        cancelled = await _cli_json(*main_opt, "cancel", ids[0])
        assert cancelled["status"] == "cancelled"
        code, out, err = await _cli(*main_opt, "cancel", ids[0])
        assert code == 0 and "cancelled" in out and err == ""
        code, _, err = await _cli(*main_opt, "cancel", "not-a-uuid")
        assert code == 2 and "UUID" in err

        # prune
        code, _, err = await _cli(*main_opt, "prune")
        assert code == 2 and "--older-than" in err
        kept = await _cli_json(*main_opt, "prune", "--older-than", "3600")
        assert kept == {"deleted": 0}, "nothing finished an hour ago"
        pruned = await _cli_json(*main_opt, "prune", "--keep-latest", "0", "--status", "cancelled")
        assert pruned == {"deleted": 1}
        code, out, _ = await _cli(*main_opt, "prune", "--keep-latest", "0")
        assert code == 0 and out.strip() == "deleted 0 jobs"
        assert await store.get_job(uuid.UUID(ids[0])) is None
        await fake.close()


async def test_a_bad_cursor_is_a_clear_error_not_a_crash() -> None:
    async with _main(MemoryAdapter()) as main, Client("127.0.0.1", main.port) as client:
        with pytest.raises(Exception, match="cursor"):
            await client.list_jobs(cursor="definitely not a cursor")
        assert (await client.list_jobs()).jobs == []


async def test_a_page_too_big_for_one_line_comes_back_smaller() -> None:
    store = MemoryAdapter()
    await store.enqueue_many([JobSpec(task="t", args=["x" * 600_000]) for _ in range(5)])
    main = Main(store, MainSettings(port=0, max_payload_bytes=1 << 20, max_line_bytes=2 << 20))
    assert main.settings.max_line_bytes < 5 * 600_000
    await main.start()
    try:
        async with Client("127.0.0.1", main.port) as client:
            seen: list[str] = []
            cursor = None
            while True:
                page = await client.list_jobs(limit=5, cursor=cursor, include_payload=True)
                assert 1 <= len(page.jobs) < 5
                seen += [str(j["id"]) for j in page.jobs]
                if (cursor := page.next_cursor) is None:
                    break
            assert len(set(seen)) == 5
    finally:
        await main.stop()


def test_request_validation() -> None:
    with pytest.raises(ValueError, match="limit"):
        protocol.ListJobs(request_id="r", limit=0)
    with pytest.raises(ValueError, match="older_than_seconds or keep_latest"):
        protocol.Prune(request_id="r")
    with pytest.raises(ValueError, match="terminal"):
        protocol.Prune(request_id="r", keep_latest=1, statuses=[JobStatus.QUEUED])
    with pytest.raises(codec.DecodeError) as caught:
        codec.decode('{"type":"prune","request_id":"r9","older_than_seconds":-1}')
    assert caught.value.request_id == "r9"


# ------------------------------------------------------------------------ without a main


async def _dead_job(store: StorageAdapter) -> uuid.UUID:
    [result] = await store.enqueue_many([JobSpec(task="app.dead", max_attempts=1)])
    lease = uuid.uuid4()
    await store.mark_handed_off_many([Claim(result.job.id, lease, "gone-worker")])
    assert await store.fail(result.job.id, lease, "it broke", None)
    return result.job.id


async def _fallback_scenario(db: tuple[str, ...], store: StorageAdapter) -> None:
    """Every command on the store directly; ``store`` is the same store, to check it."""
    main_opt = ("--main", f"127.0.0.1:{_closed_port()}", *db)
    made = await _cli_json(*main_opt, "enqueue", "app.x", "[1]", "--queue", "q1")
    job_id = made["job_id"]
    again = await _cli_json(
        *main_opt, "enqueue", "app.x", "--idempotency-key", "k", "--delay", "60"
    )
    assert (await _cli_json(*main_opt, "enqueue", "app.x", "--idempotency-key", "k")) == {
        "job_id": again["job_id"],
        "duplicate": True,
    }
    dead_id = str(await _dead_job(store))

    code, out, err = await _cli(*main_opt, "status", "--json")
    assert code == 0 and "cannot reach the main" in err
    status = json.loads(out)
    assert status["source"] == "store" and "cannot reach the main" in status["main_error"]
    assert status["workers"] is None and status["pending_recoveries"] is None
    assert status["main_id"] is None
    queues = {q["queue"]: q for q in status["queues"]}
    assert queues["q1"]["counts"]["queued"] == 1
    assert queues["default"]["counts"] == {
        "waiting": 0,
        "queued": 1,
        "handed_off": 0,
        "completed": 0,
        "failed": 1,
        "cancelled": 0,
    }
    assert queues["default"]["oldest_queued_age_seconds"] == 0.0, "its run_at is ahead"
    code, out, _ = await _cli(*main_opt, "status")
    assert code == 0 and "DOWN" in out and "q1" in out

    listing = await _cli_json(*main_opt, "jobs", "--status", "queued", "--limit", "1", "--all")
    assert {j["id"] for j in listing["jobs"]} == {job_id, again["job_id"]}
    assert (await _cli_json(*main_opt, "job", job_id))["task"] == "app.x"
    code, out, _ = await _cli(*main_opt, "jobs")
    assert code == 0 and "app.dead" in out and "it broke" in out

    retried = await _cli_json(*main_opt, "retry", dead_id)
    assert retried["status"] == "queued" and retried["attempts"] == 0
    cancelled = await _cli_json(*main_opt, "cancel", job_id)
    assert cancelled["status"] == "cancelled"
    assert (await _cli_json(*main_opt, "prune", "--keep-latest", "0")) == {"deleted": 1}
    assert await store.get_job(uuid.UUID(job_id)) is None
    code, _, err = await _cli(*main_opt, "jobs", "--cursor", "garbage")
    assert code == 1 and "cursor" in err


async def test_without_a_main_the_commands_work_on_a_sqlite_store(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'down.db'}"
    store = SQLAlchemyAdapter(url)
    await store.setup()
    try:
        await _fallback_scenario(("--database-url", url), store)
        big = json.dumps(["x" * DEFAULT_MAX_PAYLOAD_BYTES])  # the default limit, not the main's
        code, _, err = await _cli(
            "--main", f"127.0.0.1:{_closed_port()}", "--database-url", url, "enqueue", "t", big
        )
        assert code == 1 and "payload limit" in err
    finally:
        await store.close()


def pg_store(url: str) -> SQLAlchemyAdapter:
    """An ``--adapter`` factory: ``URL#schema`` opens PostgreSQL in that schema."""
    base, _, schema = url.partition("#")
    return SQLAlchemyAdapter(base, schema=schema or None)


@pytest.mark.postgres
async def test_without_a_main_the_commands_work_on_a_postgres_store() -> None:
    url = require_postgres()
    schema = fresh_schema_name()
    store = SQLAlchemyAdapter(url, schema=schema)
    await store.setup()
    try:
        db = (
            "--database-url",
            f"{url}#{schema}",
            "--adapter",
            "tests.integration.test_operator:pg_store",
        )
        await _fallback_scenario(db, store)
    finally:
        await store.close()
        await drop_schema(schema)


async def test_environment_supplies_the_store_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'env.db'}"
    store = SQLAlchemyAdapter(url)
    await store.setup()  # as broker-main would have: the CLI never creates a store
    await store.close()
    monkeypatch.setenv("BROKER_DATABASE_URL", url)
    monkeypatch.setenv("BROKER_MAIN", f"127.0.0.1:{_closed_port()}")
    status = await _cli_json("status")
    assert status["source"] == "store" and status["queues"] == []


async def test_neither_main_nor_store_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BROKER_DATABASE_URL", raising=False)
    code, out, err = await _cli("--main", f"127.0.0.1:{_closed_port()}", "status", "--json")
    assert code == 1 and out == ""
    assert "cannot reach the main" in err and "--database-url" in err


async def test_a_main_that_refuses_is_not_bypassed(tmp_path: Path) -> None:
    """A wrong token is an error even with a store URL: the store would skip the check."""
    main = Main(MemoryAdapter(), MainSettings(port=0, token="s3cret"))
    await main.start()
    try:
        url = f"sqlite+aiosqlite:///{tmp_path / 'x.db'}"
        code, _, err = await _cli(
            "--main", f"127.0.0.1:{main.port}", "--token", "wrong", "--database-url", url, "status"
        )
        assert code == 1 and "refused" in err
        assert not (tmp_path / "x.db").exists()
    finally:
        await main.stop()


# ------------------------------------------------------------------------ cancelling running jobs

_inline_cancelled: list[str] = []


@task(mode="inline")
async def inline_nap(key: str, seconds: float) -> str:
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        _inline_cancelled.append(key)
        raise
    return key


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stale_acks(caplog: pytest.LogCaptureFixture, job_id: uuid.UUID) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "broker.main" and r.getMessage().startswith(f"report stale job_id={job_id}")
    ]


@pytest.mark.slow
async def test_cancelling_a_running_pooled_job_stops_its_child_and_fences_the_report(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.e2e.test_pooled import cluster

    caplog.set_level(logging.INFO)
    async with cluster(pooled_runner_count=1, forked_concurrency=0) as c:
        [job] = await c.enqueue("nap", 60.0)
        pid = await until(lambda: _busy_child(c))
        assert _alive(pid)

        status = await c.main.status()
        [worker] = status["workers"]
        assert worker["capacity"] == {"inline": 2, "pooled": 1}
        assert worker["in_flight"] == 1 and worker["status_reported"] is True

        code, out, err = await _cli("--main", f"127.0.0.1:{c.main.port}", "cancel", str(job.id))
        assert code == 0, err
        assert "cancelled" in out
        cancelled = await c.store.get_job(job.id)
        assert cancelled is not None and cancelled.status is JobStatus.CANCELLED

        await until(lambda: _gone(pid), timeout=10)
        await until(lambda: _async(bool(_stale_acks(caplog, job.id))), timeout=10)
        await until(lambda: _async(c.worker.status()["outbox"] == 0))
        after = await c.store.get_job(job.id)
        assert after == cancelled, "the late report changed nothing"
        worker_log = [r for r in caplog.records if r.name == "broker.worker"]
        assert any("acknowledged stale, as expected" in r.getMessage() for r in worker_log)
        # A cancel is not a crash: nothing about it is logged as a warning or worse.
        about_job = [r for r in caplog.records if str(job.id) in r.getMessage()]
        assert all(r.levelno < logging.WARNING for r in about_job if r.name != "broker.main"), [
            r.getMessage() for r in about_job
        ]
        assert not any("pooled runner died" in r.getMessage() for r in caplog.records)

        # The pool replaced its child and runs the next job.
        [nxt] = await c.enqueue("whoami")
        [done] = await c.settled([nxt])
        assert done.status is JobStatus.COMPLETED and done.result != pid


@pytest.mark.slow
async def test_cancelling_a_running_inline_job_cancels_its_coroutine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.e2e.test_pooled import cluster

    caplog.set_level(logging.INFO)
    key = uuid.uuid4().hex
    async with cluster(pooled_runner_count=1, forked_concurrency=0) as c:
        [result] = await c.store.enqueue_many(
            [JobSpec(task=f"{__name__}.inline_nap", args=[key, 60.0], execution_mode=INLINE)]
        )
        job = result.job
        c.main.wake()
        await until(lambda: _async(c.worker.status()["running"] == 1))
        async with Client("127.0.0.1", c.main.port) as client:
            reply = await client.cancel(job.id)
        assert reply is not None and reply["status"] == "cancelled"
        await until(lambda: _async(key in _inline_cancelled), timeout=10)
        await until(lambda: _async(bool(_stale_acks(caplog, job.id))), timeout=10)
        after = await c.store.get_job(job.id)
        assert after is not None and after.status is JobStatus.CANCELLED
        assert after.result is None and after.last_error is None and after.attempts == 0
        assert c.worker.status()["running"] == 0


@pytest.mark.slow
async def test_a_status_with_a_startup_error_reaches_the_main(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.e2e.test_pooled import cluster

    marker = tmp_path / "fail-import"
    marker.write_text("fail")
    monkeypatch.setenv("FLAKY_APP_FAIL_IMPORT", str(marker))
    async with cluster(pooled_runner_count=1, forked_concurrency=0, apps=("tests.flaky_app",)) as c:

        async def reported() -> dict[str, Any] | None:
            workers = (await c.main.status())["workers"]
            if workers and workers[0]["startup_errors"].get("pooled"):
                return dict(workers[0])
            return None

        worker = await until(reported, timeout=30)
        assert "simulated start-up failure" in worker["startup_errors"]["pooled"]
        status = await _cli_json("--main", f"127.0.0.1:{c.main.port}", "status")
        assert "simulated start-up failure" in status["workers"][0]["startup_errors"]["pooled"]


async def _busy_child(c: Any) -> int | None:
    for child in c.pool.status().details["children"]:
        if child["busy"]:
            return int(child["pid"])
    return None


async def _gone(pid: int) -> bool:
    return not _alive(pid)


async def _async(value: bool) -> bool:
    return value


async def test_without_a_main_the_catalog_is_read_from_the_store(tmp_path: Path) -> None:
    """``broker tasks`` and ``broker enqueue`` on the store directly: the declarations the
    workers left there decide the defaults, and an undeclared name is refused."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"
    store = SQLAlchemyAdapter(url)
    await store.setup()
    try:
        declared = {"name": "app.charge", "max_attempts": 1, "queue": "money"}
        await store.declare_tasks("w1", {"app.charge": declared}, datetime.now(UTC))
        down = ("--main", f"127.0.0.1:{_closed_port()}", "--database-url", url)
        listing = await _cli_json(*down, "tasks")
        assert [(t["task"], t["worker_id"]) for t in listing["tasks"]] == [("app.charge", "w1")]
        made = await _cli_json(*down, "enqueue", "app.charge", "[1]")
        job = await store.get_job(uuid.UUID(made["job_id"]))
        assert job is not None and (job.max_attempts, job.queue) == (1, "money")
        code, _, err = await _cli(*down, "enqueue", "app.chrage", "[1]")
        assert code == 1 and "no worker has declared task 'app.chrage'" in err
    finally:
        await store.close()
