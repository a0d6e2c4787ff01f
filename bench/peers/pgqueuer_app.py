"""PgQueuer's factory (``pgq run bench.peers.pgqueuer_app:create``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job

from bench import jobs
from bench.systems import database, postgres_dsn

DATABASE = database("bench_pgqueuer")


@asynccontextmanager
async def create() -> AsyncIterator[PgQueuer]:
    connection = await asyncpg.connect(postgres_dsn(DATABASE))
    pgq = PgQueuer(AsyncpgDriver(connection))

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        jobs.noop(int(job.payload or b"-1"))

    @pgq.entrypoint("cpu")
    async def cpu(job: Job) -> None:
        jobs.cpu(int(job.payload or b"1"))

    try:
        yield pgq
    finally:
        await connection.close()


if __name__ == "__main__":
    # What `pgq run bench.peers.pgqueuer_app:create --batch-size 10` does, through
    # pgqueuer.run: the 1.6.0 CLI fails at start-up with this machine's typer.
    import asyncio

    import pgqueuer

    asyncio.run(pgqueuer.run(create, batch_size=10))
