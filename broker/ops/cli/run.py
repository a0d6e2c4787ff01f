"""What the commands run once their flags are parsed: a main, a worker, and the one way a
command ends (its exit code, a failure's chain of causes)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.exceptions import BrokerError, ConfigurationError, DeposedError
from broker.model import checks, logs
from broker.model.untrusted import escape_control
from broker.ops import composition
from broker.ops.cli.options import credentials, from_args, peer_tls, server_tls
from broker.wire.addresses import peer_arguments

if TYPE_CHECKING:
    from broker.main.main import Main


async def run_main(args: argparse.Namespace, ready: Callable[[Main], None] | None = None) -> None:
    # The main's modules load here, not with this module: ``broker`` and ``broker-worker``
    # share it and never run a main.
    from broker.main.main import Main
    from broker.main.retention import Retention
    from broker.main.settings import MainSettings, line_limit_for
    from broker.tasks.schedule import declared_in

    modules = list(args.schedules or [])
    load_apps(modules, "--schedules")
    schedules = declared_in(modules)
    secrets = credentials(args)
    settings = from_args(
        MainSettings,
        args,
        worker_token=secrets.worker,
        client_token=secrets.client,
        operator_token=secrets.operator,
        tls=server_tls(args),
        max_line_bytes=args.max_line_bytes
        or line_limit_for(args.max_payload_bytes, args.max_checkpoint_bytes),
    )
    retention = from_args(Retention, args)
    if args.adapter:
        use_app_directory()
    settings.validate()  # before the store is opened (a SQLite main takes its lock)
    store = composition.open_store(
        args.database_url,
        args.adapter,
        pool_size=args.store_pool_size,
        hot_pool_size=args.store_hot_pool_size,
        single_main=True,
        offload_threshold=args.offload_threshold,
    )
    main = Main(
        store,
        settings,
        schedules=schedules,
        retention=retention,
        retry_delay_fn=args.retry_backoff,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await main.start()  # binds the port first: a clash leaves the store untouched
    except BaseException:
        await store.close()
        raise
    dashboard = None
    try:
        if settings.http_port is not None:
            from broker.ops.web import Dashboard  # aiohttp: loaded only when it serves HTTP

            dashboard = Dashboard(main, host=settings.http_host, port=settings.http_port)
            await dashboard.start()
    except OSError as exc:
        await main.stop()
        raise ConfigurationError(
            f"cannot serve the dashboard on {settings.http_host}:{settings.http_port}: {exc}"
        ) from None
    if ready is not None:
        ready(main)
    logs.announce(
        args.log_format,
        "listening",
        f"broker-main listening on {settings.host}:{main.port}",
        host=settings.host,
        port=main.port,
    )
    if dashboard is not None:
        logs.announce(
            args.log_format,
            "dashboard",
            f"broker-main dashboard on http://{settings.http_host}:{dashboard.port}/",
            host=settings.http_host,
            port=dashboard.port,
        )
    try:
        await main.wait(stop)
    finally:
        if dashboard is not None:
            await dashboard.stop()
        await main.stop(report_grace=1.0 if main.deposed.is_set() else 5.0)
    if main.deposed.is_set():
        # The reason, not a guess: a leader that could not reach the store past its lease
        # steps down with nobody having taken over.
        raise DeposedError(
            f"this main stepped down ({main.step_down_reason}); start it again to stand by"
        )


def serving(main: Main) -> None:
    """The ``broker-main`` process is up. What it holds now (modules, the schema, compiled
    statements) lives as long as it does, so the cyclic garbage collector stops walking
    it (``gc.freeze``): its full collections, which a bulk enqueue's thousands of new
    objects set off, walked all of it every time (a quarter of the main's CPU per job
    enqueued in bulk: 47 us, 35 us frozen). Only here, in the process of its own: a test
    running mains in-process keeps its collector as it is."""
    gc.freeze()


def app_modules(args: argparse.Namespace) -> list[str]:
    """The worker's ``--app`` modules; none is a usage error."""
    apps = list(args.app or [])
    if not apps:
        raise ConfigurationError("name at least one task module with --app (or BROKER_APP)")
    return apps


