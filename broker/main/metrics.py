"""Prometheus metrics of the main and of a worker.

Two kinds, kept apart so the hot paths pay only for the first:

* **Events** (jobs enqueued, started, completed, failed, dead, cancelled; wait and run
  times; store latency and errors; report batch sizes) are counted where they happen, by
  :class:`MainMetrics`, called from a few places: the request service (enqueue, cancel),
  the main's carrying of a ``Dispatch`` (started), the report settler (outcomes) and the
  :class:`MeasuredStore` the dispatcher and settler call through. The per-job ones
  (counters by queue and task, the wait and run histograms) are plain numbers the
  registry reads at scrape time, so an event costs a dict lookup and an addition, never
  a label dict or a lock.
* **Levels** (queue depth and oldest eligible age, workers, free credits, ledger size; on
  a worker, running jobs and children) are read at scrape time from what the main or
  worker already holds (:class:`MainLevels`, :class:`broker.worker.metrics.WorkerLevels`):
  nothing to keep in
  step, nothing on the hot path.

Label values are bounded in number and in length: queue and task names are the only
free ones; past :data:`MAX_LABEL_SETS` label sets of one metric further ones are counted
under ``"_other"``, and a name longer than :data:`MAX_LABEL_BYTES` is cut (:func:`label`).
So a client that invents a name per job, or a store holding names of megabytes (written
before names had a bound), can neither grow the main's memory or a Prometheus server's
series without bound nor make a scrape heavier than :data:`MAX_METRICS_BYTES`. Every main
and worker has its own registry (two mains in one test process never share a counter).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from broker.core.history import History
from broker.jobs import ExecutionMode, Job, JobStatus, Outcome, Settlement
from broker.model.bounds import MAX_LABEL_BYTES, MAX_LABEL_SETS, MAX_METRICS_BYTES
from broker.storage import QueueCount, StorageAdapter, eligible_reader

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition format that :func:`generate_latest` writes."""

OTHER = "_other"

_CUT = "…"

_le = cast(Callable[[float], str], floatToGoString)
"""A bucket's bound as ``prometheus_client`` writes its ``le`` label."""

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_JOB_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def label(name: str) -> str:
    """``name`` as a label value: itself when it fits in :data:`MAX_LABEL_BYTES` of UTF-8,
    else cut to fit, ending in ``…`` (names sharing that start then share a series).

    Cheap on the hot path: a name that short in characters needs no encoding, and a long
    one is encoded only up to the bound, however long it is."""
    if len(name) <= MAX_LABEL_BYTES // 4:
        return name
    head = name[: MAX_LABEL_BYTES + 1].encode()
    if len(name) <= MAX_LABEL_BYTES and len(head) <= MAX_LABEL_BYTES:
        return name
    return head[: MAX_LABEL_BYTES - len(_CUT.encode())].decode(errors="ignore") + _CUT


class _ByJob:
    """One counter by (queue, task), as plain numbers read at scrape time.

    A job moves several of these and the wait and run histograms: a ``prometheus_client``
    child takes a lock per increment, which cost the main about 5 us per job; the main
    counts on one event loop, so it keeps the numbers itself and the registry reads them
    through :class:`_EventCollector`."""

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.text = text
        self.counts: dict[tuple[str, str], float] = {}

    def inc(self, queue: str, task: str, amount: int = 1) -> None:
        counts = self.counts
        key = (queue, task)
        if key in counts:
            counts[key] += amount
            return
        key = (label(queue), label(task))  # a name over the bound is never kept whole
        if key in counts:
            counts[key] += amount
        elif len(counts) >= MAX_LABEL_SETS:
            counts[_OTHERS] = counts.get(_OTHERS, 0) + amount
        else:
            counts[key] = amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.text, labels=("queue", "task"))
        for key, value in self.counts.items():
            family.add_metric(key, value)
        return family


_OTHERS = (OTHER, OTHER)


class _ByQueue:
    """One histogram whose first label is the queue, as plain numbers read at scrape time
    (see :class:`_ByJob`): per label set, a count per bucket and the sum. Past
    :data:`MAX_LABEL_SETS` label sets the queue is counted as ``"_other"``."""

    def __init__(self, name: str, text: str, labels: tuple[str, ...], buckets: Sequence[float]):
        self.name = name
        self.text = text
        self.labels = labels
        self.bounds = tuple(buckets)
        self.series: dict[tuple[str, ...], list[float]] = {}
        """Label values -> observations per bucket (the last: past every bound), then the sum."""

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        series = self.series.get(labels)
        if series is None:
            labels = (label(labels[0]), *labels[1:])
            series = self.series.get(labels)
        if series is None:
            if len(self.series) >= MAX_LABEL_SETS:
                labels = (OTHER, *labels[1:])
            series = self.series.setdefault(labels, [0.0] * (len(self.bounds) + 2))
        series[bisect.bisect_left(self.bounds, value)] += 1
        series[-1] += value

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.text, labels=self.labels)
        les = [_le(bound) for bound in self.bounds] + ["+Inf"]
        for labels, series in self.series.items():
            cumulative = list(itertools.accumulate(series[:-1]))
            family.add_metric(labels, list(zip(les, cumulative, strict=True)), series[-1])
        return family


