"""Fault-injecting wrappers around a real adapter.

The one failure a lease design must survive is the *ambiguous* claim: the call
raised, and nobody knows whether the store committed it. These wrappers produce
both halves of that on any adapter, without touching its code: the claim raises
before reaching the store, or after the store has committed it. They also make
settlements fail for a while (transient trouble) or a chosen claim or settlement
fail every time (a value the store refuses), to check that one bad report or job
never stops the others.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from broker.exceptions import StorageError, StorageRejectedError
from broker.jobs import Claim, EnqueueResult, Job, JobSpec, Outcome, Settlement
from broker.storage import StorageAdapter, SupportsEnqueueHandedOff


class ClaimFault(enum.Enum):
    NONE = "none"
    BEFORE_COMMIT = "before_commit"
    AFTER_COMMIT = "after_commit"


class InjectedFault(StorageError):
    """A fault injected by a test; the operation may or may not have committed."""


class InjectedRejection(StorageRejectedError):
    """A refusal injected by a test: the store would refuse this value every time."""


class FaultyAdapter:
    """Delegates to ``inner`` but makes claims (and optionally returns) fail on cue.

    ``claim_fault`` applies to the next ``claim_failures`` claim calls (single or
    batch), then claims behave normally again. ``return_failures`` makes that many
    returns of a lease raise before reaching the store (``return_to_queue`` calls, and
    ``settle_many`` calls giving back a lost attempt: the ledger's two ways), and
    ``settle_failures`` that many ``settle_many`` calls. A claim or settle call that
    includes a claim for which ``rejects_claim`` is true, or a settlement for which
    ``rejects_settlement`` is true, raises :class:`InjectedRejection` every time,
    writing nothing. Everything else is passed straight through, so the wrapped store
    is exercised for real.
    """

    def __init__(self, inner: StorageAdapter) -> None:
        self.inner = inner
        self.claim_fault = ClaimFault.NONE
        self.claim_failures = 0
        self.return_failures = 0
        self.settle_failures = 0
        self.rejects_claim: Callable[[Claim], bool] = lambda claim: False
        self.rejects_settlement: Callable[[Settlement], bool] = lambda settlement: False
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.enqueue_handoffs = False
        """Whether claims made at enqueue time reach the store (and its claim faults apply
        to them); off by default, so the faults above hit the dispatcher's claims, which
        is what most tests provoke."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def fail_next_claims(self, fault: ClaimFault, times: int = 1) -> None:
        self.claim_fault = fault
        self.claim_failures = times

    def _take_claim_fault(self) -> ClaimFault:
        if self.claim_failures <= 0:
            return ClaimFault.NONE
        self.claim_failures -= 1
        return self.claim_fault

    async def mark_handed_off(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, worker_id: str
    ) -> Job | None:
        claimed = await self.mark_handed_off_many([Claim(job_id, handoff_id, worker_id)])
        return claimed[0] if claimed else None

    async def mark_handed_off_many(self, claims: Sequence[Claim]) -> list[Job]:
        self.calls.append(("mark_handed_off_many", tuple(claims)))
        fault = self._take_claim_fault()
        if fault is ClaimFault.BEFORE_COMMIT:
            raise InjectedFault("injected: the claim failed before reaching the store")
        if any(self.rejects_claim(claim) for claim in claims):
            raise InjectedRejection("injected: the store refuses a value in this claim")
        claimed = await self.inner.mark_handed_off_many(claims)
        if fault is ClaimFault.AFTER_COMMIT:
            raise InjectedFault("injected: the claim committed but its answer was lost")
        return claimed

    async def enqueue_handed_off(
        self, specs: Sequence[JobSpec], claims: Sequence[Claim | None]
    ) -> list[EnqueueResult]:
        """Claims at enqueue time, when ``enqueue_handoffs`` is on and the wrapped store
        takes them, under the same claim faults; else a plain enqueue (no claim is won)."""
        inner = self.inner
        made = [claim for claim in claims if claim is not None]
        if not made or not self.enqueue_handoffs or not isinstance(inner, SupportsEnqueueHandedOff):
            return await inner.enqueue_many(specs)
        self.calls.append(("enqueue_handed_off", tuple(made)))
        fault = self._take_claim_fault()
        if fault is ClaimFault.BEFORE_COMMIT:
            raise InjectedFault("injected: the enqueue failed before reaching the store")
        results = await inner.enqueue_handed_off(specs, claims)
        if fault is ClaimFault.AFTER_COMMIT:
            raise InjectedFault("injected: the enqueue committed but its answer was lost")
        return results

    async def return_to_queue(self, job_id: uuid.UUID, handoff_id: uuid.UUID) -> bool:
        self.calls.append(("return_to_queue", (job_id, handoff_id)))
        if self.return_failures > 0:
            self.return_failures -= 1
            raise InjectedFault("injected: return_to_queue failed before reaching the store")
        return await self.inner.return_to_queue(job_id, handoff_id)

    async def settle_many(self, settlements: Sequence[Settlement]) -> list[bool]:
        self.calls.append(("settle_many", tuple(settlements)))
        if self.return_failures > 0 and any(s.outcome is Outcome.LOST for s in settlements):
            self.return_failures -= 1
            raise InjectedFault("injected: returning a lost lease failed before the store")
        if self.settle_failures > 0:
            self.settle_failures -= 1
            raise InjectedFault("injected: settle_many failed before reaching the store")
        if any(self.rejects_settlement(settlement) for settlement in settlements):
            raise InjectedRejection("injected: the store refuses a value in this settlement")
        return await self.inner.settle_many(settlements)
