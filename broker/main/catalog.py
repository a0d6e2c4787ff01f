"""The task catalog's store side: reading the catalog, writing declarations through, and
the passes of the task grace.

The rules (bounds, the newest declaration wins, defaults for a job by name, unknown names
refused) are the pure :class:`broker.core.catalog.Catalog`; this module adds only what
needs the store, so the worker, which declares tasks but never stores them, imports none
of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from broker.core.catalog import Catalog, CatalogLimitError
from broker.exceptions import transient
from broker.jobs import Clock
from broker.main.loops import retrying
from broker.main.settings import MainSettings
from broker.model.bounds import MAX_CATALOG_ENTRIES
from broker.model.logs import log_event
from broker.storage import StorageAdapter
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")

TASK_GRACE_PASS_MAX = 3600.0
"""Seconds, at most, between two passes of the task grace: a declaration outlives its
worker by the grace, less at most this (a connected worker's rows are marked seen on
each pass, so a main that restarts keeps them for the grace)."""


class StoredCatalog(Catalog):
    """The catalog in memory, read from ``store`` once and written through to it."""

    def __init__(self, store: StorageAdapter) -> None:
        super().__init__()
        self._store = store
        self._loaded = False

    async def load(self) -> None:
        """Read the catalog from the store, the first time only: at most
        :data:`~broker.model.bounds.MAX_CATALOG_ENTRIES` declarations, the most recent, so a
        store that an older release let grow costs a bounded read."""
        if not self._loaded:
            self.merge(await self._store.task_catalog(limit=MAX_CATALOG_ENTRIES))
            self._loaded = True

    async def refresh(self, names: Collection[str]) -> None:
        """Read the declarations of ``names`` from the store again: before refusing a name
        this copy does not know, in case another process (a main that led before this
        one) recorded it. Only these names' rows are read, never the whole catalog."""
        if names:
            self.merge(await self._store.task_catalog(tasks=sorted(names)))

    async def save(
        self, worker_id: str, declared: Mapping[str, Mapping[str, Any]], now: datetime
    ) -> None:
        """Write what :meth:`record` returned through to the store (in place of the
        worker's earlier declarations)."""
        await self._store.declare_tasks(worker_id, declared, now)

    async def forget(self, live: Collection[str], now: datetime, grace: timedelta) -> int:
        """Drop the declarations of workers not seen for ``grace``, here and in the store;
        the workers in ``live`` (connected now) are seen at ``now``. Returns how many
        declarations this copy dropped.

        The store forgets first, this copy after: while the store still held a gone
        worker's rows, an enqueue of a name this copy had already dropped would read them
        back (:meth:`refresh`) and be accepted, the name alive again until the next pass."""
        gone_before = now - grace
        self.mark_seen(live, now)
        await self._store.forget_tasks(live, now, gone_before)
        return self.drop_gone(live, gone_before)


class Declarations:
    """The main's side of the workers' ``tasks`` messages: each is taken into the catalog
    at once and written to the store in the background; workers gone for the task grace
    are dropped now and then."""

    def __init__(
        self,
        catalog: StoredCatalog,
        settings: MainSettings,
        *,
        clock: Clock,
        stopping: Callable[[], bool],
    ) -> None:
        """Declarations are kept for ``settings.task_grace`` after their worker left;
        their writes are retried every ``settings.error_retry_interval``."""
        self._catalog = catalog
        self._clock = clock
        self._task_grace = settings.task_grace
        self._retry_interval = settings.error_retry_interval
        self._stopping = stopping
        self._saving: set[asyncio.Task[None]] = set()
        """Declarations being written to the store."""

    def declare(self, worker_id: str, tasks: Sequence[protocol.TaskDeclaration]) -> None:
        """``worker_id`` declared the tasks it serves: the catalog in memory takes them at
        once (an enqueue that follows sees them), the store in the background, retried
        while its trouble is transient (the next declaration would record them anyway).

        :raises CatalogLimitError: over a bound of the catalog; nothing is recorded (the
            worker is told, and its earlier declarations stay).
        """
        now = self._clock()
        try:
            declared = self._catalog.record(worker_id, tasks, now)
        except CatalogLimitError as exc:
            log_event(
                logger, logging.WARNING, "task catalog refused", worker_id=worker_id, error=str(exc)
            )
            raise
        log_event(logger, logging.INFO, "tasks declared", worker_id=worker_id, tasks=len(tasks))

        async def save() -> None:
            try:
                await retrying(
                    "storing the task catalog",
                    lambda: self._catalog.save(worker_id, declared, now),
                    interval=self._retry_interval,
                    logger=logger,
                    retry_if=transient,
                    stopping=self._stopping,
                )
            except Exception as exc:
                log_event(
                    logger,
                    logging.ERROR,
                    "storing the task catalog failed",
                    worker_id=worker_id,
                    error=repr(exc),
                )

        task = asyncio.create_task(save(), name="broker-declare-tasks")
        self._saving.add(task)
        task.add_done_callback(self._saving.discard)

    async def finish(self, grace: float) -> None:
        """On stopping: let the writes under way land for ``grace`` seconds, then cancel
        them."""
        if self._saving:
            await asyncio.wait(self._saving, timeout=grace)
            for saving in self._saving:
                saving.cancel()

    async def forget_gone_workers(self, live: Callable[[], Collection[str]]) -> None:
        """Drop the task declarations of workers gone for the task grace, a pass every
        quarter of it (at most an hour), the first one a pass after this main began to
        dispatch, so workers that were connected to the main before it have reconnected
        (:meth:`StoredCatalog.forget`); ``live()`` names the workers connected now."""
        grace = timedelta(seconds=self._task_grace)
        interval = min(self._task_grace / 4, TASK_GRACE_PASS_MAX)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._catalog.forget(live(), self._clock(), grace)
            except Exception as exc:  # the next pass tries again
                log_event(
                    logger,
                    logging.WARNING,
                    "dropping gone workers' task declarations failed",
                    error=repr(exc),
                )
