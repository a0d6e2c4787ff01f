"""Command-line entry points: ``broker-main``, ``broker-worker`` and ``broker``.

Every option can also come from a ``BROKER_*`` environment variable, named in
``--help``. The ``*_entry`` functions only parse and run; the ``main(argv)`` style
functions return an exit code so tests can call them in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import importlib
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from broker.core.election import DEFAULT_FAILOVER_TIMEOUT
from broker.exceptions import BrokerError, ConfigurationError, DeposedError, InvalidJobError
from broker.jobs import ExecutionMode, JobStatus
from broker.main.main import Main
from broker.main.retention import Retention
from broker.main.settings import DEFAULT_LIST_PAGE_BYTES, MainSettings, line_limit_for
from broker.model import checks, logs
from broker.model.bounds import RUNNER_STARTUP_TIMEOUT
from broker.model.untrusted import escape_control
from broker.ops import admin, composition, secret_environment
from broker.payload import (
    DEFAULT_MAX_CHECKPOINT_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_MAX_PAYLOAD_DEPTH,
    DEFAULT_OFFLOAD_BYTES,
    MAX_PAYLOAD_BYTES_CEILING,
)
from broker.retry import RetryDelay, parse_backoff
from broker.tasks.registry import default_registry
from broker.tasks.schedule import declared_in
from broker.wire import messages as protocol
from broker.wire.addresses import parse_addresses, peer_arguments
from broker.wire.credentials import Credentials, check_private_file, parse_token_file
from broker.wire.tls import PeerTLS, ServerTLS
from broker.worker.state_dir import open_state_dir
from broker.worker.worker import PREFETCH_MAX_PER_SLOT, PREFETCH_PER_SLOT, Worker

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///./broker.db"


@dataclasses.dataclass(frozen=True)
class _BadEnvironment:
    """An option's default from a ``BROKER_*`` variable that does not parse; reported by
    :func:`parse` with the variable's name (only if the flag itself is not given)."""

    variable: str
    text: str
    problem: str


class _EnvDefault(argparse.Action):
    """Takes its default from an environment variable and says so in ``--help``."""

    def __init__(self, envvar: str, required: bool = False, default: Any = None, **kw: Any):
        if envvar in os.environ:
            default = _from_environment(envvar, os.environ[envvar], kw.get("type"))
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


