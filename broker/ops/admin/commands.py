"""The operator's commands, each run on a :class:`~broker.ops.admin.service.RequestService`
(the main, or the store when the main is down), and the checks made before one runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import msgspec

from broker.exceptions import ConfigurationError
from broker.jobs import TERMINAL_STATUSES, JobSpec, JobStatus, JSONValue, utcnow
from broker.model.untrusted import escape_control
from broker.ops.admin.format import (
    format_job,
    format_jobs,
    format_status,
    format_tasks,
    format_workflow,
    retry_rules,
)
from broker.ops.admin.service import RequestService, read_status
from broker.ops.admin.top import top
from broker.storage import SCHEMA_VERSION
from broker.wire import messages as protocol

Command = Callable[[RequestService, argparse.Namespace], Awaitable[int]]


async def run_command(service: RequestService, args: argparse.Namespace) -> int:
    """Run the parsed ``broker`` command on ``service``; returns the exit code."""
    command = COMMANDS.get(args.command)
    if command is None:
        raise ConfigurationError(f"unknown command {args.command!r}")
    return await command(service, args)


async def _status(service: RequestService, args: argparse.Namespace) -> int:
    status = await read_status(service)
    if args.json:
        _print_json(status)
    else:
        print(format_status(status))
    return 0


async def _jobs(service: RequestService, args: argparse.Namespace) -> int:
    statuses = [JobStatus(s) for s in args.status] if args.status else None
    jobs: list[dict[str, JSONValue]] = []
    cursor: str | None = args.cursor
    while True:
        page = await service.list_jobs(
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


async def _job(service: RequestService, args: argparse.Namespace) -> int:
    job_id = await resolve_job(service, args.job_id)
    job = None if job_id is None else await service.get_job(job_id)
    if job is None or args.json:
        return _print_job(job, args.json)
    rules = retry_rules(_declaration(await service.list_tasks(), str(job["task"])))
    print(format_job(job, rules))
    return 0


def _declaration(tasks: Sequence[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The declaration that decides ``name``'s defaults: the newest seen (as the main
    decides, :mod:`broker.core.catalog`)."""
    mine = [t for t in tasks if t["task"] == name]
    return max(mine, key=lambda t: str(t["seen_at"]))["declaration"] if mine else None


async def _cancel(service: RequestService, args: argparse.Namespace) -> int:
    job_id = await resolve_job(service, args.job_id)
    job = None if job_id is None else await service.cancel(job_id)
    if job is not None and job["status"] != JobStatus.CANCELLED:
        ended = escape_control(str(job["status"]))
        print(f"note: job {job_id} had already ended as {ended}", file=sys.stderr)
    return _print_job(job, args.json)


async def _retry(service: RequestService, args: argparse.Namespace) -> int:
    job_id = await resolve_job(service, args.job_id)
    # Read first: the store returns a job that is not dead unchanged, and one that was
    # already queued would look just like one this command had retried.
    job = None if job_id is None else await service.get_job(job_id)
    if job_id is not None and job is not None and job["status"] == JobStatus.FAILED:
        job = await service.retry(job_id)
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


def workflow_target(args: argparse.Namespace) -> tuple[bool, uuid.UUID]:
    """``broker workflow ID`` or ``broker workflow retry ID``: whether it retries, and the
    workflow id."""
    retry = args.workflow_id == "retry" and args.retry_id is not None
    if args.retry_id is not None and not retry:
        raise ConfigurationError(
            f"expected `workflow ID` or `workflow retry ID`, got {args.workflow_id!r} "
            f"{args.retry_id!r}"
        )
    text = args.retry_id if retry else args.workflow_id
    try:
        return retry, uuid.UUID(text)
    except ValueError:
        raise ConfigurationError(f"expected a workflow id (a UUID), got {text!r}") from None


