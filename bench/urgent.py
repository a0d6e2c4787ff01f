"""Urgent jobs during a drain: enqueue-to-start of a high-priority job while the workers
drain a backlog of lower-priority ones (issue 35), side by side with PgQueuer.

    .venv/bin/python -m bench.urgent [--systems broker-postgres-defaults,pgqueuer]
        [--backlog 100000] [--reps 3] [--before DIR] [--worker-flags FLAGS]

A run: ``backlog`` no-op jobs of priority 0 enqueued in bulk, the table analyzed
(``Driver.analyze``: ``VACUUM ANALYZE``, as ``bench.scale`` does), the workers started, and
from the first job's start one no-op job of priority :data:`URGENT` enqueued one call at
a time every :data:`PROBE_INTERVAL` seconds (each tagged: its body writes when it
starts) until :data:`DRAINED` of the backlog is complete, so every probe meets a backlog
(and a worker's prefetch window full of it). Reported per run: the probes'
enqueue-to-start p50 and p99 (from just before the enqueue call to the job body
starting, as the latency workload measures it), and the backlog's drain rate meanwhile.

The systems take turns, one repetition of each, then the next (see ``bench/README.md``);
each runs in its own virtual environment (``.venv-peers/`` for the peers, which ``python
-m bench`` installs) as ``python -m bench.urgent --one SYSTEM BACKLOG``, which prints one
JSON line. ``--before DIR`` adds the broker's rows once more, run from another tree of the
project (an export, ``git archive main | tar -x -C DIR``: its broker, this bench, which
is copied over its ``bench/``), named ``SYSTEM@before``. ``--worker-flags`` adds flags
to the broker's workers (``"--prefetch 0"``, say). The summary gives the median of the
runs and, pooled over them, the probes' p50 and p99.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import ROOT, BenchError, Config, Driver, Runner, percentile
from bench.systems import BY_NAME, DATABASE_SUFFIX, venv_python

URGENT = 10
"""The probes' priority; the backlog's is 0 (higher runs first, on every system here)."""
PROBE_INTERVAL = 0.025
"""Seconds between two probes: 40 a second, a trickle beside the drain."""
DRAINED = 0.9
"""The share of the backlog complete when the probes stop: none meets an empty queue."""
WORKER_FLAGS = "BENCH_URGENT_WORKER_FLAGS"
"""Environment variable: flags added to the broker's workers (``--prefetch 0``, say),
for trying a setting without a row of its own (``--worker-flags``)."""


def urgent_run(runner: Runner, backlog: int) -> dict[str, Any]:
    """One run of the workload on ``runner``'s system (see the module docstring)."""
    d, cfg = runner.d, runner.cfg
    d.reset()
    marks, log = runner._paths("urgent")
    d.enqueue_bulk("noop", [-1] * backlog)
    d.analyze()
    workers = runner._start_workers(marks, log)
    sent: dict[int, float] = {}
    acked: list[float] = []
    """Each probe's enqueue call, in ms: the part of its wait before the system has it."""
    try:
        deadline = time.monotonic() + cfg.run_timeout
        while marks.stat().st_size == 0:
            workers.check()
            if time.monotonic() > deadline:
                raise BenchError(f"no job started within {cfg.run_timeout:.0f} s: {workers.tail()}")
            time.sleep(0.005)
        first = time.time()
        done_at_first = d.done_count()
        next_at = time.perf_counter()
        tag = 0
        done = done_at_first
        while done < DRAINED * backlog and time.monotonic() < deadline:
            pause = next_at - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            sent[tag] = time.time()
            d.enqueue_urgent("noop", tag, URGENT)
            acked.append(1000 * (time.time() - sent[tag]))
            tag += 1
            next_at = max(next_at + PROBE_INTERVAL, time.perf_counter())
            if tag % 8 == 0:
                done = d.done_count()
                workers.check()
        drained_s = time.time() - first
        drain_done = d.done_count() - done_at_first
        runner._wait_done(workers, cfg.run_timeout)
        handed = getattr(d, "handed_off_times", lambda priority: {})(URGENT)
    finally:
        workers.stop()
    starts: dict[int, float] = {}
    for line in marks.read_text().splitlines():
        if line.startswith("L "):
            _, tag_text, at = line.split()
            starts[int(tag_text)] = float(at)
    start_ms = [1000 * (starts[t] - at) for t, at in sent.items() if t in starts]
    return {
        "system": d.name,
        "backlog": backlog,
        "probes": len(sent),
        "started": len(start_ms),
        "start_p50_ms": percentile(start_ms, 50),
        "start_p99_ms": percentile(start_ms, 99),
        "start_max_ms": max(start_ms, default=None),
        "start_ms": [round(ms, 3) for ms in start_ms],
        "enqueue_p50_ms": percentile(acked, 50),
        # The broker only: enqueue call to the claim that handed the job to a worker (the
        # main's part), and from there to the job's start (the worker's part, the send
        # included).
        "claimed_p50_ms": percentile([1000 * (handed[t] - sent[t]) for t in handed], 50),
        "claimed_to_start_p50_ms": percentile(
            [1000 * (starts[t] - handed[t]) for t in handed if t in starts], 50
        ),
        "drain_per_s": drain_done / drained_s if drained_s > 0 else None,
    }


