"""``task.enqueue(...)`` against a real main over real TCP: arguments are bound against the
task's signature before anything is sent (a wrong call raises ``TypeError`` and stores
nothing), options come from ``task.options(...)``, the default client from
``broker.configure``, and a main that stops answering raises a clear timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import broker
from adapters.memory import MemoryAdapter
from broker.client import sync as sync_module
from broker.client.client import Client
from broker.client.sync import SyncClient
from broker.exceptions import ConfigurationError, IdempotencyConflictError
from broker.storage import JobFilter
from broker.tasks import registry as tasks
from broker.tasks.registry import TaskRegistry, task
from broker.wire import codec
from broker.wire import messages as protocol
from tests.support import running_main

registry = TaskRegistry()


@task(name="app.send_email", queue="mail", retries=2, registry=registry)
async def send_email(to: str, subject: str = "", *, urgent: bool = False) -> None:
    pass


@pytest.fixture(autouse=True)
def _no_default_client() -> Iterator[None]:
    yield
    tasks.set_default_clients(None)


async def test_wrong_calls_raise_at_the_call_site_and_store_nothing() -> None:
    store = MemoryAdapter()
    async with running_main(store) as main, Client("127.0.0.1", main.port) as client:
        with pytest.raises(TypeError, match=r"app\.send_email.*too many positional"):
            await send_email.options(client=client).enqueue("a", "b", "c")  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="unexpected keyword argument 'sender'"):
            await send_email.options(client=client).enqueue("a", sender="x")  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="missing a required argument: 'to'"):
            await client.enqueue(send_email, [], {"subject": "s"})
        assert (await store.list_jobs(JobFilter())).jobs == []


async def test_options_and_the_task_defaults_reach_the_stored_job() -> None:
    store = MemoryAdapter()
    async with running_main(store) as main, Client("127.0.0.1", main.port) as client:
        plain = await send_email.options(client=client).enqueue("a@x", subject="hi")
        tuned = await send_email.options(
            client=client, queue="bulk", priority=5, delay=3600, idempotency_key="k1"
        ).enqueue("b@x", urgent=True)
        again = await send_email.options(
            client=client, queue="bulk", priority=5, delay=3600, idempotency_key="k1"
        ).enqueue("b@x", urgent=True)
        assert again.duplicate and again.job_id == tuned.job_id
        with pytest.raises(IdempotencyConflictError, match="different kwargs") as refused:
            await send_email.options(
                client=client, queue="bulk", priority=5, idempotency_key="k1"
            ).enqueue("b@x")
        assert refused.value.existing_id == tuned.job_id
        first = await store.get_job(plain.job_id)
        second = await store.get_job(tuned.job_id)
        assert first is not None and second is not None
        assert (first.queue, first.max_attempts, first.args, first.kwargs) == (
            "mail",
            3,
            ("a@x",),
            {"subject": "hi"},
        )
        assert (second.queue, second.priority, second.kwargs) == ("bulk", 5, {"urgent": True})
        assert second.run_at > first.run_at


async def test_configure_gives_tasks_a_default_client_and_without_it_the_error_says_so() -> None:
    with pytest.raises(ConfigurationError, match=r"broker.configure"):
        await send_email.enqueue("a@x")
    store = MemoryAdapter()
    async with running_main(store) as main:
        broker.configure("127.0.0.1", main.port)
        done = await send_email.enqueue("a@x", subject="async")
        sync = await asyncio.to_thread(send_email.enqueue_sync, "b@x", subject="sync")
        stored = [await store.get_job(e.job_id) for e in (done, sync)]
        assert [j.kwargs["subject"] for j in stored if j is not None] == ["async", "sync"]
        blocking = SyncClient("127.0.0.1", main.port)
        with blocking, pytest.raises(ConfigurationError, match="enqueue_sync"):
            await send_email.options(client=blocking).enqueue("c")
        defaults = tasks._defaults()
        assert isinstance(defaults, sync_module._ConfiguredClients)
        await defaults.async_client().close()
        await asyncio.to_thread(defaults.sync_client().close)


async def _greet(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_line_bytes: int
) -> None:
    """What a main says before any request: the challenge, then the welcome to the hello."""
    writer.write(codec.encode(protocol.Challenge("ab", protocol.PROTOCOL_VERSION, False)))
    await reader.readline()
    welcome = protocol.Welcome("m", protocol.PROTOCOL_VERSION, 5.0, [], max_line_bytes)
    writer.write(codec.encode(welcome))


async def test_a_main_that_stops_answering_raises_a_clear_timeout() -> None:
    hung_up = asyncio.Event()

    async def silent_main(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Greets and welcomes, then never answers a request (a stalled main)."""
        await _greet(reader, writer, 1 << 20)
        try:
            await reader.read()
        finally:
            writer.close()
            hung_up.set()

    server = await asyncio.start_server(silent_main, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, Client("127.0.0.1", port, timeout=0.2) as client:
        with pytest.raises(TimeoutError, match=r"did not answer a request .* within 0.2 s"):
            await send_email.options(client=client).enqueue("a@x")
    await hung_up.wait()


async def test_a_request_stuck_behind_a_main_that_stopped_reading_times_out() -> None:
    """A main that stops reading leaves the client's bytes unsent: the next request then
    waits for its turn to write, and that wait ends at the same deadline as the wait for
    an answer (neither request hangs)."""
    stop = asyncio.Event()

    async def deaf_main(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _greet(reader, writer, 64 << 20)
        await stop.wait()  # reads nothing more
        writer.close()

    server = await asyncio.start_server(deaf_main, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    big = "x" * (16 << 20)  # more than the kernel's socket buffers hold
    async with server, Client("127.0.0.1", port, timeout=0.3) as client:
        for _ in range(2):  # the first waits for an answer, the second for its turn
            with pytest.raises(TimeoutError, match=r"did not answer a request .* within 0.3 s"):
                await client.enqueue("app.big", [big], max_attempts=1)
        assert client._writer is not None
        assert client._writer._writer.transport.get_write_buffer_size() > 0  # still unsent
        stop.set()
