"""Reports are bound to their connection, and clients never see a lease (issue 15, finding 2).

A real main over real TCP on a real SQLite file. Any peer with the token could once
settle any running job: reports were checked only against the store's current lease,
``get_job`` and ``list_jobs`` showed that lease to every client, and a hello could adopt
any lease it named. These tests hold each door shut, and keep open the legitimate paths
a reconnecting worker takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest

from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.jobs import Job, JobSpec, JobStatus, Settlement
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.ops import admin
from broker.storage import StorageAdapter
from broker.testing.faults import FaultyAdapter
from broker.wire import messages as protocol
from tests.support import FAST, FakeWorker, lease_of, until

SETTINGS = replace(FAST, orphan_grace=MainSettings().orphan_grace)
"""Orphans wait the default grace: the restart tests need them still there."""

APPLIED = protocol.AckStatus.APPLIED
STALE = protocol.AckStatus.STALE


class _Watched(FaultyAdapter):
    """Records every settlement and job lookup the main asks of the store, and can hold
    settlements at a gate, so a test can tell "answered without the store" apart."""

    def __init__(self, inner: StorageAdapter) -> None:
        super().__init__(inner)
        self.settled: list[Settlement] = []
        self.looked_up: list[uuid.UUID] = []
        self.settling = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()

    async def settle_many(self, settlements: Sequence[Settlement]) -> list[bool]:
        self.settled.extend(settlements)
        self.settling.set()
        await self.gate.wait()
        return await super().settle_many(settlements)

    async def get_job(self, job_id: uuid.UUID) -> Job | None:
        self.looked_up.append(job_id)
        return await self.inner.get_job(job_id)


@dataclass
class Setup:
    main: Main
    store: StorageAdapter
    """The SQLite store itself, read by the test without the main seeing it."""
    watched: _Watched


def _url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'binding.db'}"


@contextlib.asynccontextmanager
async def _running(url: str, **overrides: Any) -> AsyncIterator[Setup]:
    store = SQLAlchemyAdapter(url)
    watched = _Watched(store)
    settings = MainSettings(**{**SETTINGS.__dict__, **overrides})
    main = Main(
        cast(StorageAdapter, watched),
        settings,
        retry_delay_fn=lambda n: timedelta(0),
        retention=None,
    )
    await main.start()
    try:
        yield Setup(main, store, watched)
    finally:
        await main.stop()


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    async with _running(_url(tmp_path)) as running:
        yield running


async def _job(store: StorageAdapter, **kw: Any) -> Job:
    [result] = await store.enqueue_many([JobSpec(task="t.noop", **kw)])
    return result.job


async def _handed(worker: FakeWorker, store: StorageAdapter, **kw: Any) -> protocol.JobHandoff:
    """Enqueue one job and have ``worker`` be handed it."""
    await _job(store, **kw)
    await worker.ready(pooled=1)
    return await worker.next_job()


REPORTS: dict[str, Callable[[protocol.JobHandoff], protocol.Message]] = {
    "completed": lambda j: protocol.CompletedReport(j.job_id, j.handoff_id, result="forged"),
    "failed": lambda j: protocol.FailedReport(j.job_id, j.handoff_id, error="forged", retry=False),
    "reschedule": lambda j: protocol.RescheduleReport(j.job_id, j.handoff_id, delay=3600),
    "release": lambda j: protocol.ReleaseReport(j.job_id, j.handoff_id, reason="forged"),
}


async def _forged_report_changes_nothing(
    setup: Setup, owner: FakeWorker, peer: FakeWorker, kind: str
) -> None:
    """``peer`` sends a report for ``owner``'s lease: stale at once, the store neither
    written nor read, and the owner's own report still applies."""
    sent = await _handed(owner, setup.store)
    before = await setup.store.get_job(sent.job_id)
    assert before is not None and before.handoff_id == sent.handoff_id
    ack = await peer.report(REPORTS[kind](sent))
    assert (ack.job_id, ack.handoff_id, ack.status) == (sent.job_id, sent.handoff_id, STALE)
    assert setup.watched.settled == [], "a lease this connection does not hold reached the store"
    assert setup.watched.looked_up == []
    assert await setup.store.get_job(sent.job_id) == before, "the job is untouched"
    assert (await owner.complete(sent, "real")).status is APPLIED
    done = await setup.store.get_job(sent.job_id)
    assert done is not None and done.status is JobStatus.COMPLETED
    assert done.result == "real" and done.worker_id == owner.worker_id


