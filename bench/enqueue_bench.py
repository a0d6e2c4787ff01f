"""The enqueue path alone: one job a call, then bulk, with CPU per job per process.

    .venv/bin/python -m bench.enqueue_bench broker-postgres [--one 1000] [--bulk 4000] [--direct]
    .venv-peers/pgqueuer/bin/python -m bench.enqueue_bench pgqueuer

Each run uses the system's own ``make bench`` driver (``bench/peers/``), so the
producer is the one the drain workload times: a fresh store, then ``--one`` no-op
jobs enqueued one call at a time, then ``--bulk`` in bulk. For each phase it prints
the rate and the CPU per job of the producer (this process), the broker's main, and
the PostgreSQL backends connected to the system's database (from
``/proc/PID/schedstat``, nanoseconds), plus the whole server's (walwriter,
checkpointer and other sessions' work included: noisy on a shared machine).

Throughput is noisy on a loaded machine; CPU per job per process much less so. To
compare two versions, interleave their runs (A, B, A, B) in the same minute.
Standard library only, besides the drivers' own imports.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.harness import Config, service_pids

DRIVER_MODULES = {
    "broker-postgres": "bench.peers.broker_peer",
    "broker-postgres-defaults": "bench.peers.broker_peer",
    "pgqueuer": "bench.peers.pgqueuer_peer",
}


def schedstat(pid: int) -> float:
    """CPU seconds ``pid`` has run, to the nanosecond; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except OSError:
        return 0.0


