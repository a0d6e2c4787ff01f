"""The floor of a one-at-a-time enqueue through a main: what an extra process costs.

    .venv/bin/python -m bench.enqueue_floor [--jobs 3000] [--reps 3]

Issue 10 asks for one-at-a-time enqueue at PgQueuer's rate, and PgQueuer's producer
writes straight into PostgreSQL; a broker client's request passes broker-main first.
This measures how fast that path could be at best, in turns, ``--reps`` times each:

* **direct**: the main's own store write of one job (``enqueue_on_driver_connection``,
  the statement and the row building of the adapter), called in this process on an
  asyncpg connection: what ``broker.enqueue_in_async`` costs without its checks;
* **relay**: the same write behind a relay that does nothing else: a child process
  whose ``asyncio.Protocol`` reads a line, runs the write in a task, and answers a line;
  this process sends a line and waits for the answer, one job at a time.

The relay is the least a main can add: no decoding, checks, catalog, group commit or
reply encoding. In the same turns it also runs, each in a process of its own,

* **pgqueuer**: PgQueuer's one-at-a-time enqueue (``bench.enqueue_bench pgqueuer``, in
  its ``.venv-peers`` environment; left out when that environment is missing);
* **main**: the broker's own, through a real broker-main (``bench.enqueue_bench
  broker-postgres-defaults``),

so the four rates come from the same minutes of a noisy machine. Where the relay alone
does not beat PgQueuer, no main on this design can. Each path's CPU per job is read too,
per process: the producer, the process between it and the store (the relay, the main)
and the PostgreSQL backends serving them. One at a time, the three run in turn, so
their CPU adds up to most of each enqueue's wall time, and it shows which process a
faster path would have to save in. ``make bench`` runs this (unless ``--no-floor``) and
``bench/report.py`` shows the medians (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]

from bench.__main__ import venv_python
from bench.enqueue_bench import backends, schedstat
from bench.harness import ROOT
from bench.report import median_cpu
from bench.systems import BY_NAME, database, fresh_database, on_admin_database, postgres_dsn

DATABASE = database("bench_enqueue_floor")
TASK = "bench.jobs.noop"
MAIN_ROW = "broker-postgres-defaults"
"""The ``make bench`` row whose main the floor's ``main`` path measures."""

Cpu = dict[str, float]
"""CPU microseconds per job of ``producer``, ``between`` (the relay or the main; absent
where nothing is) and ``store`` (the PostgreSQL backends of the path's connections)."""


class _Meter:
    """The CPU of this process, of the process between (if any) and of the backends
    connected to the database, over one path's timed jobs."""

    def __init__(self, between: int | None = None) -> None:
        self.between = between
        self.start = self._read()

    def _read(self) -> Cpu:
        cpu = {"producer": time.process_time(), "store": sum(map(schedstat, backends(DATABASE)))}
        if self.between is not None:
            cpu["between"] = schedstat(self.between)
        return cpu

    def per_job(self, jobs: int) -> Cpu:
        end = self._read()
        return {key: (end[key] - self.start[key]) / jobs * 1e6 for key in end}


def _store() -> Any:
    from adapters.sql import SQLAlchemyAdapter

    url = postgres_dsn(DATABASE).replace("postgresql://", "postgresql+asyncpg://")
    return SQLAlchemyAdapter(url)


async def _write_one(store: Any, conn: Any, arg: int) -> None:
    from broker.jobs import JobSpec

    await store.enqueue_on_driver_connection(conn, [JobSpec(task=TASK, args=(arg,))])


class _Relay(asyncio.Protocol):
    """A line in, the job written, a line out; nothing else."""

    def __init__(self, store: Any, conn: Any) -> None:
        self.store, self.conn = store, conn
        self.buffer = b""
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        for line in lines:
            task = asyncio.ensure_future(self._answer(int(line)))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _answer(self, arg: int) -> None:
        await _write_one(self.store, self.conn, arg)
        self.transport.write(b"ok\n")


