"""The dashboard's pages: HTML written here, every value escaped, no template engine.

Each view is a *live* fragment (what the page's script re-fetches every
:data:`REFRESH_MS` milliseconds) inside one :func:`document`. The functions take the
request service's replies as they are and return text; :mod:`broker.ops.web.dashboard`
asks the main and serves them. Every page has a size bound
(:data:`broker.model.bounds.MAX_PAGE_BYTES`): at most :data:`PAGE_ROWS` rows, names and
values cut to :data:`CELL_CHARS`, a job's payloads to :data:`VALUE_BYTES`.
"""

from __future__ import annotations

import base64
import hashlib
import html
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

import msgspec
from aiohttp import web

from broker.jobs import JobStatus
from broker.model.bounds import CELL_CHARS, PAGE_ROWS, VALUE_BYTES
from broker.model.untrusted import escape_bidi
from broker.ops.web.charts import CHART_STYLE
from broker.tasks.schedule import Schedule

REFRESH_MS = 2000
PAGE_SIZES = (20, 50, PAGE_ROWS)
MAX_LINK_BYTES = 4096
"""Longest link the dashboard writes (a filter by a queue's name): well under aiohttp's
8190-byte request line, so every link it writes can be followed. A longer name (one
stored before names had a bound) is shown without its link."""

_STYLE = (
    """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{background:#1d2430;color:#fff;padding:.6em 1em;display:flex;gap:1.2em;align-items:center}
header a{color:#cfe0ff;text-decoration:none}header a.on{color:#fff;font-weight:600}
header .auth{margin-left:auto}main{padding:0 1em 1em}section.tools{padding:0 0 1em}
table{border-collapse:collapse;background:#fff;width:100%}
th,td{border-bottom:1px solid #e2e5ea;padding:.35em .6em;text-align:left;vertical-align:top}
th{background:#eef1f5}td.n{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#fff;border:1px solid #e2e5ea;padding:.6em;overflow:auto;max-height:30em}
.st{padding:.1em .4em;border-radius:3px;font-size:12px;background:#e2e5ea}
.st.failed{background:#f8d4d4}.st.completed{background:#d4f0da}.st.handed_off{background:#d9e6fb}
.st.cancelled{background:#eee}.st.queued{background:#fbeed0}
.msg{padding:.6em 1em;background:#fbeed0;border:1px solid #e8cf8a;margin:1em}
.msg.error{background:#f8d4d4;border-color:#e29b9b}form.inline{display:inline}
.muted{color:#6b7482}form.limit input{width:5em}td.err{color:#a12f2b;max-width:28em}
#live>.msg.error{margin:1em 0}section.bulk{padding:0 0 1em}td.line{white-space:nowrap}
/* td.line: kept on one line (a queue with its links, a time) */
"""
    + CHART_STYLE
)

_SCRIPT = """
(function(){
  var box=document.getElementById('token');
  if(box){box.value=sessionStorage.getItem('broker-token')||'';
    box.addEventListener('input',function(){sessionStorage.setItem('broker-token',box.value);});}
  document.addEventListener('submit',function(e){
    var f=e.target.querySelector('input[name=token]');
    if(f&&box){f.value=box.value;}
  },true);
  var live=document.getElementById('live');
  if(!live){return;}
  function refresh(){
    if(document.hidden||(document.activeElement&&live.contains(document.activeElement))){return;}
    fetch(location.href,{headers:{'X-Broker-Fragment':'live'}}).then(function(r){
      if(r.ok){return r.text();}}).then(function(t){
        if(t!==undefined){live.innerHTML=t;live.dataset.refreshed=Date.now();}
      }).catch(function(){});
  }
  setInterval(refresh,REFRESH_MS);
})();
""".replace("REFRESH_MS", str(REFRESH_MS))


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


