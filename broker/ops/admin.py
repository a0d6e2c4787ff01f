"""The operator's commands behind ``broker``: status, jobs, job, retry, cancel, enqueue, prune.

Every command runs against a *backend*. When the main answers, that is the main
itself, through a :class:`~broker.client.client.Client`, so a cancel reaches the worker
running the job and ``status`` can show the workers. When the main cannot be
reached and a store URL was given, it is the store, opened through the
composition root: the same operations, applied directly. That is safe because
every move out of ``handed_off`` is fenced in the store, so a cancel or a retry
made while the main is down can never be undone by a late report. Without the
main, ``status`` shows job counts only.

The store is opened as it stands, never set up: a URL may name the wrong database,
and a newer ``broker`` must not migrate a schema under an older main. A reading
command opens it read-only; every command first checks that it holds this version's
schema (``check_schema``) and refuses a missing, older or newer one. Only
``broker-main`` and ``broker migrate`` create or migrate a schema.

``--json`` output shapes are part of the interface and are documented in
``docs/reference/cli.md``; the human output is a readable table and may change.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import msgspec

from broker.client.client import Client, JobListPage
from broker.core import catalog
from broker.exceptions import BrokerError, ConfigurationError
from broker.jobs import TERMINAL_STATUSES, Clock, Job, JobSpec, JobStatus, JSONValue, utcnow
from broker.main.operations import Operations
from broker.main.settings import MainSettings
from broker.model.untrusted import escape_control
from broker.ops import composition
from broker.storage import SCHEMA_VERSION, JobFilter, StorageAdapter, SupportsSchemaCheck
from broker.tasks.registry import Enqueued
from broker.wire import framing as wire
from broker.wire import messages as protocol
from broker.wire.tls import PeerTLS


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

    async def enqueue(
        self, request: protocol.JobRequest, *, allow_unknown_tasks: bool = False
    ) -> Enqueued: ...

    async def tasks(self) -> list[dict[str, JSONValue]]:
        """The task catalog, as :func:`broker.core.catalog.entry` shows each declaration."""

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

    async def enqueue(
        self, request: protocol.JobRequest, *, allow_unknown_tasks: bool = False
    ) -> Enqueued:
        [result] = await self.client.enqueue_requests(
            [request], allow_unknown_tasks=allow_unknown_tasks
        )
        return result

    async def tasks(self) -> list[dict[str, JSONValue]]:
        return await self.client.list_tasks()

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

    The requests are the main's own (:class:`~broker.main.operations.Operations`), under a
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

    async def enqueue(
        self, request: protocol.JobRequest, *, allow_unknown_tasks: bool = False
    ) -> Enqueued:
        [result] = await self.operations.enqueue([request], allow_unknown_tasks=allow_unknown_tasks)
        return Enqueued(result.job.id, result.duplicate)

    async def tasks(self) -> list[dict[str, JSONValue]]:
        return [catalog.entry(record) for record in await self.operations.tasks()]

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


def _note(text: str) -> None:
    print(text, file=sys.stderr)


def _as_dict(job: Job | None) -> dict[str, JSONValue] | None:
    return job.to_dict() if job is not None else None


"""Seconds the operator's command gives whatever answers at ``--main`` to greet as a
main: PostgreSQL, Redis or a web server on that port is reported as "not a broker
main" this soon, instead of after ``--timeout``."""


async def open_backend(
    host: str,
    port: int,
    *,
    token: str | None = None,
    role: protocol.Role = protocol.Role.OPERATOR,
    tls: PeerTLS | None = None,
    timeout: float = 10.0,  # noqa: ASYNC109 - a connect budget for the client
    database_url: str | None = None,
    adapter: str | None = None,
    read_only: bool = False,
    note: Callable[[str], None] | None = None,
) -> MainBackend | StoreBackend:
    """The main if it answers; else the store at ``database_url``; else a clear error.

    Only a main that cannot be reached (refused, unreachable, timed out) sends the
    command to the store: a main that answers and refuses (a wrong token, say) is an
    error, because the store would bypass the refusal, and so is a service that is not
    a main at all. ``read_only`` opens the store without the right to write (for the
    commands that only read). ``note`` tells the operator that the store is used (by
    default a ``note:`` line on stderr). ``token`` is the secret of ``role``.
    """
    client = Client(
        host,
        port,
        token=token,
        role=role,
        tls=tls,
        timeout=timeout,
        greeting_timeout=wire.GREETING_TIMEOUT,
    )
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
        store = composition.open_store(database_url, adapter, create=False, read_only=read_only)
        try:
            if isinstance(store, SupportsSchemaCheck):
                await store.check_schema()
        except BaseException:
            await store.close()
            raise
        (note or _note)(f"note: {reason}; working on the store directly")
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
    job_id = await resolve_job(backend, args.job_id)
    job = None if job_id is None else await backend.get_job(job_id)
    if job is None or args.json:
        return _print_job(job, args.json)
    rules = retry_rules(_declaration(await backend.tasks(), str(job["task"])))
    print(format_job(job, rules))
    return 0


