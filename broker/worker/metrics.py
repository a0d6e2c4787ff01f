"""A worker's Prometheus metrics, served by its metrics server (:mod:`broker.ops.web`).

All are levels, read at scrape time from what the worker already holds: nothing to keep
in step, nothing on the hot path. Names and labels are the worker's own (its modes), so
they need none of the main's label bounds (:mod:`broker.main.metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(eq=False)
class WorkerLevels(Collector):
    """A worker's metrics, all read at scrape time from ``status()`` (``Worker.status``):
    its running jobs, and per mode its slots, busy slots and children, with the child
    starts, crashes and recycles its runners count."""

    status: Callable[[], Mapping[str, Any]]
    registry: CollectorRegistry = field(init=False)

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        status = self.status()
        yield GaugeMetricFamily(
            "broker_worker_connected", "1 while connected to a main.", value=status["connected"]
        )
        yield GaugeMetricFamily(
            "broker_worker_draining", "1 while draining.", value=status["draining"]
        )
        yield GaugeMetricFamily(
            "broker_worker_running_jobs", "Jobs running on this worker.", value=status["running"]
        )
        yield GaugeMetricFamily(
            "broker_worker_outbox", "Reports waiting for the main's ack.", value=status["outbox"]
        )
        slots = GaugeMetricFamily("broker_worker_slots", "Slots by mode.", labels=["mode"])
        busy = GaugeMetricFamily("broker_worker_busy_slots", "Busy slots by mode.", labels=["mode"])
        alive = GaugeMetricFamily(
            "broker_worker_children_alive", "Child processes alive, by mode.", labels=["mode"]
        )
        counters = {
            key: CounterMetricFamily(f"broker_worker_child_{key}", text, labels=["mode"])
            for key, text in (
                ("starts", "Child processes started, by mode."),
                ("crashes", "Child processes that died unasked (a crash, a kill), by mode."),
                ("recycles", "Pooled children retired for their job count, memory or age."),
            )
        }
        for mode, runner in sorted(status["runners"].items()):
            slots.add_metric([mode], runner.capacity)
            busy.add_metric([mode], runner.busy)
            details = runner.details
            if "children_alive" in details:
                alive.add_metric([mode], details["children_alive"])
            for key, family in counters.items():
                if f"child_{key}" in details:
                    family.add_metric([mode], details[f"child_{key}"])
        yield from (slots, busy, alive, *counters.values())

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
