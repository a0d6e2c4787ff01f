"""The benchmark's own arithmetic: per-process CPU, the floor, the ratios, the RSS slope.

The benchmark runs for minutes and is never part of ``make test``; these check the sums
that turn its raw runs into the report, on small hand-made runs whose answers are known.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import floor, harness, report, rss_soak


def _drain(**cpu_s: float) -> dict[str, Any]:
    run: dict[str, Any] = {"jobs": 1000, "done": 1000, "per_s": 500.0}
    run.update(cpu_s)
    return run


def _system(name: str, mode: str = "pooled", **workloads: Any) -> dict[str, Any]:
    return {"system": name, "label": name, "mode": mode, "errors": [], **workloads}


BROKER = _system(
    "broker-postgres",
    drain=[
        _drain(
            worker_cpu_s=1.5,
            worker_own_cpu_s=0.5,
            children_cpu_s=1.0,
            main_cpu_s=0.25,
            server_cpu_s=0.25,
            enqueue_one_per_s=400.0,
            enqueue_direct_per_s=900.0,
        )
    ],
    producers=[
        {
            "per_s": 250.0,
            "producers": 200,
            "producer_rate": 2.0,
            "enqueue_per_s": 390.0,
            "enqueue_p50_ms": 4.0,
            "enqueue_p99_ms": 20.0,
            "enqueue_max_ms": 30.0,
            "enqueue_failed": 3,
        }
    ],
)
PGQUEUER = _system(
    "pgqueuer",
    mode="",
    drain=[
        {
            "jobs": 1000,
            "done": 1000,
            "per_s": 5000.0,
            "worker_cpu_s": 0.1,
            "worker_own_cpu_s": 0.1,
            "children_cpu_s": 0.0,
            "server_cpu_s": 0.1,
            "enqueue_one_per_s": 1000.0,
        }
    ],
    producers=[{"per_s": 1000.0}],
)


def test_the_resources_table_splits_cpu_per_job_by_process() -> None:
    (row,) = report._resource_rows([BROKER])
    # main, worker itself, children, store, all (ms per job over 1000 jobs)
    assert row[1:6] == ["0.25", "0.50", "1.00", "0.25", "2.00"]


def test_runs_from_before_the_split_show_the_worker_tree_whole() -> None:
    old = _system("broker-sqlite", drain=[_drain(worker_cpu_s=1.5, main_cpu_s=0.25)])
    (row,) = report._resource_rows([old])
    assert row[2] == "1.50"
    assert row[3] == "in workers"


def test_producers_are_compared_with_the_drain_without_them_and_failures_shown() -> None:
    (row,) = report._producer_rows([BROKER])
    assert row[1] == "200 x 2.00/s"
    assert row[2:5] == ["250", "500", "\u00d70.50"]
    assert row[5] == "390 (3 failed)"
    assert row[7] == "20.0"


def test_each_broker_row_is_a_multiple_of_pgqueuers_figures() -> None:
    (row,) = report._pgqueuer_rows([BROKER, PGQUEUER])
    assert row[0] == "broker-postgres"
    assert row[1] == "\u00d70.10"  # drain 500 / 5000
    assert row[2] == "\u00d70.25"  # with producers 250 / 1000
    assert row[3] == "\u00d70.40"  # 1-by-1 through the main 400 / 1000
    assert row[4] == "\u00d70.90"  # 1-by-1 direct 900 / PgQueuer's 1-by-1, always direct
    assert row[6] == "\u2013"  # no bulk direct figure in this run
    assert row[9] == "\u00d710.00"  # all CPU per job 2.0 / 0.2 ms


def test_no_pgqueuer_row_no_ratio_table() -> None:
    assert report._pgqueuer_rows([BROKER]) == []


FLOOR = {
    "generated": "now",
    "report_batch": 10,
    "floor": {
        "10": {
            "pooled": {"main": 0.05, "worker": 0.02, "children": 0.01, "store": 0.05, "all": 0.13},
            "inline": {"main": 0.05, "worker": 0.01, "children": 0.0, "store": 0.05, "all": 0.11},
        }
    },
}


def test_the_floor_table_holds_each_postgresql_row_to_its_modes_floor() -> None:
    inline = dict(BROKER, system="broker-postgres-inline1", label="inline", mode="inline")
    sqlite = dict(BROKER, system="broker-sqlite", label="sqlite")
    pooled_row, inline_row = report._floor_rows([BROKER, inline, sqlite, PGQUEUER], FLOOR)
    assert pooled_row[1] == "0.25 vs 0.050 (\u00d75)"
    assert pooled_row[3] == "1.00 vs 0.010 (\u00d7100)"
    assert inline_row[0] == "inline"
    assert inline_row[2] == "0.50 vs 0.010 (\u00d750)"
    assert inline_row[3] == report.DASH  # an inline row has no children to hold to a floor


ENQUEUE_FLOOR = {
    "generated": "now",
    "jobs": 3000,
    "reps": 3,
    "rates": {
        "direct": [2400.0, 2000.0, 2200.0],
        "relay": [1500.0, 1600.0, 1700.0],
        "main": [1100.0, 1200.0, 1000.0],
        "pgqueuer": [2000.0, 1900.0, 2100.0],
    },
    "cpu_us": {
        "direct": [{"producer": p, "store": 200.0} for p in (150.0, 170.0, 160.0)],
        "relay": [{"producer": 60.0, "between": b, "store": 240.0} for b in (230.0, 250.0)],
        "main": [{"producer": 190.0, "between": 360.0, "store": 215.0}],
        "pgqueuer": [{"producer": 170.0, "store": 300.0}, {"producer": 170.0}],
    },
}


def _floor_rows(record: dict[str, Any]) -> dict[str, str]:
    lines = report._enqueue_floor_lines(record)
    return {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}


def test_the_enqueue_floor_holds_each_path_to_pgqueuers_median_in_the_same_turns() -> None:
    rows = _floor_rows(ENQUEUE_FLOOR)
    pgqueuer, direct, relay, main = (rows[label] for _, label in report.ENQUEUE_FLOOR_PATHS)
    assert "| 2,000 (1,900\u20132,100) | \u00d71.00 |" in pgqueuer
    assert "| \u00d71.10 |" in direct  # 2,200 / 2,000
    assert "| 1,600 (1,500\u20131,700) | \u00d70.80 |" in relay
    assert "| \u00d70.55 |" in main  # 1,100 / 2,000


def test_the_enqueue_floor_shows_each_processs_median_cpu_per_job_and_their_sum() -> None:
    rows = _floor_rows(ENQUEUE_FLOOR)
    pgqueuer, direct, relay, main = (rows[label] for _, label in report.ENQUEUE_FLOOR_PATHS)
    dash = report.DASH
    assert direct.endswith(f"| 160 | {dash} | 200 | 360 |")  # nothing between
    assert relay.endswith("| 60 | 240 | 240 | 540 |")  # the median of 230 and 250
    assert main.endswith("| 190 | 360 | 215 | 765 |")
    # A process one run lacks is left out of the median and the sum, not taken as 0.
    assert pgqueuer.endswith(f"| 170 | {dash} | {dash} | 170 |")


def test_without_pgqueuer_the_enqueue_floor_shows_rates_alone() -> None:
    rates = {k: v for k, v in ENQUEUE_FLOOR["rates"].items() if k != "pgqueuer"}
    lines = report._enqueue_floor_lines({**ENQUEUE_FLOOR, "rates": rates, "cpu_us": {}})
    assert sum(line.startswith("| ") for line in lines) == 1 + 3  # the header, 3 paths
    assert all(line.endswith(f"| {report.DASH} |") for line in lines[-3:])
    assert report._enqueue_floor_lines({}) == []


def test_the_report_renders_every_new_section() -> None:
    data = {
        "generated": "2026-11-30T00:00:00+00:00",
        "wall_s": 60.0,
        "loadavg_start": [0.1, 0.1, 0.1],
        "loadavg_end": [0.2, 0.2, 0.2],
        "environment": {
            "cores": 2,
            "cpu": "cpu",
            "memory_gib": 1.0,
            "kernel": "6",
            "python": "3.11",
            "redis": {"ok": False, "error": "no"},
            "postgres": {"ok": False, "error": "no"},
            "hash_rounds": 1,
            "hash_job_ms": 5.0,
        },
        "config": harness.Config(workdir="", hash_rounds=1).__dict__,
        "systems": [BROKER, PGQUEUER],
        "floor": FLOOR,
        "enqueue_floor": ENQUEUE_FLOOR,
    }
    text = report.markdown(data)
    for heading in (
        "## CPU per job and memory during the drain",
        "## Draining while producers enqueue",
        "## Broker against PgQueuer, same run",
        "## Distance from the floor",
        "## One at a time through a main: the floor",
    ):
        assert heading in text


PRIMITIVES = {
    "codec": {
        "slow": dict.fromkeys(("encode_job", "decode_job", "encode_report", "decode_report"), 1.0),
        "fast": {
            "encode_job": 1e-6,
            "decode_job": 2e-6,
            "encode_report": 3e-6,
            "decode_report": 4e-6,
        },
    },
    "hops": {
        "tcp": {"parent_s": 10e-6, "child_s": 20e-6},
        "pipe": {"parent_s": 30e-6, "child_s": 40e-6},
    },
    "statements": {
        "10": {
            "claim_client_s": 100e-6,
            "settle_client_s": 200e-6,
            "claim_server_s": 300e-6,
            "settle_server_s": 400e-6,
        }
    },
}


def test_the_floor_sums_each_processs_primitives_with_the_faster_codec() -> None:
    f = floor.floor(PRIMITIVES, 10)
    pooled, inline = f["pooled"], f["inline"]
    assert pooled["main"] == pytest.approx(0.030 + 0.010 + 0.001 + 0.004)
    assert inline["worker"] == pytest.approx(0.020 + 0.002 + 0.003)
    assert pooled["worker"] == pytest.approx(inline["worker"] + 0.030 + 0.001 + 0.004)
    assert pooled["children"] == pytest.approx(0.040 + 0.002 + 0.003)
    assert inline["children"] == 0
    assert pooled["store"] == pytest.approx(0.070)
    assert pooled["all"] == pytest.approx(sum(v for k, v in pooled.items() if k != "all"))


def test_the_rss_slope_is_megabytes_per_minute() -> None:
    points = [(t, 50.0 + 0.01 * t) for t in range(0, 600, 5)]
    assert rss_soak.slope_mb_per_min(points) == pytest.approx(0.6)
    assert rss_soak.slope_mb_per_min(points[:1]) is None


def test_the_soak_summary_takes_the_spread_of_the_samples() -> None:
    samples = [
        {"t_s": 0.0, "main_rss_mb": 55.0},
        {"t_s": 5.0, "main_rss_mb": 70.0},
        {"t_s": 10.0, "main_rss_mb": None},
        {"t_s": 15.0, "main_rss_mb": 68.0},
    ]
    s = rss_soak.summarize(samples)
    assert (s["first_mb"], s["last_mb"], s["max_minus_min_mb"]) == (55.0, 68.0, 15.0)


def test_the_enqueue_ab_rates_each_side_by_its_summed_turns_and_over_pgqueuers() -> None:
    from bench import enqueue_ab

    turn = {"producer": 0.02, "main": 0.05}
    rows = {
        ("after", "one"): [{"wall": 1.0, **turn}, {"wall": 3.0, **turn}],
        ("pgqueuer", "one"): [{"wall": 1.0, **turn}, {"wall": 1.0, **turn}],
    }
    lines = enqueue_ab.table(rows, 100)
    # 200 jobs in 4 s; median turn of 100 and 33.3 jobs/s; PgQueuer's 200 in 2 s.
    assert lines[2] == "| after | through the main | 50 | 67 | 0.50 | 200 | 500 |"
    assert lines[3] == "| pgqueuer | Queries.enqueue | 100 | 100 | 1.00 | 200 | 500 |"


def _scale_run(part: str, per_s: float, **fields: Any) -> dict[str, Any]:
    run = {"part": part, "rep": 1, "jobs": 1000, "done": 1000, "per_s": per_s}
    run.update(main_cpu_s=0.1, server_cpu_s=0.2, load_before=3.0, load_after=4.0)
    run.update(fields)
    return run


def test_the_scale_report_holds_each_backlog_to_pgqueuer_and_to_its_own_empty_row() -> None:
    from bench import scale

    drains = [
        ("broker-postgres-defaults", "empty", [2000.0, 1800.0, 2200.0]),
        ("broker-postgres-defaults", "due", [1900.0]),
        ("broker-postgres-defaults", "future", [2100.0]),
        ("pgqueuer", "empty", [1600.0]),
        ("pgqueuer", "due", [1000.0]),
        ("pgqueuer", "future", [100.0]),
    ]
    runs = [
        _scale_run("drain", rate, system=system, shape=shape)
        for system, shape, rates in drains
        for rate in rates
    ]
    runs += [_scale_run("keyed", 1000.0, keys=1000), _scale_run("keyed", 800.0, keys=30_000)]
    runs += [
        _scale_run("workers", 2000.0, setup=setup, main_us_per_job=us)
        for setup, us in (("1x64", 100.0), ("1x1", 200.0), ("64x1", 150.0))
    ]
    config = {"backlog": 1_000_000, "jobs": 1000, "keyed_jobs": 1000, "worker_jobs": 1000}
    config.update(keys=[1000, 30_000], workers=["1x64", "1x1", "64x1"])
    data = {"command": "x", "started": "now", "wall_s": 60.0, "machine": "2 cores"}
    text = scale.markdown({**data, "config": config, "runs": runs, "errors": []})
    assert "| empty | 2,000 | 1,600 | 1.25x | +0% | +0% | 3.0 |" in text  # median of three
    assert "| 1,000,000 due | 1,900 | 1,000 | 1.90x | -5% | -38% | 3.0 |" in text
    assert "| 1,000,000 future | 2,100 | 100 | 21.00x | +5% | -94% | 3.0 |" in text
    assert "| 30,000 | 800 | -20% | 3.0 |" in text
    # 64 workers of 1 slot: against 1 worker of 64 slots, and against 1 worker of 1 slot.
    assert "| 64x1 | 150 | +50% | -25% | 2,000 | 200 | 3.0 |" in text
    assert "over many queues" not in text  # a part not run has no section


def test_a_backlog_over_the_empty_table_shows_the_workers_cpu_per_job_as_a_control() -> None:
    """The worker never reads the store: each turn's ratio of its CPU per job (backlog ÷
    empty) sits beside the rate's, so a turn that ran slow everywhere reads as such."""
    from bench import scorecard

    broker = "broker-postgres-defaults"
    runs = [
        _scale_run("drain", 5000.0, system=broker, shape="empty", worker_cpu_s=0.10, rep=1),
        _scale_run("drain", 4000.0, system=broker, shape="due", worker_cpu_s=0.125, rep=1),
        _scale_run("drain", 5000.0, system=broker, shape="empty", worker_cpu_s=0.10, rep=2),
        _scale_run("drain", 5000.0, system=broker, shape="due", worker_cpu_s=0.10, rep=2),
        _scale_run("drain", 5000.0, system=broker, shape="empty", rep=3),
        _scale_run("drain", 5000.0, system=broker, shape="future", rep=3),
    ]
    rows = {
        row.name: row for row in scorecard._scale_rows({"config": {"backlog": 10}, "runs": runs})
    }
    due = rows["drain over 10 due jobs ÷ the broker's empty table"]
    assert due.detail.endswith(
        "turns 0.80, 1.00; the worker's CPU per job (no store work) ÷ the empty turn's 1.25, 1.00"
    )
    # No worker figure in a turn: no control shown.
    assert "worker" not in rows["drain over 10 future jobs ÷ the broker's empty table"].detail


