"""SQLite's hot path: a claim or a settle is one function on a connection of its own.

Why: through SQLAlchemy and aiosqlite, each statement of a claim (``BEGIN IMMEDIATE``,
select, update, ``COMMIT``) was a hop to aiosqlite's thread and back plus the
statement's building and result handling, about 2 ms of CPU per claim. Here the whole
transaction runs as one call on a dedicated thread, with the ``sqlite3`` module's own
statement cache, so a claim or a settle costs one hop.

This module only runs functions on the connection; :mod:`adapters.sql` writes them.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

_T = TypeVar("_T")


class SqliteHot:
    """One ``sqlite3`` connection, opened on first use, used only from one thread.

    Like SQLAlchemy's engine after ``dispose()``, it may be closed more than once and
    used again after a close (the thread and connection then start afresh).

    ``connect_args`` are what SQLAlchemy's dialect passes to ``sqlite3.connect`` for
    the same URL; ``prepare`` is run on the new connection (``before`` just ahead of
    opening it), exactly as on the general pool's. ``name`` names its thread.
    """

    def __init__(
        self,
        connect_args: tuple[Sequence[Any], Mapping[str, Any]],
        before: Callable[[], None],
        prepare: Callable[[sqlite3.Connection, Any], None],
        name: str,
    ) -> None:
        self._name = name
        self._connect_args = connect_args
        self._before = before
        self._prepare = prepare
        self._conn: sqlite3.Connection | None = None
        self._thread: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """``fn(connection)`` on the connection's thread; it opens its own transaction."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix=self._name)
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._call, fn)

    def _call(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        if self._conn is None:
            self._before()
            args, kwargs = self._connect_args
            conn = sqlite3.connect(*args, **kwargs)
            try:
                self._prepare(conn, None)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return fn(self._conn)

    async def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return

        def close() -> None:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

        await asyncio.get_running_loop().run_in_executor(thread, close)
        thread.shutdown(wait=False)


@contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction (``BEGIN IMMEDIATE``, as the general pool's writes begin),
    committed on success and rolled back on any error."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.rollback()
        raise
    conn.commit()
