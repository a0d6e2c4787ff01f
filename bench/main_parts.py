"""Where one main's CPU goes during a PostgreSQL drain, and how far one main goes.

The harness's own drain workload (the same backlog, worker and CPU accounting as
``make bench``), with three additions while the workers drain:

- the main's user and system CPU apart (``/proc/PID/stat``): the system time is its
  system calls (the sockets' sends and receives, ``epoll``);
- ``py-spy record --gil --format raw`` of ``broker-main`` (non-blocking), each sample
  charged to a *part* of the main by the innermost frame that is not a generic helper
  of the standard library (:data:`PARTS`), and to the task it ran in. Only samples
  holding the GIL count: on a loaded machine a thread waiting for a core is runnable,
  and py-spy's default (every thread not asleep) counted it as busy, above all just
  after ``epoll`` woke it or a ``send`` woke a peer; the GIL is released around both,
  so these samples are the Python's and the C extensions' CPU, the user time;
- the CPU of the PostgreSQL backends connected to the bench's own database
  (``/proc/PID/schedstat``), where ``make bench``'s store column counts every
  PostgreSQL process, other sessions' queries included;
- jobs per second per core of the main: one second of CPU divided by the main's CPU
  per job, the rate one main reaches when its core is the only limit.

    .venv/bin/python -m bench.main_parts [--jobs 20000] [--reps 3] [--raw DIR]

Prints one line per run and, at the end, the parts' shares and microseconds per job
(medians over the runs). See ``bench/README.md`` and ``docs/explanation/scaling.md``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.__main__ import checkpoint_postgres
from bench.enqueue_bench import backends, schedstat
from bench.harness import Config, Driver, Runner, Workers
from bench.peers.broker_peer import DATABASE
from bench.systems import BY_NAME

PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("wire: framing, decode, encode", ("broker/wire/", "/msgspec/")),
    ("handoff core (broker/core)", ("broker/core/",)),
    ("dispatcher and handoffs", ("broker/main/dispatcher.py", "broker/main/handoffs.py")),
    ("settle (reports to store)", ("broker/main/settler.py", "broker/settlement.py")),
    (
        "connections and requests",
        (
            "broker/main/connections.py",
            "broker/main/requests.py",
            "broker/main/sessions.py",
            "broker/main/carrier.py",
        ),
    ),
    ("store adapter (adapters/sql)", ("adapters/sql/",)),
    ("SQLAlchemy", ("/sqlalchemy/",)),
    ("asyncpg", ("/asyncpg/",)),
    (
        "logging and metrics",
        ("/logging/", "broker/model/logs.py", "broker/main/metrics.py", "/prometheus_client/"),
    ),
    ("job values (broker/jobs, model)", ("broker/jobs.py", "broker/model/", "broker/payload.py")),
    ("other broker/main", ("broker/main/",)),
    ("asyncio transports (Python around send, recv)", ("/asyncio/selector_events.py",)),
    ("event loop: tasks, futures, callbacks", ("/asyncio/", "/selectors.py", "/socket.py")),
)
"""Each part of the main and the path fragments of its source files, first match wins."""

HELPERS = re.compile(
    r"/(json|enum|typing|dataclasses|functools|re|uuid|datetime|copy|contextlib|abc"
    r"|collections|weakref|_weakrefset|types|operator|heapq|base64|struct)(/|\.py)|^/<string>$"
)
"""Generic stdlib helpers: a sample whose innermost frame is one of them is charged to
the nearest caller outside them (a ``json.dumps`` to the code that encodes)."""

FRAME = re.compile(r"\(([^()]*):\d+\)$")


def part_of(stack: str) -> str:
    """The part a collapsed stack's sample is charged to. py-spy names files by their
    path below ``sys.path`` (``asyncio/events.py``); a leading ``/`` anchors them."""
    files = ["/" + m.group(1) for f in stack.split(";") if (m := FRAME.search(f.strip()))]
    for path in reversed(files):
        if HELPERS.search(path):
            continue
        for part, fragments in PARTS:
            if any(fragment in path for fragment in fragments):
                return part
        return "other"
    return "other"


def activity_of(stack: str) -> str:
    """The task or callback a sample ran in: the frame the event loop's ``Handle._run``
    called last (``Dispatcher.run``, ``ReportSettler.run``), or, outside any, the
    loop's own innermost frame (its ``select``)."""
    frames = [f.strip() for f in stack.split(";")]
    runs = [i for i, f in enumerate(frames) if f.startswith("Handle._run ")]
    if runs and runs[-1] + 1 < len(frames):
        frame = frames[runs[-1] + 1]
    else:
        frame = "outside any task: " + frames[-1]
    return FRAME.sub(lambda m: f"({m.group(1)})", frame)


def parts(raw: Path) -> tuple[Counter[str], Counter[str]]:
    """Samples per part and per activity in a ``py-spy --format raw`` file (``stack
    count`` lines)."""
    by_part: Counter[str] = Counter()
    by_activity: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            by_part[part_of(stack)] += int(count)
            by_activity[activity_of(stack)] += int(count)
    return by_part, by_activity