def _server_pids() -> list[int]:
    """Every process of the PostgreSQL server: the postmaster and its children."""
    tops = service_pids("postgres")
    out = list(tops)
    for top in tops:
        try:
            with open(f"/proc/{top}/task/{top}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except OSError:
            pass
    return out


def backends(database: str) -> list[int]:
    """The server processes connected to ``database``."""
    rows = subprocess.run(
        [
            "psql",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-d",
            "test",
            "-Atc",
            f"SELECT pid FROM pg_stat_activity WHERE datname = '{database}'",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [int(p) for p in rows]


class Meter:
    """CPU seconds of each process group between :meth:`start` and :meth:`stop`."""

    def __init__(self, main_pids: list[int], database: str) -> None:
        self.main_pids = main_pids
        self.database = database

    def _read(self) -> dict[str, float]:
        return {
            "producer": time.process_time(),
            "main": sum(schedstat(p) for p in self.main_pids),
            "pg_backends": sum(schedstat(p) for p in self.backends),
            "pg_all": sum(schedstat(p) for p in _server_pids()),
        }

    def start(self) -> None:
        self.backends = backends(self.database)
        self.before = self._read()
        self.wall = time.perf_counter()

    def stop(self, jobs: int) -> dict[str, float]:
        wall = time.perf_counter() - self.wall
        self.backends = sorted(set(self.backends) | set(backends(self.database)))
        after = self._read()
        out = {"per_s": jobs / wall}
        for key, value in after.items():
            out[f"{key}_us"] = (value - self.before[key]) / jobs * 1e6
        return out


class Profiler:
    """``py-spy record`` of the producer and the main while a phase runs (``--profile``),
    as collapsed stacks (``--format raw``): one file per process and phase."""

    def __init__(self, directory: str | None, main_pids: list[int]) -> None:
        self.directory = directory
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        # py-spy beside this interpreter (pip install py-spy in .venv), else on PATH
        self.py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
        self.targets = {"producer": os.getpid()}
        if main_pids:
            self.targets["main"] = main_pids[0]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, phase: str) -> None:
        if self.directory is None:
            return
        for name, pid in self.targets.items():
            out = os.path.join(self.directory, f"{name}-{phase}.txt")
            command = [self.py_spy, "record", "--pid", str(pid), "--rate", "500"]
            command += ["--format", "raw", "--nonblocking", "-o", out]
            self.procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            proc.wait()
        self.procs = []


class _Phases:
    """Each phase of one repetition, timed, metered and (with ``--profile``) profiled."""

    def __init__(self, system: str, meter: Meter, profiler: Profiler) -> None:
        self.system, self.meter, self.profiler = system, meter, profiler
        self.rows: list[dict[str, Any]] = []

    def run(self, phase: str, jobs: int, work: Callable[[], object]) -> None:
        """``work``, of ``jobs`` jobs, as ``phase``; a phase of no jobs is left out, not
        divided by zero."""
        if not jobs:
            return
        self.profiler.start(phase)
        self.meter.start()
        work()
        self.rows.append({"system": self.system, "phase": phase, **self.meter.stop(jobs)})
        self.profiler.stop()


async def _crowd(driver: Any, producers: int, jobs: int) -> None:
    """``jobs`` enqueued one call at a time by ``producers`` concurrent producers, each
    connected as the ``make bench`` producers workload connects them
    (``Driver.open_producer``: a broker ``Client`` each; PgQueuer's share a pool)."""
    import asyncio

    opened = [await driver.open_producer() for _ in range(producers)]
    try:

        async def produce(enqueue: Callable[[], Any], count: int) -> None:
            for _ in range(count):
                await enqueue()

        share, extra = divmod(jobs, producers)
        await asyncio.gather(
            *(produce(enqueue, share + (i < extra)) for i, (enqueue, _) in enumerate(opened))
        )
    finally:
        for _, close in opened:
            closed = close()
            if asyncio.iscoroutine(closed):
                await closed


def run(
    system: str,
    one: int,
    bulk: int,
    reps: int,
    profile: str | None = None,
    direct: bool = False,
    concurrent: Sequence[int] = (),
) -> list[dict[str, Any]]:
    module = __import__(DRIVER_MODULES[system], fromlist=["DRIVERS"])
    workdir = tempfile.mkdtemp(prefix="enqueue-bench-")
    driver = module.DRIVERS[system](system, Config(workdir=workdir, hash_rounds=1))
    database = module.DATABASE
    driver.setup()
    results: list[dict[str, Any]] = []
    try:
        for _ in range(reps):
            driver.reset()
            driver.enqueue_one("noop", -1)  # connected and warm: the first call's set-up
            driver.enqueue_bulk("noop", [-1] * 10)
            meter = Meter(driver.main_pids(), database)
            phases = _Phases(system, meter, Profiler(profile, driver.main_pids()))
            phases.run("one", one, lambda: [driver.enqueue_one("noop", i) for i in range(one)])
            if one and direct and hasattr(driver, "enqueue_one_direct"):
                # Not through the main: the producer's own connection, straight to the
                # store (a phase of its own, never reported as the via-main figure).
                driver.enqueue_one_direct("noop", -1)  # connected and warm
                phases.run(
                    "one-direct",
                    one,
                    lambda: [driver.enqueue_one_direct("noop", i) for i in range(one)],
                )
            for crowd in concurrent if one else ():
                phases.run(f"one-x{crowd}", one, lambda n=crowd: driver.run(_crowd(driver, n, one)))
            phases.run("bulk", bulk, lambda: driver.enqueue_bulk("noop", list(range(bulk))))
            if bulk and direct and hasattr(driver, "enqueue_bulk_direct"):
                driver.enqueue_bulk_direct("noop", [-1] * 10)  # warm
                phases.run(
                    "bulk-direct",
                    bulk,
                    lambda: driver.enqueue_bulk_direct("noop", list(range(bulk))),
                )
            results += phases.rows
    finally:
        driver.teardown()
        shutil.rmtree(workdir, ignore_errors=True)  # the SQLite files and the main's log
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("system", choices=sorted(DRIVER_MODULES))
    p.add_argument("--one", type=int, default=1000, help="jobs enqueued one call at a time")
    p.add_argument("--bulk", type=int, default=4000, help="jobs enqueued in bulk")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(
        "--profile", metavar="DIR", help="py-spy the producer and the main into DIR (collapsed)"
    )
    p.add_argument(
        "--direct",
        action="store_true",
        help="broker on PostgreSQL: also enqueue --one jobs one at a time straight to the "
        "store, on the producer's own asyncpg connection (phase one-direct), as a PgQueuer "
        "client does; the phase 'one' stays the via-main figure; and --bulk jobs in one "
        "enqueue_many_in_async call on that connection (phase bulk-direct)",
    )
    p.add_argument(
        "--concurrent",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        metavar="N[,N...]",
        help="also enqueue --one jobs one call at a time from N concurrent producers in this "
        "process (phase one-xN, one phase for each N), each connected as make bench's "
        "producers are",
    )
    args = p.parse_args()
    rows = run(
        args.system, args.one, args.bulk, args.reps, args.profile, args.direct, args.concurrent
    )
    for row in rows:
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        cells = " ".join(f"{k}={v:,.1f}" for k, v in row.items() if isinstance(v, float))
        print(f"{row['system']:<26} {row['phase']:<10} {cells}", flush=True)


if __name__ == "__main__":
    main()
