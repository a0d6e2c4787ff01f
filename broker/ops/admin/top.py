"""``broker top``: the ``status`` snapshot again every few seconds, with each queue's
throughput worked out from the change between two snapshots."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from datetime import UTC, datetime
from typing import Any

from broker.jobs import JobStatus, utcnow
from broker.model.untrusted import escape_control
from broker.ops.admin.format import by_mode, format_age, table
from broker.ops.admin.service import RequestService, read_status


def queue_rates(
    before: dict[str, Any] | None, after: dict[str, Any], seconds: float
) -> dict[str, dict[str, float]]:
    """Per queue, jobs completed and failed per second between two ``status`` snapshots.

    Counts are of jobs that exist, so retention or a prune between the two can make a
    count fall; a fall is shown as no progress rather than as a negative rate.
    """
    if before is None or seconds <= 0:
        return {}
    old = {q["queue"]: q["counts"] for q in before["queues"]}
    rates: dict[str, dict[str, float]] = {}
    for q in after["queues"]:
        was = old.get(q["queue"], {})
        rates[q["queue"]] = {
            status: max(0, q["counts"].get(status, 0) - was.get(status, 0)) / seconds
            for status in (JobStatus.COMPLETED.value, JobStatus.FAILED.value)
        }
    return rates


def format_top(
    status: dict[str, Any], rates: dict[str, dict[str, float]], now: datetime, interval: float
) -> str:
    """One frame of ``broker top``: the main, each queue's backlog and throughput, and
    the workers with their load."""
    if status.get("source") == "main":
        head = f"main {status['main_id']} up, {status['dispatched']} dispatched"
    else:
        head = f"main DOWN ({status.get('main_error')}); counts read from the store"
    out = [
        escape_control(
            f"broker top  {now.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC  every {interval:g}s  {head}"
        ),
        "",
    ]

    def rate(queue: str, status_name: str) -> str:
        return f"{rates[queue][status_name]:.1f}" if queue in rates else "-"

    rows = [
        [
            q["queue"],
            str(q["counts"].get(JobStatus.QUEUED.value, 0)),
            str(q["counts"].get(JobStatus.HANDED_OFF.value, 0)),
            format_age(q["oldest_queued_age_seconds"]),
            rate(q["queue"], JobStatus.COMPLETED.value),
            rate(q["queue"], JobStatus.FAILED.value),
            str(q["counts"].get(JobStatus.FAILED.value, 0)),
        ]
        for q in status["queues"]
    ]
    headers = ["queue", "queued", "running", "oldest queued", "done/s", "failed/s", "dead"]
    out.append(table(headers, rows) if rows else "no jobs")
    workers = status.get("workers")
    out.append("")
    if workers is None:
        out.append("workers: unknown without the main")
    elif not workers:
        out.append("no workers connected")
    else:
        out.append(
            table(
                ["worker", "modes", "in flight", "free credits", "draining", "start-up errors"],
                [
                    [
                        str(w["worker_id"]),
                        ",".join(w["modes"]),
                        str(w["in_flight"]),
                        by_mode(w["credits"]),
                        "yes" if w["draining"] else "no",
                        str(len(w["startup_errors"])) if w["startup_errors"] else "-",
                    ]
                    for w in workers
                ],
            )
        )
    return "\n".join(out)


_HOME_AND_CLEAR = "\x1b[H\x1b[2J"


async def top(service: RequestService, args: argparse.Namespace) -> int:
    """``broker top``: a frame every ``--interval`` seconds until Ctrl-C (or ``--count``
    frames). On a terminal each frame replaces the last; otherwise (a pipe, a file, a
    log) frames follow one another as plain text, split by a blank line."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, stop.set)
    live = sys.stdout.isatty()
    before: dict[str, Any] | None = None
    taken = 0.0
    frames = 0
    try:
        while not stop.is_set():
            status = await read_status(service)
            now_mono = time.monotonic()
            rates = queue_rates(before, status, now_mono - taken)
            frame = format_top(status, rates, utcnow(), args.interval)
            if live:
                sys.stdout.write(_HOME_AND_CLEAR + frame + "\n")
            else:
                sys.stdout.write(("\n" if frames else "") + frame + "\n")
            sys.stdout.flush()
            before, taken = status, now_mono
            frames += 1
            if args.count is not None and frames >= args.count:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.interval)
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)
    return 0
