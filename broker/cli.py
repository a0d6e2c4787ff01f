"""Command-line entry points: ``broker-main``, ``broker-worker`` and ``broker``.

Every option can also come from a ``BROKER_*`` environment variable, named in
``--help``. The ``*_entry`` functions only parse and run; the ``main(argv)`` style
functions return an exit code so tests can call them in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from broker import composition
from broker.client import Client
from broker.exceptions import BrokerError, ConfigurationError
from broker.jobs import ExecutionMode
from broker.main import DEFAULT_PORT, Main, MainSettings
from broker.tasks import default_registry
from broker.worker import Worker

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///./broker.db"


class _EnvDefault(argparse.Action):
    """Takes its default from an environment variable and says so in ``--help``."""

    def __init__(self, envvar: str, required: bool = False, default: Any = None, **kw: Any):
        if envvar in os.environ:
            default = os.environ[envvar]
        if required and default is not None:
            required = False
        kw["help"] = f"{kw.get('help', '')} [env {envvar}]".strip()
        super().__init__(default=default, required=required, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _number(kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number (got {text!r})") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be positive (got {text!r})")
        return value

    return parse


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigurationError(f"expected HOST:PORT (got {text!r})")
    return host, int(port)


# ------------------------------------------------------------------------ broker-main


def main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="broker-main", description="Run the broker's main process.")
    p.add_argument(
        "--database-url",
        action=_EnvDefault,
        envvar="BROKER_DATABASE_URL",
        default=DEFAULT_DATABASE_URL,
        help="job store URL",
    )
    p.add_argument(
        "--adapter",
        action=_EnvDefault,
        envvar="BROKER_ADAPTER",
        help="custom storage adapter factory, package.module:factory (called with the URL)",
    )
    p.add_argument(
        "--host",
        action=_EnvDefault,
        envvar="BROKER_HOST",
        default="127.0.0.1",
        help="address to listen on",
    )
    p.add_argument(
        "--port",
        action=_EnvDefault,
        envvar="BROKER_PORT",
        default=DEFAULT_PORT,
        type=int,
        help="port to listen on",
    )
    p.add_argument(
        "--token",
        action=_EnvDefault,
        envvar="BROKER_TOKEN",
        help="shared secret every worker and client must prove",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=_env_flag("BROKER_ALLOW_UNAUTHENTICATED"),
        help="listen on a non-loopback address without a token [env BROKER_ALLOW_UNAUTHENTICATED]",
    )
    p.add_argument(
        "--orphan-grace",
        action=_EnvDefault,
        envvar="BROKER_ORPHAN_GRACE",
        default=30.0,
        type=float,
        help="seconds a restarted main waits for workers to reclaim their leases",
    )
    p.add_argument(
        "--ping-interval",
        action=_EnvDefault,
        envvar="BROKER_PING_INTERVAL",
        default=5.0,
        type=_number(float, "ping interval"),
        help="seconds between pings",
    )
    p.add_argument(
        "--liveness-timeout",
        action=_EnvDefault,
        envvar="BROKER_LIVENESS_TIMEOUT",
        default=15.0,
        type=_number(float, "liveness timeout"),
        help="seconds of silence after which a peer is treated as gone",
    )
    p.add_argument(
        "--max-line-bytes",
        action=_EnvDefault,
        envvar="BROKER_MAX_LINE_BYTES",
        default=1 << 20,
        type=_number(int, "max line bytes"),
        help="largest protocol message accepted after the handshake",
    )
    p.add_argument(
        "--log-level",
        action=_EnvDefault,
        envvar="BROKER_LOG_LEVEL",
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR",
    )
    return p


async def run_main(args: argparse.Namespace, ready: Callable[[Main], None] | None = None) -> None:
    settings = MainSettings(
        host=args.host,
        port=int(args.port),
        token=args.token or None,
        allow_unauthenticated=args.allow_unauthenticated,
        orphan_grace=float(args.orphan_grace),
        ping_interval=float(args.ping_interval),
        liveness_timeout=float(args.liveness_timeout),
        max_line_bytes=int(args.max_line_bytes),
    )
    store = composition.open_store(args.database_url, args.adapter)
    main = Main(store, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await main.start()
    if ready is not None:
        ready(main)
    print(f"broker-main listening on {settings.host}:{main.port}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await main.stop()


def main_entry(argv: Sequence[str] | None = None) -> int:
    args = main_parser().parse_args(argv)
    _configure_logging(args.log_level)
    return _run(lambda: run_main(args))


# ------------------------------------------------------------------------ broker-worker


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number (got {text!r})") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative (got {text!r})")
    return value


_RUNNER_OPTIONS: list[tuple[str, Callable[[str], Any], Any, str]] = [
    ("--inline-concurrency", _count, 4, "inline jobs run at once on the worker's loop (0: off)"),
    (
        "--pooled-runner-count",
        _count,
        os.cpu_count() or 1,
        "warm child processes for pooled jobs (0: off; default: CPU count)",
    ),
    (
        "--pooled-runner-concurrency",
        _number(int, "pooled runner concurrency"),
        1,
        "jobs each pooled child runs at once on its own event loop",
    ),
    (
        "--pooled-max-jobs",
        _number(int, "pooled max jobs"),
        100,
        "recycle a pooled child after this many jobs",
    ),
    (
        "--pooled-max-rss-bytes",
        _number(int, "pooled max RSS"),
        512 << 20,
        "recycle a pooled child whose memory exceeds this many bytes",
    ),
    (
        "--pooled-max-lifetime",
        _number(float, "pooled max lifetime"),
        3600.0,
        "recycle a pooled child after this many seconds",
    ),
    ("--forked-concurrency", _count, 2, "forked jobs (a fresh process each) at once (0: off)"),
    (
        "--job-timeout",
        _number(float, "job timeout"),
        None,
        "default seconds a job may run (job and task options win)",
    ),
    (
        "--kill-grace",
        _number(float, "kill grace"),
        5.0,
        "seconds between SIGTERM and SIGKILL when a child must stop",
    ),
    (
        "--runner-startup-timeout",
        _number(float, "runner start-up timeout"),
        30.0,
        "seconds a child may take to import the app and say ready",
    ),
]


def _add_main_address(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--main",
        action=_EnvDefault,
        envvar="BROKER_MAIN",
        default=f"127.0.0.1:{DEFAULT_PORT}",
        help="the main's HOST:PORT",
    )


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="broker-worker", description="Run jobs handed out by a main.")
    _add_main_address(p)
    p.add_argument(
        "--app",
        action="append",
        default=None,
        help="module that registers tasks with @task; repeatable [env BROKER_APP, comma-separated]",
    )
    p.add_argument(
        "--worker-id",
        action=_EnvDefault,
        envvar="BROKER_WORKER_ID",
        help="stable identity of this worker (default: host-pid-random)",
    )
    p.add_argument(
        "--token", action=_EnvDefault, envvar="BROKER_TOKEN", help="shared secret the main requires"
    )
    p.add_argument(
        "--queues",
        action=_EnvDefault,
        envvar="BROKER_QUEUES",
        help="comma-separated queues to serve (default: all)",
    )
    for flag, kind, default, text in _RUNNER_OPTIONS:
        p.add_argument(
            flag,
            action=_EnvDefault,
            envvar="BROKER_" + flag.removeprefix("--").replace("-", "_").upper(),
            default=default,
            type=kind,
            help=text,
        )
    p.add_argument(
        "--drain-timeout",
        action=_EnvDefault,
        envvar="BROKER_DRAIN_TIMEOUT",
        type=_number(float, "drain timeout"),
        help="seconds running jobs get to finish on SIGTERM (default: wait)",
    )
    p.add_argument(
        "--log-level",
        action=_EnvDefault,
        envvar="BROKER_LOG_LEVEL",
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR",
    )
    return p


def _app_modules(args: argparse.Namespace) -> list[str]:
    apps = list(args.app or [])
    if not apps and os.environ.get("BROKER_APP"):
        apps = [a.strip() for a in os.environ["BROKER_APP"].split(",") if a.strip()]
    if not apps:
        raise ConfigurationError("name at least one task module with --app (or BROKER_APP)")
    return apps


def load_apps(modules: Sequence[str]) -> None:
    """Import the operator's task modules so their ``@task`` registrations run."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise ConfigurationError(f"cannot import task module {name!r}: {exc!r}") from exc


