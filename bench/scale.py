"""Scale: the drain on top of a deep backlog, by key count, by worker count and over many
queues, side by side with PgQueuer (issue 35, items 2, 3 and 7, and its "everything that
leads today still leads": 1,000 queues, 64 workers).

    .venv/bin/python -m bench.scale [--backlog 1000000] [--jobs 20000] [--reps 3]
        [--keys 1000,30000] [--keyed-jobs 30000] [--workers 1x64,1x1,64x1] [--worker-jobs 20000]
        [--queues 1000] [--fleet 64] [--parts drain,keyed,workers,queues,fleet]
        [--out bench/results]
    .venv/bin/python -m bench.scale --report bench/results   # scale.md, .png from scale.json

Rows, each run ``--reps`` times (the median is the figure, every run is kept):

- **drain** (``broker-postgres-defaults`` and ``pgqueuer``, in alternating turns): the
  harness's drain workload (``bench/harness.py``: ``--jobs`` no-op jobs enqueued in bulk
  through each system's own client, the workers started, timed from the first job body
  to the system's records showing every measured job complete, CPU per process) on top
  of a backlog that another process, this bench's own, put into the system's table with
  plain SQL before the measured jobs were enqueued: a template job enqueued through the
  system's own API, then ``INSERT ... SELECT`` of ``--backlog - 1`` copies of it
  (``generate_series``; the broker's ids from ``gen_random_uuid()``, PgQueuer's from its
  sequence), then ``VACUUM ANALYZE`` of the table and a ``CHECKPOINT`` (both on the empty
  table too). Shapes:

  - ``empty``: no backlog;
  - ``due``: the backlog is due now, at priority -1, below the measured jobs' 0: both
    systems dispatch by priority first (the broker by its ``(mode, priority, run_at)``
    index, PgQueuer by its ``(entrypoint, priority, id)`` one), so the measured jobs are
    the ones drained, and what the figure shows is what a deep table costs every claim
    and completion (index depth, the working set against ``shared_buffers``, vacuum),
    not the drain of a different backlog. Near the end of a drain the workers start on
    the backlog's jobs; only the measured ones are counted.
  - ``future``: the backlog is scheduled a day ahead, at the measured jobs' priority
    (0): scheduled jobs of the same task and priority, as an application that schedules
    work makes them, so each system's read of due jobs meets every one of them in its
    index and has to get past them (PgQueuer's ``(entrypoint, priority, id)`` index
    holds them ahead of the newer measured jobs; the broker's has ``run_at`` after the
    priority).

  A drain still going ``DRAIN_LIMIT`` seconds after its first job started is cut there
  (rate over the jobs complete by then, marked ``cut``).
- **keyed** (the broker only): ``--keyed-jobs`` no-op jobs with a concurrency key
  (limit 1) over ``--keys`` distinct keys (``k{i % keys}``), enqueued in bulk through the
  main, drained by the ``broker-postgres-defaults`` worker as the drain row is.
- **workers** (the broker only): the main's CPU per job by connected ``broker-worker``
  processes, ``WORKERSxSLOTS`` each (inline slots): by default 1 worker x 64 slots and
  1 x 1 beside 64 x 1, so 64 workers are compared both with one worker of as many slots
  in all (the same concurrency, but one connection carries batches 64 slots deep) and
  with one worker of the same shape (the same batches per message, one connection
  instead of 64). The workers are started and every one has connected and run a
  warm-up job,
  the ``default`` queue is paused, ``--worker-jobs`` no-op jobs are enqueued, and the
  main's CPU is read from the resume until every job is complete (so it is the dispatch
  and the settlement, not the enqueue). Real processes rather than the in-process
  ``bench/handoff_core.py``: the figure includes what 64 connections cost the main
  beside the core's own loops (64 sockets, smaller batches per message).
- **queues** (``broker-postgres-defaults`` and ``pgqueuer``, in alternating turns): the
  drain of ``--jobs`` no-op jobs spread evenly over ``--queues`` queues (job ``i`` in
  ``q{i % queues}``), enqueued in bulk through each system's own client, drained and
  timed as the drain row is (first job body to the last completion), each system in its
  drain row's shape, every worker told every queue: the broker's one worker with
  ``--queues q0,...`` (a worker serves every queue by default, which would skip the
  main's queue filter; 1,000 is the most names a worker's list may hold), PgQueuer's two
  processes of batch 10 each registering the no-op job under every name as an entrypoint
  (PgQueuer routes by entrypoint; its dequeue passes them all to each query).
- **fleet** (``broker-postgres-inline1`` and ``pgqueuer``, in alternating turns):
  ``--fleet`` worker processes of one slot each drain ``--worker-jobs`` no-op jobs, as
  the workers rows do (every process connected and has run a warm-up job, the jobs
  enqueued where no worker can take them yet, then let go at once and timed from there
  to the last completion): the broker's are the workers row's ``64x1`` (``broker-worker
  --inline-concurrency 1``, the jobs run on the worker's loop, as PgQueuer's do), its
  jobs held by pausing the ``default`` queue and let go by resuming it; PgQueuer's are
  ``pgqueuer.run(batch_size=1)`` each, its closest shape to one slot (its
  ``max_concurrent_tasks`` cap must be at least twice the batch, so 2 at the least, and
  adds the worker-budget CTEs to every dequeue; unbounded, a process with a batch of one
  dequeues its next job while a no-op job finishes on the same loop, so at most about one
  runs at a time), its jobs held by an open transaction around the bulk enqueue and let
  go by its commit (the rows and their NOTIFY appear then). PgQueuer's processes hold a
  PostgreSQL connection each (65 for 64, the bench's own reader included), and this
  server allows 100 to everyone on it: before starting them the run waits until
  ``--fleet`` plus :data:`CONNECTIONS_SPARE` are free (up to :data:`CONNECTIONS_WAIT`,
  then fails saying so rather than take connections other benches need), so a fleet of
  64 runs on a server otherwise all but idle (a smaller ``--fleet`` beside other
  benches), and each run records the connections to its database and to the server when
  the jobs are let go. The broker's workers connect to its main, not to PostgreSQL (the
  main's pools stay under 20), so its turns need no such wait.

Every run is a process of its own (``python -m bench.scale --one ...`` in the system's
virtual environment, ``.venv-peers/pgqueuer`` for PgQueuer), on PostgreSQL databases
named for this run (``BENCH_DB_SUFFIX``) and dropped at its end; the load average is
read before and after each. Writes ``scale.json`` (every run), ``scale.md`` and
``scale.png`` to ``--out``, rewritten after every run, so a run cut short keeps what it
had.
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
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.harness import ROOT, BenchError, Config, Driver, Runner, Workers, tree_usage
from bench.systems import BY_NAME, CHART_PYTHON, DATABASE_SUFFIX

DRAIN_ROW = "broker-postgres-defaults"
PEER = "pgqueuer"
WORKERS_ROW = "broker-postgres-inline1"
"""The row whose setup the workers rows start from (inline jobs, no pooled children)."""
PARTS = ("drain", "keyed", "workers", "queues", "fleet")
SHAPES = ("empty", "due", "future")
BACKLOG_PRIORITY = -1
"""The due backlog's priority; the measured jobs have 0."""
AHEAD = timedelta(days=1)
"""How far ahead the future backlog is scheduled."""
MEASURED_BEFORE = timedelta(hours=12)
"""Jobs due before now plus this are the measured ones (the future backlog is later)."""
DRAIN_LIMIT = 45.0
"""Seconds a drain may run after its first job started before it is cut."""
CONNECTIONS_SPARE = 30
"""PostgreSQL connections a PgQueuer fleet leaves free for everyone else (:func:`_room_for`):
as many as the largest pool another bench opens at once (PgQueuer's producers' 30,
``bench/peers/pgqueuer_peer.py``). A fleet of 64 then starts only on a server used by a
handful of connections: one started beside other benches (2026-12-04, 14 to 57 of their
connections) took the server to its 100, and 17 connections were refused in 15 s: other
sessions' benches and a test's, and a monitor of this run."""
CONNECTIONS_WAIT = 300.0
"""Seconds a PgQueuer fleet waits for its connections to be free before failing."""


