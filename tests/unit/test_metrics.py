"""The metrics' own rules: what each event counts, bounded labels, and the exposition
parsing with ``prometheus_client``'s parser."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.memory import MemoryAdapter
from broker.exceptions import ConfigurationError
from broker.jobs import ExecutionMode, Job, JobSpec, JobStatus, Outcome, Settlement
from broker.main.metrics import (
    MAX_LABEL_BYTES,
    MAX_LABEL_SETS,
    MAX_METRICS_BYTES,
    MainExposition,
    MainLevels,
    MainMetrics,
    MeasuredStore,
    label,
)
from broker.main.settings import MainSettings
from broker.model.bounds import MAX_QUEUE_SETTINGS
from broker.storage import QueueCount

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def handed_off_job(queue: str = "q", task: str = "t", waited: float = 2.0) -> Job:
    """A handed-off job of ``task`` on ``queue``, names that a store written before names
    had a bound may hold, longer than a ``JobSpec`` now accepts."""
    job = Job.from_spec(JobSpec(task="t", queue="q"), NOW)
    return Job(
        **{
            **{f: getattr(job, f) for f in job.__dataclass_fields__},
            "task": task,
            "queue": queue,
            "status": JobStatus.HANDED_OFF,
            "handoff_id": uuid.uuid4(),
            "handed_off_at": NOW + timedelta(seconds=waited),
        }
    )


def levels(**over: Any) -> MainLevels:
    base: dict[str, Any] = {
        "counts": [],
        "now": NOW,
        "leader": True,
        "workers": 0,
        "draining": 0,
        "credits": {},
        "in_flight": 0,
        "ledger": 0,
        "orphans": 0,
    }
    return MainLevels(**{**base, **over})


def test_outcomes_count_runs_and_deaths() -> None:
    metrics = MainMetrics()
    job = handed_off_job()
    lease = job.handoff_id
    assert lease is not None
    metrics.handed_off(job)
    later = NOW + timedelta(seconds=5)
    metrics.settled(job, Settlement(job.id, lease, Outcome.COMPLETE), later)
    metrics.settled(job, Settlement(job.id, lease, Outcome.FAIL, error="x", run_at=later), later)
    metrics.settled(job, Settlement(job.id, lease, Outcome.FAIL, error="x", run_at=None), later)
    metrics.settled(job, Settlement(job.id, lease, Outcome.RETURN), later)
    metrics.settled(None, Settlement(job.id, lease, Outcome.COMPLETE), later)
    got = samples(MainExposition(metrics).render(levels()))
    labels = frozenset({("queue", "q"), ("task", "t")})
    assert got[("broker_jobs_started_total", labels)] == 1
    assert got[("broker_jobs_completed_total", labels)] == 1
    assert got[("broker_jobs_failed_total", labels)] == 2
    assert got[("broker_jobs_dead_total", labels)] == 1
    assert got[("broker_job_wait_seconds_sum", frozenset({("queue", "q")}))] == 2.0
    complete = frozenset({("queue", "q"), ("outcome", "complete")})
    assert got[("broker_job_run_seconds_sum", complete)] == 3.0


def test_label_sets_are_bounded() -> None:
    metrics = MainMetrics()
    for n in range(MAX_LABEL_SETS + 50):
        metrics.enqueued.inc("q", f"task-{n}")
    got = samples(metrics.exposition())
    names = [labels for name, labels in got if name == "broker_jobs_enqueued_total"]
    assert len(names) == MAX_LABEL_SETS + 1
    assert (
        got[("broker_jobs_enqueued_total", frozenset({("queue", "_other"), ("task", "_other")}))]
        == 50
    )


def test_a_wait_counts_in_every_bucket_from_its_own_bound_up() -> None:
    """A bucket counts the observations at or below its bound (``le``), as Prometheus
    reads it; past :data:`MAX_LABEL_SETS` queues the rest count under ``"_other"``."""
    metrics = MainMetrics()
    for waited in (0.005, 0.0051, 7200.0):
        metrics.handed_off(handed_off_job(waited=waited))
    for n in range(MAX_LABEL_SETS + 2):
        metrics.handed_off(handed_off_job(queue=f"q{n}", waited=1.0))
    got = samples(metrics.exposition())

    def bucket(le: str, queue: str = "q") -> float:
        return got[("broker_job_wait_seconds_bucket", frozenset({("queue", queue), ("le", le)}))]

    assert [bucket("0.005"), bucket("0.01"), bucket("3600.0"), bucket("+Inf")] == [1, 2, 2, 3]
    assert got[("broker_job_wait_seconds_count", frozenset({("queue", "q")}))] == 3
    assert got[("broker_job_wait_seconds_sum", frozenset({("queue", "q")}))] == pytest.approx(
        7200.0101
    )
    assert bucket("1.0", "_other") == 3  # "q", then q0 to q998 fill the cap


def test_levels_show_depth_and_the_oldest_due_job() -> None:
    counts = [
        QueueCount("mail", JobStatus.QUEUED, 4, NOW - timedelta(minutes=3)),
        QueueCount("mail", JobStatus.COMPLETED, 9, None),
        QueueCount("later", JobStatus.QUEUED, 1, NOW + timedelta(hours=1)),
    ]
    exposition = MainExposition(MainMetrics())
    got = samples(
        exposition.render(
            levels(
                counts=counts, workers=2, ledger=3, credits={"inline": 5}, tasks_without_worker=1
            )
        )
    )
    assert got[("broker_queue_jobs", frozenset({("queue", "mail"), ("status", "queued")}))] == 4
    assert got[("broker_queue_jobs", frozenset({("queue", "mail"), ("status", "failed")}))] == 0
    age = ("broker_queue_oldest_eligible_age_seconds", frozenset({("queue", "mail")}))
    assert got[age] == 180.0
    assert got[("broker_queue_oldest_eligible_age_seconds", frozenset({("queue", "later")}))] == 0
    assert got[("broker_workers_connected", frozenset())] == 2
    assert got[("broker_recovery_ledger_size", frozenset())] == 3
    assert got[("broker_free_credits", frozenset({("mode", "inline")}))] == 5
    assert got[("broker_free_credits", frozenset({("mode", "forked")}))] == 0
    assert got[("broker_tasks_without_worker", frozenset())] == 1


def test_the_dashboard_stays_on_loopback_unless_allowed() -> None:
    """Off loopback the dashboard needs a read token or its own opt-out; the main port's
    ``allow_unauthenticated`` is not it, and the dashboard's opt-out lifts nothing on the
    main's port."""
    MainSettings(http_port=8080).validate()
    with pytest.raises(ConfigurationError, match="refusing to serve the dashboard"):
        MainSettings(http_host="0.0.0.0", http_port=8080, token="t").validate()
    with pytest.raises(ConfigurationError, match="--http-allow-unauthenticated"):
        MainSettings(http_host="0.0.0.0", http_port=8080, allow_unauthenticated=True).validate()
    MainSettings(http_host="0.0.0.0", http_port=8080, http_read_token="r").validate()
    MainSettings(http_host="0.0.0.0", http_port=8080, http_allow_unauthenticated=True).validate()
    with pytest.raises(ConfigurationError, match=r"refusing to listen on '0\.0\.0\.0'"):
        MainSettings(
            host="0.0.0.0", http_host="0.0.0.0", http_port=8080, http_allow_unauthenticated=True
        ).validate()
    with pytest.raises(ConfigurationError, match="http_port"):
        MainSettings(http_port=70000).validate()