# ------------------------------------------------------------------ forged reports


@pytest.mark.parametrize("kind", sorted(REPORTS))
async def test_a_report_from_another_workers_connection_is_stale_and_changes_nothing(
    setup: Setup, kind: str
) -> None:
    owner = FakeWorker(setup.main.port, worker_id="worker-a")
    peer = FakeWorker(setup.main.port, worker_id="worker-b")
    await owner.connect()
    await peer.connect()
    await _forged_report_changes_nothing(setup, owner, peer, kind)
    await owner.close()
    await peer.close()


async def test_a_connection_with_the_same_worker_id_that_adopted_nothing_is_refused(
    setup: Setup,
) -> None:
    owner = FakeWorker(setup.main.port, worker_id="worker-a")
    await owner.connect()
    sent = await _handed(owner, setup.store)
    twin = FakeWorker(setup.main.port, worker_id="worker-a")
    welcome = await twin.connect()  # no held_leases: it claims nothing
    assert welcome.adopted == []
    ack = await twin.complete(sent, "forged")
    assert ack.status is STALE
    assert setup.watched.settled == [] and setup.watched.looked_up == []
    job = await setup.store.get_job(sent.job_id)
    assert job is not None and job.status is JobStatus.HANDED_OFF
    assert job.handoff_id == sent.handoff_id and job.result is None
    assert (await owner.complete(sent, "real")).status is APPLIED
    done = await setup.store.get_job(sent.job_id)
    assert done is not None and done.result == "real"
    await owner.close()
    await twin.close()


async def test_a_hello_naming_a_held_lease_with_another_job_id_adopts_nothing(
    setup: Setup,
) -> None:
    owner = FakeWorker(setup.main.port, worker_id="worker-a")
    await owner.connect()
    sent = await _handed(owner, setup.store)
    twin = FakeWorker(setup.main.port, worker_id="worker-a")
    wrong = protocol.LeaseRef(job_id=uuid.uuid4(), handoff_id=sent.handoff_id)
    assert (await twin.connect(held=[wrong])).adopted == []
    assert (await twin.complete(sent, "forged")).status is STALE
    assert (await owner.complete(sent, "real")).status is APPLIED, "the owner kept its lease"
    await owner.close()
    await twin.close()


# ------------------------------------------------------------------ clients see no lease


async def test_clients_and_the_operator_cli_never_see_a_lease(setup: Setup) -> None:
    worker = FakeWorker(setup.main.port, worker_id="worker-a")
    await worker.connect()
    running = await _handed(worker, setup.store)
    dead = await _handed(worker, setup.store, max_attempts=1)
    failed = protocol.FailedReport(dead.job_id, dead.handoff_id, error="boom", retry=False)
    assert (await worker.report(failed)).status is APPLIED
    leases = {str(running.handoff_id), str(dead.handoff_id)}

    def shows_no_lease(job: object) -> bool:
        text = json.dumps(job)
        return '"handoff_id"' not in text and not any(lease in text for lease in leases)

    store_view = admin.StoreService(setup.store, "the main is down")
    async with Client("127.0.0.1", setup.main.port) as client:
        for backend in (client, store_view):
            shown = await backend.get_job(running.job_id)
            assert shown is not None and shows_no_lease(shown)
            assert shown["worker_id"] == "worker-a", "operators still see the worker"
            page = await backend.list_jobs(
                statuses=None, queues=None, tasks=None, limit=10, cursor=None, include_payload=True
            )
            assert len(page.jobs) == 2 and shows_no_lease(page.jobs)
        retried = await client.retry(dead.job_id)
        assert retried is not None and retried["status"] == "queued" and shows_no_lease(retried)
        cancelled = await client.cancel(running.job_id)
        assert cancelled is not None and cancelled["status"] == "cancelled"
        assert shows_no_lease(cancelled)
    await worker.close()


