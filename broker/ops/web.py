"""The main's web dashboard, ``/metrics`` and ``/healthz``, on one HTTP port.

Served with aiohttp: it runs inside the main's own event loop (an ``AppRunner`` and a
``TCPSite``, no second server to supervise and no signal handlers of its own, where
uvicorn would want to own the process), and it is one well-kept package with its own
HTTP parser, where Starlette would need uvicorn beside it.

Every read and action goes through the main's request service (:meth:`Requests.answer`
with the same messages a client sends), so a retry or a cancel here is checked, woken and
stopped on its worker exactly as ``broker retry`` / ``broker cancel`` are. Those requests
take the dashboard's own slots (:data:`DASHBOARD_REQUESTS`), never the clients': a page
load or an id search, which needs no client credential, cannot hold a client back.
Actions need the main's operator secret (``--operator-token``, or the shared ``--token``;
a form field ``token`` or ``Authorization: Bearer``); a main without one has no dashboard
actions, since a page on a loopback port is still reachable by any web page the
operator's browser opens.

Reads are guarded too (:func:`_guard`, before any handler runs): a request whose ``Host``
is not a loopback name, the ``--http-host`` address or one of ``--http-allowed-hosts`` is
refused, so a page that rebinds its own DNS name to 127.0.0.1 reads nothing; with
``--http-read-token`` every read needs it (or the operator secret), as a bearer token or
a Basic password, which a browser prompts for. Every answer carries a CSP that admits
only this page's own style and script and no framing, ``nosniff``, no referrer and
``no-store``. ``/healthz`` alone is open, for load balancers. The dashboard speaks plain
HTTP: keep it on loopback or behind a proxy with TLS (see docs/howto/security.md).

Every page has a size bound (:data:`broker.model.bounds.MAX_PAGE_BYTES`): at most
:data:`PAGE_ROWS` rows, the rest on further pages; names and values cut to
:data:`CELL_CHARS`; a job's payloads to :data:`VALUE_BYTES`.

The pages are plain HTML written here (every value escaped), with a few lines of vanilla
JavaScript that re-fetch the live part of the page every two seconds: no build step.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import html
import ipaddress
import secrets
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import msgspec
from aiohttp import web

from broker.exceptions import BrokerError
from broker.jobs import ExecutionMode, JobStatus, utcnow
from broker.main.main import Main
from broker.main.metrics import CONTENT_TYPE, MainExposition, MainLevels, label
from broker.model.bounds import CELL_CHARS, DASHBOARD_REQUESTS, PAGE_ROWS, VALUE_BYTES
from broker.model.untrusted import escape_bidi
from broker.storage import QueueCount
from broker.wire import messages as protocol
from broker.worker.metrics import WorkerLevels
from broker.worker.worker import Worker

COUNTS_MAX_AGE = 2.0
"""Seconds the store's job counts are reused between scrapes and page loads: counting a
large store is not free, and a second-old depth is fresh enough for either."""

REFRESH_MS = 2000
PAGE_SIZES = (20, 50, PAGE_ROWS)
PREFIX_SCAN_LIMIT = 10_000
"""Newest jobs searched for an id prefix (the store has no prefix index)."""
THROUGHPUT_WINDOW = 60.0
MAX_LINK_BYTES = 4096
"""Longest link the dashboard writes (a filter by a queue's name): well under aiohttp's
8190-byte request line, so every link it writes can be followed. A longer name (one
stored before names had a bound) is shown without its link."""

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
"""Host names every dashboard answers to, besides loopback addresses."""

OPEN_PATHS = frozenset({"/healthz"})
"""Paths answered whatever the ``Host`` and without the read credential: a load
balancer's probe names the address it dialled, and the answer says nothing."""

_STYLE = """
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
.muted{color:#6b7482}
"""

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


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's ``Host`` names this dashboard: a loopback name or address, or
    one of ``allowed`` (lower case), with any port. A DNS-rebinding page's requests carry
    its own name, so they are refused; a missing ``Host`` is too."""
    if not header:
        return False
    name = header.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.removesuffix(".")
    if name in allowed or name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_hosts(http_host: str, extra: Iterable[str]) -> frozenset[str]:
    """The names a dashboard answers to besides loopback: its own listen address (unless
    a wildcard) and the operator's ``--http-allowed-hosts``."""
    names = {name.strip().lower().removesuffix(".") for name in extra if name.strip()}
    if http_host not in ("", "0.0.0.0", "::"):
        names.add(http_host.lower().strip("[]"))
    return frozenset(names)


def _credential(request: web.Request) -> str:
    """The secret an ``Authorization`` header carries: a bearer token, or a Basic
    password (what a browser prompts for; the user name is ignored)."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return ""
        return decoded.partition(":")[2]
    return ""


def _matches(given: str, secret: str | None) -> bool:
    return bool(secret) and secrets.compare_digest(given.encode(), (secret or "").encode())


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


def _paged(request: web.Request, items: Sequence[Any]) -> tuple[Sequence[Any], str]:
    """The rows of the page the query asks for (``page``, from 1; :data:`PAGE_ROWS` a
    page) and the links to the pages beside it."""
    try:
        page = int(request.query.get("page") or 1)
    except ValueError:
        raise web.HTTPBadRequest(text="bad page: not a number") from None
    if page < 1:
        raise web.HTTPBadRequest(text="bad page: pages start at 1")
    start = (page - 1) * PAGE_ROWS
    shown = items[start : start + PAGE_ROWS]
    if len(items) <= PAGE_ROWS and page == 1:
        return shown, ""
    query = {k: v for k, v in request.query.items() if k not in ("page", "msg")}

    def link(number: int, text: str, anchor: str) -> str:
        href = request.path + "?" + urlencode({**query, "page": str(number)})
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


class Dashboard:
    """The HTTP side of a running :class:`Main`: start it after the main, stop it before."""

    def __init__(self, main: Main, *, host: str, port: int) -> None:
        self.main = main
        self._host = host
        self._port = port
        self._exposition = MainExposition(main.metrics)
        self._counts: tuple[float, list[QueueCount]] | None = None
        self._counts_lock = asyncio.Lock()
        self._completed: deque[tuple[float, dict[str, float]]] = deque()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._slots = asyncio.Semaphore(DASHBOARD_REQUESTS)
        settings = main.settings
        self._hosts = allowed_hosts(host, settings.http_allowed_hosts)
        self._read_secrets = (
            (settings.http_read_token, settings.credentials.operator)
            if settings.http_read_token
            else ()
        )
        """The secrets a read may show when a read credential is set (the operator's
        secret reads too); empty: reads need none."""
        app = web.Application(middlewares=[self._guard])
        app.on_response_prepare.append(_secure)
        app.add_routes(
            [
                web.get("/", self._queues),
                web.get("/workers", self._workers),
                web.get("/jobs", self._jobs),
                web.get("/jobs/{job_id}", self._job),
                web.post("/jobs/{job_id}/retry", self._retry),
                web.post("/jobs/{job_id}/cancel", self._cancel),
                web.get("/recoveries", self._recoveries),
                web.get("/schedules", self._schedules),
                web.post("/prune", self._prune),
                web.get("/metrics", self._metrics),
                web.get("/healthz", self._healthz),
            ]
        )
        self.app = app

    @property
    def port(self) -> int:
        if self._site is None or self._runner is None or not self._runner.addresses:
            raise RuntimeError("the dashboard is not listening")
        return int(self._runner.addresses[0][1])

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self._host, self._port)
        try:
            await self._site.start()
        except BaseException:
            await self._runner.cleanup()
            raise

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------------ data

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        """Refuse, before anything is read, a request for another host (DNS rebinding)
        and, with a read credential set, one without it."""
        if request.path not in OPEN_PATHS:
            if not host_allowed(request.headers.get("Host"), self._hosts):
                return web.Response(
                    status=421,
                    text="refused: this dashboard does not answer to that Host (a name "
                    "it should answer to goes in --http-allowed-hosts)\n",
                )
            if self._read_secrets:
                given = _credential(request)
                if not any(_matches(given, secret) for secret in self._read_secrets):
                    return web.Response(
                        status=401,
                        text="refused: this dashboard needs its read token "
                        "(--http-read-token), as a bearer token or a Basic password\n",
                        headers={"WWW-Authenticate": 'Basic realm="broker", charset="UTF-8"'},
                    )
        response: web.StreamResponse = await handler(request)
        return response

    async def _ask(self, msg: protocol.Message) -> Any:
        async with self._slots:  # the dashboard's own, never a client's
            return await self.main.requests.answer(msg)

    async def _job_counts(self) -> list[QueueCount]:
        async with self._counts_lock:
            now = time.monotonic()
            if self._counts is None or now - self._counts[0] > COUNTS_MAX_AGE:
                self._counts = (now, await self.main.store.count_jobs())
            return self._counts[1]

    def _levels(self, counts: Sequence[QueueCount]) -> MainLevels:
        handoff = self.main.handoff
        workers = list(handoff.worker_peers.values())
        credits = {mode.value: handoff.credit(mode) for mode in ExecutionMode}
        return MainLevels(
            counts=counts,
            now=utcnow(),
            workers=len(workers),
            draining=sum(1 for p in workers if p.draining),
            credits=credits,
            in_flight=sum(len(p.leases) for p in workers),
            ledger=len(handoff.returns),
            orphans=len(handoff.orphans),
        )

    def _throughput(self) -> dict[str, float]:
        """Completed runs per minute by queue, over about the last minute (the counters,
        sampled on each page load: the store's counts shrink when jobs are pruned)."""
        now = time.monotonic()
        totals = self.main.metrics.completed.totals_by_queue()
        self._completed.append((now, totals))
        while len(self._completed) > 2 and now - self._completed[1][0] >= THROUGHPUT_WINDOW:
            self._completed.popleft()
        then, before = self._completed[0]
        span = now - then
        if span < 1.0:
            return {}
        return {q: (n - before.get(q, 0.0)) * 60.0 / span for q, n in totals.items()}

    def _authorized(self, request: web.Request, form: Mapping[str, Any]) -> bool:
        token = self.main.settings.credentials.operator
        if not token:
            return False
        given = str(form.get("token") or "")
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            given = header.removeprefix("Bearer ")
        return _matches(given, token)

    # ------------------------------------------------------------------ pages

    def _page(self, request: web.Request, title: str, live: str, tools: str = "") -> web.Response:
        if request.headers.get("X-Broker-Fragment") == "live":
            return web.Response(text=live, content_type="text/html")
        nav = "".join(
            f'<a href="{path}"{" class=on" if request.path == path else ""}>{name}</a>'
            for path, name in _VIEWS
        )
        message = request.query.get("msg")
        note = f'<div class="msg" id="notice">{_e(message)}</div>' if message else ""
        body = (
            f"<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<title>{_e(title)} · broker</title><style>{_STYLE}</style></head><body>"
            f"<header><strong>broker</strong> <span class=muted>{_e(self.main.main_id)}</span>"
            f"{nav}<label class=auth>operator token "
            f'<input id="token" type="password" autocomplete="off" size="14"></label></header>'
            f"{note}<main><h1>{_e(title)}</h1>{tools}<div id=live>{live}</div></main>"
            f"<script>{_SCRIPT}</script></body></html>"
        )
        return web.Response(text=body, content_type="text/html")

    async def _queues(self, request: web.Request) -> web.Response:
        status = await self._ask(protocol.Status(request_id="web"))
        rates = self._throughput()
        rows = []
        queues, pages = _paged(request, status.status["queues"])
        for q in queues:
            counts = q["counts"]
            age = q["oldest_queued_age_seconds"]
            name = _cut(q["queue"])
            # A name longer than the link bound is never encoded whole (it may be megabytes).
            link = "/jobs?" + urlencode({"queue": q["queue"][: MAX_LINK_BYTES + 1]})
            if len(q["queue"]) <= MAX_LINK_BYTES and len(link) <= MAX_LINK_BYTES:
                name = f'<a href="{_e(link)}">{name}</a>'
            rows.append(
                [
                    f"<td>{name}</td>",
                    *(_td(counts[s.value], numeric=True) for s in JobStatus),
                    _td("" if age is None else f"{age:.1f} s", numeric=True),
                    _td(f"{rates.get(label(q['queue']), 0.0):.1f}", numeric=True),
                ]
            )
        headers = ["queue", *(s.value for s in JobStatus), "oldest due", "completed/min"]
        live = _table(headers, rows, "No jobs in the store.") + pages
        prune = (
            '<section class=tools><form method="post" action="/prune" id="prune">'
            '<input type="hidden" name="token" value="">Prune finished jobs older than '
            '<input name="older_than_days" type="number" min="0" step="any" value="7" size="4">'
            ' days <button type="submit">Prune</button></form></section>'
        )
        return self._page(request, "Queues", live, prune)

    async def _workers(self, request: web.Request) -> web.Response:
        status = await self._ask(protocol.Status(request_id="web"))
        workers, pages = _paged(request, status.status["workers"] or [])
        rows = [
            [
                _td(w["worker_id"]),
                _td(w["host"]),
                _td(", ".join(w["modes"])),
                _td("all" if w["queues"] is None else ", ".join(w["queues"])),
                _td(", ".join(f"{m}: {n}" for m, n in sorted(w["credits"].items()))),
                _td(w["in_flight"], numeric=True),
                _td(
                    ", ".join(
                        f"{m}: {w['busy'].get(m)}/{c}" for m, c in sorted(w["capacity"].items())
                    )
                ),
                _td("draining" if w["draining"] else "serving"),
            ]
            for w in workers
        ]
        headers = ["worker", "host", "modes", "queues", "free credits", "running", "busy", "state"]
        live = _table(headers, rows, "No worker is connected.") + pages
        return self._page(request, "Workers", live)

    async def _recoveries(self, request: web.Request) -> web.Response:
        status = await self._ask(protocol.Status(request_id="web"))
        pending, pages = _paged(request, status.status["pending_recoveries"] or [])
        rows = [
            [f'<td><a href="/jobs/{_e(r["job_id"])}">{_e(r["job_id"])}</a></td>'] for r in pending
        ]
        live = (
            f"<p>Orphans waiting for their worker: {_e(status.status['orphans'])}</p>"
            + _table(["job (lease going back to the queue)"], rows, "No recovery is pending.")
            + pages
        )
        return self._page(request, "Pending recoveries", live)

    async def _schedules(self, request: web.Request) -> web.Response:
        scheduler = self.main.leader.scheduler
        ticks = scheduler.ticks()
        schedules, pages = _paged(request, scheduler.schedules)
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
        headers = ["schedule", "task", "queue", "when", "next tick"]
        live = _table(headers, rows, "No schedules.") + pages
        return self._page(request, "Periodic schedules", live)

    async def _jobs(self, request: web.Request) -> web.Response:
        query = request.query
        status = query.get("status") or None
        queue = query.get("queue") or None
        task = query.get("task") or None
        prefix = (query.get("id") or "").strip().lower()
        try:
            limit = int(query.get("limit") or PAGE_SIZES[0])
            statuses = [JobStatus(status)] if status else None
            listing = protocol.ListJobs(
                request_id="web",
                statuses=statuses,
                queues=[queue] if queue else None,
                tasks=[task] if task else None,
                limit=limit if limit in PAGE_SIZES else PAGE_SIZES[0],
                cursor=query.get("cursor") or None,
            )
        except (ValueError, BrokerError) as exc:
            raise web.HTTPBadRequest(text=f"bad filter: {exc}") from None
        jobs, next_cursor, note = await self._find(listing, prefix)
        rows = [
            [
                f'<td><a href="/jobs/{_e(j["id"])}">{_e(str(j["id"])[:8])}</a></td>',
                f"<td>{_status(j['status'])}</td>",
                _td(j["queue"]),
                _td(j["task"]),
                _td(j["attempts"], numeric=True),
                _td(_time(j["created_at"])),
                _td(_time(j["updated_at"])),
            ]
            for j in jobs
        ]
        headers = ["id", "status", "queue", "task", "failed runs", "created", "updated"]
        live = _table(headers, rows, "No job matches.") + note
        if next_cursor:
            more = {k: v for k, v in query.items() if k != "cursor"}
            after = urlencode({**more, "cursor": next_cursor})
            live += f'<p><a id="next" href="/jobs?{_e(after)}">Next page</a></p>'
        if query.get("cursor"):
            first = {k: v for k, v in query.items() if k != "cursor"}
            live += f'<p><a href="/jobs?{_e(urlencode(first))}">First page</a></p>'
        options = "".join(
            f'<option value="{s}"{" selected" if s == status else ""}>{s}</option>'
            for s in JobStatus
        )
        sizes = "".join(
            f"<option{' selected' if str(n) == query.get('limit') else ''}>{n}</option>"
            for n in PAGE_SIZES
        )
        tools = (
            '<section class=tools><form method="get" action="/jobs" id="filter">'
            f'status <select name="status"><option value="">any</option>{options}</select> '
            f'queue <input name="queue" value="{_e(queue)}" size="10"> '
            f'task <input name="task" value="{_e(task)}" size="24"> '
            f'id <input name="id" value="{_e(prefix)}" size="10" placeholder="prefix"> '
            f'per page <select name="limit">{sizes}</select> '
            '<button type="submit">Filter</button></form></section>'
        )
        return self._page(request, "Jobs", live, tools)

    async def _find(
        self, listing: protocol.ListJobs, prefix: str
    ) -> tuple[list[dict[str, Any]], str | None, str]:
        """One page of the listing; with an id prefix, the matches among the newest
        :data:`PREFIX_SCAN_LIMIT` jobs the filter selects (a whole id is looked up)."""
        try:
            reply = await self._ask(listing) if not prefix else None
        except BrokerError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        if reply is not None:
            return reply.jobs, reply.next_cursor, ""
        try:
            whole = uuid.UUID(prefix)
        except ValueError:
            whole = None
        if whole is not None:
            info = await self._ask(protocol.GetJob(request_id="web", job_id=whole))
            return ([info.job] if info.job else []), None, ""
        found: list[dict[str, Any]] = []
        cursor: str | None = None
        seen = 0
        while seen < PREFIX_SCAN_LIMIT and len(found) < listing.limit:
            page = await self._ask(
                protocol.ListJobs(
                    request_id="web",
                    statuses=listing.statuses,
                    queues=listing.queues,
                    tasks=listing.tasks,
                    limit=protocol.MAX_LIST_LIMIT,
                    cursor=cursor,
                )
            )
            seen += len(page.jobs)
            found += [j for j in page.jobs if str(j["id"]).startswith(prefix)]
            cursor = page.next_cursor
            if cursor is None:
                break
        note = (
            f'<p class="muted">Searched the newest {seen} jobs for ids starting with '
            f"{_cut(prefix)}.</p>"
        )
        return found[: listing.limit], None, note

    async def _job(self, request: web.Request) -> web.Response:
        job_id = _job_id(request)
        info = await self._ask(protocol.GetJob(request_id="web", job_id=job_id))
        job = info.job
        if job is None:
            raise web.HTTPNotFound(text=f"no job {job_id}")
        actions = []
        if job["status"] == JobStatus.FAILED.value:
            actions.append(_action(f"/jobs/{job_id}/retry", "Retry"))
        if job["status"] in (JobStatus.QUEUED.value, JobStatus.HANDED_OFF.value):
            actions.append(_action(f"/jobs/{job_id}/cancel", "Cancel"))
        fields = [
            ("status", _status(job["status"])),
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
                _cut(
                    f"{job['progress']:.0%} {job['progress_message'] or ''}".rstrip()
                    if job["progress"] is not None
                    else ""
                ),
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
        ]
        table = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in fields)
        live = (
            f'<p id="job-id">{_e(job_id)} {" ".join(actions)}</p><table>{table}</table>'
            "<h2>Arguments</h2>"
            + _pre(_json({"args": job["args"], "kwargs": job["kwargs"]}))
            + "<h2>Result</h2>"
            + _pre(_json(job["result"]))
            + "<h2>Last checkpoint</h2>"
            + _pre(_json(job["checkpoint"]), "checkpoint")
            + "<h2>Last error</h2>"
            + _pre(job["last_error"] or "none", "error")
            + '<p class="muted">The store keeps a job\'s latest hand-off (worker and time) and '
            "its last error, not the earlier attempts.</p>"
        )
        return self._page(request, f"Job {str(job_id)[:8]}", live)

    # ------------------------------------------------------------------ actions

    async def _act(
        self, request: web.Request, make: Callable[[Mapping[str, Any]], protocol.Message]
    ) -> tuple[Mapping[str, Any], Any] | web.Response:
        """The reply to an authorized action, or the response refusing it."""
        form = await request.post()
        if not self._authorized(request, form):
            why = (
                "this main has no token for operators (BROKER_OPERATOR_TOKEN or BROKER_TOKEN), "
                "so the dashboard takes no actions"
                if not self.main.settings.credentials.operator
                else "the operator token is missing or wrong"
            )
            return web.Response(status=403, text=f"refused: {why}\n")
        try:
            msg = make(form)
        except (ValueError, OverflowError, BrokerError) as exc:
            return web.Response(status=400, text=f"refused: {exc}\n")
        try:
            return form, await self._ask(msg)
        except BrokerError as exc:
            return web.Response(status=409, text=f"refused: {exc}\n")

    async def _retry(self, request: web.Request) -> web.StreamResponse:
        return await self._job_action(request, protocol.Retry, "queued again")

    async def _cancel(self, request: web.Request) -> web.StreamResponse:
        return await self._job_action(request, protocol.Cancel, "cancelled")

    async def _job_action(
        self, request: web.Request, kind: type[protocol.Retry | protocol.Cancel], done: str
    ) -> web.StreamResponse:
        job_id = _job_id(request)
        outcome = await self._act(request, lambda _: kind(request_id="web", job_id=job_id))
        if isinstance(outcome, web.Response):
            return outcome
        job = outcome[1].job
        if job is None:
            raise web.HTTPNotFound(text=f"no job {job_id}")
        note = done if job["status"] in ("queued", "cancelled") else f"unchanged: {job['status']}"
        raise web.HTTPSeeOther(f"/jobs/{job_id}?" + urlencode({"msg": f"job {note}"}))

    async def _prune(self, request: web.Request) -> web.StreamResponse:
        def make(form: Mapping[str, Any]) -> protocol.Message:
            days = float(form.get("older_than_days") or "nan")
            return protocol.Prune(
                request_id="web", older_than_seconds=timedelta(days=days).total_seconds()
            )

        outcome = await self._act(request, make)
        if isinstance(outcome, web.Response):
            return outcome
        deleted = outcome[1].deleted
        raise web.HTTPSeeOther("/?" + urlencode({"msg": f"pruned {deleted} jobs"}))

    # ------------------------------------------------------------------ machines

    async def _metrics(self, request: web.Request) -> web.Response:
        levels = self._levels(await self._job_counts())
        return web.Response(
            body=self._exposition.render(levels),
            content_type=None,
            headers={"Content-Type": CONTENT_TYPE},
        )

    async def _healthz(self, request: web.Request) -> web.Response:
        """200 while the main serves; a load balancer needs no more (the store's health
        shows in the store error counters and in requests failing)."""
        return web.Response(text="ok\n")


async def _secure(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer's :data:`SECURITY_HEADERS`, refusals and errors included."""
    response.headers.update(SECURITY_HEADERS)


def _job_id(request: web.Request) -> uuid.UUID:
    try:
        return uuid.UUID(request.match_info["job_id"])
    except ValueError:
        raise web.HTTPNotFound(text="not a job id") from None


class WorkerMetricsServer:
    """A worker's ``/metrics`` and ``/healthz`` (``broker-worker --metrics-port``)."""

    def __init__(self, worker: Worker, *, host: str, port: int) -> None:
        self._levels = WorkerLevels(worker.status)
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        app = web.Application()
        app.add_routes([web.get("/metrics", self._metrics), web.get("/healthz", self._healthz)])
        self.app = app

    @property
    def port(self) -> int:
        if self._runner is None or not self._runner.addresses:
            raise RuntimeError("the metrics server is not listening")
        return int(self._runner.addresses[0][1])

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self._host, self._port).start()
        except BaseException:
            await self._runner.cleanup()
            raise

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._levels.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")


__all__ = ["Dashboard", "WorkerMetricsServer"]


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
