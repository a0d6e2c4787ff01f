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


def open_store(
    url: str,
    *,
    clock: Clock = utcnow,
    create: bool = True,
    read_only: bool = False,
    single_main: bool = False,
) -> StorageAdapter:
    """The adapter for ``url``; call its ``setup()`` before use.

    ``create=False`` (and ``read_only=True``) open an existing store without the right to
    create or change its schema; call ``check_schema()`` instead of ``setup()``.
    ``single_main=True`` is for a broker-main: a SQLite store then refuses a second main.
    """
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "memory":
        if not create or read_only:
            raise ConfigurationError(
                "memory:// lives inside the broker-main process that opened it; no other "
                "process can open it: reach that main with --main instead"
            )
        from adapters.memory import MemoryAdapter

        return MemoryAdapter(clock=clock)
    if scheme.startswith(("sqlite", "postgres")):
        from adapters.sql import SQLAlchemyAdapter

        return SQLAlchemyAdapter(
            url, clock=clock, create=create, read_only=read_only, single_main=single_main
        )
    raise ConfigurationError(
        f"unsupported store URL {redact_url(url)!r}; use one of: {', '.join(SUPPORTED_URLS)} "
        "(a custom adapter is plugged in with --adapter module:factory)"
    )


__all__ = ["SUPPORTED_URLS", "open_store"]