def test_the_scale_report_holds_the_queues_and_the_fleet_to_pgqueuer() -> None:
    from bench import scale

    runs = [
        _scale_run("queues", 3000.0, system="broker-postgres-defaults", queues=1000),
        _scale_run("queues", 5000.0, system="broker-postgres-defaults", queues=1000),
        _scale_run("queues", 2000.0, system="pgqueuer", queues=1000, load_before=5.0),
    ]
    fleet = {"workers": 64, "main_us_per_job": 120.0, "pg_connections": 65}
    runs += [
        _scale_run("fleet", 900.0, system="broker-postgres-inline1", **fleet),
        _scale_run("fleet", 1000.0, system="pgqueuer", **fleet, server_cpu_s=2.0),
    ]
    config = {"backlog": 0, "jobs": 1000, "worker_jobs": 1000, "queues": [1000], "fleet": 64}
    config.update(keys=[], keyed_jobs=0, workers=[])
    data = {"command": "x", "started": "now", "wall_s": 60.0, "machine": "2 cores"}
    text = scale.markdown({**data, "config": config, "runs": runs, "errors": []})
    assert "| 1,000 | 4,000 | 2,000 | 2.00x | 3.0 |" in text  # load: median of 3, 3, 5
    # PostgreSQL's CPU per job: 0.2 s and 2 s over 1,000 jobs; PgQueuer's 65 connections.
    assert "| 900 | 1,000 | 0.90x | 120 | 200 / 2,000 | 65 | 3.0 |" in text
    assert "Drain of 1,000 no-op jobs over a backlog" not in text