async def _serve() -> None:
    store = _store()
    conn = await asyncpg.connect(postgres_dsn(DATABASE))
    server = await asyncio.get_running_loop().create_server(
        lambda: _Relay(store, conn), "127.0.0.1", 0
    )
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()  # until the parent kills this process


async def _direct(jobs: int) -> tuple[float, Cpu]:
    store = _store()
    conn = await asyncpg.connect(postgres_dsn(DATABASE))
    try:
        for i in range(200):  # warm: the statement prepared, the code paths hot
            await _write_one(store, conn, i)
        meter = _Meter()
        start = time.perf_counter()
        for i in range(jobs):
            await _write_one(store, conn, i)
        return jobs / (time.perf_counter() - start), meter.per_job(jobs)
    finally:
        await conn.close()


async def _through(relay: int, port: int, jobs: int) -> tuple[float, Cpu]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i in range(200):
            writer.write(b"%d\n" % i)
            await reader.readline()
        meter = _Meter(relay)
        start = time.perf_counter()
        for i in range(jobs):
            writer.write(b"%d\n" % i)
            await reader.readline()
        return jobs / (time.perf_counter() - start), meter.per_job(jobs)
    finally:
        writer.close()


async def _fresh_database() -> None:
    await on_admin_database(*fresh_database(DATABASE))
    store = _store()
    await store.setup()
    await store.close()


def _one_at_a_time(python: Path, system: str, jobs: int) -> tuple[float, Cpu]:
    """``system``'s one-at-a-time rate and CPU per job from ``bench.enqueue_bench``, in a
    process of its own."""
    options = ["--one", str(jobs), "--bulk", "0", "--json"]
    done = subprocess.run(
        [str(python), "-m", "bench.enqueue_bench", system, *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    row = next(r for r in rows if r["phase"] == "one")
    cpu = {"producer": row["producer_us"], "store": row["pg_backends_us"]}
    if row["main_us"]:
        cpu["between"] = row["main_us"]
    return float(row["per_s"]), cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=3000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the rates here")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(_serve())
        return
    asyncio.run(_fresh_database())
    relay = subprocess.Popen(
        [sys.executable, "-m", "bench.enqueue_floor", "--serve"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert relay.stdout is not None
        port = int(relay.stdout.readline())
        paths: dict[str, Callable[[], tuple[float, Cpu]]] = {
            "direct": lambda: asyncio.run(_direct(args.jobs)),
            "relay": lambda: asyncio.run(_through(relay.pid, port, args.jobs)),
            "main": lambda: _one_at_a_time(Path(sys.executable), MAIN_ROW, args.jobs),
        }
        pgqueuer = venv_python(BY_NAME["pgqueuer"])
        if pgqueuer.exists():
            paths["pgqueuer"] = lambda: _one_at_a_time(pgqueuer, "pgqueuer", args.jobs)
        rates: dict[str, list[float]] = {name: [] for name in paths}
        cpu: dict[str, list[Cpu]] = {name: [] for name in paths}
        for _ in range(args.reps):
            for name, path in paths.items():
                rate, used = path()
                rates[name].append(rate)
                cpu[name].append(used)
        for name, values in rates.items():
            runs = ", ".join(f"{v:,.0f}" for v in values)
            medians = ", ".join(f"{k} {v:,.0f}" for k, v in median_cpu(cpu[name]).items())
            print(
                f"{name:8} median {statistics.median(values):,.0f} jobs/s ({runs}); "
                f"CPU us/job: {medians}"
            )
    finally:
        relay.kill()
        relay.wait()
    if args.json is not None:
        generated = datetime.now(UTC).isoformat(timespec="seconds")
        record = {
            "generated": generated,
            "jobs": args.jobs,
            "reps": args.reps,
            "rates": rates,
            "cpu_us": cpu,
        }
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