async def _workflow(service: RequestService, args: argparse.Namespace) -> int:
    retry, workflow_id = workflow_target(args)
    if retry:
        view = await service.retry_workflow(workflow_id)
    else:
        view = await service.get_workflow(workflow_id)
    if view is None:
        print("no such workflow", file=sys.stderr)
        return 1
    if args.json:
        _print_json(msgspec.to_builtins(view))
    else:
        print(format_workflow(view))
    return 0


MAX_PREFIX_MATCHES = 10
"""How many matching ids an ambiguous prefix lists before it stops looking."""


async def resolve_job(service: RequestService, ref: uuid.UUID | str) -> uuid.UUID | None:
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
        page = await service.list_jobs(
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
    return (
        args.command in {"status", "top", "jobs", "job", "tasks"}
        or (args.command == "prune" and bool(args.dry_run))
        or (args.command == "workflow" and not workflow_target(args)[0])
    )


async def migrate(database_url: str | None, adapter: str | None, as_json: bool) -> int:
    """``broker migrate``: the one operator command that creates or migrates a schema
    (as ``broker-main`` does when it starts)."""
    if not database_url:
        raise ConfigurationError("migrate needs --database-url (or BROKER_DATABASE_URL)")
    from broker.ops import composition  # the store's modules: only this command opens one

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


async def _enqueue(service: RequestService, args: argparse.Namespace) -> int:
    request = getattr(args, "request", None) or enqueue_request(args)
    [result] = await service.enqueue_requests(
        [request], allow_unknown_tasks=args.allow_unknown_task
    )
    if args.json:
        print(json.dumps({"job_id": str(result.job_id), "duplicate": result.duplicate}))
    else:
        print(result.job_id)
    return 0


async def _tasks(service: RequestService, args: argparse.Namespace) -> int:
    tasks = await service.list_tasks()
    if args.json:
        _print_json({"tasks": tasks})
    else:
        print(format_tasks(tasks))
    return 0


async def _prune(service: RequestService, args: argparse.Namespace) -> int:
    if args.older_than is None and args.keep_latest is None:
        raise ConfigurationError("prune needs --older-than, --keep-latest or both")
    statuses = [JobStatus(s) for s in args.status] if args.status else None
    if getattr(args, "dry_run", False):
        count = await _would_prune(service, args.older_than, args.keep_latest, statuses)
        if args.json:
            _print_json({"dry_run": True, "would_delete": count})
        else:
            print(f"would delete {count} job{'' if count == 1 else 's'} (dry run: nothing deleted)")
        return 0
    deleted = await service.prune(
        older_than=args.older_than, keep_latest=args.keep_latest, statuses=statuses
    )
    if args.json:
        _print_json({"deleted": deleted})
    else:
        print(f"deleted {deleted} job{'' if deleted == 1 else 's'}")
    return 0


async def _would_prune(
    service: RequestService,
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
        page = await service.list_jobs(
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


async def _queue(service: RequestService, args: argparse.Namespace) -> int:
    """``broker queue pause|resume|limit QUEUE``: change a queue's settings, print them."""
    match args.queue_command:
        case "pause":
            settings = await service.pause_queue(args.queue)
        case "resume":
            settings = await service.resume_queue(args.queue)
        case _:
            settings = await service.limit_queue(args.queue, args.rate, burst=args.burst)
    if args.json:
        _print_json(settings)
    else:
        print(format_queue_settings(settings))
    return 0


def format_queue_settings(settings: Mapping[str, Any]) -> str:
    """One line: the queue, paused or dispatching, and its rate limit if any."""
    state = "paused" if settings["paused"] else "dispatching"
    rate = settings.get("rate_limit")
    limit = "no rate limit" if rate is None else f"at most {rate} (burst {settings['rate_burst']})"
    return f"queue {settings['queue']}: {state}, {limit}"


COMMANDS: dict[str, Command] = {
    "status": _status,
    "jobs": _jobs,
    "tasks": _tasks,
    "job": _job,
    "cancel": _cancel,
    "retry": _retry,
    "workflow": _workflow,
    "enqueue": _enqueue,
    "prune": _prune,
    "queue": _queue,
    "top": top,
}
