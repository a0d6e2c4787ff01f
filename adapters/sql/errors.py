"""The one door where the SQL store's driver errors become the broker's.

Every call into a database goes through :meth:`StoreErrors.translate` (as httpcore's
``map_exceptions``): a driver's error, SQLAlchemy's wrapper, a lost socket, come out as
:class:`~broker.exceptions.StorageError`, which the main retries;
:class:`~broker.exceptions.StorageRejectedError` when the value itself is at fault (the
same call fails every time); :class:`~broker.exceptions.DeposedError` when the epoch
fence refused a deposed main. Which classes a driver raises is known here alone.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from types import TracebackType
from typing import Any

from sqlalchemy import exc as sa_exc

from adapters.sql.schema import FENCED_SQLSTATE
from broker.exceptions import DeposedError, StorageError, StorageRejectedError

REJECTED_SQLSTATE_CLASSES = ("22", "23", "54")
"""PostgreSQL error classes about the data itself: data exceptions (22, such as a NUL in
text), integrity constraint violations (23) and program limits (54, such as a value too
long for an index entry). Anything else (a lost connection, a timeout, a deadlock, a
missing table or grant) may succeed later and is retried."""


def rejects_value(exc: BaseException) -> bool:
    """Whether the database refused the data itself, so the same call fails every time.

    ``exc`` comes wrapped by SQLAlchemy, or straight from asyncpg on the hot path
    (:mod:`adapters.sql.postgres`), where a server error carries its SQLSTATE itself.
    """
    cause: object = exc
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return False
        if isinstance(exc, sa_exc.DataError | sa_exc.IntegrityError):
            return True
        cause = exc.orig
    sqlstate = getattr(cause, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate[:2] in REJECTED_SQLSTATE_CLASSES


class StoreErrors:
    """What counts as a store error on one store (``caught``), and how each is told.

    ``client_rejects`` are the driver's own refusals of a value before it reaches the
    server (say, an integer beyond BIGINT); ``where`` names the store in messages.
    ``on_fenced(op)`` is called when the epoch fence refuses ``op`` (see
    :meth:`~broker.storage.StorageAdapter.fence`).
    """

    def __init__(
        self,
        where: str,
        caught: tuple[type[BaseException], ...],
        client_rejects: tuple[type[BaseException], ...],
    ) -> None:
        self.where = where
        self.caught = caught
        self._client_rejects = client_rejects
        self.on_fenced: Callable[[str], None] | None = None

    @classmethod
    def for_postgres(cls, where: str, driver: Any) -> StoreErrors:
        """asyncpg's errors; an argument it cannot encode is a value the store can never
        hold, as the server's data errors are."""
        return cls(
            where,
            (
                sa_exc.DBAPIError,
                sa_exc.TimeoutError,
                OSError,
                driver.PostgresError,
                driver.InterfaceError,
            ),
            (driver.exceptions._base.DataError,),
        )

    @classmethod
    def for_sqlite(cls, where: str) -> StoreErrors:
        """sqlite3's errors; on the hot path, its ``IntegrityError`` and ``DataError`` are
        what SQLAlchemy would call a ``DataError`` or ``IntegrityError``: the value, not
        the moment, is at fault."""
        return cls(
            where,
            (sa_exc.DBAPIError, sa_exc.TimeoutError, OSError, sqlite3.Error),
            (sqlite3.IntegrityError, sqlite3.DataError),
        )

    def translate(self, op: str) -> _Translating:
        """A context in which a store error of ``op`` is raised as the broker's (the
        driver's error as its cause); anything else passes through."""
        return _Translating(self, op)

    def error(self, op: str, exc: BaseException) -> StorageError:
        """The broker's error for the store error ``exc`` of ``op``."""
        cause = exc.orig if isinstance(exc, sa_exc.DBAPIError) and exc.orig else exc
        if getattr(cause, "sqlstate", None) == FENCED_SQLSTATE:
            if self.on_fenced is not None:
                self.on_fenced(op)
            return DeposedError(
                f"{op} refused by the epoch fence on {self.where}: {cause} (another "
                "main took over; nothing was changed)"
            )
        rejected = rejects_value(exc) or isinstance(exc, self._client_rejects)
        kind = StorageRejectedError if rejected else StorageError
        return kind(f"{op} failed on {self.where}: {type(cause).__name__}: {cause}")


class _Translating:
    """:meth:`StoreErrors.translate`'s context: a plain class, as it wraps every call on
    the hot path."""

    __slots__ = ("_errors", "_op")

    def __init__(self, errors: StoreErrors, op: str) -> None:
        self._errors = errors
        self._op = op

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is not None and isinstance(exc, self._errors.caught):
            raise self._errors.error(self._op, exc) from exc
