"""Per-role credentials on a real main over real TCP, in both directions: each role gets
in with its own secret and only with it, and each connection may make only its role's
requests (a refused request leaves the connection, and every other one, working)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from adapters.memory import MemoryAdapter
from broker.client.client import Client
from broker.exceptions import AuthenticationError, ConfigurationError, PermissionDeniedError
from broker.jobs import JobStatus
from broker.main.main import Main
from broker.ops.web import Dashboard
from broker.wire import messages as protocol
from broker.wire.messages import Role
from tests.support import FAST, FakeWorker, running_main

SECRETS = {"worker": "w-secret", "client": "c-secret", "operator": "o-secret"}
SPLIT = replace(
    FAST,
    worker_token=SECRETS["worker"],
    client_token=SECRETS["client"],
    operator_token=SECRETS["operator"],
)


@asynccontextmanager
async def main_with(settings: object = SPLIT) -> AsyncIterator[Main]:
    async with running_main(MemoryAdapter(), settings) as main:  # type: ignore[arg-type]
        yield main


def _client(main: Main, role: Role, secret: str | None) -> Client:
    return Client("127.0.0.1", main.port, token=secret, role=role, timeout=5)


async def test_a_client_secret_enqueues_and_reads_but_cannot_cancel_retry_or_prune() -> None:
    async with main_with() as main, _client(main, Role.CLIENT, SECRETS["client"]) as client:
        job = await client.enqueue("t.task", queue="q")
        assert (await client.get_job(job.job_id)) is not None
        assert (await client.list_jobs()).jobs
        assert await client.status()
        with pytest.raises(PermissionDeniedError, match="'cancel' needs the operator role"):
            await client.cancel(job.job_id)
        with pytest.raises(PermissionDeniedError, match="'retry' needs the operator role"):
            await client.retry(job.job_id)
        with pytest.raises(PermissionDeniedError, match="'prune' needs the operator role"):
            await client.prune(older_than=0)
        stored = await main.store.get_job(job.job_id)
        assert stored is not None and stored.status is JobStatus.QUEUED
        # The connection stays open and useful after the refusals.
        assert (await client.get_job(job.job_id)) is not None


async def test_the_operator_secret_cancels() -> None:
    async with main_with() as main:
        async with _client(main, Role.CLIENT, SECRETS["client"]) as client:
            job = await client.enqueue("t.task")
        async with _client(main, Role.OPERATOR, SECRETS["operator"]) as operator:
            cancelled = await operator.cancel(job.job_id)
        assert cancelled is not None and cancelled["status"] == "cancelled"


@pytest.mark.parametrize(
    ("role", "secret"),
    [
        (Role.OPERATOR, SECRETS["client"]),  # a client's secret cannot act as an operator
        (Role.OPERATOR, SECRETS["worker"]),  # nor a worker's
        (Role.CLIENT, SECRETS["worker"]),  # a worker's cannot even enqueue
    ],
)
async def test_a_secret_of_another_role_is_refused_at_hello(role: Role, secret: str | None) -> None:
    async with main_with() as main:
        with pytest.raises(AuthenticationError, match=f"for the {role} role"):
            async with _client(main, role, secret):
                pass


async def test_a_client_without_a_secret_does_not_say_hello_to_a_main_that_requires_one() -> None:
    """As the worker: a hello without a proof would only be refused (wire.handshake)."""
    async with main_with() as main:
        with pytest.raises(ConfigurationError, match="set the client secret of the main"):
            async with _client(main, Role.CLIENT, None):
                pass


async def test_a_client_secret_cannot_say_hello_as_a_worker() -> None:
    async with main_with() as main:
        intruder = FakeWorker(main.port, token=SECRETS["client"])
        try:
            with pytest.raises(ConnectionRefusedError, match="for the worker role"):
                await intruder.connect()
        finally:
            await intruder.close()
        assert not main.handoff.peers, "no worker joined"
        worker = FakeWorker(main.port, worker_id="real", token=SECRETS["worker"])
        await worker.connect()
        await worker.close()


async def test_a_worker_connection_cannot_cancel() -> None:
    async with main_with() as main:
        async with _client(main, Role.CLIENT, SECRETS["client"]) as client:
            job = await client.enqueue("t.task")
        worker = _ListeningWorker(main.port, token=SECRETS["worker"])
        await worker.connect()
        try:
            await worker.send(protocol.Cancel(request_id="r1", job_id=job.job_id))
            denied = await asyncio.wait_for(worker.replies.get(), 5)
            assert isinstance(denied, protocol.RequestError)
            assert denied.code == protocol.ErrorCode.PERMISSION_DENIED
            assert "said hello as worker" in denied.message
            assert worker.connected
            stored = await main.store.get_job(job.job_id)
            assert stored is not None and stored.status is JobStatus.QUEUED
        finally:
            await worker.close()


class _ListeningWorker(FakeWorker):
    """A fake worker that also keeps the request errors it is sent."""

    def __init__(self, port: int, token: str) -> None:
        super().__init__(port, token=token)
        self.replies: asyncio.Queue[protocol.Message] = asyncio.Queue()

    async def _handle(self, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.RequestError):
            self.replies.put_nowait(msg)
        await super()._handle(msg)


async def test_a_role_without_a_secret_is_closed() -> None:
    settings = replace(FAST, worker_token="w", client_token="c")
    async with main_with(settings) as main:
        with pytest.raises(AuthenticationError, match="accepts no operator connections"):
            async with _client(main, Role.OPERATOR, "anything"):
                pass
        async with _client(main, Role.CLIENT, "c") as client:
            await client.status()


async def test_the_shared_token_still_grants_every_right() -> None:
    async with (
        main_with(replace(FAST, token="shared")) as main,
        _client(main, Role.CLIENT, "shared") as client,
    ):
        job = await client.enqueue("t.task")
        assert await client.cancel(job.job_id) is not None


async def test_dashboard_actions_need_the_operator_secret(tmp_path: Path) -> None:
    async with main_with() as main:
        site = Dashboard(main, host="127.0.0.1", port=0)
        await site.start()
        try:
            async with _client(main, Role.CLIENT, SECRETS["client"]) as client:
                job = await client.enqueue("t.task")
            cancel = f"http://127.0.0.1:{site.port}/jobs/{job.job_id}/cancel"
            async with aiohttp.ClientSession() as http:
                for secret in (SECRETS["client"], SECRETS["worker"]):
                    headers = {"Authorization": f"Bearer {secret}"}
                    async with http.post(cancel, headers=headers, allow_redirects=False) as r:
                        assert r.status == 403
                headers = {"Authorization": f"Bearer {SECRETS['operator']}"}
                async with http.post(cancel, headers=headers, allow_redirects=False) as r:
                    assert r.status == 303
            stored = await main.store.get_job(uuid.UUID(str(job.job_id)))
            assert stored is not None and stored.status is JobStatus.CANCELLED
        finally:
            await site.stop()
