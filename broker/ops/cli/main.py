"""``broker-main``: its flags, built from :class:`~broker.main.settings.MainSettings` and
:class:`~broker.main.retention.Retention`, and the store's own options."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from broker.exceptions import ConfigurationError
from broker.main.retention import Retention
from broker.main.settings import MainSettings
from broker.model import logs
from broker.ops import composition
from broker.ops.cli.options import (
    add_credential_options,
    add_log_options,
    add_rows,
    add_server_tls_options,
    add_version,
    env_list,
    env_option,
    parse,
    positive,
    server_tls,
)
from broker.ops.cli.run import run, run_main, serving
from broker.payload import DEFAULT_OFFLOAD_BYTES
from broker.retry import RetryDelay, parse_backoff
from broker.wire import messages as protocol

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///./broker.db"


def main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="broker-main", description="Run the broker's main process.")
    add_version(p)
    env_option(p, "--database-url", default=DEFAULT_DATABASE_URL, help="job store URL")
    env_option(
        p,
        "--adapter",
        help="custom storage adapter factory, package.module:factory (called with the URL)",
    )
    env_option(
        p,
        "--store-pool-size",
        default=composition.DEFAULT_POOL_SIZE,
        type=positive(int, "store_pool_size"),
        metavar="N",
        help="SQL store connections for listings and operator calls (up to 10 more "
        "under load), and on PostgreSQL up to as many for enqueues",
    )
    env_option(
        p,
        "--store-hot-pool-size",
        default=composition.DEFAULT_HOT_POOL_SIZE,
        type=positive(int, "store_hot_pool_size"),
        metavar="N",
        help="PostgreSQL connections kept for claims, settles and job selection alone",
    )
    env_option(
        p,
        "--offload-threshold",
        default=DEFAULT_OFFLOAD_BYTES,
        type=positive(int, "offload_threshold"),
        help="args, kwargs or a result larger than this many bytes (as JSON) is stored "
        "apart from its job's row, which claims and settles rewrite (built-in stores)",
    )
    add_credential_options(p, list(protocol.Role), "the secret every {role} must prove")
    add_server_tls_options(p)
    add_rows(p, MainSettings)
    add_rows(p, Retention)
    env_option(
        p,
        "--retry-backoff",
        default="schedule",
        type=_backoff,
        metavar="KIND",
        help="wait before a failed job's next run: schedule (10 s, 1 min, 10 min, 1 h, "
        "then hourly), exponential or exponential:BASE:CAP (seconds, doubling, "
        "jittered), fixed:SECONDS (default: %(default)s)",
    )
    env_list(
        p,
        "--schedules",
        metavar="MODULE",
        help="module declaring periodic jobs (@task(cron=...), schedules = [...]); repeatable",
    )
    add_log_options(p)
    return p


def _backoff(text: str) -> RetryDelay:
    try:
        return parse_backoff(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main_entry(argv: Sequence[str] | None = None) -> int:
    args = parse(main_parser(), argv, [server_tls])
    logs.configure(args.log_level, args.log_format)
    return run(lambda: run_main(args, serving), args.log_format)
