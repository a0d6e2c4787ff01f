"""The task catalog and idempotency conflicts through a real main, a real (in-process)
worker and the Python client over TCP: a job by name takes the declared defaults, an
undeclared name is refused unless the client allows it, and a conflicting key fails its
caller alone inside a group commit."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from adapters.memory import MemoryAdapter
from broker.client.client import Client
from broker.exceptions import IdempotencyConflictError, UnknownTaskError
from broker.jobs import ExecutionMode
from broker.main.main import Main
from broker.tasks.registry import TaskRegistry, task
from broker.worker.worker import Worker
from runners.inline import InlineRunner
from tests.support import running_main, until

registry = TaskRegistry()


@task(name="app.settle", registry=registry, mode="inline", retries=0, queue="money", timeout=5)
async def settle(account: int) -> int:
    return account


@contextlib.asynccontextmanager
async def serving(store: MemoryAdapter) -> AsyncIterator[Main]:
    async with running_main(store) as main:
        worker = Worker(
            "127.0.0.1",
            main.port,
            worker_id="w-catalog",
            runners={ExecutionMode.INLINE: InlineRunner(registry, concurrency=2)},
            registry=registry,
        )
        running = asyncio.create_task(worker.run())
        try:
            await until(lambda: main.operations.catalog.declared("app.settle") is not None)
            yield main
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


async def test_a_client_by_name_gets_the_declared_defaults() -> None:
    store = MemoryAdapter()
    async with serving(store) as main, Client("127.0.0.1", main.port) as client:
        plain = await client.enqueue("app.settle", [7])
        given = await client.enqueue("app.settle", [8], queue="other", max_attempts=3)
        first, second = [await store.get_job(e.job_id) for e in (plain, given)]
        assert first is not None and second is not None
        assert (first.queue, first.max_attempts, first.timeout) == ("money", 1, 5)
        assert first.execution_mode is ExecutionMode.INLINE
        assert (second.queue, second.max_attempts, second.timeout) == ("other", 3, 5)
        listed = await client.list_tasks()
        assert [(t["task"], t["worker_id"]) for t in listed] == [("app.settle", "w-catalog")]


async def test_an_undeclared_name_is_refused_unless_the_client_allows_it() -> None:
    store = MemoryAdapter()
    async with serving(store) as main:
        async with Client("127.0.0.1", main.port) as client:
            with pytest.raises(UnknownTaskError, match=r"no worker has declared task 'app\.setle'"):
                await client.enqueue("app.setle", [1])
            assert await store.count_jobs() == []
        async with Client("127.0.0.1", main.port, allow_unknown_tasks=True) as cold:
            made = await cold.enqueue("app.later", [1])
            job = await store.get_job(made.job_id)
            assert job is not None and job.max_attempts == 11


async def test_a_conflicting_key_fails_its_caller_alone_in_a_group_commit() -> None:
    store = MemoryAdapter()
    async with serving(store) as main:
        clients = [Client("127.0.0.1", main.port) for _ in range(6)]
        await asyncio.gather(*(c.connect() for c in clients))
        try:
            first = await clients[0].enqueue("app.settle", [1], idempotency_key="k")
            outcomes = await asyncio.gather(
                *(
                    c.enqueue("app.settle", [2 if i == 3 else 1], idempotency_key="k")
                    if i in (2, 3)
                    else c.enqueue("app.settle", [100 + i])
                    for i, c in enumerate(clients)
                ),
                return_exceptions=True,
            )
        finally:
            await asyncio.gather(*(c.close() for c in clients))
    conflict = outcomes[3]
    assert isinstance(conflict, IdempotencyConflictError)
    assert conflict.existing_id == first.job_id
    repeat = outcomes[2]
    assert not isinstance(repeat, BaseException) and repeat.duplicate
    assert repeat.job_id == first.job_id
    others = [o for i, o in enumerate(outcomes) if i not in (2, 3)]
    assert all(not isinstance(o, BaseException) and not o.duplicate for o in others)


async def test_arguments_spread_out_are_refused_with_the_right_form_and_nothing_stored() -> None:
    """``client.enqueue(task, 7)`` or ``client.enqueue(task, "acme")`` (the arguments
    spread out, as ``task.enqueue`` takes them) is a clear ``TypeError`` naming the one-list
    form; a string is not read as a list of characters."""
    store = MemoryAdapter()
    async with serving(store) as main, Client("127.0.0.1", main.port) as client:
        for args in (7, "acme"):
            with pytest.raises(TypeError, match=r"as one list, e\.g\. client\.enqueue"):
                await client.enqueue(settle, args)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="as one list"):
                await client.enqueue("app.settle", args)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="as one mapping"):
            await client.enqueue(settle, [1], [("account", 1)])  # type: ignore[arg-type]
        assert (await store.list_jobs()).jobs == []
