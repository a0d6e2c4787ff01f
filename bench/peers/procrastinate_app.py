"""Procrastinate's app and tasks (``procrastinate --app bench.peers.procrastinate_app.app``)."""

from __future__ import annotations

import procrastinate

from bench import jobs
from bench.systems import database, postgres_dsn

DATABASE = database("bench_procrastinate")

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=postgres_dsn(DATABASE)))


@app.task(name="noop")
async def noop(tag: int = -1) -> None:
    jobs.noop(tag)


@app.task(name="cpu")
async def cpu(rounds: int) -> int:
    return jobs.cpu(rounds)
