"""The client rides a failover: two mains on one PostgreSQL store, the leader stops, and a
client's wait (made again at the new leader, which reads the job once) and its reads
carry on; a job that ended while the client was between mains is not missed. A request
that is not safe to repeat (an enqueue without an idempotency key) is not repeated."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.exceptions import BrokerUnavailableError, ConnectionLostError
from broker.main.main import Main
from tests.conftest import drop_schema, fresh_schema_name, require_postgres
from tests.support import FAST, running_main, until

pytestmark = pytest.mark.postgres

SETTINGS = replace(FAST, failover_timeout=2.0)


@pytest.fixture
async def stores() -> AsyncIterator[list[SQLAlchemyAdapter]]:
    url = require_postgres()
    schema = fresh_schema_name()
    made = [SQLAlchemyAdapter(url, schema=schema) for _ in range(3)]
    try:
        yield made
    finally:
        await drop_schema(schema)


async def test_a_wait_rides_a_failover_and_misses_no_end(
    stores: list[SQLAlchemyAdapter],
) -> None:
    leader = Main(stores[0], SETTINGS, retention=None)
    standby = Main(stores[1], SETTINGS, retention=None)
    await leader.start()
    await standby.start()
    both = f"127.0.0.1:{leader.port},127.0.0.1:{standby.port}"
    try:
        async with Client(both, allow_unknown_tasks=True, retry_timeout=60) as client:
            job = await client.enqueue("tests.noop", idempotency_key="ride-1")
            waiting = asyncio.create_task(client.wait(job.job_id, timeout=120))
            await until(lambda: leader.waits.waiters.waited_on([job.job_id]))
            # Ended where the leader cannot see it (another process's write): no notice.
            await stores[2].cancel(job.job_id)
            await stores[2].close()
            assert not waiting.done()
            await leader.stop()  # the client's connection drops; the standby takes over
            ended = await asyncio.wait_for(waiting, 60)
            assert ended["status"] == "cancelled", "read once at the new leader"
            assert standby.leading
            # Reads and keyed enqueues carry on at the new leader.
            assert (await client.get_job(job.job_id)) is not None
            again = await client.enqueue("tests.noop", idempotency_key="ride-1")
            assert again.job_id == job.job_id and again.duplicate
    finally:
        await leader.stop()
        await standby.stop()


async def test_a_keyless_enqueue_is_not_repeated_when_the_connection_drops() -> None:
    async with running_main(MemoryAdapter()) as main:
        client = Client("127.0.0.1", main.port, allow_unknown_tasks=True, retry_timeout=60)
        await client.connect()
        enqueue = main.operations.enqueue
        arrived = asyncio.Event()

        async def stuck(*args: object, **kwargs: object) -> object:
            arrived.set()
            await asyncio.Event().wait()  # never answered: the connection drops first
            return await enqueue(*args, **kwargs)  # type: ignore[arg-type]

        main.operations.enqueue = stuck  # type: ignore[method-assign]
        sent = asyncio.create_task(client.enqueue("tests.noop"))
        await arrived.wait()
        for session in list(main.sessions.values()):
            session.abort()
        with pytest.raises(ConnectionLostError):
            await sent
        await client.close()


async def test_a_main_that_never_answers_raises_broker_unavailable() -> None:
    client = Client("127.0.0.1", 1, timeout=1, retry_timeout=0)
    with pytest.raises(BrokerUnavailableError, match=r"no main at 127\.0\.0\.1:1 welcomed"):
        await client.get_job(uuid.uuid4())
    with pytest.raises(ConnectionError):  # also what code written before it catches
        await client.connect()
