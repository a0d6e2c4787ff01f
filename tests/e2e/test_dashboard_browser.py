"""The web dashboard in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium), against a real main on a real SQLite file with a
real worker running real jobs.

The browser is missing on a bare machine: then these tests skip, except under ``CI=true``
where ``.ci/run`` installs it and its absence is a failure. The screenshots in
``docs/images/`` are made by :mod:`tests.e2e.dashboard_screenshots`, during a drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.jobs import ExecutionMode, JobSpec
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.ops.web import Dashboard
from broker.tasks.registry import TaskRegistry, task
from broker.tasks.schedule import Schedule
from broker.worker.worker import Worker
from runners.inline import InlineRunner
from tests.e2e.browser import chrome, missing_browser
from tests.support import until

pytestmark = pytest.mark.slow

TOKEN = "operator-secret"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = missing_browser()
    if missing is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the browser tests need a browser under CI=true: {missing}")
        pytest.skip(missing)
    driver = chrome()
    try:
        yield driver
    finally:
        driver.quit()


@dataclass
class Site:
    """A running main with its dashboard and a worker, and the browser pointed at it."""

    main: Main
    dashboard: Dashboard
    client: Client
    driver: Any
    worker_task: asyncio.Task[None] | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard.port}"

    async def do(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A blocking browser call, in a thread, so this loop keeps serving the page."""
        return await asyncio.to_thread(fn, *args)

    async def url_has(self, text: str) -> bool:
        return text in str(await self.do(lambda: self.driver.current_url))

    async def open(self, path: str) -> None:
        await self.do(self.driver.get, self.url + path)

    async def text(self, css: str = "body") -> str:
        """The text of the first element matching ``css``, read in one script (the live
        refresh may replace the element between two separate calls)."""
        script = "var e=document.querySelector(arguments[0]);return e?e.innerText:''"
        return str(await self.do(self.driver.execute_script, script, css))

    async def shows(self, needle: str, css: str = "body") -> str:
        """Wait until ``needle`` appears (a click's page may still be loading)."""

        async def check() -> str | None:
            text = await self.text(css)
            return text if needle in text else None

        return str(await until(check))

    async def rows(self) -> list[str]:
        script = (
            "return Array.from(document.querySelectorAll('#live tbody tr'))"
            ".map(function(r){return r.innerText;})"
        )
        return [str(row) for row in await self.do(self.driver.execute_script, script)]

    async def click(self, css: str) -> None:
        from selenium.webdriver.common.by import By

        element = await self.do(self.driver.find_element, By.CSS_SELECTOR, css)
        await self.do(element.click)

    async def type_token(self, token: str) -> None:
        from selenium.webdriver.common.by import By

        box = await self.do(self.driver.find_element, By.ID, "token")
        await self.do(box.clear)
        await self.do(box.send_keys, token)

    async def stop_worker(self) -> None:
        if self.worker_task is not None:
            self.worker_task.cancel()
            await asyncio.gather(self.worker_task, return_exceptions=True)
            self.worker_task = None
            await until(
                lambda: all(p.worker_id != "worker-eu-1" for p in self.main.handoff.peers.values())
            )

    async def status(self, job_id: uuid.UUID) -> str:
        job = await self.client.get_job(job_id)
        assert job is not None
        return str(job["status"])


def _registry() -> TaskRegistry:
    registry = TaskRegistry()

    @task(name="mail.send", registry=registry, mode="inline")
    async def send(to: str) -> str:
        return f"sent to {to}"

    @task(name="report.build", registry=registry, mode="inline", retries=0)
    async def build(name: str) -> None:
        raise ValueError(f"no data for report {name!r}")

    return registry