async def run_worker(args: argparse.Namespace) -> None:
    apps = _app_modules(args)
    load_apps(apps)
    host, port = _host_port(args.main)
    runners = composition.build_runners(
        composition.RunnerOptions(
            apps=tuple(apps),
            inline_concurrency=args.inline_concurrency,
            pooled_runner_count=args.pooled_runner_count,
            pooled_runner_concurrency=args.pooled_runner_concurrency,
            pooled_max_jobs=args.pooled_max_jobs,
            pooled_max_rss_bytes=args.pooled_max_rss_bytes,
            pooled_max_lifetime=args.pooled_max_lifetime,
            forked_concurrency=args.forked_concurrency,
            default_timeout=args.job_timeout,
            kill_grace=args.kill_grace,
            startup_timeout=args.runner_startup_timeout,
        ),
        default_registry,
    )
    if not runners:
        raise ConfigurationError("this worker serves no execution mode; enable at least one runner")
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    queues = [q.strip() for q in args.queues.split(",") if q.strip()] if args.queues else None
    worker = Worker(
        host,
        port,
        worker_id=worker_id,
        runners=runners,
        registry=default_registry,
        token=args.token or None,
        queues=queues,
        drain_timeout=float(args.drain_timeout) if args.drain_timeout else None,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    print(
        f"broker-worker {worker_id} serving {sorted(m.value for m in runners)}",
        file=sys.stderr,
        flush=True,
    )
    await worker.run()


def worker_entry(argv: Sequence[str] | None = None) -> int:
    args = worker_parser().parse_args(argv)
    _configure_logging(args.log_level)
    return _run(lambda: run_worker(args))


# ------------------------------------------------------------------------ broker (operator)


def broker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="broker", description="Enqueue and inspect jobs.")
    _add_main_address(p)
    p.add_argument(
        "--token", action=_EnvDefault, envvar="BROKER_TOKEN", help="shared secret the main requires"
    )
    sub = p.add_subparsers(dest="command", required=True)
    enq = sub.add_parser("enqueue", help="enqueue a job and print its id")
    enq.add_argument("task", help="registered task name, e.g. app.tasks.send_email")
    enq.add_argument("args_json", nargs="?", default="[]", help="positional args as a JSON list")
    enq.add_argument("--kwargs", default="{}", help="keyword args as a JSON object")
    enq.add_argument("--queue", default=None)
    enq.add_argument("--priority", type=int, default=None, help="higher runs first")
    enq.add_argument("--delay", type=float, default=None, help="seconds before it may run")
    enq.add_argument("--idempotency-key", default=None)
    enq.add_argument("--mode", choices=[m.value for m in ExecutionMode], default=None)
    enq.add_argument("--json", action="store_true", help="print the result as JSON")
    job = sub.add_parser("job", help="show one job")
    job.add_argument("job_id")
    job.add_argument("--json", action="store_true", help="print the job as JSON")
    cancel = sub.add_parser("cancel", help="cancel a queued or running job")
    cancel.add_argument("job_id")
    cancel.add_argument("--json", action="store_true")
    return p


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{what} is not valid JSON: {exc}") from None


