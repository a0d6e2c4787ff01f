"""SQLite's hot path: a claim or a settle is one function on a connection of its own.

Why: through SQLAlchemy and aiosqlite, each statement of a claim (``BEGIN IMMEDIATE``,
select, update, ``COMMIT``) was a hop to aiosqlite's thread and back plus the
statement's building and result handling, about 2 ms of CPU per claim. Here the whole
transaction runs as one call on a dedicated thread, with the ``sqlite3`` module's own
statement cache, so a claim or a settle costs one hop; the writes that queue meanwhile
share the next transaction (:meth:`SqliteHot.write`). Dispatch's reads take a second
such connection, so they never wait for a commit (and SQLAlchemy's building of the
read cost the main's event loop about a fifth of its time in a drain).

This module only runs functions on the connection; :mod:`adapters.sql.sqlite` writes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

_T = TypeVar("_T")


class SqliteHot:
    """One ``sqlite3`` connection, opened on first use, used only from one thread.

    Like SQLAlchemy's engine after ``dispose()``, it may be closed more than once and
    used again after a close (the thread and connection then start afresh).

    ``connect_args`` are what SQLAlchemy's dialect passes to ``sqlite3.connect`` for
    the same URL; ``prepare`` is run on the new connection (``before`` just ahead of
    opening it), exactly as on the general pool's. ``name`` names its thread, and
    :meth:`write` holds ``lock`` (the adapter's, shared with its other writers) over
    each transaction.
    """

    def __init__(
        self,
        connect_args: tuple[Sequence[Any], Mapping[str, Any]],
        before: Callable[[], None],
        prepare: Callable[[sqlite3.Connection, Any], None],
        name: str,
        lock: AbstractAsyncContextManager[Any] | None = None,
    ) -> None:
        self._name = name
        self._connect_args = connect_args
        self._before = before
        self._prepare = prepare
        self._lock = contextlib.nullcontext() if lock is None else lock
        self._conn: sqlite3.Connection | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._pending: list[tuple[Callable[[sqlite3.Connection], Any], asyncio.Future[Any]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """``fn(connection)`` on the connection's thread, outside any transaction."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix=self._name)
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._call, fn)

    async def write(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """``fn(connection)`` inside a write transaction, committed before this returns.

        Group commit: the writes that come while a transaction is under way wait for it,
        then go together in the next one, each in a savepoint of its own (an error in
        one undoes that one alone, and is raised to its caller alone). Each claim and
        each settle was a transaction, a commit and a hop to the thread of its own; in a
        drain they come in pairs or more at once. A write whose caller has gone before
        its transaction starts is left out.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_T] = loop.create_future()
        self._pending.append((fn, done))
        if self._writer is None or self._writer.done():
            self._writer = loop.create_task(self._write_groups(), name=f"{self._name}-writer")
        return await done

    async def _write_groups(self) -> None:
        while self._pending:
            group = [(fn, done) for fn, done in self._pending if not done.done()]
            self._pending = []
            if not group:
                continue
            try:
                async with self._lock:
                    outcomes = await self.run(functools.partial(_in_one_transaction, group))
            except asyncio.CancelledError:
                for _, done in group:
                    done.cancel()
                raise
            except BaseException as exc:
                for _, done in group:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for (_, done), (ok, value) in zip(group, outcomes, strict=True):
                if done.done():
                    continue
                if ok:
                    done.set_result(value)
                else:
                    done.set_exception(value)

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


def _in_one_transaction(
    group: list[tuple[Callable[[sqlite3.Connection], Any], Any]], conn: sqlite3.Connection
) -> list[tuple[bool, Any]]:
    """Run each function of ``group`` in one write transaction (``BEGIN IMMEDIATE``, as
    the general pool's writes begin); returns ``(True, its value)`` or ``(False, its
    error)`` for each. Alone, a function's error rolls the transaction back and is
    raised; in a group, each runs in a savepoint, and its error rolls back that savepoint
    only, unless SQLite rolled back the whole transaction (a full disk, say): then the
    error is raised for the whole group, whose earlier work is gone too."""
    conn.execute("BEGIN IMMEDIATE")
    outcomes: list[tuple[bool, Any]] = []
    try:
        if len(group) == 1:
            outcomes.append((True, group[0][0](conn)))
        else:
            for fn, _ in group:
                conn.execute("SAVEPOINT broker_write")
                try:
                    value = fn(conn)
                except Exception as exc:
                    if not conn.in_transaction:
                        raise
                    conn.execute("ROLLBACK TO broker_write")
                    outcomes.append((False, exc))
                else:
                    outcomes.append((True, value))
                conn.execute("RELEASE broker_write")
    except BaseException:
        conn.rollback()
        raise
    conn.commit()
    return outcomes