def queue_names(count: int) -> list[str]:
    """The queues part's queues: the broker's queue names and PgQueuer's entrypoints."""
    return [f"q{i}" for i in range(count)]


# ----------------------------------------------------------------------------- backlog


async def _copy_rows(conn: Any, table: str, template: Any, copies: int, ids: str | None) -> None:
    """``copies`` more rows like the row whose ``id`` is ``template``, in one
    ``INSERT ... SELECT`` over ``generate_series``: every column copied but the id,
    which is ``ids`` (an SQL expression) or the column's default, and identity columns."""
    columns = [
        r["column_name"]
        for r in await conn.fetch(
            "SELECT column_name FROM information_schema.columns WHERE table_name = $1 "
            "AND table_schema = current_schema() AND is_identity = 'NO' "
            "ORDER BY ordinal_position",
            table,
        )
    ]
    names = [c for c in columns if c != "id"] + (["id"] if ids else [])
    values = [f"t.{c}" for c in columns if c != "id"] + ([ids] if ids else [])
    await conn.execute(
        f"INSERT INTO {table} ({', '.join(names)}) SELECT {', '.join(values)} "
        f"FROM {table} t CROSS JOIN generate_series(1, $2) WHERE t.id = $1",
        template,
        copies,
    )


def _backlog_broker(driver: Any, shape: str, size: int) -> None:
    """The backlog of ``shape`` in the broker's table, then ``VACUUM ANALYZE`` (of the
    empty table too, so every shape starts from the same steps)."""
    from bench.peers.broker_peer import TASKS
    from broker.client.transactional import enqueue_in_async
    from broker.jobs import ExecutionMode

    async def fill() -> None:
        conn = driver.pg
        if shape == "empty":
            await conn.execute("VACUUM ANALYZE broker_jobs")
            return
        mode = ExecutionMode(driver.mode)
        if shape == "due":
            options = {"priority": BACKLOG_PRIORITY}
        else:
            options = {"run_at": datetime.now(UTC) + AHEAD}
        await enqueue_in_async(
            conn, f"{TASKS}.noop", [-1], max_attempts=1, execution_mode=mode, **options
        )
        template = await conn.fetchval("SELECT id FROM broker_jobs")
        await _copy_rows(conn, "broker_jobs", template, size - 1, "gen_random_uuid()")
        await conn.execute("VACUUM ANALYZE broker_jobs")

    driver.run(fill())


