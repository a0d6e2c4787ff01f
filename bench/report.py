"""Turns ``results.json`` into the Markdown report; every figure comes from the runs.

The peer baseline (``peer-baseline.md``, measured on this kind of machine before the
harness existed) is parsed, not copied, and shown beside this run's figures.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

BASELINE_PATHS = (
    Path(__file__).resolve().parents[2] / "shared" / "notes" / "peer-baseline.md",
    Path("/work/shared/notes/peer-baseline.md"),
)
BASELINE_ROWS = {
    "celery": "Celery",
    "rq": "RQ (2 forking",
    "rq-simple": "RQ (2 SimpleWorkers",
    "dramatiq": "Dramatiq",
    "arq": "arq (2 x max_jobs",
    "arq-fastpoll": "arq (0.01",
    "procrastinate": "Procrastinate",
    "pgqueuer": "PgQueuer",
}
BASELINE_COLUMNS = ("enqueue_one", "enqueue_bulk", "drain", "start_p50", "start_p99")
DASH = "\u2013"
TIMES = "\u00d7"


# ----------------------------------------------------------------------------- numbers


def spread(values: list[float | None]) -> tuple[float, float, float] | None:
    """``(median, min, max)`` of the values present."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return statistics.median(present), min(present), max(present)


def fmt(value: float | None) -> str:
    if value is None:
        return DASH
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def cell(values: list[float | None], marks: str = "") -> str:
    s = spread(values)
    if s is None:
        return DASH
    median, lo, hi = s
    if len([v for v in values if v is not None]) == 1 or fmt(lo) == fmt(hi):
        return f"{fmt(median)}{marks}"
    return f"{fmt(median)}{marks} ({fmt(lo)}{DASH}{fmt(hi)})"


def metric(result: dict[str, Any], workload: str, key: str) -> list[float | None]:
    return [run.get(key) for run in result.get(workload, [])]


def summary(result: dict[str, Any]) -> dict[str, tuple[float, float, float] | None]:
    """Median, min and max of every headline figure of one system."""
    per_job = [
        (r["worker_cpu_s"] * 1000 / r["done"]) if r.get("done") else None
        for r in result.get("drain", [])
    ]
    return {
        "enqueue_one": spread(metric(result, "drain", "enqueue_one_per_s")),
        "enqueue_direct": spread(metric(result, "drain", "enqueue_direct_per_s")),
        "enqueue_bulk": spread(metric(result, "drain", "enqueue_bulk_per_s")),
        "enqueue_bulk_direct": spread(metric(result, "drain", "enqueue_bulk_direct_per_s")),
        "drain": spread(metric(result, "drain", "per_s")),
        "cpu": spread(metric(result, "cpu", "per_s")),
        "startup": spread(metric(result, "drain", "startup_s")),
        "start_p50": spread(metric(result, "latency", "start_p50_ms")),
        "start_p99": spread(metric(result, "latency", "start_p99_ms")),
        "complete_p50": spread(metric(result, "latency", "complete_p50_ms")),
        "complete_p99": spread(metric(result, "latency", "complete_p99_ms")),
        "worker_cpu_ms_per_job": spread(per_job),
    }


def one_line(result: dict[str, Any]) -> str:
    s = summary(result)
    parts = []
    for key, label, unit in (
        ("drain", "drain", "/s"),
        ("cpu", "cpu", "/s"),
        ("start_p50", "start p50", " ms"),
        ("start_p99", "p99", " ms"),
    ):
        value = s[key]
        parts.append(f"{label} {fmt(value[0]) if value else DASH}{unit}")
    errors = result.get("errors") or []
    tail = f"; {len(errors)} error(s): {errors[0][:160]}" if errors else ""
    return f"{', '.join(parts)} [{result.get('wall_s', 0):.0f} s]{tail}"


# ----------------------------------------------------------------------------- baseline