async def test_status_names_a_lease_still_being_returned_by_its_job_only(setup: Setup) -> None:
    worker = FakeWorker(setup.main.port, worker_id="worker-a")
    await worker.connect()
    sent = await _handed(worker, setup.store)
    setup.watched.return_failures = 1_000_000  # the store refuses to take the lease back
    await worker.close()
    await until(lambda: len(setup.main.leader.ledger) == 1)
    async with Client("127.0.0.1", setup.main.port) as client:
        status = await client.status()
    assert status["pending_recoveries"] == [{"job_id": str(sent.job_id)}]
    assert str(sent.handoff_id) not in json.dumps(status)
    setup.watched.return_failures = 0
    await until(lambda: len(setup.main.leader.ledger) == 0)


# ------------------------------------------------------------------ after a main restart


async def test_after_a_restart_a_hello_cannot_adopt_another_workers_leases(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    async with _running(url) as first:
        owner = FakeWorker(first.main.port, worker_id="owner")
        await owner.connect()
        sent = await _handed(owner, first.store)
    await owner.close()

    async with _running(url, orphan_grace=30) as second:
        assert list(second.main.orphans) == [sent.handoff_id]
        impostor = FakeWorker(second.main.port, worker_id="impostor")
        assert (await impostor.connect(held=[lease_of(sent)])).adopted == []
        assert list(second.main.orphans) == [sent.handoff_id], "still waiting for its owner"
        assert (await impostor.complete(sent, "forged")).status is STALE
        assert second.watched.settled == [] and second.watched.looked_up == []
        job = await second.store.get_job(sent.job_id)
        assert job is not None and job.status is JobStatus.HANDED_OFF
        assert job.handoff_id == sent.handoff_id and job.worker_id == "owner"

        back = FakeWorker(second.main.port, worker_id="owner")
        assert (await back.connect(held=[lease_of(sent)])).adopted == [lease_of(sent)]
        assert (await back.complete(sent, "real")).status is APPLIED
        done = await second.store.get_job(sent.job_id)
        assert done is not None and done.result == "real"
        await impostor.close()
        await back.close()


# ------------------------------------------------------------------ a worker reconnecting


async def test_a_reconnecting_worker_adopts_its_lease_and_the_old_socket_loses_it(
    setup: Setup,
) -> None:
    """The worker reconnects before the main noticed its old socket died: the new
    connection takes the lease over, its report applies, and the old one's does not."""
    old = FakeWorker(setup.main.port, worker_id="worker-a")
    await old.connect()
    sent = await _handed(old, setup.store)
    new = FakeWorker(setup.main.port, worker_id="worker-a")
    assert (await new.connect(held=[lease_of(sent)])).adopted == [lease_of(sent)]
    assert (await old.complete(sent, "old")).status is STALE
    await old.close()
    await until(lambda: len(setup.main.sessions) == 1)
    assert len(setup.main.leader.ledger) == 0, "the old socket had nothing left to give back"
    assert (await new.complete(sent, "new")).status is APPLIED
    done = await setup.store.get_job(sent.job_id)
    assert done is not None and done.status is JobStatus.COMPLETED and done.result == "new"
    await new.close()


async def test_a_report_resent_while_its_first_copy_settles_is_a_duplicate(
    setup: Setup,
) -> None:
    """The old connection's report is still being stored when the worker reconnects,
    adopts the lease and sends the report again: the first applies, the copy is
    recognised as already recorded, and nothing is applied twice."""
    old = FakeWorker(setup.main.port, worker_id="worker-a")
    await old.connect()
    sent = await _handed(old, setup.store)
    setup.watched.gate.clear()
    await old.send(protocol.CompletedReport(sent.job_id, sent.handoff_id, result="once"))
    await asyncio.wait_for(setup.watched.settling.wait(), 5)
    new = FakeWorker(setup.main.port, worker_id="worker-a")
    assert (await new.connect(held=[lease_of(sent)])).adopted == [lease_of(sent)]
    await new.send(protocol.CompletedReport(sent.job_id, sent.handoff_id, result="once"))
    await until(lambda: len(setup.main.leader.settler.writer.queued) == 1)
    setup.watched.gate.set()
    assert (await asyncio.wait_for(old.acks.get(), 5)).status is APPLIED
    assert (await asyncio.wait_for(new.acks.get(), 5)).status is protocol.AckStatus.DUPLICATE
    done = await setup.store.get_job(sent.job_id)
    assert done is not None and done.status is JobStatus.COMPLETED and done.result == "once"
    await old.close()
    await new.close()