def _backlog_pgqueuer(driver: Any, shape: str, size: int) -> None:
    """As :func:`_backlog_broker`, in PgQueuer's table."""

    async def fill() -> None:
        if shape == "empty":
            await driver.conn.execute("VACUUM ANALYZE pgqueuer")
            return
        [template] = await driver.queries.enqueue(
            "noop",
            b"-1",
            BACKLOG_PRIORITY if shape == "due" else 0,
            AHEAD if shape == "future" else None,
        )
        await _copy_rows(driver.conn, "pgqueuer", int(template), size - 1, None)
        await driver.conn.execute("VACUUM ANALYZE pgqueuer")

    driver.run(fill())


def _measured_only(driver: Any, name: str) -> None:
    """Narrows the driver's completion count to the measured jobs: priority 0 (the due
    backlog's is -1) and due within :data:`MEASURED_BEFORE` (the future backlog is a day
    ahead). Each read walks an index over the measured rows alone, so polling it costs
    the same whatever lies beside them."""
    cutoff_us = int((datetime.now(UTC) + MEASURED_BEFORE).timestamp() * 1_000_000)
    if name == PEER:
        window = f"execute_after < now() + interval '{int(MEASURED_BEFORE.total_seconds())} s'"
        driver.outstanding = (
            "SELECT (SELECT count(*) FROM pgqueuer WHERE status = 'queued' AND "
            f"entrypoint = 'noop' AND priority >= 0 AND {window})"
            " + (SELECT count(*) FROM pgqueuer WHERE status = 'picked' AND priority >= 0 "
            f"AND {window})"
        )
        return
    driver.outstanding = (
        "SELECT (SELECT count(*) FROM broker_jobs WHERE status = 'queued' AND "
        f"execution_mode = '{driver.mode}' AND priority = 0 AND run_at_us < {cutoff_us})"
        " + (SELECT count(*) FROM broker_jobs WHERE status = 'handed_off' AND priority = 0 "
        f"AND run_at_us < {cutoff_us})"
    )


# ----------------------------------------------------------------------------- one run


def _driver(name: str, cfg: Config) -> Driver:
    module = importlib.import_module(BY_NAME[name].module)
    driver: Driver = module.DRIVERS[name](name, cfg)
    return driver


def _checkpoint() -> None:
    from bench.__main__ import checkpoint_postgres

    if error := checkpoint_postgres():
        print(error, file=sys.stderr)


def one_drain(runner: Runner, name: str, shape: str, size: int, jobs: int) -> dict[str, Any]:
    d = runner.d
    _measured_only(d, name)

    def backlog() -> None:
        started = time.perf_counter()
        (_backlog_pgqueuer if name == PEER else _backlog_broker)(d, shape, size)
        _checkpoint()
        fill_s[0] = time.perf_counter() - started

    fill_s = [0.0]
    run = runner.drain("noop", jobs, 0, backlog=backlog)
    return {**run, "fill_s": fill_s[0], "backlog": size if shape != "empty" else 0}


def one_keyed(runner: Runner, keys: int, jobs: int) -> dict[str, Any]:
    from bench.peers.broker_peer import CHUNK, IN_FLIGHT, TASKS
    from broker.jobs import ExecutionMode, JobSpec

    d: Any = runner.d
    d.reset()
    _checkpoint()
    mode = ExecutionMode(d.mode)
    specs = (
        JobSpec(
            task=f"{TASKS}.noop",
            args=(-1,),
            max_attempts=1,
            execution_mode=mode,
            concurrency_key=f"k{i % keys}",
            concurrency_limit=1,
        )
        for i in range(jobs)
    )
    started = time.perf_counter()
    d.run(d.client.enqueue_batches(specs, batch_size=CHUNK, in_flight=IN_FLIGHT))
    d.enqueued += jobs
    run: dict[str, Any] = {"jobs": jobs, "keys": keys}
    run["enqueue_bulk_per_s"] = jobs / (time.perf_counter() - started)
    return runner.drain_queued("keyed", jobs, run)


def one_queues(runner: Runner, name: str, queues: list[str], jobs: int) -> dict[str, Any]:
    """The drain of ``jobs`` no-op jobs spread evenly over ``queues`` (job ``i`` in
    ``queues[i % len(queues)]``), enqueued in bulk, each worker told every queue."""
    from bench.peers.broker_peer import CHUNK, IN_FLIGHT, TASKS
    from broker.jobs import ExecutionMode, JobSpec

    d: Any = runner.d
    d.reset()
    _checkpoint()
    started = time.perf_counter()
    if name == PEER:
        names = [queues[i % len(queues)] for i in range(jobs)]
        d.run(d.queries.enqueue(names, [b"-1"] * jobs, [0] * jobs))
    else:
        task, mode = f"{TASKS}.noop", ExecutionMode(d.mode)
        specs = (
            JobSpec(
                task=task,
                args=(-1,),
                max_attempts=1,
                execution_mode=mode,
                queue=queues[i % len(queues)],
            )
            for i in range(jobs)
        )
        d.run(d.client.enqueue_batches(specs, batch_size=CHUNK, in_flight=IN_FLIGHT))
    d.enqueued += jobs
    run: dict[str, Any] = {"jobs": jobs, "queues": len(queues)}
    run["enqueue_bulk_per_s"] = jobs / (time.perf_counter() - started)
    return runner.drain_queued("queues", jobs, run)