def _print_job(job: dict[str, Any] | None, as_json: bool) -> int:
    if job is None:
        print("no such job", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(job, indent=2, sort_keys=True))
    else:
        width = max(len(k) for k in job)
        for key, value in job.items():
            print(f"{key:<{width}}  {json.dumps(value) if not isinstance(value, str) else value}")
    return 0


async def run_broker(args: argparse.Namespace) -> int:
    host, port = _host_port(args.main)
    async with Client(host, port, token=args.token or None) as client:
        match args.command:
            case "enqueue":
                params = _json_arg(args.args_json, "ARGS_JSON")
                if not isinstance(params, list):
                    raise ConfigurationError("ARGS_JSON must be a JSON list, e.g. '[1, \"a\"]'")
                kwargs = _json_arg(args.kwargs, "--kwargs")
                if not isinstance(kwargs, dict):
                    raise ConfigurationError("--kwargs must be a JSON object")
                result = await client.enqueue(
                    args.task,
                    params,
                    kwargs,
                    queue=args.queue,
                    priority=args.priority,
                    delay=args.delay,
                    idempotency_key=args.idempotency_key,
                    execution_mode=args.mode,
                )
                if args.json:
                    print(json.dumps({"job_id": str(result.job_id), "duplicate": result.duplicate}))
                else:
                    print(result.job_id)
                return 0
            case "job":
                return _print_job(await client.get_job(args.job_id), args.json)
            case "cancel":
                return _print_job(await client.cancel(args.job_id), args.json)
    return 2


def broker_entry(argv: Sequence[str] | None = None) -> int:
    args = broker_parser().parse_args(argv)
    _configure_logging("WARNING")
    result: list[int] = []

    async def go() -> None:
        result.append(await run_broker(args))

    code = _run(go)
    return result[0] if code == 0 and result else code


def _run(make: Callable[[], Any]) -> int:
    """Run a coroutine; print a failure's chain of causes and return a non-zero code."""
    try:
        asyncio.run(make())
    except KeyboardInterrupt:
        return 130
    except (BrokerError, OSError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        cause = exc.__cause__
        while cause is not None:
            print(f"  caused by: {cause!r}", file=sys.stderr)
            cause = cause.__cause__
        return 1
    return 0


if __name__ == "__main__":
    _commands = {"main": main_entry, "worker": worker_entry, "broker": broker_entry}
    if len(sys.argv) < 2 or sys.argv[1] not in _commands:
        print(f"usage: python -m broker.cli {{{','.join(_commands)}}} [options]", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(_commands[sys.argv[1]](sys.argv[2:]))
