"""Reaching the database: the store URL and its driver, the engines and pools, and a
SQLite file's set-up (created private, WAL, pragmas, ``BEGIN IMMEDIATE`` for writes, the
one-main lock).

The lock that keeps a SQLite store to one broker-main (:class:`MainLock`): two mains on
one SQLite file would both dispatch, and each would give back the other's handoffs as
orphans. SQLite has no advisory locks that outlive a transaction, so the main holds an OS
file lock (``flock``) on ``<db>.main.lock`` for its whole life. The kernel drops it when
the process dies, however it dies, so a crashed main never leaves a stale lock behind.
Only the main takes it: the operator's command and applications' own transactional
enqueues open the database file itself, which the lock does not touch.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import time
import urllib.parse
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from adapters.sql import SUPPORTED_URLS
from adapters.sql.sqlite_thread import SqliteHot
from broker.exceptions import ConfigurationError, MissingDriverError
from broker.model.untrusted import redact_url

SQLITE_BUSY_TIMEOUT_MS = 5000
"""How long a SQLite writer waits for another process's write lock before failing."""

WRITE_OPTION = "broker_write"
"""Execution option marking SQLite write transactions (they begin IMMEDIATE)."""


def redact(url: URL) -> str:
    # SQLAlchemy hides only what it parsed as the password: of "u:p@ss@host" it shows
    # "u:***@ss@host". The shared rule hides up to the last "@", and query passwords.
    return redact_url(url.render_as_string(hide_password=True))


def require_driver(module: str, url: URL) -> Any:
    """Import a DB driver, turning its absence into a message that says what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDriverError(
            f"the store URL {redact(url)} needs the {module!r} driver, which is not "
            f"installed: pip install {module}"
        ) from exc


def resolve_url(raw: str) -> tuple[URL, str]:
    """The async-driver URL for ``raw`` and its backend (``sqlite`` or ``postgresql``)."""
    try:
        url = make_url(raw)
    except (sa_exc.ArgumentError, ValueError) as exc:  # ValueError: a port that is no number
        raise ConfigurationError(
            f"cannot parse store URL {redact_url(raw)!r}; use one of: {', '.join(SUPPORTED_URLS)}"
        ) from exc
    driver = url.drivername.lower()
    if driver in ("sqlite", "sqlite+aiosqlite"):
        if url.database in (None, "", ":memory:") or url.query.get("mode") == "memory":
            raise ConfigurationError(
                "in-memory SQLite is not supported (each connection would see its own "
                "empty database); give a file path, e.g. sqlite+aiosqlite:///broker.db, "
                "or use memory:// for the in-memory adapter"
            )
        return url.set(drivername="sqlite+aiosqlite"), "sqlite"
    if driver in ("postgresql", "postgres", "postgresql+asyncpg"):
        return url.set(drivername="postgresql+asyncpg"), "postgresql"
    raise ConfigurationError(
        f"unsupported store URL scheme {url.drivername!r}; use one of: {', '.join(SUPPORTED_URLS)}"
    )


def main_lock(url: URL) -> MainLock | None:
    """The single-main lock of a SQLite file; none for PostgreSQL, whose mains coordinate
    in the database, nor for a ``file:`` URI, which is the operator's own."""
    if url.get_backend_name() != "sqlite" or not url.database or url.query.get("uri"):
        return None
    return MainLock(url.database)