def _database(d: Any, name: str) -> Any:
    """The bench's own asyncpg connection to the system's database."""
    return d.conn if name == PEER else d.pg


def _connections(d: Any, name: str, everyone: bool = True) -> int:
    """Client connections to the server now: everyone's (they share max_connections), or
    those to the system's database alone."""
    where = "" if everyone else " AND datname = current_database()"
    sql = f"SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'{where}"
    return int(d.run(_database(d, name).fetchval(sql)))


def _room_for(d: Any, name: str, needed: int) -> None:
    """Waits until the server has ``needed`` connections free beside
    :data:`CONNECTIONS_SPARE` for everyone else, or fails saying so: a fleet of PgQueuer
    processes holds one connection each, so it would take the connections other benches
    on the server open meanwhile (refused, their runs fail), or one of its own would be
    refused and the run would have fewer workers than it says."""
    limit = int(d.run(_database(d, name).fetchval("SHOW max_connections")))
    deadline = time.monotonic() + CONNECTIONS_WAIT
    while (free := limit - _connections(d, name)) < needed + CONNECTIONS_SPARE:
        if time.monotonic() > deadline:
            raise BenchError(
                f"{free} of {limit} PostgreSQL connections free after {CONNECTIONS_WAIT:.0f} s;"
                f" {needed} workers need {needed + CONNECTIONS_SPARE} with the spare"
            )
        time.sleep(1.0)


def _firsts(marks: Path) -> int:
    """Worker processes that have run a job (each marks its first once, ``bench/jobs.py``)."""
    return sum(line.startswith("F ") for line in marks.read_text().splitlines())


def _warm(runner: Runner, name: str, procs: Workers, marks: Path, count: int, slots: int) -> None:
    """Returns once every one of the ``count`` worker processes has run a job: the broker's
    after its main counts them all connected; then a round of a warm-up job per slot,
    again until each has had one (PgQueuer's are known only by their jobs)."""
    d: Any = runner.d
    deadline = time.monotonic() + runner.cfg.run_timeout
    while name != PEER and len(d.run(d.client.status())["workers"] or []) < count:
        procs.check()
        if time.monotonic() > deadline:
            raise BenchError(f"{count} workers not connected: {procs.tail()}")
        time.sleep(0.2)
    while True:
        d.enqueue_bulk("noop", [-1] * count * slots)
        runner._wait_done(procs, runner.cfg.run_timeout)
        if _firsts(marks) >= count:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{_firsts(marks)} of {count} workers ran a job: {procs.tail()}")
        time.sleep(0.5)


def _held(d: Any, name: str, jobs: int) -> Any:
    """Enqueues ``jobs`` no-op jobs that no worker can take yet, and returns the call that
    lets them all go at once: the broker's ``default`` queue paused, then resumed;
    PgQueuer's bulk enqueue left in an open transaction, then committed (its rows are
    invisible to the workers' dequeue until then, and its NOTIFY goes at the commit)."""
    if name == PEER:
        transaction = d.conn.transaction()
        d.run(transaction.start())
        d.enqueue_bulk("noop", [-1] * jobs)
        return lambda: d.run(transaction.commit())
    from broker.jobs import DEFAULT_QUEUE

    d.run(d.client.pause_queue(DEFAULT_QUEUE))
    d.enqueue_bulk("noop", [-1] * jobs)
    return lambda: d.run(d.client.resume_queue(DEFAULT_QUEUE))


def one_workers(runner: Runner, name: str, workers: int, slots: int, jobs: int) -> dict[str, Any]:
    """``workers`` processes of ``slots`` each, every one connected and warm, then
    ``jobs`` no-op jobs let go at once (:func:`_held`): timed, with each process's CPU,
    from their release to the last completion (the workers part, and the fleet part's
    turns of both systems)."""
    d: Any = runner.d
    d.reset()
    marks, log = runner._paths("workers")
    if name == PEER:
        _room_for(d, name, workers)
    began = time.monotonic()
    procs: Workers = runner._start_workers(marks, log)
    try:
        _warm(runner, name, procs, marks, workers, slots)
        ready_s = time.monotonic() - began
        _checkpoint()
        release = _held(d, name, jobs)
        connections = _connections(d, name, everyone=False), _connections(d, name)
        main0, server0 = tree_usage(d.main_pids())[0], runner._server_cpu()
        worker0 = tree_usage(procs.pids)[0]
        started = time.perf_counter()
        release()
        runner._wait_done(procs, runner.cfg.run_timeout)
        seconds = time.perf_counter() - started
        main_cpu = tree_usage(d.main_pids())[0] - main0
        server_cpu = runner._server_cpu() - server0
        worker_cpu = tree_usage(procs.pids)[0] - worker0
    finally:
        procs.stop()
    return {
        "workers": workers,
        "slots_each": slots,
        "jobs": jobs,
        "ready_s": ready_s,
        "seconds": seconds,
        "per_s": jobs / seconds,
        "main_cpu_s": main_cpu,
        "main_us_per_job": main_cpu / jobs * 1e6,
        "server_cpu_s": server_cpu,
        "worker_cpu_s": worker_cpu,
        "pg_connections": connections[0],
        "pg_connections_all": connections[1],
    }


