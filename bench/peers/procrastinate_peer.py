"""Procrastinate: two workers of concurrency 10, PostgreSQL (LISTEN/NOTIFY plus polling).

Completion is the job row leaving ``todo``/``doing`` (for ``succeeded``: no job fails
here); its time, the ``succeeded`` row in ``procrastinate_events``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import psycopg

from bench.harness import Driver
from bench.peers.procrastinate_app import DATABASE, app, cpu, noop
from bench.systems import POSTGRES_ADMIN_DB, postgres_dsn

TASKS = {"noop": noop, "cpu": cpu}


class ProcrastinateDriver(Driver):
    label = "Procrastinate (2 x concurrency 10, PostgreSQL)"
    setup_text = "2 x `procrastinate worker --concurrency 10`, async tasks, defaults otherwise"
    durability = "PostgreSQL, fsync and synchronous_commit on"
    packages = ("procrastinate", "psycopg", "psycopg-binary")
    bulk_text = "batch_defer_async, all jobs in one call"
    server = "postgres"

    def setup(self) -> None:
        with psycopg.connect(postgres_dsn(POSTGRES_ADMIN_DB), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
            admin.execute(f"CREATE DATABASE {DATABASE}")
        self.loop = asyncio.new_event_loop()
        self.run(app.open_async())
        self.run(app.schema_manager.apply_schema_async())
        self.db = psycopg.connect(postgres_dsn(DATABASE), autocommit=True)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def reset(self) -> None:
        self.db.execute(
            "TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_periodic_defers, "
            "procrastinate_workers RESTART IDENTITY CASCADE"
        )
        self.enqueued = 0

    def enqueue_one(self, kind: str, arg: int) -> Any:
        key = "tag" if kind == "noop" else "rounds"
        job_id = self.run(TASKS[kind].defer_async(**{key: arg}))
        self.enqueued += 1
        return job_id

    def enqueue_bulk(self, kind: str, args: list[int]) -> None:
        key = "tag" if kind == "noop" else "rounds"
        self.run(TASKS[kind].batch_defer_async(*({key: a} for a in args)))
        self.enqueued += len(args)

    def done_count(self) -> int:
        # Jobs no longer todo or doing (none fail here); this predicate is a partial
        # index of Procrastinate's, so the poll stays cheap.
        row = self.db.execute(
            "SELECT count(*) FROM procrastinate_jobs WHERE status = ANY("
            "ARRAY['todo', 'doing']::procrastinate_job_status[])"
        ).fetchone()
        return self.enqueued - (int(row[0]) if row else 0)

    def completion_times(self, handles: list[Any]) -> list[float | None] | None:
        rows = self.db.execute(
            "SELECT job_id, extract(epoch FROM at) FROM procrastinate_events "
            "WHERE type = 'succeeded' AND job_id = ANY(%s)",
            (list(handles),),
        ).fetchall()
        at = {job_id: float(t) for job_id, t in rows}
        return [at.get(h) for h in handles]

    def worker_commands(self) -> list[list[str]]:
        command = [
            sys.executable,
            "-m",
            "procrastinate",
            "--app",
            "bench.peers.procrastinate_app.app",
            "worker",
            "--concurrency",
            "10",
        ]
        return [command, command]

    def teardown(self) -> None:
        self.db.close()
        self.run(app.close_async())
        self.loop.close()
        with psycopg.connect(postgres_dsn(POSTGRES_ADMIN_DB), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")


DRIVERS = {"procrastinate": ProcrastinateDriver}
