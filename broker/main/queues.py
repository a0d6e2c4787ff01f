"""The queues' operator settings, as the leading main keeps them: read from the store when
it starts to lead (a start, a standby's takeover), changed by operators' requests (stored
first, then applied), shown in ``broker status`` and the metrics.

What the settings mean for dispatch is :mod:`broker.core.flow`'s; this module only reads,
writes and reports them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from broker.core.flow import FlowControl
from broker.exceptions import ConfigurationError, ProtocolError
from broker.model.logs import log_event
from broker.model.rates import Rate
from broker.model.values import check_name
from broker.storage import QueueSettings, StorageAdapter, SupportsQueueSettings
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")

QUEUE_REQUESTS = (protocol.PauseQueue, protocol.ResumeQueue, protocol.LimitQueue)
"""The operators' requests that change a queue's settings, answered by
:meth:`QueueControl.answer`."""


class QueueControl:
    """Pause, resume and rate-limit queues on the leading main."""

    def __init__(self, store: StorageAdapter, flow: FlowControl, *, wake: Callable[[], None]):
        self._store = store
        self._flow = flow
        self._wake = wake

    def _settings_store(self) -> SupportsQueueSettings:
        if not isinstance(self._store, SupportsQueueSettings):
            raise ConfigurationError(
                "this store cannot keep queue settings (its adapter does not implement "
                "SupportsQueueSettings), so queues cannot be paused or rate limited"
            )
        return self._store

    async def load(self) -> None:
        """Start from the stored settings; a store without them has none."""
        if isinstance(self._store, SupportsQueueSettings):
            self._flow.load(await self._store.queue_settings())

    async def answer(
        self, msg: protocol.PauseQueue | protocol.ResumeQueue | protocol.LimitQueue
    ) -> protocol.QueueInfo:
        """The reply to an operator's ``pause_queue``, ``resume_queue`` or ``limit_queue``."""
        match msg:
            case protocol.PauseQueue(queue=queue):
                settings = await self.pause(queue)
            case protocol.ResumeQueue(queue=queue):
                settings = await self.resume(queue)
            case protocol.LimitQueue(queue=queue):
                settings = await self.limit(queue, msg.limit())
        return protocol.QueueInfo(request_id=msg.request_id, queue=settings_info(settings))

    async def pause(self, queue: str) -> QueueSettings:
        return await self._change(replace(self._flow.get(queue), paused=True), "queue paused")

    async def resume(self, queue: str) -> QueueSettings:
        return await self._change(replace(self._flow.get(queue), paused=False), "queue resumed")

    async def limit(self, queue: str, rate: Rate | None) -> QueueSettings:
        event = "queue rate limit cleared" if rate is None else "queue rate limited"
        return await self._change(replace(self._flow.get(queue), rate=rate), event)

    async def _change(self, new: QueueSettings, event: str) -> QueueSettings:
        """Store ``new``, then apply it and wake the dispatcher (a resumed or faster queue
        may have jobs to go at once). Stored first: a change the store did not keep is
        not applied, so the main never enforces what a restart would forget."""
        store = self._settings_store()
        try:
            check_name("queue", new.queue)
            if not new.queue:
                raise ValueError("queue must not be empty")
            self._flow.check(new)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        await store.save_queue_settings(new)
        self._flow.apply(new)
        self._wake()
        log_event(
            logger,
            logging.INFO,
            event,
            queue=new.queue,
            paused=new.paused,
            rate_limit=None if new.rate is None else str(new.rate),
            burst=None if new.rate is None else new.rate.burst,
        )
        return new

    def status(self) -> list[dict[str, Any]]:
        """Every queue with settings, for ``broker status``: paused, its limit, and how
        long its next job waits for a token now (``token_wait_seconds``), with how many
        times a dispatch pass found one of its jobs held back for a token."""
        now = asyncio.get_running_loop().time()
        flow = self._flow
        return [
            {
                **settings_info(settings),
                "token_wait_seconds": round(flow.token_wait(queue, now), 3),
                "held_for_token": flow.held.get(queue, 0),
            }
            for queue, settings in sorted(flow.settings.items())
        ]


def settings_info(settings: QueueSettings) -> dict[str, Any]:
    """A queue's settings as JSON (a ``queue_info`` reply, a status entry)."""
    rate = settings.rate
    return {
        "queue": settings.queue,
        "paused": settings.paused,
        "rate_limit": None if rate is None else str(rate),
        "rate_burst": None if rate is None else rate.burst,
    }
