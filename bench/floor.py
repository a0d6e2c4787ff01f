"""The floor: the least CPU per job each process can spend on this design, measured.

    .venv/bin/python -m bench.floor [--out bench/results] [--batches 1,10,100]

A no-op job on the drain path costs, at the least (one claim and one settle statement
per batch of ``B`` jobs, one encode and one decode per message per hop):

* **main**: its share of one claim and one settle statement on PostgreSQL (the
  driver's client-side work, asyncpg, prepared, arrays in and rows out), plus one TCP
  hop to the worker (send the job line, read the report line) and the codec on both
  (encode the job, decode the report);
* **worker**: the other end of that TCP hop (read, write), and for pooled jobs the
  parent end of the child pipe hop (write, read); the codec: decode the job and encode
  the report, plus encode the job and decode the outcome for the child (pooled);
* **children** (pooled only): the child end of the pipe hop and decode the job, encode
  the outcome;
* **store server**: the PostgreSQL backend's CPU for its share of the claim and the
  settle, each its own transaction with fsync on (``synchronous_commit``).

Each primitive is measured here, on its own, with ``time.process_time`` (this process)
or ``/proc/PID/schedstat`` (the echo child, the PostgreSQL backend serving the
connection: its time on a CPU, in nanoseconds), as the best of several repeats of many
calls (the timeit way: the least disturbed repeat): the codec with the stdlib
``json`` and with ``msgspec`` (the floor takes the faster), the hops as a round trip
of a job-sized line through a pipe and through a loopback TCP socket to an echo child,
the statements against a scratch table shaped like the job table (``bench_floor``
database). Everything else a real main, worker and child do per job (asyncio tasks and
callbacks, validation, bookkeeping, logging) is above the floor.

Writes ``floor.json`` (every primitive and the floor per process and batch size) and
``floor.md``; ``bench/report.py`` reads ``floor.json`` and shows each broker row's
distance from the floor at batch size ``REPORT_BATCH``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.harness import ROOT, _proc_stat
from bench.systems import (
    database,
    drop_database,
    fresh_database,
    on_admin_database,
    postgres_dsn,
)

DATABASE = database("bench_floor")
REPORT_BATCH = 10
"""The batch size the report compares rows with: one pooled child's concurrency, and
about the jobs per dispatcher pass that the issue measured."""
REPEATS = 5

JOB = {
    "type": "job",
    "seq": 123456,
    "job_id": str(uuid.uuid4()),
    "handoff_id": str(uuid.uuid4()),
    "task": "bench.peers.broker_app.noop",
    "args": [-1],
    "kwargs": {},
    "execution_mode": "pooled",
    "attempt": 1,
    "max_attempts": 1,
    "timeout": None,
    "queue": "default",
}
"""A no-op job as the main hands it to a worker (the fields of ``protocol.JobHandoff``)."""
REPORT = {
    "type": "completed",
    "job_id": JOB["job_id"],
    "handoff_id": JOB["handoff_id"],
    "result": None,
}
"""Its outcome as the worker reports it (``protocol.CompletedReport``)."""


def _own_cpu(pid: int) -> float:
    """CPU seconds of one process so far: ``/proc/PID/schedstat`` (nanoseconds) where the
    kernel has it, else utime + stime from ``/proc/PID/stat`` (10 ms ticks, too coarse
    for one statement)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        stat = _proc_stat(pid)
        return stat[1] if stat is not None else 0.0


def best_per_call(fn: Callable[[], object], number: int) -> float:
    """CPU seconds per call of ``fn``: the best of ``REPEATS`` runs of ``number`` calls."""
    best = float("inf")
    for _ in range(REPEATS):
        started = time.process_time()
        for _ in range(number):
            fn()
        best = min(best, (time.process_time() - started) / number)
    return best


# ----------------------------------------------------------------------------- codec


