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

A task's limit may be *per key* instead (``@task(rate_limit="10/s", rate_key="{tenant}")``):
each job carries its key, filled from its arguments at enqueue (``Job.rate_key``), and
each key of the task has a bucket of its own at the task's rate (:class:`KeyBuckets`),
so one tenant's backlog never spends another's tokens. A dispatch read leaves out the
keys with no token (:meth:`FlowControl.leave_out_keys`), so that backlog never hides the
other keys' jobs either. The live buckets are bounded
(:data:`~broker.model.bounds.MAX_RATE_KEYS`): a bucket that has filled up again is
dropped when room is needed (it holds nothing a fresh one would not); with none full, a
job of a key that has no bucket waits, queued, until the first one fills, so the bound
delays jobs and never lets one more through.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from broker.model.bounds import MAX_QUEUE_SETTINGS, MAX_RATE_KEYS
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


KeyId = tuple[str, str]
"""A per-key bucket's name: the task and the job's rate key (``""`` for a job without one,
enqueued before its task had a per-key limit)."""


def key_of(task: str, rate_key: str | None) -> KeyId:
    """The bucket a job of ``task`` with ``rate_key`` spends (see :data:`KeyId`)."""
    return (task, rate_key or "")


@dataclass
class KeyBuckets:
    """The buckets of per-key limits, one per live key, at most ``bound`` of them.

    A bucket whose ``tat`` is not after now is full: it is exactly a fresh one, so it may
    be dropped when room is needed, and nothing is lost. With no room and none full, a
    key without a bucket is refused a token (:meth:`admits`) until
    :attr:`idle_from`, the earliest any bucket can be full: the bound delays a new key's
    jobs and never exceeds a limit."""

    bound: int = MAX_RATE_KEYS
    buckets: dict[KeyId, Bucket] = field(default_factory=dict)
    held_back: set[KeyId] = field(default_factory=set)
    """The keys a plan refused or spent a token of: the dispatcher looks again when their
    next token is due (as :attr:`FlowControl.held_back`)."""
    crowded: bool = False
    """A key was refused for want of room: the dispatcher looks again at
    :attr:`idle_from`."""
    idle_from: int | None = None
    """No bucket is full before this time (ns); ``None``: none is held."""

    def admits(self, key: KeyId, rate: Rate, now_ns: int) -> bool:
        """Whether a job of ``key`` may go at ``now_ns`` (spends nothing): its bucket has a
        token, or it has none and there is room for one (dropping full buckets)."""
        bucket = self.buckets.get(key)
        if bucket is not None:
            ok = bucket.admits(now_ns)
        else:
            ok = self._room(now_ns)
            self.crowded |= not ok
        if not ok:
            self.held_back.add(key)
        return ok

    def take(self, key: KeyId, rate: Rate, now_ns: int) -> None:
        """A job of ``key`` went at ``now_ns`` (which :meth:`admits` allowed)."""
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = Bucket.of(rate)
        bucket.take(now_ns)
        assert bucket.tat is not None
        if self.idle_from is None or bucket.tat < self.idle_from:
            self.idle_from = bucket.tat
        self.held_back.add(key)

    def _room(self, now_ns: int) -> bool:
        """Whether a new bucket fits, dropping the full ones if it would not. A sweep
        walks every bucket, so it runs only once some bucket may be full
        (:attr:`idle_from`), not for every job of a new key at the bound."""
        if len(self.buckets) < self.bound:
            return True
        if self.idle_from is None or now_ns < self.idle_from:
            return False
        for key in [k for k, b in self.buckets.items() if b.tat is None or b.tat <= now_ns]:
            del self.buckets[key]
            self.held_back.discard(key)
        self.idle_from = min(
            (b.tat for b in self.buckets.values() if b.tat is not None), default=None
        )
        return len(self.buckets) < self.bound

    def drop_task(self, task: str) -> None:
        """``task``'s keys lose their buckets (its limit changed, or is gone)."""
        for key in [key for key in self.buckets if key[0] == task]:
            del self.buckets[key]
            self.held_back.discard(key)

    def blocked(self, now_ns: int) -> frozenset[KeyId]:
        """The keys whose bucket has no token at ``now_ns``."""
        return frozenset(key for key, b in self.buckets.items() if not b.admits(now_ns))

    def wake_at(self, now_ns: int) -> list[int]:
        """When each key held back gets its next token (ns), and when room may come."""
        due = [
            self.buckets[key].next_at() or now_ns for key in self.held_back if key in self.buckets
        ]
        if self.crowded and self.idle_from is not None:
            due.append(self.idle_from)
        return due

    def wait(self, key: KeyId, now_ns: int) -> int:
        """Nanoseconds until a job of ``key`` may go (0: now)."""
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) < self.bound or self.idle_from is None:
                return 0
            return max(0, self.idle_from - now_ns)
        due = bucket.next_at()
        return 0 if due is None else max(0, due - now_ns)


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
    keyed: frozenset[str] = frozenset()
    """The tasks of :attr:`task_rates` whose limit is per key (``rate_key``): they have no
    bucket in :attr:`task_buckets`, one per key in :attr:`keys` instead."""
    keys: KeyBuckets = field(default_factory=KeyBuckets)

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

    def limit_tasks(self, rates: Mapping[str, Rate], keyed: Collection[str] = ()) -> None:
        """The tasks' limits are ``rates`` from now on, per key for those in ``keyed``
        (the newest declaration of each
        among the connected workers, :meth:`broker.core.handoff.Handoff.declared`): a
        task no longer limited loses its bucket; a changed rate starts a fresh one (its
        burst at once); an unchanged one keeps its state, so a worker that connects again
        grants no extra tokens. Their number is bounded by the catalog's
        (:data:`~broker.model.bounds.MAX_CATALOG_ENTRIES`)."""
        keyed = frozenset(keyed) & rates.keys()
        for task in [task for task in self.task_rates if task not in rates]:
            self._unlimit(task)
        for task in [task for task in self.task_rates if (task in keyed) != (task in self.keyed)]:
            self._unlimit(task)  # turned per key, or back: a fresh start either way
        self.keyed = keyed
        for task, rate in rates.items():
            if self.task_rates.get(task) != rate:
                self._unlimit(task)
                self.task_rates[task] = rate
                if task not in keyed:
                    self.task_buckets[task] = Bucket.of(rate)

    def _unlimit(self, task: str) -> None:
        self.task_rates.pop(task, None)
        self.task_buckets.pop(task, None)
        self.task_held_back.discard(task)
        self.keys.drop_task(task)

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
        return bool(self.settings or self.task_rates)

    def limits(self, task: str) -> bool:
        """Whether ``task`` has a limit of its own (for its whole, or per key)."""
        return task in self.task_rates

    def leave_out_keys(self, now: float) -> frozenset[KeyId]:
        """The keys of per-key limits with no token at ``now``: a dispatch read leaves
        their jobs out, so one key's backlog never hides another key's jobs (bounded by
        :data:`~broker.model.bounds.MAX_RATE_KEYS`). Remembered for :meth:`wake_at` (as
        :meth:`leave_out`), and a key refused for want of room is forgotten: the next
        plan refuses it again if there is still none."""
        keys = self.keys
        keys.crowded = False
        blocked = keys.blocked(_ns(now)) if keys.buckets else frozenset()
        keys.held_back = set(blocked)
        return blocked

    def admits(
        self, queue: str, now: float, task: str | None = None, rate_key: str | None = None
    ) -> bool:
        """Whether a job of ``queue`` (and of ``task``, with ``rate_key``, when given) may
        be dispatched at ``now``: its queue's bucket and its task's (or its key's) have a
        token (spends nothing)."""
        if task is not None and not self._task_admits(task, rate_key, now):
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

    def _task_admits(self, task: str, rate_key: str | None, now: float) -> bool:
        if task in self.keyed:
            return self.keys.admits(key_of(task, rate_key), self.task_rates[task], _ns(now))
        bucket = self.task_buckets.get(task)
        if bucket is None or bucket.admits(_ns(now)):
            return True
        self.task_held_back.add(task)
        return False

    def admitted(
        self, queue: str, now: float, task: str | None = None, rate_key: str | None = None
    ) -> None:
        """A job of ``queue`` was placed at ``now``: it spends a token. The queue counts as
        held back from now on: it may have more jobs, and the token just spent may have
        been its last, so the dispatcher must look again when the next one is due (a
        plan that took every job it read refused none, and would not say so). So does
        ``task``'s bucket, when it has one."""
        if task is not None and task in self.keyed:
            self.keys.take(key_of(task, rate_key), self.task_rates[task], _ns(now))
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
        it); so do the keys of per-key limits (:meth:`KeyBuckets.wake_at`). ``None``:
        nothing waits for a token. A paused queue waits for its resume,
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
        if self.keys.held_back or self.keys.crowded:
            due += self.keys.wake_at(at)
        return max(at, min(due)) / NANOS if due else None

    def token_wait(self, queue: str, now: float) -> float:
        """Seconds until ``queue``'s next token (0: it has one now, or no limit)."""
        return _wait(self.buckets.get(queue), now)

    def task_wait(self, task: str, rate_key: str | None, now: float) -> float:
        """Seconds until a job of ``task`` with ``rate_key`` gets its task's (or its key's)
        next token (0: it has one now, or no limit)."""
        if task in self.keyed:
            return self.keys.wait(key_of(task, rate_key), _ns(now)) / NANOS
        return _wait(self.task_buckets.get(task), now)


def _wait(bucket: Bucket | None, now: float) -> float:
    due = None if bucket is None else bucket.next_at()
    return 0.0 if due is None else max(0.0, (due - _ns(now)) / NANOS)
