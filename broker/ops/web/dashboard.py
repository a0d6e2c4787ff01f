"""The dashboard's handlers: each asks the main's request service and serves a page
of :mod:`broker.ops.web.pages`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from aiohttp import web
from aiohttp.typedefs import Handler

from broker.core.election import MainRole
from broker.exceptions import BrokerError
from broker.jobs import ExecutionMode, JobStatus, utcnow
from broker.main.main import Main
from broker.main.metrics import CONTENT_TYPE, MainExposition, MainLevels
from broker.main.operations import queue_summary
from broker.model.bounds import BULK_ACTION_JOBS, DASHBOARD_REQUESTS
from broker.ops.web import charts, pages, workflows
from broker.ops.web.access import allowed_hosts, guard, matches, secure
from broker.ops.web.serving import HttpServer
from broker.storage import QueueCount
from broker.wire import messages as protocol

COUNTS_MAX_AGE = 2.0
"""Seconds the store's job counts are reused between scrapes and page loads: counting a
large store is not free, and a second-old depth is fresh enough for either."""

PREFIX_SCAN_LIMIT = 10_000
"""Newest jobs searched for an id prefix (the store has no prefix index)."""

SAMPLE_INTERVAL = 15.0
"""Seconds between the history's samples of the store's queue depths (the counts the
metrics read, so a scrape in between costs nothing more)."""


class Dashboard(HttpServer):
    """The HTTP side of a running :class:`Main`: start it after the main, stop it before."""

    def __init__(self, main: Main, *, host: str, port: int) -> None:
        self.main = main
        self._exposition = MainExposition(main.metrics)
        self._counts: tuple[float, list[QueueCount]] | None = None
        self._counts_lock = asyncio.Lock()
        self._sampler: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(DASHBOARD_REQUESTS)
        settings = main.settings
        # The secrets a read may show when a read credential is set (the operator's
        # secret reads too); empty: reads need none.
        read_secrets = (
            (settings.http_read_token, settings.credentials.operator)
            if settings.http_read_token
            else ()
        )
        app = web.Application(
            middlewares=[
                guard(allowed_hosts(host, settings.http_allowed_hosts), read_secrets),
                self._errors_in_page,
            ]
        )
        app.on_response_prepare.append(secure)
        app.add_routes(
            [
                web.get("/", self._queues),
                web.get("/workers", self._workers),
                web.get("/jobs", self._jobs),
                web.get("/jobs/bulk", self._bulk_confirm),
                web.post("/jobs/bulk", self._bulk),
                web.get("/jobs/{job_id}", self._job),
                web.get("/history", self._history),
                web.get("/workflows/{workflow_id}", functools.partial(workflows.page, self)),
                web.post("/jobs/{job_id}/retry", self._retry),
                web.post("/jobs/{job_id}/cancel", self._cancel),
                web.get("/recoveries", self._recoveries),
                web.get("/schedules", self._schedules),
                web.post("/prune", self._prune),
                web.post("/queues/pause", self._pause_queue),
                web.post("/queues/resume", self._resume_queue),
                web.post("/queues/limit", self._limit_queue),
                web.get("/metrics", self._metrics),
                web.get("/healthz", self._healthz),
            ]
        )
        super().__init__(app, host=host, port=port, what="dashboard")

    async def start(self) -> None:
        await super().start()
        self._sampler = asyncio.create_task(self._sample_levels(), name="broker-history")

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        await super().stop()

    async def _sample_levels(self) -> None:
        """Every :data:`SAMPLE_INTERVAL`, the queues' depth and oldest due wait into the
        main's history (a store that fails a count is tried again at the next)."""
        history = self.main.metrics.history
        while True:
            with contextlib.suppress(Exception):
                counts = await self._job_counts()
                now = utcnow()
                levels = {
                    q["queue"]: (q["counts"]["queued"], q["oldest_queued_age_seconds"])
                    for q in queue_summary(list(counts), now)
                }
                history.sampled(now.timestamp(), levels)
            await asyncio.sleep(SAMPLE_INTERVAL)

    @web.middleware
    async def _errors_in_page(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A request the dashboard refuses (a bad filter, an unknown job) is answered
        with a page that says why and links back, not a bare text; ``/metrics`` and
        ``/healthz`` keep their plain answers."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400 or request.path in ("/metrics", "/healthz"):
                raise
            back = "/jobs" if request.path.startswith("/jobs") else "/"
            return self._refused(request, exc.status, exc.text or exc.reason, back)

    # ------------------------------------------------------------------ data

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
            leader=self.main.standing.role is MainRole.LEADER,
            workers=len(workers),
            draining=sum(1 for p in workers if p.draining),
            credits=credits,
            in_flight=sum(len(p.leases) for p in workers),
            ledger=len(handoff.returns),
            orphans=len(handoff.orphans),
            tasks_without_worker=len(
                handoff.unserved(record.task for record in self.main.operations.catalog.records())
            ),
            queue_flow=self.main.queues.status(),
        )

    def _authorized(self, request: web.Request, form: Mapping[str, Any]) -> bool:
        token = self.main.settings.credentials.operator
        if not token:
            return False
        given = str(form.get("token") or "")
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            given = header.removeprefix("Bearer ")
        return matches(given, token)

    # ------------------------------------------------------------------ pages

    def _page(
        self, request: web.Request, title: str, live: str, tools: str = "", status: int = 200
    ) -> web.Response:
        if request.headers.get("X-Broker-Fragment") == "live":
            return web.Response(text=live, content_type="text/html", status=status)
        body = pages.document(
            title=title,
            path=request.path,
            main_id=self.main.main_id,
            message=request.query.get("msg"),
            live=live,
            tools=tools,
        )
        return web.Response(text=body, content_type="text/html", status=status)

    def _refused(self, request: web.Request, status: int, text: str, back: str) -> web.Response:
        """A refusal as a page of the dashboard: the reason, and a link back."""
        return self._page(request, "Refused", pages.refused(text, back), status=status)

    async def _queues(self, request: web.Request) -> web.Response:
        status = await self._ask(protocol.Status(request_id="web"))
        rates = self.main.metrics.history.completed_per_minute(time.time())
        queues, links = pages.paged(request.path, request.query, status.status["queues"])
        settings = {q["queue"]: q for q in status.status.get("queue_settings") or []}
        live = pages.queues_live(queues, rates, settings) + links
        return self._page(request, "Queues", live, pages.PRUNE_FORM)

    async def _workers(self, request: web.Request) -> web.Response:
        status = await self._ask(protocol.Status(request_id="web"))
        workers, links = pages.paged(request.path, request.query, status.status["workers"] or [])
        return self._page(request, "Workers", pages.workers_live(workers) + links)

    async def _recoveries(self, request: web.Request) -> web.Response:
        status = await self._ask(protocol.Status(request_id="web"))
        pending, links = pages.paged(
            request.path, request.query, status.status["pending_recoveries"] or []
        )
        live = pages.recoveries_live(pending, status.status["orphans"]) + links
        return self._page(request, "Pending recoveries", live)

    async def _schedules(self, request: web.Request) -> web.Response:
        scheduler = self.main.leader.scheduler
        ticks = scheduler.ticks()
        schedules, links = pages.paged(request.path, request.query, scheduler.schedules)
        live = pages.schedules_live(schedules, ticks) + links
        return self._page(request, "Periodic schedules", live)

    async def _jobs(self, request: web.Request) -> web.Response:
        query = request.query
        status = query.get("status") or None
        queue = query.get("queue") or None
        task = query.get("task") or None
        prefix = (query.get("id") or "").strip().lower()
        try:
            limit = int(query.get("limit") or pages.PAGE_SIZES[0])
            statuses = [JobStatus(status)] if status else None
            listing = protocol.ListJobs(
                request_id="web",
                statuses=statuses,
                queues=[queue] if queue else None,
                tasks=[task] if task else None,
                limit=limit if limit in pages.PAGE_SIZES else pages.PAGE_SIZES[0],
                cursor=query.get("cursor") or None,
            )
        except (ValueError, BrokerError) as exc:
            raise web.HTTPBadRequest(text=f"bad filter: {exc}") from None
        jobs, next_cursor, note = await self._find(listing, prefix)
        live = pages.jobs_live(jobs, note, query, next_cursor)
        return self._page(request, "Jobs", live, pages.jobs_filter(query, prefix))

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
        return found[: listing.limit], None, pages.prefix_note(seen, prefix)

    async def _history(self, request: web.Request) -> web.Response:
        history = self.main.metrics.history
        live = charts.history_live(request.query, history, time.time())
        return self._page(request, "History", live, charts.picker(request.query, history))

    async def _job(self, request: web.Request) -> web.Response:
        job_id = _job_id(request)
        info = await self._ask(protocol.GetJob(request_id="web", job_id=job_id))
        if info.job is None:
            raise web.HTTPNotFound(text=f"no job {job_id}")
        tools = ""
        if request.headers.get("X-Broker-Fragment") != "live":  # read once, not per refresh
            tools = workflows.workflow_link(await workflows.read(self, job_id))
        return self._page(
            request, f"Job {str(job_id)[:8]}", pages.job_live(job_id, info.job), tools
        )

    # ------------------------------------------------------------------ actions

    async def _allowed(
        self, request: web.Request, back: str
    ) -> tuple[Mapping[str, Any], None] | tuple[None, web.Response]:
        """The form of an authorized action, or the page refusing it."""
        form = await request.post()
        if not self._authorized(request, form):
            why = (
                "this main has no token for operators (BROKER_OPERATOR_TOKEN or BROKER_TOKEN), "
                "so the dashboard takes no actions"
                if not self.main.settings.credentials.operator
                else "the operator token is missing or wrong"
            )
            return None, self._refused(request, 403, f"refused: {why}", back)
        return form, None

    async def _act(
        self,
        request: web.Request,
        make: Callable[[Mapping[str, Any]], protocol.Message],
        back: str,
    ) -> tuple[Mapping[str, Any], Any] | web.Response:
        """The reply to an authorized action, or the page refusing it (with a link
        ``back`` to where the action was asked)."""
        form, refusal = await self._allowed(request, back)
        if form is None:
            assert refusal is not None
            return refusal
        try:
            msg = make(form)
        except (ValueError, OverflowError, BrokerError) as exc:
            return self._refused(request, 400, f"refused: {exc}", back)
        try:
            return form, await self._ask(msg)
        except BrokerError as exc:
            return self._refused(request, 409, f"refused: {exc}", back)

    async def _retry(self, request: web.Request) -> web.StreamResponse:
        return await self._job_action(request, protocol.Retry, "queued again")

    async def _cancel(self, request: web.Request) -> web.StreamResponse:
        return await self._job_action(request, protocol.Cancel, "cancelled")

    async def _job_action(
        self, request: web.Request, kind: type[protocol.Retry | protocol.Cancel], done: str
    ) -> web.StreamResponse:
        job_id = _job_id(request)
        outcome = await self._act(
            request, lambda _: kind(request_id="web", job_id=job_id), f"/jobs/{job_id}"
        )
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

        outcome = await self._act(request, make, "/")
        if isinstance(outcome, web.Response):
            return outcome
        deleted = outcome[1].deleted
        raise web.HTTPSeeOther("/?" + urlencode({"msg": f"pruned {deleted} jobs"}))

    async def _pause_queue(self, request: web.Request) -> web.StreamResponse:
        return await self._queue_action(request, protocol.PauseQueue, "paused")

    async def _resume_queue(self, request: web.Request) -> web.StreamResponse:
        return await self._queue_action(request, protocol.ResumeQueue, "resumed")

    async def _queue_action(
        self,
        request: web.Request,
        kind: type[protocol.PauseQueue | protocol.ResumeQueue],
        done: str,
    ) -> web.StreamResponse:
        """Pause or resume the queue the form names, under the actions' rules (the
        operator token, the same-origin check): back to the queues view, saying so."""
        outcome = await self._act(
            request, lambda form: kind(request_id="web", queue=str(form.get("queue", ""))), "/"
        )
        if isinstance(outcome, web.Response):
            return outcome
        queue = str(outcome[1].queue["queue"])
        raise web.HTTPSeeOther("/?" + urlencode({"msg": f"queue {queue[:100]} {done}"}))

    async def _limit_queue(self, request: web.Request) -> web.StreamResponse:
        """Set the rate limit of the queue the form names (``rate`` like ``50/s``, and
        ``burst``), or clear it (an empty ``rate``), as ``broker queue limit`` does."""

        def make(form: Mapping[str, Any]) -> protocol.Message:
            rate = str(form.get("rate") or "").strip() or None
            burst = int(str(form.get("burst") or "1"))
            return protocol.LimitQueue(
                request_id="web", queue=str(form.get("queue", "")), rate=rate, burst=burst
            )

        outcome = await self._act(request, make, "/")
        if isinstance(outcome, web.Response):
            return outcome
        info = outcome[1].queue
        queue = str(info["queue"])[:100]
        rate = info.get("rate_limit")
        done = f"limited to {rate}" if rate else "no longer rate limited"
        raise web.HTTPSeeOther("/?" + urlencode({"msg": f"queue {queue} {done}"}))

    # ------------------------------------------------------------------ bulk actions

    async def _matching(
        self, action: str, query: Mapping[str, Any], before: datetime | None
    ) -> tuple[list[uuid.UUID], bool]:
        """The newest jobs (at most :data:`BULK_ACTION_JOBS`) a bulk ``action`` applies to
        under the filter (queue, task, status) in ``query``, enqueued no later than
        ``before``; and whether more match beyond them."""
        try:
            allowed, _, _ = pages.BULK_ACTIONS[str(query.get("action") or action)]
            status = str(query.get("status") or "")
            statuses = sorted(allowed if not status else allowed & {JobStatus(status)})
        except (KeyError, ValueError):
            raise web.HTTPBadRequest(text="bad bulk action: unknown action or status") from None
        queue = str(query.get("queue") or "")
        task = str(query.get("task") or "")
        found: list[uuid.UUID] = []
        cursor: str | None = None
        while statuses:
            try:
                page = await self._ask(
                    protocol.ListJobs(
                        request_id="web",
                        statuses=statuses,
                        queues=[queue] if queue else None,
                        tasks=[task] if task else None,
                        limit=min(protocol.MAX_LIST_LIMIT, BULK_ACTION_JOBS + 1),
                        cursor=cursor,
                    )
                )
            except BrokerError as exc:
                raise web.HTTPBadRequest(text=f"bad filter: {exc}") from None
            for job in page.jobs:
                if before is None or datetime.fromisoformat(str(job["created_at"])) <= before:
                    found.append(uuid.UUID(str(job["id"])))
            cursor = page.next_cursor
            if cursor is None or len(found) > BULK_ACTION_JOBS:
                break
        return found[:BULK_ACTION_JOBS], len(found) > BULK_ACTION_JOBS

    async def _bulk_confirm(self, request: web.Request) -> web.Response:
        """How many jobs a bulk retry or cancel would affect now, and the form that
        does it (the confirmation step)."""
        action = request.query.get("action") or ""
        if action not in pages.BULK_ACTIONS:
            back = "/jobs?" + urlencode(pages.bulk_filter(request.query))
            return self._refused(request, 400, "refused: no such bulk action", back)
        found, more = await self._matching(action, request.query, None)
        live = pages.bulk_confirm(action, request.query, len(found), more, utcnow().isoformat())
        title = f"{pages.BULK_ACTIONS[action][1]} jobs"
        return self._page(request, title, live)

    async def _bulk(self, request: web.Request) -> web.StreamResponse:
        """A confirmed bulk retry or cancel: the jobs matching the filter now, enqueued
        before the confirmation was shown, at most :data:`BULK_ACTION_JOBS`, each
        retried or cancelled as ``broker retry`` or ``broker cancel`` would (one request
        each: the dispatcher is woken, a running job is stopped on its worker)."""
        posted = await request.post()  # read once: aiohttp keeps it for _allowed
        back = "/jobs?" + urlencode(pages.bulk_filter({k: str(v) for k, v in posted.items()}))
        form, refusal = await self._allowed(request, back)
        if form is None:
            assert refusal is not None
            return refusal
        action = str(form.get("action") or "")
        if action not in pages.BULK_ACTIONS:
            return self._refused(request, 400, "refused: no such bulk action", back)
        try:
            before = datetime.fromisoformat(str(form.get("before") or ""))
        except ValueError:
            return self._refused(request, 400, "refused: the confirmation is missing", back)
        found, more = await self._matching(action, form, before)
        kind = protocol.Retry if action == "retry" else protocol.Cancel
        _, _, done = pages.BULK_ACTIONS[action]
        changed = unchanged = 0
        for job_id in found:
            try:
                reply = await self._ask(kind(request_id="web", job_id=job_id))
            except BrokerError:
                unchanged += 1
                continue
            status = reply.job["status"] if reply.job else None
            if status in ("queued", "cancelled"):
                changed += 1
            else:
                unchanged += 1
        note = f"{changed} jobs {done}"
        if unchanged:
            note += f"; {unchanged} had moved on and were left as they were"
        if more:
            note += f"; more match (at most {BULK_ACTION_JOBS} a time): run it again"
        shown = {**pages.bulk_filter({k: str(v) for k, v in form.items()}), "msg": note}
        raise web.HTTPSeeOther("/jobs?" + urlencode(shown))

    # ------------------------------------------------------------------ machines

    async def _metrics(self, request: web.Request) -> web.Response:
        levels = self._levels(await self._job_counts())
        return web.Response(
            body=self._exposition.render(levels),
            content_type=None,
            headers={"Content-Type": CONTENT_TYPE},
        )

    async def _healthz(self, request: web.Request) -> web.Response:
        """200 while the main serves, leader or standby (a standby is healthy: it is ready
        to take over), with its role in the body, ``ok leader`` or ``ok standby``; 503 once
        it stepped down and is stopping. The leader's address is not said here: this path
        is open to anyone who reaches the port, and the main names the leader only to
        peers that proved a secret. A load balancer needs no more (the store's health
        shows in the store error counters and in requests failing)."""
        role = self.main.standing.role
        if role is MainRole.DEPOSED:
            return web.Response(status=503, text="deposed\n")
        return web.Response(text=f"ok {role.value}\n")


def _job_id(request: web.Request) -> uuid.UUID:
    try:
        return uuid.UUID(request.match_info["job_id"])
    except ValueError:
        raise web.HTTPNotFound(text="not a job id") from None