def _create_private(path: str) -> None:
    """Create the SQLite file readable and writable by its owner only, if it is missing.

    SQLite would create it with the umask's mode, usually 0644: job arguments and
    results readable by every local user. Its ``-wal`` and ``-shm`` files take the
    database file's mode. A file that exists already keeps the mode its operator chose.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return  # it exists, or cannot be created: SQLite then opens it or says why not
    os.close(fd)


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Take transaction control away from the sqlite3 module; _sqlite_on_begin emits BEGIN.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        _switch_to_wal(cursor)
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _switch_to_wal(cursor: Any) -> None:
    """Put the file in WAL mode, once (the mode is stored in the file).

    The first switch of a fresh file needs it to itself, and SQLite answers "database is
    locked" at once, without its busy timeout, while another connection has it open, as
    when several processes start on a new store together. So a locked switch is tried
    again, for as long as the busy timeout would have waited.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode")
            if cursor.fetchone()[0] != "wal":
                cursor.execute("PRAGMA journal_mode=WAL")
            return
        except Exception as exc:  # the driver's OperationalError, as the dialect wraps it
            if "database is locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def existing_file_url(url: URL, *, read_only: bool) -> URL:
    """The URL that opens the SQLite file only if it is there (SQLite's ``mode=rw`` or
    ``mode=ro``): an operator's typo in a path must never leave an empty store behind."""
    mode = "ro" if read_only else "rw"
    if url.query.get("uri"):  # the operator's own file: URI
        return url.update_query_dict({"mode": mode})
    path = "file:" + urllib.parse.quote(url.database or "")
    return url.set(database=path, query={**url.query, "mode": mode, "uri": "true"})


def _sqlite_on_connect_existing(read_only: bool) -> Callable[[Any, Any], None]:
    """Connection set-up for a store opened without the right to create: the journal
    mode is left as the file has it (switching it is a write), and a read-only handle
    also refuses writes of its own (``query_only``)."""

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute("PRAGMA foreign_keys=ON")
            if read_only:
                cursor.execute("PRAGMA query_only=ON")
        finally:
            cursor.close()

    return on_connect


def _sqlite_on_begin(conn: sa.Connection) -> None:
    if conn.get_execution_options().get(WRITE_OPTION):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.exec_driver_sql("BEGIN")


def wire_sqlite(
    engine: AsyncEngine,
    resolved: URL,
    *,
    create: bool,
    read_only: bool,
    write_lock: AbstractAsyncContextManager[Any],
) -> tuple[SqliteHot, SqliteHot]:
    """Set up every SQLite connection alike, the engine's and the hot path's own: one
    for its writes and one for dispatch's reads, which thus never wait for a write's
    commit (WAL lets them read beside it)."""
    path = resolved.database
    # A file: URI is the operator's own, and a handle without the right to create
    # creates nothing.
    private = path if create and path and not resolved.query.get("uri") else None

    def before_connect(*_: object) -> None:
        if private is not None:
            _create_private(private)

    on_connect = _sqlite_on_connect if create else _sqlite_on_connect_existing(read_only)
    event.listen(engine.sync_engine, "do_connect", before_connect)
    event.listen(engine.sync_engine, "connect", on_connect)
    event.listen(engine.sync_engine, "begin", _sqlite_on_begin)
    connect_args = engine.dialect.create_connect_args(resolved)
    return (
        SqliteHot(connect_args, before_connect, on_connect, "broker-sqlite-hot", write_lock),
        SqliteHot(connect_args, before_connect, on_connect, "broker-sqlite-reads"),
    )


def lock_path(database: str) -> str:
    """The lock file beside the database file."""
    return database + ".main.lock"


class MainLock:
    """Held from :meth:`acquire` to :meth:`release`; acquiring twice is a no-op."""

    def __init__(self, database: str) -> None:
        self.path = lock_path(database)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`ConfigurationError` naming the main that holds it."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigurationError(
                f"another broker-main{holder} is already running on this SQLite store (it "
                f"holds {self.path}): a SQLite store takes one main. Stop that main first, or "
                "use PostgreSQL to run several mains on one store"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # The holder's pid, for the message a second main prints; informative only (the
        # lock itself is the kernel's).
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        # Closing the descriptor drops the lock; the file stays (removing it would race a
        # main that has just opened it).
        os.close(fd)


def _read_holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode("ascii").strip())
        return f" (pid {pid})"
    return ""
