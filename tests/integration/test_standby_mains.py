"""Several mains in one process on one PostgreSQL store: the first to start leads at once
(ready when ``start`` returns, as a lone main always was); the other answers a hello
with ``not_leader`` naming it, and a client given the standby's address, or both, is
sent on to the leader. A leader that stops cleanly resigns, and the standby takes over
at its next round."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, cast

import aiohttp
import pytest
import sqlalchemy as sa
from sqlalchemy.pool import QueuePool

from adapters import DEFAULT_POOL_SIZE
from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.jobs import JobStatus
from broker.main.main import Main
from broker.ops.web import Dashboard
from broker.storage import JobFilter, JobPage, StorageAdapter
from tests.conftest import drop_schema, fresh_schema_name, require_postgres
from tests.support import FAST, FakeWorker, lease_of, until

pytestmark = pytest.mark.postgres

SETTINGS = replace(FAST, failover_timeout=2.0)


class HeldOrphans:
    """A store whose read of the handoffs in flight (the orphans a main loads once elected)
    waits for :attr:`loaded` once :attr:`holding` is set; everything else goes straight
    through."""

    def __init__(self, inner: StorageAdapter) -> None:
        self.inner = inner
        self.holding = False
        self.loaded = asyncio.Event()
        self.waiting = False
        """A read is being held now."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def list_jobs(self, job_filter: JobFilter, **options: Any) -> JobPage:
        if self.holding and list(job_filter.statuses or ()) == [JobStatus.HANDED_OFF]:
            self.waiting = True
            await self.loaded.wait()
        return await self.inner.list_jobs(job_filter, **options)


@pytest.fixture
async def stores() -> AsyncIterator[list[SQLAlchemyAdapter]]:
    url = require_postgres()
    schema = fresh_schema_name()
    made = [SQLAlchemyAdapter(url, schema=schema) for _ in range(2)]
    try:
        yield made
    finally:
        await drop_schema(schema)


async def test_a_standby_sends_peers_to_the_leader_and_takes_over(
    stores: list[SQLAlchemyAdapter],
) -> None:
    leader = Main(stores[0], SETTINGS, retention=None)
    standby = Main(stores[1], SETTINGS, retention=None)
    await leader.start()
    try:
        assert leader.leading, "a main alone on its store leads when start() returns"
        await standby.start()
        assert not standby.leading
        assert standby.election is not None and standby.election.leader == leader.address
        async with Client("127.0.0.1", standby.port) as client:  # sent on to the leader
            job = await client.enqueue("tests.noop")
            assert (await client.get_job(job.job_id)) is not None
        both = f"127.0.0.1:{standby.port},127.0.0.1:{leader.port}"
        async with Client(both) as client:
            assert (await client.status())["main_id"] == leader.main_id
        await leader.stop()  # resigns: the standby takes over at its next round
        await until(lambda: standby.leading, timeout=10)
        assert standby.election is not None and standby.election.epoch == 2
        async with Client(both) as client:
            assert (await client.status())["main_id"] == standby.main_id
    finally:
        await leader.stop()
        await standby.stop()


async def test_a_main_just_elected_welcomes_no_worker_before_its_orphans_are_loaded(
    stores: list[SQLAlchemyAdapter],
) -> None:
    """Between winning the election and loading the handoffs in flight, a main would
    welcome a reconnecting worker with none of its leases adopted; the leases would go
    back to the queue at the orphans' deadline while the worker ran them (a soak of
    failovers caught it). It sends the worker away to try again instead, and adopts its
    leases once loaded."""
    leader = Main(stores[0], SETTINGS, retention=None)
    held = HeldOrphans(stores[1])
    standby = Main(cast(StorageAdapter, held), SETTINGS, retention=None)
    await leader.start()
    try:
        worker = FakeWorker(leader.port, worker_id="w1")
        await worker.connect()
        async with Client("127.0.0.1", leader.port) as client:
            await client.enqueue("tests.noop")
        await worker.ready(inline=1, pooled=1, forked=1)
        job = await worker.next_job()
        await standby.start()
        held.holding = True
        await worker.close()
        await leader.stop()
        await until(lambda: held.waiting)  # elected, and loading the orphans
        back = FakeWorker(standby.port, worker_id="w1")
        with pytest.raises(ConnectionRefusedError, match="just elected"):
            await back.connect(held=[lease_of(job)])
        await back.close()
        held.loaded.set()
        await until(lambda: standby.leading, timeout=10)
        welcome = await back.connect(held=[lease_of(job)])
        assert welcome.adopted == [lease_of(job)]
        await back.close()
    finally:
        await leader.stop()
        await standby.stop()


