"""One enqueue at a time, two checkouts and PgQueuer in tight turns: an A/B for a loaded machine.

    .venv/bin/python -m bench.enqueue_ab --before DIR [--after DIR] [--blocks 40] [--block 50]

``bench.enqueue_bench`` runs each system in a process of its own, one after the other,
and on a machine shared with other work the load moves between those runs: PgQueuer's
own rate moved 66 to 204 jobs/s between rounds minutes apart, more than any change
measured. Here each side is a producer process that stays up, its store and (for the
broker) its broker-main set up once; this process then asks each in turn for ``--block``
jobs one at a time, ``--blocks`` times, so every side meets the same load within a
second or two. A side reports each block's wall time and the CPU of its producer and
its main (``/proc/PID/schedstat``); the rate is jobs over the summed wall time, and the
median block is shown beside it.

Sides: ``before`` (the broker at ``--before``, through its main and direct, the
producer's own asyncpg connection), ``after`` (the broker at ``--after``, by default
this checkout, the same two paths; ``--after`` the same as ``--before`` measures the
noise) and ``pgqueuer`` (in its ``.venv-peers`` environment, left out when that is
missing). Each runs under its own database suffix, so none drops another's store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent.parent


def _schedstat(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except OSError:
        return 0.0


def serve(system: str, bulk: bool = False) -> None:
    """A producer: set up, then answer ``PHASE N`` lines with one JSON line each: ``N``
    calls of one job, or with ``bulk`` one call of ``N`` jobs."""
    import importlib

    from bench.harness import Config

    module = importlib.import_module(
        "bench.peers.pgqueuer_peer" if system == "pgqueuer" else "bench.peers.broker_peer"
    )
    driver = module.DRIVERS[system](system, Config(workdir=tempfile.mkdtemp(), hash_rounds=1))
    driver.setup()
    driver.reset()
    try:
        main_pids = driver.main_pids()
        calls = {"one": driver.enqueue_one}
        if system.startswith("broker-postgres"):
            calls["direct"] = driver.enqueue_one_direct
        for call in calls.values():
            for i in range(50):  # connected and warm
                call("noop", -1 - i)
        if bulk:
            calls = {"bulk": driver.enqueue_bulk}
            if system.startswith("broker-postgres"):
                calls["bulk-direct"] = driver.enqueue_bulk_direct
            for call in calls.values():
                call("noop", [-1] * 10)  # warm
        print(json.dumps({"phases": sorted(calls)}), flush=True)
        while line := _next_line(driver.loop):
            phase, count = line.split()
            call = calls[phase]
            cpu, main = time.process_time(), sum(map(_schedstat, main_pids))
            wall = time.perf_counter()
            if bulk:
                call("noop", list(range(int(count))))
            else:
                for i in range(int(count)):
                    call("noop", i)
            row = {
                "wall": time.perf_counter() - wall,
                "producer": time.process_time() - cpu,
                "main": sum(map(_schedstat, main_pids)) - main,
            }
            print(json.dumps(row), flush=True)
    finally:
        driver.teardown()


def _next_line(loop: asyncio.AbstractEventLoop) -> str:
    """The next line of stdin, read while the driver's loop runs: the client answers the
    main's pings while the other sides take their turns (a bulk turn can take longer than
    the main waits for a ping's answer)."""
    return loop.run_until_complete(loop.run_in_executor(None, sys.stdin.readline))


