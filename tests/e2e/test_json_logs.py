"""``--log-format json`` against real processes: a ``broker-main`` and a ``broker-worker``
on a SQLite file, and a client whose task name is full of ``key=value`` words.

The fields of a JSON line come from the code, never from the text of a message: the
forged name stays inside its own ``task`` field, and the line keeps its own level, time,
logger and worker id. Numbers are numbers, a missing worker id is ``null``, a duration
is its seconds, and every job event (started, completed, failed and retried, dead, timed
out, handed off, retried by the operator) names its job by id, task, queue and attempt.
The forged task is one no worker declares, so its job waits (routing by task) and only
the main logs it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from broker.client.client import Client
from tests.e2e.test_e2e import Cluster, Proc, eventually, sqlite_url

pytestmark = pytest.mark.slow

APP = "tests.logs_app"
FORGED = f"{APP}.nosuch level=DEBUG time=0 logger=x worker_id=y event=e lease=l queue=q"
"""A legal task name (spaces and ``=`` are allowed) that reads like log fields."""

TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00$")


def _records(proc: Proc) -> list[dict[str, Any]]:
    """Every line the process wrote, each parsed: a line that is not JSON fails."""
    return [json.loads(line) for line in proc.output().splitlines() if line]


def _job_events(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A job's own events (a lease's bookkeeping, such as a report's ack, is not one)."""
    return [r for r in records if "job_id" in r and r["event"].startswith("job ")]


async def _settled(client: Client, job_id: object, *ends: str) -> dict[str, Any]:
    job: dict[str, Any] = {}

    async def ended() -> bool:
        nonlocal job
        job = await client.get_job(str(job_id)) or {}
        return job.get("status") in ends

    await eventually(ended, f"job {job_id} to end {ends}", timeout=60)
    return job


async def test_json_fields_are_the_codes_own_and_keep_their_types(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, sqlite_url(tmp_path))
    try:
        main = await cluster.start_main("--log-format", "json", "--log-level", "DEBUG")
        worker = await cluster.spawn(
            "worker",
            *("worker", "--main", f"127.0.0.1:{cluster.port}", "--app", APP),
            *("--worker-id", "logs-worker", "--pooled-runner-count", "1"),
            *("--forked-concurrency", "0", "--kill-grace", "0.5"),
            *("--log-format", "json", "--log-level", "DEBUG"),
        )
        await worker.wait_for_output("connected to main")
        # Its tasks' queue ("logs") reaches jobs enqueued by name once the main has the
        # declarations, which follow "connected" on their own (see Cluster.start_worker).
        await main.wait_for_output("tasks declared")
        async with Client("127.0.0.1", cluster.port, allow_unknown_tasks=True) as client:
            ok = await client.enqueue(f"{APP}.ok")
            boom = await client.enqueue(f"{APP}.boom")
            stuck = await client.enqueue(f"{APP}.stuck")
            forged = await client.enqueue(FORGED, execution_mode="inline", queue="logs")
            await _settled(client, ok.job_id, "completed")
            dead = await _settled(client, boom.job_id, "failed")
            assert dead["attempts"] == 2
            await _settled(client, stuck.job_id, "failed")
            waiting = await client.get_job(str(forged.job_id))
            assert waiting is not None and waiting["status"] == "queued", "no worker runs it"
            await client.retry(str(boom.job_id))  # the operator's retry: a job event too
            await _settled(client, boom.job_id, "failed")
        assert await worker.terminate() == 0
        assert await main.terminate() == 0
    finally:
        await cluster.close()

    mains, workers = _records(main), _records(worker)
    everything = mains + workers
    assert all(TIME.match(r["time"]) for r in everything), "every time is the record's own"
    assert not any(r["level"] == "DEBUG" and r.get("task") == FORGED for r in workers)
    assert all(r["logger"] != "x" for r in everything)
    ours = [r for r in workers if r["logger"].split(".")[0] in {"broker", "runners"}]
    assert all(r["worker_id"] == "logs-worker" for r in ours), "the worker's id, never y"

    # The forged name is one field's value, whole; the worker never sees its job.
    assert not any(r.get("task") == FORGED for r in workers)
    main_forged = [r for r in mains if r.get("task") == FORGED]
    levels = {r["event"]: r["level"] for r in main_forged}
    assert levels == {"job enqueued": "DEBUG"}
    assert all(r["logger"] == "broker.main" for r in main_forged)
    assert all(r["queue"] == "logs" for r in main_forged)

    # Numbers stay numbers, None is null, a duration is its seconds.
    [listening] = [r for r in mains if r["event"] == "main listening"]
    assert listening["port"] == cluster.port and listening["orphans"] == 0
    peers = [r for r in mains if r["event"] == "peer connected"]
    assert any(r["role"] == "client" and r["worker_id"] is None for r in peers), peers
    assert any(r["worker_id"] == "logs-worker" and r["adopted"] == 0 for r in peers), peers
    [retention] = [r for r in mains if r["event"] == "retention on"]
    assert retention["completed_ttl"] == 7 * 86400.0, "not '7 days, 0:00:00' cut to '7'"

    # Every job event names its job by id, task, queue and attempt.
    names = {
        str(ok.job_id): f"{APP}.ok",
        str(boom.job_id): f"{APP}.boom",
        str(stuck.job_id): f"{APP}.stuck",
        str(forged.job_id): FORGED,
    }
    events = _job_events(everything)
    for record in events:
        assert record["task"] == names[record["job_id"]], record
        assert record["queue"] == "logs" and isinstance(record["attempt"], int), record
    seen = {(r["event"], names[r["job_id"]], r["attempt"]) for r in events}
    assert {
        ("job started", f"{APP}.ok", 1),
        ("job completed", f"{APP}.ok", 1),
        ("job failed", f"{APP}.boom", 1),
        ("job failed", f"{APP}.boom", 2),
        ("job handed off", f"{APP}.boom", 2),
        ("job retried", f"{APP}.boom", 1),  # an operator's retry starts the count again
        ("job timed out, stopping its runner process", f"{APP}.stuck", 1),
        ("job failed", f"{APP}.stuck", 1),
    } <= seen, sorted(seen)
    ends = {
        (r["event"], r["level"], names[r["job_id"]], r["attempt"])
        for r in mains
        if r["event"] in ("job will run again", "job dead")
    }
    assert {
        ("job will run again", "INFO", f"{APP}.boom", 1),
        ("job dead", "WARNING", f"{APP}.boom", 2),
        ("job dead", "WARNING", f"{APP}.stuck", 1),
    } <= ends, sorted(ends)
