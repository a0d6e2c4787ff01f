"""Issue 30, findings 5 and 10, against real processes: one address cannot lock the others
out of the handshake (plain TCP and TLS); a careless token file or a short token beyond
loopback stops the main; failed authentications are logged with the peer, within a
rate; task code cannot read the worker's secrets; a planted state directory, a planted
``json.py`` and bidi controls do no harm; a TLS peer without a client certificate is
logged as such."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from adapters.sql import SQLAlchemyAdapter
from broker.client import Client
from broker.exceptions import AuthenticationError, BrokerError
from broker.jobs import JobSpec, JobStatus
from broker.protocol import Role
from tests.e2e.test_e2e import REPO, Proc, free_port
from tests.e2e.test_hardening import _env, _worker_process
from tests.e2e.test_tls_roles_e2e import SECRETS, TLSCluster
from tests.integration.test_operator import _closed_port, _run_cli
from tests.support import until

pytestmark = pytest.mark.slow

TOKEN = "a-token-long-enough-for-any-host"
ATTACKER = "127.0.0.2"
"""Another loopback address (Linux answers on all of 127.0.0.0/8): the idle sockets come
from it, the honest client from 127.0.0.1."""


async def _spawn(tmp_path: Path, name: str, argv: list[str], env: dict[str, str]) -> Proc:
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "broker.cli",
            *argv,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Proc(name, process, log)


@contextlib.asynccontextmanager
async def _main(tmp_path: Path, *extra: str, **env: str) -> AsyncIterator[tuple[Proc, int]]:
    """A real ``broker-main`` on SQLite, its token in its environment."""
    port = free_port()
    argv = ["main", "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}"]
    argv += ["--port", str(port), *extra]
    main = await _spawn(tmp_path, "main", argv, _env(BROKER_TOKEN=TOKEN, **env))
    try:
        await main.wait_for_output("broker-main listening on", timeout=60)
        yield main, port
    finally:
        await main.kill()


@contextlib.asynccontextmanager
async def _idle_sockets(port: int, count: int) -> AsyncIterator[None]:
    """``count`` sockets from :data:`ATTACKER` that never say hello (nor start TLS), each
    opened again as soon as the main closes it: the handshake slots they can take, they
    hold all the time."""

    async def hold() -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(ATTACKER, 0)
                )
            except OSError:
                await asyncio.sleep(0.05)
                continue
            try:
                await reader.read()  # until the main closes it
            except OSError:
                pass
            finally:
                writer.close()
            await asyncio.sleep(0.05)  # refused at once: no busy loop

    holders = [asyncio.create_task(hold()) for _ in range(count)]
    try:
        yield
    finally:
        for holder in holders:
            holder.cancel()
        await asyncio.gather(*holders, return_exceptions=True)


IDLE = 80
"""More idle sockets than the main's handshake slots (64), so the main refuses some of
them whatever its limits, and its log says when they are all taken."""


async def _handshake_slots_taken(main: Proc) -> None:
    """Wait until the main refuses the attacker's surplus: its slots are all taken."""
    await main.wait_for_output(f"connection refused peer={ATTACKER}", timeout=60)


# ------------------------------------------------------------------ finding 5


async def test_idle_sockets_from_one_address_leave_another_address_unaffected(
    tmp_path: Path,
) -> None:
    async with _main(tmp_path) as (main, port), _idle_sockets(port, IDLE):
        await _handshake_slots_taken(main)
        failures: list[BaseException] = []
        for _ in range(20):
            try:
                async with Client("127.0.0.1", port, token=TOKEN, timeout=10) as client:
                    await client.status()
            except BrokerError as exc:
                failures.append(exc)
        assert failures == [], f"{len(failures)} of 20 refused: {failures[0]!r}"
        assert "connection refused" in main.output()


async def test_idle_tls_sockets_from_one_address_leave_another_address_unaffected(
    tmp_path: Path,
) -> None:
    cluster = TLSCluster(tmp_path)
    try:
        main = await cluster.start_main()
        async with _idle_sockets(cluster.port, IDLE):
            await _handshake_slots_taken(main)
            for _ in range(20):
                async with cluster.client(Role.OPERATOR) as client:
                    assert await client.status()
    finally:
        await cluster.close()
