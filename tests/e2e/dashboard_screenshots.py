"""Screenshots of every dashboard view during a drain with failures, for ``docs/images/``.

A real main on a SQLite file, with its dashboard, two real workers over TCP running a
job mix (mail that sometimes fails and is retried, reports that often fail for good,
image jobs that report progress, a rate-limited billing queue, a paused exports queue,
and a workflow: a group of thumbnails, two of which fail for good, with a fan-in after it),
enqueued in waves for a few minutes so the history has minutes to chart; then headless
Chromium opens each view and saves it as a PNG::

    .venv/bin/python -m tests.e2e.dashboard_screenshots docs/images --minutes 6

It takes the minutes asked for plus about half a minute. Not a test: the browser tests
(``tests/e2e/test_dashboard_browser.py``) check the views; this shows them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.jobs import ExecutionMode, JobSpec
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.ops.web import Dashboard
from broker.tasks.context import current_job
from broker.tasks.registry import TaskRegistry, task
from broker.tasks.schedule import Schedule
from broker.tasks.workflow import Workflow, group
from broker.worker.worker import Worker
from runners.inline import InlineRunner
from tests.e2e.browser import chrome, missing_browser

TOKEN = "operator-secret"


def inline(**fields: Any) -> JobSpec:
    """A job of the mix: every one runs inline (the workers run only that mode)."""
    return JobSpec(execution_mode=ExecutionMode.INLINE, **fields)


ALBUM = 8
"""Thumbnails in the screenshots' workflow; those of :data:`BROKEN` fail for good."""
BROKEN = {3, 6}


def registry() -> tuple[TaskRegistry, Workflow]:
    """The tasks of the mix, and the workflow the drain enqueues (a group of thumbnails
    with a fan-in that publishes the album)."""
    tasks = TaskRegistry()
    rng = random.Random(7)

    @task(name="mail.send", registry=tasks, mode="inline", retries=3, backoff=lambda n: 2.0)
    async def send(to: str) -> str:
        await asyncio.sleep(rng.uniform(0.05, 0.4))
        if rng.random() < 0.08:
            raise ConnectionError(f"SMTP server closed the connection while sending to {to}")
        return f"sent to {to}"

    @task(name="report.build", registry=tasks, mode="inline", retries=1, backoff=lambda n: 3.0)
    async def build(name: str) -> dict[str, int]:
        job = current_job()
        for step in range(4):
            job.progress(step / 4, f"section {step + 1} of 4")
            await asyncio.sleep(rng.uniform(0.2, 0.6))
            if step == 2 and rng.random() < 0.35:
                raise ValueError(f"no data for report {name!r} in the warehouse")
        return {"rows": rng.randint(100, 5000)}

    @task(name="image.resize", registry=tasks, mode="inline", retries=2, backoff=lambda n: 1.0)
    async def resize(path: str, width: int) -> str:
        job = current_job()
        for step in range(3):
            job.progress(step / 3, f"tile {step + 1} of 3")
            await asyncio.sleep(rng.uniform(0.1, 0.5))
        if rng.random() < 0.05:
            raise OSError(f"cannot identify image file {path!r}")
        return f"{path}@{width}"

    @task(name="billing.charge", registry=tasks, mode="inline")
    async def charge(account: int, cents: int) -> str:
        await asyncio.sleep(0.1)
        return f"charged {cents} to {account}"

    @task(name="export.csv", registry=tasks, mode="inline")
    async def export(table: str) -> str:
        return table

    @task(name="album.thumbnail", registry=tasks, mode="inline", retries=0)
    async def thumbnail(photo: int) -> str:
        await asyncio.sleep(0.2)
        if photo in BROKEN:
            raise OSError(f"photo {photo}: truncated JPEG data")
        return f"thumb-{photo}.jpg"

    @task(name="album.publish", registry=tasks, mode="inline")
    async def publish(thumbs: list[str], album: str) -> str:
        return f"{album}: {len(thumbs)} photos"

    album = group(thumbnail.bind(i) for i in range(ALBUM)).then(publish.bind(album="summer"))
    return tasks, album


def wave(n: int, rng: random.Random) -> list[JobSpec]:
    """About ``n`` jobs of the mix."""
    specs: list[JobSpec] = []
    for i in range(n):
        roll = rng.random()
        if roll < 0.55:
            specs.append(inline(task="mail.send", args=[f"user{i}@example.com"], max_attempts=4))
        elif roll < 0.7:
            specs.append(
                inline(
                    task="report.build",
                    args=[f"weekly-{i}"],
                    queue="reports",
                    max_attempts=2,
                )
            )
        elif roll < 0.9:
            specs.append(
                inline(
                    task="image.resize",
                    args=[f"/uploads/{i}.png", 640],
                    queue="images",
                    max_attempts=3,
                )
            )
        else:
            specs.append(inline(task="billing.charge", args=[1000 + i, 499], queue="billing"))
    return specs


