"""Large payloads end to end: a real ``broker-main``, a real worker and its pooled child,
on a SQLite file and on PostgreSQL.

Arguments and results of 1 MiB and 10 MiB go through the client, the main, the store's
payload table, the worker, the child's pipe and back; the job rows that claims and
settles rewrite hold none of it.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from broker.payload import DEFAULT_OFFLOAD_BYTES
from tests.e2e.test_e2e import Cluster, eventually
from tests.e2e.test_e2e import store_url as store_url  # the fixture: SQLite, PostgreSQL

pytestmark = pytest.mark.slow

MiB = 1 << 20
ECHO = "tests.pool_app.echo_blob"


async def _hot_row_sizes(url: str) -> tuple[int, int]:
    """The longest payload column of any ``broker_jobs`` row, and how many payload rows."""
    engine = create_async_engine(url.replace("postgresql://", "postgresql+asyncpg://", 1))
    try:
        async with engine.connect() as conn:
            longest = (
                await conn.execute(
                    sa.text(
                        "SELECT max(length(args) + length(kwargs) + "
                        "coalesce(length(result), 0)) FROM broker_jobs"
                    )
                )
            ).scalar()
            offloaded = (
                await conn.execute(sa.text("SELECT count(*) FROM broker_payloads"))
            ).scalar()
    finally:
        await engine.dispose()
    return int(longest or 0), int(offloaded or 0)


async def test_1_and_10_mib_args_and_results_round_trip_and_stay_out_of_the_job_rows(
    tmp_path: Path, store_url: str
) -> None:
    cluster = Cluster(tmp_path, store_url)
    try:
        # The default liveness (15 s): a process encoding a 10 MiB message on a loaded
        # machine may well leave a ping unanswered for the suite's usual 1 s.
        await cluster.start_main("--ping-interval", "5", "--liveness-timeout", "15")
        worker = await cluster.spawn(
            "worker",
            *("worker", "--main", f"127.0.0.1:{cluster.port}", "--app", "tests.pool_app"),
            *("--worker-id", "big-worker", "--inline-concurrency", "0"),
            *("--forked-concurrency", "0", "--pooled-runner-count", "1"),
        )
        await worker.wait_for_output("connected to main")
        async with cluster.client() as client:
            for size in (MiB, 10 * MiB):
                blob = os.urandom(size // 2).hex()
                started = time.monotonic()
                made = await client.enqueue(ECHO, [blob, size])

                async def completed(job_id: uuid.UUID = made.job_id) -> bool:
                    job = await client.get_job(job_id)
                    assert job is not None and job["status"] in (
                        "queued",
                        "handed_off",
                        "completed",
                    ), job
                    return job["status"] == "completed"

                await eventually(
                    completed, f"the {size >> 20} MiB job to complete", detail=cluster.logs
                )
                seconds = time.monotonic() - started
                print(f"{size >> 20} MiB: enqueue to completion seen in {seconds:.2f} s")
                job = await client.get_job(made.job_id)
                assert job is not None
                assert job["args"] == [blob, size], "the stored arguments, whole"
                result = job["result"]
                assert isinstance(result, dict)
                assert result["digest"] == hashlib.sha256(blob.encode()).hexdigest(), (
                    "the child received every byte of the argument"
                )
                assert len(result["blob"]) == size, "the whole result came back"
        longest, offloaded = await _hot_row_sizes(store_url)
        assert longest <= 3 * DEFAULT_OFFLOAD_BYTES, "no large value in a job row"
        assert longest < 1000, "nor any value near the threshold in these jobs"
        assert offloaded == 4, "each job's args and result live in the payload table"
    finally:
        await cluster.close()