def one(name: str, backlog: int) -> int:
    """Run the workload once for ``name`` in this process's environment; print it as JSON."""
    from bench.__main__ import checkpoint_postgres

    workdir = Path(tempfile.mkdtemp(prefix=f"urgent-{name}-"))
    cfg = Config(workdir=str(workdir), hash_rounds=1000, run_timeout=300.0)
    driver: Driver = importlib.import_module(BY_NAME[name].module).DRIVERS[name](name, cfg)
    if extra := os.environ.get(WORKER_FLAGS, "").split():
        driver.row = dataclasses.replace(driver.row, flags=(*driver.row.flags, *extra))  # type: ignore[attr-defined]
    runner = Runner(driver, cfg, workdir / "out.json")
    driver.setup()
    try:
        if error := checkpoint_postgres():
            print(error, file=sys.stderr)
        print(json.dumps(urgent_run(runner, backlog)), flush=True)
    finally:
        driver.teardown()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _python(name: str) -> str:
    python = venv_python(BY_NAME[name])
    if not python.exists():
        raise SystemExit(f"{python} is missing: `python -m bench --systems {name}` installs it")
    return str(python)


def summary(runs: list[dict[str, Any]]) -> str:
    """A table: per row, the median of the runs' p50, p99 and drain rate, and the p50
    and p99 of every probe of every run pooled."""
    lines = [
        "| system | runs | probes | p50 ms (median of runs) | p99 ms (median of runs) "
        "| pooled p50 / p99 ms | drain /s (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    rows: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        rows.setdefault(run["row"], []).append(run)
    for row, its in rows.items():
        pooled = [ms for run in its for ms in run["start_ms"]]
        lines.append(
            f"| {row} | {len(its)} | {len(pooled)} "
            f"| {statistics.median(r['start_p50_ms'] for r in its):.1f} "
            f"| {statistics.median(r['start_p99_ms'] for r in its):.1f} "
            f"| {percentile(pooled, 50):.1f} / {percentile(pooled, 99):.1f} "
            f"| {statistics.median(r['drain_per_s'] for r in its):,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        return one(argv[1], int(argv[2]))
    parser = argparse.ArgumentParser(prog="python -m bench.urgent")
    parser.add_argument("--systems", default="broker-postgres-defaults,pgqueuer")
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--before", type=Path, help="an export of another commit: its broker's rows too"
    )
    parser.add_argument("--out", type=Path, help="write every run as JSON lines here")
    parser.add_argument("--worker-flags", default="", help="added to the broker's workers")
    args = parser.parse_args(argv)
    rows: list[tuple[str, str, Path]] = []
    for name in args.systems.split(","):
        rows.append((name, name, ROOT))
        if args.before is not None and BY_NAME[name].venv is None:
            rows.append((f"{name}@before", name, args.before.resolve()))
    if args.before is not None:
        # The other checkout runs this bench (its drivers, this workload) on its own broker.
        if (args.before / ".git").exists():
            raise SystemExit(f"{args.before}: give an export (git archive), not a checkout")
        shutil.copytree(ROOT / "bench", args.before / "bench", dirs_exist_ok=True)
    env = {**os.environ, DATABASE_SUFFIX: f"_urgent{os.getpid()}", WORKER_FLAGS: args.worker_flags}
    runs: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for row, name, checkout in rows:
            command = [_python(name), "-m", "bench.urgent", "--one", name, str(args.backlog)]
            done = subprocess.run(
                command,
                cwd=checkout,
                env={**env, "PYTHONPATH": str(checkout)},
                capture_output=True,
                text=True,
            )
            if done.returncode != 0 or not done.stdout.strip():
                print(f"{row} rep {rep + 1} failed: {done.stderr[-800:]}", file=sys.stderr)
                continue
            run = {**json.loads(done.stdout.strip().splitlines()[-1]), "row": row}
            runs.append(run)
            print(
                f"{row} rep {rep + 1}: p50 {run['start_p50_ms']:.1f} ms, "
                f"p99 {run['start_p99_ms']:.1f} ms over {run['started']} probes "
                f"(enqueue call p50 {run['enqueue_p50_ms']:.1f} ms"
                + (
                    f", claimed p50 {run['claimed_p50_ms']:.1f} ms, claimed to start p50 "
                    f"{run['claimed_to_start_p50_ms']:.1f} ms"
                    if run["claimed_p50_ms"] is not None
                    else ""
                )
                + "), "
                f"drain {run['drain_per_s']:,.0f}/s",
                file=sys.stderr,
                flush=True,
            )
            if args.out is not None:
                with args.out.open("a") as out:
                    out.write(json.dumps(run) + "\n")
    print(summary(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
