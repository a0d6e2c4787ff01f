"""The broker: ``broker-main`` on SQLite or PostgreSQL and ``broker-worker`` processes.

Runs in the broker's own ``.venv``. A fresh store and a fresh main for every run:
a new SQLite file, or a PostgreSQL database dropped and created again.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import ROOT, BenchError, Config, Driver, Workers
from bench.systems import (
    database,
    drop_database,
    fresh_database,
    on_admin_database,
    postgres_dsn,
)

TASKS = "bench.peers.broker_app"
DATABASE = database("bench_broker")
CHUNK = 250
"""Jobs per enqueue request: one round trip and one transaction each."""
IN_FLIGHT = 3
"""Enqueue requests under way at once in a bulk enqueue (``Client.enqueue_batches``, and
``Client.enqueue_each`` for a backlog over :data:`EACH` jobs)."""
EACH = 10_000
"""The most jobs of one ``Client.enqueue_each`` request in a bulk enqueue: a backlog of
100,000 (``bench/urgent.py``) is over the main's container bound (25,000, one per
argument set) in one request."""
OUTSTANDING = (
    "SELECT (SELECT count(*) FROM broker_jobs WHERE status = 'queued')"
    " + (SELECT count(*) FROM broker_jobs WHERE status = 'handed_off')"
)
COMPLETED = "SELECT args, updated_us FROM broker_jobs WHERE status = 'completed'"


MAIN_FLAGS: tuple[str, ...] = ("--log-level", "WARNING", "--max-connections-per-address", "256")
"""``broker-main``'s flags beyond the store URL and port, for every row. The producers
workload opens 200 client connections from 127.0.0.1, over the default of 64 per address."""

POOLED = ("--pooled-runner-count", "2", "--pooled-runner-concurrency", "10")
"""Two warm children, up to 10 jobs each at once: what every pooled row states."""
ONLY_POOLED = ("--inline-concurrency", "0", "--forked-concurrency", "0", *POOLED)
ONLY_INLINE = ("--pooled-runner-count", "0", "--forked-concurrency", "0")


@dataclass(frozen=True)
class Setup:
    """One broker row of the report: the processes it runs and the words that name them.

    The worker flags of every row live here, in one place, so a new worker flag (a
    prefetch window, a pool size) is tried by editing one tuple.
    """

    postgres: bool
    mode: str
    """The jobs' execution mode: ``pooled`` or ``inline``."""
    workers: int
    """``broker-worker`` processes."""
    flags: tuple[str, ...]
    """Each worker's flags beyond ``--main``, ``--app`` and ``--log-level``."""
    shape: str
    """The label's words after the store's name."""
    setup_text: str
    """The workers, for the report's settings table (the main's flags are added)."""


def _setups(postgres: bool) -> dict[str, Setup]:
    store = "postgres" if postgres else "sqlite"
    pooled_text = (
        "1 broker-worker " + " ".join(ONLY_POOLED) + " (two warm child "
        "processes, up to 10 jobs each at once, as docs/howto/execution-modes.md suggests "
        "for I/O-bound or async jobs and as PgQueuer and Procrastinate are run at 10; no "
        "inline or forked slots; other flags at their defaults)"
    )
    out = {
        f"broker-{store}": Setup(
            postgres, "pooled", 1, ONLY_POOLED, "1 worker x 2 pooled children x 10", pooled_text
        ),
        f"broker-{store}-inline": Setup(
            postgres,
            "inline",
            2,
            ("--inline-concurrency", "10", *ONLY_INLINE),
            "2 workers x inline 10",
            "2 broker-worker processes, --inline-concurrency 10, jobs run on "
            "each worker's event loop (async no-op) or a thread (sync CPU job)",
        ),
    }
    if postgres:
        out["broker-postgres-inline1"] = Setup(
            postgres,
            "inline",
            1,
            ("--inline-concurrency", "20", *ONLY_INLINE),
            "1 worker x inline 20",
            "1 broker-worker --inline-concurrency 20 (the same 20 slots as the "
            "other rows, all on one event loop), no pooled or forked slots, other flags at "
            "their defaults",
        )
        out["broker-postgres-defaults"] = Setup(
            postgres,
            "pooled",
            1,
            POOLED,
            "pooled, default flags",
            "1 broker-worker " + " ".join(POOLED) + ": every other flag at its "
            "default (prefetch, memory and age recycling, inline and forked slots "
            "included), as issue 10 "
            "measures its targets",
        )
    return out


