"""The dispatcher: passes that read eligible jobs, plan them with the handoff core and
claim them in the store, one batch per call.

It holds no handoff state: credits, leases and claims in flight are the core's
(:mod:`broker.handoff`), and the effects of a claim (jobs to send, leases to return) are
carried out by the main. Between passes it sleeps until woken (a ``ready``, a report, an
insert the store notified, a lease returned) or until the next scheduled job is due.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from broker.handoff import ClaimJobs, Handoff, HandoffEffect, PlannedClaim
from broker.jobs import Clock
from broker.reports import transient
from broker.storage import StorageAdapter, SupportsNotify
from broker.supervise import retrying

logger = logging.getLogger("broker.main")


class Dispatcher:
    def __init__(
        self,
        store: StorageAdapter,
        handoff: Handoff,
        *,
        carry: Callable[[Sequence[HandoffEffect]], None],
        stopping: Callable[[], bool],
        clock: Clock,
        claim_batch: int,
        poll_interval: float,
        notify_fallback_interval: float,
        retry_interval: float,
    ) -> None:
        self._store = store
        self._handoff = handoff
        self._carry = carry
        self._stopping = stopping
        self._clock = clock
        self._claim_batch = claim_batch
        self._poll_interval = poll_interval
        self._notify_fallback_interval = notify_fallback_interval
        self._retry_interval = retry_interval
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Ask for another pass (coalesced: many wakes, one pass)."""
        self._wake.set()

    async def listen(self) -> None:
        """Keep the store's notifications on; while they are down, each failure wakes the
        dispatcher for a pass, since an enqueue may have gone unannounced."""
        await retrying(
            "store listener",
            self._listen_once,
            interval=self._retry_interval,
            logger=logger,
            on_error=self.wake,
        )

    async def _listen_once(self) -> None:
        assert isinstance(self._store, SupportsNotify)
        async with self._store.listen(self.wake):
            await asyncio.Event().wait()

    async def run(self) -> None:
        """Pass after pass; between them, sleep until woken or the next job is due."""
        while True:
            self._wake.clear()
            more = await retrying(
                "dispatch pass", self.dispatch_once, interval=self._retry_interval, logger=logger
            )
            if more:
                continue
            timeout = await self._idle_timeout()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def _idle_timeout(self) -> float | None:
        """How long to sleep when there is nothing to dispatch: until the next scheduled
        job, or the poll interval when other processes' inserts cannot wake us."""
        modes = self._handoff.modes_with_credit()
        if not modes:
            return None
        polling = not self._store.capabilities.listen_notify
        try:
            next_at = await self._store.next_run_at(
                modes=modes, queues=self._handoff.served_queues()
            )
        except Exception as exc:
            logger.warning("could not read the next run time error=%r", exc)
            return self._retry_interval
        delay = None if next_at is None else (next_at - self._clock()).total_seconds()
        ceiling = self._poll_interval if polling else self._notify_fallback_interval
        if delay is None or delay <= 0:
            # Nothing scheduled, or due jobs that could not go out (their concurrency key is
            # full): a report or a readiness message wakes us, so a timer of zero would spin.
            return ceiling
        return min(delay, ceiling)

    async def dispatch_once(self) -> bool:
        """One dispatch pass; returns ``True`` when another pass may find more work."""
        if self._stopping():
            return False
        core = self._handoff
        queues = core.served_queues()
        modes = core.modes_with_credit()
        if not modes:
            return False
        limit = min(core.credit(), self._claim_batch)
        jobs = await self._store.select_eligible(modes=modes, queues=queues, limit=limit)
        plan = core.plan(jobs)
        if len(plan) < len(jobs):
            # One mode's backlog filled the read while another mode still has free slots:
            # read again for those modes alone, each no further than its own credit.
            for mode in sorted(core.modes_with_credit()):
                room = min(core.credit(mode), limit)
                found = await self._store.select_eligible(modes=[mode], queues=queues, limit=room)
                plan += core.plan(found)
        if not plan:
            return False
        error = await self._claim(plan)
        if error is not None:
            raise error  # after the jobs that were won went out; the loop backs off
        return len(jobs) == limit

    async def _claim(self, plan: Sequence[PlannedClaim]) -> Exception | None:
        """Claim the planned jobs in one call and send the ones won; returns the first
        error met, if any.

        When the call raises, nobody knows whether it committed, so the core sends each
        of its leases to the ledger. An error that is not transient (a value the store
        refuses, say) would recur forever, so the core has the batch claimed again in
        halves under fresh leases until the job or worker behind it stands alone: one bad
        row or worker id never stops dispatch to the others.
        """
        try:
            claimed = await self._store.mark_handed_off_many([p.claim for p in plan])
        except Exception as exc:
            if transient(exc) or len(plan) == 1:
                logger.warning("claim outcome unknown for %d jobs error=%r", len(plan), exc)
                self._carry(self._handoff.claim_unknown(plan))
                return exc
            logger.warning(
                "claiming %d jobs failed, splitting the batch to isolate the cause error=%r",
                len(plan),
                exc,
            )
            effects = self._handoff.claim_refused(plan)
            self._carry(effects)
            for effect in effects:
                if isinstance(effect, ClaimJobs):
                    await self._claim(effect.claims)
            return exc
        self._carry(self._handoff.claimed(plan, claimed))
        return None