@pytest.fixture
async def site(tmp_path: Path, browser: Any) -> AsyncIterator[Site]:
    store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}")
    settings = MainSettings(port=0, token=TOKEN, poll_interval=0.05)
    nightly = Schedule(
        name="nightly-report",
        task="report.build",
        cron="0 3 * * *",
        timezone="Europe/Paris",
        args=["nightly"],
        catch_up=False,
    )
    main = Main(store, settings, schedules=[nightly], retention=None)
    await main.start()
    dashboard = Dashboard(main, host="127.0.0.1", port=0)
    await dashboard.start()
    registry = _registry()
    worker = Worker(
        "127.0.0.1",
        main.port,
        worker_id="worker-eu-1",
        runners={ExecutionMode.INLINE: InlineRunner(registry, concurrency=4)},
        registry=registry,
        token=TOKEN,
    )
    worker_task = asyncio.create_task(worker.run())
    client = Client("127.0.0.1", main.port, token=TOKEN)
    await until(lambda: main.handoff.workers())
    try:
        yield Site(main, dashboard, client, browser, worker_task)
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        worker_task.cancel()
        await asyncio.gather(worker_task, return_exceptions=True)
        await dashboard.stop()
        await main.stop()


async def _enqueue(site: Site, name: str, args: list[Any], **options: Any) -> uuid.UUID:
    ref = await site.client.enqueue(name, args, execution_mode="inline", **options)
    return ref.job_id


async def _some_jobs(site: Site) -> tuple[list[uuid.UUID], uuid.UUID]:
    sent = [await _enqueue(site, "mail.send", [f"user{n}@example.com"]) for n in range(3)]
    dead = await _enqueue(site, "report.build", ["weekly"], queue="reports", max_attempts=1)
    for job_id in [*sent, dead]:
        await until(lambda j=job_id: _ended(site, j))
    return sent, dead


async def _ended(site: Site, job_id: uuid.UUID) -> bool:
    return await site.status(job_id) in ("completed", "failed", "cancelled")


async def test_each_view_renders(site: Site) -> None:
    _, dead = await _some_jobs(site)
    await _enqueue(site, "mail.send", ["later@example.com"], delay=3600)

    await site.open("/")
    queues = await site.rows()
    assert any(row.startswith("default") for row in queues), queues
    assert any(row.startswith("reports") for row in queues), queues

    await site.open("/workers")
    workers = await site.text("#live")
    assert "worker-eu-1" in workers and "inline" in workers and "serving" in workers

    await site.open("/jobs")
    assert len(await site.rows()) == 5

    await site.open(f"/jobs/{dead}")
    page = await site.text("#live")
    assert "report.build" in page and "failed" in page
    error = await site.text("#error")
    assert "ValueError: no data for report 'weekly'" in error
    assert "Traceback" in error  # the whole traceback, on lines of its own
    assert "+00:00" in page  # times carry their zone

    await site.open("/recoveries")
    assert "No recovery is pending." in await site.text("#live")

    await site.open("/schedules")
    schedules = await site.text("#live")
    assert "nightly-report" in schedules and "cron 0 3 * * * (Europe/Paris)" in schedules

    await site.open("/healthz")
    assert "ok" in await site.text()


async def test_a_filter_narrows_the_list(site: Site) -> None:
    sent, _ = await _some_jobs(site)
    await site.open("/jobs")
    assert len(await site.rows()) == 4

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    select = await site.do(site.driver.find_element, By.NAME, "status")
    await site.do(lambda: Select(select).select_by_value("failed"))
    await site.click("#filter button")
    await until(lambda: site.url_has("status=failed"))
    rows = await site.rows()
    assert len(rows) == 1 and "report.build" in rows[0], rows

    await site.open(f"/jobs?id={str(sent[1])[:6]}")
    rows = await site.rows()
    assert len(rows) == 1 and str(sent[1])[:8] in rows[0], rows


async def test_the_page_refreshes_without_reloading(site: Site) -> None:
    await site.open("/")
    await site.do(site.driver.execute_script, "window.notReloaded = true")
    assert "No jobs in the store." in await site.text("#live")
    await _enqueue(site, "mail.send", ["fresh@example.com"], queue="fresh", delay=3600)

    async def shows_it() -> bool:
        return "fresh" in await site.text("#live")

    await until(shows_it)
    assert await site.do(site.driver.execute_script, "return window.notReloaded") is True


async def test_retry_on_a_dead_job_makes_it_queued(site: Site) -> None:
    _, dead = await _some_jobs(site)
    await site.stop_worker()  # so the retried job stays queued for the check
    await site.open(f"/jobs/{dead}")
    await site.type_token(TOKEN)
    await site.click("button[value=retry]")
    await site.shows("job queued again", "#notice")
    assert "queued" in await site.text("#live")
    assert await site.status(dead) == "queued"
    job = await site.client.get_job(dead)
    assert job is not None and job["attempts"] == 0


