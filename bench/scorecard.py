"""Issue 35's scorecard: every figure its "Done when" names, from one run, beside its
target (broker against PgQueuer, or against the broker's own baseline row).

    .venv/bin/python -m bench.scorecard [--reps 3] [--backlog 1000000] [--urgent-backlog 100000]
        [--parts side,urgent,scale,failover,crowd] [--out bench/results/scorecard]
    .venv/bin/python -m bench.scorecard --report DIR   # scorecard.md, .png again from DIR

One run is five benches run one after the other, each as its own process with its own
databases, writing into ``--out``:

- ``side``: ``python -m bench --systems broker-postgres-defaults,pgqueuer --no-floor``
  (``results.json``): the drain, the drain with 200 producers, enqueue one at a time
  through the main and direct, bulk enqueue, enqueue-to-start p50 and p99 at 50 jobs/s;
- ``urgent``: ``python -m bench.urgent`` (``urgent.jsonl``): priority-10 jobs enqueued
  one at a time during a drain of ``--urgent-backlog`` jobs, enqueue-to-start p50 and
  p99 pooled over every probe of every repetition;
- ``scale``: ``python -m bench.scale`` (``scale.json``): the drain over ``--backlog`` due
  and future jobs, the keyed drain at 1,000 and 30,000 keys, the main's CPU per job at
  1 worker x 64 slots and 64 workers x 1 slot, and beside PgQueuer the drain over 1,000
  queues and 64 one-slot workers' drain (the Done-when's "1,000 queues" and "64 workers"
  that must still lead);
- ``failover``: ``python -m bench.failover`` (``failover.json``): first completion after
  a leader's ``kill -9``, ten takeovers;
- ``crowd``: ``python -m bench.enqueue_bench SYSTEM --concurrent 50,200`` for each system
  in turn, the order reversed every repetition (``crowd.jsonl``): 50 and 200 producers
  enqueueing one job at a time each, as fast as they can (the issue's "50 and 200
  producers" that must still lead).

Every bench keeps its own report beside the scorecard (``results.md``, ``scale.md``,
...); the scorecard (``scorecard.md``, ``scorecard.json``, ``scorecard.png``) is
:func:`score` over their raw files, so ``--report`` can draw it again, and a part left
out (``--parts``) leaves its rows marked as not measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.harness import ROOT, percentile
from bench.report import DASH
from bench.scale import WORKERS_ROW
from bench.systems import BY_NAME, CHART_PYTHON, venv_python

BROKER = "broker-postgres-defaults"
PEER = "pgqueuer"
PARTS = ("side", "urgent", "scale", "failover", "crowd")
CROWDS = (50, 200)
"""Concurrent producers in the ``crowd`` part."""
CROWD_JOBS = 4000
"""Jobs each crowd enqueues: enough for 200 producers to send 20 each."""
QUEUES = 1000
"""Queues the ``scale`` part's queues drain spreads its jobs over (the issue's 1,000)."""
FLEET = 64
"""One-slot worker processes of the ``scale`` part's fleet (the issue's 64 workers)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One "Done when" figure: ``value`` against ``target``; ``higher`` says which way is
    better (a rate ratio must reach its target, a latency ratio stay under it)."""

    name: str
    value: float | None
    target: float
    higher: bool
    detail: str

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.target if self.higher else self.value <= self.target

    @property
    def margin(self) -> float | None:
        """The value over its target, turned so that above 1 is met (for the chart)."""
        if self.value is None or self.value == 0:
            return None
        return self.value / self.target if self.higher else self.target / self.value


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, digits: int = 0) -> str:
    return DASH if value is None else f"{value:,.{digits}f}"


def _paired(
    name: str,
    ours: list[float | None],
    theirs: list[float | None],
    target: float,
    *,
    higher: bool = True,
    unit: str = "jobs/s",
    digits: int = 0,
) -> Row:
    """A row whose value is the median of each turn's ratio: ``ours[i] / theirs[i]``,
    the two sides of turn ``i`` measured in the same minutes.

    The ratio of the two sides' medians took each median from whichever turn it fell
    in: on this shared machine the rates move 20% from one turn to the next, so a slow
    turn of one side set against a fast turn of the other decided the row (issue 35's
    first scorecard: 1M due jobs 0.83 by medians, turns 0.83, 1.02, 1.09). A turn with
    a side missing is left out; the detail shows both medians and every turn's ratio."""
    # A side whose later turns failed has a shorter list: its turns still pair by index.
    ratios = [a / b for a, b in zip(ours, theirs, strict=False) if a is not None and b]
    mine = _median([a for a in ours if a is not None])
    other = _median([b for b in theirs if b is not None])
    turns = ", ".join(f"{r:.2f}" for r in ratios)
    detail = f"{_fmt(mine, digits)} / {_fmt(other, digits)} {unit}" + (
        f"; turns {turns}" if ratios else ""
    )
    return Row(name, _median(ratios), target, higher, detail)


