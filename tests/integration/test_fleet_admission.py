"""A fleet that restarts at once gets in: 500 clients connecting in the same moment to
one main over real TCP all connect (the handshake's limits make them wait in line rather
than refuse them, and ``Client.connect`` retries with jittered backoff the few a loaded
machine makes wait past the handshake deadline)."""

from __future__ import annotations

import asyncio

from adapters.memory import MemoryAdapter
from broker.client.client import Client
from broker.main.settings import MainSettings
from tests.support import running_main

FLEET = 500


async def test_500_clients_connecting_at_once_all_get_in() -> None:
    # One address holds the whole fleet here, so its connection cap is raised; the
    # handshake limits (128 in all, 64 per address) keep their defaults and are what the
    # fleet meets.
    # The default timers (not the tests' short ones): 500 connections in one loaded
    # process may answer pings late, and liveness is not what this test is about.
    settings = MainSettings(port=0, max_connections_per_address=FLEET + 10)
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
            statuses = await asyncio.gather(*(client.status() for client in clients[:5]))
            assert all(s["main_id"] == main.main_id for s in statuses)
        finally:
            await asyncio.gather(*(client.close() for client in clients))
