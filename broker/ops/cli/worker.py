"""``broker-worker``: its flags, built from :class:`~broker.worker.settings.WorkerSettings`
and :class:`~broker.tasks.runner_options.RunnerOptions`, and the process's own (identity,
state directory, metrics)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from broker.model import logs
from broker.ops import secret_environment
from broker.ops.cli.options import (
    add_credential_options,
    add_log_options,
    add_main_address,
    add_peer_tls_options,
    add_rows,
    add_version,
    check_main_address,
    env_list,
    env_option,
    parse,
    peer_tls,
    typed,
)
from broker.ops.cli.run import app_modules, run, run_worker
from broker.tasks.runner_options import RunnerOptions
from broker.wire import messages as protocol
from broker.worker.settings import WorkerSettings


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="broker-worker", description="Run jobs handed out by a main.")
    add_version(p)
    add_main_address(p)
    env_list(p, "--app", help="module that registers tasks with @task; repeatable")
    env_option(
        p,
        "--worker-id",
        help="stable identity of this worker (default: the one kept in --state-dir, else "
        "host-pid-random)",
    )
    env_option(
        p,
        "--state-dir",
        help="directory this worker keeps its id in across restarts (and its tasks their "
        "local state): a restarted worker keeps its id, so recoveries of local_state jobs "
        "come back to it; one worker per directory",
    )
    add_credential_options(p, [protocol.Role.WORKER], "the {role} secret the main requires")
    add_peer_tls_options(p)
    add_rows(p, RunnerOptions)
    add_rows(p, WorkerSettings)
    env_option(
        p,
        "--metrics-host",
        default="127.0.0.1",
        help="address of this worker's /metrics and /healthz",
    )
    env_option(
        p,
        "--metrics-port",
        type=typed(int, None, "metrics_port"),
        help="port of this worker's /metrics and /healthz (default: none)",
    )
    add_log_options(p)
    return p


def worker_entry(argv: Sequence[str] | None = None) -> int:
    parser = worker_parser()
    args = parse(parser, argv, [app_modules, peer_tls])
    secret_environment.scrub()  # read; task code must not find them (its module's doc)
    check_main_address(parser, args.main)
    logs.configure(args.log_level, args.log_format)
    return run(lambda: run_worker(args), args.log_format)
