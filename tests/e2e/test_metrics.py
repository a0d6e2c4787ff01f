"""``/metrics`` of a real ``broker-main`` and ``broker-worker`` while jobs run and the worker
drains: the counters move by exactly the jobs that happened, and everything parses with
``prometheus_client``'s own parser."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.client.client import Client
from tests.e2e.test_e2e import Cluster, eventually, free_port, sqlite_url

pytestmark = pytest.mark.slow

APP = "tests.web_app"
TOKEN = "metrics-test-token"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(port: int) -> Samples:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await response.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path, sqlite_url(tmp_path), token=TOKEN)
    try:
        yield cluster
    finally:
        await cluster.close()


async def test_counters_move_by_the_jobs_run_during_a_drain(
    cluster: Cluster, tmp_path: Path
) -> None:
    http_port, worker_port = free_port(), free_port()
    await cluster.start_main("--http-port", str(http_port))
    worker = await cluster.spawn(
        "worker",
        *("worker", "--main", f"127.0.0.1:{cluster.port}", "--app", APP, "--token", TOKEN),
        *("--worker-id", "w1", "--metrics-port", str(worker_port)),
        *("--pooled-runner-count", "1", "--inline-concurrency", "4"),
    )
    await worker.wait_for_output("connected to main")
    main_before = await scrape(http_port)
    worker_before = await scrape(worker_port)
    gate = tmp_path / "gate"

    async with Client("127.0.0.1", cluster.port, token=TOKEN) as client:
        greets = [
            await client.enqueue(f"{APP}.greet", [str(n)], queue="a", execution_mode="inline")
            for n in range(5)
        ]
        explodes = [
            await client.enqueue(
                f"{APP}.explode", ["x"], queue="b", execution_mode="inline", max_attempts=1
            )
            for _ in range(3)
        ]
        squares = [
            await client.enqueue(f"{APP}.square", [n], queue="a", execution_mode="pooled")
            for n in range(2)
        ]
        for _ in range(2):
            await client.enqueue(
                f"{APP}.greet", ["dup"], queue="a", execution_mode="inline", idempotency_key="k"
            )

        async def all_ended() -> bool:
            for ref in [*greets, *explodes, *squares]:
                job = await client.get_job(ref.job_id)
                if job is None or job["status"] not in ("completed", "failed", "cancelled"):
                    return False
            return True

        await eventually(all_ended, "every job to end", detail=cluster.logs)

        # Two jobs held open, then the worker is told to drain while they run.
        held = [
            await client.enqueue(f"{APP}.wait_for", [str(gate)], queue="c", execution_mode="inline")
            for _ in range(2)
        ]

        async def holding() -> bool:
            m, w = await scrape(http_port), await scrape(worker_port)
            return (
                value(m, "broker_jobs_in_flight") == 2
                and value(w, "broker_worker_running_jobs") == 2
            )

        await eventually(holding, "both held jobs to run", detail=cluster.logs)
        worker.process.send_signal(signal.SIGTERM)

        async def draining() -> bool:
            m, w = await scrape(http_port), await scrape(worker_port)
            return (
                value(m, "broker_workers_draining") == 1 and value(w, "broker_worker_draining") == 1
            )

        await eventually(draining, "the worker to drain", detail=cluster.logs)
        during = await scrape(worker_port)
        assert value(during, "broker_worker_running_jobs") == 2

        gate.touch()
        assert await worker.exit_code() == 0
        for ref in held:
            job = await client.get_job(ref.job_id)
            assert job is not None and job["status"] == "completed"

    after = await scrape(http_port)

    def jobs(name: str, queue: str, task: str) -> float:
        return moved(
            main_before, after, f"broker_jobs_{name}_total", queue=queue, task=f"{APP}.{task}"
        )

    assert jobs("enqueued", "a", "greet") == 6  # five, and one of the two duplicates
    assert jobs("enqueued", "b", "explode") == 3
    assert jobs("enqueued", "a", "square") == 2
    assert jobs("started", "a", "greet") == 6
    assert jobs("completed", "a", "greet") == 6
    assert jobs("completed", "a", "square") == 2
    assert jobs("completed", "c", "wait_for") == 2
    assert jobs("failed", "b", "explode") == 3
    assert jobs("dead", "b", "explode") == 3
    assert jobs("failed", "a", "greet") == 0
    assert (
        moved(main_before, after, "broker_job_run_seconds_count", queue="a", outcome="complete")
        == 8
    )
    assert moved(main_before, after, "broker_job_wait_seconds_count", queue="b") == 3
    assert moved(main_before, after, "broker_report_batch_size_sum") == 6 + 2 + 3 + 2
    assert moved(main_before, after, "broker_store_errors_total", operation="claim") == 0

    async def depths_settled() -> bool:
        levels = await scrape(http_port)
        return (
            value(levels, "broker_queue_jobs", queue="a", status="completed") == 8
            and value(levels, "broker_queue_jobs", queue="b", status="failed") == 3
            and value(levels, "broker_workers_connected") == 0
        )

    await eventually(depths_settled, "the levels to show the drained store")
    # The worker's own counters, from its last scrape: one pooled child started (and no
    # crash); the drain ran its two held jobs to the end.
    assert moved(worker_before, during, "broker_worker_child_starts_total", mode="pooled") == 0
    assert value(during, "broker_worker_child_starts_total", mode="pooled") == 1
    assert value(during, "broker_worker_child_crashes_total", mode="pooled") == 0
