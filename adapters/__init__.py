"""Storage adapters, chosen by URL.

``open_store`` imports an adapter only when its URL is used, so a deployment on
SQLite never needs asyncpg importable and vice versa.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict, Unpack

from adapters import sql
from broker.exceptions import ConfigurationError
from broker.jobs import Clock, utcnow
from broker.model.untrusted import redact_url
from broker.payload import DEFAULT_OFFLOAD_BYTES

if TYPE_CHECKING:
    from broker.storage import StorageAdapter

DEFAULT_POOL_SIZE = 5
"""Connections of a SQL store's general pool (enqueues, listings, operator calls), which
may grow by up to 10 more under load."""
DEFAULT_HOT_POOL_SIZE = 4
"""PostgreSQL connections kept for claims, settles and selection alone, so none of them
waits behind enqueues: enough for the dispatcher's pass and its claims in flight
(``max_claims_in_flight``, 2) and the report settler's group commit at once."""

SUPPORTED_URLS = (*sql.SUPPORTED_URLS, "memory://")
"""Every store URL :func:`open_store` takes: the SQL store's, and the in-memory one."""


class StoreOptions(TypedDict, total=False):
    """How :func:`open_store` opens a built-in store; an option left out takes the
    adapter's default. Written once: :func:`broker.ops.composition.open_store` passes
    them on whole."""

    clock: Clock
    create: bool
    read_only: bool
    pool_size: int
    hot_pool_size: int
    single_main: bool
    offload_threshold: int | None


def open_store(url: str, **options: Unpack[StoreOptions]) -> StorageAdapter:
    """The adapter for ``url``; call its ``setup()`` before use.

    ``create=False`` (and ``read_only=True``) open an existing store without the right to
    create or change its schema; call ``check_schema()`` instead of ``setup()``.
    ``pool_size`` and ``hot_pool_size`` size a SQL store's connection pools (see
    :class:`adapters.sql.SQLAlchemyAdapter`); the in-memory store has none.
    ``single_main=True`` is for a broker-main: a SQLite store then refuses a second main.
    ``offload_threshold``: values larger than this are kept apart from their job's row
    (see :class:`broker.storage.SupportsOffload`); ``None`` keeps them all inline.
    """
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "memory":
        if not options.get("create", True) or options.get("read_only", False):
            raise ConfigurationError(
                "memory:// lives inside the broker-main process that opened it; no other "
                "process can open it: reach that main with --main instead"
            )
        from adapters.memory import MemoryAdapter

        return MemoryAdapter(
            clock=options.get("clock", utcnow),
            offload_threshold=options.get("offload_threshold", DEFAULT_OFFLOAD_BYTES),
        )
    if scheme.startswith(("sqlite", "postgres")):
        from adapters.sql import SQLAlchemyAdapter

        return SQLAlchemyAdapter(url, **options)
    raise ConfigurationError(
        f"unsupported store URL {redact_url(url)!r}; use one of: {', '.join(SUPPORTED_URLS)} "
        "(a custom adapter is plugged in with --adapter module:factory)"
    )


__all__ = [
    "DEFAULT_HOT_POOL_SIZE",
    "DEFAULT_POOL_SIZE",
    "SUPPORTED_URLS",
    "StoreOptions",
    "open_store",
]