async def test_cancel_works(site: Site) -> None:
    later = await _enqueue(site, "mail.send", ["later@example.com"], delay=3600)
    await site.open(f"/jobs/{later}")
    await site.type_token(TOKEN)
    await site.click("button[value=cancel]")
    await site.shows("job cancelled", "#notice")
    assert await site.status(later) == "cancelled"


async def test_an_action_without_the_credential_is_refused(site: Site) -> None:
    _, dead = await _some_jobs(site)
    later = await _enqueue(site, "mail.send", ["later@example.com"], delay=3600)
    await site.open(f"/jobs/{later}")
    await site.type_token("")
    await site.click("button[value=cancel]")
    await site.shows("refused: the operator token is missing or wrong")
    assert await site.status(later) == "queued"

    await site.open(f"/jobs/{dead}")
    await site.type_token("not-the-token")
    await site.click("button[value=retry]")
    await site.shows("refused: the operator token is missing or wrong")
    assert await site.status(dead) == "failed"

    await site.open("/")
    await site.type_token("")
    await site.click("#prune button")
    await site.shows("refused: the operator token is missing or wrong")


async def test_prune_with_the_credential(site: Site) -> None:
    await _some_jobs(site)
    await site.open("/")
    await site.type_token(TOKEN)
    from selenium.webdriver.common.by import By

    days = await site.do(site.driver.find_element, By.NAME, "older_than_days")
    await site.do(days.clear)
    await site.do(days.send_keys, "0")
    await site.click("#prune button")
    await site.shows("pruned 4 jobs", "#notice")


async def test_pages_go_newest_first(site: Site) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    specs = [JobSpec(task="mail.send", args=[f"n{n}"], run_at=later) for n in range(24)]
    ids = [ref.job_id for ref in await site.client.enqueue_many(specs)]
    newest = await _enqueue(site, "mail.send", ["newest"], delay=3600)
    await site.open("/jobs")
    first = await site.rows()
    assert len(first) == 20
    assert first[0].startswith(str(newest)[:8])
    await site.click("#next")
    await until(lambda: site.url_has("cursor="))
    rest = await site.rows()
    assert len(rest) == 5
    shown = {row.split()[0] for row in first + rest}
    assert shown == {str(job_id)[:8] for job_id in [*ids, newest]}


# ---------------------------------------------------------------- the incident views (issue 34)


async def _dead_reports(site: Site, n: int) -> list[uuid.UUID]:
    dead = [
        await _enqueue(site, "report.build", [f"r{i}"], queue="reports", max_attempts=1)
        for i in range(n)
    ]
    for job_id in dead:
        await until(lambda j=job_id: _ended(site, j))
    return dead


async def _count(site: Site, css: str) -> int:
    script = "return document.querySelectorAll(arguments[0]).length"
    return int(await site.do(site.driver.execute_script, script, css))


async def test_the_history_charts_runs_waits_and_depth(site: Site) -> None:
    await _some_jobs(site)  # three mails completed, one report failed for good
    await site.open("/history")
    summary = await site.shows("4 runs ended", "#summary")
    assert "all jobs" in summary and "1 failed for good" in summary, summary
    assert await _count(site, "svg.chart rect.c-completed") >= 1
    assert await _count(site, "svg.chart rect.c-failed") == 1
    assert await _count(site, 'svg[aria-label="wait from due to start"] polyline') == 2
    assert await _count(site, 'svg[aria-label="jobs queued"] polyline') == 1  # sampled

    await site.click('#series a[href*="queue=reports"]')
    await site.shows("queue reports", "#summary")
    assert "1 runs ended" in await site.text("#summary")
    await site.click('#windows a[href*="window=15m"]')
    await until(lambda: site.url_has("window=15m"))
    assert "the last 15 minutes" in await site.shows("queue reports", "#summary")

    await site.click('#series a[href*="task=mail.send"]')
    summary = await site.shows("task mail.send", "#summary")
    assert "3 runs ended" in summary
    assert "Sampled by queue" in await site.text("#charts")  # no depth by task