def test_scorecard_reads_each_part_and_judges_each_target(tmp_path: Path) -> None:
    """Each row is the median of each turn's ratio (the two sides of a turn measured in
    the same minutes), judged in the right direction; a part not run leaves its rows
    unmeasured, never met."""
    import json

    from bench import scorecard

    def drains(one: float, bulk: float, rate: float) -> dict[str, Any]:
        return {"enqueue_one_per_s": one, "enqueue_bulk_per_s": bulk, "per_s": rate}

    results = {
        "systems": [
            {
                "system": "broker-postgres-defaults",
                "drain": [
                    drains(900.0, 20_000.0, 5000.0),
                    drains(700.0, 30_000.0, 3000.0),
                    drains(800.0, 25_000.0, 6000.0),
                ],
                "latency": [{"start_p50_ms": 3.0, "start_p99_ms": 6.0}],
                "producers": [{"per_s": 3000.0}],
            },
            {
                "system": "pgqueuer",
                "drain": [
                    drains(1000.0, 25_000.0, 4000.0),
                    drains(1000.0, 25_000.0, 4000.0),
                    drains(1000.0, 25_000.0, 7000.0),
                ],
                "latency": [{"start_p50_ms": 4.0, "start_p99_ms": 5.0}],
                "producers": [{"per_s": 3000.0}],
            },
        ]
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    urgent = [
        {"row": "broker-postgres-defaults", "start_ms": [10.0, 20.0, 30.0]},
        {"row": "pgqueuer", "start_ms": [40.0, 40.0, 40.0]},
    ]
    (tmp_path / "urgent.jsonl").write_text("\n".join(json.dumps(u) for u in urgent))
    runs = [
        _scale_run("workers", 1.0, setup="1x64", main_us_per_job=100.0, rep=1),
        _scale_run("workers", 1.0, setup="64x1", main_us_per_job=111.0, rep=1),
        _scale_run("drain", 5000.0, system="broker-postgres-defaults", shape="due", rep=1),
        _scale_run("drain", 4000.0, system="pgqueuer", shape="due", rep=1),
        _scale_run("drain", 4000.0, system="broker-postgres-defaults", shape="due", rep=2),
        _scale_run("drain", 5000.0, system="pgqueuer", shape="due", rep=2),
        _scale_run("drain", 9000.0, system="broker-postgres-defaults", shape="due", rep=3),
        _scale_run("drain", 8500.0, system="pgqueuer", shape="due", rep=3),
        _scale_run("queues", 3000.0, system="broker-postgres-defaults", queues=1000, rep=1),
        _scale_run("queues", 5000.0, system="broker-postgres-defaults", queues=1000, rep=2),
        _scale_run("queues", 99_999.0, system="broker-postgres-defaults", queues=10, rep=3),
        _scale_run("queues", 2000.0, system="pgqueuer", queues=1000, rep=1),
        _scale_run("queues", 2000.0, system="pgqueuer", queues=1000, rep=2),
        _scale_run("fleet", 900.0, system="broker-postgres-inline1", workers=64, rep=1),
        _scale_run("fleet", 99_999.0, system="broker-postgres-inline1", workers=8, rep=2),
        _scale_run("fleet", 1000.0, system="pgqueuer", workers=64, rep=1),
    ]
    (tmp_path / "scale.json").write_text(json.dumps({"config": {"backlog": 10}, "runs": runs}))
    crowd = [
        {"system": "broker-postgres-defaults", "phase": "one-x50", "per_s": 1200.0},
        {"system": "broker-postgres-defaults", "phase": "one", "per_s": 99_999.0},
        {"system": "pgqueuer", "phase": "one-x50", "per_s": 1000.0},
        {"system": "pgqueuer", "phase": "one-x200", "per_s": 1000.0},
        {"system": "pgqueuer", "phase": "one-x50", "per_s": 2000.0},
        {"system": "broker-postgres-defaults", "phase": "one-x50", "per_s": 1800.0},
    ]
    (tmp_path / "crowd.jsonl").write_text("\n".join(json.dumps(c) for c in crowd))
    rows = {row.name: row for row in scorecard.score(tmp_path)}

    def judged(name: str) -> tuple[float | None, bool | None]:
        row = rows[name]
        return (None if row.value is None else round(row.value, 3)), row.met

    # Turns 1.25, 0.75, 0.857: their median, where the medians' ratio (5,000 / 4,000)
    # would have said 1.25.
    assert judged("drain ÷ PgQueuer") == (0.857, False)
    assert "turns 1.25, 0.75, 0.86" in rows["drain ÷ PgQueuer"].detail
    assert judged("drain with 200 producers ÷ PgQueuer") == (1.0, True)
    assert judged("enqueue one at a time through the main ÷ PgQueuer") == (0.8, True)
    assert judged("bulk enqueue through the main ÷ PgQueuer") == (1.0, True)
    assert judged("bulk enqueue direct ÷ PgQueuer") == (None, None)  # no direct bulk figure
    assert judged("enqueue-to-start p50 at 50 jobs/s ÷ PgQueuer") == (0.75, True)
    assert judged("enqueue-to-start p99 at 50 jobs/s ÷ PgQueuer") == (1.2, False)
    assert judged("urgent job p50 during a drain ÷ PgQueuer") == (0.5, True)
    assert judged("main CPU per job, 64 workers x 1 ÷ 1 worker x 64") == (1.11, False)
    # By repetition: 1.25, 0.8, 1.059; the empty table was not measured.
    assert judged("drain over 10 due jobs ÷ PgQueuer") == (1.059, True)
    assert judged("drain over 10 due jobs ÷ the broker's empty table") == (None, None)
    assert judged("keyed drain, 30,000 keys ÷ 1,000 keys") == (None, None)
    # Each at its own count only: the broker's turns at 1,000 queues 1.5 and 2.5 (10
    # queues not mixed in), its 64 workers' 900 (a fleet of 8 not mixed in) short of
    # PgQueuer's.
    assert judged("drain over 1,000 queues ÷ PgQueuer") == (2.0, True)
    assert judged("64 one-slot workers' drain ÷ PgQueuer") == (0.9, False)
    assert judged("takeovers with a completion within 5 s of kill -9") == (None, None)
    # The crowd's turns pair by order (1.2, 0.9), the serial phase not mixed in.
    assert judged("50 producers enqueueing one at a time ÷ PgQueuer") == (1.05, True)
    assert judged("200 producers enqueueing one at a time ÷ PgQueuer") == (None, None)
    # The chart's margin turns a latency so that past 1 is met: 1.0 / 1.2 here.
    assert rows["enqueue-to-start p99 at 50 jobs/s ÷ PgQueuer"].margin == pytest.approx(1 / 1.2)


class _CountingDriver:
    """A driver that counts the jobs in its store since the last reset, each way in."""

    has_bulk = True

    def __init__(self, direct: bool) -> None:
        self.has_direct = direct
        self.queued: dict[str, int] = {}
        self.bulk_direct_calls: list[int] = []
        self.direct_calls = 0
        if direct:
            self.enqueue_bulk_direct = self._bulk_direct

    def reset(self) -> None:
        self.queued = {}

    def _add(self, way: str, count: int) -> None:
        self.queued[way] = self.queued.get(way, 0) + count

    def enqueue_one(self, kind: str, arg: int) -> None:
        self._add("one", 1)

    def enqueue_one_direct(self, kind: str, arg: int) -> None:
        self.direct_calls += 1
        self._add("direct", 1)

    def enqueue_bulk(self, kind: str, args: list[int]) -> None:
        self._add("bulk", len(args))

    def _bulk_direct(self, kind: str, args: list[int]) -> None:
        self.bulk_direct_calls.append(len(args))
        self._add("bulk direct", len(args))


@pytest.mark.parametrize("direct", [True, False])
def test_the_drain_workload_drains_its_n_jobs_whatever_ways_they_are_timed_in(
    monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """The drain's store holds exactly its ``n`` jobs, on every system: the broker's
    direct enqueues are timed on a store emptied again before them, one at a time as many
    jobs as one at a time through the main, in bulk as many as the bulk through it."""
    driver = _CountingDriver(direct)
    runner = harness.Runner.__new__(harness.Runner)
    runner.d = driver  # type: ignore[assignment]
    runner.cfg = harness.Config(workdir="unused", hash_rounds=1)
    monkeypatch.setattr(runner, "drain_queued", lambda what, n, run: run)
    run = runner.drain("noop", 200, 50)
    assert sum(driver.queued.values()) == 200
    assert driver.queued == {"one": 50, "bulk": 150}
    if direct:
        assert driver.direct_calls == 50  # a warm-up call, then 49 timed
        assert driver.bulk_direct_calls == [1, 150]  # a warm-up call, then the timed one
        assert run.keys() >= {
            "enqueue_bulk_per_s",
            "enqueue_direct_per_s",
            "enqueue_bulk_direct_per_s",
        }
    else:
        assert run.keys().isdisjoint({"enqueue_direct_per_s", "enqueue_bulk_direct_per_s"})