class Side:
    def __init__(self, name: str, python: str, root: Path, system: str, bulk: bool) -> None:
        suffix = f"{os.environ.get('BENCH_DB_SUFFIX', '')}_ab_{name}"
        env = {**os.environ, "PYTHONPATH": str(root), "BENCH_DB_SUFFIX": suffix}
        self.name = name
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--serve", system, *["--bulk"] * bulk],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.phases: list[str] = self._read()["phases"]

    def _read(self) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        while True:
            line = out.readline()
            if not line:
                raise RuntimeError(f"side {self.name} ended")
            if line.startswith("{"):
                return dict(json.loads(line))

    def run(self, phase: str, count: int) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{phase} {count}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, help="a checkout of the broker to compare with")
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument(
        "--after", type=Path, default=HERE, help="the checkout measured (default: this one)"
    )
    p.add_argument("--block", type=int, default=50, help="jobs a turn")
    p.add_argument(
        "--bulk",
        action="store_true",
        help="each turn one bulk call of --block jobs (through the main, and direct), not "
        "--block calls of one job",
    )
    p.add_argument("--system", default="broker-postgres")
    p.add_argument(
        "--path",
        choices=sorted(PATHS),
        action="append",
        help="measure only this path of the broker's sides (repeatable; default: every "
        "path): a path run just after another meets what that one left running (the "
        "main's dispatcher passes, a background ANALYZE)",
    )
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.bulk)
        return
    sides: list[Side] = []
    broker_python = str(HERE / ".venv" / "bin" / "python")
    if args.before is not None:
        sides.append(Side("before", broker_python, args.before.resolve(), args.system, args.bulk))
    sides.append(Side("after", broker_python, args.after.resolve(), args.system, args.bulk))
    pgqueuer = HERE / ".venv-peers" / "pgqueuer" / "bin" / "python"
    if pgqueuer.exists():
        sides.append(Side("pgqueuer", str(pgqueuer), HERE, "pgqueuer", args.bulk))
    loads = [os.getloadavg()[0]]
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for turn in range(args.blocks):
            # Every other turn in the reverse order: in an A/A run with a fixed order,
            # the side that went second was 6-8% cheaper per job, as much as the
            # change being measured.
            for side in sides if turn % 2 == 0 else sides[::-1]:
                for phase in side.phases:
                    if args.path and side.name != "pgqueuer" and phase not in args.path:
                        continue
                    rows.setdefault((side.name, phase), []).append(side.run(phase, args.block))
            loads.append(os.getloadavg()[0])
    finally:
        for side in sides:
            side.close()
    print(f"load average {min(loads):.1f}-{max(loads):.1f}; {args.blocks} turns of {args.block}")
    print("\n".join(table(rows, args.block)))
    print("\n".join(pairs(rows, args.block)))


def table(rows: dict[tuple[str, str], list[dict[str, float]]], block: int) -> list[str]:
    """The Markdown table of the turns: each side and path's rate (its jobs over its summed
    wall time), its median turn's rate, that rate over PgQueuer's, and the median CPU per
    job of its producer and its main."""
    pg = rows.get(("pgqueuer", "one")) or rows.get(("pgqueuer", "bulk"))
    pg_rate = None if pg is None else len(pg) * block / sum(r["wall"] for r in pg)
    lines = [
        "| side | path | jobs/s | median turn jobs/s | x PgQueuer | producer us/job "
        "| main us/job |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (name, phase), blocks in rows.items():
        rate = len(blocks) * block / sum(r["wall"] for r in blocks)
        turn = statistics.median(block / r["wall"] for r in blocks)
        ratio = "" if pg_rate is None else f"{rate / pg_rate:.2f}"
        producer = statistics.median(r["producer"] for r in blocks) / block * 1e6
        main_us = statistics.median(r["main"] for r in blocks) / block * 1e6
        path = PATHS.get(phase, phase) if name != "pgqueuer" else "Queries.enqueue"
        lines.append(
            f"| {name} | {path} | {rate:,.0f} | {turn:,.0f} | {ratio} | {producer:,.0f} | "
            f"{main_us:,.0f} |"
        )
    return lines


def pairs(rows: dict[tuple[str, str], list[dict[str, float]]], block: int) -> list[str]:
    """Each side and path's rate over PgQueuer's in the same turn, turn by turn (the
    load moves between turns, less within one), and how many turns it led; and the
    after side's over the before side's, path by path."""
    pg = rows.get(("pgqueuer", "one")) or rows.get(("pgqueuer", "bulk"))
    if pg is None:
        return []
    lines = []
    for (name, phase), blocks in rows.items():
        if name == "pgqueuer":
            continue
        ratios = [b["wall"] and p["wall"] / b["wall"] for b, p in zip(blocks, pg, strict=True)]
        lines.append(
            f"{name} {PATHS.get(phase, phase)} / PgQueuer by turn: "
            f"{' '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f}, "
            f"{sum(r >= 1 for r in ratios)} of {len(ratios)} at 1.0x or more)"
        )
    for (name, phase), blocks in rows.items():
        before = rows.get(("before", phase))
        if name == "after" and before is not None:
            ratios = [b["wall"] / a["wall"] for a, b in zip(blocks, before, strict=True)]
            lines.append(
                f"after / before, {PATHS.get(phase, phase)}, by turn: "
                f"{' '.join(f'{r:.2f}' for r in ratios)} "
                f"(median {statistics.median(ratios):.2f}, after faster in "
                f"{sum(r > 1 for r in ratios)} of {len(ratios)})"
            )
    return lines


PATHS = {
    "one": "through the main",
    "direct": "direct",
    "bulk": "bulk through the main",
    "bulk-direct": "bulk direct",
}
"""The name of each phase in the table."""

if __name__ == "__main__":
    main()