def _side_rows(results: dict[str, Any] | None) -> list[Row]:
    systems = {s["system"]: s for s in (results or {}).get("systems", [])}
    ours, theirs = systems.get(BROKER, {}), systems.get(PEER, {})

    def turns(system: dict[str, Any], workload: str, key: str) -> list[float | None]:
        # python -m bench runs the systems in turns, one repetition each: a workload's
        # k-th run on either side is turn k.
        return [r.get(key) for r in system.get(workload, [])]

    def rate(name: str, workload: str, key: str, target: float, peer_key: str = "") -> Row:
        return _paired(
            name, turns(ours, workload, key), turns(theirs, workload, peer_key or key), target
        )

    def latency(name: str, key: str) -> Row:
        a, b = turns(ours, "latency", key), turns(theirs, "latency", key)
        return _paired(name, a, b, 1.0, higher=False, unit="ms", digits=2)

    return [
        rate("drain ÷ PgQueuer", "drain", "per_s", 1.0),
        rate("drain with 200 producers ÷ PgQueuer", "producers", "per_s", 1.0),
        rate(
            "enqueue one at a time through the main ÷ PgQueuer", "drain", "enqueue_one_per_s", 0.8
        ),
        # A PgQueuer producer always writes straight into PostgreSQL: its one-at-a-time
        # figure is what both of the broker's paths are held to.
        rate(
            "enqueue one at a time direct ÷ PgQueuer",
            "drain",
            "enqueue_direct_per_s",
            1.2,
            peer_key="enqueue_one_per_s",
        ),
        rate("bulk enqueue through the main ÷ PgQueuer", "drain", "enqueue_bulk_per_s", 1.0),
        rate(
            "bulk enqueue direct ÷ PgQueuer",
            "drain",
            "enqueue_bulk_direct_per_s",
            1.0,
            peer_key="enqueue_bulk_per_s",
        ),
        latency("enqueue-to-start p50 at 50 jobs/s ÷ PgQueuer", "start_p50_ms"),
        latency("enqueue-to-start p99 at 50 jobs/s ÷ PgQueuer", "start_p99_ms"),
    ]


def _urgent_rows(runs: list[dict[str, Any]]) -> list[Row]:
    def pooled(row: str, q: float) -> float | None:
        probes = [ms for run in runs if run["row"] == row for ms in run["start_ms"]]
        return percentile(probes, q) if probes else None

    rows = []
    for q in (50, 99):
        a, b = pooled(BROKER, q), pooled(PEER, q)
        detail = f"{_fmt(a, 1)} / {_fmt(b, 1)} ms, every probe pooled"
        rows.append(
            Row(f"urgent job p{q} during a drain ÷ PgQueuer", _ratio(a, b), 1.0, False, detail)
        )
    return rows


def _scale_rows(scale: dict[str, Any] | None) -> list[Row]:
    runs = (scale or {}).get("runs", [])
    reps = sorted({r["rep"] for r in runs if "rep" in r})

    def turns(key: str, **match: Any) -> list[float | None]:
        """``key`` of the run that matches, in each repetition (bench.scale runs every
        shape of a part once a repetition, the systems in turns)."""
        by_rep = {
            r["rep"]: r.get(key) for r in runs if all(r.get(k) == v for k, v in match.items())
        }
        return [by_rep.get(rep) for rep in reps]

    def worker_us(shape: str) -> list[float | None]:
        """The broker's worker's CPU per job in the drain of ``shape``, each repetition."""
        cpu = turns("worker_cpu_s", part="drain", system=BROKER, shape=shape)
        done = turns("done", part="drain", system=BROKER, shape=shape)
        return [c / n if c is not None and n else None for c, n in zip(cpu, done, strict=True)]

    rows = []
    empty = turns("per_s", part="drain", system=BROKER, shape="empty")
    backlog = (scale or {}).get("config", {}).get("backlog", 0)
    for shape in ("due", "future"):
        ours = turns("per_s", part="drain", system=BROKER, shape=shape)
        label = f"drain over {backlog:,} {shape} jobs"
        theirs = turns("per_s", part="drain", system=PEER, shape=shape)
        rows.append(_paired(f"{label} ÷ PgQueuer", ours, theirs, 1.0))
        row = _paired(f"{label} ÷ the broker's empty table", ours, empty, 0.9)
        # A control: the worker never reads the store, so its CPU per job does not
        # depend on what the table holds. When it moves between the two turns as much as
        # the rate does, the machine's pace moved (or each message carried fewer jobs),
        # not what a deep table costs the main or PostgreSQL (bench/README.md, "Flat in
        # backlog depth", branch depth2).
        pace = [a / b for a, b in zip(worker_us(shape), worker_us("empty"), strict=True) if a and b]
        if pace:
            turns_text = ", ".join(f"{r:.2f}" for r in pace)
            control = f"; the worker's CPU per job (no store work) ÷ the empty turn's {turns_text}"
            row = dataclasses.replace(row, detail=row.detail + control)
        rows.append(row)
    rows.append(
        _paired(
            "keyed drain, 30,000 keys ÷ 1,000 keys",
            turns("per_s", part="keyed", keys=30000),
            turns("per_s", part="keyed", keys=1000),
            0.8,
        )
    )
    rows.append(
        _paired(
            "main CPU per job, 64 workers x 1 ÷ 1 worker x 64",
            turns("main_us_per_job", part="workers", setup="64x1"),
            turns("main_us_per_job", part="workers", setup="1x64"),
            1.1,
            higher=False,
            unit="µs",
        )
    )
    rows.append(
        _paired(
            f"drain over {QUEUES:,} queues ÷ PgQueuer",
            turns("per_s", part="queues", system=BROKER, queues=QUEUES),
            turns("per_s", part="queues", system=PEER, queues=QUEUES),
            1.0,
            unit="jobs/s, one worker told every queue",
        )
    )
    rows.append(
        _paired(
            f"{FLEET} one-slot workers' drain ÷ PgQueuer",
            turns("per_s", part="fleet", system=WORKERS_ROW, workers=FLEET),
            turns("per_s", part="fleet", system=PEER, workers=FLEET),
            1.0,
            unit="jobs/s, inline 1 / batch 1",
        )
    )
    return rows


