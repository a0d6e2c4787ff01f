"""The systems ``make bench`` compares: where each driver lives and what it needs.

Standard library only: the harness imports this in every virtual environment.
Each peer is pinned and installed into its own virtual environment under
``.venv-peers/`` (their Redis client pins conflict), the broker runs from ``.venv``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

REDIS_HOST = "127.0.0.1"
REDIS_PORT = 6379
REDIS_DB = 11
"""A database index of its own, flushed before every run; Celery's results use the next."""
POSTGRES_HOST = "127.0.0.1"
POSTGRES_PORT = 5432
POSTGRES_USER = "postgres"
POSTGRES_ADMIN_DB = "test"
"""The database the harness connects to in order to create its own throwaway ones."""


def postgres_dsn(database: str) -> str:
    return f"postgresql://{POSTGRES_USER}@{POSTGRES_HOST}:{POSTGRES_PORT}/{database}"


DATABASE_SUFFIX = "BENCH_DB_SUFFIX"
"""Environment variable: a suffix for every PostgreSQL database the benchmark makes.
``python -m bench`` sets a fresh one per run, and the harness and workers inherit it."""


async def on_admin_database(*statements: str) -> None:
    """Run ``statements`` in turn on the admin database (:data:`POSTGRES_ADMIN_DB`),
    as creating and dropping a benchmark's database needs. asyncpg is imported here,
    so this module stays importable where it is not installed."""
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(postgres_dsn(POSTGRES_ADMIN_DB))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def drop_database(name: str) -> str:
    return f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"


def fresh_database(name: str) -> tuple[str, str]:
    """The statements that give ``name`` as a new, empty database."""
    return drop_database(name), f"CREATE DATABASE {name}"


def database(base: str) -> str:
    """``base`` plus this run's suffix. Each run drops and creates its databases; with a
    name of its own, a run never drops one that another run (another session's smoke
    test on the same server) is using."""
    return base + os.environ.get(DATABASE_SUFFIX, "")


def redis_url(db: int = REDIS_DB) -> str:
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}"


@dataclass(frozen=True)
class System:
    name: str
    module: str
    venv: str | None
    """Directory name under ``.venv-peers/``; ``None``: the broker's own ``.venv``."""
    needs: tuple[str, ...]
    """Services: ``"redis"``, ``"postgres"``."""


PINS: dict[str, tuple[str, ...]] = {
    "celery": ("celery[redis]==5.7.0",),
    "rq": ("rq==2.12.0",),
    "dramatiq": ("dramatiq[redis]==2.2.1",),
    "arq": ("arq==0.28.0",),
    "procrastinate": ("procrastinate==3.10.0", "psycopg[binary]==3.3.9"),
    "pgqueuer": ("pgqueuer==1.6.0", "asyncpg==0.32.0"),
    "chart": ("matplotlib==3.11.2",),
}
"""What each peer virtual environment gets; ``chart`` renders the PNG."""

PEERS_VENV = Path(__file__).resolve().parent.parent / ".venv-peers"
CHART_PYTHON = PEERS_VENV / "chart" / "bin" / "python"
"""The interpreter that draws every chart (matplotlib lives only there)."""


def venv_python(system: System) -> Path:
    """The interpreter ``system``'s driver runs in."""
    if system.venv is None:
        return Path(sys.executable)
    return PEERS_VENV / system.venv / "bin" / "python"


SYSTEMS: tuple[System, ...] = (
    System("broker-sqlite", "bench.peers.broker_peer", None, ()),
    System("broker-postgres", "bench.peers.broker_peer", None, ("postgres",)),
    System("broker-sqlite-inline", "bench.peers.broker_peer", None, ()),
    System("broker-postgres-inline", "bench.peers.broker_peer", None, ("postgres",)),
    System("broker-postgres-inline1", "bench.peers.broker_peer", None, ("postgres",)),
    System("broker-postgres-defaults", "bench.peers.broker_peer", None, ("postgres",)),
    System("celery", "bench.peers.celery_peer", "celery", ("redis",)),
    System("rq", "bench.peers.rq_peer", "rq", ("redis",)),
    System("rq-simple", "bench.peers.rq_peer", "rq", ("redis",)),
    System("dramatiq", "bench.peers.dramatiq_peer", "dramatiq", ("redis",)),
    System("arq", "bench.peers.arq_peer", "arq", ("redis",)),
    System("arq-fastpoll", "bench.peers.arq_peer", "arq", ("redis",)),
    System("procrastinate", "bench.peers.procrastinate_peer", "procrastinate", ("postgres",)),
    System("pgqueuer", "bench.peers.pgqueuer_peer", "pgqueuer", ("postgres",)),
)

BY_NAME = {s.name: s for s in SYSTEMS}