def _first_number(text: str) -> float | None:
    match = re.search(r"\d[\d,]*(?:\.\d+)?", text.replace("*", ""))
    return float(match.group(0).replace(",", "")) if match else None


def read_baseline() -> dict[str, Any]:
    """The peer figures of ``peer-baseline.md``, by system, or an empty dict."""
    for path in BASELINE_PATHS:
        if path.exists():
            break
    else:
        return {}
    rows: dict[str, dict[str, float | None]] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("| ") or line.startswith(("| system", "|---")):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 6:
            continue
        for system, prefix in BASELINE_ROWS.items():
            if cells[0].startswith(prefix):
                rows[system] = dict(
                    zip(BASELINE_COLUMNS, (_first_number(c) for c in cells[1:6]), strict=True)
                )
    return {"source": str(path), "rows": rows}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object another tool wrote (``floor.json``, ``rss-soak.json``), or an empty dict."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data


def read_soak(path: Path) -> dict[str, Any]:
    """The last ``make bench-soak`` (``rss-soak.json``) without its series, or an empty dict."""
    data = read_json(path)
    return {k: v for k, v in data.items() if k != "samples"}


# ----------------------------------------------------------------------------- markdown


def _table(header: list[str], rows: list[list[str]], align: str = "---:") -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|---|" + "|".join([align] * (len(header) - 1)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _label(result: dict[str, Any]) -> str:
    return str(result.get("label") or result["system"])


def _cut(result: dict[str, Any], workload: str) -> str:
    return "†" if any(r.get("timed_out") for r in result.get(workload, [])) else ""


def _throughput_rows(systems: list[dict[str, Any]], default_n: int) -> list[list[str]]:
    rows = []
    for r in systems:
        if r.get("skipped"):
            rows.append([_label(r), r["skipped"], "", "", "", "", "", ""])
            continue
        bulk = cell(metric(r, "drain", "enqueue_bulk_per_s")) if r.get("has_bulk") else "no bulk"
        n = {run.get("jobs") for run in r.get("drain", [])}
        drain_n = f" [{', '.join(f'{x:,}' for x in sorted(n))} jobs]" if n - {default_n} else ""
        rows.append(
            [
                _label(r),
                cell(metric(r, "drain", "enqueue_one_per_s")),
                cell(metric(r, "drain", "enqueue_direct_per_s")) if r.get("has_direct") else DASH,
                bulk,
                cell(metric(r, "drain", "enqueue_bulk_direct_per_s"))
                if r.get("has_direct")
                else DASH,
                cell(metric(r, "drain", "per_s"), _cut(r, "drain")) + drain_n,
                cell(metric(r, "cpu", "per_s"), _cut(r, "cpu")),
                cell(metric(r, "drain", "startup_s")),
            ]
        )
    return rows


