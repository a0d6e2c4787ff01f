"""PgQueuer's factory (``pgq run bench.peers.pgqueuer_app:create``)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job

from bench import jobs
from bench.systems import database, postgres_dsn

DATABASE = database("bench_pgqueuer")
BATCH_SIZE = "BENCH_PGQ_BATCH_SIZE"
"""Environment variable: jobs each worker dequeues at once (default 10, as ``make bench``)."""
QUEUES = "BENCH_PGQ_QUEUES"
"""Environment variable: more names, comma-separated, each worker registers the no-op job
under (default none). PgQueuer routes by entrypoint name, so these are its queues:
``bench/scale.py``'s queues part spreads its jobs over them."""


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

    for name in filter(None, os.environ.get(QUEUES, "").split(",")):
        pgq.entrypoint(name)(noop)

    try:
        yield pgq
    finally:
        await connection.close()


if __name__ == "__main__":
    # What `pgq run bench.peers.pgqueuer_app:create --batch-size 10` does, through
    # pgqueuer.run: the 1.6.0 CLI fails at start-up with this machine's typer.
    import asyncio

    import pgqueuer

    asyncio.run(pgqueuer.run(create, batch_size=int(os.environ.get(BATCH_SIZE, "10"))))