SECURITY_HEADERS = {
    # Only this page's own style and script run, it talks only to its own origin, and no
    # other site may frame it (a click-jacked "Retry") or read it sniffed as a script.
    "Content-Security-Policy": (
        f"default-src 'none'; style-src {_csp_hash(_STYLE)}; script-src {_csp_hash(_SCRIPT)}; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Jobs' arguments and results must not stay in a browser's or a proxy's cache.
    "Cache-Control": "no-store",
}
"""Set on every answer of the dashboard's port, errors included."""


_VIEWS = (
    ("/", "Queues"),
    ("/workers", "Workers"),
    ("/jobs", "Jobs"),
    ("/history", "History"),
    ("/recoveries", "Recoveries"),
    ("/schedules", "Schedules"),
)


def _e(value: object) -> str:
    return html.escape(escape_bidi("" if value is None else str(value)), quote=True)


def _cut(value: object) -> str:
    """``value`` as shown in a cell: escaped, its text cut to :data:`CELL_CHARS`."""
    text = "" if value is None else str(value)
    if len(text) > CELL_CHARS:
        text = text[: CELL_CHARS - 1] + "…"
    return _e(text)


def _pre(text: str, ident: str = "") -> str:
    """``text`` in a ``<pre>``, escaped and cut to :data:`VALUE_BYTES` bytes of UTF-8
    (never inside an entity), with a note when anything was left out."""
    head = html.escape(text[: VALUE_BYTES + 1], quote=True)
    data = head.encode()
    attribute = f' id="{ident}"' if ident else ""
    if len(text) <= VALUE_BYTES and len(data) <= VALUE_BYTES:
        return f"<pre{attribute}>{head}</pre>"
    cut = data[:VALUE_BYTES].decode(errors="ignore")
    if cut.rfind("&") > cut.rfind(";"):
        cut = cut[: cut.rfind("&")]
    return (
        f'<pre{attribute}>{cut}</pre><p class="muted cut">Cut at {VALUE_BYTES >> 10} KiB '
        f"of {len(text):,} characters: <code>broker job ID</code> prints it whole.</p>"
    )


def _json(value: object) -> str:
    """A stored value as indented JSON, formatted by msgspec in C, so a 16 MiB payload
    costs the loop milliseconds, not the seconds ``json.dumps`` takes."""
    return msgspec.json.format(msgspec.json.encode(value), indent=2).decode()


def _time(value: object) -> str:
    """A stored time as shown: ISO 8601 with its zone (the store keeps UTC)."""
    if not value:
        return ""
    text = str(value)
    try:
        return datetime.fromisoformat(text).isoformat(sep=" ", timespec="seconds")
    except ValueError:
        return text


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], empty: str) -> str:
    body = "".join("<tr>" + "".join(row) + "</tr>" for row in rows)
    if not body:
        return f'<p class="muted">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _td(value: object, *, numeric: bool = False) -> str:
    return f'<td class="n">{_cut(value)}</td>' if numeric else f"<td>{_cut(value)}</td>"


def _status(value: object) -> str:
    return f'<span class="st {_cut(value)}">{_cut(value)}</span>'


def _action(path: str, label: str, **fields: str) -> str:
    hidden = "".join(
        f'<input type="hidden" name="{_e(k)}" value="{_e(v)}">' for k, v in fields.items()
    )
    return (
        f'<form class="inline" method="post" action="{_e(path)}">'
        f'<input type="hidden" name="token" value="">{hidden}'
        f'<button type="submit" name="action" value="{_e(label.lower())}">{_e(label)}</button>'
        "</form>"
    )


def _lost_runs(job: dict[str, Any]) -> str:
    """Recoveries so far, with the job's own cap when it has one (else the main's)."""
    cap = job.get("max_recoveries")
    limit = "the main's limit" if cap is None else f"at most {cap}"
    held = (
        f"; waiting for {job['state_holder']}, which holds its state"
        if job.get("state_holder")
        else ""
    )
    return f"{job.get('recoveries', 0)} ({limit}){held}"


def paged(path: str, query: Mapping[str, str], items: Sequence[Any]) -> tuple[Sequence[Any], str]:
    """The rows of the page the query asks for (``page``, from 1; :data:`PAGE_ROWS` a
    page) and the links to the pages beside it."""
    try:
        page = int(query.get("page") or 1)
    except ValueError:
        raise web.HTTPBadRequest(text="bad page: not a number") from None
    if page < 1:
        raise web.HTTPBadRequest(text="bad page: pages start at 1")
    start = (page - 1) * PAGE_ROWS
    shown = items[start : start + PAGE_ROWS]
    if len(items) <= PAGE_ROWS and page == 1:
        return shown, ""
    kept = {k: v for k, v in query.items() if k not in ("page", "msg")}

    def link(number: int, text: str, anchor: str) -> str:
        href = path + "?" + urlencode({**kept, "page": str(number)})
        return f'<a id="{anchor}" href="{_e(href)}">{text}</a>'

    links = []
    if page > 1:
        links.append(link(page - 1, "Previous page", "previous"))
    if start + PAGE_ROWS < len(items):
        links.append(link(page + 1, "Next page", "next"))
    where = (
        f"Rows {start + 1} to {start + len(shown)} of {len(items)}"
        if shown
        else f"No rows on page {page} (of {len(items)} rows)"
    )
    return shown, f'<p class="pages">{where}. {" ".join(links)}</p>'