def _longest(n: int, char: str) -> str:
    """A name that escapes to twice its length, far over the label bound."""
    return f"{n}" + char * 4000


def test_the_worst_exposition_stays_under_its_bound() -> None:
    """Every label set of every metric used, every label value at its length and made of
    characters that escape to two, and 3,000 queues of long names in the store: one
    ``/metrics`` answer still weighs under :data:`MAX_METRICS_BYTES`, and parses."""
    metrics = MainMetrics()
    counters = (
        metrics.enqueued,
        metrics.started,
        metrics.completed,
        metrics.failed,
        metrics.dead,
        metrics.cancelled,
    )
    for n in range(3 * MAX_LABEL_SETS):
        queue, task = _longest(n, '"'), _longest(n, "\\")
        for counter in counters:
            counter.inc(queue, task)
        job = handed_off_job(queue=queue, task=task)
        lease = job.handoff_id
        assert lease is not None
        metrics.handed_off(job)
        later = NOW + timedelta(seconds=5)
        metrics.settled(job, Settlement(job.id, lease, Outcome.COMPLETE), later)
        metrics.settled(job, Settlement(job.id, lease, Outcome.FAIL, error="x"), later)
    for operation in ("select", "claim", "settle", "checkpoint"):
        metrics.store_call(operation, 0.1, failed=True)
    counts = [
        QueueCount(_longest(n, '"'), status, 5, NOW - timedelta(seconds=n))
        for n in range(3000)
        for status in JobStatus
    ]
    flow = [
        {"queue": _longest(n, '"'), "paused": True, "rate_limit": "1/s", "token_wait_seconds": 0.5}
        for n in range(MAX_QUEUE_SETTINGS)
    ]
    text = MainExposition(metrics).render(levels(counts=counts, queue_flow=flow))
    assert len(text) < MAX_METRICS_BYTES
    got = samples(text)  # parsed once: the parser takes most of this test's time
    paused = [labels for name, labels in got if name == "broker_queue_paused"]
    assert len(paused) == MAX_LABEL_SETS
    depth = [labels for name, labels in got if name == "broker_queue_jobs"]
    assert len(depth) == (MAX_LABEL_SETS + 1) * len(JobStatus)
    other = frozenset({("queue", "_other"), ("status", "queued")})
    assert got[("broker_queue_jobs", other)] == 5 * (3000 - MAX_LABEL_SETS)
    for name, labels in got:
        for _, value in labels:
            assert len(value.encode()) <= MAX_LABEL_BYTES, name


