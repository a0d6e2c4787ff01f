"""Retention: finished jobs are deleted after a while, so the job table stays bounded.

The main runs :func:`run_retention` in the background (``Main(retention=...)``, the
``--retention-*`` flags). Every ``interval`` seconds it asks the store to prune:

* ``completed`` and ``cancelled`` jobs last updated more than ``completed_ttl`` ago;
* ``failed`` (dead) jobs last updated more than ``dead_ttl`` ago, kept longer so an
  operator can still inspect and retry them;
* with ``max_terminal_rows``, every finished job beyond the newest N, whatever its
  age: a hard cap for bursts that outrun the TTLs.

Queued and handed-off jobs are never touched: :meth:`StorageAdapter.prune` deletes
terminal jobs only, re-checked row by row. Deletes go in batches of ``batch_size``,
each its own short transaction. A store error is logged and the next pass tries
again. Note that an idempotency key is free again once its job has been pruned.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from broker.jobs import Clock, JobStatus, utcnow
from broker.main.loops import retrying
from broker.model import checks
from broker.model.logs import log_event
from broker.model.setting import age, check_rows, setting
from broker.storage import StorageAdapter

logger = logging.getLogger("broker.retention")

FINISHED = frozenset({JobStatus.COMPLETED, JobStatus.CANCELLED})
DEAD = frozenset({JobStatus.FAILED})


@dataclass(frozen=True, slots=True)
class Retention:
    """How long finished jobs are kept. ``None`` for a TTL keeps that class forever.

    Each field's default, flag and rule are written here once (:mod:`broker.model.setting`);
    ``broker-main``'s ``--retention-*`` flags are built from them."""

    completed_ttl: timedelta | None = setting(
        timedelta(days=7),
        flag="--retention-completed",
        parse=age,
        check=checks.positive_duration,
        metavar="DURATION",
        help="delete completed and cancelled jobs this long after they finished "
        "(seconds, or 30s, 15m, 12h, 7d; 0: keep forever)",
    )
    """Age after which ``completed`` and ``cancelled`` jobs are deleted."""
    dead_ttl: timedelta | None = setting(
        timedelta(days=30),
        flag="--retention-dead",
        parse=age,
        check=checks.positive_duration,
        metavar="DURATION",
        help="delete failed (dead) jobs this long after they died (0: keep forever)",
    )
    """Age after which ``failed`` (dead) jobs are deleted."""
    max_terminal_rows: int | None = setting(
        None,
        flag="--retention-max-rows",
        parse=int,
        check=checks.positive_int,
        metavar="N",
        help="keep at most the newest N finished jobs, whatever their age (default: no cap)",
    )
    """Keep at most this many finished jobs of any status (the newest); ``None``: no cap."""
    interval: float = setting(
        60.0,
        flag="--retention-interval",
        parse=float,
        check=checks.positive,
        metavar="SECONDS",
        help="seconds between retention passes",
    )
    """Seconds between passes."""
    batch_size: int = setting(1000, check=checks.positive_int)
    """Rows deleted per transaction."""

    def __post_init__(self) -> None:
        check_rows(self)


async def prune_once(
    store: StorageAdapter, settings: Retention, clock: Clock = utcnow
) -> dict[str, int]:
    """One retention pass; returns how many jobs each rule deleted."""
    now = clock()
    deleted: dict[str, int] = {}
    if settings.completed_ttl is not None:
        deleted["completed_cancelled"] = await store.prune(
            older_than=now - settings.completed_ttl,
            statuses=FINISHED,
            batch_size=settings.batch_size,
        )
    if settings.dead_ttl is not None:
        deleted["dead"] = await store.prune(
            older_than=now - settings.dead_ttl, statuses=DEAD, batch_size=settings.batch_size
        )
    if settings.max_terminal_rows is not None:
        deleted["over_cap"] = await store.prune(
            keep_latest=settings.max_terminal_rows, batch_size=settings.batch_size
        )
    return deleted


async def run_retention(store: StorageAdapter, settings: Retention, clock: Clock = utcnow) -> None:
    """Prune every ``settings.interval`` seconds until cancelled; never raises otherwise.

    The first pass runs at once, so a main that was down for a while catches up.
    """
    log_event(
        logger,
        logging.INFO,
        "retention on",
        completed_ttl=settings.completed_ttl,
        dead_ttl=settings.dead_ttl,
        max_terminal_rows=settings.max_terminal_rows,
        interval=timedelta(seconds=settings.interval),
    )
    while True:
        deleted = await retrying(
            "retention pass",
            lambda: prune_once(store, settings, clock),
            interval=settings.interval,
            logger=logger,
        )
        if any(deleted.values()):
            counts: dict[str, Any] = dict(deleted)  # a field per rule, each its count
            log_event(logger, logging.INFO, "retention pruned", **counts)
        await asyncio.sleep(settings.interval)


__all__ = ["DEAD", "FINISHED", "Retention", "prune_once", "run_retention"]