def _crowd_rows(runs: list[dict[str, Any]]) -> list[Row]:
    def turns(system: str, crowd: int) -> list[float | None]:
        # Each turn runs each system once, so a system's k-th run is turn k.
        return [r["per_s"] for r in runs if r["system"] == system and r["phase"] == f"one-x{crowd}"]

    return [
        _paired(
            f"{crowd} producers enqueueing one at a time ÷ PgQueuer",
            turns(BROKER, crowd),
            turns(PEER, crowd),
            1.0,
        )
        for crowd in CROWDS
    ]


def _failover_rows(failover: dict[str, Any] | None) -> list[Row]:
    if not failover:
        return [
            Row("takeovers with a completion within 5 s of kill -9", None, 10, True, "not measured")
        ]
    within, rounds = failover["within_5_s"], failover["rounds"]
    first = failover["first_completion_s"]
    detail = f"{within} of {rounds}; median {first['median']:.2f} s, max {first['max']:.2f} s"
    return [Row("takeovers with a completion within 5 s of kill -9", within, rounds, True, detail)]


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def score(out: Path) -> list[Row]:
    """Every row of the scorecard from the raw files the parts wrote into ``out``."""
    return [
        *_side_rows(_read(out / "results.json")),
        *_urgent_rows(_read_lines(out / "urgent.jsonl")),
        *_scale_rows(_read(out / "scale.json")),
        *_failover_rows(_read(out / "failover.json")),
        *_crowd_rows(_read_lines(out / "crowd.jsonl")),
    ]


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    met = sum(r.met is True for r in rows)
    lines = [
        "# Issue 35's scorecard",
        "",
        f"Command: `{meta['command']}`, started {meta['started']}, "
        f"{meta['wall_s'] / 60:.0f} min; load average {meta['load_before']:.1f} at the start, "
        f"{meta['load_after']:.1f} at the end.",
        "Each part's own report is beside this file (`results.md`, `scale.md`, the urgent, "
        "failover and crowd raw files); the rows are `bench/scorecard.py`'s reading of their "
        "raw runs: medians of the repetitions (the urgent rows pool every probe).",
        "",
        f"**{met} of {len(rows)} met.**",
        "",
        "![scorecard](scorecard.png)",
        "",
        "| figure | value | target | met | broker / other |",
        "|---|---:|---:|:---:|---|",
    ]
    for r in rows:
        sign = "≥" if r.higher else "≤"
        met_text = {True: "yes", False: "**no**", None: DASH}[r.met]
        value = DASH if r.value is None else f"{r.value:.2f}"
        lines.append(f"| {r.name} | {value} | {sign} {r.target:g} | {met_text} | {r.detail} |")
    return "\n".join(lines) + "\n"