SETUPS: dict[str, Setup] = {**_setups(False), **_setups(True)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main_on_fresh_database(name: str, log: Path) -> tuple[Workers, int, str]:
    """A real ``broker-main`` (:data:`MAIN_FLAGS`) on a fresh PostgreSQL database ``name``,
    started, logging to ``log``: the process, its port and its store URL (the benchmarks
    that need one main of their own, such as :mod:`bench.fan_in` and :mod:`bench.push_wait`).
    """
    await on_admin_database(*fresh_database(name))
    port = free_port()
    url = postgres_dsn(name).replace("postgresql://", "postgresql+asyncpg://")
    main_bin = str(Path(sys.executable).parent / "broker-main")
    command = [main_bin, "--database-url", url, "--port", str(port), *MAIN_FLAGS]
    return Workers([command], {}, log, what="broker-main"), port, url


class BrokerDriver(Driver):
    packages = ("broker", "SQLAlchemy", "aiosqlite", "asyncpg")
    bulk_text = (
        "Client.enqueue_each: the task and its options once and a list of argument sets, "
        "one request stored all or none"
    )

    def __init__(self, name: str, cfg: Config) -> None:
        super().__init__(name, cfg)
        self.row = SETUPS[name]
        self.postgres = self.row.postgres
        self.loop = asyncio.new_event_loop()
        self.client: Any = None
        self.main: Workers | None = None
        self.port = 0
        self.url = ""
        self.sqlite: sqlite3.Connection | None = None
        self.pg: Any = None
        self.has_direct = self.postgres
        self.outstanding = OUTSTANDING
        """The read behind :meth:`done_count`: the jobs not yet complete, which
        ``bench/scale.py`` narrows to the measured ones when a backlog lies beside them."""
        self.direct: Any = None
        """The producer's own asyncpg connection, for :meth:`enqueue_one_direct`."""
        self.runs = 0
        store = "PostgreSQL" if self.postgres else "SQLite"
        self.label = f"broker ({store}, {self.row.shape})"
        self.setup_text = f"broker-main {' '.join(MAIN_FLAGS)} + {self.row.setup_text}"
        self.mode = self.row.mode
        # The producers workload runs on the PostgreSQL rows only, which issue 10's targets
        # are about; on all five rows it would take make bench past 15 minutes.
        self.producer_text = self.PRODUCER_TEXT if self.postgres else ""
        self.server = "postgres" if self.postgres else ""
        self.durability = (
            "PostgreSQL, fsync and synchronous_commit on: every enqueue, claim and completion "
            "committed"
            if self.postgres
            else "SQLite WAL, synchronous=FULL: every enqueue, claim and completion committed"
        )

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def setup(self) -> None:
        if self.postgres:
            self.run(on_admin_database())  # the server answers before anything starts

    def _stop_main(self) -> None:
        if self.client is not None:
            self.run(self.client.close())
            self.client = None
        if self.sqlite is not None:
            self.sqlite.close()
            self.sqlite = None
        if self.pg is not None:
            self.run(self.pg.close())
            self.pg = None
        if self.direct is not None:
            self.run(self.direct.close())
            self.direct = None
        if self.main is not None:
            self.main.stop(grace=10)
            self.main = None

    def _fresh_store(self) -> None:
        self.runs += 1
        if not self.postgres:
            path = self.workdir / f"{self.name}-{self.runs}.db"
            self.url = f"sqlite+aiosqlite:///{path}"
            return
        self.run(on_admin_database(*fresh_database(DATABASE)))
        self.url = postgres_dsn(DATABASE).replace("postgresql://", "postgresql+asyncpg://")

    def reset(self) -> None:
        from broker.client.client import Client

        self._stop_main()
        self._fresh_store()
        self.port = free_port()
        bin_dir = Path(sys.executable).parent
        command = [
            str(bin_dir / "broker-main"),
            "--database-url",
            self.url,
            "--port",
            str(self.port),
            *MAIN_FLAGS,
        ]
        self.main = Workers(
            [command], {}, self.workdir / f"{self.name}-main.log", what="broker-main"
        )
        deadline = time.monotonic() + 30
        while True:
            self.main.check()
            try:
                client = Client("127.0.0.1", self.port, timeout=60)
                self.run(client.connect())
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise BenchError(f"broker-main did not listen: {self.main.tail()}") from None
                time.sleep(0.05)
        self.client = client
        self._open_reader()
        self.enqueued = 0

    def _open_reader(self) -> None:
        if self.postgres:
            import asyncpg

            self.pg = self.run(asyncpg.connect(postgres_dsn(DATABASE)))
        else:
            path = self.url.split("///", 1)[1]
            self.sqlite = sqlite3.connect(f"file:{path}?mode=ro", uri=True)

    def _query(self, sql: str) -> list[Any]:
        if self.pg is not None:
            return [tuple(r) for r in self.run(self.pg.fetch(sql))]
        assert self.sqlite is not None
        return self.sqlite.execute(sql).fetchall()

    def enqueue_one(self, kind: str, arg: int) -> Any:
        self.run(
            self.client.enqueue(f"{TASKS}.{kind}", [arg], max_attempts=1, execution_mode=self.mode)
        )
        self.enqueued += 1
        return arg

    def enqueue_urgent(self, kind: str, arg: int, priority: int) -> Any:
        self.run(
            self.client.enqueue(
                f"{TASKS}.{kind}",
                [arg],
                max_attempts=1,
                execution_mode=self.mode,
                priority=priority,
            )
        )
        self.enqueued += 1
        return arg

    def handed_off_times(self, priority: int) -> dict[int, float]:
        """Epoch seconds at which each job of ``priority`` was claimed for a worker, by its
        tag (its argument): where an urgent job's wait splits into the main's and the
        worker's (``bench/urgent.py``)."""
        rows = self._query(
            f"SELECT args, handed_off_us FROM broker_jobs WHERE priority = {int(priority)}"
        )
        return {json.loads(args)[0]: us / 1e6 for args, us in rows if us is not None}

    def enqueue_one_direct(self, kind: str, arg: int) -> Any:
        """One job on the producer's own asyncpg connection, straight to the store
        (``broker.enqueue_in_async``; PostgreSQL only): what a PgQueuer client does, and
        not the via-main figure (:meth:`enqueue_one`)."""
        from broker.client.transactional import enqueue_in_async

        if self.direct is None:
            import asyncpg

            self.direct = self.run(asyncpg.connect(postgres_dsn(DATABASE)))
        self.run(
            enqueue_in_async(
                self.direct, f"{TASKS}.{kind}", [arg], max_attempts=1, execution_mode=self.mode
            )
        )
        self.enqueued += 1
        return arg

    def enqueue_bulk_direct(self, kind: str, args: list[int]) -> None:
        """``args`` in one call on the producer's own asyncpg connection, straight to the
        store (``broker.enqueue_each_in_async`` outside a transaction: the task and options
        once and a list of argument sets, stored by column in one transaction, all or
        none; PostgreSQL only): what PgQueuer's bulk ``Queries.enqueue`` of lists does,
        and not the via-main figure."""
        from broker.client.transactional import enqueue_each_in_async

        if self.direct is None:
            import asyncpg

            self.direct = self.run(asyncpg.connect(postgres_dsn(DATABASE)))
        arg_sets = [(a,) for a in args]
        self.run(
            enqueue_each_in_async(
                self.direct,
                f"{TASKS}.{kind}",
                arg_sets,
                max_attempts=1,
                execution_mode=self.mode,
            )
        )
        self.enqueued += len(args)

    def analyze(self) -> None:
        if self.pg is not None:
            self.run(self.pg.execute("VACUUM ANALYZE broker_jobs"))

    def enqueue_bulk(self, kind: str, args: list[int]) -> None:
        """``args`` through the main by ``Client.enqueue_each`` (the task and options
        once, a list of argument sets, each request all or none), as PgQueuer's bulk
        ``Queries.enqueue`` takes lists: one request of up to :data:`EACH` jobs (a
        4,000-job bulk call is one), a larger backlog in requests of that many, up to
        :data:`IN_FLIGHT` under way."""
        arg_sets = [(a,) for a in args]
        task = f"{TASKS}.{kind}"
        slots = asyncio.Semaphore(IN_FLIGHT)

        async def send(part: list[tuple[int]]) -> None:
            async with slots:
                await self.client.enqueue_each(task, part, max_attempts=1, execution_mode=self.mode)

        async def every() -> None:
            parts = [arg_sets[i : i + EACH] for i in range(0, len(arg_sets), EACH)]
            await asyncio.gather(*map(send, parts))

        self.run(every())
        self.enqueued += len(args)

    def done_count(self) -> int:
        return self.enqueued - int(self._query(self.outstanding)[0][0])

    def completion_times(self, handles: list[Any]) -> list[float | None] | None:
        at = {}
        for args, updated_us in self._query(COMPLETED):
            tag = json.loads(args)[0]
            at[tag] = updated_us / 1e6
        return [at.get(h) for h in handles]

    PRODUCER_TEXT = (
        "one broker.Client per producer: its own TCP connection to broker-main, "
        "Client.enqueue of one job at a time"
    )

    async def open_producer(self) -> tuple[Callable[[], Awaitable[Any]], Callable[[], Any]]:
        from broker.client.client import Client

        client = Client("127.0.0.1", self.port, timeout=60)
        await client.connect()
        task, mode = f"{TASKS}.noop", self.mode

        async def enqueue() -> None:
            await client.enqueue(task, [-1], max_attempts=1, execution_mode=mode)

        return enqueue, client.close

    def worker_commands(self) -> list[list[str]]:
        worker = [
            str(Path(sys.executable).parent / "broker-worker"),
            "--main",
            f"127.0.0.1:{self.port}",
            "--app",
            TASKS,
            "--log-level",
            "WARNING",
            *self.row.flags,
        ]
        return [worker] * self.row.workers

    def main_pids(self) -> list[int]:
        return self.main.pids if self.main is not None else []

    def versions(self) -> dict[str, str]:
        out = super().versions()
        out["sqlite"] = sqlite3.sqlite_version
        try:
            commit = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            dirty = subprocess.run(
                [
                    "git",
                    "-C",
                    str(ROOT),
                    "status",
                    "--porcelain",
                    "--",
                    "broker",
                    "adapters",
                    "runners",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            out["broker"] += f" ({commit}{' + uncommitted changes' if dirty else ''})"
        except (OSError, subprocess.CalledProcessError):
            pass
        return out

    def teardown(self) -> None:
        self._stop_main()
        if self.postgres:
            self.run(on_admin_database(drop_database(DATABASE)))
        self.loop.close()


DRIVERS = {name: BrokerDriver for name in SETUPS}
