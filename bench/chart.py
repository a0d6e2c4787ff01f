"""Draws ``chart.png`` from ``results.json`` (run with the ``chart`` peer environment).

.venv-peers/chart/bin/python -m bench.chart bench/results/results.json bench/results/chart.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.report import spread, summary

BROKER = "#c0392b"
PEER = "#5d6d7e"


def _short(result: dict[str, Any]) -> str:
    return str(result["system"])


def _panel(ax: Any, systems: list[dict[str, Any]], key: str, title: str, log: bool = False) -> None:
    names, medians, lows, highs, colours = [], [], [], [], []
    for r in systems:
        s = summary(r).get(key)
        if s is None:
            continue
        names.append(_short(r))
        medians.append(s[0])
        lows.append(s[0] - s[1])
        highs.append(s[2] - s[0])
        colours.append(BROKER if r["system"].startswith("broker") else PEER)
    y = list(range(len(names)))
    ax.barh(y, medians, color=colours, xerr=[lows, highs], capsize=2, ecolor="#222")
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_xscale("log")
    ax.grid(axis="x", alpha=0.3)
    for yi, m, hi in zip(y, medians, highs, strict=True):
        ax.text(m + hi, yi, f" {m:,.0f}" if m >= 10 else f" {m:.1f}", va="center", fontsize=7)


def _latency(ax: Any, systems: list[dict[str, Any]]) -> None:
    names, p50, p99, colours = [], [], [], []
    for r in systems:
        s = summary(r)
        if s["start_p50"] is None:
            continue
        names.append(_short(r))
        p50.append(s["start_p50"][0])
        p99.append(s["start_p99"][0] if s["start_p99"] else 0)
        colours.append(BROKER if r["system"].startswith("broker") else PEER)
    y = list(range(len(names)))
    ax.barh([v - 0.2 for v in y], p50, height=0.4, color=colours, label="p50")
    ax.barh([v + 0.2 for v in y], p99, height=0.4, color=colours, alpha=0.45, label="p99")
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_title("enqueue-to-start latency, ms (p50 solid, p99 pale; lower is better)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _enqueue(ax: Any, systems: list[dict[str, Any]]) -> None:
    names, one, bulk, colours = [], [], [], []
    for r in systems:
        s = summary(r)
        if s["enqueue_one"] is None:
            continue
        names.append(_short(r))
        one.append(s["enqueue_one"][0])
        bulk.append(s["enqueue_bulk"][0] if s["enqueue_bulk"] else 0)
        colours.append(BROKER if r["system"].startswith("broker") else PEER)
    y = list(range(len(names)))
    ax.barh([v - 0.2 for v in y], one, height=0.4, color=colours)
    ax.barh([v + 0.2 for v in y], bulk, height=0.4, color=colours, alpha=0.45)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_title("enqueue jobs/s (1-by-1 solid, bulk pale)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def draw(data: dict[str, Any], out: Path) -> None:
    systems = [r for r in data["systems"] if not r.get("skipped")]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    _panel(axes[0][0], systems, "drain", "drain: no-op jobs/s (median, min-max; log)", log=True)
    _panel(axes[0][1], systems, "cpu", "CPU-bound (≈5 ms jobs): jobs/s")
    ideal = 2000 / data["environment"]["hash_job_ms"]
    axes[0][1].axvline(ideal, color="#222", linestyle="--", linewidth=1)
    axes[0][1].text(ideal, -0.6, f" 2 cores ideal {ideal:.0f}", fontsize=7)
    _latency(axes[1][0], systems)
    _enqueue(axes[1][1], systems)
    spread_note = spread([data["loadavg_start"][0], data["loadavg_end"][0]])
    load = f"load avg {spread_note[1]:.1f}-{spread_note[2]:.1f}" if spread_note else ""
    fig.suptitle(
        f"broker (red) vs peers (grey), {data['environment']['cores']} cores, "
        f"{data['config']['reps']} runs each; {load}; generated {data['generated']}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    source, target = argv
    draw(json.loads(Path(source).read_text()), Path(target))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
