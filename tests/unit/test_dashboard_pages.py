"""The dashboard's pure parts: which ``Host`` it answers to, and how a page is cut into
pages and links (``broker.ops.web.access``, ``broker.ops.web.pages``), without a server."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from aiohttp import web

from broker.jobs import Job, JobStatus
from broker.model.bounds import PAGE_ROWS
from broker.ops.admin.format import format_job
from broker.ops.web import pages
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