async def _get(http: aiohttp.ClientSession, site: Dashboard, path: str) -> tuple[int, str]:
    async with http.get(f"http://127.0.0.1:{site.port}{path}") as response:
        return response.status, await response.text()


async def test_healthz_metrics_and_status_say_leader_or_standby(
    stores: list[SQLAlchemyAdapter],
) -> None:
    """A standby's ``/metrics`` reports 0 workers by design: ``broker_main_leader 0``
    stands beside it (the documented alerts join on it), ``/healthz`` stays 200 and says
    ``standby``, and ``broker status`` (sent on to the leader) says who answered."""
    leader = Main(stores[0], SETTINGS, retention=None)
    standby = Main(stores[1], SETTINGS, retention=None)
    await leader.start()
    await standby.start()
    sites = [Dashboard(main, host="127.0.0.1", port=0) for main in (leader, standby)]
    for site in sites:
        await site.start()
    try:
        async with aiohttp.ClientSession() as http:
            assert await _get(http, sites[0], "/healthz") == (200, "ok leader\n")
            assert await _get(http, sites[1], "/healthz") == (200, "ok standby\n")
            _, on_leader = await _get(http, sites[0], "/metrics")
            _, on_standby = await _get(http, sites[1], "/metrics")
            assert "\nbroker_main_leader 1.0\n" in on_leader
            assert "\nbroker_main_leader 0.0\n" in on_standby
            assert "\nbroker_workers_connected 0.0\n" in on_standby
            async with Client("127.0.0.1", standby.port) as client:
                status = await client.status()
            assert (status["main_id"], status["role"]) == (leader.main_id, "leader")
            assert status["leader"] == leader.address
            await leader.stop()
            await until(lambda: standby.leading, timeout=10)
            assert await _get(http, sites[1], "/healthz") == (200, "ok leader\n")
            _, on_standby = await _get(http, sites[1], "/metrics")
            assert "\nbroker_main_leader 1.0\n" in on_standby
    finally:
        for site in sites:
            await site.stop()
        await leader.stop()
        await standby.stop()


async def test_a_main_just_elected_answers_from_connections_opened_before_it_leads(
    stores: list[SQLAlchemyAdapter],
) -> None:
    """A standby held one connection of its general pool (its start-up's); once elected,
    the leader's set-up took it (the notification connection keeps one for good) in the
    same moment as the first client request, which waited for a connection to open: up to
    2 s of a takeover on a loaded machine, after the election. Now the connections are
    opened while the main loads its orphans, so no request of the new leader opens one."""
    leader = Main(stores[0], SETTINGS, retention=None)
    standby = Main(stores[1], SETTINGS, retention=None)
    opened_leading: list[bool] = []

    def opened(*_: object) -> None:
        opened_leading.append(standby.leading)

    await leader.start()
    try:
        await standby.start()
        engine = stores[1]._dialect.engine.sync_engine
        sa.event.listen(engine, "connect", opened)
        await leader.stop()  # resigns: the standby takes over at its next round
        await until(lambda: standby.leading, timeout=10)
        pool = cast(QueuePool, engine.pool)
        assert pool.checkedin() + pool.checkedout() == DEFAULT_POOL_SIZE
        async with Client("127.0.0.1", standby.port) as client:
            status = await client.status()
            job = await client.enqueue("tests.noop")
            assert (await client.get_job(job.job_id)) is not None
        assert status["main_id"] == standby.main_id
        assert not any(opened_leading), "a request of the new leader opened a connection"
    finally:
        await leader.stop()
        await standby.stop()
