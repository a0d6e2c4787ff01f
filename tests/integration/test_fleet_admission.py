"""A fleet that restarts at once gets in: 500 clients connecting in the same moment to
one main over real TCP all connect (the handshake's limits make them wait in line rather
than refuse them, and ``Client.connect`` retries with jittered backoff what is refused)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from adapters.memory import MemoryAdapter
from broker.client.client import Client
from tests.support import FAST, running_main

FLEET = 500


async def test_500_clients_connecting_at_once_all_get_in(caplog: pytest.LogCaptureFixture) -> None:
    # One address holds the whole fleet here, so its connection cap is raised; the
    # handshake limits (128 in all, 64 per address) keep their defaults and are what the
    # fleet meets.
    settings = dataclasses.replace(
        FAST, max_connections_per_address=FLEET + 10, handshake_timeout=2.0
    )
    async with running_main(MemoryAdapter(), settings) as main:
        clients = [
            Client("127.0.0.1", main.port, timeout=30.0, retry_timeout=60.0) for _ in range(FLEET)
        ]
        try:
            admission = main.connections.admission
            enter = admission.enter
            lined_up: list[bool] = []

            def counted(address: str, ticket: asyncio.Future[None]) -> bool:
                lined_up.append(not (admitted := enter(address, ticket)))
                return admitted

            admission.enter = counted  # type: ignore[method-assign]
            await asyncio.gather(*(client.connect() for client in clients))
            assert len(main.sessions) == FLEET
            assert any(lined_up), "the fleet met the handshake limits (it waited in line)"
            assert "connection refused" not in caplog.text, "none was refused"
            statuses = await asyncio.gather(*(client.status() for client in clients[:5]))
            assert all(s["main_id"] == main.main_id for s in statuses)
        finally:
            await asyncio.gather(*(client.close() for client in clients))