def measure_codec() -> dict[str, dict[str, float]]:
    """Seconds per encode and per decode of the job and the report, by codec."""
    out: dict[str, dict[str, float]] = {}
    job_line, report_line = json.dumps(JOB).encode(), json.dumps(REPORT).encode()
    out["json"] = {
        "encode_job": best_per_call(lambda: json.dumps(JOB, separators=(",", ":")).encode(), 20000),
        "decode_job": best_per_call(lambda: json.loads(job_line), 20000),
        "encode_report": best_per_call(
            lambda: json.dumps(REPORT, separators=(",", ":")).encode(), 20000
        ),
        "decode_report": best_per_call(lambda: json.loads(report_line), 20000),
    }
    try:
        import msgspec
    except ImportError:
        return out

    class Job(msgspec.Struct, tag_field="type", tag="job"):
        seq: int
        job_id: uuid.UUID
        handoff_id: uuid.UUID
        task: str
        args: list[Any]
        kwargs: dict[str, Any]
        execution_mode: str
        attempt: int
        max_attempts: int
        timeout: float | None
        queue: str

    class Completed(msgspec.Struct, tag_field="type", tag="completed"):
        job_id: uuid.UUID
        handoff_id: uuid.UUID
        result: Any = None

    decoder = msgspec.json.Decoder(Job | Completed)
    encoder = msgspec.json.Encoder()
    job = decoder.decode(job_line)
    report = decoder.decode(report_line)
    out["msgspec"] = {
        "encode_job": best_per_call(lambda: encoder.encode(job), 20000),
        "decode_job": best_per_call(lambda: decoder.decode(job_line), 20000),
        "encode_report": best_per_call(lambda: encoder.encode(report), 20000),
        "decode_report": best_per_call(lambda: decoder.decode(report_line), 20000),
    }
    return out


# ----------------------------------------------------------------------------- hops


def echo(where: str) -> None:
    """The child end of a hop: every line read is written back (``pipe`` or ``tcp:PORT``)."""
    if where == "pipe":
        reader, writer = sys.stdin.buffer, sys.stdout.buffer
    else:
        sock = socket.create_connection(("127.0.0.1", int(where.split(":", 1)[1])))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader, writer = sock.makefile("rb"), sock.makefile("wb")
    for line in iter(reader.readline, b""):
        writer.write(line)
        writer.flush()


