"""Unique jobs through every enqueue path: JobSpec, the protocol, Client, ``@task(unique=True)``,
``broker enqueue --unique-key``, and retrying a dead job whose key is taken.

The store-level semantics are in the conformance suite (``unique_key`` checks)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest

from adapters.memory import MemoryAdapter
from broker.client.client import Client
from broker.exceptions import InvalidJobError, UniqueKeyTakenError
from broker.jobs import MAX_UNIQUE_KEY_BYTES, JobSpec, JobStatus
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.ops import cli
from broker.tasks.registry import TaskRegistry, default_unique_key, task
from broker.wire import codec
from broker.wire import messages as protocol

NOW = datetime(2030, 1, 1, tzinfo=UTC)


@contextlib.asynccontextmanager
async def _main(store: MemoryAdapter) -> AsyncIterator[Main]:
    main = Main(store, MainSettings(port=0), retention=None)
    await main.start()
    try:
        yield main
    finally:
        await main.stop()


async def _finish(store: MemoryAdapter, job_id: uuid.UUID | str) -> None:
    lease = uuid.uuid4()
    claimed = await store.mark_handed_off(uuid.UUID(str(job_id)), lease, "w")
    assert claimed is not None
    assert await store.complete(claimed.id, lease)


def test_jobspec_validates_the_unique_key() -> None:
    assert JobSpec(task="t").unique_key is None
    assert JobSpec(task="t", unique_key="k").unique_key == "k"
    for bad in ("", "x" * (MAX_UNIQUE_KEY_BYTES + 1), "é" * 600):
        with pytest.raises(InvalidJobError, match="unique_key"):
            JobSpec(task="t", unique_key=bad)
    with pytest.raises(InvalidJobError, match="unique_key"):
        JobSpec(task="t", unique_key=5)  # type: ignore[arg-type]


def test_the_protocol_carries_the_unique_key_and_older_requests_lack_it() -> None:
    spec = JobSpec(task="t", args=[1], unique_key="acct:9")
    request = protocol.JobRequest.from_spec(spec)
    line = codec.encode(protocol.Enqueue(request_id="r1", jobs=[request]))
    decoded = codec.decode(line)
    assert isinstance(decoded, protocol.Enqueue)
    assert decoded.jobs[0].to_spec(NOW).unique_key == "acct:9"
    old = codec.decode(b'{"type":"enqueue","request_id":"r2","jobs":[{"task":"t"}]}')
    assert isinstance(old, protocol.Enqueue) and old.jobs[0].to_spec(NOW).unique_key is None
    with pytest.raises(codec.DecodeError, match="unique_key"):
        codec.decode(b'{"type":"enqueue","request_id":"r3","jobs":[{"task":"t","unique_key":1}]}')


async def test_client_enqueue_with_a_unique_key() -> None:
    store = MemoryAdapter()
    async with _main(store) as main, Client("127.0.0.1", main.port) as client:
        first = await client.enqueue("app.sync", [1], unique_key="sync:1")
        again = await client.enqueue("app.sync", [2], unique_key="sync:1")
        other = await client.enqueue("app.sync", [3], unique_key="sync:2")
        assert not first.duplicate and again.duplicate and again.job_id == first.job_id
        assert not other.duplicate
        shown = await client.get_job(first.job_id)
        assert shown is not None and shown["unique_key"] == "sync:1"
        await _finish(store, first.job_id)
        after = await client.enqueue("app.sync", [4], unique_key="sync:1")
        assert not after.duplicate and after.job_id != first.job_id


def test_task_unique_builds_the_documented_default_key() -> None:
    registry = TaskRegistry()

    @task(name="app.sync", unique=True, registry=registry)
    def sync(account_id: int, full: bool = False) -> None:
        pass

    spec = sync.spec([42], {"full": True})
    assert spec.unique_key == 'app.sync:{"args":[42],"kwargs":{"full":true}}'
    assert spec.unique_key == default_unique_key("app.sync", [42], {"full": True})
    assert sync.spec([42]).unique_key != spec.unique_key
    assert sync.spec([42], unique_key="mine").unique_key == "mine", "an explicit key wins"
    assert sync.spec(kwargs={"b": 1, "a": "é"}).unique_key == (
        'app.sync:{"args":[],"kwargs":{"a":"\\u00e9","b":1}}'
    ), "sorted keys, ASCII: the same arguments always give the same key"
    huge = sync.spec(["x" * 5000])
    assert huge.unique_key is not None and huge.unique_key.startswith("app.sync:sha256:")
    assert len(huge.unique_key) == len("app.sync:sha256:") + 64
    assert huge.unique_key == sync.spec(["x" * 5000]).unique_key

    @task(name="app.plain", registry=registry)
    def plain() -> None:
        pass

    assert plain.spec().unique_key is None


async def test_a_unique_task_through_the_client() -> None:
    registry = TaskRegistry()

    @task(name="app.report", unique=True, registry=registry)
    def report(day: str) -> None:
        pass

    store = MemoryAdapter()
    async with _main(store) as main, Client("127.0.0.1", main.port) as client:
        first = await client.enqueue(report, ["2030-01-01"])
        again = await client.enqueue(report, ["2030-01-01"])
        other_day = await client.enqueue(report, ["2030-01-02"])
        assert again.duplicate and again.job_id == first.job_id and not other_day.duplicate
    assert len((await store.list_jobs()).jobs) == 2


def _broker(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.broker_entry(argv)
    return code, out.getvalue()


async def test_broker_enqueue_unique_key() -> None:
    store = MemoryAdapter()
    async with _main(store) as main:
        address = ["--main", f"127.0.0.1:{main.port}"]
        argv = [*address, "enqueue", "app.sync", "[7]", "--unique-key", "sync:7", "--json"]
        code, out = await asyncio.to_thread(_broker, argv)
        assert code == 0
        first = json.loads(out)
        code, out = await asyncio.to_thread(_broker, argv)
        second = json.loads(out)
        assert first["duplicate"] is False
        assert second == {"job_id": first["job_id"], "duplicate": True}
    job = await store.get_job(uuid.UUID(first["job_id"]))
    assert job is not None and job.unique_key == "sync:7"
    parsed = cli.broker_parser().parse_args(["enqueue", "t", "--unique-key", "k"])
    assert parsed.unique_key == "k"


async def test_retrying_a_dead_job_whose_key_is_taken_is_refused_clearly() -> None:
    store = MemoryAdapter()
    [dead] = await store.enqueue_many([JobSpec(task="t", unique_key="acct", max_attempts=1)])
    lease = uuid.uuid4()
    assert await store.mark_handed_off(dead.job.id, lease, "w") is not None
    assert await store.fail(dead.job.id, lease, "boom", None)
    holder = (await store.enqueue(JobSpec(task="t", unique_key="acct"))).job
    with pytest.raises(UniqueKeyTakenError) as raised:
        await store.retry_dead(dead.job.id)
    assert raised.value.holder_id == holder.id
    assert isinstance(raised.value, InvalidJobError)
    assert str(holder.id) in str(raised.value) and "'acct'" in str(raised.value)
    async with _main(store) as main, Client("127.0.0.1", main.port) as client:
        with pytest.raises(InvalidJobError, match="cannot be retried"):
            await client.retry(dead.job.id)
        stored = await store.get_job(dead.job.id)
        assert stored is not None and stored.status is JobStatus.FAILED
        await _finish(store, holder.id)
        revived = await client.retry(dead.job.id)
        assert revived is not None and revived["status"] == "queued"
