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
import tempfile
import urllib.request
from pathlib import Path

from bench.__main__ import checkpoint_postgres
from bench.harness import Config, Runner
from bench.peers import broker_peer
from bench.peers.broker_peer import free_port


def store_timings(port: int) -> dict[str, tuple[float, float]]:
    """``operation -> (calls, seconds)`` from the main's ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as answer:
        text = answer.read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for prefix, into in (
            ("broker_store_seconds_sum", sums),
            ("broker_store_seconds_count", counts),
        ):
            if line.startswith(prefix + "{"):
                labels, value = line.rsplit(" ", 1)
                into[labels[len(prefix) :]] = float(value)
    return {op: (counts[op], sums.get(op, 0.0)) for op in counts}


def main(argv: list[str]) -> int:
    name, reps = argv[0], int(argv[1])
    http_port = free_port()
    broker_peer.MAIN_FLAGS = (*broker_peer.MAIN_FLAGS, "--http-port", str(http_port))
    workdir = Path(tempfile.mkdtemp(prefix=f"producers-{name}-"))
    cfg = Config(workdir=str(workdir), hash_rounds=1000)
    driver = broker_peer.DRIVERS[name](name, cfg)
    runner = Runner(driver, cfg, workdir / "out.json")
    before: list[dict[str, tuple[float, float]]] = []
    reset = driver.reset

    def reset_and_read() -> None:  # the workload resets the main: read it right after
        reset()
        before.append(store_timings(http_port))

    driver.reset = reset_and_read  # type: ignore[method-assign]
    driver.setup()
    try:
        for _ in range(reps):
            if error := checkpoint_postgres():
                print(error, file=sys.stderr)
            run = runner.producers(cfg.producer_jobs)
            after, start = store_timings(http_port), before[-1]
            calls = []
            for op, (n, seconds) in sorted(after.items()):
                n0, s0 = start.get(op, (0.0, 0.0))
                if n > n0:
                    calls.append(f"{op} {n - n0:.0f} x {(seconds - s0) / (n - n0) * 1e3:.2f} ms")
            print(
                f"{name}: drain {run['per_s']:,.0f} jobs/s; enqueue p50 "
                f"{run['enqueue_p50_ms']:.2f} ms, p99 {run['enqueue_p99_ms']:.2f} ms; "
                + ", ".join(calls),
                flush=True,
            )
    finally:
        driver.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
