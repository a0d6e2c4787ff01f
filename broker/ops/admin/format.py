"""The human output of the operator's commands: tables and one-field-a-line views.

Everything a peer sent (task names, errors, worker ids) is shown with its control
characters escaped, never obeyed. Only ``--json`` output is an interface
(``docs/reference/cli.md``); these forms may change.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from broker.jobs import JobStatus
from broker.model.untrusted import escape_control
from broker.wire import messages as protocol


def format_job(job: dict[str, Any], rules: str | None = None) -> str:
    """The human form of ``broker job``: one field a line. The error, which may hold a
    traceback, goes on over several lines indented under its field, so the columns
    hold; every other value is one line, its control characters escaped (a newline in
    a name is shown as ``\\n``, never obeyed). The task's retry ``rules``
    (:func:`retry_rules`), when given, come after the runs."""
    width = max(len(k) for k in [*job, "retry rules"])
    out: list[str] = []
    for key, value in job.items():
        if key in _TIME_FIELDS and isinstance(value, str):
            text = format_time(value)
        else:
            text = value if isinstance(value, str) else json.dumps(value)
        first, *rest = (text.splitlines() or [""]) if key == "last_error" else [text]
        out.append(f"{escape_control(key):<{width}}  {escape_control(first)}".rstrip())
        out.extend(f"{'':<{width}}  {escape_control(line)}".rstrip() for line in rest)
        if key == "attempts":
            lost = int(job.get("recoveries") or 0)
            also = f" ({lost} of them lost, which do not count)" if lost else ""
            out.append(f"{'runs':<{width}}  {runs(job)} of at most {job.get('max_attempts')}{also}")
            if rules is not None:
                out.append(f"{'retry rules':<{width}}  {escape_control(rules)}")
    return "\n".join(out)


def retry_rules(declared: dict[str, Any] | None) -> str:
    """Which failures of a task are retried and after what wait, from its declaration."""
    if declared is None:
        return "any Exception; the main's backoff (the task is not in the catalog)"
    retry_on = declared.get("retry_on")
    dont = declared.get("dont_retry_on") or []
    text = "any Exception" if retry_on is None else ", ".join(retry_on)
    if dont:
        text += f" except {', '.join(dont)}"
    backoff = declared.get("backoff") or "the main's"
    return f"{text}; backoff: {backoff}"


_TIME_FIELDS = frozenset({"run_at", "created_at", "updated_at", "handed_off_at", "checkpoint_at"})


def format_time(iso: str) -> str:
    """A stored time as ``YYYY-MM-DD HH:MM:SS UTC``: always with its zone."""
    try:
        when = datetime.fromisoformat(iso)
    except ValueError:
        return iso
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def format_progress(job: dict[str, Any]) -> str:
    """A job's last reported progress as ``42% message`` (``-`` when it reported none)."""
    fraction = job.get("progress")
    if not isinstance(fraction, int | float):
        return "-"
    message = short(job.get("progress_message") or "", 30)
    return f"{fraction:.0%} {message}".rstrip()


