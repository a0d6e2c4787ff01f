"""SyncClient against a real main over real TCP: every call blocks the calling thread
until the main answers, errors arrive as the client's exceptions, and closing it closes
the connection and stops its event-loop thread."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

from adapters.memory import MemoryAdapter
from broker.client.sync import SyncClient
from broker.exceptions import BrokerError, InvalidJobError
from broker.jobs import JobSpec
from tests.support import running_main


async def test_each_call_answers_from_the_main() -> None:
    async with running_main(MemoryAdapter()) as main:

        def talk() -> None:
            with SyncClient("127.0.0.1", main.port) as client:
                first = client.enqueue("app.send", [1], {"to": "a"}, queue="mail")
                again = client.enqueue("app.send", [1], idempotency_key="k")
                same = client.enqueue("app.send", [1], idempotency_key="k")
                assert not first.duplicate and same.duplicate and same.job_id == again.job_id
                job = client.get_job(first.job_id)
                assert job is not None
                assert (job["task"], job["queue"], job["status"]) == ("app.send", "mail", "queued")
                many = client.enqueue_many([JobSpec(task="app.bulk", args=(n,)) for n in range(3)])
                assert len({e.job_id for e in many}) == 3
                page = client.list_jobs(tasks=["app.bulk"])
                assert {j["id"] for j in page.jobs} == {str(e.job_id) for e in many}
                each = client.enqueue_each("app.each", [[1], [2]], [{}, {"k": 3}], priority=2)
                jobs = [client.get_job(job_id) for job_id in each]
                assert [(j["args"], j["kwargs"], j["priority"]) for j in jobs if j] == [
                    ([1], {}, 2),
                    ([2], {"k": 3}, 2),
                ]
                cancelled = client.cancel(first.job_id)
                assert cancelled is not None and cancelled["status"] == "cancelled"
                assert client.wait(first.job_id)["status"] == "cancelled"
                assert client.get_job(uuid.uuid4()) is None
                assert client.status()["main_id"] == main.main_id

        await asyncio.to_thread(talk)


async def test_errors_reach_the_calling_thread_and_the_client_goes_on() -> None:
    async with running_main(MemoryAdapter()) as main:

        def talk() -> None:
            with SyncClient("127.0.0.1", main.port) as client:
                # Raised on the loop's thread, re-raised on this one as the same type.
                with pytest.raises(InvalidJobError, match="control"):
                    client.enqueue("app\nsend")
                with pytest.raises(BrokerError, match="does not exist"):
                    client.wait(uuid.uuid4(), timeout=5)
                assert client.get_job(client.enqueue("app.send").job_id) is not None

        await asyncio.to_thread(talk)


async def test_close_stops_the_loop_thread_and_later_calls_say_so() -> None:
    async with running_main(MemoryAdapter()) as main:

        def talk() -> None:
            before = set(threading.enumerate())
            client = SyncClient("127.0.0.1", main.port)
            client.status()
            assert len(set(threading.enumerate()) - before) == 1  # the loop's thread
            client.close()
            client.close()  # a second close is harmless
            assert set(threading.enumerate()) - before == set()
            with pytest.raises(RuntimeError, match="this SyncClient is closed"):
                client.status()

        await asyncio.to_thread(talk)