def use_app_directory() -> None:
    """Make the operator's modules in the working directory importable.

    Only for what the operator names (``--app``, ``--schedules``, ``--adapter``), and
    last on the path, so a file planted there can never stand in for an installed module.
    """
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def load_apps(modules: Sequence[str], named_by: str = "--app") -> None:
    """Import the operator's task modules (or ``--schedules`` modules) so their ``@task``
    registrations run; one that fails is a :class:`~broker.ops.composition.ImportFailure`."""
    if not modules:
        return
    use_app_directory()
    for name in modules:
        composition.import_named(name, named_by)


async def run_worker(args: argparse.Namespace) -> None:
    # The worker's modules load here, not with this module (``broker-main`` shares it).
    from broker.tasks.registry import default_registry
    from broker.tasks.runner_options import RunnerOptions
    from broker.worker.settings import WorkerSettings
    from broker.worker.state_dir import open_state_dir
    from broker.worker.worker import Worker

    apps = app_modules(args)
    load_apps(apps)
    host, port = peer_arguments(args.main)
    runners = composition.build_runners(
        from_args(RunnerOptions, args, apps=tuple(apps)), default_registry
    )
    if not runners:
        raise ConfigurationError("this worker serves no execution mode; enable at least one runner")
    state = None if args.state_dir is None else open_state_dir(Path(args.state_dir), args.worker_id)
    if state is not None:
        worker_id = state.worker_id
    else:
        worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    logs.bind(worker_id=worker_id)
    worker = Worker(
        host,
        port,
        worker_id=worker_id,
        runners=runners,
        registry=default_registry,
        token=credentials(args).worker,
        tls=peer_tls(args),
        local_state_lost=state is not None and state.fresh,
        **from_args(WorkerSettings, args).keywords(),
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    metrics = None
    if args.metrics_port is not None:
        checks.int_in_range("--metrics-port", int(args.metrics_port), 0, 65535)
        from broker.ops.web import WorkerMetricsServer  # aiohttp: only when it serves HTTP

        metrics = WorkerMetricsServer(worker, host=args.metrics_host, port=int(args.metrics_port))
        try:
            await metrics.start()
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc}"
            ) from None
        logs.announce(
            args.log_format,
            "metrics",
            f"broker-worker metrics on http://{args.metrics_host}:{metrics.port}/metrics",
            host=args.metrics_host,
            port=metrics.port,
        )
    modes = sorted(m.value for m in runners)
    logs.announce(
        args.log_format,
        "serving",
        f"broker-worker {worker_id} serving {modes}",
        modes=modes,
        worker_id=worker_id,
    )
    try:
        await worker.run()
    finally:
        if metrics is not None:
            await metrics.stop()


def run(make: Callable[[], Any], log_format: str = "text") -> int:
    """Run a coroutine; print a failure's chain of causes (as one JSON line under
    ``--log-format json``) and return a non-zero code."""
    try:
        asyncio.run(make())
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Whoever read our output has gone (``broker jobs | head``): end quietly, with the
        # status a shell gives a command killed by SIGPIPE, and never write to it again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (BrokerError, OSError, TimeoutError) as exc:
        causes: list[str] = []
        cause = exc.__cause__
        while cause is not None:
            causes.append(repr(cause))
            cause = cause.__cause__
        lines = [f"error: {escape_control(str(exc))}", *(f"  caused by: {c}" for c in causes)]
        trace = exc.traceback if isinstance(exc, composition.ImportFailure) else None
        if trace is not None:
            # Indented as a log line's traceback is: every line at column 0 is an event.
            lines += ["    " + line for line in trace.splitlines()]
        logs.announce(
            log_format,
            "fatal",
            "\n".join(lines),
            level="ERROR",
            error=f"{type(exc).__name__}: {exc}",
            causes=causes,
            trace=trace,
        )
        return 1
    return 0
