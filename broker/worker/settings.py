"""The worker's settings, once: each tunable's default, flag and rule (the table
``broker-worker``'s flags and ``BROKER_*`` variables are built from; see
:mod:`broker.model.setting`).

:class:`~broker.worker.worker.Worker` takes these as keyword arguments whose defaults are
read from here, and checks them through :meth:`WorkerSettings.validate`, so the keyword
constructor and the command line cannot drift apart. The runners' settings are
:class:`broker.tasks.runner_options.RunnerOptions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from broker.core.window import LINE_WINDOW, SHORT_RUN, WIDE_LINE_WINDOW
from broker.exceptions import ConfigurationError
from broker.model import checks
from broker.model.bounds import LIVENESS_TIMEOUT, PING_INTERVAL
from broker.model.setting import check_rows, comma_list, setting

PREFETCH_PER_SLOT = 2
"""Unless told otherwise, a worker's window for a mode starts at two jobs per slot and
grows with the jobs' pace (:class:`~broker.core.worker_state.AdaptiveWindow`) up to
:data:`PREFETCH_MAX_PER_SLOT` per slot. The window has to cover what a slot waits for its
next job (a ``ready``, a claim committed on the store, the job's trip back), during which
a slot can finish many short jobs. Draining 10,000 no-op jobs through 2 pooled children x
10 on PostgreSQL (one run each, the machine nearly quiet): a window of 1, 2,407 jobs/s;
one per slot (20), 3,187 to 3,355; two per slot (40), 4,173; five per slot (100), 4,711.
A window costs fairness (a prefetched job waits behind this worker's long jobs while
another worker may idle), so it grows only for jobs short enough to need it (see
:data:`~broker.core.worker_state.PREFETCH_REFILL`); ``--prefetch N`` fixes it at N (0: none,
for long jobs)."""

PREFETCH_MAX_PER_SLOT = 8
"""The most an adaptive window grows to, per slot (reached by jobs of 2.5 ms or less), but
never less than :data:`~broker.core.window.WIDE_LINE_WINDOW` per mode
(:func:`~broker.core.window.line_cap`).
Draining 5,000 no-op jobs through 2 pooled children x 10 on PostgreSQL, alternated runs:
five per slot against two, 4,719 -> 5,557 jobs/s (four pairs, the machine busy with a
test suite); eight against five, 8,423 -> 9,082 (four pairs, quiet), and the main's and
the store's CPU per job fell with the larger batches; twelve against eight, no difference
beyond the run-to-run spread (four pairs)."""


def _queues(text: str) -> tuple[str, ...] | None:
    """``--queues a,b``; an empty list serves every queue."""
    return comma_list(text) or None


@dataclass(frozen=True)
class WorkerSettings:
    """How a worker talks to the main and takes jobs."""

    queues: Sequence[str] | None = setting(
        None, parse=_queues, help="comma-separated queues to serve (default: all)"
    )
    """Serve only these queues (``None``: every queue)."""
    ping_interval: float = setting(
        PING_INTERVAL,
        parse=float,
        check=checks.positive,
        help="seconds between this worker's pings to the main (the main's own interval "
        "when that is shorter)",
    )
    liveness_timeout: float = setting(
        LIVENESS_TIMEOUT,
        parse=float,
        check=checks.positive,
        help="seconds without a message from the main (or with a send stuck) after which "
        "this worker gives the connection up and reconnects, keeping its jobs running",
    )
    """How long the main may be silent before this worker gives its socket up: a main
    frozen longer than this (SIGSTOP, a dead host) is left, and its jobs' leases are listed
    again at the next ``hello``. Shorter notices a frozen main sooner, at the cost of giving
    up on one that was only slow."""
    reconnect_max_delay: float = setting(
        10.0,
        parse=float,
        check=checks.positive,
        help="seconds, at most, between attempts to reach the main after the connection "
        "is lost (the wait doubles from 0.1 s up to this)",
    )
    drain_timeout: float | None = setting(
        None,
        parse=float,
        check=checks.non_negative,
        help="seconds running jobs get to finish on SIGTERM (default: wait)",
    )
    """How long a graceful stop waits for running jobs before cancelling them (``None``: as
    long as they take)."""
    prefetch: int | None = setting(
        None,
        parse=int,
        check=checks.non_negative_int,
        help="jobs per mode held beyond the free slots, so a finished job's slot is "
        "refilled at once; their leases go back if the connection drops "
        f"(default: {PREFETCH_PER_SLOT} per slot of the mode, growing up to "
        f"{PREFETCH_MAX_PER_SLOT} per slot for jobs shorter than 10 ms, and to at least "
        f"{LINE_WINDOW} per mode for jobs shorter than {SHORT_RUN * 1000:g} ms, "
        f"{WIDE_LINE_WINDOW} shorter than {SHORT_RUN * 500:g} ms; 0: none)",
    )
    """Jobs per mode held beyond the free slots (``None``: sized to the jobs' pace; see
    :data:`PREFETCH_PER_SLOT`)."""

    def validate(self) -> None:
        check_rows(self)
        if self.queues is not None and (not self.queues or not all(self.queues)):
            raise ConfigurationError("queues must name at least one queue (None serves all)")
        checks.require(
            self.liveness_timeout > self.ping_interval,
            "liveness_timeout must be longer than ping_interval",
        )

    def keywords(self) -> dict[str, Any]:
        """The fields as :class:`~broker.worker.worker.Worker`'s keyword arguments."""
        return {field.name: getattr(self, field.name) for field in fields(self)}
