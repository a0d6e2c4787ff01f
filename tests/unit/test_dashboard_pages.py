"""The dashboard's pure parts: which ``Host`` it answers to, and how a page is cut into
pages and links (``broker.ops.web.access``, ``broker.ops.web.pages``), without a server."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from aiohttp import web

from broker.core.history import History
from broker.jobs import Job, JobStatus
from broker.model.bounds import HISTORY_SERIES, MAX_PAGE_BYTES, PAGE_ROWS
from broker.ops.admin.format import format_job
from broker.ops.web import charts, pages
from broker.ops.web.access import allowed_hosts, host_allowed

MINE = allowed_hosts("0.0.0.0", ["Broker.Example.", " "])


@pytest.mark.parametrize(
    "header",
    [
        "localhost",
        "localhost:8080",
        "127.0.0.1:8080",
        "[::1]:8080",
        "broker.example",
        "BROKER.EXAMPLE.",
    ],
)
def test_loopback_and_the_allowed_names_are_answered_with_any_port(header: str) -> None:
    assert host_allowed(header, MINE)


@pytest.mark.parametrize("header", [None, "", "evil.example", "evil.example:8080", "10.0.0.5"])
def test_another_name_or_none_is_refused(header: str | None) -> None:
    assert not host_allowed(header, MINE)


def test_the_listen_address_is_allowed_unless_a_wildcard() -> None:
    assert allowed_hosts("10.0.0.5", []) == {"10.0.0.5"}
    assert allowed_hosts("::", []) == allowed_hosts("0.0.0.0", []) == frozenset()


def test_one_page_of_rows_needs_no_links() -> None:
    rows, links = pages.paged("/jobs", {}, list(range(PAGE_ROWS)))
    assert len(rows) == PAGE_ROWS and links == ""


def test_the_next_page_keeps_the_filter_and_drops_the_message() -> None:
    items = list(range(PAGE_ROWS + 1))
    rows, links = pages.paged("/workers", {"page": "2", "q": "a", "msg": "done"}, items)
    assert list(rows) == [PAGE_ROWS]
    assert 'href="/workers?q=a&amp;page=1"' in links and "msg" not in links
    assert "Next page" not in links


@pytest.mark.parametrize("page", ["x", "0"])
def test_a_bad_page_number_is_a_bad_request(page: str) -> None:
    with pytest.raises(web.HTTPBadRequest):
        pages.paged("/", {"page": page}, [])


def test_a_queue_name_too_long_for_a_link_is_shown_without_one() -> None:
    counts = {"queued": 0, "handed_off": 0, "completed": 0, "failed": 0, "cancelled": 0}
    row = {"counts": counts, "oldest_queued_age_seconds": None}
    short = pages.queues_live([{**row, "queue": "q"}], {})
    long = pages.queues_live([{**row, "queue": "q" * (pages.MAX_LINK_BYTES + 1)}], {})
    assert 'href="/jobs?queue=q"' in short and "href" not in long


def test_each_queue_shows_its_flow_with_a_pause_or_resume_button() -> None:
    counts = {"queued": 0, "handed_off": 0, "completed": 0, "failed": 0, "cancelled": 0}
    row = {"counts": counts, "oldest_queued_age_seconds": None}
    settings = {"mail": {"queue": "mail", "paused": True, "rate_limit": "50/s"}}
    page = pages.queues_live([{**row, "queue": "mail"}, {**row, "queue": "api"}], {}, settings)
    assert "paused, at most 50/s" in page
    assert 'action="/queues/resume"' in page and 'value="mail"' in page
    assert 'action="/queues/pause"' in page and 'value="api"' in page
    long = pages.queues_live([{**row, "queue": "q" * (pages.MAX_LINK_BYTES + 1)}], {})
    assert "dispatching" in long and "/queues/pause" not in long


def test_a_jobs_page_and_broker_job_say_why_it_waits_when_the_main_knows() -> None:
    """``wait_reason`` (from the main's ``get_job``, :mod:`broker.core.why`) is shown under
    the status on the dashboard's job page and by ``broker job``; a job without one shows
    no such line."""
    now = datetime(2026, 5, 1, tzinfo=UTC)
    job = Job(
        id=uuid.uuid4(),
        task="app.notify",
        args=(),
        kwargs={},
        queue="mail",
        priority=0,
        status=JobStatus.QUEUED,
        attempts=0,
        max_attempts=1,
        run_at=now,
        created_at=now,
        updated_at=now,
        rate_key="acme",
    ).to_dict()
    reason = "queue 'mail' is paused (`broker queue resume mail`)"
    shown: dict[str, object] = {}
    for key, value in job.items():  # as the main's get_job places it
        shown[key] = value
        if key == "status":
            shown["wait_reason"] = reason
    page = pages.job_live(job["id"], shown)
    assert "waiting for" in page and "queue &#x27;mail&#x27; is paused" in page
    assert "acme" in page, "the rate key is on the page"
    assert "waiting for" not in pages.job_live(job["id"], job)
    lines = format_job(shown).splitlines()
    assert lines[lines.index(next(x for x in lines if x.startswith("status"))) + 1].split() == [
        "wait_reason",
        *reason.split(),
    ], "the reason comes right under the status"
    assert "wait_reason" not in format_job(job)


def test_a_rate_limited_queue_has_a_clear_button_and_the_others_a_limit_form() -> None:
    counts = {"queued": 0, "handed_off": 0, "completed": 0, "failed": 0, "cancelled": 0}
    row = {"counts": counts, "oldest_queued_age_seconds": None}
    settings = {"mail": {"queue": "mail", "paused": False, "rate_limit": "50/s", "rate_burst": 5}}
    page = pages.queues_live([{**row, "queue": "mail"}, {**row, "queue": "api"}], {}, settings)
    assert "dispatching, at most 50/s (burst 5)" in page
    assert page.count('action="/queues/limit"') == 2
    assert page.count('value="clear limit"') == 1 and page.count('value="limit"') == 1


def test_the_job_list_shows_the_errors_first_line_and_progress() -> None:
    base = {"queue": "q", "task": "t", "attempts": 1, "created_at": None, "updated_at": None}
    jobs = [
        {
            **base,
            "id": "a" * 32,
            "status": "failed",
            "progress": 0.5,
            "progress_message": "m",
            "last_error": "ValueError: no data\nTraceback (innermost last):\n  File x",
        },
        {
            **base,
            "id": "b" * 32,
            "status": "completed",
            "progress": 0.875,
            "progress_message": "",
            "last_error": None,
        },
        {
            **base,
            "id": "c" * 32,
            "status": "handed_off",
            "progress": 0.25,
            "progress_message": "step 1",
            "last_error": None,
        },
    ]
    page = pages.jobs_live(jobs, "", {}, None)
    assert ">ValueError: no data</td>" in page and "Traceback" not in page
    assert "<td>done</td>" in page  # a completed job is done, whatever it last said
    assert "<td>25% step 1</td>" in page


def test_a_failed_jobs_page_starts_with_its_error() -> None:
    job = {
        "status": "failed",
        "task": "t",
        "queue": "q",
        "priority": 0,
        "execution_mode": "inline",
        "attempts": 1,
        "max_attempts": 1,
        "recoveries": 0,
        "run_at": None,
        "created_at": None,
        "updated_at": None,
        "worker_id": None,
        "handed_off_at": None,
        "timeout": None,
        "checkpoint_at": None,
        "progress": None,
        "idempotency_key": None,
        "unique_key": None,
        "concurrency_key": None,
        "args": [],
        "kwargs": {},
        "result": None,
        "checkpoint": None,
        "last_error": "ValueError: boom",
    }
    failed = pages.job_live(uuid.uuid4(), job)
    assert failed.index('id="error"') < failed.index("<table>")
    done = pages.job_live(uuid.uuid4(), {**job, "status": "completed"})
    assert done.index('id="error"') > done.index("<table>")


def test_the_workers_view_counts_as_broker_status_does() -> None:
    worker = {
        "worker_id": "w",
        "host": "h",
        "queues": None,
        "modes": ["inline", "pooled"],
        "draining": False,
        "in_flight": 5,
        "in_flight_by_mode": {"inline": 3, "pooled": 2},
        "credits": {"inline": 1, "pooled": 0},
        "capacity": {"inline": 4, "pooled": 2},
        "status_reported": True,
    }
    page = pages.workers_live([worker])
    assert "<td>6 (inline: 4, pooled: 2)</td>" in page  # capacity
    assert "<td>5 (inline: 3, pooled: 2)</td>" in page  # in flight
    assert "<td>1 (inline: 1, pooled: 0)</td>" in page  # free credits


def test_a_bulk_confirmation_says_how_many_and_keeps_the_filter() -> None:
    query = {"queue": "reports", "status": "failed", "limit": "50", "action": "retry"}
    page = pages.bulk_confirm("retry", query, 3, False, "2026-01-01T00:00:00+00:00")
    assert "<strong>3 jobs</strong>" in page and "Retry 3 jobs</button>" in page
    assert 'name="queue" value="reports"' in page and 'name="limit"' not in page
    assert 'href="/jobs?queue=reports&amp;status=failed"' in page
    more = pages.bulk_confirm("cancel", {}, 500, True, "2026-01-01T00:00:00+00:00")
    assert "at least 500 jobs; this acts on the newest 500" in more
    none = pages.bulk_confirm("cancel", {"task": "t"}, 0, False, "x")
    assert "nothing to do" in none and "<form" not in none


def test_the_bulk_links_offer_only_what_the_status_allows() -> None:
    assert 'id="bulk-retry"' in pages.jobs_filter({"status": "failed"}, "")
    assert 'id="bulk-cancel"' not in pages.jobs_filter({"status": "failed"}, "")
    assert "bulk" not in pages.jobs_filter({"status": "completed"}, "").split("</form>")[1]


def test_the_history_page_stays_under_the_page_bound_at_its_worst() -> None:
    history = History()
    start = 1_800_000_000.0
    for minute in range(history.minutes):
        now = start + minute * 60
        for n in range(HISTORY_SERIES + 2):
            name = f'"<{n}>' + "é" * 1100  # longer than any name the main takes
            history.completed(now, name, name)
            history.failed(now, name, name, retried=True)
            history.started(now, name, name, 0.5 + n)
        history.sampled(now, {f"q{n}": (n, 1.0) for n in range(HISTORY_SERIES + 2)})
    now = start + history.minutes * 60 - 1
    query = {"window": "all"}
    page = pages.document(
        title="History",
        path="/history",
        main_id="m",
        message=None,
        live=charts.history_live(query, history, now),
        tools=charts.picker(query, history),
    )
    assert len(page.encode()) < MAX_PAGE_BYTES, len(page.encode())
    assert page.count("<svg") == 4 and "&lt;0&gt;" in page and "<0>" not in page