def document(
    *, title: str, path: str, main_id: str, message: str | None, live: str, tools: str = ""
) -> str:
    """A whole page: the header with the views and the operator-token box, the
    ``message`` an action left (``msg``), the view's ``tools`` and its ``live`` part."""
    nav = "".join(
        f'<a href="{view}"{" class=on" if path == view else ""}>{name}</a>' for view, name in _VIEWS
    )
    note = f'<div class="msg" id="notice">{_e(message)}</div>' if message else ""
    return (
        f"<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{_e(title)} · broker</title><style>{_STYLE}</style></head><body>"
        f"<header><strong>broker</strong> <span class=muted>{_e(main_id)}</span>"
        f"{nav}<label class=auth>operator token "
        f'<input id="token" type="password" autocomplete="off" size="14"></label></header>'
        f"{note}<main><h1>{_e(title)}</h1>{tools}<div id=live>{live}</div></main>"
        f"<script>{_SCRIPT}</script></body></html>"
    )


PRUNE_FORM = (
    '<section class=tools><form method="post" action="/prune" id="prune">'
    '<input type="hidden" name="token" value="">Prune finished jobs older than '
    '<input name="older_than_days" type="number" min="0" step="any" value="7" size="4">'
    ' days <button type="submit">Prune</button></form></section>'
)
"""The queues page's tool: prune, which needs the operator token."""


def queues_live(
    queues: Sequence[dict[str, Any]],
    rates: Mapping[str, float],
    settings: Mapping[str, dict[str, Any]] | None = None,
) -> str:
    """The queues table: counts by status, the oldest due job's age, completed runs in
    the last minute (``rates``, by queue: the main's history) and, per queue, its flow
    (paused, rate limited: ``settings`` by queue name, as ``broker status`` has them)
    with a Pause or Resume button and the rate limit's form (POSTs under the
    dashboard's action rules)."""
    settings = settings or {}
    rows = []
    for q in queues:
        counts = q["counts"]
        age = q["oldest_queued_age_seconds"]
        name = _cut(q["queue"])
        # A name longer than the link bound is never encoded whole (it may be megabytes).
        link = "/jobs?" + urlencode({"queue": q["queue"][: MAX_LINK_BYTES + 1]})
        if len(q["queue"]) <= MAX_LINK_BYTES and len(link) <= MAX_LINK_BYTES:
            chart = "/history?" + urlencode({"queue": q["queue"]})
            name = f'<a href="{_e(link)}">{name}</a> <a class=muted href="{_e(chart)}">chart</a>'
        rows.append(
            [
                f'<td class="line">{name}</td>',
                *(_td(counts.get(s.value, 0), numeric=True) for s in JobStatus),
                _td("" if age is None else f"{age:.1f} s", numeric=True),
                _td(f"{rates.get(q['queue'], 0.0):.1f}", numeric=True),
                f"<td>{_flow_cell(q['queue'], settings.get(q['queue']))}</td>",
            ]
        )
    headers = ["queue", *(s.value for s in JobStatus), "oldest due", "completed/min", "flow"]
    return _table(headers, rows, "No jobs in the store.")


def _flow_cell(queue: str, settings: Mapping[str, Any] | None) -> str:
    """A queue's flow (paused, its rate limit), the button that pauses or resumes it and
    the form that sets its rate limit (or the button that clears it); a name too long to
    carry in a form gets no buttons (``broker queue`` still works)."""
    paused = bool(settings and settings["paused"])
    rate = settings.get("rate_limit") if settings else None
    burst = settings.get("rate_burst") if settings else None
    limited = f", at most {rate}" + (f" (burst {burst})" if burst and burst > 1 else "")
    text = ("paused" if paused else "dispatching") + (limited if rate else "")
    if len(queue.encode()) > MAX_LINK_BYTES:
        return _e(text)
    path, button = ("/queues/resume", "Resume") if paused else ("/queues/pause", "Pause")
    if rate:
        limit = _action("/queues/limit", "Clear limit", queue=queue, rate="")
    else:
        limit = (
            '<form class="inline limit" method="post" action="/queues/limit">'
            f'<input type="hidden" name="token" value=""><input type="hidden" name="queue" '
            f'value="{_e(queue)}"><input name="rate" placeholder="50/s" aria-label="rate"> '
            '<input name="burst" type="number" min="1" value="1" aria-label="burst"> '
            '<button type="submit" name="action" value="limit">Set limit</button></form>'
        )
    return f"{_e(text)} {_action(path, button, queue=queue)} {limit}"