def one(argv: list[str]) -> int:
    """``--one drain SYSTEM SHAPE BACKLOG JOBS`` | ``--one keyed KEYS JOBS`` |
    ``--one workers WORKERSxSLOTS JOBS`` | ``--one queues SYSTEM QUEUES JOBS`` |
    ``--one fleet SYSTEM WORKERS JOBS``: one run in this environment, printed as JSON."""
    what = argv[0]
    workdir = Path(tempfile.mkdtemp(prefix=f"scale-{what}-"))
    cfg = Config(workdir=str(workdir), hash_rounds=1000, run_timeout=600.0, drain_limit=DRAIN_LIMIT)
    name = {"keyed": DRAIN_ROW, "workers": WORKERS_ROW}.get(what) or argv[1]
    driver: Any = _driver(name, cfg)
    count, slots = 0, 0
    if what == "workers":
        count, slots = _setup(argv[1])
    elif what == "fleet":
        count, slots = int(argv[2]), 1
    queues = queue_names(int(argv[2])) if what == "queues" else []
    if name == PEER:  # the drain row's two processes of batch 10 but in the fleet
        driver.queues = tuple(queues)
        if what == "fleet":
            driver.processes, driver.batch_size = count, 1
    elif what in ("workers", "fleet"):
        from bench.peers.broker_peer import ONLY_INLINE

        flags = ("--inline-concurrency", str(slots), *ONLY_INLINE)
        driver.row = dataclasses.replace(driver.row, workers=count, flags=flags)
    elif what == "queues":
        flags = (*driver.row.flags, "--queues", ",".join(queues))
        driver.row = dataclasses.replace(driver.row, flags=flags)
    runner = Runner(driver, cfg, workdir / "out.json")
    driver.setup()
    try:
        if what == "drain":
            run = one_drain(runner, name, argv[2], int(argv[3]), int(argv[4]))
        elif what == "keyed":
            run = one_keyed(runner, int(argv[1]), int(argv[2]))
        elif what == "queues":
            run = one_queues(runner, name, queues, int(argv[3]))
        else:
            run = one_workers(runner, name, count, slots, int(argv[-1]))
        print(json.dumps(run), flush=True)
    finally:
        driver.teardown()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


# ----------------------------------------------------------------------------- the report


def _python(name: str) -> str:
    from bench.__main__ import venv_python

    python = venv_python(BY_NAME[name])
    if not python.exists():
        raise SystemExit(f"{python} is missing: `python -m bench --systems {name}` installs it")
    return str(python)


def _loadavg() -> float:
    return os.getloadavg()[0]


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _row_label(run: dict[str, Any]) -> str:
    if run["part"] == "drain":
        return f"{run['system']} / {run['shape']}"
    if run["part"] == "keyed":
        return f"keyed / {run['keys']:,} keys"
    if run["part"] == "queues":
        return f"{run['system']} / {run['queues']:,} queues"
    if run["part"] == "fleet":
        return f"{run['system']} / {run['workers']} workers x 1"
    return f"workers x slots / {run['setup']}"


def _runs_of(runs: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in runs if all(r.get(k) == v for k, v in match.items())]


def _pair(
    runs: list[dict[str, Any]], broker: str, **match: Any
) -> tuple[float | None, float | None, str]:
    """The median jobs/s of the broker's row ``broker`` and of PgQueuer's over the runs
    that ``match``, and the median load before them."""
    ours, theirs = _runs_of(runs, system=broker, **match), _runs_of(runs, system=PEER, **match)
    load = _med([r["load_before"] for r in ours + theirs])
    return _med([r["per_s"] for r in ours]), _med([r["per_s"] for r in theirs]), _fmt(load, 1)


def _ratio_text(b: float | None, p: float | None) -> str:
    return _fmt(b / p, 2) + "x" if b and p else "-"


SECTION_PARTS = {
    "of": "drain",
    "drain": "keyed",
    "main's": "workers",
    "over": "queues",
    "one-slot": "fleet",
}
"""The part each section of :func:`markdown` shows, by its title's second word."""


