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

A task may have a limit of its own (``@task(rate_limit="100/s")``), declared by the
workers that serve it (:meth:`FlowControl.limit_tasks`): its bucket is kept beside the
queues', and a job goes only when both its queue's bucket and its task's have a token;
both are spent when it is placed. :meth:`FlowControl.leave_out_tasks` names the tasks a
dispatch read leaves out, and :meth:`FlowControl.wake_at` covers their next token too.
"""

from __future__ import annotations

from collections.abc import Mapping
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

    task_rates: dict[str, Rate] = field(default_factory=dict)
    """Per task, the rate limit its connected workers declare (the newest declaration)."""
    task_buckets: dict[str, Bucket] = field(default_factory=dict)
    task_held_back: set[str] = field(default_factory=set)
    """:attr:`held_back`, for the tasks' buckets."""

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

    def limit_tasks(self, rates: Mapping[str, Rate]) -> None:
        """The tasks' limits are ``rates`` from now on (the newest declaration of each
        among the connected workers, :meth:`broker.core.handoff.Handoff.declared`): a
        task no longer limited loses its bucket; a changed rate starts a fresh one (its
        burst at once); an unchanged one keeps its state, so a worker that connects again
        grants no extra tokens. Their number is bounded by the catalog's
        (:data:`~broker.model.bounds.MAX_CATALOG_ENTRIES`)."""
        for task in [task for task in self.task_rates if task not in rates]:
            del self.task_rates[task], self.task_buckets[task]
            self.task_held_back.discard(task)
        for task, rate in rates.items():
            if self.task_rates.get(task) != rate:
                self.task_rates[task] = rate
                self.task_buckets[task] = Bucket.of(rate)

    def blocked_tasks(self, now: float) -> frozenset[str]:
        """The tasks out of tokens at ``now``: a dispatch read leaves their jobs out."""
        if not self.task_buckets:
            return frozenset()
        at = _ns(now)
        return frozenset(task for task, b in self.task_buckets.items() if not b.admits(at))

    def leave_out_tasks(self, now: float) -> frozenset[str]:
        """:meth:`blocked_tasks`, remembered for :meth:`wake_at` (as :meth:`leave_out`)."""
        blocked = self.blocked_tasks(now)
        self.task_held_back = set(blocked)
        return blocked

    @property
    def limiting(self) -> bool:
        """Whether any queue has settings or any task a limit: every dispatch pass then
        reads the store (jobs read ahead may have lost their token since)."""
        return bool(self.settings or self.task_buckets)

    def admits(self, queue: str, now: float, task: str | None = None) -> bool:
        """Whether a job of ``queue`` (and of ``task``, when given) may be dispatched at
        ``now``: both buckets have a token (spends nothing)."""
        if task is not None and not self._task_admits(task, now):
            return False
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

    def _task_admits(self, task: str, now: float) -> bool:
        bucket = self.task_buckets.get(task)
        if bucket is None or bucket.admits(_ns(now)):
            return True
        self.task_held_back.add(task)
        return False

    def admitted(self, queue: str, now: float, task: str | None = None) -> None:
        """A job of ``queue`` was placed at ``now``: it spends a token. The queue counts as
        held back from now on: it may have more jobs, and the token just spent may have
        been its last, so the dispatcher must look again when the next one is due (a
        plan that took every job it read refused none, and would not say so). So does
        ``task``'s bucket, when it has one."""
        limited = self.task_buckets.get(task) if task is not None else None
        if limited is not None and task is not None:
            limited.take(_ns(now))
            self.task_held_back.add(task)
        bucket = self.buckets.get(queue)
        if bucket is not None:
            bucket.take(_ns(now))
            self.held_back.add(queue)

    def wake_at(self, now: float) -> float | None:
        """When the dispatcher must read again by itself: when the first queue or task
        held back for a token (:attr:`held_back`, :attr:`task_held_back`) gets one;
        ``now`` if one has a token already (the read that left it out came just before
        it). ``None``: nothing waits for a token. A paused queue waits for its resume,
        which wakes the dispatcher itself."""
        at = _ns(now)
        due = [
            self.buckets[queue].next_at() or at
            for queue in self.held_back
            if queue in self.buckets and not self.settings[queue].paused
        ]
        due += [
            self.task_buckets[task].next_at() or at
            for task in self.task_held_back
            if task in self.task_buckets
        ]
        return max(at, min(due)) / NANOS if due else None

    def token_wait(self, queue: str, now: float) -> float:
        """Seconds until ``queue``'s next token (0: it has one now, or no limit)."""
        bucket = self.buckets.get(queue)
        due = None if bucket is None else bucket.next_at()
        return 0.0 if due is None else max(0.0, (due - _ns(now)) / NANOS)
