"""The task catalog with a real main and a real worker, each its own process, and the
operator's command (its entry point, in the test's process): the worker declares its
tasks, a CLI enqueue by name gets the task's declared defaults (``retries=0``: one run), a
name no worker declared is refused (and accepted with ``--allow-unknown-task``), and
``broker tasks`` lists the catalog."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from broker.jobs import JobStatus
from tests.e2e.test_e2e import Cluster, RunLog, eventually, sqlite_url
from tests.integration.test_operator import _cli

pytestmark = pytest.mark.slow

TASK = "tests.e2e_app.charge_once"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path, sqlite_url(tmp_path))
    try:
        yield cluster
    finally:
        await cluster.close()


async def _broker(cluster: Cluster, *argv: str) -> subprocess.CompletedProcess[str]:
    """``broker --main MAIN ARGV``, its entry point called in this process with its output
    captured: what the command prints and exits with is what these tests check (the
    command as a process is ``tests/e2e/test_cli_process.py``'s), and a process of it
    costs half a second of CPU, mostly imports."""
    code, out, err = await _cli("--main", f"127.0.0.1:{cluster.port}", *argv)
    return subprocess.CompletedProcess(list(argv), code, out, err)


async def test_a_cli_enqueue_gets_the_declared_defaults_and_unknown_names_are_refused(
    cluster: Cluster,
) -> None:
    await cluster.start_main()
    await cluster.start_worker("w1")
    async with cluster.client() as client:

        async def declared() -> bool:
            return any(t["task"] == TASK for t in await client.list_tasks())

        await eventually(declared, "the worker's tasks in the catalog", detail=cluster.logs)

        enqueued = await _broker(cluster, "enqueue", TASK, '["k1"]')
        assert enqueued.returncode == 0, enqueued.stderr
        job_id = uuid.UUID(enqueued.stdout.strip())

        async def dead() -> bool:
            job = await client.get_job(job_id)
            return job is not None and job["status"] == JobStatus.FAILED

        await eventually(dead, "the job to fail", detail=cluster.logs)
        job = await client.get_job(job_id)
        assert job is not None
        assert (job["max_attempts"], job["attempts"], job["queue"]) == (1, 1, "once")
        assert job["execution_mode"] == "inline" and job["timeout"] == 30
        assert len(RunLog.read(cluster.runs).starts["k1"]) == 1, "declared retries=0: one run"
        shown = await _broker(cluster, "job", str(job_id))
        assert "runs               1 of at most 1" in shown.stdout, shown.stdout
        assert "retry rules        any Exception; backoff: the main's" in shown.stdout

        # A caller's own option still wins over the declaration.
        kept = await _broker(cluster, "enqueue", TASK, '["k2"]', "--queue", "mine", "--json")
        assert kept.returncode == 0, kept.stderr
        mine = await client.get_job(json.loads(kept.stdout)["job_id"])
        assert mine is not None and (mine["queue"], mine["max_attempts"]) == ("mine", 1)

        typo = await _broker(cluster, "enqueue", "tests.e2e_app.charge_onse", '["k3"]')
        assert typo.returncode == 1
        assert "no worker has declared task 'tests.e2e_app.charge_onse'" in typo.stderr
        assert "--allow-unknown-task" in typo.stderr and "Traceback" not in typo.stderr
        page = await client.list_jobs(tasks=["tests.e2e_app.charge_onse"])
        assert page.jobs == [], "a refused enqueue stores nothing"

        cold = await _broker(
            cluster, "enqueue", "tests.e2e_app.later", "--allow-unknown-task", "--json"
        )
        assert cold.returncode == 0, cold.stderr
        stored = await client.get_job(json.loads(cold.stdout)["job_id"])
        assert stored is not None and stored["max_attempts"] == 11, "the broker's defaults"

    listing = await _broker(cluster, "tasks")
    assert listing.returncode == 0, listing.stderr
    [row] = [line for line in listing.stdout.splitlines() if line.startswith(TASK)]
    assert row.split()[:4] == [TASK, "inline", "once", "0"], row
    assert "w1" in row and "30s" in row
    as_json = await _broker(cluster, "tasks", "--json")
    entries = {t["task"]: t for t in json.loads(as_json.stdout)["tasks"]}
    declared_json = entries[TASK]["declaration"]
    assert declared_json["max_attempts"] == 1 and declared_json["parameters"] == ["key"]
    assert entries[TASK]["worker_id"] == "w1"


async def test_broker_tasks_tells_connected_workers_from_gone_ones_and_the_grace_drops_them(
    cluster: Cluster,
) -> None:
    """Two workers declare the same tasks; one stops. ``broker tasks`` shows the other as
    connected and the gone one with the time it was last seen, until the task grace
    (five seconds here: long enough to look, short for a test) drops the gone one's
    declarations; the connected one's stay."""
    await cluster.start_main("--task-grace", "5")
    await cluster.start_worker("w1")
    gone = await cluster.start_worker("w2")
    async with cluster.client() as client:

        async def rows() -> dict[str, Any]:
            tasks = await client.list_tasks()
            return {str(t["worker_id"]): t for t in tasks if t["task"] == TASK}

        async def both_connected() -> bool:
            seen = await rows()
            return {w: t["connected"] for w, t in seen.items()} == {"w1": True, "w2": True}

        await eventually(
            both_connected, "both workers' declarations, connected", detail=cluster.logs
        )
        assert await gone.terminate() == 0

        async def w2_gone_but_listed() -> bool:
            return (await rows()).get("w2", {}).get("connected") is False

        await eventually(w2_gone_but_listed, "w2 listed as not connected", detail=cluster.logs)
        table = await _broker(cluster, "tasks")
        lines = [line for line in table.stdout.splitlines() if line.startswith(TASK)]
        [w1_row] = [line for line in lines if " w1 " in line]
        assert "connected" in w1_row, table.stdout
        # Gone: its last-seen time, unless the grace dropped it meanwhile.
        assert all("UTC" in line for line in lines if " w2 " in line), table.stdout

        async def w2_dropped() -> bool:
            return set(await rows()) == {"w1"}

        await eventually(
            w2_dropped, "the task grace to drop w2's declarations", detail=cluster.logs
        )
        assert (await rows())["w1"]["connected"] is True
