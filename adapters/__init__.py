"""Storage adapters, chosen by URL.

``open_store`` imports an adapter only when its URL is used, so a deployment on
SQLite never needs asyncpg importable and vice versa.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.exceptions import ConfigurationError
from broker.jobs import Clock, utcnow
from broker.untrusted import redact_url

if TYPE_CHECKING:
    from broker.storage import StorageAdapter

SUPPORTED_URLS = (
    "sqlite+aiosqlite:///path/to/broker.db",
    "postgresql+asyncpg://user@host:5432/dbname",
    "memory://",
)


def open_store(url: str, *, clock: Clock = utcnow) -> StorageAdapter:
    """The adapter for ``url``; call its ``setup()`` before use."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "memory":
        from adapters.memory import MemoryAdapter

        return MemoryAdapter(clock=clock)
    if scheme.startswith(("sqlite", "postgres")):
        from adapters.sql import SQLAlchemyAdapter

        return SQLAlchemyAdapter(url, clock=clock)
    raise ConfigurationError(
        f"unsupported store URL {redact_url(url)!r}; use one of: {', '.join(SUPPORTED_URLS)} "
        "(a custom adapter is plugged in with --adapter module:factory)"
    )


__all__ = ["SUPPORTED_URLS", "open_store"]
