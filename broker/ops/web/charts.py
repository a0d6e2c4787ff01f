"""The dashboard's history view: the main's minute-by-minute history
(:mod:`broker.core.history`) as inline SVG charts, written here on the server.

No script draws them and nothing is fetched from elsewhere: each chart is a few hundred
SVG elements at most (one per minute and line), styled by the page's own stylesheet
(its classes), with a ``<title>`` on each minute for its figures on hover. The live
refresh replaces them like any table.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from urllib.parse import urlencode

from broker.core.history import OTHER, History, Point
from broker.model.bounds import CELL_CHARS
from broker.model.untrusted import escape_bidi

WINDOWS = {"15m": 15, "1h": 60, "all": 0}
"""The windows a chart shows, by the ``window`` a link asks for (``all``: the whole
history the main keeps)."""

_WIDTH = 600
_HEIGHT = 150
_LEFT = 56
_RIGHT = 8
_TOP = 8
_BOTTOM = 22

CHART_STYLE = """
svg.chart{background:#fff;border:1px solid #e2e5ea;display:block;margin:.2em 0 1em}
svg.chart text{font:11px system-ui,sans-serif;fill:#6b7482}
svg.chart .axis{stroke:#c9ced6;stroke-width:1}svg.chart .grid{stroke:#eef1f5}
.c-completed{fill:#5cb874}.c-failed{fill:#d9534f}.c-retried{fill:#f0ad4e}
.l-p50{stroke:#3b7dd8;fill:none;stroke-width:2}.l-p95{stroke:#a05cd6;fill:none;stroke-width:2}
.l-depth{stroke:#3b7dd8;fill:none;stroke-width:2}.l-oldest{stroke:#d9534f;fill:none;stroke-width:2}
.key{display:inline-block;width:.8em;height:.8em;margin:0 .3em 0 .8em;vertical-align:-1px}
.k-completed{background:#5cb874}.k-failed{background:#d9534f}.k-retried{background:#f0ad4e}
.k-p50,.k-depth{background:#3b7dd8}.k-p95{background:#a05cd6}.k-oldest{background:#d9534f}
.charts h2{font-size:15px;margin:.8em 0 .1em}nav.pick a{margin-right:.8em}
.panes{display:grid;grid-template-columns:repeat(auto-fill,minmax(604px,1fr));gap:0 1em}
nav.pick a.on{font-weight:600}
"""
"""The charts' part of the page's stylesheet (its hash is in the CSP like the rest)."""


def _e(value: object) -> str:
    return html.escape(escape_bidi(str(value)), quote=True)


def _name(name: str) -> str:
    """A queue or task name as a label: cut to :data:`CELL_CHARS`, escaped."""
    return _e(name if len(name) <= CELL_CHARS else name[: CELL_CHARS - 1] + "…")


def _clock(minute: int) -> str:
    return datetime.fromtimestamp(minute * 60, UTC).strftime("%H:%M")


def _seconds(value: float) -> str:
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min"


def _nice(top: float) -> float:
    """A round ceiling for a chart's scale: 1, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 times a power
    of ten (so the tallest minute fills most of the chart)."""
    if top <= 0:
        return 1.0
    step = 10.0 ** math.floor(math.log10(top))
    for factor in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if step * factor >= top:
            return step * factor
    return step * 10  # pragma: no cover - factor 10 always reaches top


def _frame(
    points: Sequence[Point], top: float, unit: Callable[[float], str], body: str, label: str
) -> str:
    """The chart around ``body``: axes, the scale's top and middle, and times below."""
    inner_h = _HEIGHT - _TOP - _BOTTOM
    bottom = _TOP + inner_h
    right = _WIDTH - _RIGHT
    lines = [
        f'<line class=grid x1="{_LEFT}" y1="{_TOP}" x2="{right}" y2="{_TOP}"/>',
        f'<line class=grid x1="{_LEFT}" y1="{_TOP + inner_h / 2:.1f}" x2="{right}" '
        f'y2="{_TOP + inner_h / 2:.1f}"/>',
        f'<line class=axis x1="{_LEFT}" y1="{bottom}" x2="{right}" y2="{bottom}"/>',
        f'<text x="{_LEFT - 4}" y="{_TOP + 9}" text-anchor=end>{_e(unit(top))}</text>',
        f'<text x="{_LEFT - 4}" y="{_TOP + inner_h / 2 + 4:.1f}" text-anchor=end>'
        f"{_e(unit(top / 2))}</text>",
        f'<text x="{_LEFT - 4}" y="{bottom}" text-anchor=end>0</text>',
    ]
    if points:
        n = len(points)
        for index in sorted({0, n // 2, n - 1}):
            x = _LEFT + (index + 0.5) * (right - _LEFT) / n
            anchor = "start" if index == 0 else "end" if index == n - 1 else "middle"
            lines.append(
                f'<text x="{x:.1f}" y="{_HEIGHT - 6}" text-anchor={anchor}>'
                f"{_clock(points[index].minute)}</text>"
            )
    return (
        f'<svg class=chart role=img aria-label="{_e(label)}" width="{_WIDTH}" '
        f'height="{_HEIGHT}" viewBox="0 0 {_WIDTH} {_HEIGHT}" '
        f'xmlns="http://www.w3.org/2000/svg">{"".join(lines)}{body}</svg>'
    )


def runs_chart(points: Sequence[Point]) -> str:
    """Runs per minute, stacked: completed, retried, failed for good."""
    top = _nice(max((p.completed + p.failed + p.retried for p in points), default=0))
    inner_h = _HEIGHT - _TOP - _BOTTOM
    width = (_WIDTH - _LEFT - _RIGHT) / max(1, len(points))
    bars = []
    for index, p in enumerate(points):
        total = p.completed + p.failed + p.retried
        if not total:
            continue
        x = _LEFT + index * width
        y: float = _TOP + inner_h
        tip = f"{_clock(p.minute)}: {p.completed} completed, {p.retried} retried, {p.failed} failed"
        parts = []
        for kind, count in (
            ("completed", p.completed),
            ("retried", p.retried),
            ("failed", p.failed),
        ):
            if not count:
                continue
            h = count / top * inner_h
            y -= h
            parts.append(
                f'<rect class=c-{kind} x="{x + 0.5:.1f}" y="{y:.1f}" '
                f'width="{max(1.0, width - 1):.1f}" height="{h:.1f}"/>'
            )
        bars.append(f"<g><title>{_e(tip)}</title>{''.join(parts)}</g>")
    return _frame(points, top, lambda v: f"{v:g}", "".join(bars), "runs per minute")


def _lines(
    points: Sequence[Point],
    series: Sequence[tuple[str, Callable[[Point], float | None]]],
    unit: Callable[[float], str],
    label: str,
    tip: Callable[[Point], str],
) -> str:
    """One polyline per ``series`` (a minute without a value breaks the line), and a
    hover target per minute with ``tip``."""
    values = [get(p) for _, get in series for p in points]
    top = _nice(max((v for v in values if v is not None), default=0.0))
    inner_h = _HEIGHT - _TOP - _BOTTOM
    width = (_WIDTH - _LEFT - _RIGHT) / max(1, len(points))
    body = []
    for kind, get in series:
        run: list[str] = []
        runs: list[list[str]] = []
        for index, p in enumerate(points):
            value = get(p)
            if value is None:
                if run:
                    runs.append(run)
                run = []
                continue
            x = _LEFT + (index + 0.5) * width
            y = _TOP + inner_h - min(value, top) / top * inner_h
            run.append(f"{x:.1f},{y:.1f}")
        if run:
            runs.append(run)
        for part in runs:
            if len(part) == 1:  # a lone minute: a short tick, so it shows
                at, height = part[0].split(",")
                part = [f"{float(at) - 2:.1f},{height}", f"{float(at) + 2:.1f},{height}"]
            body.append(f'<polyline class=l-{kind} points="{" ".join(part)}"/>')
    for index, p in enumerate(points):
        if all(get(p) is None for _, get in series):
            continue
        x = _LEFT + index * width
        body.append(
            f'<rect x="{x:.1f}" y="{_TOP}" width="{width:.1f}" height="{inner_h}" '
            f'fill="transparent"><title>{_e(tip(p))}</title></rect>'
        )
    return _frame(points, top, unit, "".join(body), label)


def wait_chart(points: Sequence[Point]) -> str:
    """Wait from due to start, p50 and p95 per minute (minutes with no start: no line)."""
    return _lines(
        points,
        [("p50", lambda p: p.wait_p50), ("p95", lambda p: p.wait_p95)],
        _seconds,
        "wait from due to start",
        lambda p: (
            f"{_clock(p.minute)}: {p.started} started, p50 "
            f"{_seconds(p.wait_p50 or 0)}, p95 {_seconds(p.wait_p95 or 0)}"
        ),
    )


def depth_chart(points: Sequence[Point]) -> str:
    return _lines(
        points,
        [("depth", lambda p: None if p.depth is None else float(p.depth))],
        lambda v: f"{v:g}",
        "jobs queued",
        lambda p: f"{_clock(p.minute)}: {p.depth} queued",
    )


def oldest_chart(points: Sequence[Point]) -> str:
    return _lines(
        points,
        [("oldest", lambda p: p.oldest)],
        _seconds,
        "oldest eligible job's wait",
        lambda p: f"{_clock(p.minute)}: oldest due job waited {_seconds(p.oldest or 0)}",
    )


def _key(*kinds: str) -> str:
    return "".join(f'<span class="key k-{k}"></span>{_e(k)}' for k in kinds)


def picker(query: Mapping[str, str], history: History) -> str:
    """Links choosing the window and the series (all jobs, one queue, one task)."""
    window = query.get("window") or "1h"
    queue = query.get("queue")
    task = query.get("task")
    kept = {k: v for k, v in (("queue", queue), ("task", task)) if v}

    def link(params: dict[str, str], text: str, on: bool) -> str:
        href = "/history?" + urlencode(params)
        return f'<a href="{_e(href)}"{" class=on" if on else ""}>{_name(text)}</a>'

    names = {"15m": "15 minutes", "1h": "1 hour", "all": f"{history.minutes // 60} hours (all)"}
    windows = "".join(link({**kept, "window": w}, names[w], w == window) for w in WINDOWS)
    series = [link({"window": window}, "all jobs", not kept)]
    series += [
        link({"window": window, "queue": q}, f"queue {q}", q == queue)
        for q in sorted(history.queues, key=lambda n: (n == OTHER, n))
    ]
    series += [
        link({"window": window, "task": t}, f"task {t}", t == task)
        for t in sorted(history.tasks, key=lambda n: (n == OTHER, n))
    ]
    return (
        f'<section class=tools><nav class=pick id="windows">window: {windows}</nav>'
        f'<nav class=pick id="series">series: {"".join(series)}</nav></section>'
    )


def history_live(query: Mapping[str, str], history: History, now: float) -> str:
    """The four charts of the series and window the query asks for."""
    minutes = WINDOWS.get(query.get("window") or "1h", 60) or history.minutes
    queue = query.get("queue") or None
    task = None if queue else (query.get("task") or None)
    series = history.series(queue=queue, task=task)
    what = f"queue {queue}" if queue else f"task {task}" if task else "all jobs"
    points = history.points(series, now, minutes)
    runs = sum(p.completed + p.failed + p.retried for p in points)
    note = (
        ""
        if series is not None
        else f'<p class="msg">No event of {_name(what)} in the history yet.</p>'
    )
    depth = (
        '<div><h2>Jobs queued</h2><p class="muted">Sampled by queue: pick a queue or all '
        "jobs.</p></div>"
        if task
        else f"<div><h2>Jobs queued</h2>{_key('depth')}{depth_chart(points)}</div>"
        f"<div><h2>Oldest due job's wait</h2>{_key('oldest')}{oldest_chart(points)}</div>"
    )
    failed = sum(p.failed for p in points)
    retried = sum(p.retried for p in points)
    return (
        f'<div class=charts id="charts">{note}<p id="summary">{_name(what)}, the last '
        f"{len(points)} minutes (UTC): {runs} runs ended, {retried} of them to be retried "
        f"and {failed} failed for good.</p><div class=panes>"
        f"<div><h2>Runs per minute</h2>{_key('completed', 'retried', 'failed')}"
        f"{runs_chart(points)}</div>"
        f"<div><h2>Wait from due to start</h2>{_key('p50', 'p95')}{wait_chart(points)}</div>"
        f"{depth}</div></div>"
    )


__all__ = ["CHART_STYLE", "WINDOWS", "history_live", "picker"]