def chart(json_path: Path, png_path: Path) -> None:
    """One panel: every row's margin over its target, 1 = exactly met (the chart
    environment's python: matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in json.loads(json_path.read_text())["rows"] if r["margin"] is not None]
    fig, ax = plt.subplots(figsize=(11, 0.38 * len(rows) + 1.2))
    y = list(range(len(rows)))
    colours = ["#1e8449" if r["met"] else "#c0392b" for r in rows]
    ax.barh(y, [r["margin"] for r in rows], color=colours)
    ax.axvline(1.0, color="#222", linewidth=1)
    ax.set_yticks(y, [r["name"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ticks = [0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("value ÷ target, turned so that right of 1 is met (log scale)", fontsize=8)
    ax.set_title("Issue 35: broker against its targets (green: met)", fontsize=10)
    for yi, r in zip(y, rows, strict=True):
        ax.text(r["margin"], yi, f" {r['value']:.2f}", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110, bbox_inches="tight")


def write(out: Path, meta: dict[str, Any]) -> None:
    rows = score(out)
    (out / "scorecard.md").write_text(markdown(rows, meta))
    records = [{**dataclasses.asdict(r), "met": r.met, "margin": r.margin} for r in rows]
    (out / "scorecard.json").write_text(json.dumps({"meta": meta, "rows": records}, indent=1))
    if not CHART_PYTHON.exists():
        print(
            f"no chart: {CHART_PYTHON} is missing (`python -m bench` installs it)", file=sys.stderr
        )
        return
    drawn = subprocess.run(
        [str(CHART_PYTHON), "-m", "bench.scorecard", "--chart", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    if drawn.returncode != 0:
        print(f"chart failed: {drawn.stderr[-400:]}", file=sys.stderr)


Step = tuple[list[str], Callable[[str], None]]
"""A command line, and what to do with its standard output."""


def _commands(args: argparse.Namespace) -> dict[str, list[Step]]:
    """Each part: its steps, run in order."""
    out, reps = args.out, str(args.reps)

    def failover(stdout: str) -> None:
        # Its progress lines come first, then the summary as indented JSON.
        text = stdout[stdout.index("\n{") + 1 :] if not stdout.startswith("{") else stdout
        (out / "failover.json").write_text(text)

    def ignore(stdout: str) -> None:
        del stdout

    def crowd(stdout: str) -> None:
        with open(out / "crowd.jsonl", "a") as f:
            f.write(stdout)

    pythons = {BROKER: sys.executable, PEER: str(venv_python(BY_NAME[PEER]))}
    turns = [list(pythons) if rep % 2 == 0 else list(pythons)[::-1] for rep in range(args.reps)]

    python = sys.executable
    return {
        "side": [
            (
                [
                    python,
                    "-m",
                    "bench",
                    "--systems",
                    f"{BROKER},{PEER}",
                    "--reps",
                    reps,
                    "--no-floor",
                    "--out",
                    str(out),
                ],
                ignore,
            )
        ],
        "urgent": [
            (
                [
                    python,
                    "-m",
                    "bench.urgent",
                    "--backlog",
                    str(args.urgent_backlog),
                    "--reps",
                    reps,
                    "--out",
                    str(out / "urgent.jsonl"),
                ],
                ignore,
            )
        ],
        "scale": [
            (
                [
                    python,
                    "-m",
                    "bench.scale",
                    "--backlog",
                    str(args.backlog),
                    "--reps",
                    reps,
                    "--workers",
                    "1x64,64x1",
                    "--queues",
                    str(QUEUES),
                    "--fleet",
                    str(FLEET),
                    "--parts",
                    "drain,keyed,workers,queues,fleet",
                    "--out",
                    str(out),
                ],
                ignore,
            )
        ],
        "failover": [([python, "-m", "bench.failover"], failover)],
        "crowd": [
            (
                [
                    pythons[system],
                    "-m",
                    "bench.enqueue_bench",
                    system,
                    "--one",
                    str(CROWD_JOBS),
                    "--bulk",
                    "0",
                    "--concurrent",
                    ",".join(map(str, CROWDS)),
                    "--json",
                ],
                crowd,
            )
            for turn in turns
            for system in turn
        ],
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["--chart"]:
        out = Path(argv[1])
        chart(out / "scorecard.json", out / "scorecard.png")
        return 0
    if argv[:1] == ["--report"]:
        out = Path(argv[1])
        write(out, json.loads((out / "scorecard.json").read_text())["meta"])
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.scorecard")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--urgent-backlog", type=int, default=100_000)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scorecard")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "command": "python -m bench.scorecard " + " ".join(argv),
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_before": os.getloadavg()[0],
    }
    began = time.monotonic()
    commands = _commands(args)
    for part in args.parts.split(","):
        # bench.urgent and the crowd's turns append to their files
        (args.out / f"{part}.jsonl").unlink(missing_ok=True)
        for command, take in commands[part]:
            print(f"== {part}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
            done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                print(f"{part} failed with exit code {done.returncode}", file=sys.stderr)
                continue
            take(done.stdout)
    meta.update(wall_s=time.monotonic() - began, load_after=os.getloadavg()[0])
    write(args.out, meta)
    print((args.out / "scorecard.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
