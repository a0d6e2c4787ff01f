"""The producers workload alone, for quick A/B comparisons between two checkouts.

``make bench`` runs it as one workload among many; a change that touches the main's
request path or its handoff core is judged by running this with the old and the new
code in turn, several times (run-to-run spread on a shared 2-core machine is wide):

    PYTHONPATH=<checkout> .venv/bin/python -m bench.producers_ab broker-postgres-defaults 3

Each run is the harness's own producers workload (the same backlog, 200 producers,
rate, workers and timing as ``make bench``), after a PostgreSQL ``CHECKPOINT``, with the
main's dashboard port open so that its own store timings (``broker_store_seconds``, per
operation) can be read before and after. Prints one line per run: the drain rate, the
enqueues' p50 and p99, and the mean time of each store call the main made meanwhile.
"""

from __future__ import annotations

import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.drain_ab import repeat
from bench.harness import Runner
from bench.peers import broker_peer
from bench.peers.broker_peer import free_port


def store_timings(port: int) -> dict[str, tuple[float, float]]:
    """``operation -> (calls, seconds)`` of ``broker_store_seconds`` from the main's
    ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as answer:
        text = answer.read().decode()
    calls: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "broker_store_seconds":
            continue
        for sample in family.samples:
            into = {"_count": calls, "_sum": seconds}.get(sample.name[len(family.name) :])
            if into is not None:
                into[sample.labels["operation"]] = sample.value
    return {op: (n, seconds.get(op, 0.0)) for op, n in calls.items()}


def main(argv: list[str]) -> int:
    name, reps = argv[0], int(argv[1])
    http_port = free_port()
    broker_peer.MAIN_FLAGS = (*broker_peer.MAIN_FLAGS, "--http-port", str(http_port))
    before: dict[str, tuple[float, float]] = {}

    def producers(runner: Runner) -> str:
        driver = runner.d
        reset = driver.reset

        def reset_and_read() -> None:  # the workload starts a fresh main: read it then
            reset()
            before.clear()
            before.update(store_timings(http_port))

        driver.reset = reset_and_read  # type: ignore[method-assign]
        try:
            run = runner.producers(runner.cfg.producer_jobs)
        finally:
            driver.reset = reset  # type: ignore[method-assign]
        calls = []
        for op, (n, seconds) in sorted(store_timings(http_port).items()):
            n0, s0 = before.get(op, (0.0, 0.0))
            if n > n0:
                calls.append(f"{op}: {n - n0:.0f} x {(seconds - s0) / (n - n0) * 1e3:.2f} ms")
        return (
            f"{name}: drain {run['per_s']:,.0f} jobs/s; enqueue p50 "
            f"{run['enqueue_p50_ms']:.2f} ms, p99 {run['enqueue_p99_ms']:.2f} ms; "
            + ", ".join(calls)
        )

    repeat(name, reps, producers, prefix="producers")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