class _EventCollector(Collector):
    """Exposes the counters and histograms the main keeps as plain numbers."""

    def __init__(self, metrics: Sequence[_ByJob | _ByQueue]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield metric.family()


class MainMetrics:
    """The main's event counters and histograms, and its registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.enqueued = _ByJob(
            "broker_jobs_enqueued", "Jobs stored by an enqueue (not duplicates)."
        )
        self.started = _ByJob("broker_jobs_started", "Jobs handed to a worker (each attempt).")
        self.completed = _ByJob("broker_jobs_completed", "Runs that completed.")
        self.failed = _ByJob(
            "broker_jobs_failed", "Runs that failed (retried or not; see broker_jobs_dead)."
        )
        self.dead = _ByJob("broker_jobs_dead", "Jobs that failed with no retry left (dead).")
        self.cancelled = _ByJob("broker_jobs_cancelled", "Jobs cancelled by a request.")
        self._wait = _ByQueue(
            "broker_job_wait_seconds",
            "From when a job was due (its run_at) to its hand-off to a worker.",
            ("queue",),
            _JOB_BUCKETS,
        )
        self._run = _ByQueue(
            "broker_job_run_seconds",
            "From a job's hand-off to the settlement of its report, by outcome.",
            ("queue", "outcome"),
            _JOB_BUCKETS,
        )
        reg.register(
            _EventCollector(
                [
                    self.enqueued,
                    self.started,
                    self.completed,
                    self.failed,
                    self.dead,
                    self.cancelled,
                    self._wait,
                    self._run,
                ]
            )
        )
        self._store_seconds = Histogram(
            "broker_store_seconds",
            "Latency of the main's store calls on the job path, by operation.",
            ("operation",),
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self._store_errors = Counter(
            "broker_store_errors",
            "Store calls on the job path that raised, by operation.",
            ("operation",),
            registry=reg,
        )
        self._batch = Histogram(
            "broker_report_batch_size",
            "Reports settled per store transaction (group commit).",
            buckets=_BATCH_BUCKETS,
            registry=reg,
        )
        self._checkpoints = Counter(
            "broker_checkpoints",
            "Checkpoints answered, by acknowledgement status (applied, duplicate, stale, refused).",
            ("status",),
            registry=reg,
        )
        self._progress = Counter(
            "broker_progress_updates",
            "Progress updates taken from workers (each job's latest is stored; no per-job "
            "series: a job id is an unbounded label).",
            registry=reg,
        )
        self._store_children: dict[str, Any] = {}
        self.history = History()
        """The same events minute by minute, for the dashboard's charts (fed here, where
        they are counted: a few additions per event)."""

    def handed_off(self, job: Job) -> None:
        """``job`` left for a worker: count it and how long it waited since due."""
        self.started.inc(job.queue, job.task)
        if job.handed_off_at is not None:
            wait = max(0.0, (job.handed_off_at - job.run_at).total_seconds())
            self._wait.observe((job.queue,), wait)
            self.history.started(job.handed_off_at.timestamp(), job.queue, job.task, wait)

    def settled(self, job: Job | None, settlement: Settlement, now: datetime) -> None:
        """A report was applied to ``job`` (as the main held it, ``None`` if it no longer
        does): count its outcome and, for a run that ended, its run time."""
        if job is None:
            return
        outcome = settlement.outcome
        at = now.timestamp()
        if outcome is Outcome.COMPLETE:
            self.completed.inc(job.queue, job.task)
            self.history.completed(at, job.queue, job.task)
        elif outcome is Outcome.FAIL:
            self.failed.inc(job.queue, job.task)
            if settlement.run_at is None:
                self.dead.inc(job.queue, job.task)
            self.history.failed(at, job.queue, job.task, retried=settlement.run_at is not None)
        elif outcome is Outcome.LOST:
            if settlement.run_at is None:  # its recovery limit
                self.dead.inc(job.queue, job.task)
            self.history.failed(at, job.queue, job.task, retried=settlement.run_at is not None)
            return  # a lost attempt is no run's end the task reached
        else:
            return  # a release or reschedule is no run's end
        if job.handed_off_at is not None:
            seconds = max(0.0, (now - job.handed_off_at).total_seconds())
            self._run.observe((job.queue, outcome.value), seconds)

    def store_call(self, operation: str, seconds: float, *, failed: bool) -> None:
        child = self._store_children.get(operation)
        if child is None:
            child = self._store_children[operation] = self._store_seconds.labels(operation)
        child.observe(seconds)
        if failed:
            self._store_errors.labels(operation=operation).inc()

    def checkpoint_answered(self, status: str) -> None:
        self._checkpoints.labels(status=status).inc()

    def progress_received(self) -> None:
        self._progress.inc()

    def report_batch(self, size: int) -> None:
        self._batch.observe(size)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MeasuredStore:
    """The store as the dispatcher and the report settler call it: claims and settles
    are timed and their errors counted (and report batch sizes observed); every other
    call goes straight through to the store."""

    def __init__(self, store: StorageAdapter, metrics: MainMetrics) -> None:
        self._store = store
        self._metrics = metrics
        self._select = eligible_reader(store)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    @contextlib.contextmanager
    def _timed(self, op: str) -> Iterator[None]:
        """Time the store call made inside, as ``op``, counting it failed if it raised."""
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self._metrics.store_call(op, time.perf_counter() - start, failed=True)
            raise
        self._metrics.store_call(op, time.perf_counter() - start, failed=False)

    async def mark_handed_off_many(self, claims: Sequence[Any]) -> list[Job]:
        with self._timed("claim"):
            return await self._store.mark_handed_off_many(claims)

    async def settle_many(self, settlements: Sequence[Settlement]) -> list[bool]:
        self._metrics.report_batch(len(settlements))
        with self._timed("settle"):
            return await self._store.settle_many(settlements)

    async def save_checkpoints(self, saves: Sequence[Any]) -> list[bool]:
        with self._timed("checkpoint"):
            return await self._store.save_checkpoints(saves)

    async def select_eligible(
        self,
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        limit: int = 100,
        skip: Collection[uuid.UUID] = (),
        tasks: Collection[str] | None = None,
        exclude_queues: Collection[str] = (),
        exclude_keys: Collection[tuple[str, str]] = (),
    ) -> list[Job]:
        with self._timed("select"):
            # Only a store with SupportsQueueSettings is asked these (see the dispatcher).
            extra: dict[str, Any] = {}
            if exclude_queues:
                extra["exclude_queues"] = exclude_queues
            if exclude_keys:
                extra["exclude_keys"] = exclude_keys
            if extra:
                return await self._store.select_eligible(
                    modes=modes, queues=queues, limit=limit, skip=skip, tasks=tasks, **extra
                )
            return await self._select(
                modes=modes, queues=queues, limit=limit, skip=skip, tasks=tasks
            )


# ---------------------------------------------------------------------- levels


@dataclass(frozen=True, slots=True)
class MainLevels:
    """What the main holds at a scrape, and the store's counts (read at most every
    couple of seconds, since counting a large store is not free)."""

    counts: Sequence[QueueCount]
    now: datetime
    leader: bool
    """Whether this main dispatches: a standby's worker and credit gauges read 0, and
    alert rules join on ``broker_main_leader`` so they fire on the leader only."""
    workers: int
    draining: int
    credits: Mapping[str, int]
    """Free credits by execution mode, summed over the dispatchable workers."""
    in_flight: int
    ledger: int
    orphans: int
    tasks_without_worker: int = 0
    """Tasks of the catalog that no connected worker declares: their jobs wait (routing
    by task, :meth:`Handoff.unserved <broker.core.handoff.Handoff.unserved>`)."""
    queue_flow: Sequence[Mapping[str, Any]] = ()
    """The queues paused or rate limited (:meth:`broker.main.queues.QueueControl.status`)."""


class _MainLevelsCollector(Collector):
    def __init__(self) -> None:
        self.levels: MainLevels | None = None

    def collect(self) -> Iterator[Metric]:
        levels = self.levels
        if levels is None:
            return
        depth = GaugeMetricFamily(
            "broker_queue_jobs",
            "Jobs in the store by queue and status.",
            labels=["queue", "status"],
        )
        oldest = GaugeMetricFamily(
            "broker_queue_oldest_eligible_age_seconds",
            "How long the oldest due job of the queue has waited (0: none is due).",
            labels=["queue"],
        )
        seen, ages = _by_queue(levels)
        for queue, per in seen.items():
            for status, count in per.items():
                depth.add_metric([queue, status], count)
            oldest.add_metric([queue], ages.get(queue, 0.0))
        yield depth
        yield oldest
        yield _gauge(
            "broker_main_leader",
            "1 while this main dispatches (the leader), 0 on a standby.",
            1 if levels.leader else 0,
        )
        yield _gauge("broker_workers_connected", "Worker connections.", levels.workers)
        yield _gauge("broker_workers_draining", "Worker connections draining.", levels.draining)
        credits = GaugeMetricFamily(
            "broker_free_credits",
            "Free slots the workers have announced, by execution mode.",
            labels=["mode"],
        )
        for mode in ExecutionMode:
            credits.add_metric([mode.value], levels.credits.get(mode.value, 0))
        yield credits
        yield _gauge("broker_jobs_in_flight", "Leases held by connected workers.", levels.in_flight)
        yield _gauge(
            "broker_recovery_ledger_size", "Leases waiting to go back to the store.", levels.ledger
        )
        yield _gauge(
            "broker_orphans", "Hand-offs from before a restart, unclaimed.", levels.orphans
        )
        yield _gauge(
            "broker_tasks_without_worker",
            "Declared tasks no connected worker declares now: their jobs wait.",
            levels.tasks_without_worker,
        )
        yield from _flow(levels.queue_flow)


def _flow(settings: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
    """The queues with settings, at most :data:`MAX_LABEL_SETS` of them (by name; a main
    rarely has more than a few): paused, and how long the next job waits for a token."""
    paused = GaugeMetricFamily(
        "broker_queue_paused", "1 while the queue is paused, else 0.", labels=["queue"]
    )
    wait = GaugeMetricFamily(
        "broker_queue_token_wait_seconds",
        "How long the rate-limited queue's next job waits for a token now.",
        labels=["queue"],
    )
    for entry in settings[:MAX_LABEL_SETS]:
        queue = label(str(entry["queue"]))
        paused.add_metric([queue], 1.0 if entry["paused"] else 0.0)
        if entry["rate_limit"] is not None:
            wait.add_metric([queue], float(entry["token_wait_seconds"]))
    yield paused
    yield wait


def _by_queue(levels: MainLevels) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
    """Jobs by queue and status, and each queue's oldest due wait, for at most
    :data:`MAX_LABEL_SETS` queues: those with the most queued jobs (then the most jobs),
    by name; the rest summed under ``"_other"`` (its oldest wait: the longest of theirs)."""
    seen: dict[str, dict[str, int]] = {}
    ages: dict[str, float] = {}
    for row in levels.counts:
        queue = label(row.queue)
        per = seen.setdefault(queue, {s.value: 0 for s in JobStatus})
        per[row.status.value] += row.count
        if row.status is JobStatus.QUEUED and row.oldest_run_at is not None:
            age = (levels.now - row.oldest_run_at).total_seconds()
            ages[queue] = max(ages.get(queue, 0.0), age, 0.0)
    if len(seen) <= MAX_LABEL_SETS:
        return dict(sorted(seen.items())), ages
    queued = JobStatus.QUEUED.value
    ranked = sorted(seen, key=lambda q: (-seen[q][queued], -sum(seen[q].values()), q))
    kept = sorted(ranked[:MAX_LABEL_SETS])
    other = {s.value: 0 for s in JobStatus}
    for queue in ranked[MAX_LABEL_SETS:]:
        for status, count in seen[queue].items():
            other[status] += count
    shown = {q: seen[q] for q in kept}
    shown[OTHER] = other
    other_age = max((ages.get(q, 0.0) for q in ranked[MAX_LABEL_SETS:]), default=0.0)
    return shown, {**{q: ages[q] for q in kept if q in ages}, OTHER: other_age}


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


class MainExposition:
    """The main's ``/metrics``: its counters and the levels read at scrape time."""

    def __init__(self, metrics: MainMetrics) -> None:
        self.metrics = metrics
        self._levels = _MainLevelsCollector()
        metrics.registry.register(self._levels)

    def render(self, levels: MainLevels) -> bytes:
        """The exposition: at most :data:`MAX_METRICS_BYTES` by construction (see the
        module's docstring), which ``tests/unit/test_metrics.py`` renders at its worst."""
        self._levels.levels = levels
        return self.metrics.exposition()


__all__ = [
    "CONTENT_TYPE",
    "MAX_LABEL_BYTES",
    "MAX_LABEL_SETS",
    "MAX_METRICS_BYTES",
    "MainExposition",
    "MainLevels",
    "MainMetrics",
    "MeasuredStore",
    "label",
]