def _latency_rows(systems: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in systems:
        if r.get("skipped") or not r.get("latency"):
            continue
        has_complete = any("complete_p50_ms" in s for s in r["latency"])
        rows.append(
            [
                _label(r),
                cell(metric(r, "latency", "start_p50_ms")),
                cell(metric(r, "latency", "start_p99_ms")),
                cell(metric(r, "latency", "complete_p50_ms")) if has_complete else "not recorded",
                cell(metric(r, "latency", "complete_p99_ms")) if has_complete else "not recorded",
            ]
        )
    return rows


def _per_job(key: str) -> Callable[[dict[str, Any]], float | None]:
    """CPU ms per completed job of one process group in a drain run (``None``: not measured)."""
    return lambda run: run[key] * 1000 / run["done"] if run.get("done") and key in run else None


def _total_per_job(run: dict[str, Any]) -> float | None:
    """Every process's CPU per job: workers with their children, the main, the store."""
    if not run.get("done"):
        return None
    keys = ("worker_cpu_s", "main_cpu_s", "server_cpu_s")
    return sum(run.get(k) or 0.0 for k in keys) * 1000 / run["done"]


def _resource_rows(systems: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in systems:
        drains = r.get("drain", [])
        if r.get("skipped") or not drains:
            continue
        is_broker = str(r["system"]).startswith("broker")
        split = any("worker_own_cpu_s" in run for run in drains)
        has_children = any(run.get("children_cpu_s") for run in drains)
        server = DASH
        if any(run.get("server_cpu_s") for run in drains):
            server = cell([_per_job("server_cpu_s")(run) for run in drains])
        worker_key = "worker_own_cpu_s" if split else "worker_cpu_s"
        rows.append(
            [
                _label(r),
                cell([_per_job("main_cpu_s")(run) for run in drains]) if is_broker else "n/a",
                cell([_per_job(worker_key)(run) for run in drains]),
                cell([_per_job("children_cpu_s")(run) for run in drains])
                if split and has_children
                else ("0" if split else "in workers"),
                server,
                cell([_total_per_job(run) for run in drains]),
                cell([run.get("worker_rss_mb") for run in drains]),
                cell([run.get("main_rss_mb") for run in drains]) if is_broker else "n/a",
            ]
        )
    return rows


def _failed(runs: list[dict[str, Any]]) -> int:
    return sum(int(run.get("enqueue_failed") or 0) for run in runs)


def _producer_rows(systems: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in systems:
        runs = r.get("producers", [])
        if r.get("skipped") or not runs:
            continue
        without = spread(metric(r, "drain", "per_s"))
        with_ = spread(metric(r, "producers", "per_s"))
        ratio = f"{TIMES}{with_[0] / without[0]:.2f}" if with_ and without else DASH
        offered = {(run.get("producers"), run.get("producer_rate")) for run in runs}
        rows.append(
            [
                _label(r),
                ", ".join(
                    f"{p} x {fmt(rate)}/s" if rate else f"{p} x flat out" for p, rate in offered
                ),
                cell(metric(r, "producers", "per_s"), _cut(r, "producers")),
                cell(metric(r, "drain", "per_s"), _cut(r, "drain")),
                ratio,
                cell(metric(r, "producers", "enqueue_per_s"))
                + (f" ({failed:,} failed)" if (failed := _failed(runs)) else ""),
                cell(metric(r, "producers", "enqueue_p50_ms")),
                cell(metric(r, "producers", "enqueue_p99_ms")),
                cell(metric(r, "producers", "enqueue_max_ms")),
            ]
        )
    return rows


FLOOR_PARTS = (
    ("main", "main_cpu_s"),
    ("worker", "worker_own_cpu_s"),
    ("children", "children_cpu_s"),
    ("store", "server_cpu_s"),
)


ENQUEUE_FLOOR_PATHS = (
    ("pgqueuer", "PgQueuer's producer, straight into PostgreSQL"),
    ("direct", "the main's store write of one job, called in the producer (no main)"),
    ("relay", "that write behind a process that does nothing else: the floor of any main"),
    ("main", "broker-main: `Client.enqueue`, one job a call"),
)


CPU_PROCESSES = ("producer", "between", "store")
"""The processes ``bench/enqueue_floor.py`` reads CPU per job of, in the table's order."""


def median_cpu(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each process's median CPU per job over ``runs`` (``bench/enqueue_floor.py``), in
    :data:`CPU_PROCESSES` order; a process some run lacks is left out."""
    keys = [k for k in CPU_PROCESSES if runs and all(k in r for r in runs)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def _enqueue_floor_lines(record: dict[str, Any]) -> list[str]:
    """The one-at-a-time paths of ``bench/enqueue_floor.py``, measured in the same turns,
    as rates and multiples of PgQueuer's: what a main on this design can reach at best."""
    rates = record.get("rates") or {}
    cpu = record.get("cpu_us") or {}
    pgq = spread(rates.get("pgqueuer") or [])
    rows = []
    for key, label in ENQUEUE_FLOOR_PATHS:
        values = rates.get(key)
        if not values:
            continue
        median = statistics.median(values)
        ratio = f"{TIMES}{median / pgq[0]:.2f}" if pgq else DASH
        used = median_cpu(cpu.get(key) or [])
        cells = [f"{used[k]:,.0f}" if k in used else DASH for k in CPU_PROCESSES]
        total = f"{sum(used.values()):,.0f}" if used else DASH
        rows.append([label, cell(values), ratio, *cells, total])
    if not rows:
        return []
    return [
        "",
        "## One at a time through a main: the floor",
        "",
        f"`bench/enqueue_floor.py`, measured {record.get('generated', '?')}: "
        f"{record.get('jobs', '?'):,} no-op jobs enqueued one at a time on each path, each "
        "path in turn, "
        f"{record.get('reps', '?')} turns; jobs/s, median (min{DASH}max). A relay that "
        "reads a line, makes the store write and answers a line is the least a process "
        "between the producer and the store adds; where it does not beat PgQueuer, no main "
        "on this design can. CPU: microseconds per job, median, of the producer, of the "
        "process between it and the store (the relay, broker-main) and of the PostgreSQL "
        "backends serving the path; one at a time they run in turn, so their sum is most "
        "of each enqueue's wall time.",
        "",
        *_table(
            [
                "path",
                "jobs/s",
                f"{TIMES} PgQueuer",
                "producer µs",
                "between µs",
                "PostgreSQL µs",
                "all µs",
            ],
            rows,
        ),
    ]


def _floor_rows(systems: list[dict[str, Any]], floor: dict[str, Any]) -> list[list[str]]:
    """Each broker row's CPU per job per process as a multiple of the floor for its mode."""
    batch = str(floor.get("report_batch"))
    by_mode = floor.get("floor", {}).get(batch, {})
    rows = []
    for r in systems:
        drains = r.get("drain", [])
        least = by_mode.get(r.get("mode"))
        # The floor's statements ran on PostgreSQL: the SQLite rows have no floor here.
        if not str(r["system"]).startswith("broker-postgres") or r.get("skipped") or not drains:
            continue
        if least is None or not any("worker_own_cpu_s" in run for run in drains):
            continue
        cells = [_label(r)]
        for part, key in FLOOR_PARTS:
            spent = spread([_per_job(key)(run) for run in drains])
            if spent is None or not least[part]:
                cells.append(DASH)  # not measured, or no such process in this mode
                continue
            cells.append(
                f"{fmt(spent[0])} vs {least[part]:.3f} ({TIMES}{spent[0] / least[part]:.0f})"
            )
        total = spread([_total_per_job(run) for run in drains])
        cells.append(
            f"{fmt(total[0])} vs {least['all']:.3f} ({TIMES}{total[0] / least['all']:.0f})"
            if total
            else DASH
        )
        rows.append(cells)
    return rows


def _pgqueuer_rows(systems: list[dict[str, Any]]) -> list[list[str]]:
    """Each broker row as a multiple of PgQueuer's figure in the same run."""
    peer = next((r for r in systems if r["system"] == "pgqueuer" and not r.get("skipped")), None)
    if peer is None:
        return []

    def medians(r: dict[str, Any]) -> dict[str, float | None]:
        s = summary(r)
        out = {k: (v[0] if v else None) for k, v in s.items()}
        total = spread([_total_per_job(run) for run in r.get("drain", [])])
        with_producers = spread(metric(r, "producers", "per_s"))
        out["cpu_total"] = total[0] if total else None
        out["producers"] = with_producers[0] if with_producers else None
        return out

    theirs = medians(peer)
    # A PgQueuer client always writes straight into PostgreSQL: its one-at-a-time figure
    # is what the broker's direct enqueue is held to.
    theirs["enqueue_direct"] = theirs["enqueue_one"]
    theirs["enqueue_bulk_direct"] = theirs["enqueue_bulk"]
    rows = []
    for r in systems:
        if not str(r["system"]).startswith("broker") or r.get("skipped"):
            continue
        ours = medians(r)
        cells = [_label(r)]
        for key in (
            "drain",
            "producers",
            "enqueue_one",
            "enqueue_direct",
            "enqueue_bulk",
            "enqueue_bulk_direct",
            "start_p50",
            "start_p99",
            "cpu_total",
        ):
            a, b = ours.get(key), theirs.get(key)
            cells.append(f"{TIMES}{a / b:.2f}" if a is not None and b else DASH)
        rows.append(cells)
    return rows


def _baseline_rows(data: dict[str, Any]) -> list[list[str]]:
    rows = []
    base = data.get("baseline", {}).get("rows", {})
    for r in data["systems"]:
        ref = base.get(r["system"])
        if not ref or r.get("skipped"):
            continue
        here = summary(r)
        cells = [_label(r)]
        for key in ("enqueue_one", "enqueue_bulk", "drain", "start_p50", "start_p99"):
            ours = here.get(key)
            theirs = ref.get(key)
            if ours is None or theirs is None:
                cells.append(f"{fmt(ours[0]) if ours else DASH} vs {fmt(theirs)}")
                continue
            cells.append(f"{fmt(ours[0])} vs {fmt(theirs)} ({TIMES}{ours[0] / theirs:.2f})")
        rows.append(cells)
    return rows


def _header(data: dict[str, Any], chart_error: str | None) -> list[str]:
    env = data["environment"]
    cfg = data["config"]
    redis, pg = env["redis"], env["postgres"]
    redis_text = (
        f"Redis {redis['version']} at {redis['where']}, {redis['persistence']}"
        if redis.get("ok")
        else f"**Redis missing**: {redis['error']}"
    )
    pg_text = (
        f"PostgreSQL {pg['server_version']} at {pg['where']}, fsync {pg['fsync']}, "
        f"synchronous_commit {pg['synchronous_commit']}, full_page_writes {pg['full_page_writes']}"
        "; a `CHECKPOINT` before each system, so none starts in its predecessor's writes"
        if pg.get("ok")
        else f"**PostgreSQL missing**: {pg['error']}"
    )
    others = [r.get("other_cpu_pct", 0.0) for r in data["systems"] if "other_cpu_pct" in r]
    busiest = max(others, default=0.0)
    load = data["loadavg_start"]
    load_text = (
        f"Load average {load[0]:.2f} when the run started, "
        f"{data['loadavg_end'][0]:.2f} at the end. "
        f"CPU used by processes outside the benchmark (other sessions' tests and the like) "
        f"while each system ran: up to {busiest:.0f}% of one core"
    )
    if busiest > 20:
        load_text += (
            " — **this machine was not idle: figures carry that noise** (per system in the "
            "last table)"
        )
    lines = [
        "# Broker and peers, side by side",
        "",
        f"Generated by `make bench` on {data['generated']} in {data['wall_s'] / 60:.1f} min. "
        "Every figure below is computed from `results.json` (raw runs) by `bench/report.py`.",
        "",
        f"- Machine: {env['cores']} cores ({env['cpu']}), {env['memory_gib']} GiB, "
        f"Linux {env['kernel']}, Python {env['python']}.",
        f"- {redis_text}.",
        f"- {pg_text}.",
        f"- {load_text}.",
        f"- Each cell: median of {cfg['reps']} runs (min{DASH}max); the systems take turns, "
        "one repetition of each, then the next. "
        f"Drain: {cfg['drain_jobs']:,} "
        f"no-op jobs ({cfg['one_by_one']:,} enqueued one call at a time, the rest in bulk), "
        "then the workers start. 1-by-1 direct (broker on PostgreSQL): as many jobs as "
        "1-by-1, enqueued one at a time by "
        "`broker.enqueue_in_async` on the producer's own asyncpg connection, straight into "
        "the store as a PgQueuer client writes (the main's LISTEN picks them up); 1-by-1 is "
        "through broker-main; bulk direct: then as many jobs as the bulk, in one "
        "`broker.enqueue_each_in_async` call on that connection; both into a store emptied "
        "again before the drain's jobs. Drain rate: from the first "
        "job body starting until the system's own records show every job complete. "
        "† = a run was cut "
        f"{cfg['drain_limit']:.0f} s after its first job started; its rate counts the jobs "
        "complete by then.",
        f"- CPU-bound: {cfg['cpu_jobs']:,} jobs of {env['hash_rounds']:,} SHA-256 rounds "
        f"({env['hash_job_ms']:.1f} ms on one core here), drained the same way; two "
        f"processes cannot beat {2000 / env['hash_job_ms']:.0f} jobs/s.",
        f"- Latency: {cfg['latency_jobs']} no-op jobs sent one at a time at "
        f"{cfg['latency_rate']:.0f}/s to idle, warmed-up workers; to start = from just before "
        "the enqueue call to the job body starting; to complete = to the completion time the "
        "system itself records.",
        "- Everyone gets two processes running jobs (or the closest the system allows), "
        "configured as its docs suggest for throughput; bytecode is precompiled for every "
        "system"
        + (
            " (this machine sets PYTHONDONTWRITEBYTECODE=1)."
            if env.get("pythondontwritebytecode")
            else "."
        ),
        "",
        "![chart](chart.png)" if not chart_error else f"Chart not drawn: {chart_error}",
        "",
    ]
    return lines


def markdown(data: dict[str, Any], chart_error: str | None = None) -> str:
    systems = data["systems"]
    lines = _header(data, chart_error)
    lines += ["## Throughput", ""]
    lines += _table(
        [
            "system (setup)",
            "enqueue 1-by-1 /s",
            "enqueue 1-by-1 direct /s",
            "enqueue bulk /s",
            "enqueue bulk direct /s",
            "drain jobs/s",
            "5 ms CPU jobs/s",
            "start-up s",
        ],
        _throughput_rows(systems, data["config"]["drain_jobs"]),
    )
    lines += ["", "## Latency at 50 jobs/s, idle workers (ms)", ""]
    lines += _table(
        ["system", "to start p50", "to start p99", "to complete p50", "to complete p99"],
        _latency_rows(systems),
    )
    lines += [
        "",
        "## CPU per job and memory during the drain",
        "",
        "CPU is user + system time from the first job start to the end of the drain, per "
        "job, per process: broker-main; the worker processes themselves; their children "
        "(pool children, recycled ones included); the store server (redis-server, or every "
        "PostgreSQL process, other sessions' queries included); and all of them together. "
        "RSS: the peak of the worker tree's summed resident memory, and of broker-main's.",
        "",
    ]
    lines += _table(
        [
            "system",
            "main ms/job",
            "worker ms/job",
            "children ms/job",
            "store server ms/job",
            "all ms/job",
            "worker peak RSS MB",
            "main peak RSS MB",
        ],
        _resource_rows(systems),
    )
    producer_rows = _producer_rows(systems)
    if producer_rows:
        cfg = data["config"]
        lines += [
            "",
            "## Draining while producers enqueue",
            "",
            f"A backlog of {cfg.get('producer_jobs', cfg['drain_jobs']):,} no-op jobs "
            "enqueued in bulk; "
            f"{cfg.get('producers', 200)} producers connect (each with a connection of its "
            "own where the system allows: see Settings), then the workers start and every "
            "producer enqueues one job at a time at the stated rate, waiting for each "
            "acknowledgement, until a backlog's worth of jobs is complete. Drain = every job "
            "completed per second meanwhile; without = the drain workload above; enqueue = "
            "acknowledged enqueues per second and the time from the call to its "
            "acknowledgement (ms).",
            "",
        ]
        lines += _table(
            [
                "system",
                "producers x rate",
                "drain with producers /s",
                "drain without /s",
                "with / without",
                "enqueued /s",
                "enqueue p50 ms",
                "enqueue p99 ms",
                "enqueue max ms",
            ],
            producer_rows,
        )
    pgq_rows = _pgqueuer_rows(systems)
    if pgq_rows:
        lines += [
            "",
            "## Broker against PgQueuer, same run",
            "",
            f"Each broker median as a multiple of PgQueuer's ({TIMES} = broker / PgQueuer): "
            "above 1 is better for the rates, below 1 is better for latency and CPU.",
            "",
        ]
        lines += _table(
            [
                "system",
                "drain",
                "drain with producers",
                "enqueue 1-by-1",
                "enqueue 1-by-1 direct",
                "enqueue bulk",
                "enqueue bulk direct",
                "start p50",
                "start p99",
                "all CPU per job",
            ],
            pgq_rows,
        )
    lines += _enqueue_floor_lines(data.get("enqueue_floor") or {})
    floor = data.get("floor") or {}
    floor_rows = _floor_rows(systems, floor)
    if floor_rows:
        lines += [
            "",
            "## Distance from the floor",
            "",
            "Each process's CPU per job in the drain against the least it could spend on this "
            f"design (`bench/floor.py`, measured {floor.get('generated', '?')}, claim and "
            f"settle batches of {floor.get('report_batch')}; bench/README.md explains the "
            f"sum): ms/job here vs the floor ({TIMES} = here / floor).",
            "",
        ]
        lines += _table(["system", "main", "worker", "children", "store server", "all"], floor_rows)
    soak = data.get("rss_soak") or {}
    if soak.get("summary"):
        s = soak["summary"]
        slope = s.get("second_half_slope_mb_per_min")
        lines += [
            "",
            "## broker-main RSS soak (the last `make bench-soak`, not this run)",
            "",
            f"{soak['jobs']:,} no-op jobs enqueued and drained on PostgreSQL in "
            f"{soak['seconds'] / 60:.1f} min on {soak['generated']}: broker-main's RSS "
            f"{s['first_mb']:.1f} MB at the start, {s['last_mb']:.1f} MB at the end, "
            f"max - min {s['max_minus_min_mb']:.1f} MB"
            + (f", {slope:+.3f} MB/min over the second half" if slope is not None else "")
            + " (`rss-soak.md`).",
        ]
    baseline = _baseline_rows(data)
    if baseline:
        lines += [
            "",
            "## This run against the peer baseline",
            "",
            f"Medians here vs `{Path(data['baseline']['source']).name}` "
            f"({TIMES} = here / baseline).",
            "",
        ]
        lines += _table(
            ["system", "enqueue 1-by-1 /s", "enqueue bulk /s", "drain /s", "p50 ms", "p99 ms"],
            baseline,
        )
    lines += ["", "## Settings, versions, durability", ""]
    rows = []
    for r in systems:
        versions = ", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items())
        setup = r.get("setup", "")
        if r.get("producer_text"):
            setup += f"; producers: {r['producer_text']}"
        rows.append(
            [
                _label(r),
                setup,
                r.get("bulk", ""),
                versions,
                r.get("durability", ""),
                f"{r.get('other_cpu_pct', 0):.0f}%" if "other_cpu_pct" in r else DASH,
            ]
        )
    lines += _table(
        ["system", "setup", "bulk enqueue", "versions", "durability", "others' CPU"], rows, "---"
    )
    errors = [(r["system"], e) for r in systems for e in r.get("errors") or []]
    if errors:
        lines += ["", "## What went wrong", ""]
        lines += [f"- {name}: {text}".replace("\n", " ") for name, text in errors]
    return "\n".join(lines) + "\n"