def runs(job: dict[str, Any]) -> int:
    """How many times the job has started. ``attempts`` counts the runs that failed and
    ``recoveries`` those that were lost; a job that completed or is running is on one run
    more (a completed job that never failed ran once, so it shows 1, not 0)."""
    ended = int(job.get("attempts") or 0) + int(job.get("recoveries") or 0)
    return ended + (1 if job.get("status") in (JobStatus.COMPLETED, JobStatus.HANDED_OFF) else 0)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, headers in capitals; control characters in
    the cells (task names, errors, worker ids come from peers) are escaped."""
    cells = [[h.upper() for h in headers], *[[escape_control(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )


def format_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def short(text: object, limit: int = 60) -> str:
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def by_mode(values: object) -> str:
    if not isinstance(values, dict) or not values:
        return "-"
    return " ".join(f"{mode}={values[mode]}" for mode in sorted(values))


def _role(status: dict[str, Any]) -> str:
    """`` as leader at HOST:PORT``: which main answered (a standby the command reached
    hands it to the leader), or nothing from a main older than the role."""
    role, leader = status.get("role"), status.get("leader")
    if role is None:
        return ""
    return f" as {role}" + ("" if leader is None else f" at {leader}")


def format_status(status: dict[str, Any]) -> str:
    """The human form of ``broker status``."""
    out: list[str] = []
    if status.get("source") == "main":
        out.append(
            escape_control(
                f"main: {status['main_id']} up{_role(status)}, "
                f"{status['dispatched']} jobs dispatched, "
                f"{status['orphans']} orphaned leases awaiting their workers"
            )
        )
    else:
        error = escape_control(str(status.get("main_error")))
        out.append(f"main: DOWN ({error}); job counts read from the store")
    out.append("")
    statuses = [s.value for s in JobStatus]
    queue_rows = [
        [
            q["queue"],
            *(str(q["counts"].get(s, 0)) for s in statuses),
            format_age(q["oldest_queued_age_seconds"]),
        ]
        for q in status["queues"]
    ]
    out.append(
        table(["queue", *statuses, "oldest queued"], queue_rows) if queue_rows else "no jobs"
    )
    workers = status.get("workers")
    if workers is not None:
        out.append("")
        if not workers:
            out.append("no workers connected")
        else:
            rows = [
                [
                    str(w["worker_id"]),
                    str(w["host"] or "-"),
                    by_mode(w["capacity"]) if w["status_reported"] else "(not reported)",
                    str(w["in_flight"]),
                    by_mode(w["credits"]),
                    "yes" if w["draining"] else "no",
                    "; ".join(f"{m}: {short(e)}" for m, e in sorted(w["startup_errors"].items()))
                    or "-",
                ]
                for w in workers
            ]
            headers = ["worker", "host", "capacity", "in flight", "credits", "draining"]
            out.append(table([*headers, "start-up errors"], rows))
    for waiting in status.get("waiting") or ():
        out.append("")
        out.append(escape_control(f"waiting: {waiting['reason']}"))
    settings = status.get("queue_settings")
    if settings:
        out.append("")
        rows = [
            [
                str(q["queue"]),
                "yes" if q["paused"] else "no",
                f"{q['rate_limit']} (burst {q['rate_burst']})" if q["rate_limit"] else "-",
                f"{q['token_wait_seconds']} s" if q["rate_limit"] else "-",
                str(q["held_for_token"]),
            ]
            for q in settings
        ]
        headers = ["queue", "paused", "rate limit", "next token in", "held for a token"]
        out.append(table(headers, rows))
    recoveries = status.get("pending_recoveries")
    if recoveries is not None:
        out.append("")
        out.append(f"pending recoveries: {len(recoveries)}")
        out.extend(f"  job {r['job_id']}" for r in recoveries)
    return "\n".join(out)


def format_jobs(jobs: Sequence[dict[str, Any]]) -> str:
    """The human form of ``broker jobs``; payload columns only when the listing has them."""
    if not jobs:
        return "no jobs"
    payload = [key for key in ("args", "kwargs", "result") if any(key in job for job in jobs)]
    rows = [
        [
            str(job["id"]),
            str(job["status"]),
            str(job["queue"]),
            str(job["task"]),
            str(job["execution_mode"]),
            f"{runs(job)}/{job['max_attempts']}",
            format_time(str(job["updated_at"])),
            format_progress(job),
            short(job["last_error"] or "", 40),
            *(short(json.dumps(job[key]), 30) if key in job else "(omitted)" for key in payload),
        ]
        for job in jobs
    ]
    headers = ["id", "status", "queue", "task", "mode", "runs", "updated", "progress", "last error"]
    return table([*headers, *payload], rows)


def format_tasks(tasks: Sequence[dict[str, Any]]) -> str:
    """The human form of ``broker tasks``: one row per task and worker that declared it,
    the defaults its jobs get, its rate limit (a column shown when some task has one)
    and its retry rules. ``LAST SEEN`` is ``connected`` for a
    worker connected now, and when it was last seen for one that is gone (it still
    vouches for the task until the task grace drops it)."""
    if not tasks:
        return "no tasks declared (a worker declares its tasks when it connects)"
    rows = []
    for entry in tasks:
        declared = entry["declaration"]
        rows.append(
            [
                str(entry["task"]),
                str(declared.get("execution_mode")),
                str(declared.get("queue")),
                str(int(declared.get("max_attempts", 1)) - 1),
                "-" if declared.get("timeout") is None else f"{declared['timeout']:g}s",
                str(entry["worker_id"]),
                "connected" if entry.get("connected") else format_time(str(entry["seen_at"])),
                retry_rules(declared),
            ]
        )
    headers = ["task", "mode", "queue", "retries", "timeout", "worker", "last seen"]
    limits = [_rate_limit(entry["declaration"]) for entry in tasks]
    if any(limit != "-" for limit in limits):  # a column only when some task has one
        headers.append("rate limit")
        rows = [[*row[:-1], limit, row[-1]] for row, limit in zip(rows, limits, strict=True)]
    return table([*headers, "retry rules"], rows)


def _rate_limit(declared: dict[str, Any]) -> str:
    """A task's own rate limit as ``broker tasks`` shows it (``-``: none)."""
    if not declared.get("rate_limit"):
        return "-"
    return f"{declared['rate_limit']} (burst {declared.get('rate_burst') or 1})"


def format_workflow(view: protocol.WorkflowView) -> str:
    """A workflow as ``broker workflow ID`` shows it: a head line, then a table of its
    members, parents first, each with its parents (their short ids), state and error."""
    short_ids = {m.job_id: str(m.job_id)[:8] for m in view.members}
    rows = []
    for m in view.members:
        parents = [short_ids.get(p, str(p)[:8]) for p in view.parents(m.job_id)]
        shown = ",".join(parents[:3]) + (f" (+{len(parents) - 3})" if len(parents) > 3 else "")
        rows.append(
            [
                str(m.job_id),
                m.task,
                m.status.value,
                str(m.attempts),
                shown or "-",
                short(m.error or ""),
            ]
        )
    head = f"workflow {view.workflow_id}  {view.status}  {len(view.members)} jobs"
    if view.truncated:
        head += " (more not shown)"
    return head + "\n" + table(["job", "task", "status", "attempts", "parents", "error"], rows)
