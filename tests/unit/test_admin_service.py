"""Where the operator's commands go (``broker.ops.admin.service``): a client connected to
the main, or the store through the main's own operations, both one request service."""

from __future__ import annotations

import uuid
from typing import Any

from adapters.memory import MemoryAdapter
from broker.jobs import JobStatus
from broker.ops.admin.format import format_status
from broker.ops.admin.service import RequestService, StoreService, read_status
from broker.wire import messages as protocol


class _MainReply:
    """What a main's ``status`` reply holds: it never says where it came from."""

    async def status(self) -> dict[str, Any]:
        return {"main_id": "m1", "queues": []}


async def test_a_status_that_does_not_say_its_source_is_the_mains() -> None:
    shown = await read_status(_MainReply())  # type: ignore[arg-type]  # status alone
    assert shown == {"source": "main", "main_error": None, "main_id": "m1", "queues": []}


def test_the_first_line_of_broker_status_names_the_main_that_answered_and_its_role() -> None:
    """With several mains, a standby given as ``--main`` hands the command to the leader:
    the line says which main answered, as what, and where (a main older than the role
    says neither)."""
    base = {"source": "main", "main_id": "m2", "dispatched": 3, "orphans": 0, "queues": []}
    shown = format_status({**base, "role": "leader", "leader": "main-b.internal:7600"})
    assert shown.splitlines()[0] == (
        "main: m2 up as leader at main-b.internal:7600, 3 jobs dispatched, "
        "0 orphaned leases awaiting their workers"
    )
    assert format_status(base).startswith("main: m2 up, 3 jobs dispatched")


async def test_the_store_says_the_main_is_down_and_why_and_has_no_workers() -> None:
    service: RequestService = StoreService(MemoryAdapter(), "cannot reach the main")
    shown = await read_status(service)
    assert shown["source"] == "store" and shown["main_error"] == "cannot reach the main"
    assert shown["workers"] is None and shown["queues"] == []


async def test_the_store_answers_in_the_dicts_the_main_would_send() -> None:
    service: RequestService = StoreService(MemoryAdapter(), "down")
    [enqueued] = await service.enqueue_requests(
        [protocol.JobRequest(task="app.t", args=[1])], allow_unknown_tasks=True
    )
    job = await service.get_job(enqueued.job_id)
    assert job is not None and job["id"] == str(enqueued.job_id) and job["args"] == [1]
    page = await service.list_jobs(
        statuses=[JobStatus.QUEUED],
        queues=None,
        tasks=None,
        limit=10,
        cursor=None,
        include_payload=False,
    )
    assert [j["id"] for j in page.jobs] == [job["id"]] and page.next_cursor is None
    cancelled = await service.cancel(enqueued.job_id)
    assert cancelled is not None and cancelled["status"] == JobStatus.CANCELLED
    assert await service.get_job(uuid.uuid4()) is None