async def test_lists_show_error_and_progress_and_a_dead_job_starts_with_its_error(
    site: Site,
) -> None:
    _, dead = await _some_jobs(site)
    await site.open("/jobs")
    rows = await site.rows()
    failed = [row for row in rows if "report.build" in row]
    assert len(failed) == 1 and "ValueError: no data for report 'weekly'" in failed[0], rows
    assert all("done" in row for row in rows if "mail.send" in row), rows

    await site.open(f"/jobs/{dead}")
    script = (
        "var e=document.getElementById('error'),t=document.querySelector('#live table');"
        "return !!(e.compareDocumentPosition(t) & Node.DOCUMENT_POSITION_FOLLOWING)"
    )
    assert await site.do(site.driver.execute_script, script) is True  # the error comes first
    assert "ValueError" in await site.text("#error")


async def test_bulk_retry_asks_first_then_queues_them_all(site: Site) -> None:
    await _some_jobs(site)
    dead = await _dead_reports(site, 3)
    await site.stop_worker()  # so the retried jobs stay queued for the check
    await site.open("/jobs?queue=reports&status=failed")
    await site.click("#bulk-retry")
    count = await site.shows("4 jobs", "#bulk-count")
    assert "queue reports" in count and "status failed" in count, count
    for job_id in dead:
        assert await site.status(job_id) == "failed"  # nothing done before the confirmation
    await site.type_token(TOKEN)
    await site.click("#bulk button")
    await site.shows("4 jobs queued again", "#notice")
    assert await site.url_has("queue=reports")
    for job_id in dead:
        assert await site.status(job_id) == "queued"


async def test_bulk_cancel_leaves_jobs_enqueued_after_the_confirmation(site: Site) -> None:
    later = [await _enqueue(site, "mail.send", [f"l{n}@example.com"], delay=3600) for n in range(3)]
    await site.open("/jobs?status=queued")
    await site.click("#bulk-cancel")
    await site.shows("3 jobs", "#bulk-count")
    newer = await _enqueue(site, "mail.send", ["newer@example.com"], delay=3600)
    await site.type_token(TOKEN)
    await site.click("#bulk button")
    await site.shows("3 jobs cancelled", "#notice")
    for job_id in later:
        assert await site.status(job_id) == "cancelled"
    assert await site.status(newer) == "queued"


async def test_a_refused_bulk_action_says_why_in_the_page_with_a_way_back(site: Site) -> None:
    later = await _enqueue(site, "mail.send", ["later@example.com"], delay=3600)
    await site.open("/jobs?queue=default")
    await site.click("#bulk-cancel")
    await site.shows("1 job", "#bulk-count")
    await site.type_token("not-the-token")
    await site.click("#bulk button")
    notice = await site.shows("refused", "#error-notice")
    assert "the operator token is missing or wrong" in notice
    assert await site.status(later) == "queued"
    await site.click("#back")
    await until(lambda: site.url_has("/jobs?queue=default"))
    assert len(await site.rows()) == 1


async def test_rate_limit_set_and_cleared_from_the_queues_view(site: Site) -> None:
    await _enqueue(site, "mail.send", ["later@example.com"], delay=3600)
    from selenium.webdriver.common.by import By

    await site.open("/")
    await site.type_token(TOKEN)
    rate = await site.do(site.driver.find_element, By.CSS_SELECTOR, "form.limit input[name=rate]")
    await site.do(rate.send_keys, "fast")
    await site.click("button[value=limit]")
    notice = await site.shows("refused", "#error-notice")
    assert "rate" in notice, notice  # the reason the main gave, in the page
    await site.click("#back")

    async def back_on_the_queues() -> bool:
        return not await site.url_has("/queues/limit")

    await until(back_on_the_queues)

    rate = await site.do(site.driver.find_element, By.CSS_SELECTOR, "form.limit input[name=rate]")
    await site.do(rate.send_keys, "30/m")
    await site.click("button[value=limit]")
    await site.shows("queue default limited to 30/m", "#notice")
    assert "at most 30/m" in await site.text("#live")
    settings = (await site.client.status())["queue_settings"]
    assert [(q["queue"], q["rate_limit"]) for q in settings] == [("default", "30/m")]

    await site.click('button[value="clear limit"]')
    await site.shows("queue default no longer rate limited", "#notice")
    assert "at most" not in await site.text("#live")


