"""Payload integrity end to end: a real ``broker-main`` and a real worker, on a SQLite file
and on PostgreSQL.

Nine due jobs whose arguments are offloaded wait for a worker; one of their
``broker_payloads`` rows is edited behind the main's back (one byte changed, or the body
cut so it is no longer JSON). When the worker connects, the main claims the nine in one
batch: the edited job ends dead with "payload failed its integrity check" under the
lease of that claim, never runs, and the other eight complete. Before the digest, the
edited byte ran as is and the cut body failed the claim of every batch holding it.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from adapters.sql.schema import payloads
from broker.exceptions import StorageRejectedError
from broker.jobs import Job, JobSpec, JobStatus
from broker.payload import DEFAULT_OFFLOAD_BYTES
from broker.storage import INTEGRITY_ERROR, payload_digest
from tests.e2e.test_e2e import Cluster, eventually, observe
from tests.e2e.test_e2e import store_url as store_url  # the fixture: SQLite, PostgreSQL

pytestmark = pytest.mark.slow

ECHO = "tests.pool_app.echo_blob"


def _flip_a_byte(body: str) -> tuple[str, bool]:
    """One character of the blob changed: still JSON, only the SHA-256 can tell."""
    at = body.index("a")
    return f"{body[:at]}b{body[at + 1 :]}", False


def _not_json(body: str) -> tuple[str, bool]:
    """The body cut short, with a SHA-256 that matches it (a forged one): the digest
    passes, and what catches it is that it no longer decodes."""
    return body[: len(body) // 2], True


async def _tamper(url: str, job_id: uuid.UUID, edit: Callable[[str], tuple[str, bool]]) -> None:
    engine = create_async_engine(url.replace("postgresql://", "postgresql+asyncpg://", 1))
    where = (payloads.c.job_id == job_id) & (payloads.c.kind == "args")
    try:
        async with engine.begin() as conn:
            body = (await conn.execute(sa.select(payloads.c.body).where(where))).scalar_one()
            text, rehash = edit(body)
            values = {"body": text, **({"digest": payload_digest(text)} if rehash else {})}
            await conn.execute(sa.update(payloads).where(where).values(**values))
    finally:
        await engine.dispose()


@pytest.mark.parametrize("edit", [_flip_a_byte, _not_json], ids=["byte", "not_json"])
async def test_a_tampered_payload_fails_its_job_and_the_rest_of_its_batch_completes(
    tmp_path: Path, store_url: str, edit: Callable[[str], tuple[str, bool]]
) -> None:
    cluster = Cluster(tmp_path, store_url)
    blobs = [("a" * (DEFAULT_OFFLOAD_BYTES + 1)) + str(i) for i in range(9)]
    specs = [JobSpec(task=ECHO, args=[blob, 8], max_attempts=3) for blob in blobs]
    bad = specs[4].id
    try:
        main = await cluster.start_main()
        async with cluster.client() as client:
            made = await client.enqueue_many(specs)
            assert [r.job_id for r in made] == [s.id for s in specs]
            await _tamper(store_url, bad, edit)
            worker = await cluster.spawn(
                "worker",
                *("worker", "--main", f"127.0.0.1:{cluster.port}", "--app", "tests.pool_app"),
                *("--worker-id", "w1", "--inline-concurrency", "0", "--forked-concurrency", "0"),
                *("--pooled-runner-count", "1", "--pooled-runner-concurrency", "16"),
            )
            await worker.wait_for_output("connected to main")
            async with observe(store_url) as store:

                async def summaries() -> dict[uuid.UUID, Job]:
                    # A summary loads no offloaded value (a full one of the bad job fails).
                    page = await store.list_jobs(limit=100, include_payload=False)
                    return {j.id: j for j in page.jobs}

                async def settled() -> bool:
                    jobs = await summaries()
                    return len(jobs) == len(specs) and all(
                        j.status in (JobStatus.COMPLETED, JobStatus.FAILED) for j in jobs.values()
                    )

                await eventually(settled, "all nine jobs to settle", detail=cluster.logs)
                dead = (await summaries())[bad]
                done = [await store.get_job(s.id) for s in specs if s.id != bad]
            assert dead.status is JobStatus.FAILED, dead
            assert dead.last_error is not None and dead.last_error.startswith(INTEGRITY_ERROR)
            assert "args" in dead.last_error, dead.last_error
            assert dead.handoff_id is not None and dead.worker_id == "w1", "failed at its claim"
            assert dead.attempts == 1, "counted once"
            for job, spec in zip(done, [s for s in specs if s.id != bad], strict=True):
                assert job is not None and job.status is JobStatus.COMPLETED, job
                assert isinstance(job.result, dict)
                want = hashlib.sha256(str(spec.args[0]).encode()).hexdigest()
                assert job.result["digest"] == want, "each ran with its own arguments"
            with pytest.raises(StorageRejectedError, match=INTEGRITY_ERROR):
                await client.get_job(bad)
            assert (await client.get_job(specs[0].id) or {})["status"] == "completed"
            log = main.output()
            assert f"job failed at claim job_id={bad}" in log, "the main says which and why"
            assert "claim outcome unknown" not in log and "splitting" not in log, "no claim failed"
    finally:
        await cluster.close()
