"""Flow control, without I/O: which queues the dispatcher may take jobs from now.

An operator pauses a queue, or limits how fast its jobs are dispatched (``50/s``, with a
burst), and the main, which sees every dispatch, enforces it exactly across all workers.
This module decides; the dispatcher asks it before it claims:

* :meth:`FlowControl.leave_out` names the queues a dispatch read leaves out now (paused,
  or limited with no token): their jobs stay queued, never claimed, so no attempt is
  counted;
* :meth:`FlowControl.admits` and :meth:`FlowControl.admitted` are the check and the spend
  of one token as :meth:`broker.core.handoff.Handoff.plan` places a job, after its slot is
  reserved, so a held-back job never holds a credit;
* :meth:`FlowControl.wake_at` is when the next token of a queue held back is due: the
  dispatcher sleeps until then, and polls nothing. A read that left a queue out may
  prove its mode drained; the wake comes even if the token fell due between that read
  and the dispatcher's sleep, so the proof never outlives the token.

The limiter is a GCRA (a token bucket kept as one number, its theoretical arrival time),
counted in whole nanoseconds of the injected clock so that no rounding lets one more job
through: over any window of ``W`` seconds it admits at most ``rate * W + burst`` jobs, and
it refuses none it could admit (``tests/unit/test_flow.py`` checks both properties).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.model.bounds import MAX_QUEUE_SETTINGS
from broker.model.rates import NANOS, Rate
from broker.storage import QueueSettings


def _ns(now: float) -> int:
    return round(now * NANOS)


@dataclass(slots=True)
class Bucket:
    """One rate limit's state: ``tat``, the time (ns) by which every admitted job would
    have gone at the steady rate. A job may go while ``tat`` is at most ``tolerance``
    ahead of now, i.e. while the bucket holds a token."""

    interval: int
    """Nanoseconds between two jobs at the steady rate (:attr:`Rate.interval_ns`)."""
    burst: int
    tat: int | None = None

    @classmethod
    def of(cls, rate: Rate) -> Bucket:
        return cls(rate.interval_ns, rate.burst)

    @property
    def tolerance(self) -> int:
        return (self.burst - 1) * self.interval

    def next_at(self) -> int | None:
        """When (ns) the next job may go; ``None``: at once, whenever that is."""
        return None if self.tat is None else self.tat - self.tolerance

    def admits(self, now_ns: int) -> bool:
        due = self.next_at()
        return due is None or now_ns >= due

    def take(self, now_ns: int) -> None:
        """One job went at ``now_ns`` (which :meth:`admits` allowed)."""
        base = now_ns if self.tat is None else max(self.tat, now_ns)
        self.tat = base + self.interval


@dataclass
class FlowControl:
    """The queues' settings and their buckets (see the module docstring). ``now`` is any
    monotonic clock in seconds: the main's loop time."""

    settings: dict[str, QueueSettings] = field(default_factory=dict)
    buckets: dict[str, Bucket] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    """Per queue, the jobs a plan found but held back for a token (a count that grows)."""
    held_back: set[str] = field(default_factory=set)
    """The queues the last dispatch read left out, and those a plan since placed or
    refused a job of: the dispatcher must look again when they get a token
    (:meth:`wake_at`), since a read that left them out may have proven their modes
    drained, and a queue that spent its last token may have more jobs."""

    def load(self, settings: list[QueueSettings]) -> None:
        """Start from the stored settings (a leader's start-up, a standby's takeover)."""
        self.settings.clear()
        self.buckets.clear()
        for each in settings:
            self.apply(each)

    def check(self, new: QueueSettings) -> None:
        """Refuse a setting that would hold more than :data:`MAX_QUEUE_SETTINGS` queues;
        raises ``ValueError``."""
        taken = len(self.settings) >= MAX_QUEUE_SETTINGS
        if taken and not new.empty and new.queue not in self.settings:
            raise ValueError(
                f"at most {MAX_QUEUE_SETTINGS} queues may have settings; "
                "clear one (resume it, or clear its rate limit) first"
            )

    def apply(self, new: QueueSettings) -> None:
        """``new`` replaces the queue's settings. A changed rate starts a fresh bucket
        (its burst at once); an unchanged one keeps its state, so pausing and resuming
        a queue grants no extra tokens."""
        old = self.settings.get(new.queue)
        if new.empty:
            self.settings.pop(new.queue, None)
        else:
            self.settings[new.queue] = new
        if new.rate is None:
            self.buckets.pop(new.queue, None)
        elif old is None or old.rate != new.rate:
            self.buckets[new.queue] = Bucket.of(new.rate)

    def get(self, queue: str) -> QueueSettings:
        return self.settings.get(queue) or QueueSettings(queue)

    def governed(self, queue: str) -> bool:
        """Whether ``queue`` has any setting: its jobs are never handed off at enqueue,
        only by the dispatcher, which asks :meth:`admits`."""
        return queue in self.settings

    def blocked(self, now: float) -> frozenset[str]:
        """The queues a dispatch read at ``now`` leaves out: paused, or out of tokens."""
        if not self.settings:
            return frozenset()
        at = _ns(now)
        return frozenset(
            queue
            for queue, each in self.settings.items()
            if each.paused or not self.buckets[queue].admits(at)
        )

    def leave_out(self, now: float) -> frozenset[str]:
        """:meth:`blocked`, for a dispatch read about to leave them out: remembered until
        the next read, so that :meth:`wake_at` wakes the dispatcher when they get a token."""
        blocked = self.blocked(now)
        self.held_back = set(blocked)
        return blocked

    def admits(self, queue: str, now: float) -> bool:
        """Whether a job of ``queue`` may be dispatched at ``now`` (spends nothing)."""
        each = self.settings.get(queue)
        if each is None:
            return True
        if each.paused:
            return False
        if self.buckets[queue].admits(_ns(now)):
            return True
        self.held[queue] = self.held.get(queue, 0) + 1
        self.held_back.add(queue)
        return False

    def admitted(self, queue: str, now: float) -> None:
        """A job of ``queue`` was placed at ``now``: it spends a token. The queue counts as
        held back from now on: it may have more jobs, and the token just spent may have
        been its last, so the dispatcher must look again when the next one is due (a
        plan that took every job it read refused none, and would not say so)."""
        bucket = self.buckets.get(queue)
        if bucket is not None:
            bucket.take(_ns(now))
            self.held_back.add(queue)

    def wake_at(self, now: float) -> float | None:
        """When the dispatcher must read again by itself: when the first queue held back
        for a token (:attr:`held_back`) gets one; ``now`` if one has a token already (the
        read that left it out came just before it). ``None``: no queue waits for a token.
        A paused queue waits for its resume, which wakes the dispatcher itself."""
        at = _ns(now)
        due = [
            self.buckets[queue].next_at() or at
            for queue in self.held_back
            if queue in self.buckets and not self.settings[queue].paused
        ]
        return max(at, min(due)) / NANOS if due else None

    def token_wait(self, queue: str, now: float) -> float:
        """Seconds until ``queue``'s next token (0: it has one now, or no limit)."""
        bucket = self.buckets.get(queue)
        due = None if bucket is None else bucket.next_at()
        return 0.0 if due is None else max(0.0, (due - _ns(now)) / NANOS)