WORKERS_NOTE = (
    '<p class="muted" id="workers-note">The figures of <code>broker status</code>, by mode. '
    "In flight: jobs handed to the worker and not settled yet, running or prefetched. "
    "In flight plus free credits is what the worker takes at once: its capacity (jobs "
    "it runs at once) plus its prefetch window.</p>"
)


def workers_live(workers: Sequence[dict[str, Any]]) -> str:
    """The workers as ``broker status`` counts them, by mode: the slots a worker reported
    (capacity), the jobs the main has handed it and not seen settled (in flight, from
    the main's own leases, so never stale) and the credits it may still fill."""

    def by_mode(values: Mapping[str, Any], modes: Sequence[str]) -> str:
        total = sum(v for v in values.values() if isinstance(v, int))
        shown = ", ".join(f"{m}: {values.get(m, 0)}" for m in modes)
        return shown if len(modes) == 1 else f"{total} ({shown})"

    rows = []
    for w in workers:
        capacity = w["capacity"] if w["status_reported"] else {}
        held = w.get("in_flight_by_mode") or {}
        modes = sorted(set(w["modes"]) | set(capacity))
        rows.append(
            [
                _td(w["worker_id"]),
                _td(w["host"]),
                _td("all" if w["queues"] is None else ", ".join(w["queues"])),
                _td(by_mode(capacity, modes) if capacity else "(not reported)"),
                _td(by_mode(held, modes) if held else w["in_flight"]),
                _td(by_mode(w["credits"], modes)),
                _td("draining" if w["draining"] else "serving"),
            ]
        )
    headers = ["worker", "host", "queues", "capacity", "in flight", "free credits", "state"]
    return WORKERS_NOTE + _table(headers, rows, "No worker is connected.")


def recoveries_live(pending: Sequence[dict[str, Any]], orphans: object) -> str:
    rows = [[f'<td><a href="/jobs/{_e(r["job_id"])}">{_e(r["job_id"])}</a></td>'] for r in pending]
    return f"<p>Orphans waiting for their worker: {_e(orphans)}</p>" + _table(
        ["job (lease going back to the queue)"], rows, "No recovery is pending."
    )


def schedules_live(schedules: Sequence[Schedule], ticks: Mapping[str, datetime]) -> str:
    rows = [
        [
            _td(s.name),
            _td(s.task),
            _td(s.queue),
            _td(f"cron {s.cron} ({s.timezone})" if s.cron else f"every {s.every}"),
            _td(_time(t.isoformat()) if (t := ticks.get(s.name)) else ""),
        ]
        for s in schedules
    ]
    return _table(["schedule", "task", "queue", "when", "next tick"], rows, "No schedules.")


def jobs_live(
    jobs: Sequence[dict[str, Any]], note: str, query: Mapping[str, str], next_cursor: str | None
) -> str:
    """The jobs table and the search ``note``, with links to the next page
    (``next_cursor``) and back to the first, under the same filter (``query``)."""
    rows = [
        [
            f'<td><a href="/jobs/{_e(j["id"])}">{_e(str(j["id"])[:8])}</a></td>',
            f"<td>{_status(j['status'])}</td>",
            _td(j["queue"]),
            _td(j["task"]),
            _td(j["attempts"], numeric=True),
            _td(_progress(j)),
            # A failed job's error in red; an earlier run's, kept by a job that went on, muted.
            f'<td class="{"err" if j["status"] == "failed" else "muted"}">'
            f"{_cut(_error_line(j))}</td>",
            f'<td class="line">{_cut(_time(j["updated_at"]))}</td>',
        ]
        for j in jobs
    ]
    headers = ["id", "status", "queue", "task", "failed runs", "progress", "error", "updated"]
    live = _table(headers, rows, "No job matches.") + note
    if next_cursor:
        more = {k: v for k, v in query.items() if k != "cursor"}
        after = urlencode({**more, "cursor": next_cursor})
        live += f'<p><a id="next" href="/jobs?{_e(after)}">Next page</a></p>'
    if query.get("cursor"):
        first = {k: v for k, v in query.items() if k != "cursor"}
        live += f'<p><a href="/jobs?{_e(urlencode(first))}">First page</a></p>'
    return live


