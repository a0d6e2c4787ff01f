"""``broker``, the operator's command: its parser, its subcommands, and how it reaches the
main (or, when it cannot, the store)."""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Sequence

from broker.exceptions import ConfigurationError, InvalidJobError
from broker.jobs import ExecutionMode, JobStatus
from broker.model import checks, logs
from broker.model.rates import parse_rate
from broker.ops import admin
from broker.ops.cli.options import (
    add_credential_options,
    add_log_options,
    add_main_address,
    add_peer_tls_options,
    add_version,
    check_main_address,
    count,
    credentials,
    duration,
    env_option,
    parse,
    peer_tls,
    positive,
    typed,
)
from broker.ops.cli.run import run, use_app_directory
from broker.wire import messages as protocol
from broker.wire.addresses import peer_arguments
from broker.wire.credentials import Credentials


def _job_ref(text: str) -> uuid.UUID | str:
    """A job id, or the start of one (at least 4 hex digits, as ``broker jobs`` shows
    ids), which :func:`broker.ops.admin.resolve_job` looks up."""
    try:
        return uuid.UUID(text)
    except ValueError:
        pass
    prefix = text.strip().lower()
    if len(prefix.replace("-", "")) >= 4 and all(c in "0123456789abcdef-" for c in prefix):
        return prefix
    raise argparse.ArgumentTypeError(
        f"expected a job id (a UUID) or its first 4 or more hex digits, got {text!r}"
    )


def _page(name: str, value: int) -> object:
    checks.int_in_range(name, value, 1, protocol.MAX_LIST_LIMIT, why="use --all to follow pages")
    return value


def _json_here(parser: argparse.ArgumentParser) -> None:
    """``--json`` after a nested subcommand too (``broker queue pause mail --json``); left
    unset unless given, so it never undoes a ``--json`` given before the subcommand."""
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")


def broker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="broker",
        description="Operate the broker: status, top, jobs, job, retry, cancel, workflow, enqueue, "
        "tasks, "
        "prune, queue, migrate. Talks to the main; when the main cannot be reached and "
        "--database-url is set, works on the store directly (never creating or migrating "
        "its schema).",
    )
    add_version(p)
    add_main_address(p)
    add_credential_options(
        p,
        [protocol.Role.OPERATOR, protocol.Role.CLIENT],
        "the {role} secret the main requires",
    )
    add_peer_tls_options(p)
    env_option(
        p,
        "--database-url",
        help="job store URL, used only when the main cannot be reached, and by migrate "
        "(default: none)",
    )
    env_option(
        p,
        "--adapter",
        help="custom storage adapter factory for --database-url, package.module:factory",
    )
    env_option(
        p,
        "--timeout",
        default=10.0,
        type=positive(float, "timeout"),
        help="seconds to wait for the main to connect and to answer",
    )
    add_log_options(p, level=False)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("--json", action="store_true", help="print JSON (docs/reference/cli.md)")
        # A usage error found after parsing shows this subcommand's usage, as argparse's own do.
        cmd.set_defaults(command_parser=cmd)
        return cmd

    command("status", "job counts per queue, workers and pending recoveries")
    top = sub.add_parser(
        "top",
        help="a live view of queues, rates and workers",
        description="Queues, throughput and workers, redrawn in place every --interval "
        "seconds until Ctrl-C; one plain frame after another when the output is not a terminal.",
    )
    top.set_defaults(command_parser=top)
    top.add_argument(
        "--interval", type=positive(float, "interval"), default=2.0, help="seconds between frames"
    )
    top.add_argument(
        "--count", type=positive(int, "count"), default=None, help="stop after this many frames"
    )
    jobs = command("jobs", "list jobs, newest first")
    jobs.add_argument(
        "--status",
        action="append",
        choices=[s.value for s in JobStatus],
        help="only jobs in this status; repeatable",
    )
    jobs.add_argument("--queue", action="append", help="only jobs in this queue; repeatable")
    jobs.add_argument("--task", action="append", help="only jobs of this task; repeatable")
    jobs.add_argument(
        "--limit", type=typed(int, _page, "limit"), default=50, help="jobs per page (default 50)"
    )
    jobs.add_argument("--cursor", default=None, help="the page after this one (from a listing)")
    jobs.add_argument("--all", action="store_true", help="follow every page to the end")
    jobs.add_argument(
        "--with-payload",
        action="store_true",
        help="include each job's args, kwargs and result (left out by default: they can be "
        "large; `broker job ID` always shows them)",
    )
    for name, text in (
        ("job", "show one job"),
        ("retry", "put a dead (failed) job back in the queue with a fresh attempt count"),
        ("cancel", "cancel a queued or running job"),
    ):
        command(name, text).add_argument(
            "job_id", type=_job_ref, help="the job's id, or its first 4 or more hex digits"
        )
    workflow = command(
        "workflow",
        "show a workflow's members, their parents and states; `workflow retry ID` queues "
        "its dead members again and revives the dependents they cancelled",
    )
    workflow.add_argument(
        "workflow_id", metavar="[retry] ID", help="the workflow's id (a job's workflow_id)"
    )
    workflow.add_argument("retry_id", nargs="?", default=None, help=argparse.SUPPRESS)
    enq = command("enqueue", "enqueue a job and print its id")
    enq.add_argument("task", help="registered task name, e.g. app.tasks.send_email")
    enq.add_argument("args_json", nargs="?", default="[]", help="positional args as a JSON list")
    enq.add_argument("--kwargs", default="{}", help="keyword args as a JSON object")
    enq.add_argument("--queue", default=None)
    enq.add_argument("--priority", type=int, default=None, help="higher runs first")
    enq.add_argument(
        "--delay",
        type=duration,
        default=None,
        help="how long before it may run: seconds, or 30s, 15m, 12h, 7d",
    )
    enq.add_argument("--idempotency-key", default=None)
    enq.add_argument(
        "--unique-key",
        default=None,
        help="while a queued or running job holds this key, return it instead of a new one",
    )
    enq.add_argument("--mode", choices=[m.value for m in ExecutionMode], default=None)
    enq.add_argument(
        "--retries",
        type=count("retries"),
        default=None,
        metavar="N",
        help="runs allowed after a failed first one (default: the task's @task(retries=...) "
        "as its workers declared it; see `broker tasks`)",
    )
    enq.add_argument(
        "--allow-unknown-task",
        action="store_true",
        help="enqueue even if no worker has ever declared this task (a deliberate cold "
        "start, before the first worker serving it starts); without it such a name is "
        "refused, since it is usually a typo",
    )
    command("tasks", "list the task catalog: the tasks workers declared and their job defaults")
    prune = command("prune", "delete finished jobs (never a queued or running one)")
    prune.add_argument(
        "--older-than",
        type=duration,
        default=None,
        metavar="DURATION",
        help="delete finished jobs last updated longer ago than this: seconds, or 30s, "
        "15m, 12h, 7d",
    )
    prune.add_argument(
        "--keep-latest",
        type=count("keep_latest"),
        default=None,
        metavar="N",
        help="delete all but the newest N finished jobs",
    )
    prune.add_argument(
        "--status",
        action="append",
        choices=[s.value for s in JobStatus if s.is_terminal],
        help="prune only this finished status; repeatable (default: all three)",
    )
    prune.add_argument(
        "--dry-run",
        action="store_true",
        help="count the jobs it would delete, and delete nothing",
    )
    queue = command("queue", "pause, resume or rate-limit a queue (kept across restarts)")
    queue_sub = queue.add_subparsers(dest="queue_command", required=True)
    for name, text in (
        ("pause", "dispatch none of the queue's jobs (running ones finish) until resumed"),
        ("resume", "dispatch the queue's jobs again, at once"),
    ):
        action = queue_sub.add_parser(name, help=text, description=text)
        action.add_argument("queue", help="the queue's name")
        _json_here(action)
    limit = queue_sub.add_parser(
        "limit",
        help="dispatch at most RATE of the queue's jobs, across every worker",
        description="Dispatch at most RATE of the queue's jobs (50/s, 600/m, 100/h), across "
        "every worker; --clear removes the limit.",
    )
    limit.add_argument("queue", help="the queue's name")
    limit.add_argument("rate", nargs="?", default=None, help="COUNT/s, COUNT/m or COUNT/h")
    limit.add_argument(
        "--burst",
        type=positive(int, "burst"),
        default=1,
        help="jobs let through at once after a quiet spell (default 1)",
    )
    limit.add_argument("--clear", action="store_true", help="remove the queue's rate limit")
    _json_here(limit)
    command(
        "migrate",
        "create the schema of the store at --database-url, or migrate it to this version "
        "(what broker-main does when it starts); stop an older main first",
    )
    return p