def _from_environment(variable: str, text: str, kind: Callable[[str], Any] | None) -> Any:
    """The variable's value, converted now, so a bad one is reported by its own name
    rather than as the flag it stands in for."""
    if kind is None:
        return text
    try:
        return kind(text)
    except argparse.ArgumentTypeError as exc:
        return _BadEnvironment(variable, text, str(exc))
    except (TypeError, ValueError):
        name = getattr(kind, "__name__", "value")
        return _BadEnvironment(
            variable, text, f"expected {'a whole number' if kind is int else 'a ' + name}"
        )


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, with a bad ``BROKER_*`` variable named as such (exit 2)."""
    args = parser.parse_args(argv)
    for value in vars(args).values():
        if isinstance(value, _BadEnvironment):
            parser.error(
                f"environment variable {value.variable}={value.text!r} is not valid: "
                f"{value.problem}"
            )
    return args


def _env_option(parser: argparse.ArgumentParser, flag: str, **options: Any) -> None:
    """An option whose default comes from ``BROKER_<FLAG>`` (named in ``--help``)."""
    envvar = "BROKER_" + flag.removeprefix("--").replace("-", "_").upper()
    parser.add_argument(flag, action=_EnvDefault, envvar=envvar, **options)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _backoff(text: str) -> RetryDelay:
    try:
        return parse_backoff(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def _add_log_options(p: argparse.ArgumentParser, *, level: bool = True) -> None:
    if level:
        _env_option(p, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    _env_option(
        p,
        "--log-format",
        default="text",
        type=_log_format,
        help="text (one line per event, tracebacks indented) or json (one object per line)",
    )


def _log_format(text: str) -> str:
    if text not in logs.FORMATS:
        raise argparse.ArgumentTypeError(f"expected {' or '.join(logs.FORMATS)} (got {text!r})")
    return text


def _duration(text: str) -> float:
    """Seconds, written as a number of seconds or with a unit: ``30s``, ``15m``, ``12h``, ``7d``."""
    number, unit = text.strip(), 1.0
    if number[-1:].lower() in _UNITS:
        number, unit = number[:-1], _UNITS[number[-1].lower()]
    try:
        value = float(number) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a duration such as 90, 30s, 15m, 12h or 7d (got {text!r})"
        ) from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"a duration must be 0 or more (got {text!r})")
    return value


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


# ------------------------------------------------------------------------ credentials, TLS


def _add_credential_options(
    p: argparse.ArgumentParser, roles: Sequence[protocol.Role], text: str
) -> None:
    """``--token`` (every role's), ``--<role>-token`` for each of ``roles`` and
    ``--token-file``; each also from its ``BROKER_*`` variable, so no secret ever needs
    to be on a command line (where ``ps`` shows it)."""
    _env_option(p, "--token", help="the shared secret, for every role without its own")
    for role in roles:
        _env_option(p, f"--{role}-token", help=text.format(role=role))
    _env_option(
        p,
        "--token-file",
        metavar="PATH",
        help="a file of role=secret lines (worker, client, operator, or all)",
    )


def _credentials(args: argparse.Namespace) -> Credentials:
    """The secrets from the flags, their variables and the token file (see
    :meth:`broker.wire.credentials.Credentials.combine` for which wins)."""
    lines: dict[str, str] | None = None
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as file:
                check_private_file(
                    os.fstat(file.fileno()).st_mode, f"--token-file {args.token_file}"
                )
                text = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"cannot read --token-file {args.token_file}: {exc}") from None
        lines = parse_token_file(text, f"--token-file {args.token_file}")
    return Credentials.combine(
        shared=args.token or None,
        worker=getattr(args, "worker_token", None) or None,
        client=getattr(args, "client_token", None) or None,
        operator=getattr(args, "operator_token", None) or None,
        file=lines,
    )


def _operator_credential(credentials: Credentials) -> tuple[protocol.Role, str | None]:
    """The role the operator's command says hello as, and its secret.

    With an operator secret of its own, as an operator. Otherwise as a client: with a
    client secret its reads and enqueue still work; with one shared token, or none, a
    client has every right (:meth:`Credentials.rights`), and a main older than the
    operator role still understands the hello."""
    if credentials.operator and credentials.operator != credentials.client:
        return protocol.Role.OPERATOR, credentials.operator
    return protocol.Role.CLIENT, credentials.client


def _add_peer_tls_options(p: argparse.ArgumentParser) -> None:
    _env_option(
        p,
        "--tls-ca",
        metavar="PEM",
        help="connect over TLS, trusting this CA for the main's certificate (its host name "
        "is checked too)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        default=_env_flag("BROKER_TLS"),
        help="connect over TLS, trusting the system's CAs (implied by --tls-ca) [env BROKER_TLS]",
    )
    _env_option(p, "--tls-client-cert", metavar="PEM", help="mutual TLS: this peer's certificate")
    _env_option(p, "--tls-client-key", metavar="PEM", help="the private key of --tls-client-cert")


def _peer_tls(args: argparse.Namespace) -> PeerTLS | None:
    if not (args.tls or args.tls_ca or args.tls_client_cert or args.tls_client_key):
        return None
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise ConfigurationError("--tls-client-cert and --tls-client-key go together")
    return PeerTLS(
        ca=args.tls_ca or None,
        client_cert=args.tls_client_cert or None,
        client_key=args.tls_client_key or None,
    )


def _server_tls(args: argparse.Namespace) -> ServerTLS | None:
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise ConfigurationError(
            "--tls-cert and --tls-key go together (--tls-client-ca needs both as well)"
        )
    return ServerTLS(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca or None)


# ------------------------------------------------------------------------ broker-main


def _ttl(seconds: float) -> timedelta | None:
    """A retention age; 0 keeps that class of jobs forever."""
    return timedelta(seconds=seconds) if seconds > 0 else None


_RETENTION_OPTIONS: list[tuple[str, Any, Callable[[str], Any], str, str]] = [
    (
        "--retention-completed",
        7 * 86400.0,
        _duration,
        "DURATION",
        "delete completed and cancelled jobs this long after they finished "
        "(seconds, or 30s, 15m, 12h, 7d; 0: keep forever)",
    ),
    (
        "--retention-dead",
        30 * 86400.0,
        _duration,
        "DURATION",
        "delete failed (dead) jobs this long after they died (0: keep forever)",
    ),
    (
        "--retention-max-rows",
        None,
        _number(int, "retention max rows"),
        "N",
        "keep at most the newest N finished jobs, whatever their age (default: no cap)",
    ),
    (
        "--retention-interval",
        60.0,
        _number(float, "retention interval"),
        "SECONDS",
        "seconds between retention passes",
    ),
]


_LIMIT_OPTIONS: list[tuple[str, str]] = [
    (
        "--max-outbox-bytes",
        "bytes queued for one peer before the main stops reading from it; a peer over it "
        "for the liveness timeout is disconnected",
    ),
    (
        "--max-requests-per-connection",
        "client requests one connection may have in progress (then the main stops reading it)",
    ),
    ("--max-requests", "client requests in progress across all connections"),
    (
        "--max-request-bytes-per-connection",
        "bytes of one connection's client requests in progress (then the main stops reading it)",
    ),
    (
        "--max-request-bytes",
        "bytes of all client requests in progress (then the main stops reading clients)",
    ),
    (
        "--max-payload-containers",
        "lists and objects ('[' and '{') one message may hold, so one payload, result or "
        "checkpoint too; counted before the message is decoded",
    ),
    ("--max-connections", "connections in all; more are refused"),
    ("--max-connections-per-address", "connections from one IP address; more are refused"),
    ("--max-unauthenticated", "connections still in the handshake; more are refused"),
    (
        "--max-unauthenticated-per-address",
        "connections from one IP address still in the handshake; more are refused",
    ),
    ("--max-credit", "free slots a worker may announce per mode; a larger ready is refused"),
]
"""Resource limits of the main: each flag sets the ``MainSettings`` field of the same name."""


def main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="broker-main", description="Run the broker's main process.")
    _env_option(
        p,
        "--database-url",
        default=DEFAULT_DATABASE_URL,
        help="job store URL",
    )
    _env_option(
        p,
        "--adapter",
        help="custom storage adapter factory, package.module:factory (called with the URL)",
    )
    _env_option(
        p,
        "--store-pool-size",
        default=composition.DEFAULT_POOL_SIZE,
        type=_number(int, "store pool size"),
        metavar="N",
        help="SQL store connections for listings and operator calls (up to 10 more "
        "under load), and on PostgreSQL up to as many for enqueues",
    )
    _env_option(
        p,
        "--store-hot-pool-size",
        default=composition.DEFAULT_HOT_POOL_SIZE,
        type=_number(int, "store hot pool size"),
        metavar="N",
        help="PostgreSQL connections kept for claims, settles and job selection alone",
    )
    _env_option(
        p,
        "--host",
        default="127.0.0.1",
        help="address to listen on",
    )
    _env_option(
        p,
        "--port",
        default=protocol.DEFAULT_PORT,
        type=int,
        help="port to listen on",
    )
    _add_credential_options(p, list(protocol.Role), "the secret every {role} must prove")
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=_env_flag("BROKER_ALLOW_UNAUTHENTICATED"),
        help="listen on a non-loopback address without credentials (the main's port only; "
        "see --http-allow-unauthenticated) [env BROKER_ALLOW_UNAUTHENTICATED]",
    )
    _env_option(p, "--tls-cert", metavar="PEM", help="serve TLS with this certificate (chain)")
    _env_option(p, "--tls-key", metavar="PEM", help="the private key of --tls-cert")
    _env_option(
        p,
        "--tls-client-ca",
        metavar="PEM",
        help="mutual TLS: refuse every peer without a client certificate this CA signed",
    )
    _env_option(
        p,
        "--orphan-grace",
        default=30.0,
        type=float,
        help="seconds a restarted (or stalled) main waits for workers to reclaim their leases",
    )
    _env_option(
        p,
        "--max-recoveries",
        default=MainSettings.max_recoveries,
        type=int,
        help="lost attempts (worker, child or connection died) a job recovers from, unless "
        "its task sets max_recoveries; the next one ends it dead",
    )
    _env_option(
        p,
        "--affinity-grace",
        default=MainSettings.affinity_grace,
        type=float,
        help="seconds a local_state job's recovery waits for the worker holding its state "
        "after that worker left",
    )
    _env_option(
        p,
        "--task-grace",
        default=MainSettings.task_grace,
        type=float,
        help="seconds the task catalog keeps the declarations of a worker no longer "
        "connected (default: 7 days)",
    )
    _env_option(
        p,
        "--failover-timeout",
        default=DEFAULT_FAILOVER_TIMEOUT,
        type=_number(float, "failover timeout"),
        help="several mains on one PostgreSQL store: seconds, at most, from the leader's "
        "death to a standby dispatching (the leader's lease is 60%% of it)",
    )
    _env_option(
        p,
        "--advertise",
        metavar="HOST:PORT",
        help="where peers reach this main, as standbys name it to them once it leads "
        "(default: the listen address and port; this host's name for 0.0.0.0)",
    )
    _env_option(
        p,
        "--ping-interval",
        default=5.0,
        type=_number(float, "ping interval"),
        help="seconds between pings",
    )
    _env_option(
        p,
        "--liveness-timeout",
        default=15.0,
        type=_number(float, "liveness timeout"),
        help="seconds of silence after which a peer is treated as gone",
    )
    _env_option(
        p,
        "--max-line-bytes",
        type=_number(int, "max line bytes"),
        help="largest protocol message accepted after the handshake "
        "(default: the payload limit plus the checkpoint limit plus 1 MiB, at least 2 MiB, "
        "at most 33 MiB)",
    )
    _env_option(
        p,
        "--max-payload-bytes",
        default=DEFAULT_MAX_PAYLOAD_BYTES,
        type=_number(int, "max payload bytes"),
        help="largest args+kwargs of a job, and largest result, as JSON "
        f"(at most {MAX_PAYLOAD_BYTES_CEILING})",
    )
    _env_option(
        p,
        "--offload-threshold",
        default=DEFAULT_OFFLOAD_BYTES,
        type=_number(int, "offload threshold"),
        help="args, kwargs or a result larger than this many bytes (as JSON) is stored "
        "apart from its job's row, which claims and settles rewrite (built-in stores)",
    )
    _env_option(
        p,
        "--max-checkpoint-bytes",
        default=DEFAULT_MAX_CHECKPOINT_BYTES,
        type=_number(int, "max checkpoint bytes"),
        help="largest checkpoint a task may save, as JSON (docs/howto/long-jobs.md)",
    )
    _env_option(
        p,
        "--list-page-bytes",
        default=DEFAULT_LIST_PAGE_BYTES,
        type=_number(int, "list page bytes"),
        help="about how many bytes of jobs one page of a job listing may carry",
    )
    _env_option(
        p,
        "--max-payload-depth",
        default=DEFAULT_MAX_PAYLOAD_DEPTH,
        type=_number(int, "max payload depth"),
        help="how many lists and objects deep each argument and each result may nest",
    )
    for flag, default, kind, metavar, text in _RETENTION_OPTIONS:
        _env_option(p, flag, default=default, type=kind, metavar=metavar, help=text)
    defaults = MainSettings()
    for flag, text in _LIMIT_OPTIONS:
        name = _setting_name(flag)
        _env_option(
            p,
            flag,
            default=getattr(defaults, name),
            type=_number(int, name.replace("_", " ")),
            metavar="N",
            help=f"{text} (default: %(default)s)",
        )
    _env_option(
        p,
        "--retry-backoff",
        default="schedule",
        type=_backoff,
        metavar="KIND",
        help="wait before a failed job's next run: schedule (10 s, 1 min, 10 min, 1 h, "
        "then hourly), exponential or exponential:BASE:CAP (seconds, doubling, "
        "jittered), fixed:SECONDS (default: %(default)s)",
    )
    p.add_argument(
        "--schedules",
        action="append",
        default=None,
        metavar="MODULE",
        help="module declaring periodic jobs (@task(cron=...), schedules = [...]); "
        "repeatable [env BROKER_SCHEDULES, comma-separated]",
    )
    _env_option(
        p,
        "--http-host",
        default="127.0.0.1",
        help="address of the web dashboard, /metrics and /healthz",
    )
    _env_option(
        p,
        "--http-port",
        type=int,
        help="port of the web dashboard, /metrics and /healthz (default: none, no HTTP)",
    )
    _env_option(
        p,
        "--http-allowed-hosts",
        default="",
        metavar="NAMES",
        help="comma-separated Host names the dashboard answers to besides loopback names "
        "and --http-host (any other Host is refused: DNS rebinding)",
    )
    _env_option(
        p,
        "--http-read-token",
        help="the secret every dashboard read and /metrics needs (a bearer token or a "
        "Basic password; the operator secret reads too); default: none",
    )
    p.add_argument(
        "--http-allow-unauthenticated",
        action="store_true",
        default=_env_flag("BROKER_HTTP_ALLOW_UNAUTHENTICATED"),
        help="serve the dashboard off loopback with no --http-read-token; the main's port "
        "keeps its own rule [env BROKER_HTTP_ALLOW_UNAUTHENTICATED]",
    )
    _add_log_options(p)
    return p


def _setting_name(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


async def run_main(args: argparse.Namespace, ready: Callable[[Main], None] | None = None) -> None:
    modules = list(args.schedules or [])
    if not modules and os.environ.get("BROKER_SCHEDULES"):
        modules = [m.strip() for m in os.environ["BROKER_SCHEDULES"].split(",") if m.strip()]
    load_apps(modules)
    schedules = declared_in(modules)
    limits: dict[str, Any] = {
        _setting_name(flag): int(getattr(args, _setting_name(flag))) for flag, _ in _LIMIT_OPTIONS
    }
    credentials = _credentials(args)
    settings = MainSettings(
        host=args.host,
        port=int(args.port),
        worker_token=credentials.worker,
        client_token=credentials.client,
        operator_token=credentials.operator,
        tls=_server_tls(args),
        allow_unauthenticated=args.allow_unauthenticated,
        orphan_grace=float(args.orphan_grace),
        max_recoveries=int(args.max_recoveries),
        affinity_grace=float(args.affinity_grace),
        task_grace=float(args.task_grace),
        failover_timeout=float(args.failover_timeout),
        advertise=args.advertise or None,
        ping_interval=float(args.ping_interval),
        liveness_timeout=float(args.liveness_timeout),
        max_payload_bytes=int(args.max_payload_bytes),
        max_checkpoint_bytes=int(args.max_checkpoint_bytes),
        max_payload_depth=int(args.max_payload_depth),
        max_line_bytes=int(
            args.max_line_bytes
            or line_limit_for(int(args.max_payload_bytes), int(args.max_checkpoint_bytes))
        ),
        list_page_bytes=int(args.list_page_bytes),
        http_host=args.http_host,
        http_port=None if args.http_port is None else int(args.http_port),
        http_allowed_hosts=tuple(
            name.strip() for name in str(args.http_allowed_hosts).split(",") if name.strip()
        ),
        http_read_token=args.http_read_token or None,
        http_allow_unauthenticated=args.http_allow_unauthenticated,
        **limits,
    )
    retention = Retention(
        completed_ttl=_ttl(args.retention_completed),
        dead_ttl=_ttl(args.retention_dead),
        max_terminal_rows=args.retention_max_rows,
        interval=float(args.retention_interval),
    )
    if args.adapter:
        use_app_directory()
    settings.validate()  # before the store is opened (a SQLite main takes its lock)
    store = composition.open_store(
        args.database_url,
        args.adapter,
        pool_size=int(args.store_pool_size),
        hot_pool_size=int(args.store_hot_pool_size),
        single_main=True,
        offload_threshold=int(args.offload_threshold),
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


def main_entry(argv: Sequence[str] | None = None) -> int:
    args = parse(main_parser(), argv)
    logs.configure(args.log_level, args.log_format)
    return _run(lambda: run_main(args, _serving), args.log_format)


def _serving(main: Main) -> None:
    """The ``broker-main`` process is up. What it holds now (modules, the schema, compiled
    statements) lives as long as it does, so the cyclic garbage collector stops walking
    it (``gc.freeze``): its full collections, which a bulk enqueue's thousands of new
    objects set off, walked all of it every time (a quarter of the main's CPU per job
    enqueued in bulk: 47 us, 35 us frozen). Only here, in the process of its own: a test
    running mains in-process keeps its collector as it is."""
    gc.freeze()


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
        None,
        "recycle a pooled child after this many jobs (default: never; the memory and "
        "age limits still apply)",
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
        RUNNER_STARTUP_TIMEOUT,
        "seconds a child may take to import the app and say ready",
    ),
]


def _add_main_address(p: argparse.ArgumentParser) -> None:
    _env_option(
        p,
        "--main",
        default=f"127.0.0.1:{protocol.DEFAULT_PORT}",
        help="the main's HOST:PORT, or every main's, comma-separated (HOST:PORT,HOST:PORT): "
        "a standby names the elected one, and a lost connection tries the next",
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
    _env_option(
        p,
        "--worker-id",
        help="stable identity of this worker (default: the one kept in --state-dir, else "
        "host-pid-random)",
    )
    _env_option(
        p,
        "--state-dir",
        help="directory this worker keeps its id in across restarts (and its tasks their "
        "local state): a restarted worker keeps its id, so recoveries of local_state jobs "
        "come back to it; one worker per directory",
    )
    _add_credential_options(p, [protocol.Role.WORKER], "the {role} secret the main requires")
    _add_peer_tls_options(p)
    _env_option(
        p,
        "--queues",
        help="comma-separated queues to serve (default: all)",
    )
    for flag, kind, default, text in _RUNNER_OPTIONS:
        _env_option(p, flag, default=default, type=kind, help=text)
    _env_option(
        p,
        "--metrics-host",
        default="127.0.0.1",
        help="address of this worker's /metrics and /healthz",
    )
    _env_option(
        p,
        "--metrics-port",
        type=int,
        help="port of this worker's /metrics and /healthz (default: none)",
    )
    _env_option(
        p,
        "--drain-timeout",
        type=_number(float, "drain timeout"),
        help="seconds running jobs get to finish on SIGTERM (default: wait)",
    )
    _env_option(
        p,
        "--reconnect-max-delay",
        default=10.0,
        type=_number(float, "reconnect max delay"),
        help="seconds, at most, between attempts to reach the main after the connection "
        "is lost (the wait doubles from 0.1 s up to this)",
    )
    _env_option(
        p,
        "--prefetch",
        type=_count,
        help="jobs per mode held beyond the free slots, so a finished job's slot is "
        "refilled at once; their leases go back if the connection drops "
        f"(default: {PREFETCH_PER_SLOT} per slot of the mode, growing up to "
        f"{PREFETCH_MAX_PER_SLOT} per slot for jobs shorter than 10 ms; 0: none)",
    )
    _add_log_options(p)
    return p


def _app_modules(args: argparse.Namespace) -> list[str]:
    apps = list(args.app or [])
    if not apps and os.environ.get("BROKER_APP"):
        apps = [a.strip() for a in os.environ["BROKER_APP"].split(",") if a.strip()]
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


def load_apps(modules: Sequence[str]) -> None:
    """Import the operator's task modules so their ``@task`` registrations run."""
    if not modules:
        return
    use_app_directory()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise ConfigurationError(f"cannot import task module {name!r}: {exc!r}") from exc


async def run_worker(args: argparse.Namespace) -> None:
    apps = _app_modules(args)
    load_apps(apps)
    host, port = peer_arguments(args.main)
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
    state = None if args.state_dir is None else open_state_dir(Path(args.state_dir), args.worker_id)
    if state is not None:
        worker_id = state.worker_id
    else:
        worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    logs.bind(worker_id=worker_id)
    queues = [q.strip() for q in args.queues.split(",") if q.strip()] if args.queues else None
    worker = Worker(
        host,
        port,
        worker_id=worker_id,
        runners=runners,
        registry=default_registry,
        token=_credentials(args).worker,
        tls=_peer_tls(args),
        queues=queues,
        drain_timeout=float(args.drain_timeout) if args.drain_timeout else None,
        prefetch=args.prefetch,
        reconnect_max_delay=float(args.reconnect_max_delay),
        local_state_lost=state is not None and state.fresh,
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


def worker_entry(argv: Sequence[str] | None = None) -> int:
    parser = worker_parser()
    args = parse(parser, argv)
    secret_environment.scrub()  # read; task code must not find them (its module's doc)
    _check_main_address(parser, args.main)
    logs.configure(args.log_level, args.log_format)
    return _run(lambda: run_worker(args), args.log_format)


# ------------------------------------------------------------------------ broker (operator)


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


def _page_size(text: str) -> int:
    value = _count(text)
    if not 1 <= value <= protocol.MAX_LIST_LIMIT:
        raise argparse.ArgumentTypeError(
            f"must be 1-{protocol.MAX_LIST_LIMIT} (got {text!r}); use --all to follow pages"
        )
    return value


def broker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="broker",
        description="Operate the broker: status, top, jobs, job, retry, cancel, enqueue, tasks, "
        "prune, migrate. Talks to the main; when the main cannot be reached and --database-url is "
        "set, works on the store directly (never creating or migrating its schema).",
    )
    _add_main_address(p)
    _add_credential_options(
        p,
        [protocol.Role.OPERATOR, protocol.Role.CLIENT],
        "the {role} secret the main requires",
    )
    _add_peer_tls_options(p)
    _env_option(
        p,
        "--database-url",
        help="job store URL, used only when the main cannot be reached, and by migrate "
        "(default: none)",
    )
    _env_option(
        p,
        "--adapter",
        help="custom storage adapter factory for --database-url, package.module:factory",
    )
    _env_option(
        p,
        "--timeout",
        default=10.0,
        type=_number(float, "timeout"),
        help="seconds to wait for the main to connect and to answer",
    )
    _add_log_options(p, level=False)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("--json", action="store_true", help="print JSON (docs/reference/cli.md)")
        return cmd

    command("status", "job counts per queue, workers and pending recoveries")
    top = sub.add_parser(
        "top",
        help="a live view of queues, rates and workers",
        description="Queues, throughput and workers, redrawn in place every --interval "
        "seconds until Ctrl-C; one plain frame after another when the output is not a terminal.",
    )
    top.add_argument(
        "--interval", type=_number(float, "interval"), default=2.0, help="seconds between frames"
    )
    top.add_argument(
        "--count", type=_number(int, "count"), default=None, help="stop after this many frames"
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
    jobs.add_argument("--limit", type=_page_size, default=50, help="jobs per page (default 50)")
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
    enq = command("enqueue", "enqueue a job and print its id")
    enq.add_argument("task", help="registered task name, e.g. app.tasks.send_email")
    enq.add_argument("args_json", nargs="?", default="[]", help="positional args as a JSON list")
    enq.add_argument("--kwargs", default="{}", help="keyword args as a JSON object")
    enq.add_argument("--queue", default=None)
    enq.add_argument("--priority", type=int, default=None, help="higher runs first")
    enq.add_argument(
        "--delay",
        type=_duration,
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
        type=_count,
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
        type=_duration,
        default=None,
        metavar="DURATION",
        help="delete finished jobs last updated longer ago than this: seconds, or 30s, "
        "15m, 12h, 7d",
    )
    prune.add_argument(
        "--keep-latest",
        type=_count,
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
    command(
        "migrate",
        "create the schema of the store at --database-url, or migrate it to this version "
        "(what broker-main does when it starts); stop an older main first",
    )
    return p


async def run_broker(args: argparse.Namespace) -> int:
    if args.adapter:
        use_app_directory()
    if args.command == "migrate":
        return await admin.migrate(args.database_url or None, args.adapter or None, args.json)
    host, port = peer_arguments(args.main)
    role, secret = _operator_credential(_credentials(args))
    backend = await admin.open_backend(
        host,
        port,
        token=secret,
        role=role,
        tls=_peer_tls(args),
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


def _check_main_address(parser: argparse.ArgumentParser, text: str) -> None:
    try:
        parse_addresses(text)
    except ConfigurationError as exc:
        parser.error(f"--main: {exc}")


def broker_entry(argv: Sequence[str] | None = None) -> int:
    parser = broker_parser()
    args = parse(parser, argv)
    if args.command == "prune" and args.older_than is None and args.keep_latest is None:
        parser.error("prune needs --older-than DURATION, --keep-latest N, or both")
    if args.command == "migrate" and not args.database_url:
        parser.error("migrate needs --database-url (or BROKER_DATABASE_URL)")
    _check_main_address(parser, args.main)
    if args.command == "enqueue":
        # Checked before anything connects: a bad request is a usage error (exit 2).
        try:
            args.request = admin.enqueue_request(args)
        except (ConfigurationError, InvalidJobError) as exc:
            parser.error(str(exc))
    logs.configure("WARNING", args.log_format)
    result: list[int] = []

    async def go() -> None:
        result.append(await run_broker(args))

    code = _run(go, args.log_format)
    return result[0] if code == 0 and result else code


def _run(make: Callable[[], Any], log_format: str = "text") -> int:
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
        text = "\n".join(
            [f"error: {escape_control(str(exc))}", *(f"  caused by: {c}" for c in causes)]
        )
        logs.announce(
            log_format,
            "fatal",
            text,
            level="ERROR",
            error=f"{type(exc).__name__}: {exc}",
            causes=causes,
        )
        return 1
    return 0


if __name__ == "__main__":  # the working directory is off the path (``broker/__init__``)
    _commands = {"main": main_entry, "worker": worker_entry, "broker": broker_entry}
    if len(sys.argv) < 2 or sys.argv[1] not in _commands:
        print(
            f"usage: python -m broker.ops.cli {{{','.join(_commands)}}} [options]", file=sys.stderr
        )
        raise SystemExit(2)
    raise SystemExit(_commands[sys.argv[1]](sys.argv[2:]))
