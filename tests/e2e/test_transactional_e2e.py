"""A job enqueued in the application's own transaction is run by real ``broker-main`` and
``broker-worker`` processes: on PostgreSQL the insert trigger's notification at commit
wakes the main (its safety poll, 30 s, is longer than the wait here); on SQLite its
poll finds the job."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

import broker
from broker.jobs import JobStatus
from tests.e2e.test_e2e import RECORD, Cluster, RunLog, eventually, observe, store_url

pytestmark = pytest.mark.slow

__all__ = ["store_url"]  # the fixture, shared with test_e2e


def _app_url(store_url: str) -> str:
    """The same database as the application reaches it, through a synchronous driver."""
    url = make_url(store_url)
    driver = "sqlite" if url.get_backend_name() == "sqlite" else "postgresql+psycopg"
    return url.set(drivername=driver).render_as_string(hide_password=False)


async def test_a_job_enqueued_in_an_apps_session_is_run_by_a_real_main_and_worker(
    tmp_path: Path, store_url: str
) -> None:
    cluster = Cluster(tmp_path, store_url)
    try:
        await cluster.start_main()
        worker = await cluster.start_worker("worker-1")
        key = str(uuid.uuid4())
        engine = sa.create_engine(_app_url(store_url))
        try:
            with Session(engine) as session, session.begin():
                result = broker.enqueue_in(session, RECORD, [key], execution_mode="inline")
        finally:
            engine.dispose()
        await eventually(
            lambda: key in RunLog.read(cluster.runs).ended_by(worker.pid),
            "the worker to run the job",
            detail=cluster.logs,
        )
        async with observe(cluster.url) as store:

            async def completed() -> bool:
                job = await store.get_job(result.job.id)
                return job is not None and job.status is JobStatus.COMPLETED

            await eventually(completed, "the job to be completed in the store")
    finally:
        await cluster.close()