def _declaration(tasks: Sequence[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The declaration that decides ``name``'s defaults: the newest seen (as the main
    decides, :mod:`broker.core.catalog`)."""
    mine = [t for t in tasks if t["task"] == name]
    return max(mine, key=lambda t: str(t["seen_at"]))["declaration"] if mine else None


async def _cancel(backend: Backend, args: argparse.Namespace) -> int:
    job_id = await resolve_job(backend, args.job_id)
    job = None if job_id is None else await backend.cancel(job_id)
    if job is not None and job["status"] != JobStatus.CANCELLED:
        ended = escape_control(str(job["status"]))
        print(f"note: job {job_id} had already ended as {ended}", file=sys.stderr)
    return _print_job(job, args.json)


async def _retry(backend: Backend, args: argparse.Namespace) -> int:
    job_id = await resolve_job(backend, args.job_id)
    # Read first: the store returns a job that is not dead unchanged, and one that was
    # already queued would look just like one this command had retried.
    job = None if job_id is None else await backend.get_job(job_id)
    if job_id is not None and job is not None and job["status"] == JobStatus.FAILED:
        job = await backend.retry(job_id)
        if job is not None and job["status"] == JobStatus.QUEUED:
            return _print_job(job, args.json)
    if job is None:
        return _print_job(None, args.json)
    print(
        f"error: job {job_id} is {escape_control(str(job['status']))}; "
        "only a failed (dead) job can be retried",
        file=sys.stderr,
    )
    return 1


MAX_PREFIX_MATCHES = 10
"""How many matching ids an ambiguous prefix lists before it stops looking."""


async def resolve_job(backend: Backend, ref: uuid.UUID | str) -> uuid.UUID | None:
    """The job ``ref`` names: a whole id as it is, or the one job whose id starts with
    the prefix ``ref`` (None if none does).

    There is no index on id prefixes in the contract, so a prefix is matched on the
    listing, page by page, payloads left out: a scan of every job, fine for an operator
    typing an id from ``broker jobs``.

    :raises ConfigurationError: the prefix matches more than one job (listed).
    """
    if isinstance(ref, uuid.UUID):
        return ref
    prefix = ref.replace("-", "")
    matches: list[str] = []
    cursor: str | None = None
    while len(matches) < MAX_PREFIX_MATCHES:
        page = await backend.list_jobs(
            statuses=None,
            queues=None,
            tasks=None,
            limit=protocol.MAX_LIST_LIMIT,
            cursor=cursor,
            include_payload=False,
        )
        matches += [
            str(job["id"])
            for job in page.jobs
            if str(job["id"]).replace("-", "").startswith(prefix)
        ]
        cursor = page.next_cursor
        if cursor is None:
            break
    if len(matches) > 1:
        shown = ", ".join(matches[:MAX_PREFIX_MATCHES])
        more = " and more" if len(matches) >= MAX_PREFIX_MATCHES else ""
        raise ConfigurationError(
            f"the id prefix {ref!r} matches {len(matches)}{more} jobs: {shown}{more}; "
            "give more of the id"
        )
    return uuid.UUID(matches[0]) if matches else None


def only_reads(args: argparse.Namespace) -> bool:
    """Whether the parsed command only reads: such a command opens a store fallback
    read-only."""
    return args.command in {"status", "top", "jobs", "job", "tasks"} or (
        args.command == "prune" and bool(args.dry_run)
    )


async def migrate(database_url: str | None, adapter: str | None, as_json: bool) -> int:
    """``broker migrate``: the one operator command that creates or migrates a schema
    (as ``broker-main`` does when it starts)."""
    if not database_url:
        raise ConfigurationError("migrate needs --database-url (or BROKER_DATABASE_URL)")
    store = composition.open_store(database_url, adapter)
    try:
        await store.setup()
    finally:
        await store.close()
    if as_json:
        _print_json({"schema_version": SCHEMA_VERSION})
    else:
        print(f"the store is at schema version {SCHEMA_VERSION}")
    return 0


def enqueue_request(args: argparse.Namespace) -> protocol.JobRequest:
    """The request ``broker enqueue`` sends, built and checked before anything connects.

    :raises ConfigurationError: ARGS_JSON or --kwargs is not the JSON it must be.
    :raises InvalidJobError: the job itself is invalid (an empty queue, a priority out of
        range...), with the job spec's own message.
    """
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
        "max_attempts": None if args.retries is None else args.retries + 1,
    }
    said = {k: v for k, v in options.items() if v is not None}
    # Built as a spec first, so a bad request fails here with the spec's message; what
    # is not said here the main fills from the task's declaration (the task catalog).
    spec = JobSpec(task=args.task, args=params, kwargs=kwargs, **said)
    request = protocol.JobRequest.from_spec(spec, said=said)
    if args.delay is not None:
        request = msgspec.structs.replace(request, run_at=None, delay=float(args.delay))
    return request


async def _enqueue(backend: Backend, args: argparse.Namespace) -> int:
    request = getattr(args, "request", None) or enqueue_request(args)
    result = await backend.enqueue(request, allow_unknown_tasks=args.allow_unknown_task)
    if args.json:
        print(json.dumps({"job_id": str(result.job_id), "duplicate": result.duplicate}))
    else:
        print(result.job_id)
    return 0


async def _tasks(backend: Backend, args: argparse.Namespace) -> int:
    tasks = await backend.tasks()
    if args.json:
        _print_json({"tasks": tasks})
    else:
        print(format_tasks(tasks))
    return 0


def format_tasks(tasks: Sequence[dict[str, Any]]) -> str:
    """The human form of ``broker tasks``: one row per task and worker that declared it,
    the defaults its jobs get and its retry rules."""
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
                format_time(str(entry["seen_at"])),
                retry_rules(declared),
            ]
        )
    headers = ["task", "mode", "queue", "retries", "timeout", "worker", "last seen"]
    return table([*headers, "retry rules"], rows)


async def _prune(backend: Backend, args: argparse.Namespace) -> int:
    if args.older_than is None and args.keep_latest is None:
        raise ConfigurationError("prune needs --older-than, --keep-latest or both")
    statuses = [JobStatus(s) for s in args.status] if args.status else None
    if getattr(args, "dry_run", False):
        count = await _would_prune(backend, args.older_than, args.keep_latest, statuses)
        if args.json:
            _print_json({"dry_run": True, "would_delete": count})
        else:
            print(f"would delete {count} job{'' if count == 1 else 's'} (dry run: nothing deleted)")
        return 0
    deleted = await backend.prune(
        older_than=args.older_than, keep_latest=args.keep_latest, statuses=statuses
    )
    if args.json:
        _print_json({"deleted": deleted})
    else:
        print(f"deleted {deleted} job{'' if deleted == 1 else 's'}")
    return 0


async def _would_prune(
    backend: Backend,
    older_than: float | None,
    keep_latest: int | None,
    statuses: Collection[JobStatus] | None,
) -> int:
    """How many jobs ``prune`` would delete now, by the same rules, from the listing
    (finished jobs only, payloads left out); nothing is deleted. The age is measured on
    this machine's clock, the prune's own on the main's."""
    stamps: list[datetime] = []
    cursor: str | None = None
    while True:
        page = await backend.list_jobs(
            statuses=statuses or TERMINAL_STATUSES,
            queues=None,
            tasks=None,
            limit=protocol.MAX_LIST_LIMIT,
            cursor=cursor,
            include_payload=False,
        )
        stamps += [datetime.fromisoformat(str(job["updated_at"])) for job in page.jobs]
        cursor = page.next_cursor
        if cursor is None:
            break
    return prune_count(stamps, older_than, keep_latest, utcnow())


def prune_count(
    updated: Sequence[datetime], older_than: float | None, keep_latest: int | None, now: datetime
) -> int:
    """How many of the finished jobs last updated at ``updated`` a prune deletes: those
    older than ``older_than`` seconds, and all but the newest ``keep_latest``."""
    newest_first = sorted(updated, reverse=True)
    doomed = set()
    if older_than is not None:
        cutoff = now - timedelta(seconds=older_than)
        doomed |= {i for i, at in enumerate(newest_first) if at < cutoff}
    if keep_latest is not None:
        doomed |= set(range(keep_latest, len(newest_first)))
    return len(doomed)


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
        print(format_job(job))
    return 0


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
    message = _short(job.get("progress_message") or "", 30)
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
            f"{runs(job)}/{job['max_attempts']}",
            format_time(str(job["updated_at"])),
            format_progress(job),
            _short(job["last_error"] or "", 40),
            *(_short(json.dumps(job[key]), 30) if key in job else "(omitted)" for key in payload),
        ]
        for job in jobs
    ]
    headers = ["id", "status", "queue", "task", "mode", "runs", "updated", "progress", "last error"]
    return table([*headers, *payload], rows)


# ------------------------------------------------------------------------ top


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
                        _by_mode(w["credits"]),
                        "yes" if w["draining"] else "no",
                        str(len(w["startup_errors"])) if w["startup_errors"] else "-",
                    ]
                    for w in workers
                ],
            )
        )
    return "\n".join(out)


_HOME_AND_CLEAR = "\x1b[H\x1b[2J"


async def top(backend: Backend, args: argparse.Namespace) -> int:
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
            status = await backend.status()
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


COMMANDS: dict[str, Command] = {
    "status": _status,
    "jobs": _jobs,
    "tasks": _tasks,
    "job": _job,
    "cancel": _cancel,
    "retry": _retry,
    "enqueue": _enqueue,
    "prune": _prune,
    "top": top,
}
