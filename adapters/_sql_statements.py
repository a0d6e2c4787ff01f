"""The application's own connection, as :mod:`adapters.sql`'s enqueue code writes to it.

The store's insert-or-find rule (:meth:`adapters.sql.SQLAlchemyAdapter._enqueue_on`) is
written once, as a coroutine over an ``AsyncConnection``; all it does with the connection
is ``await conn.execute(statement, parameters)``. A transactional enqueue runs that same
rule on whatever connection the application holds, synchronous or not, by handing it
an object with just that method.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy.ext.asyncio import AsyncConnection

_T = TypeVar("_T")


class SyncStatements(Protocol):
    """What a synchronous transactional enqueue needs of a connection:
    ``sa.Connection.execute``'s shape (results with ``scalars()`` and ``mappings()``)."""

    def execute(
        self, statement: Any, parameters: Any = None, *, execution_options: Any = None
    ) -> Any: ...


class _Statements:
    def __init__(self, execute: Callable[[Any, Any], Awaitable[Any]]) -> None:
        self.execute = execute


def statements(execute: Callable[[Any, Any], Awaitable[Any]]) -> AsyncConnection:
    """A stand-in for an ``AsyncConnection`` whose ``execute`` is ``execute``: the only
    method the enqueue code calls."""
    return cast(AsyncConnection, _Statements(execute))


def complete_now(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine that never suspends (its awaits reach only synchronous calls), so a
    synchronous caller needs no event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(_T, done.value)
    coro.close()
    raise RuntimeError("a synchronous enqueue waited on I/O; its connection must be synchronous")