async def test_pause_and_resume_from_the_queues_view(site: Site) -> None:
    await _enqueue(site, "mail.send", ["later@example.com"], delay=3600)
    await site.open("/")
    await site.type_token(TOKEN)
    await site.click("button[value=pause]")
    await site.shows("queue default paused", "#notice")
    assert "paused" in await site.text("#live")
    await site.click("button[value=resume]")
    await site.shows("queue default resumed", "#notice")
    assert "dispatching" in await site.text("#live")


async def test_worker_figures_are_those_of_broker_status(site: Site) -> None:
    await site.stop_worker()
    registry = _registry()

    @task(name="slow.wait", registry=registry, mode="inline")
    async def slow() -> None:
        await asyncio.Event().wait()

    worker = Worker(
        "127.0.0.1",
        site.main.port,
        worker_id="worker-eu-2",
        runners={ExecutionMode.INLINE: InlineRunner(registry, concurrency=2)},
        registry=registry,
        token=TOKEN,
        # A window of 2: the backlog may fill 1 of it, the other is the spare kept for a
        # job that jumps the line (docs/guarantees.md), so the third job is prefetched
        # whether or not it led at its enqueue.
        prefetch=2,
    )
    site.worker_task = asyncio.create_task(worker.run())
    await until(lambda: site.main.handoff.workers())
    for _ in range(3):
        await _enqueue(site, "slow.wait", [])
    await until(lambda: sum(len(p.leases) for p in site.main.handoff.worker_peers.values()) == 3)

    await site.open("/workers")
    [row] = await site.rows()
    [entry] = (await site.client.status())["workers"]
    assert entry["in_flight"] == 3 and entry["capacity"] == {"inline": 2}
    cells = row.split("\t")
    assert cells[3:6] == [
        f"inline: {entry['capacity']['inline']}",
        f"inline: {entry['in_flight_by_mode']['inline']}",
        f"inline: {entry['credits']['inline']}",
    ], cells
    # Two running and one prefetched: in flight plus free is capacity plus the window.
    assert entry["in_flight_by_mode"]["inline"] + entry["credits"]["inline"] == 2 + 2
    assert "broker status" in await site.text("#workers-note")


async def test_a_job_in_a_workflow_links_to_its_graph(site: Site) -> None:
    """A job page of a workflow's member links to the workflow page, which draws each
    member as a box coloured by its status and an arrow per edge, over a table of the
    members with their parents."""
    workflow_id = uuid.uuid4()
    inline = {"execution_mode": ExecutionMode.INLINE, "workflow_id": workflow_id}
    sent = JobSpec("mail.send", args=["a@example.com"], **inline)  # type: ignore[arg-type]
    dead = JobSpec("report.build", args=["weekly"], max_attempts=1, **inline)  # type: ignore[arg-type]
    then = JobSpec(
        "mail.send",
        args=["done@example.com"],
        depends_on=(sent.id, dead.id),
        **inline,  # type: ignore[arg-type]
    )
    await site.client.enqueue_many([sent, dead, then])
    await until(lambda: _ended(site, then.id))
    await site.open(f"/jobs/{sent.id}")
    await site.shows(f"In workflow {workflow_id}", "#workflow-link")
    await site.click("#workflow-link a")
    await site.shows("failed", "#workflow-status")
    assert await site.url_has(f"/workflows/{workflow_id}")
    count = "return document.querySelectorAll(arguments[0]).length"
    assert await site.do(site.driver.execute_script, count, "#graph g.node") == 3
    assert await site.do(site.driver.execute_script, count, "#graph line.edge") == 2
    for status in ("completed", "failed", "cancelled"):
        assert await site.do(site.driver.execute_script, count, f"#graph g.node.{status}") == 1
    rows = await site.rows()
    assert len(rows) == 3 and "cancelled" in rows[2]
    assert str(sent.id)[:8] in rows[2] and str(dead.id)[:8] in rows[2], rows[2]
    await site.open(f"/jobs/{uuid.uuid4()}")
    await site.open(f"/workflows/{uuid.uuid4()}")
    assert "no workflow" in await site.text()
