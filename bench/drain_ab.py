"""Drain runs alone, for quick A/B comparisons between two checkouts or against a peer.

``make bench`` runs every workload of every system (about 12 minutes); a change to the
hot path is judged faster by draining the same backlog with the old and the new code in
turn, several times, on a quiet machine: run-to-run spread here is about ±10%, so one
pair proves little. Each run is the harness's own drain workload (the same backlog,
workers, timing and CPU accounting as ``make bench``), after a PostgreSQL ``CHECKPOINT``.

    .venv/bin/python -m bench.drain_ab broker-postgres-defaults 5000 3
    .venv-peers/pgqueuer/bin/python -m bench.drain_ab pgqueuer 5000 3

Run it with ``PYTHONPATH`` set to the checkout to measure: the main and the workers it
starts import the broker from there (the harness puts its own tree first). Prints one
line per run: jobs per second, and CPU per job of each process in ms.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.__main__ import checkpoint_postgres
from bench.harness import Config, Driver, Runner
from bench.systems import BY_NAME


def repeat(name: str, reps: int, one: Callable[[Runner], str], prefix: str = "drain") -> None:
    """Run ``one(runner)`` ``reps`` times on a fresh driver of the system ``name``, each
    after a PostgreSQL ``CHECKPOINT``, printing the line each run returns (the drain
    here, the producers workload in :mod:`bench.producers_ab`)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{prefix}-{name}-"))
    cfg = Config(workdir=str(workdir), hash_rounds=1000)
    driver: Driver = importlib.import_module(BY_NAME[name].module).DRIVERS[name](name, cfg)
    runner = Runner(driver, cfg, workdir / "out.json")
    driver.setup()
    try:
        for _ in range(reps):
            if error := checkpoint_postgres():
                print(error, file=sys.stderr)
            print(one(runner), flush=True)
    finally:
        driver.teardown()


def main(argv: list[str]) -> int:
    name, jobs, reps = argv[0], int(argv[1]), int(argv[2])

    def drain(runner: Runner) -> str:
        run = runner.drain("noop", jobs, 0)
        per_job = {
            part: run[f"{part}_cpu_s"] / run["done"] * 1e3
            for part in ("main", "worker_own", "children", "server")
        }
        return f"{name}: {run['per_s']:,.0f} jobs/s; ms/job " + ", ".join(
            f"{part} {ms:.3f}" for part, ms in per_job.items()
        )

    repeat(name, reps, drain)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