def markdown(data: dict[str, Any]) -> str:
    runs, cfg = data["runs"], data["config"]
    size = cfg["backlog"]
    lines = [
        "# Scale: drain over a deep backlog, key count, worker count, queue count "
        "(`python -m bench.scale`)",
        "",
        f"Command: `{data['command']}`; started {data['started']}, "
        f"{data['wall_s'] / 60:.0f} min so far. Medians of the runs (each run listed below "
        "with the load average before / after it); the systems take turns. Machine: "
        f'{data["machine"]}. See `bench/README.md` ("Scale") for what each row does.',
        "",
        f"## Drain of {cfg['jobs']:,} no-op jobs over a backlog of {size:,} (jobs/s)",
        "",
        "| backlog | broker | PgQueuer | broker / PgQueuer | broker vs its empty row "
        "| PgQueuer vs its empty row | load (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    empty: dict[str, float | None] = {}
    for shape in SHAPES:
        med: dict[str, float | None] = {}
        loads: list[float] = []
        for system in (DRAIN_ROW, PEER):
            these = _runs_of(runs, part="drain", system=system, shape=shape)
            med[system] = _med([r["per_s"] for r in these])
            loads += [r["load_before"] for r in these]
            if shape == "empty":
                empty[system] = med[system]
        b, p = med[DRAIN_ROW], med[PEER]
        ratio = _ratio_text(b, p)

        def vs(system: str, of: dict[str, float | None] = med) -> str:
            value, base = of[system], empty.get(system)
            return f"{100 * (value / base - 1):+.0f}%" if value and base else "-"

        label = {"empty": "empty", "due": f"{size:,} due", "future": f"{size:,} future"}[shape]
        lines.append(
            f"| {label} | {_fmt(b)} | {_fmt(p)} | {ratio} | {vs(DRAIN_ROW)} | {vs(PEER)} "
            f"| {_fmt(_med(loads), 1)} |"
        )
    lines += [
        "",
        "Due backlog: priority -1, below the measured jobs' 0; future backlog: priority 0, "
        "run_at a day ahead. Inserted with plain SQL by the bench's own process, then "
        "`VACUUM ANALYZE` and `CHECKPOINT`.",
        "",
        f"## Keyed drain through the main (broker, {cfg['keyed_jobs']:,} jobs, limit 1 per key)",
        "",
        "| distinct keys | drain /s (median) | vs the fewest keys | load (median) |",
        "|---:|---:|---:|---:|",
    ]
    base: float | None = None
    for keys in cfg["keys"]:
        these = _runs_of(runs, part="keyed", keys=keys)
        m = _med([r["per_s"] for r in these])
        base = base if base is not None else m
        change = f"{100 * (m / base - 1):+.0f}%" if m and base else "-"
        load = _fmt(_med([r["load_before"] for r in these]), 1)
        lines.append(f"| {keys:,} | {_fmt(m)} | {change} | {load} |")
    lines += [
        "",
        f"## The main's CPU per job by connected workers (broker, {cfg['worker_jobs']:,} "
        "no-op jobs, inline slots)",
        "",
        "| workers x slots each | main µs/job (median) | vs 1 worker, as many slots in all "
        "| vs 1 worker of the same slots | jobs/s | PostgreSQL µs/job | load (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    per_job: dict[tuple[int, int], float | None] = {}
    for setup in cfg["workers"]:
        these = _runs_of(runs, part="workers", setup=setup)
        per_job[_setup(setup)] = _med([r["main_us_per_job"] for r in these])
    for setup in cfg["workers"]:
        these = _runs_of(runs, part="workers", setup=setup)
        count, slots = _setup(setup)
        m = per_job[(count, slots)]

        def change(base: float | None, m: float | None = m) -> str:
            return f"{100 * (m / base - 1):+.0f}%" if m and base else "-"

        server = _med([r["server_cpu_s"] / r["jobs"] * 1e6 for r in these])
        lines.append(
            f"| {setup} | {_fmt(m)} | {change(per_job.get((1, count * slots)))} "
            f"| {change(per_job.get((1, slots)))} | {_fmt(_med([r['per_s'] for r in these]))} "
            f"| {_fmt(server)} | {_fmt(_med([r['load_before'] for r in these]), 1)} |"
        )
    lines += [
        "",
        f"## Drain over many queues, one worker serving them all ({cfg['jobs']:,} no-op jobs, "
        "jobs/s)",
        "",
        "| queues | broker | PgQueuer | broker / PgQueuer | load (median) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for count in cfg.get("queues", []):  # none in a scale.json from before this part
        b, p, load = _pair(runs, DRAIN_ROW, part="queues", queues=count)
        lines.append(f"| {count:,} | {_fmt(b)} | {_fmt(p)} | {_ratio_text(b, p)} | {load} |")
    lines += [
        "",
        "Job i in queue `q{i % queues}`, enqueued in bulk; the broker's worker is "
        "`broker-postgres-defaults` with `--queues` naming every one, PgQueuer's two processes "
        "(batch 10) each register the no-op job under every name.",
        "",
        f"## Many one-slot workers draining together, beside PgQueuer ({cfg.get('fleet')} "
        f"processes, {cfg['worker_jobs']:,} no-op jobs, jobs/s)",
        "",
        "| broker | PgQueuer | broker / PgQueuer | broker's main µs/job "
        "| PostgreSQL µs/job, broker / PgQueuer | PgQueuer's connections | load (median) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    b, p, load = _pair(runs, WORKERS_ROW, part="fleet")
    ours, theirs = (
        _runs_of(runs, part="fleet", system=WORKERS_ROW),
        _runs_of(runs, part="fleet", system=PEER),
    )
    main = _med([r["main_us_per_job"] for r in ours])
    server = [_med([r["server_cpu_s"] / r["jobs"] * 1e6 for r in rs]) for rs in (ours, theirs)]
    connections = _med([r["pg_connections"] for r in theirs])
    lines.append(
        f"| {_fmt(b)} | {_fmt(p)} | {_ratio_text(b, p)} | {_fmt(main)} "
        f"| {_fmt(server[0])} / {_fmt(server[1])} | {_fmt(connections)} | {load} |"
    )
    lines += [
        "",
        "Every process connected and warm, then the jobs let go at once (the broker's queue "
        "resumed, PgQueuer's enqueue committed), timed to the last completion. The broker: "
        "`broker-worker --inline-concurrency 1`; PgQueuer: `pgqueuer.run(batch_size=1)`, "
        "one connection each.",
        "",
        "## Every run",
        "",
        "| rep | row | jobs/s | main ms/job | PostgreSQL ms/job | backlog fill s "
        "| load before / after | note |",
        "|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for r in runs:
        done = r.get("done", r["jobs"])
        has_main = r.get("system") != PEER  # PgQueuer has no main: its workers claim
        main = r["main_cpu_s"] / done * 1e3 if done and has_main else None
        server = r["server_cpu_s"] / done * 1e3 if done else None
        note = "cut at the drain limit" if r.get("timed_out") else ""
        lines.append(
            f"| {r['rep']} | {_row_label(r)} | {_fmt(r['per_s'])} | {_fmt(main, 3)} "
            f"| {_fmt(server, 3)} | {_fmt(r.get('fill_s'), 0)} "
            f"| {r['load_before']:.1f} / {r['load_after']:.1f} | {note} |"
        )
    if data["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e}" for e in data["errors"]]
    # A run of some parts only (--parts) shows only their sections.
    ran = {r["part"] for r in runs}
    head, *sections = ("\n".join(lines) + "\n").split("\n## ")
    kept = [s for s in sections if SECTION_PARTS.get(s.split(" ", 2)[1], "") in ran | {""}]
    return "\n## ".join([head, *kept])


def _bars_beside_pgqueuer(
    ax: Any, runs: list[dict[str, Any]], broker: str, groups: list[tuple[str, dict[str, Any]]]
) -> None:
    """Median jobs/s of the broker's row ``broker`` and of PgQueuer's, side by side, for
    each group of runs (its label, the fields its runs match); bars: min-max."""
    width = 0.38
    for i, (system, colour) in enumerate(((broker, "#c0392b"), (PEER, "#5d6d7e"))):
        meds, lows, highs = [], [], []
        for _, match in groups:
            rates = [r["per_s"] for r in _runs_of(runs, system=system, **match)]
            m = statistics.median(rates) if rates else 0.0
            meds.append(m)
            lows.append(m - min(rates, default=m))
            highs.append(max(rates, default=m) - m)
        xs = [x + (i - 0.5) * width for x in range(len(groups))]
        ax.bar(xs, meds, width, color=colour, yerr=[lows, highs], capsize=3, label=system)
    ax.set_xticks(range(len(groups)), [label for label, _ in groups])
    ax.legend(fontsize=8)


def chart(json_path: Path, png_path: Path) -> None:
    """A panel for each part in ``scale.json`` (run with the ``chart`` environment's python)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(json_path.read_text())
    runs, cfg = data["runs"], data["config"]
    ran = [part for part in PARTS if _runs_of(runs, part=part)]
    if not ran:
        return
    fig, axes = plt.subplots(1, len(ran), figsize=(5 * len(ran), 4.5), squeeze=False)
    panels = dict(zip(ran, axes[0], strict=True))
    size = cfg["backlog"]
    if ax := panels.get("drain"):
        labels = {"empty": "empty", "due": f"{size:,} due", "future": f"{size:,} future"}
        groups = [(labels[shape], {"part": "drain", "shape": shape}) for shape in SHAPES]
        _bars_beside_pgqueuer(ax, runs, DRAIN_ROW, groups)
        ax.set_title(f"Drain of {cfg['jobs']:,} jobs over a backlog (jobs/s)")
    if ax := panels.get("queues"):
        groups = [(f"{n:,} queues", {"part": "queues", "queues": n}) for n in cfg["queues"]]
        _bars_beside_pgqueuer(ax, runs, DRAIN_ROW, groups)
        ax.set_title(f"Drain of {cfg['jobs']:,} jobs over many queues (jobs/s)")
    if ax := panels.get("fleet"):
        _bars_beside_pgqueuer(ax, runs, WORKERS_ROW, [(f"{cfg['fleet']} x 1", {"part": "fleet"})])
        ax.set_title(f"{cfg['fleet']} one-slot workers' drain of {cfg['worker_jobs']:,} (jobs/s)")
    for part, key, field, title in (
        ("keyed", "keys", "per_s", "Keyed drain, broker (jobs/s)"),
        ("workers", "setup", "main_us_per_job", "broker-main CPU per job (µs), workers x slots"),
    ):
        if (ax := panels.get(part)) is None:
            continue
        values = cfg["keys" if part == "keyed" else "workers"]
        meds, lows, highs = [], [], []
        for v in values:
            got = [r[field] for r in _runs_of(runs, part=part, **{key: v})]
            m = statistics.median(got) if got else 0.0
            meds.append(m)
            lows.append(m - min(got, default=m))
            highs.append(max(got, default=m) - m)
        ax.bar(range(len(values)), meds, 0.5, color="#c0392b", yerr=[lows, highs], capsize=3)
        names = [f"{v:,} keys" if part == "keyed" else str(v) for v in values]
        ax.set_xticks(range(len(values)), names)
        ax.set_title(title)
    fig.suptitle("Medians of the runs; bars: min-max", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def _schedule(args: argparse.Namespace) -> list[tuple[int, str, list[str], dict[str, Any]]]:
    """Every run in order: per repetition the drain shapes, each system in turn (the one
    going first alternating between repetitions), then the keyed and the workers rows
    (their order alternating too), then the queues and the fleet, each system in turn
    as the drain's."""
    parts = set(args.parts.split(","))
    out: list[tuple[int, str, list[str], dict[str, Any]]] = []
    for rep in range(1, args.reps + 1):
        order = [DRAIN_ROW, PEER] if rep % 2 else [PEER, DRAIN_ROW]
        if "drain" in parts:
            for shape in SHAPES:
                for system in order:
                    words = ["drain", system, shape, str(args.backlog), str(args.jobs)]
                    label = {"part": "drain", "system": system, "shape": shape}
                    out.append((rep, _python(system), words, label))
        if "keyed" in parts:
            for keys in args.keys if rep % 2 else args.keys[::-1]:
                words = ["keyed", str(keys), str(args.keyed_jobs)]
                out.append((rep, sys.executable, words, {"part": "keyed", "keys": keys}))
        if "workers" in parts:
            for setup in args.workers if rep % 2 else args.workers[::-1]:
                words = ["workers", setup, str(args.worker_jobs)]
                out.append((rep, sys.executable, words, {"part": "workers", "setup": setup}))
        if "queues" in parts:
            for count in args.queues:
                for system in order:
                    words = ["queues", system, str(count), str(args.jobs)]
                    label = {"part": "queues", "system": system}
                    out.append((rep, _python(system), words, label))
        if "fleet" in parts:
            for system in [WORKERS_ROW, PEER] if rep % 2 else [PEER, WORKERS_ROW]:
                words = ["fleet", system, str(args.fleet), str(args.worker_jobs)]
                out.append((rep, _python(system), words, {"part": "fleet", "system": system}))
    return out


def _draw(out: Path, env: dict[str, str]) -> None:
    if not CHART_PYTHON.exists():
        print(
            f"no chart: {CHART_PYTHON} is missing (`python -m bench` installs it)", file=sys.stderr
        )
        return
    command = [str(CHART_PYTHON), "-m", "bench.scale", "--chart"]
    drawn = subprocess.run(
        [*command, str(out / "scale.json"), str(out / "scale.png")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if drawn.returncode != 0:
        print(f"chart failed: {drawn.stderr[-400:]}", file=sys.stderr)


def _setup(text: str) -> tuple[int, int]:
    """``"64x1"``: 64 workers of 1 slot each."""
    workers, slots = text.split("x")
    return int(workers), int(slots)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        return one(argv[1:])
    if argv[:1] == ["--chart"]:
        chart(Path(argv[1]), Path(argv[2]))
        return 0
    if argv[:1] == ["--report"]:  # scale.md and scale.png again from scale.json in DIR
        out = Path(argv[1])
        (out / "scale.md").write_text(markdown(json.loads((out / "scale.json").read_text())))
        _draw(out, {**os.environ, "PYTHONPATH": str(ROOT)})
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.scale")
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--keys", type=_ints, default=[1000, 30_000])
    parser.add_argument("--keyed-jobs", type=int, default=30_000)
    parser.add_argument("--workers", type=lambda t: t.split(","), default=["1x64", "1x1", "64x1"])
    parser.add_argument("--worker-jobs", type=int, default=20_000)
    parser.add_argument("--queues", type=_ints, default=[1000])
    parser.add_argument("--fleet", type=int, default=64)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, DATABASE_SUFFIX: f"_scale{os.getpid()}", "PYTHONPATH": str(ROOT)}
    began = time.monotonic()
    data: dict[str, Any] = {
        "command": "python -m bench.scale " + " ".join(argv),
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} cores",
        "config": {
            "backlog": args.backlog,
            "jobs": args.jobs,
            "reps": args.reps,
            "keys": args.keys,
            "keyed_jobs": args.keyed_jobs,
            "workers": args.workers,
            "worker_jobs": args.worker_jobs,
            "queues": args.queues,
            "fleet": args.fleet,
            "drain_limit_s": DRAIN_LIMIT,
        },
        "runs": [],
        "errors": [],
        "wall_s": 0.0,
    }

    def save() -> None:
        data["wall_s"] = time.monotonic() - began
        (args.out / "scale.json").write_text(json.dumps(data, indent=1))
        (args.out / "scale.md").write_text(markdown(data))

    def run(rep: int, python: str, words: list[str], label: dict[str, Any]) -> None:
        before = _loadavg()
        done = subprocess.run(
            [python, "-m", "bench.scale", "--one", *words],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        after = _loadavg()
        if done.returncode != 0 or not done.stdout.strip():
            error = f"rep {rep} {' '.join(words)}: {done.stderr.strip()[-600:]}"
            print(error, file=sys.stderr, flush=True)
            data["errors"].append(error)
        else:
            result = json.loads(done.stdout.strip().splitlines()[-1])
            entry = {**label, **result, "rep": rep, "load_before": before, "load_after": after}
            data["runs"].append(entry)
            print(
                f"rep {rep} {_row_label(entry)}: {entry['per_s']:,.0f} jobs/s, load "
                f"{before:.1f}/{after:.1f}",
                file=sys.stderr,
                flush=True,
            )
        save()

    for rep, python, words, label in _schedule(args):
        run(rep, python, words, label)
    save()
    _draw(args.out, env)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
