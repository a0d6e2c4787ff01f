"""The runners' settings, once: what a worker runs and how (``--inline-concurrency`` and the
rest of ``broker-worker``'s runner flags).

Here, beside the runner contract, because both sides read it: the composition root builds
the runners from it (:func:`broker.ops.composition.build_runners`), the command line builds
its flags from it (:mod:`broker.model.setting`), and each runner takes its own defaults
from it, so no default is written twice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from broker.model import checks
from broker.model.bounds import RUNNER_STARTUP_TIMEOUT
from broker.model.setting import check_rows, setting


def _cpu_count() -> int:
    return os.cpu_count() or 1


@dataclass(frozen=True)
class RunnerOptions:
    """What a worker runs and how; zero for a mode's count turns that mode off."""

    apps: tuple[str, ...] = ()
    """The task modules each child imports (``--app``)."""
    inline_concurrency: int = setting(
        4,
        parse=int,
        check=checks.non_negative_int,
        help="inline jobs run at once on the worker's loop (0: off)",
    )
    pooled_runner_count: int = setting(
        default_factory=_cpu_count,
        parse=int,
        check=checks.non_negative_int,
        help="warm child processes for pooled jobs (0: off; default: CPU count)",
    )
    pooled_runner_concurrency: int = setting(
        1,
        parse=int,
        check=checks.positive_int,
        help="jobs each pooled child runs at once on its own event loop",
    )
    pooled_max_jobs: int | None = setting(
        None,
        parse=int,
        check=checks.positive_int,
        help="recycle a pooled child after this many jobs (default: never; the memory and "
        "age limits still apply)",
    )
    pooled_max_rss_bytes: int = setting(
        512 << 20,
        parse=int,
        check=checks.positive_int,
        help="recycle a pooled child whose memory exceeds this many bytes",
    )
    pooled_max_lifetime: float = setting(
        3600.0,
        parse=float,
        check=checks.positive,
        help="recycle a pooled child after this many seconds",
    )
    forked_concurrency: int = setting(
        2,
        parse=int,
        check=checks.non_negative_int,
        help="forked jobs (a fresh process each) at once (0: off)",
    )
    default_timeout: float | None = setting(
        None,
        flag="--job-timeout",
        parse=float,
        check=checks.positive,
        help="default seconds a job may run (job and task options win)",
    )
    kill_grace: float = setting(
        5.0,
        parse=float,
        check=checks.positive,
        help="seconds between SIGTERM and SIGKILL when a child must stop",
    )
    startup_timeout: float = setting(
        RUNNER_STARTUP_TIMEOUT,
        flag="--runner-startup-timeout",
        parse=float,
        check=checks.positive,
        help="seconds a child may take to import the app, run its start-up hooks and say ready",
    )

    def validate(self) -> None:
        check_rows(self)
