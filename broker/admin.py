"""The operator's commands behind ``broker``: status, jobs, job, retry, cancel, enqueue, prune.

Every command runs against a *backend*. When the main answers, that is the main
itself, through a :class:`~broker.client.Client`, so a cancel reaches the worker
running the job and ``status`` can show the workers. When the main cannot be
reached and a store URL was given, it is the store, opened through the
composition root: the same operations, applied directly. That is safe because
every move out of ``handed_off`` is fenced in the store, so a cancel or a retry
made while the main is down can never be undone by a late report. Without the
main, ``status`` shows job counts only.

``--json`` output shapes are part of the interface and are documented in
``docs/reference/cli.md``; the human output is a readable table and may change.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, Protocol

import msgspec

from broker import composition, protocol
from broker.client import Client, Enqueued, JobListPage
from broker.config import MainSettings
from broker.exceptions import BrokerError, ConfigurationError
from broker.jobs import Clock, Job, JobSpec, JobStatus, JSONValue, utcnow
from broker.operations import Operations
from broker.storage import JobFilter, StorageAdapter
from broker.untrusted import escape_control


class Backend(Protocol):
    """What the commands need; implemented by the main (:class:`MainBackend`) and by the
    store read directly (:class:`StoreBackend`)."""

    async def status(self) -> dict[str, Any]: ...

    async def list_jobs(
        self,
        *,
        statuses: Collection[JobStatus] | None,
        queues: Collection[str] | None,
        tasks: Collection[str] | None,
        limit: int,
        cursor: str | None,
        include_payload: bool,
    ) -> JobListPage: ...

    async def get_job(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None: ...

    async def cancel(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None: ...

    async def retry(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None: ...

    async def enqueue(self, request: protocol.JobRequest) -> Enqueued: ...

    async def prune(
        self,
        *,
        older_than: float | None,
        keep_latest: int | None,
        statuses: Collection[JobStatus] | None,
    ) -> int: ...

    async def close(self) -> None: ...


class MainBackend:
    """The running main, through a client connection."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def status(self) -> dict[str, Any]:
        return {"source": "main", "main_error": None, **await self.client.status()}

    async def list_jobs(
        self,
        *,
        statuses: Collection[JobStatus] | None,
        queues: Collection[str] | None,
        tasks: Collection[str] | None,
        limit: int,
        cursor: str | None,
        include_payload: bool,
    ) -> JobListPage:
        return await self.client.list_jobs(
            statuses=statuses,
            queues=queues,
            tasks=tasks,
            limit=limit,
            cursor=cursor,
            include_payload=include_payload,
        )

    async def get_job(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None:
        return await self.client.get_job(job_id)

    async def cancel(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None:
        return await self.client.cancel(job_id)

    async def retry(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None:
        return await self.client.retry(job_id)

    async def enqueue(self, request: protocol.JobRequest) -> Enqueued:
        return (await self.client.enqueue_requests([request]))[0]

    async def prune(
        self,
        *,
        older_than: float | None,
        keep_latest: int | None,
        statuses: Collection[JobStatus] | None,
    ) -> int:
        return await self.client.prune(
            older_than=older_than, keep_latest=keep_latest, statuses=statuses
        )

    async def close(self) -> None:
        await self.client.close()


class StoreBackend:
    """The job store itself, for when the main is down. ``main_error`` says why.

    The requests are the main's own (:class:`~broker.operations.Operations`), under a
    default main's limits: this main's own are unknown here, and the defaults keep
    every job deliverable."""

    def __init__(self, store: StorageAdapter, main_error: str, *, clock: Clock = utcnow) -> None:
        self.store = store
        self.main_error = main_error
        self.operations = Operations(store, MainSettings(), clock=clock)

    async def status(self) -> dict[str, Any]:
        return {
            "source": "store",
            "main_error": self.main_error,
            **await self.operations.status(),
        }

    async def list_jobs(
        self,
        *,
        statuses: Collection[JobStatus] | None,
        queues: Collection[str] | None,
        tasks: Collection[str] | None,
        limit: int,
        cursor: str | None,
        include_payload: bool,
    ) -> JobListPage:
        try:
            page = await self.operations.list_jobs(
                JobFilter(statuses=statuses, queues=queues, tasks=tasks),
                limit=limit,
                cursor=cursor,
                include_payload=include_payload,
            )
        except ValueError as exc:
            raise ConfigurationError(f"--cursor is not valid: {exc}") from None
        return JobListPage(jobs=page.jobs, next_cursor=page.next_cursor)

    async def get_job(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None:
        return _as_dict(await self.operations.get(job_id))

    async def cancel(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None:
        return _as_dict(await self.operations.cancel(job_id))

    async def retry(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None:
        return _as_dict(await self.operations.retry(job_id))

    async def enqueue(self, request: protocol.JobRequest) -> Enqueued:
        [result] = await self.operations.enqueue([request])
        return Enqueued(result.job.id, result.duplicate)

    async def prune(
        self,
        *,
        older_than: float | None,
        keep_latest: int | None,
        statuses: Collection[JobStatus] | None,
    ) -> int:
        try:
            return await self.operations.prune(
                older_than_seconds=older_than, keep_latest=keep_latest, statuses=statuses
            )
        except ValueError as exc:
            raise ConfigurationError(f"prune: {exc}") from None

    async def close(self) -> None:
        await self.store.close()


def _as_dict(job: Job | None) -> dict[str, JSONValue] | None:
    return job.to_dict() if job is not None else None


async def open_backend(
    host: str,
    port: int,
    *,
    token: str | None = None,
    timeout: float = 10.0,  # noqa: ASYNC109 - a connect budget for the client
    database_url: str | None = None,
    adapter: str | None = None,
) -> MainBackend | StoreBackend:
    """The main if it answers; else the store at ``database_url``; else a clear error.

    Only a main that cannot be reached (refused, unreachable, timed out) sends the
    command to the store: a main that answers and refuses (a wrong token, say) is an
    error, because the store would bypass the refusal.
    """
    client = Client(host, port, token=token, timeout=timeout)
    try:
        await client.connect()
    except (OSError, TimeoutError) as exc:
        await client.close()
        reason = f"cannot reach the main at {host}:{port} ({str(exc) or type(exc).__name__})"
        if not database_url:
            raise BrokerError(
                f"{reason}; start broker-main, or pass --database-url (or set "
                "BROKER_DATABASE_URL) to work on the store directly"
            ) from None
        store = composition.open_store(database_url, adapter)
        try:
            await store.setup()
        except BaseException:
            await store.close()
            raise
        print(f"note: {reason}; working on the store directly", file=sys.stderr)
        return StoreBackend(store, reason)
    return MainBackend(client)


# ------------------------------------------------------------------------ commands


Command = Callable[[Backend, argparse.Namespace], Awaitable[int]]


async def run_command(backend: Backend, args: argparse.Namespace) -> int:
    """Run the parsed ``broker`` command on ``backend``; returns the exit code."""
    command = COMMANDS.get(args.command)
    if command is None:
        raise ConfigurationError(f"unknown command {args.command!r}")
    return await command(backend, args)


async def _status(backend: Backend, args: argparse.Namespace) -> int:
    status = await backend.status()
    if args.json:
        _print_json(status)
    else:
        print(format_status(status))
    return 0


async def _jobs(backend: Backend, args: argparse.Namespace) -> int:
    statuses = [JobStatus(s) for s in args.status] if args.status else None
    jobs: list[dict[str, JSONValue]] = []
    cursor: str | None = args.cursor
    while True:
        page = await backend.list_jobs(
            statuses=statuses,
            queues=args.queue or None,
            tasks=args.task or None,
            limit=args.limit,
            cursor=cursor,
            include_payload=args.with_payload,
        )
        jobs.extend(page.jobs)
        cursor = page.next_cursor
        if cursor is None or not args.all:
            break
    if args.json:
        _print_json({"jobs": jobs, "next_cursor": cursor})
    else:
        print(format_jobs(jobs))
        if cursor is not None:
            print(f"more: --cursor {escape_control(cursor)}")
    return 0


async def _job(backend: Backend, args: argparse.Namespace) -> int:
    return _print_job(await backend.get_job(args.job_id), args.json)


async def _cancel(backend: Backend, args: argparse.Namespace) -> int:
    job = await backend.cancel(args.job_id)
    if job is not None and job["status"] != JobStatus.CANCELLED:
        ended = escape_control(str(job["status"]))
        print(f"note: job {args.job_id} had already ended as {ended}", file=sys.stderr)
    return _print_job(job, args.json)


async def _retry(backend: Backend, args: argparse.Namespace) -> int:
    # Read first: the store returns a job that is not dead unchanged, and one that was
    # already queued would look just like one this command had retried.
    job = await backend.get_job(args.job_id)
    if job is not None and job["status"] == JobStatus.FAILED:
        job = await backend.retry(args.job_id)
        if job is not None and job["status"] == JobStatus.QUEUED:
            return _print_job(job, args.json)
    if job is None:
        return _print_job(None, args.json)
    print(
        f"error: job {args.job_id} is {escape_control(str(job['status']))}; "
        "only a failed (dead) job can be retried",
        file=sys.stderr,
    )
    return 1


async def _enqueue(backend: Backend, args: argparse.Namespace) -> int:
    params = _json_arg(args.args_json, "ARGS_JSON")
    if not isinstance(params, list):
        raise ConfigurationError("ARGS_JSON must be a JSON list, e.g. '[1, \"a\"]'")
    kwargs = _json_arg(args.kwargs, "--kwargs")
    if not isinstance(kwargs, dict):
        raise ConfigurationError("--kwargs must be a JSON object")
    options: dict[str, Any] = {
        "queue": args.queue,
        "priority": args.priority,
        "idempotency_key": args.idempotency_key,
        "unique_key": args.unique_key,
        "execution_mode": args.mode,
    }
    # Built as a spec first, so a bad request fails here with the spec's message.
    spec = JobSpec(
        task=args.task,
        args=params,
        kwargs=kwargs,
        **{k: v for k, v in options.items() if v is not None},
    )
    request = protocol.JobRequest.from_spec(spec)
    if args.delay is not None:
        request = msgspec.structs.replace(request, run_at=None, delay=float(args.delay))
    result = await backend.enqueue(request)
    if args.json:
        print(json.dumps({"job_id": str(result.job_id), "duplicate": result.duplicate}))
    else:
        print(result.job_id)
    return 0


async def _prune(backend: Backend, args: argparse.Namespace) -> int:
    if args.older_than is None and args.keep_latest is None:
        raise ConfigurationError("prune needs --older-than, --keep-latest or both")
    deleted = await backend.prune(
        older_than=args.older_than,
        keep_latest=args.keep_latest,
        statuses=[JobStatus(s) for s in args.status] if args.status else None,
    )
    if args.json:
        _print_json({"deleted": deleted})
    else:
        print(f"deleted {deleted} job{'' if deleted == 1 else 's'}")
    return 0


COMMANDS: dict[str, Command] = {
    "status": _status,
    "jobs": _jobs,
    "job": _job,
    "cancel": _cancel,
    "retry": _retry,
    "enqueue": _enqueue,
    "prune": _prune,
}


# ------------------------------------------------------------------------ output


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigurationError(f"{what} nests too deeply to decode as JSON") from None


def _print_job(job: dict[str, Any] | None, as_json: bool) -> int:
    if job is None:
        print("no such job", file=sys.stderr)
        return 1
    if as_json:
        _print_json(job)
    else:
        width = max(len(k) for k in job)
        for key, value in job.items():
            text = value if isinstance(value, str) else json.dumps(value)
            print(f"{escape_control(key):<{width}}  {escape_control(text)}")
    return 0


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


def _short(text: object, limit: int = 60) -> str:
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _by_mode(values: object) -> str:
    if not isinstance(values, dict) or not values:
        return "-"
    return " ".join(f"{mode}={values[mode]}" for mode in sorted(values))


def format_status(status: dict[str, Any]) -> str:
    """The human form of ``broker status``."""
    out: list[str] = []
    if status.get("source") == "main":
        out.append(
            escape_control(
                f"main: {status['main_id']} up, {status['dispatched']} jobs dispatched, "
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
                    _by_mode(w["capacity"]) if w["status_reported"] else "(not reported)",
                    str(w["in_flight"]),
                    _by_mode(w["credits"]),
                    "yes" if w["draining"] else "no",
                    "; ".join(f"{m}: {_short(e)}" for m, e in sorted(w["startup_errors"].items()))
                    or "-",
                ]
                for w in workers
            ]
            headers = ["worker", "host", "capacity", "in flight", "credits", "draining"]
            out.append(table([*headers, "start-up errors"], rows))
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
            f"{job['attempts']}/{job['max_attempts']}",
            str(job["updated_at"])[:19],
            _short(job["last_error"] or "", 40),
            *(_short(json.dumps(job[key]), 30) if key in job else "(omitted)" for key in payload),
        ]
        for job in jobs
    ]
    headers = ["id", "status", "queue", "task", "mode", "attempts", "updated", "last error"]
    return table([*headers, *payload], rows)