def _error_line(job: Mapping[str, Any]) -> str:
    """The line of a job's last error that names it: its first (the exception and its
    message; the traceback follows it, innermost last)."""
    error = str(job.get("last_error") or "")[:2000]
    return next((line.strip() for line in error.splitlines() if line.strip()), "")


def _progress(job: Mapping[str, Any]) -> str:
    """A job's progress as a list shows it: done once it completed (its last report may
    have been below 100%), else its last report and message."""
    if job["status"] == JobStatus.COMPLETED.value:
        return "done"
    fraction = job.get("progress")
    if fraction is None:
        return ""
    return f"{fraction:.0%} {job.get('progress_message') or ''}".rstrip()


def prefix_note(seen: int, prefix: str) -> str:
    """How far an id-prefix search looked."""
    return (
        f'<p class="muted">Searched the newest {seen} jobs for ids starting with '
        f"{_cut(prefix)}.</p>"
    )


def jobs_filter(query: Mapping[str, str], prefix: str) -> str:
    """The jobs page's filter form, filled in from the query."""
    status = query.get("status") or None
    options = "".join(
        f'<option value="{s}"{" selected" if s == status else ""}>{s}</option>' for s in JobStatus
    )
    sizes = "".join(
        f"<option{' selected' if str(n) == query.get('limit') else ''}>{n}</option>"
        for n in PAGE_SIZES
    )
    return (
        '<section class=tools><form method="get" action="/jobs" id="filter">'
        f'status <select name="status"><option value="">any</option>{options}</select> '
        f'queue <input name="queue" value="{_e(query.get("queue") or None)}" size="10"> '
        f'task <input name="task" value="{_e(query.get("task") or None)}" size="24"> '
        f'id <input name="id" value="{_e(prefix)}" size="10" placeholder="prefix"> '
        f'per page <select name="limit">{sizes}</select> '
        '<button type="submit">Filter</button></form></section>' + _bulk_links(query)
    )


BULK_ACTIONS = {
    "retry": (frozenset({JobStatus.FAILED}), "Retry", "queued again"),
    "cancel": (frozenset({JobStatus.QUEUED, JobStatus.HANDED_OFF}), "Cancel", "cancelled"),
}
"""The bulk actions: the statuses each acts on, its button, and what it did."""


def bulk_filter(query: Mapping[str, str]) -> dict[str, str]:
    """The filter of a bulk action (queue, task, status) as its links carry it."""
    return {k: query[k] for k in ("queue", "task", "status") if query.get(k)}


def _bulk_links(query: Mapping[str, str]) -> str:
    """Links to the confirmation of a bulk retry or cancel of the jobs the filter
    selects (those an action applies to: failed ones for retry, waiting or running ones
    for cancel)."""
    kept = bulk_filter(query)
    status = kept.get("status")
    links = []
    for action, (statuses, button, _) in BULK_ACTIONS.items():
        if status and JobStatus(status) not in statuses:
            continue
        href = "/jobs/bulk?" + urlencode({**kept, "action": action})
        which = "failed" if action == "retry" else "queued and running"
        links.append(f'<a id="bulk-{action}" href="{_e(href)}">{button} all {which} jobs</a>')
    if not links:
        return ""
    return f"<section class=bulk>Matching this filter: {' · '.join(links)}</section>"


