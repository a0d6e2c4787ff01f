"""PgQueuer: two ``pgq run`` processes with batch size 10, PostgreSQL, asyncpg.

A finished job is deleted from the queue table and logged as ``successful`` in
``pgqueuer_log``, whose ``created`` is the completion time.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from pgqueuer.db import AsyncpgDriver
from pgqueuer.queries import Queries

from bench.harness import BenchError, Driver
from bench.peers.pgqueuer_app import BATCH_SIZE, DATABASE, QUEUES
from bench.systems import drop_database, fresh_database, on_admin_database, postgres_dsn

PRODUCER_POOL = 30
"""Connections the producers share: PostgreSQL here allows 100 in all, for everyone."""


class PgQueuerDriver(Driver):
    label = "PgQueuer (2 x batch 10, PostgreSQL, asyncpg)"
    setup_text = (
        "2 x pgqueuer.run(factory, batch_size=10) (what `pgq run --batch-size 10` does; the "
        "CLI itself fails with the typer installed alongside), durable tables"
    )
    durability = "PostgreSQL, fsync and synchronous_commit on; tables LOGGED (durable)"
    packages = ("pgqueuer", "asyncpg")
    bulk_text = "Queries.enqueue with lists, all jobs in one call"
    server = "postgres"
    producer_pool: Any = None
    producer_users = 0
    processes = 2
    batch_size = 10
    queues: tuple[str, ...] = ()
    """More names each process registers the no-op job under (``bench.peers.pgqueuer_app``):
    ``bench/scale.py`` sets them, the processes and their batch size for its queues and
    fleet parts; the label above is these defaults'."""
    outstanding = "SELECT count(*) FROM pgqueuer"
    """The read behind :meth:`done_count` (a finished job's row is deleted), which
    ``bench/scale.py`` narrows to the measured jobs when a backlog lies beside them."""

    def setup(self) -> None:
        self.loop = asyncio.new_event_loop()

        self.run(on_admin_database(*fresh_database(DATABASE)))
        install = subprocess.run(
            [sys.executable, "-m", "pgqueuer", "--pg-dsn", postgres_dsn(DATABASE), "install"],
            capture_output=True,
            text=True,
        )
        if install.returncode != 0:
            raise BenchError(f"pgq install failed: {install.stderr[-500:]}")
        self.conn = self.run(asyncpg.connect(postgres_dsn(DATABASE)))
        self.queries = Queries(AsyncpgDriver(self.conn))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def reset(self) -> None:
        self.run(self.conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics"))
        self.enqueued = 0

    def enqueue_one(self, kind: str, arg: int) -> Any:
        ids = self.run(self.queries.enqueue(kind, str(arg).encode()))
        self.enqueued += 1
        return int(ids[0])

    def enqueue_urgent(self, kind: str, arg: int, priority: int) -> Any:
        ids = self.run(self.queries.enqueue(kind, str(arg).encode(), priority))
        self.enqueued += 1
        return int(ids[0])

    def analyze(self) -> None:
        self.run(self.conn.execute("VACUUM ANALYZE pgqueuer"))

    def enqueue_bulk(self, kind: str, args: list[int]) -> None:
        payloads: list[bytes | None] = [str(a).encode() for a in args]
        self.run(self.queries.enqueue([kind] * len(args), payloads, [0] * len(args)))
        self.enqueued += len(args)

    def done_count(self) -> int:
        return self.enqueued - int(self.run(self.conn.fetchval(self.outstanding)))

    def completion_times(self, handles: list[Any]) -> list[float | None] | None:
        rows = self.run(
            self.conn.fetch(
                "SELECT job_id, extract(epoch FROM created)::float8 AS at FROM pgqueuer_log "
                "WHERE status = 'successful' AND job_id = ANY($1::bigint[])",
                list(handles),
            )
        )
        at = {int(r["job_id"]): float(r["at"]) for r in rows}
        return [at.get(h) for h in handles]

    producer_text = (
        f"Queries.enqueue of one job at a time; the producers share an asyncpg pool of "
        f"{PRODUCER_POOL} connections (200 would pass this server's max_connections of 100)"
    )

    async def open_producer(self) -> tuple[Callable[[], Awaitable[Any]], Callable[[], Any]]:
        if self.producer_pool is None:  # the first producer makes the pool the rest share
            self.producer_pool = asyncio.ensure_future(
                asyncpg.create_pool(
                    postgres_dsn(DATABASE), min_size=PRODUCER_POOL, max_size=PRODUCER_POOL
                )
            )
        pool_future = self.producer_pool
        queries = Queries.from_asyncpg_pool(await pool_future)
        self.producer_users += 1

        async def enqueue() -> None:
            await queries.enqueue("noop", b"-1")

        async def close() -> None:
            # The last producer to close takes the shared pool with it.
            self.producer_users -= 1
            if self.producer_users == 0:
                self.producer_pool = None
                await (await pool_future).close()

        return enqueue, close

    def worker_commands(self) -> list[list[str]]:
        return [[sys.executable, "-m", "bench.peers.pgqueuer_app"]] * self.processes

    def worker_env(self) -> dict[str, str]:
        return {BATCH_SIZE: str(self.batch_size), QUEUES: ",".join(self.queues)}

    def teardown(self) -> None:
        self.run(self.conn.close())
        self.run(on_admin_database(drop_database(DATABASE)))
        self.loop.close()


DRIVERS = {"pgqueuer": PgQueuerDriver}
