"""The dashboard over real HTTP without a browser: bad input is a clear 400 and changes
nothing, actions need the token (a form field or a bearer header), and a main without a
token takes no action from the dashboard."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.jobs import JobSpec, JobStatus
from broker.main.main import Main
from broker.model.bounds import BULK_ACTION_JOBS, DASHBOARD_REQUESTS
from broker.ops.web import Dashboard
from broker.ops.web import dashboard as web_dashboard
from broker.storage import JobPage
from tests.support import FAST, until

TOKEN = "web-token"
BOUND = 7
assert BOUND < BULK_ACTION_JOBS


@asynccontextmanager
async def dashboard(tmp_path: Path, token: str | None) -> AsyncIterator[tuple[Main, str]]:
    store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}")
    main = Main(store, replace(FAST, token=token), retention=None)
    await main.start()
    site = Dashboard(main, host="127.0.0.1", port=0)
    await site.start()
    try:
        yield main, f"http://127.0.0.1:{site.port}"
    finally:
        await site.stop()
        await main.stop()


async def queued_job(main: Main) -> uuid.UUID:
    [result] = await main.store.enqueue_many([JobSpec(task="t", queue="q")])
    return result.job.id


@pytest.mark.parametrize(
    "path",
    [
        "/jobs?status=bogus",
        "/jobs?limit=many",
        "/jobs?cursor=not-a-cursor",
    ],
)
async def test_a_bad_filter_is_a_clear_400(tmp_path: Path, path: str) -> None:
    async with (
        dashboard(tmp_path, TOKEN) as (_, url),
        aiohttp.ClientSession() as http,
        http.get(url + path) as response,
    ):
        assert response.status == 400
        text = await response.text()
        assert "bad filter" in text or "cursor is not valid" in text, text


async def test_unknown_jobs_are_404(tmp_path: Path) -> None:
    async with dashboard(tmp_path, TOKEN) as (_, url), aiohttp.ClientSession() as http:
        for path in (f"/jobs/{uuid.uuid4()}", "/jobs/not-an-id"):
            async with http.get(url + path) as response:
                assert response.status == 404


async def test_a_bearer_token_works_and_a_wrong_one_is_refused(tmp_path: Path) -> None:
    async with dashboard(tmp_path, TOKEN) as (main, url), aiohttp.ClientSession() as http:
        job_id = await queued_job(main)
        cancel = f"{url}/jobs/{job_id}/cancel"
        wrong = {"Authorization": "Bearer nope"}
        async with http.post(cancel, headers=wrong, allow_redirects=False) as response:
            assert response.status == 403
        job = await main.store.get_job(job_id)
        assert job is not None and job.status is JobStatus.QUEUED
        right = {"Authorization": f"Bearer {TOKEN}"}
        async with http.post(cancel, headers=right, allow_redirects=False) as response:
            assert response.status == 303
        job = await main.store.get_job(job_id)
        assert job is not None and job.status is JobStatus.CANCELLED


@pytest.mark.parametrize("days", ["", "-1", "1e300", "nan"])
async def test_a_bad_prune_is_refused_and_deletes_nothing(tmp_path: Path, days: str) -> None:
    async with dashboard(tmp_path, TOKEN) as (main, url), aiohttp.ClientSession() as http:
        job_id = await queued_job(main)
        await main.store.cancel(job_id)
        form = {"token": TOKEN, "older_than_days": days}
        async with http.post(f"{url}/prune", data=form, allow_redirects=False) as response:
            assert response.status == 400
            page = await response.text()  # the reason in the page, and the way back
            assert '<div class="msg error" id="error-notice">refused: ' in page, page
            assert '<a id="back" href="/">Back</a>' in page
        assert await main.store.get_job(job_id) is not None


async def test_a_main_without_a_token_takes_no_actions(tmp_path: Path) -> None:
    async with dashboard(tmp_path, None) as (main, url), aiohttp.ClientSession() as http:
        job_id = await queued_job(main)
        async with http.post(f"{url}/jobs/{job_id}/cancel", data={"token": ""}) as response:
            assert response.status == 403
            assert "this main has no token" in await response.text()
        job = await main.store.get_job(job_id)
        assert job is not None and job.status is JobStatus.QUEUED
        async with http.get(f"{url}/healthz") as response:
            assert response.status == 200


class _StuckListings(SQLAlchemyAdapter):
    """A store whose job listings, once ``stuck``, hang until released: the fault that
    shows who holds a request slot meanwhile."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.stuck = False
        self.release = asyncio.Event()
        self.entered = 0

    async def list_jobs(self, *args: Any, **kwargs: Any) -> JobPage:
        if self.stuck:
            self.entered += 1
            await self.release.wait()
        return await super().list_jobs(*args, **kwargs)


async def test_dashboard_searches_never_take_the_clients_request_slots(tmp_path: Path) -> None:
    """Twelve id searches, which need no credential, are stuck in the store: they hold
    the dashboard's own slots only, so a client's request is answered at once (before,
    they took all 8 of the clients' slots and the client waited for them)."""
    store = _StuckListings(f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}")
    main = Main(store, replace(FAST, token=TOKEN), retention=None)
    await main.start()
    site = Dashboard(main, host="127.0.0.1", port=0)
    await site.start()
    job_id = await queued_job(main)
    try:
        async with (
            aiohttp.ClientSession() as http,
            Client("127.0.0.1", main.port, token=TOKEN) as client,
        ):
            url = f"http://127.0.0.1:{site.port}/jobs?id=abc"
            store.stuck = True
            searches = [asyncio.create_task(http.get(url)) for _ in range(12)]
            await until(lambda: store.entered >= DASHBOARD_REQUESTS)
            job = await asyncio.wait_for(client.get_job(job_id), 10.0)
            assert job is not None and job["status"] == "queued"
            assert store.entered == DASHBOARD_REQUESTS  # the other searches wait their turn
            store.release.set()
            for response in await asyncio.gather(*searches):
                assert response.status == 200
                response.release()
    finally:
        store.release.set()
        await site.stop()
        await main.stop()


async def test_a_bulk_cancel_acts_on_at_most_its_bound_and_says_more_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bound made small: at 500 jobs one request takes seconds on a loaded machine.
    monkeypatch.setattr(web_dashboard, "BULK_ACTION_JOBS", BOUND)
    async with dashboard(tmp_path, TOKEN) as (main, url), aiohttp.ClientSession() as http:
        later = datetime.now(UTC) + timedelta(hours=1)
        specs = [JobSpec(task="t", queue="q", run_at=later) for _ in range(BOUND + 2)]
        await main.store.enqueue_many(specs)
        async with http.get(f"{url}/jobs/bulk?queue=q&action=cancel") as response:
            page = await response.text()
            assert f"at least {BOUND} jobs" in page, page
            before = re.search(r'name="before" value="([^"]+)"', page)
            assert before is not None
        form = {"token": TOKEN, "queue": "q", "action": "cancel", "before": before.group(1)}
        async with http.post(f"{url}/jobs/bulk", data=form, allow_redirects=False) as response:
            assert response.status == 303
            where = response.headers["Location"]
        assert f"{BOUND}+jobs+cancelled" in where and "run+it+again" in where, where
        counts = {row.status: row.count for row in await main.store.count_jobs()}
        assert counts == {JobStatus.CANCELLED: BOUND, JobStatus.QUEUED: 2}

        form = {"token": TOKEN, "queue": "q", "action": "cancel"}  # no confirmation
        async with http.post(f"{url}/jobs/bulk", data=form) as response:
            assert response.status == 400
            assert "the confirmation is missing" in await response.text()