async def drain(out: Path, minutes: float, port: int) -> None:
    missing = missing_browser()
    if missing is not None:
        raise SystemExit(missing)
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{Path(tmp) / 'broker.db'}")
        nightly = Schedule(
            name="nightly-report",
            task="report.build",
            cron="0 3 * * *",
            timezone="Europe/Paris",
            args=["nightly"],
            catch_up=False,
        )
        main = Main(store, MainSettings(port=0, token=TOKEN), schedules=[nightly], retention=None)
        await main.start()
        dashboard = Dashboard(main, host="127.0.0.1", port=port)
        await dashboard.start()
        tasks, album = registry()
        workers = [
            Worker(
                "127.0.0.1",
                main.port,
                worker_id=worker_id,
                runners={ExecutionMode.INLINE: InlineRunner(tasks, concurrency=slots)},
                registry=tasks,
                token=TOKEN,
            )
            for worker_id, slots in (("worker-eu-1", 6), ("worker-eu-2", 4))
        ]
        running = [asyncio.create_task(w.run()) for w in workers]
        client = Client("127.0.0.1", main.port, token=TOKEN)
        rng = random.Random(11)
        try:
            while len(main.handoff.workers()) < 2:
                await asyncio.sleep(0.1)
            await client.limit_queue("billing", "40/m", burst=5)
            await client.pause_queue("exports")
            await client.enqueue_many(
                [inline(task="export.csv", args=[t], queue="exports") for t in ("users", "orders")]
            )
            flow = await client.enqueue_workflow(album)
            end = time.monotonic() + minutes * 60
            await client.enqueue_many(wave(300, rng))
            while time.monotonic() < end:
                # Waves that grow, then a burst near the end: the depth climbs and drains.
                left = end - time.monotonic()
                size = 40 if left > 60 else 180
                await client.enqueue_many(wave(size, rng))
                await asyncio.sleep(10)
            await shoot(out, dashboard.port, flow.workflow_id)
        finally:
            await client.close()
            for job in running:
                job.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await dashboard.stop()
            await main.stop()


async def shoot(out: Path, port: int, workflow_id: uuid.UUID) -> None:
    """Each view, saved as ``out/NAME.png`` at the height of its page."""
    url = f"http://127.0.0.1:{port}"
    driver = await asyncio.to_thread(chrome, 1280, 900)
    try:

        async def run(script: str, *args: Any) -> Any:
            return await asyncio.to_thread(driver.execute_script, script, *args)

        async def save(name: str, what: str) -> None:
            """The whole page, however tall (the viewport is set to its height)."""
            tall = int(await run("return document.documentElement.scrollHeight"))
            metrics = {"width": 1280, "height": tall, "deviceScaleFactor": 1, "mobile": False}
            await asyncio.to_thread(
                driver.execute_cdp_cmd, "Emulation.setDeviceMetricsOverride", metrics
            )
            await asyncio.to_thread(driver.save_screenshot, str(out / f"{name}.png"))
            await asyncio.to_thread(
                driver.execute_cdp_cmd, "Emulation.clearDeviceMetricsOverride", {}
            )
            print(f"saved {out / name}.png ({what})")

        async def view(name: str, path: str) -> None:
            await asyncio.to_thread(driver.get, url + path)
            await run(
                "var b=document.getElementById('token');"
                "if(b){b.value=arguments[0];sessionStorage.setItem('broker-token',arguments[0]);}",
                TOKEN,
            )
            await save(name, path)

        out.mkdir(parents=True, exist_ok=True)
        await view("queues", "/")
        await view("workers", "/workers")
        await view("history", "/history?window=15m")
        await view("history-reports", "/history?window=15m&queue=reports")
        await view("jobs", "/jobs")
        await view("jobs-failed", "/jobs?status=failed&queue=reports")
        failed = await run(
            "var a=document.querySelector('#live tbody tr a');return a?a.getAttribute('href'):''"
        )
        if failed:
            await view("job", str(failed))
        await view("bulk-retry", "/jobs/bulk?queue=reports&status=failed&action=retry")
        # A refusal: a rate limit the main cannot read, with why and the way back.
        await asyncio.to_thread(driver.get, url + "/")
        await run(
            "var f=document.querySelector('form.limit');"
            "f.querySelector('input[name=rate]').value='fast';"
            "document.getElementById('token').value=arguments[0];"
            "f.querySelector('button').click()",
            TOKEN,
        )
        for _ in range(50):
            if await run("return !!document.getElementById('error-notice')"):
                break
            await asyncio.sleep(0.1)
        await save("refused", "a rate limit the main refuses")
        await view("workflow", f"/workflows/{workflow_id}")
        await view("recoveries", "/recoveries")
        await view("schedules", "/schedules")
    finally:
        await asyncio.to_thread(driver.quit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where the PNGs go (docs/images)")
    parser.add_argument("--minutes", type=float, default=4.0, help="how long the drain runs")
    parser.add_argument("--port", type=int, default=0, help="the dashboard's port (0: any)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the failures are the point: not their lines
    asyncio.run(drain(args.out, args.minutes, args.port))


if __name__ == "__main__":
    main()