def test_a_long_name_is_cut_to_the_label_bound_and_kept_apart_from_short_ones() -> None:
    assert label("mail") == "mail"
    exact = "é" * (MAX_LABEL_BYTES // 2)
    assert label(exact) == exact
    cut = label("é" * MAX_LABEL_BYTES)
    assert cut.endswith("…") and len(cut.encode()) <= MAX_LABEL_BYTES
    metrics = MainMetrics()
    metrics.enqueued.inc("q" * 10_000_000, "t")
    metrics.enqueued.inc("q" * 10_000_000, "t")
    [(key, count)] = metrics.enqueued.counts.items()
    assert count == 2 and len(key[0].encode()) <= MAX_LABEL_BYTES


class _StoreBeforeSkip(MemoryAdapter):
    """A user's adapter written before ``select_eligible`` took ``skip``."""

    async def select_eligible(  # type: ignore[override]
        self,
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        limit: int = 100,
    ) -> list[Job]:
        return await super().select_eligible(modes=modes, queues=queues, limit=limit)


async def test_a_store_without_skip_is_read_past_the_skipped_jobs() -> None:
    """Dispatch passes ``skip``; an adapter that does not take it still gets the same
    answer (the jobs after the skipped ones, up to ``limit``), not a TypeError per pass."""
    store = _StoreBeforeSkip()
    jobs = [r.job for r in await store.enqueue_many([JobSpec(task="t") for _ in range(5)])]
    measured = MeasuredStore(store, MainMetrics())
    found = await measured.select_eligible(
        modes=list(ExecutionMode), limit=2, skip=[jobs[0].id, jobs[2].id]
    )
    assert [j.id for j in found] == [jobs[1].id, jobs[3].id]