def operator_credential(secrets: Credentials) -> tuple[protocol.Role, str | None]:
    """The role the operator's command says hello as, and its secret.

    With an operator secret of its own, as an operator. Otherwise as a client: with a
    client secret its reads and enqueue still work; with one shared token, or none, a
    client has every right (:meth:`Credentials.rights`), and a main older than the
    operator role still understands the hello."""
    if secrets.operator and secrets.operator != secrets.client:
        return protocol.Role.OPERATOR, secrets.operator
    return protocol.Role.CLIENT, secrets.client


async def run_broker(args: argparse.Namespace) -> int:
    if args.adapter:
        use_app_directory()
    if args.command == "migrate":
        return await admin.migrate(args.database_url or None, args.adapter or None, args.json)
    host, port = peer_arguments(args.main)
    role, secret = operator_credential(credentials(args))
    backend = await admin.open_backend(
        host,
        port,
        token=secret,
        role=role,
        tls=peer_tls(args),
        timeout=float(args.timeout),
        database_url=args.database_url or None,
        adapter=args.adapter or None,
        read_only=admin.only_reads(args),
        note=lambda text: logs.announce(args.log_format, "store_fallback", text, level="WARNING"),
    )
    try:
        return await admin.run_command(backend, args)
    finally:
        await backend.close()


def broker_entry(argv: Sequence[str] | None = None) -> int:
    parser = broker_parser()
    args = parse(parser, argv, [peer_tls])
    usage = args.command_parser
    if args.command == "prune" and args.older_than is None and args.keep_latest is None:
        usage.error("prune needs --older-than DURATION, --keep-latest N, or both")
    if args.command == "queue" and args.queue_command == "limit":
        if (args.rate is None) == (not args.clear):
            usage.error("queue limit needs RATE (like 50/s) or --clear, not both")
        if args.rate is not None:
            try:
                parse_rate(args.rate, args.burst)
            except ValueError as exc:
                usage.error(str(exc))
    if args.command == "migrate" and not args.database_url:
        usage.error(
            "migrate needs --database-url URL before it (broker --database-url URL migrate), "
            "or BROKER_DATABASE_URL"
        )
    check_main_address(parser, args.main)
    if args.command == "enqueue":
        # Checked before anything connects: a bad request is a usage error (exit 2).
        try:
            args.request = admin.enqueue_request(args)
        except (ConfigurationError, InvalidJobError) as exc:
            usage.error(str(exc))
    logs.configure("WARNING", args.log_format)
    result: list[int] = []

    async def go() -> None:
        result.append(await run_broker(args))

    code = run(go, args.log_format)
    return result[0] if code == 0 and result else code
