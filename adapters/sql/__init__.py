"""The job store on SQL: SQLite through aiosqlite, PostgreSQL through asyncpg.

The package, by idea: :mod:`~adapters.sql.adapter` states what each call of the storage
contract does, and a dialect per engine says how (:mod:`~adapters.sql.postgres`,
:mod:`~adapters.sql.sqlite`), chosen once at construction; :mod:`~adapters.sql.connect`
reaches the database, :mod:`~adapters.sql.rows` turns jobs into rows and back,
:mod:`~adapters.sql.enqueue` holds the one insert-or-find enqueue,
:mod:`~adapters.sql.errors` the one door where driver errors become the broker's, and
:mod:`~adapters.sql.schema` the tables and their migrations.

The adapter is imported on first use, as :func:`adapters.open_store` imports a store only
when its URL is used: ``SUPPORTED_URLS`` alone costs no SQLAlchemy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from adapters.sql.adapter import SQLAlchemyAdapter as SQLAlchemyAdapter
    from adapters.sql.enqueue import SyncStatements as SyncStatements

SUPPORTED_URLS = (
    "sqlite+aiosqlite:///path/to/broker.db",
    "sqlite:///path/to/broker.db",
    "postgresql+asyncpg://user@host:5432/dbname",
    "postgresql://user@host:5432/dbname",
    "postgres://user@host:5432/dbname",
)
"""The store URLs the SQL store takes (each backend's own form first)."""


def __getattr__(name: str) -> Any:
    if name == "SQLAlchemyAdapter":
        from adapters.sql.adapter import SQLAlchemyAdapter

        return SQLAlchemyAdapter
    if name == "SyncStatements":
        from adapters.sql.enqueue import SyncStatements

        return SyncStatements
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SUPPORTED_URLS", "SQLAlchemyAdapter", "SyncStatements"]
