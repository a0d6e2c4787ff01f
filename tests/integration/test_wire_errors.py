"""Errors cross the wire as themselves: a real main over TCP, a real client.

A retry refused for a taken unique key arrives as ``UniqueKeyTakenError`` with the
holder's id, an oversized job as ``PayloadTooLargeError``, a wrong token as
``AuthenticationError`` (as the worker already had it), never as the broader class.
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from adapters.memory import MemoryAdapter
from broker.client.client import Client
from broker.exceptions import (
    AuthenticationError,
    BrokerUnavailableError,
    PayloadTooLargeError,
    UniqueKeyTakenError,
)
from broker.jobs import Claim, JobSpec, JobStatus
from tests.support import FAST, running_main


async def test_a_unique_key_conflict_arrives_with_its_holder() -> None:
    store = MemoryAdapter()
    [dead] = await store.enqueue_many([JobSpec(task="t", unique_key="acct", max_attempts=1)])
    lease = uuid.uuid4()
    await store.mark_handed_off_many([Claim(dead.job.id, lease, "w")])
    assert await store.fail(dead.job.id, lease, "broke", None)
    async with running_main(store) as main, Client("127.0.0.1", main.port) as client:
        holder = await client.enqueue("t", unique_key="acct")
        assert not holder.duplicate
        with pytest.raises(UniqueKeyTakenError) as raised:
            await client.retry(dead.job.id)
        assert raised.value.holder_id == holder.job_id
    job = await store.get_job(dead.job.id)
    assert job is not None and job.status is JobStatus.FAILED


async def test_an_oversized_job_arrives_as_payload_too_large() -> None:
    store = MemoryAdapter()
    settings = dataclasses.replace(FAST, max_payload_bytes=1000)
    async with running_main(store, settings) as main, Client("127.0.0.1", main.port) as client:
        with pytest.raises(PayloadTooLargeError, match="over the payload limit of 1000 bytes"):
            await client.enqueue("t", ["x" * 5000])
    assert (await store.list_jobs()).jobs == []


async def test_a_wrong_token_arrives_as_an_authentication_error() -> None:
    settings = dataclasses.replace(FAST, token="s3cret")
    async with running_main(MemoryAdapter(), settings) as main:
        client = Client("127.0.0.1", main.port, token="guess")
        with pytest.raises(AuthenticationError, match="wrong or missing token proof"):
            await client.connect()
        await client.close()
        async with Client("127.0.0.1", main.port, token="s3cret") as good:
            assert (await good.status())["main_id"] == main.main_id


async def test_a_connection_over_a_limit_is_refused_with_the_mains_reason() -> None:
    settings = dataclasses.replace(FAST, max_connections_per_address=1)
    async with running_main(MemoryAdapter(), settings) as main, Client("127.0.0.1", main.port):
        extra = Client("127.0.0.1", main.port, retry_timeout=0)
        with pytest.raises(
            BrokerUnavailableError,
            match=r": the main refused the connection: .*--max-connections-per-address",
        ):
            await extra.connect()
        await extra.close()