def bulk_confirm(action: str, query: Mapping[str, str], count: int, more: bool, before: str) -> str:
    """The confirmation of a bulk action: how many jobs it affects now (at most
    :data:`~broker.model.bounds.BULK_ACTION_JOBS` a request; ``more``: others match
    beyond), a form that does it, and a way back."""
    statuses, button, _ = BULK_ACTIONS[action]
    kept = bulk_filter(query)
    what = ", ".join(f"{k} {v}" for k, v in kept.items()) or "every job"
    back = "/jobs?" + urlencode(kept)
    which = " or ".join(sorted(s.value for s in statuses))
    if count == 0:
        return (
            f'<p id="bulk-count">No {which} job matches ({_cut(what)}): nothing to do.</p>'
            f'<p><a id="back" href="{_e(back)}">Back to the jobs</a></p>'
        )
    jobs = f"{count} job{'s' if count != 1 else ''}"
    many = f"at least {jobs}; this acts on the newest {count}, run it again for the rest"
    fields = "".join(
        f'<input type="hidden" name="{_e(k)}" value="{_e(v)}">'
        for k, v in {**kept, "action": action, "before": before}.items()
    )
    return (
        f'<p id="bulk-count">{button} the {which} jobs matching {_cut(what)}: '
        f"<strong>{_e(many if more else jobs)}</strong> (counted now; jobs enqueued after "
        "this page are left alone).</p>"
        f'<form method="post" action="/jobs/bulk" id="bulk">'
        f'<input type="hidden" name="token" value="">{fields}'
        f'<button type="submit" name="confirm" value="{_e(action)}">{button} {jobs}</button> '
        f'<a id="back" href="{_e(back)}">Back to the jobs</a></form>'
    )


def refused(text: str, back: str) -> str:
    """A refused action or request, in the page, with a way back."""
    return (
        f'<div class="msg error" id="error-notice">{_e(text)}</div>'
        f'<p><a id="back" href="{_e(back)}">Back</a></p>'
    )


def job_live(job_id: uuid.UUID, job: dict[str, Any]) -> str:
    """One job, every field, with its payloads cut to size and the actions its status
    allows (retry a dead job, cancel a waiting or running one)."""
    actions = []
    if job["status"] == JobStatus.FAILED.value:
        actions.append(_action(f"/jobs/{job_id}/retry", "Retry"))
    if job["status"] in (JobStatus.QUEUED.value, JobStatus.HANDED_OFF.value):
        actions.append(_action(f"/jobs/{job_id}/cancel", "Cancel"))
    fields = [
        ("status", _status(job["status"])),
        # Why a queued or waiting job is not running, when the main knows (broker.core.why).
        *([("waiting for", _cut(job["wait_reason"]))] if job.get("wait_reason") else []),
        ("task", _cut(job["task"])),
        ("queue", _cut(job["queue"])),
        ("priority", _cut(job["priority"])),
        ("mode", _cut(job["execution_mode"])),
        ("failed runs", _cut(f"{job['attempts']} (at most {job['max_attempts']} runs)")),
        ("lost runs", _cut(_lost_runs(job))),
        ("run at", _cut(_time(job["run_at"]))),
        ("created", _cut(_time(job["created_at"]))),
        ("updated", _cut(_time(job["updated_at"]))),
        ("worker", _cut(job["worker_id"] or "")),
        ("handed off", _cut(_time(job["handed_off_at"]))),
        ("timeout", _cut("" if job["timeout"] is None else f"{job['timeout']} s")),
        (
            "last checkpoint",
            _cut(
                f"{_time(job['checkpoint_at'])} (number {job['checkpoint_seq']})"
                if job["checkpoint_at"]
                else "none"
            ),
        ),
        (
            "progress",
            _cut(_progress(job)),
        ),
        ("idempotency key", _cut(job["idempotency_key"] or "")),
        ("unique key", _cut(job["unique_key"] or "")),
        (
            "concurrency",
            _cut(
                f"{job['concurrency_key']} (limit {job['concurrency_limit']})"
                if job["concurrency_key"]
                else ""
            ),
        ),
        ("rate key", _cut(job.get("rate_key") or "")),
    ]
    table = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in fields)
    error = "<h2>Last error</h2>" + _pre(job["last_error"] or "none", "error")
    failed = job["status"] == JobStatus.FAILED.value
    return (
        f'<p id="job-id">{_e(job_id)} {" ".join(actions)}</p>'
        + (error if failed else "")  # a dead job's page starts with why
        + f"<table>{table}</table>"
        "<h2>Arguments</h2>"
        + _pre(_json({"args": job["args"], "kwargs": job["kwargs"]}))
        + "<h2>Result</h2>"
        + _pre(_json(job["result"]))
        + "<h2>Last checkpoint</h2>"
        + _pre(_json(job["checkpoint"]), "checkpoint")
        + ("" if failed else error)
        + '<p class="muted">The store keeps a job\'s latest hand-off (worker and time) and '
        "its last error, not the earlier attempts.</p>"
    )