def measure_hop(kind: str, rounds: int = 5000) -> dict[str, float]:
    """CPU seconds per round trip of a job-sized line: this end and the echo child's."""
    line = json.dumps(JOB).encode() + b"\n"
    command = [sys.executable, "-m", "bench.floor", "--echo"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    closers: list[Callable[[], object]] = []
    if kind == "pipe":
        child = subprocess.Popen(
            [*command, "pipe"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        assert child.stdin is not None and child.stdout is not None
        writer, reader = child.stdin, child.stdout
    else:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            port = listener.getsockname()[1]
            child = subprocess.Popen([*command, f"tcp:{port}"], env=env)
            conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer, reader = conn.makefile("wb"), conn.makefile("rb")  # type: ignore[assignment]
        closers += [reader.close, conn.close]
    try:

        def round_trip() -> None:
            writer.write(line)
            writer.flush()
            reader.readline()

        for _ in range(200):  # warm-up
            round_trip()
        best_parent, best_child = float("inf"), float("inf")
        for _ in range(REPEATS):
            child0, parent0 = _own_cpu(child.pid), time.process_time()
            for _ in range(rounds):
                round_trip()
            best_parent = min(best_parent, (time.process_time() - parent0) / rounds)
            best_child = min(best_child, (_own_cpu(child.pid) - child0) / rounds)
    finally:
        writer.close()
        for close in closers:
            close()
        child.wait(10)
    return {"parent_s": best_parent, "child_s": best_child}


# ----------------------------------------------------------------------------- statements

SCHEMA = """
CREATE TABLE jobs (
    id uuid PRIMARY KEY,
    seq bigserial NOT NULL,
    queue text NOT NULL,
    priority integer NOT NULL,
    status text NOT NULL,
    lease uuid,
    task text NOT NULL,
    args jsonb NOT NULL,
    result jsonb,
    updated_us bigint NOT NULL
);
CREATE INDEX jobs_eligible ON jobs (queue, priority, seq) WHERE status = 'queued';
"""
FILL = """
INSERT INTO jobs (id, queue, priority, status, task, args, updated_us)
SELECT gen_random_uuid(), 'default', 0, 'queued', 'bench.peers.broker_app.noop', '[-1]', 0
FROM generate_series(1, $1)
"""
CLAIM = """
WITH picked AS (
    SELECT id, row_number() OVER () AS n FROM (
        SELECT id FROM jobs WHERE status = 'queued' AND queue = 'default'
        ORDER BY priority, seq LIMIT $1 FOR UPDATE SKIP LOCKED
    ) AS eligible
), leased AS (
    SELECT picked.id, minted.lease
    FROM picked JOIN unnest($2::uuid[]) WITH ORDINALITY AS minted(lease, n) USING (n)
)
UPDATE jobs SET status = 'handed_off', lease = leased.lease, updated_us = $3
FROM leased WHERE jobs.id = leased.id
RETURNING jobs.id, jobs.lease, jobs.task, jobs.args
"""
"""One statement picks the eligible rows, writes the leases minted beforehand, returns the
rows: issue 10's claim."""
SETTLE = """
UPDATE jobs SET status = 'completed', result = 'null', updated_us = $3
FROM unnest($1::uuid[], $2::uuid[]) AS settled(id, lease)
WHERE jobs.id = settled.id AND jobs.lease = settled.lease AND jobs.status = 'handed_off'
"""
"""One statement over arrays, the lease fence in its ``WHERE``: issue 10's settle."""


async def measure_statements(batches: list[int]) -> dict[str, dict[str, float]]:
    import asyncpg

    await on_admin_database(*fresh_database(DATABASE))
    conn = await asyncpg.connect(postgres_dsn(DATABASE))
    out: dict[str, dict[str, float]] = {}
    try:
        await conn.execute(SCHEMA)
        backend = int(await conn.fetchval("SELECT pg_backend_pid()"))
        claim, settle = await conn.prepare(CLAIM), await conn.prepare(SETTLE)
        for batch in batches:
            passes = max(100, min(500, 10000 // batch))
            best: dict[str, float] = {}
            for _ in range(REPEATS):
                await conn.execute("TRUNCATE jobs")
                await conn.execute(FILL, passes * batch + batch)
                await conn.execute("ANALYZE jobs")
                sums = dict.fromkeys(
                    ("claim_client_s", "claim_server_s", "claim_wall_s"), 0.0
                ) | dict.fromkeys(("settle_client_s", "settle_server_s", "settle_wall_s"), 0.0)
                for _ in range(passes):
                    leases = [uuid.uuid4() for _ in range(batch)]
                    server0, client0, wall0 = (
                        _own_cpu(backend),
                        time.process_time(),
                        time.perf_counter(),
                    )
                    rows = await claim.fetch(batch, leases, 1)
                    server1, client1, wall1 = (
                        _own_cpu(backend),
                        time.process_time(),
                        time.perf_counter(),
                    )
                    await settle.fetch([r["id"] for r in rows], [r["lease"] for r in rows], 2)
                    server2, client2, wall2 = (
                        _own_cpu(backend),
                        time.process_time(),
                        time.perf_counter(),
                    )
                    if len(rows) != batch:
                        raise RuntimeError(f"claimed {len(rows)} of {batch}")
                    sums["claim_client_s"] += client1 - client0
                    sums["claim_server_s"] += server1 - server0
                    sums["claim_wall_s"] += wall1 - wall0
                    sums["settle_client_s"] += client2 - client1
                    sums["settle_server_s"] += server2 - server1
                    sums["settle_wall_s"] += wall2 - wall1
                per_statement = {k: v / passes for k, v in sums.items()}
                best = {k: min(best.get(k, v), v) for k, v in per_statement.items()}
            done = await conn.fetchval("SELECT count(*) FROM jobs WHERE status = 'completed'")
            if done != passes * batch:
                raise RuntimeError(f"settled {done} of {passes * batch}")
            out[str(batch)] = best
    finally:
        await conn.close()
        await on_admin_database(drop_database(DATABASE))
    return out


# ----------------------------------------------------------------------------- floor


def floor(data: dict[str, Any], batch: int) -> dict[str, dict[str, float]]:
    """Milliseconds per job per process, pooled and inline, at claim/settle batch ``batch``."""
    codec = min(data["codec"].values(), key=lambda c: sum(c.values()))
    st = data["statements"][str(batch)]
    tcp, pipe = data["hops"]["tcp"], data["hops"]["pipe"]
    main = (
        (st["claim_client_s"] + st["settle_client_s"]) / batch
        + tcp["parent_s"]
        + codec["encode_job"]
        + codec["decode_report"]
    )
    worker_inline = tcp["child_s"] + codec["decode_job"] + codec["encode_report"]
    worker_pooled = worker_inline + pipe["parent_s"] + codec["encode_job"] + codec["decode_report"]
    children = pipe["child_s"] + codec["decode_job"] + codec["encode_report"]
    store = (st["claim_server_s"] + st["settle_server_s"]) / batch
    ms = 1000.0
    pooled = {
        "main": main * ms,
        "worker": worker_pooled * ms,
        "children": children * ms,
        "store": store * ms,
    }
    inline = {"main": main * ms, "worker": worker_inline * ms, "children": 0.0, "store": store * ms}
    for row in (pooled, inline):
        row["all"] = sum(row.values())
    return {"pooled": pooled, "inline": inline}


def markdown(data: dict[str, Any]) -> str:
    us = 1e6
    lines = [
        "# The floor: least CPU per job per process on this design",
        "",
        f"Measured by `python -m bench.floor` on {data['generated']} (load average "
        f"{data['loadavg'][0]:.2f} at the start: other work on the machine inflates the "
        "figures a little, never deflates them). Best of "
        f"{REPEATS} repeats; CPU = user + system time of the process doing the work.",
        "",
        "## Primitives (µs of CPU each)",
        "",
        "| codec | encode job | decode job | encode report | decode report |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, c in data["codec"].items():
        lines.append(
            f"| {name} | {c['encode_job'] * us:.1f} | {c['decode_job'] * us:.1f} | "
            f"{c['encode_report'] * us:.1f} | {c['decode_report'] * us:.1f} |"
        )
    lines += ["", "| hop (one line each way) | this end | echo child |", "|---|---:|---:|"]
    for name, h in data["hops"].items():
        lines.append(f"| {name} | {h['parent_s'] * us:.1f} | {h['child_s'] * us:.1f} |")
    lines += [
        "",
        "| batch | claim: client / backend / wall | settle: client / backend / wall |",
        "|---:|---:|---:|",
    ]
    for batch, s in data["statements"].items():
        lines.append(
            f"| {batch} | {s['claim_client_s'] * us:.0f} / {s['claim_server_s'] * us:.0f} / "
            f"{s['claim_wall_s'] * us:.0f} | {s['settle_client_s'] * us:.0f} / "
            f"{s['settle_server_s'] * us:.0f} / {s['settle_wall_s'] * us:.0f} |"
        )
    lines += [
        "",
        "## Floor per job (ms of CPU)",
        "",
        "| batch | mode | main | worker | children | store server | all |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for batch, modes in data["floor"].items():
        for mode, f in modes.items():
            lines.append(
                f"| {batch} | {mode} | {f['main']:.3f} | {f['worker']:.3f} | "
                f"{f['children']:.3f} | {f['store']:.3f} | {f['all']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where to write")
    p.add_argument("--batches", default="1,10,100", help="claim/settle batch sizes to measure")
    p.add_argument("--echo", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.echo:
        echo(args.echo)
        return 0
    batches = sorted({int(b) for b in args.batches.split(",")} | {REPORT_BATCH})
    data: dict[str, Any] = {
        "generated": datetime.now(UTC).isoformat(timespec="seconds"),
        "loadavg": os.getloadavg(),
        "report_batch": REPORT_BATCH,
        "codec": measure_codec(),
        "hops": {"pipe": measure_hop("pipe"), "tcp": measure_hop("tcp")},
        "statements": asyncio.run(measure_statements(batches)),
    }
    data["floor"] = {str(b): floor(data, b) for b in batches}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "floor.json").write_text(json.dumps(data, indent=1))
    (args.out / "floor.md").write_text(markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