def user_system(pid: int) -> tuple[float, float]:
    """``pid``'s user and system CPU seconds (``/proc/PID/stat``, clock ticks)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().decode(errors="replace").rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class ProfiledRunner(Runner):
    """The harness's drain, with py-spy on the main and the bench database's backends
    metered from the workers' start to the drain's end."""

    def __init__(self, driver: Driver, cfg: Config, out: Path, raw: Path | None) -> None:
        super().__init__(driver, cfg, out)
        self.raw = raw
        self.spy: subprocess.Popen[bytes] | None = None
        self.pg: dict[int, float] = {}
        self.pg_cpu_s = 0.0
        self.main_at_start = (0.0, 0.0)
        self.main_user_s = self.main_system_s = 0.0

    def _start_workers(self, marks: Path, log: Path) -> Workers:
        self.pg = {pid: schedstat(pid) for pid in backends(DATABASE)}
        self.main_at_start = user_system(self.d.main_pids()[0])
        if self.raw is not None:
            py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
            command = [py_spy, "record", "--pid", str(self.d.main_pids()[0]), "--rate", "1000"]
            command += ["--gil", "--format", "raw", "--nonblocking", "-o", str(self.raw)]
            self.spy = subprocess.Popen(command, stdout=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches before the first job
        return super()._start_workers(marks, log)

    def _watch(
        self, workers: Workers, marks: Path, spawned: float, n: int, run: dict[str, Any]
    ) -> None:
        try:
            super()._watch(workers, marks, spawned, n, run)
        finally:
            if self.spy is not None:
                self.spy.send_signal(signal.SIGINT)
                self.spy.wait()
                self.spy = None
            user, system = user_system(self.d.main_pids()[0])
            self.main_user_s = user - self.main_at_start[0]
            self.main_system_s = system - self.main_at_start[1]
            now = backends(DATABASE)
            self.pg_cpu_s = sum(schedstat(p) - self.pg.get(p, 0.0) for p in now)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.main_parts")
    parser.add_argument("--system", default="broker-postgres-defaults")
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--raw", metavar="DIR", help="keep py-spy's raw stacks in DIR")
    parser.add_argument("--no-profile", action="store_true", help="meter only, no py-spy")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="main-parts-"))
    raw_dir = Path(args.raw) if args.raw else workdir
    raw_dir.mkdir(parents=True, exist_ok=True)
    cfg = Config(workdir=str(workdir), hash_rounds=1000, drain_limit=120.0, run_timeout=180.0)
    driver: Driver = importlib.import_module(BY_NAME[args.system].module).DRIVERS[args.system](
        args.system, cfg
    )
    shares: list[dict[str, float]] = []
    activities: list[dict[str, float]] = []
    rows: list[dict[str, float]] = []
    driver.setup()
    try:
        for rep in range(args.reps):
            if error := checkpoint_postgres():
                print(error, file=sys.stderr)
            raw = None if args.no_profile else raw_dir / f"main-{rep + 1}.txt"
            runner = ProfiledRunner(driver, cfg, workdir / "out.json", raw)
            load = os.getloadavg()
            run = runner.drain("noop", args.jobs, 0)
            done = run["done"]
            row = {
                "per_s": run["per_s"],
                "main_us": run["main_cpu_s"] / done * 1e6,
                "main_user_us": runner.main_user_s / done * 1e6,
                "main_system_us": runner.main_system_s / done * 1e6,
                "pg_us": runner.pg_cpu_s / done * 1e6,
                "worker_us": run["worker_own_cpu_s"] / done * 1e6,
                "children_us": run["children_cpu_s"] / done * 1e6,
                "server_all_us": run["server_cpu_s"] / done * 1e6,
            }
            row["main_share"] = run["main_cpu_s"] / run["seconds"]
            row["per_core"] = 1e6 / row["main_us"]
            rows.append(row)
            print(
                f"run {rep + 1}: {row['per_s']:,.0f} jobs/s ({done} jobs), load {load[0]:.1f};"
                f" µs/job main {row['main_us']:.0f} (user {row['main_user_us']:.0f}, system"
                f" {row['main_system_us']:.0f}; busy {row['main_share']:.0%} of a core),"
                f" PostgreSQL backends {row['pg_us']:.0f} (all PostgreSQL processes"
                f" {row['server_all_us']:.0f}), worker {row['worker_us']:.0f},"
                f" children {row['children_us']:.0f}; one main per core:"
                f" {row['per_core']:,.0f} jobs/s",
                flush=True,
            )
            if raw is not None and raw.exists():
                by_part, by_activity = parts(raw)
                total = sum(by_part.values()) or 1
                shares.append({part: n / total for part, n in by_part.items()})
                activities.append({act: n / total for act, n in by_activity.items()})
    finally:
        driver.teardown()
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print("\nmedians:", ", ".join(f"{k} {v:,.2f}" for k, v in medians.items()))
    for title, table in (("part of broker-main", shares), ("task it ran in", activities)):
        if table:
            _share_table(title, table, medians["main_user_us"])
    return 0


def _share_table(title: str, shares: list[dict[str, float]], main_us: float) -> None:
    """A Markdown table of the median share of each key over the runs, largest first,
    with the microseconds of the main's user CPU per job it stands for (top 12)."""
    median = {
        key: statistics.median(s.get(key, 0.0) for s in shares)
        for key in {k for s in shares for k in s}
    }
    print(f"\n| {title} | share of its user CPU | µs per job (of {main_us:.0f}) |")
    print("|---|---:|---:|")
    for key, share in sorted(median.items(), key=lambda kv: -kv[1])[:12]:
        print(f"| {key} | {share:.1%} | {share * main_us:.1f} |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
