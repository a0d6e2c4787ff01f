"""The handoffs the main makes or finds outside a dispatch pass: jobs handed off in the
enqueue's own transaction, and the handoffs in flight a main finds when it starts to
dispatch (the orphans, waiting for their workers' hellos).

The decisions (which jobs may start at once, under which leases; what an orphan's lease
becomes) are :class:`broker.core.handoff.Handoff`'s; this module makes the store calls
and hands the core's effects to the main's carrier.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

from broker.core.handoff import Handoff, HandoffEffect, Leads
from broker.jobs import Clock, EnqueueResult, JobSpec, JobStatus
from broker.storage import JobFilter, StorageAdapter, SupportsEnqueueHandedOff

_ORPHAN_PAGE = 1000
"""Handoffs in flight read per page at start-up."""


class EnqueueHandoff:
    """One group commit of enqueues, handing off at once the jobs that can start now."""

    def __init__(
        self,
        store: StorageAdapter,
        handoff: Handoff,
        *,
        carry: Callable[[Sequence[HandoffEffect]], None],
        enqueued: Callable[[list[EnqueueResult]], None],
        leads: Leads,
        stopping: Callable[[], bool],
        clock: Clock,
    ) -> None:
        """``carry`` carries out the core's effects; ``enqueued`` tells the dispatcher
        of the jobs stored queued; ``leads`` is the dispatcher's word on whether a job
        would overtake none still waiting (:meth:`Dispatcher.leads
        <broker.main.dispatcher.Dispatcher.leads>`)."""
        self._store = store
        self._handed_off_store = store if isinstance(store, SupportsEnqueueHandedOff) else None
        """The store, if it can hand jobs off at enqueue (checked once: a runtime protocol
        check costs as much as a small enqueue's other bookkeeping)."""
        self._handoff = handoff
        self._carry = carry
        self._enqueued = enqueued
        self._leads = leads
        self._stopping = stopping
        self._clock = clock

    async def commit(self, specs: list[JobSpec]) -> list[EnqueueResult]:
        """Store ``specs``. Jobs that can start at once (a worker has a free slot and no
        waiting job would be overtaken, see :meth:`Handoff.plan_at_enqueue`) are written
        already handed off, under leases minted before the insert, and sent right after
        the commit: one transaction and no dispatch pass between the enqueue and the
        start. An unknown outcome sends their leases to the ledger, as for any claim."""
        store = self._handed_off_store
        plans = (
            []
            if store is None or self._stopping()
            else self._handoff.plan_at_enqueue(specs, self._clock(), self._leads)
        )
        planned = [p for p in plans if p is not None]
        leased: set[uuid.UUID] = set()
        if store is None or not planned:
            results = await self._store.enqueue_many(specs)
        else:
            try:
                results = await store.enqueue_handed_off(
                    specs, [None if p is None else p.claim for p in plans]
                )
            except BaseException:
                self._carry(self._handoff.claim_unknown(planned))
                raise
            # Only the jobs planned are looked at (reading a result's job builds it).
            leased = {p.job.id for p in planned}
            won = [r.job for r in results if not r.duplicate and r.job_id in leased]
            self._carry(self._handoff.claimed(planned, won))
        # The jobs stored queued (not those handed off at once) wake the dispatcher.
        self._enqueued([r for r in results if not r.duplicate and r.job_id not in leased])
        return results


async def load_orphans(store: StorageAdapter, handoff: Handoff) -> None:
    """Read the handoffs in flight into ``handoff``, as summaries: a held lease needs no
    payload (a job sent again is claimed again, which loads it), so a start never loads
    megabytes per running job, nor fails on a value that no longer passes its integrity
    check."""
    cursor: str | None = None
    while True:
        page = await store.list_jobs(
            JobFilter(statuses=[JobStatus.HANDED_OFF]),
            limit=_ORPHAN_PAGE,
            cursor=cursor,
            include_payload=False,
        )
        handoff.load_orphans(page.jobs)
        if page.next_cursor is None:
            return
        cursor = page.next_cursor
