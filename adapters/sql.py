"""A job store on SQLAlchemy Core (asyncio): SQLite through aiosqlite, PostgreSQL through asyncpg.

How the contract in :mod:`broker.storage` maps onto SQL:

* **Fencing** is a single ``UPDATE ... WHERE id = :id AND handoff_id = :lease AND
  status = 'handed_off'``; the row count is the answer.
* **Claims** lock their candidate rows first (PostgreSQL: ``FOR UPDATE SKIP LOCKED``,
  so concurrent claimers never wait on each other's jobs), then the concurrency
  counters in sorted key order, then hand off every granted row in one ``UPDATE``.
  Releases lock the job row (the fenced ``UPDATE``) and then its counter. Neither
  path waits on a job row while holding a counter, so the two cannot deadlock.
* **SQLite** has one writer at a time. Write transactions start with
  ``BEGIN IMMEDIATE`` so that two writers never deadlock upgrading a read lock, and
  writes inside one adapter queue on an ``asyncio.Lock`` instead of sleeping in
  SQLite's busy handler. Another process on the same file waits up to the busy
  timeout. The journal is WAL with ``synchronous=FULL``: a commit is on disk before
  the call returns, because the broker acknowledges only what is durable.
* **The hot path** (claims, settles, enqueues and selection) does
  not go through SQLAlchemy: PostgreSQL runs each as one asyncpg statement over arrays
  on a pool of its own (:mod:`adapters._pg_hot`), SQLite as one thread hop to a
  connection of its own (:mod:`adapters._sqlite_hot`), writes group-committed. SQLAlchemy
  keeps the schema, migrations and everything else.
* **Time** is read from the adapter's clock, never the database's, and stored as
  integer microseconds since the epoch.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib
import json
import logging
import math
import operator
import os
import sqlite3
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from adapters import DEFAULT_HOT_POOL_SIZE, DEFAULT_POOL_SIZE
from adapters._sql_schema import (
    FENCED_SQLSTATE,
    HOLLOW,
    INSERT_COLUMNS,
    IS_ACTIVE,
    IS_HANDED_OFF,
    IS_TERMINAL,
    OFFLOADABLE,
    OFFLOADED,
    QUIET_INSERTS_SETTING,
    _qualified,
    concurrency,
    jobs,
    migrate,
    notify_channel,
    payloads,
    schema_version,
    selection,
    task_catalog,
)
from adapters._sql_statements import SyncStatements as SyncStatements  # re-exported
from adapters._sql_statements import complete_now, statements
from adapters._sqlite_hot import SqliteHot
from adapters._sqlite_lock import MainLock
from broker import settlement
from broker.exceptions import (
    ConfigurationError,
    DeposedError,
    InvalidJobError,
    MissingDriverError,
    SchemaVersionError,
    StorageError,
    StorageRejectedError,
    UniqueKeyTakenError,
)
from broker.jobs import (
    JOB_DEFAULTS,
    TERMINAL_STATUSES,
    CheckpointSave,
    Claim,
    Clock,
    EnqueueResult,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
    JSONValue,
    Outcome,
    ProgressUpdate,
    Settlement,
    check_idempotent_repeat,
    compact_json,
    utcnow,
)
from broker.model.untrusted import redact_url
from broker.payload import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_OFFLOAD_BYTES, check_all
from broker.storage import (
    SCHEMA_VERSION,
    Capabilities,
    JobFilter,
    JobPage,
    LeaderRecord,
    PayloadIntegrityError,
    QueueCount,
    TaskRecord,
    check_payload,
    log_refused_at_claim,
    payload_digest,
)

if TYPE_CHECKING:
    from adapters._pg_hot import HotPool, HotSql

logger = logging.getLogger(__name__)
_ANALYZE_AFTER_INSERTS = 500
_ANALYZE_INTERVAL = 30.0
_T = TypeVar("_T")
E = TypeVar("E", bound=enum.Enum)

SUPPORTED_URLS = (
    "sqlite+aiosqlite:///path/to/broker.db",
    "sqlite:///path/to/broker.db",
    "postgresql+asyncpg://user@host:5432/dbname",
    "postgresql://user@host:5432/dbname",
    "postgres://user@host:5432/dbname",
)

SQLITE_BUSY_TIMEOUT_MS = 5000
"""How long a SQLite writer waits for another process's write lock before failing."""

_QUEUED = JobStatus.QUEUED.value
_HANDED_OFF = JobStatus.HANDED_OFF.value
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US = timedelta(microseconds=1)
_ENQUEUE_ROUNDS = 5
"""How often an enqueue retries when the job holding its key vanishes mid-transaction."""
_READ_ROUNDS = 5
"""Reads of rows and their payloads before a payload that keeps vanishing between the
two is an error (see :meth:`SQLAlchemyAdapter._read_with_bodies`)."""
_CHUNK = 500
"""Most ids bound in one statement (SQLite and asyncpg cap a statement near 32k parameters)."""
_WRITE_OPTION = "broker_write"
"""Execution option marking SQLite write transactions (they begin IMMEDIATE)."""
_SUMMARY_COLUMNS = [
    {
        "args": sa.literal_column("'[]'", sa.Text).label("args"),
        "kwargs": sa.literal_column("'{}'", sa.Text).label("kwargs"),
        "result": sa.null().label("result"),
        "checkpoint": sa.null().label("checkpoint"),
    }.get(column.name, column)
    for column in jobs.c
]
"""What a summary listing selects: constants in place of the payload columns, so the
database never reads them (each may be megabytes) and ``_job_from_row`` needs no
special case."""


# --------------------------------------------------------------------------- helpers


def _to_us(value: datetime) -> int:
    global _last_us
    last = _last_us
    if last[0] is value:
        return last[1]  # the same time again: a batch's jobs share theirs, three times each
    if value.tzinfo is None:
        raise ValueError(f"datetimes must be timezone-aware (got naive {value.isoformat()})")
    us = (value - _EPOCH) // _ONE_US
    _last_us = (value, us)  # one rebinding: a thread reading it sees the pair whole
    return us


_last_us: tuple[datetime | None, int] = (None, 0)


@functools.lru_cache(maxsize=4096)
def _from_us(value: int) -> datetime:
    """Cached: the rows decoded together mostly share their times (a bulk enqueue's jobs
    one creation time, a claim's jobs one hand-off time), and a datetime is immutable."""
    return _EPOCH + timedelta(microseconds=value)


def _enum_decoder(kind: type[E]) -> Callable[[Any], E]:
    """``kind(value)`` by a dict lookup first: an enum's own call cost the decoding of a
    row about 1 µs per enum column. A value not in ``kind`` still raises as the call does."""
    members = {member.value: member for member in kind}

    def decode(value: Any) -> E:
        member = members.get(value)
        return kind(value) if member is None else member

    return decode


_dumps = compact_json
_JSON_DECODE = msgspec.json.Decoder().decode


def _loads(text: str | bytes) -> Any:
    """``json.loads(text)``, in C: every claimed and selected job decodes its arguments,
    and ``json.loads``'s Python layers cost more than decoding a small value. msgspec
    gives the same value for every text it accepts; the few valid texts it refuses (an
    escaped lone surrogate, a number beyond a float's range) go to ``json.loads``, which
    also raises as ever for a text that is not JSON."""
    try:
        return _JSON_DECODE(text)
    except msgspec.MsgspecError:
        return json.loads(text)


def _optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else convert(value)


def _enum_value(kind: type[enum.Enum]) -> Callable[[Any], Any]:
    """A ``kind`` member's value, or the value of the member a raw value names (which
    refuses one no member has); a member, the usual case, without the enum's lookup."""
    return lambda v: v._value_ if type(v) is kind else kind(v).value


def _same(value: Any) -> Any:
    return value


def _result_text(value: JSONValue) -> str | None:
    """A reported result as stored; one that JSON cannot hold is the reporter's error."""
    try:
        return None if value is None else _dumps(value)
    except (TypeError, ValueError) as exc:
        raise InvalidJobError(f"result is not JSON-serialisable: {exc}") from exc


_CODECS: dict[str, tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = {
    "args": ("args", _dumps, lambda v: tuple(_loads(v))),
    "kwargs": ("kwargs", _dumps, _loads),
    "status": ("status", _enum_value(JobStatus), _enum_decoder(JobStatus)),
    "run_at": ("run_at_us", _to_us, _from_us),
    "created_at": ("created_us", _to_us, _from_us),
    "updated_at": ("updated_us", _to_us, _from_us),
    "execution_mode": (
        "execution_mode",
        _enum_value(ExecutionMode),
        _enum_decoder(ExecutionMode),
    ),
    "handed_off_at": ("handed_off_us", _optional(_to_us), _optional(_from_us)),
    "result": ("result", _result_text, _optional(_loads)),
    "timeout": ("timeout_s", _optional(float), _optional(float)),
    "checkpoint": ("checkpoint", _result_text, _optional(_loads)),
    "checkpoint_at": ("checkpoint_us", _optional(_to_us), _optional(_from_us)),
    "local_state": ("local_state", bool, bool),
}
"""How a :class:`Job` field differs in ``broker_jobs`` (column, encode, decode); every
other field is a column of its own name holding its value as is."""
_FIELDS = [(f.name, *_CODECS.get(f.name, (f.name, _same, _same))) for f in dataclasses.fields(Job)]
_COLUMN_OF = {name: column for name, column, _, _ in _FIELDS}
_ENCODE = {name: encode for name, _, encode, _ in _FIELDS}


_ROW_GET = operator.itemgetter(*(column for _, column, _, _ in _FIELDS))
"""A row's columns in :class:`Job`'s field order, in one C call (by name: asyncpg records,
SQLAlchemy mappings and ``sqlite3.Row`` all take one)."""
_DECODED = [(i, decode) for i, (_, _, _, decode) in enumerate(_FIELDS) if decode is not _same]
_PAYLOADS_GET = operator.itemgetter(*OFFLOADABLE)
_ROW_COLUMNS = [column for _, column, _, _ in _FIELDS]
"""The columns of ``broker_jobs`` in :class:`Job`'s field order."""
_ID_AT = _ROW_COLUMNS.index("id")
_PAYLOAD_POSITIONS = [(_ROW_COLUMNS.index(column), column) for column in OFFLOADABLE]
_PAYLOADS_AT = operator.itemgetter(*(i for i, _ in _PAYLOAD_POSITIONS))
"""A row's payload columns, by position in :class:`Job`'s field order."""


Bodies = Mapping[tuple[uuid.UUID, str], tuple[str, str | None]]
"""Offloaded payloads by ``(job id, column)``, as ``broker_payloads`` holds them: each
one's text and the SHA-256 stored beside it (see :func:`broker.storage.check_payload`)."""


def _is_offloaded(row: Mapping[Any, Any] | sqlite3.Row) -> bool:
    return OFFLOADED in _PAYLOADS_GET(row)


def _job_from_row(row: Mapping[Any, Any], bodies: Bodies | None = None) -> Job:
    """A :class:`Job` from a ``broker_jobs`` row (or the parameters of its INSERT).

    An offloaded payload column takes its value from ``bodies``; with ``bodies=None``
    (dispatch's selection, which never needs payloads) it reads as empty instead.
    """
    return _job_from_values(list(_ROW_GET(row)), bodies)


def _job_from_values(values: list[Any], bodies: Bodies | None) -> Job:
    """A :class:`Job` from a row's column values in its fields' order (see
    :func:`_job_from_row`), which this decodes in place.

    Columns held as is are copied without a call each, all in one, and the job is built
    from positions: every selected and claimed job passes through here, and the calls and
    the keyword dict were most of its cost.
    """
    if OFFLOADED in _PAYLOADS_AT(values):
        return _job_with_bodies(values, bodies)
    for i, decode in _DECODED:
        values[i] = decode(values[i])
    return Job(*values)


def _job_with_bodies(values: list[Any], bodies: Bodies | None) -> Job:
    """:func:`_job_from_values` for a row with an offloaded column: each such column is
    checked and decoded as it is filled in (:func:`_fill`), the others as usual."""
    loaded = _fill(values, bodies)
    for i, decode in _DECODED:
        if i not in loaded:
            values[i] = decode(values[i])
    return Job(*values)


_DECODE_AT = dict(_DECODED)


def _fill(values: list[Any], bodies: Bodies | None) -> set[int]:
    """Replace each offloaded column of ``values`` by its payload from ``bodies``, checked
    and decoded (:func:`broker.storage.check_payload`, which raises
    :class:`~broker.storage.PayloadIntegrityError` for one that fails); returns the
    positions it decoded."""
    job_id = values[_ID_AT]
    loaded: set[int] = set()
    for i, column in _PAYLOAD_POSITIONS:
        if values[i] != OFFLOADED:
            continue
        if bodies is None:
            values[i] = HOLLOW[column]
            continue
        stored = bodies.get((job_id, column))
        if stored is None:
            # The payload and its mark are written and deleted together: a reader that read
            # the row and the payloads apart reads both again when they disagree
            # (SQLAlchemyAdapter._read_with_bodies); only a hand-edited store gets here.
            # Saying so beats returning a job with its arguments gone.
            raise StorageError(f"job {job_id}: its offloaded {column} is missing")
        values[i] = check_payload(job_id, column, *stored, _DECODE_AT[i])
        loaded.add(i)
    return loaded


def _claimed_jobs(
    claims: Collection[Claim], rows: Sequence[Any], build: Callable[[Any], Job]
) -> tuple[list[Job], list[Settlement]]:
    """The jobs of the ``rows`` a claim handed off (each built by ``build``), and the
    settlements that fail dead, under its claim's lease, each job whose offloaded value
    failed its check (:func:`broker.settlement.payload_refused`).

    The rows are built all at once first, as before; only when one fails its check are
    they built again one by one: a claim whose payloads pass costs what it did, and one
    bad value no longer fails the claim of every batch that holds it."""
    try:
        return [build(r) for r in rows], []
    except PayloadIntegrityError:
        pass
    by_id = {claim.job_id: claim for claim in claims}
    won: list[Job] = []
    refused: list[Settlement] = []
    for row in rows:
        try:
            won.append(build(row))
        except PayloadIntegrityError as exc:
            claim = by_id[exc.job_id]
            log_refused_at_claim(claim, exc)
            refused.append(settlement.payload_refused(claim, exc))
    return won, refused


def _whole_jobs(rows: Sequence[Mapping[Any, Any]], bodies: Bodies) -> list[Job]:
    """The jobs of ``rows`` whose payloads ``bodies`` holds; a job whose payload went
    between the two reads (its checkpoint replaced meanwhile) is left out, as if it were
    gone: an enqueue looking for the job holding its key then tries again
    (:meth:`SQLAlchemyAdapter._insert_or_find`), and reads it as it now stands."""
    return [_job_from_row(r, bodies) for r in rows if not _lacks_body(r, bodies)]


def _bodies_missing(rows: Sequence[Mapping[Any, Any]], bodies: Bodies) -> bool:
    """Whether a row of ``rows`` marks a payload that ``bodies`` lacks."""
    return any(_lacks_body(row, bodies) for row in rows)


def _lacks_body(row: Mapping[Any, Any], bodies: Bodies) -> bool:
    """Whether ``row`` marks a payload that ``bodies`` lacks."""
    return _is_offloaded(row) and any(
        row[column] == OFFLOADED and (row["id"], column) not in bodies for column in OFFLOADABLE
    )


Payload = tuple[uuid.UUID, str, str, str]
"""One ``broker_payloads`` row: ``(job id, column, text, its SHA-256)``."""


def _offload(
    job_id: uuid.UUID, row: dict[str, Any], threshold: int | None
) -> tuple[dict[str, Any], list[Payload]]:
    """``row`` with every payload column longer than ``threshold`` moved out: the column
    holds the :data:`OFFLOADED` mark instead, and its text comes back as a payload row.

    ``row`` itself is left alone (a copy is made only when something moves). Texts are
    ASCII (escaped JSON), so their length is their size in bytes. Each moved text
    carries its SHA-256, which every load checks.
    """
    if threshold is None:
        return row, []
    moved = [
        (job_id, column, text, payload_digest(text))
        for column in OFFLOADABLE
        if (text := row.get(column)) is not None and len(text) > threshold
    ]
    if not moved:
        return row, moved
    return {**row, **{column: OFFLOADED for _, column, _, _ in moved}}, moved


Insert = Callable[[list[dict[str, Any]], list[Payload]], Awaitable[set[uuid.UUID]]]
"""Stores rows unless a key or id is taken, with the offloaded payloads of those it
stored; returns the ids stored."""
Overlap = Callable[
    [Insert, Iterator[tuple[list[dict[str, Any]], list[Payload]]]], Awaitable[set[uuid.UUID]]
]

_OVERLAP_CHUNK = 250
"""Jobs per statement where a batch's rows are built while the rows before are written."""


async def _overlapped(
    insert: Insert, batches: Iterator[tuple[list[dict[str, Any]], list[Payload]]]
) -> set[uuid.UUID]:
    """``insert`` each of ``batches`` in turn (on one connection, in one transaction), the
    next one built while the server writes the one before. Taking the next batch from
    the iterator builds it: the jobs and rows of a bulk enqueue cost the main about as
    much CPU as their insert costs the server, and one statement for the whole batch
    made each wait for the other. A statement is never left running: an error or a
    cancellation waits for the one in flight (cancelled, for a cancellation)."""
    stored: set[uuid.UUID] = set()
    ahead: asyncio.Future[set[uuid.UUID]] | None = None
    try:
        for rows, moved in batches:
            if ahead is not None:
                stored |= await ahead
            ahead = asyncio.ensure_future(insert(rows, moved))
            await asyncio.sleep(0)  # its statement goes out before the next batch is built
        if ahead is not None:
            stored |= await ahead
    except BaseException as exc:
        if ahead is not None and not ahead.done():
            if isinstance(exc, asyncio.CancelledError):
                ahead.cancel()
            await asyncio.wait([ahead])
            if not ahead.cancelled():
                ahead.exception()  # retrieved: the error raised here is the one that counts
        raise
    return stored


def _kept(moved: Sequence[Payload], stored: Collection[uuid.UUID]) -> list[Payload]:
    """The payloads of the jobs whose row was written (``stored``): a job fenced out or
    found a duplicate writes none."""
    return [p for p in moved if p[0] in stored]


def _columns(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Job field values keyed and encoded as ``broker_jobs`` columns (in one pass: every
    report and claim passes here)."""
    return {_COLUMN_OF[name]: _ENCODE[name](value) for name, value in changes.items()}


_ROW_ENCODED = [(column, encode) for _, column, encode, _ in _FIELDS if encode is not _same]
_ROWS_JSON = msgspec.json.Encoder()
"""Rows for PostgreSQL's enqueue (:mod:`adapters._pg_hot`): column values as JSON (ids
as text; the values are the columns' own, so nothing is lost on the way)."""


def _new_row(job_fields: Mapping[str, Any]) -> dict[str, Any]:
    """The columns of a new job's row that are not NULL (what an enqueue inserts: a
    column left out is NULL), from the job's fields by name, those at their defaults
    left out (:func:`~broker.settlement.enqueued_fields`). Most of a new job's are NULL;
    PostgreSQL's enqueue sends its rows as JSON (``json_to_recordset`` reads an absent
    key as NULL), and the nulls were half its text: encoded by the main, sent and parsed
    by the server for nothing. Columns held as is are copied without a call each: every
    enqueued job passes here. No encoding turns a value into NULL or NULL into a value."""
    row = {
        **_DEFAULT_ROW,
        **{_COLUMN_OF[name]: v for name, v in job_fields.items() if v is not None},
    }
    for column, encode in _ROW_ENCODED:
        value = row.get(column)
        if value is not None:
            row[column] = encode(value)
    return row


_DEFAULT_ROW = {
    _COLUMN_OF[name]: value for name, value in JOB_DEFAULTS.items() if value is not None
}
"""The columns of the :class:`Job` fields whose default is not NULL, at it (not yet
encoded): under every new row."""


_NULL_ROW = dict.fromkeys(_ROW_COLUMNS)
"""Every column NULL: under the columns :func:`_new_row` leaves out, for an insert that
names every column in every row (SQLAlchemy's, PostgreSQL's one-job insert)."""
_INSERT_VALUES = operator.itemgetter(*INSERT_COLUMNS)
"""A full row's values in :data:`INSERT_COLUMNS` order, in one C call."""


def _chunks(items: Sequence[_T], size: int = _CHUNK) -> list[Sequence[_T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _encode_cursor(created_us: int, job_id: uuid.UUID) -> str:
    raw = f"{created_us}.{job_id.hex}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[int, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created, _, hex_id = raw.partition(".")
        return int(created), uuid.UUID(hex=hex_id)
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"invalid list_jobs cursor {cursor!r}") from exc


_REJECTED_SQLSTATE_CLASSES = ("22", "23", "54")
"""PostgreSQL error classes about the data itself: data exceptions (22, such as a NUL in
text), integrity constraint violations (23) and program limits (54, such as a value too
long for an index entry). Anything else (a lost connection, a timeout, a deadlock, a
missing table or grant) may succeed later and is retried."""


def _rejects_value(exc: BaseException) -> bool:
    """Whether the database refused the data itself, so the same call fails every time.

    ``exc`` comes wrapped by SQLAlchemy, or straight from asyncpg on the hot path
    (:mod:`adapters._pg_hot`), where a server error carries its SQLSTATE itself.
    """
    cause: object = exc
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return False
        if isinstance(exc, sa_exc.DataError | sa_exc.IntegrityError):
            return True
        cause = exc.orig
    sqlstate = getattr(cause, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate[:2] in _REJECTED_SQLSTATE_CLASSES


def _redact(url: URL) -> str:
    # SQLAlchemy hides only what it parsed as the password: of "u:p@ss@host" it shows
    # "u:***@ss@host". The shared rule hides up to the last "@", and query passwords.
    return redact_url(url.render_as_string(hide_password=True))


def _require_driver(module: str, url: URL) -> Any:
    """Import a DB driver, turning its absence into a message that says what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDriverError(
            f"the store URL {_redact(url)} needs the {module!r} driver, which is not "
            f"installed: pip install {module}"
        ) from exc


def _resolve_url(raw: str) -> tuple[URL, str]:
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


def _main_lock(url: URL) -> MainLock | None:
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


def _existing_file_url(url: URL, *, read_only: bool) -> URL:
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
    if conn.get_execution_options().get(_WRITE_OPTION):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.exec_driver_sql("BEGIN")


def _match_holders(specs: Sequence[JobSpec], found: list[Job]) -> list[Job | None]:
    """For each spec that did not insert, the job among ``found`` that blocked it: the
    holder of its idempotency key, else the job with its id, else the *active* holder of
    its unique key (the same order the in-memory store checks them in)."""
    by_key = {j.idempotency_key: j for j in found if j.idempotency_key is not None}
    by_id = {j.id: j for j in found}
    by_unique = {j.unique_key: j for j in found if j.unique_key is not None and j.status.is_active}
    holders: list[Job | None] = []
    for spec in specs:
        job = by_key.get(spec.idempotency_key) if spec.idempotency_key else None
        if job is None:
            job = by_id.get(spec.id)
        if job is None and spec.unique_key is not None:
            job = by_unique.get(spec.unique_key)
        holders.append(job)
    return holders


def _grant(
    candidates: list[tuple[uuid.UUID, str | None, int | None]],
    order: list[uuid.UUID],
    active: Mapping[str, int],
) -> tuple[list[uuid.UUID], dict[str, int]]:
    """Which locked candidates ``(id, concurrency key, limit)`` a claim may hand off, given
    each key's ``active`` count: every unkeyed one, and keyed ones in claim ``order``
    while their key has room. Also returns the slots taken per key."""
    rank = {job_id: i for i, job_id in enumerate(order)}
    granted = [job_id for job_id, key, _ in candidates if key is None]
    taken: dict[str, int] = {}
    for job_id, key, limit in sorted(candidates, key=lambda c: rank[c[0]]):
        if key is not None and limit is not None and active[key] + taken.get(key, 0) < limit:
            granted.append(job_id)
            taken[key] = taken.get(key, 0) + 1
    return granted, taken


async def _pg_bodies(sql: HotSql, conn: Any, rows: Sequence[Mapping[Any, Any]]) -> Bodies:
    """The offloaded payloads of ``rows`` (an asyncpg connection), in one query."""
    wanted = [r["id"] for r in rows if _is_offloaded(r)]
    if not wanted:
        return {}
    found = await conn.fetch(sql.payloads_of, wanted)
    return {(r["job_id"], r["kind"]): (r["body"], r["digest"]) for r in found}


async def _pg_put(sql: HotSql, conn: Any, moved: Sequence[Payload]) -> None:
    """Write payload rows on an asyncpg connection, replacing any of the same kind."""
    if moved:
        await conn.execute(sql.put_payloads, *(list(column) for column in zip(*moved, strict=True)))


async def _sa_bodies(conn: AsyncConnection, rows: Sequence[Mapping[Any, Any]]) -> Bodies:
    """The offloaded payloads of ``rows`` (a SQLAlchemy connection, or an application's
    connection that offers ``mappings()`` as :mod:`adapters._sql_statements` describes)."""
    wanted = [r["id"] for r in rows if _is_offloaded(r)]
    bodies: dict[tuple[uuid.UUID, str], tuple[str, str | None]] = {}
    for chunk in _chunks(wanted):
        found = await conn.execute(sa.select(payloads).where(payloads.c.job_id.in_(chunk)))
        bodies.update(
            {(r["job_id"], r["kind"]): (r["body"], r["digest"]) for r in found.mappings()}
        )
    return bodies


_COMPLETED = JobStatus.COMPLETED.value


def _completions_only(columns: list[list[Any]], now_us: int) -> bool:
    """Whether the settle statement's arrays (see ``HotSql.settle``) are completions
    alone, each moving exactly as ``HotSql.settle_completed`` does: status completed,
    its result set, nothing else changed but ``updated_us`` (the batch's one time), no
    attempt or recovery counted, its slot given back."""
    (_, _, status, set_result, _, set_error, _, run_at, attempts, updated, releases) = columns[:11]
    recoveries, set_holder = columns[11], columns[12]
    return (
        all(v == _COMPLETED for v in status)
        and all(set_result)
        and all(releases)
        and all(v == now_us for v in updated)
        and all(v is None for v in run_at)
        and not any(set_error)
        and not any(attempts)
        and not any(recoveries)
        and not any(set_holder)
    )


def _claim_arrays(claims: Sequence[Claim]) -> tuple[list[uuid.UUID], list[uuid.UUID], list[str]]:
    """Claims as the ``unnest`` arrays of the hot claim statements."""
    return [c.job_id for c in claims], [c.handoff_id for c in claims], [c.worker_id for c in claims]


def _lite_value(value: Any) -> Any:
    """A value as SQLAlchemy's ``Uuid`` stores it on SQLite (32 hex digits), else as is."""
    return value.hex if isinstance(value, uuid.UUID) else value


_LITE_COLUMNS = ", ".join(_ROW_COLUMNS)
"""What SQLite's hot statements select or return of a job: every column, in :class:`Job`'s
field order, so a row is decoded by position (:func:`_lite_job`)."""
_LITE_IDS = [_ROW_COLUMNS.index(column) for column in ("id", "handoff_id")]


def _lite_job(row: Sequence[Any], bodies: Bodies | None = None) -> Job:
    """A :class:`Job` from a row of :data:`_LITE_COLUMNS` (its ids are hex text)."""
    values = list(row)
    for i in _LITE_IDS:
        if values[i] is not None:
            values[i] = uuid.UUID(hex=values[i])
    return _job_from_values(values, bodies)


def _lite_bodies(conn: sqlite3.Connection, rows: Sequence[Sequence[Any]]) -> Bodies:
    """The offloaded payloads of ``rows`` (of :data:`_LITE_COLUMNS`), in one query."""
    wanted = [r[_ID_AT] for r in rows if OFFLOADED in _PAYLOADS_AT(r)]
    if not wanted:
        return {}
    found = conn.execute(
        "SELECT job_id, kind, body, digest FROM broker_payloads "
        "WHERE job_id IN (SELECT value FROM json_each(?))",
        (json.dumps(wanted),),
    )
    return {(uuid.UUID(hex=job_id), kind): (body, digest) for job_id, kind, body, digest in found}


def _lite_put(conn: sqlite3.Connection, moved: Sequence[Payload]) -> None:
    """Write payload rows on SQLite's hot connection, replacing any of the same kind."""
    if not moved:
        return
    conn.executemany(
        "INSERT INTO broker_payloads (job_id, kind, body, digest) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (job_id, kind) DO UPDATE SET body = excluded.body, digest = excluded.digest",
        [(job_id.hex, kind, body, digest) for job_id, kind, body, digest in moved],
    )


def _lite_update(move: settlement.Move, where: str) -> tuple[str, list[str]]:
    """An ``UPDATE`` of ``broker_jobs`` carrying out ``move`` (its fields bound in the order
    returned, then ``where``'s); the same text for every move of one shape, so the
    ``sqlite3`` statement cache prepares it once."""
    columns = sorted(_COLUMN_OF[name] for name in move.changes)
    return f"UPDATE broker_jobs SET {_lite_sets(move, columns, '?')} WHERE {where}", columns


def _lite_sets(move: settlement.Move, columns: list[str], value: str) -> str:
    """The ``SET`` list carrying out ``move``: each of ``columns`` (its changes) to
    ``value`` (formatted with the column's name), and the counters it adds to."""
    sets = [f"{column} = {value.format(column)}" for column in columns]
    if move.counts_attempt:
        sets.append("attempts = attempts + 1")
    if move.counts_recovery:
        sets.append("recoveries = recoveries + 1")
    return ", ".join(sets)


def _lite_update_batch(
    move: settlement.Move, keys: Sequence[str], where: str, returning: str
) -> tuple[str, list[str]]:
    """An ``UPDATE`` carrying out moves of ``move``'s shape on a batch of rows, in one
    statement: the JSON array bound as ``?1`` holds an array per row, its ``keys`` first
    (``where`` reads them as ``w.<key>``), then its move's values of the columns returned;
    the statement returns ``returning`` of each row it changed.
    One statement for the batch, instead of one per row (and a claim's ``SELECT`` of
    the rows first), is the larger part of why SQLite's thread went from 0.16 to 0.07 ms
    of CPU per job in a pooled drain; the text is the same for every batch of one
    shape, so it is prepared once."""
    columns = sorted(_COLUMN_OF[name] for name in move.changes)
    names = [*keys, *(f"new_{column}" for column in columns)]
    source = ", ".join(f"json_extract(value, '$[{i}]') AS {n}" for i, n in enumerate(names))
    return (
        f"UPDATE broker_jobs SET {_lite_sets(move, columns, 'w.new_{}')} "
        f"FROM (SELECT {source} FROM json_each(?1)) AS w WHERE {where} "
        f"RETURNING {returning}",
        columns,
    )


_LITE_RETURNING = ", ".join(f"broker_jobs.{column}" for column in _ROW_COLUMNS)
_LITE_ROWS = msgspec.json.Encoder()
"""The rows of a batched statement (:func:`_lite_update_batch`) as the JSON text bound."""


def _hand_off_rows(claims: Sequence[Claim], now: datetime, where: str) -> tuple[str, str]:
    """The hand-off of ``claims`` as one batched ``UPDATE`` of the due queued rows that
    also meet ``where`` (``now``'s microseconds bound as ``?2``), returning them as now
    stored: the statement for their shape and its JSON rows."""
    rows = []
    update = ""
    for claim in claims:
        move = settlement.hand_off(claim, now)
        if not update:
            update, columns = _lite_update_batch(
                move,
                ["w_id"],
                f"broker_jobs.id = w.w_id AND status = 'queued' AND run_at_us <= ?2{where}",
                _LITE_RETURNING,
            )
        values = _columns(move.changes)
        rows.append([claim.job_id.hex, *(_lite_value(values[c]) for c in columns)])
    return update, _LITE_ROWS.encode(rows).decode()


_LITE_DUE = "status = 'queued' AND execution_mode IN (SELECT value FROM json_each(?1))"
_LITE_IN_QUEUES = " AND queue IN (SELECT value FROM json_each(?2))"
_LITE_NEXT_RUN = f"SELECT min(run_at_us) FROM broker_jobs WHERE {_LITE_DUE}"
_LITE_NEXT_RUN_IN_QUEUES = _LITE_NEXT_RUN + _LITE_IN_QUEUES


def _lite_eligible(queue_test: str) -> str:
    """SQLite's selection: the best due jobs of the modes in ``?1`` (and queues in ``?2``)
    whose concurrency key has room, but those in the skipped ids (``?5``), at most ``?4``
    (``?3`` is the time now), their payloads left out (see ``_sql_schema.selection``).
    The dispatch index gives them in order: its predicate is the status test here,
    written as the index's own (a literal), so no sort step is needed; ``rowid`` (the
    index's own last column) breaks ties in enqueue order."""
    return f"""
        SELECT {selection(_ROW_COLUMNS, "j.")} FROM broker_jobs AS j
        WHERE {_LITE_DUE}{queue_test} AND run_at_us <= ?3
            AND NOT EXISTS (
                SELECT 1 FROM broker_concurrency AS c
                WHERE c.key = j.concurrency_key AND c.active >= j.concurrency_limit
            )
            AND id NOT IN (SELECT value FROM json_each(?5))
        ORDER BY priority DESC, run_at_us, created_us, seq, j.rowid
        LIMIT ?4
    """


_LITE_ELIGIBLE = _lite_eligible("")
_LITE_ELIGIBLE_IN_QUEUES = _lite_eligible(_LITE_IN_QUEUES)


def _lite_wanted(
    modes: Collection[ExecutionMode], queues: Collection[str] | None
) -> tuple[Any, ...]:
    """The modes (``?1``) and queues (``?2``, if any) of SQLite's dispatch reads."""
    wanted = json.dumps(sorted({ExecutionMode(m).value for m in modes}))
    return wanted, None if queues is None else json.dumps(sorted(set(queues)))


_LITE_INSERT_ROWS = 25
"""Most rows in one of SQLite's ``INSERT`` statements (``25 x 32`` parameters stay under
the 999 of SQLite before 3.32). A statement per row cost an ``enqueue_many`` of 1,000
jobs 0.057 ms of CPU per job, 25 rows a statement 0.047 (100 measured no better)."""


@functools.lru_cache(maxsize=_LITE_INSERT_ROWS)
def _lite_insert(rows: int) -> str:
    """SQLite's insert of ``rows`` jobs (each binding :data:`INSERT_COLUMNS` in order) that
    stores those whose id and keys are free, in the order given, and returns their ids."""
    marks = f"({', '.join('?' * len(INSERT_COLUMNS))})"
    return (
        f"INSERT INTO broker_jobs ({', '.join(INSERT_COLUMNS)}) "
        f"VALUES {', '.join([marks] * rows)} ON CONFLICT DO NOTHING RETURNING id"
    )


def _claim_lite(conn: sqlite3.Connection, claims: list[Claim], now_us: int) -> list[Job]:
    """SQLite's claim, one transaction: the due queued rows among the claims that have no
    concurrency key, handed off in one statement; then, if any claim is left over, the
    keyed ones among those, the counters of their keys, and the hand-off of the ones
    granted. (Granting the unkeyed jobs first changes nothing: they take no slot.)"""
    now = _from_us(now_us)
    update, batch = _hand_off_rows(claims, now, " AND concurrency_key IS NULL")
    rows = conn.execute(update, (batch, now_us)).fetchall()
    taken = {r[_ID_AT] for r in rows}
    rest = [c for c in claims if c.job_id.hex not in taken]
    if rest:
        rows += _claim_keyed_lite(conn, rest, now_us, now)
    won, refused = _claimed_jobs(
        claims, rows, functools.partial(_lite_job, bodies=_lite_bodies(conn, rows))
    )
    if refused:  # in the claim's transaction: the job is never seen handed off
        _settle_lite(conn, refused, now_us, None)
    order = {claim.job_id: i for i, claim in enumerate(claims)}
    return sorted(won, key=lambda job: order[job.id])


def _claim_keyed_lite(
    conn: sqlite3.Connection, claims: list[Claim], now_us: int, now: datetime
) -> list[Any]:
    """The keyed due queued rows among ``claims``, granted while their keys have room
    (:func:`_grant`) and handed off, their slots taken; returns the rows as now stored."""
    found = conn.execute(
        "SELECT id, concurrency_key, concurrency_limit FROM broker_jobs "
        "WHERE id IN (SELECT value FROM json_each(?)) AND status = 'queued' "
        "AND run_at_us <= ? AND concurrency_key IS NOT NULL",
        (json.dumps([c.job_id.hex for c in claims]), now_us),
    ).fetchall()
    if not found:
        return []
    keys = sorted({key for _, key, _ in found})
    conn.executemany(
        "INSERT INTO broker_concurrency (key, active) VALUES (?, 0) ON CONFLICT (key) DO NOTHING",
        [(k,) for k in keys],
    )
    counters = conn.execute(
        "SELECT key, active FROM broker_concurrency WHERE key IN (SELECT value FROM json_each(?))",
        (json.dumps(keys),),
    )
    granted, taken = _grant(
        [(uuid.UUID(hex=job_id), key, limit) for job_id, key, limit in found],
        [c.job_id for c in claims],
        dict(counters.fetchall()),
    )
    if not granted:
        return []
    chosen = set(granted)
    update, batch = _hand_off_rows([c for c in claims if c.job_id in chosen], now, "")
    rows = conn.execute(update, (batch, now_us)).fetchall()
    conn.executemany(
        "UPDATE broker_concurrency SET active = active + ? WHERE key = ?",
        [(n, key) for key, n in sorted(taken.items())],
    )
    return rows


def _settle_lite(
    conn: sqlite3.Connection,
    settlements: Sequence[Settlement],
    now_us: int,
    offload_threshold: int | None,
) -> list[bool]:
    """SQLite's settle, one transaction: a fenced ``UPDATE`` per shape of move, for all the
    batch's moves of that shape (only the first move per job in a batch can be
    accepted), then the slots given back in key order. A result over
    ``offload_threshold`` is written to ``broker_payloads`` only when its move is
    accepted, in the same transaction."""
    now = _from_us(now_us)
    first: dict[uuid.UUID, int] = {}
    for i, s in enumerate(settlements):
        first.setdefault(s.job_id, i)
    shapes: dict[tuple[Any, ...], tuple[str, list[str], bool, list[list[Any]]]] = {}
    moved: list[Payload] = []
    for i in first.values():
        s = settlements[i]
        move = settlement.settle(s, now)
        shape = (*move.shape, move.releases_slot)
        batch = shapes.get(shape)
        if batch is None:
            update, columns = _lite_update_batch(
                move,
                ["w_id", "w_lease"],
                "broker_jobs.id = w.w_id AND handoff_id = w.w_lease AND status = 'handed_off'",
                "broker_jobs.id, broker_jobs.concurrency_key",
            )
            batch = shapes[shape] = (update, columns, move.releases_slot, [])
        values, offloaded = _offload(s.job_id, _columns(move.changes), offload_threshold)
        moved += offloaded
        batch[3].append([s.job_id.hex, s.handoff_id.hex, *(values[c] for c in batch[1])])
    accepted: set[str] = set()
    released: Counter[str] = Counter()
    for update, _, releases, rows in shapes.values():
        for job_id, key in conn.execute(update, (_LITE_ROWS.encode(rows).decode(),)):
            accepted.add(job_id)
            if releases and key is not None:
                released[key] += 1
    _lite_put(conn, [p for p in moved if p[0].hex in accepted])
    conn.executemany(
        "UPDATE broker_concurrency SET active = MAX(active - ?, 0) WHERE key = ?",
        [(n, key) for key, n in sorted(released.items())],
    )
    return [first[s.job_id] == i and s.job_id.hex in accepted for i, s in enumerate(settlements)]


def _save_checkpoints_lite(
    conn: sqlite3.Connection,
    saves: Sequence[CheckpointSave],
    now_us: int,
    offload_threshold: int | None,
) -> list[bool]:
    """SQLite's checkpoints, one transaction: a fenced ``UPDATE`` each, in order (so of
    two saves of one lease in a batch, the later and newer one ends up stored). A saved
    checkpoint over ``offload_threshold`` replaces the job's checkpoint payload; one kept
    in its row deletes it, so the checkpoint it replaces is never left behind."""
    now = _from_us(now_us)
    saved = []
    for save in saves:
        move = settlement.save_checkpoint(save, now)
        update, columns = _lite_update(
            move, "id = ? AND handoff_id = ? AND status = 'handed_off' AND checkpoint_seq < ?"
        )
        values, moved = _offload(save.job_id, _columns(move.changes), offload_threshold)
        fence = [save.job_id.hex, save.handoff_id.hex, save.seq]
        taken = conn.execute(update, [values[c] for c in columns] + fence).rowcount == 1
        if taken and moved:
            _lite_put(conn, moved)
        elif taken:
            conn.execute(
                "DELETE FROM broker_payloads WHERE job_id = ? AND kind = 'checkpoint'",
                (save.job_id.hex,),
            )
        saved.append(taken)
    return saved


def _save_progress_lite(conn: sqlite3.Connection, updates: Sequence[ProgressUpdate]) -> list[bool]:
    return [
        _update_lite(
            conn,
            settlement.record_progress(update),
            "id = ? AND handoff_id = ? AND status = 'handed_off'",
            [update.job_id.hex, update.handoff_id.hex],
        )
        for update in updates
    ]


def _update_lite(
    conn: sqlite3.Connection, move: settlement.Move, where: str, fence: list[Any]
) -> bool:
    """Carry out ``move`` under the fence ``where`` (bound to ``fence``); says whether the
    row matched."""
    update, columns = _lite_update(move, where)
    values = _columns(move.changes)
    return conn.execute(update, [values[c] for c in columns] + fence).rowcount == 1


# --------------------------------------------------------------------------- adapter


class SQLAlchemyAdapter:
    """A :class:`~broker.storage.StorageAdapter` on SQLite (a file) or PostgreSQL.

    ``schema`` (PostgreSQL only) puts the tables in that schema, creating it if needed.
    ``max_payload_bytes`` caps a job's args and kwargs (as JSON) in
    :meth:`enqueue_in_transaction`, which does not pass through the main's own check;
    ``None`` turns the cap off. ``pool_size`` is the general pool (enqueues, listings,
    operator calls; up to 10 more connections under load); on PostgreSQL,
    ``hot_pool_size`` more connections serve claims, settles and selection alone (see
    :mod:`adapters._pg_hot`), and up to ``pool_size`` more the main's enqueues (opened
    as needed; its group commit uses one at a time). Call :meth:`setup` before use and
    :meth:`close` when done.

    ``create=False`` opens only a store that exists (a SQLite file is never created) and
    ``read_only=True`` also refuses every write (PostgreSQL: read-only transactions);
    such a handle is checked with :meth:`check_schema`, never set up. The operator's
    command opens stores this way.

    ``single_main=True`` is for a broker-main: on a SQLite file, :meth:`setup` takes the
    file lock of :mod:`adapters._sqlite_lock` (a second main on the file is refused) and
    :meth:`close` drops it. On PostgreSQL, its enqueues then notify no listener: the
    main wakes its own dispatcher after each (other processes' inserts still notify).

    ``offload_threshold``: a job's args, kwargs, result or checkpoint longer than this many
    bytes (as stored JSON) is kept in ``broker_payloads`` instead of its ``broker_jobs``
    row, so the rows that claims and settles rewrite stay small; ``None`` keeps every
    value inline.
    """

    def __init__(
        self,
        url: str,
        *,
        clock: Clock = utcnow,
        schema: str | None = None,
        pool_size: int = DEFAULT_POOL_SIZE,
        hot_pool_size: int = DEFAULT_HOT_POOL_SIZE,
        echo: bool = False,
        max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
        create: bool = True,
        read_only: bool = False,
        single_main: bool = False,
        offload_threshold: int | None = DEFAULT_OFFLOAD_BYTES,
    ) -> None:
        resolved, backend = _resolve_url(url)
        self._create = create and not read_only
        for name, size in (("pool_size", pool_size), ("hot_pool_size", hot_pool_size)):
            if size < 1:
                raise ConfigurationError(f"{name} must be at least 1 (got {size})")
        if max_payload_bytes is not None and max_payload_bytes < 1:
            raise ConfigurationError(
                f"max_payload_bytes must be positive or None (got {max_payload_bytes})"
            )
        self._max_payload_bytes = max_payload_bytes
        if offload_threshold is not None and offload_threshold < 0:
            raise ConfigurationError(
                f"offload_threshold must not be negative, or None (got {offload_threshold})"
            )
        self._offload_threshold = offload_threshold
        self._clock = clock
        self._backend = backend
        self._pg = backend == "postgresql"
        self._url_text = _redact(resolved)
        if self._pg:
            driver = _require_driver("asyncpg", resolved)
            self._errors: tuple[type[BaseException], ...] = (
                sa_exc.DBAPIError,
                sa_exc.TimeoutError,
                OSError,
                driver.PostgresError,
                driver.InterfaceError,
            )
            self._server_refused: type[BaseException] = driver.PostgresError
            """A statement the server refused: the session is fine, nothing was written."""
            # An argument asyncpg cannot encode (say, an integer beyond BIGINT) is a
            # value the store can never hold, as the server's data errors are.
            self._client_rejects: tuple[type[BaseException], ...] = (
                driver.exceptions._base.DataError,
            )
        else:
            _require_driver("aiosqlite", resolved)
            self._errors = (sa_exc.DBAPIError, sa_exc.TimeoutError, OSError, sqlite3.Error)
            # What the hot path's sqlite3 raises where SQLAlchemy would say DataError or
            # IntegrityError: the value, not the moment, is at fault.
            self._client_rejects = (sqlite3.IntegrityError, sqlite3.DataError)
            if schema is not None:
                raise ConfigurationError(
                    "the schema option is for PostgreSQL only; a SQLite store is one file"
                )
        self._schema = schema
        self._epoch: int | None = None
        """The leader's epoch every claim and settle is fenced with (see :meth:`fence`)."""
        self._on_fenced: Callable[[str], None] | None = None
        self._unanalyzed_inserts = 0
        self._last_analyze = -math.inf
        self._analyzing: asyncio.Task[None] | None = None
        options: dict[str, Any] = {}
        connect_args: dict[str, Any] = {}
        if self._pg:
            connect_args["server_settings"] = {"application_name": "broker"}
            if read_only:
                connect_args["server_settings"]["default_transaction_read_only"] = "on"
            if schema is not None:
                options["schema_translate_map"] = {None: schema}
        self._sqlite_file: str | None = None
        """The SQLite file that must exist already (``create=False``), if it is a path."""
        self._main_lock = _main_lock(resolved) if single_main else None
        """Held from :meth:`setup` to :meth:`close` by a main on a SQLite file
        (``single_main``), so a second main on that file refuses to start."""
        if not self._pg and not self._create:
            if resolved.database and not resolved.query.get("uri"):
                self._sqlite_file = resolved.database
            resolved = _existing_file_url(resolved, read_only=read_only)
        self._engine: AsyncEngine = create_async_engine(
            resolved,
            echo=echo,
            pool_size=pool_size,
            execution_options=options,
            connect_args=connect_args,
        )
        if self._pg:
            self._write_engine = self._engine
            self._read_engine = self._engine.execution_options(isolation_level="AUTOCOMMIT")
            self._write_lock: AbstractAsyncContextManager[Any] = contextlib.nullcontext()
            from adapters._pg_hot import HotPool, HotSql

            _, connect_kwargs = self._engine.dialect.create_connect_args(resolved)
            hot = HotPool(hot_pool_size, {**connect_kwargs, **connect_args})
            self._hot: tuple[HotSql, HotPool] | None = (HotSql(schema), hot)
            # A main's own enqueues wake its dispatcher themselves: their sessions skip
            # the insert notification (QUIET_INSERTS_SETTING), which only came back to it.
            quiet = {QUIET_INSERTS_SETTING: "on"} if single_main else {}
            enqueue_args = {
                **connect_args,
                "server_settings": {**connect_args["server_settings"], **quiet},
            }
            self._enqueue_pool: HotPool | None = HotPool(
                pool_size, {**connect_kwargs, **enqueue_args}
            )
            self._leader_pool: HotPool | None = HotPool(1, {**connect_kwargs, **connect_args})
            """The election's own connection (opened by a main's first round only), so a
            renewal never queues behind claims and settles for a connection."""
            self._lite: SqliteHot | None = None
            self._lite_reads: SqliteHot | None = None
        else:
            self._write_lock = asyncio.Lock()
            self._lite, self._lite_reads = self._wire_sqlite(resolved, read_only)
            self._write_engine = self._engine.execution_options(**{_WRITE_OPTION: True})
            self._read_engine = self._engine
            self._hot = None
            self._enqueue_pool = None
            self._leader_pool = None
        self._insert = pg_dialect.insert if self._pg else sqlite_dialect.insert

    def _wire_sqlite(self, resolved: URL, read_only: bool) -> tuple[SqliteHot, SqliteHot]:
        """Set up every SQLite connection alike, the engine's and the hot path's own: one
        for its writes and one for dispatch's reads, which thus never wait for a write's
        commit (WAL lets them read beside it)."""
        path = resolved.database
        # A file: URI is the operator's own, and a handle without the right to create
        # creates nothing.
        private = path if self._create and path and not resolved.query.get("uri") else None

        def before_connect(*_: object) -> None:
            if private is not None:
                _create_private(private)

        on_connect = _sqlite_on_connect if self._create else _sqlite_on_connect_existing(read_only)
        event.listen(self._engine.sync_engine, "do_connect", before_connect)
        event.listen(self._engine.sync_engine, "connect", on_connect)
        event.listen(self._engine.sync_engine, "begin", _sqlite_on_begin)
        connect_args = self._engine.dialect.create_connect_args(resolved)
        return (
            SqliteHot(
                connect_args, before_connect, on_connect, "broker-sqlite-hot", self._write_lock
            ),
            SqliteHot(connect_args, before_connect, on_connect, "broker-sqlite-reads"),
        )

    def __repr__(self) -> str:
        schema = f", schema={self._schema!r}" if self._schema else ""
        return f"SQLAlchemyAdapter({self._url_text!r}{schema})"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            skip_locked=self._pg,
            listen_notify=self._pg,
            shared_between_processes=True,
            leader_election=self._pg,
        )

    @property
    def offload_threshold(self) -> int | None:
        return self._offload_threshold

    async def count_payloads(self) -> int:
        stmt = sa.select(sa.func.count()).select_from(payloads)
        async with self._read("count_payloads") as conn:
            return int((await conn.execute(stmt)).scalar_one())

    # ------------------------------------------------------------------ plumbing

    def _now(self) -> int:
        return _to_us(self._clock())

    def _storage_error(self, op: str, exc: BaseException) -> StorageError:
        cause = exc.orig if isinstance(exc, sa_exc.DBAPIError) and exc.orig else exc
        if getattr(cause, "sqlstate", None) == FENCED_SQLSTATE:
            if self._on_fenced is not None:
                self._on_fenced(op)
            return DeposedError(
                f"{op} refused by the epoch fence on {self._url_text}: {cause} (another "
                "main took over; nothing was changed)"
            )
        rejected = _rejects_value(exc) or isinstance(exc, self._client_rejects)
        kind = StorageRejectedError if rejected else StorageError
        return kind(f"{op} failed on {self._url_text}: {type(cause).__name__}: {cause}")

    @asynccontextmanager
    async def _write(self, op: str) -> AsyncIterator[AsyncConnection]:
        """One write transaction; driver errors come out as :class:`StorageError`."""
        try:
            async with self._write_lock, self._write_engine.begin() as conn:
                yield conn
        except self._errors as exc:
            raise self._storage_error(op, exc) from exc

    @asynccontextmanager
    async def _hot_conn(self, op: str) -> AsyncIterator[tuple[HotSql, Any]]:
        """A connection of the hot pool (PostgreSQL), for claims, settles and selection."""
        assert self._hot is not None
        sql, pool = self._hot
        try:
            async with pool.acquire() as conn:
                yield sql, conn
        except self._errors as exc:
            raise self._storage_error(op, exc) from exc

    @asynccontextmanager
    async def _driver_conn(self, op: str) -> AsyncIterator[tuple[HotSql, Any]]:
        """A connection of the enqueue pool (PostgreSQL), for the raw enqueue: it queues
        neither with dispatch nor with listings and operator calls. A pool of asyncpg's
        own, as the hot one: checking out a SQLAlchemy connection and unwrapping its
        driver connection cost as much of the main's CPU as a one-job insert itself."""
        assert self._hot is not None and self._enqueue_pool is not None
        try:
            async with self._enqueue_pool.acquire() as conn:
                yield self._hot[0], conn
        except self._errors as exc:
            raise self._storage_error(op, exc) from exc

    async def _lite_write(self, op: str, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """``fn`` in a write transaction on SQLite's hot connection, in its turn among
        this adapter's writers (see :meth:`SqliteHot.write`)."""
        assert self._lite is not None
        try:
            return await self._lite.write(fn)
        except self._errors as exc:
            raise self._storage_error(op, exc) from exc

    async def _lite_read(self, op: str, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """``fn`` on SQLite's read connection (dispatch's reads), beside any write."""
        assert self._lite_reads is not None
        try:
            return await self._lite_reads.run(fn)
        except self._errors as exc:
            raise self._storage_error(op, exc) from exc

    async def _read_with_bodies(
        self, op: str, stmt: sa.Select[Any], first: int | None = None
    ) -> tuple[Sequence[Mapping[Any, Any]], Bodies]:
        """The rows ``stmt`` selects, and the offloaded payloads of the ``first`` of them
        (``None``: of all).

        Two statements, each seeing the store as it is when it runs: a job whose
        checkpoint was replaced by a small one, between them, has a mark in the row read
        and no payload left (it went with the old value), and ``broker job`` polled
        while a recovered job saved its checkpoints failed with "its offloaded
        checkpoint is missing". Both are read again then: the row read anew names what
        is stored now."""
        for _ in range(_READ_ROUNDS):
            async with self._read(op) as conn:
                rows = (await conn.execute(stmt)).mappings().all()
                wanted = rows if first is None else rows[:first]
                bodies = await _sa_bodies(conn, wanted)
            if not _bodies_missing(wanted, bodies):
                return rows, bodies
        raise StorageError(
            f"{op} failed on {self._url_text}: the payloads of the jobs read kept changing "
            "between the read of their rows and of their payloads"
        )

    @asynccontextmanager
    async def _read(self, op: str) -> AsyncIterator[AsyncConnection]:
        try:
            async with self._read_engine.connect() as conn:
                yield conn
        except self._errors as exc:
            raise self._storage_error(op, exc) from exc

    # ------------------------------------------------------------------ lifecycle

    async def setup(self) -> None:
        if self._main_lock is not None:
            self._main_lock.acquire()
        async with self._write("setup") as conn:
            await conn.run_sync(self._setup_sync)

    def _setup_lock_key(self) -> int:
        digest = hashlib.sha256(f"broker.setup:{self._schema or ''}".encode()).digest()
        return int.from_bytes(digest[:8], "big", signed=True)

    def _setup_sync(self, conn: sa.Connection) -> None:
        if self._pg:
            # Serialise concurrent setups (several processes starting at once).
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(self._setup_lock_key())))
            if self._schema is not None:
                quoted = conn.dialect.identifier_preparer.quote_schema(self._schema)
                conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
        current = self._stored_version(conn) or 0
        if current < SCHEMA_VERSION:
            logger.info("migrating %s from schema version %d to %d", self, current, SCHEMA_VERSION)
            migrate(conn, self._schema, current)

    def _stored_version(self, conn: sa.Connection) -> int | None:
        """The store's schema version; None if it holds no broker schema at all.

        :raises SchemaVersionError: a newer schema than this code understands.
        """
        if not sa.inspect(conn).has_table(schema_version.name, schema=self._schema):
            return None
        found = conn.execute(
            sa.select(schema_version.c.version).where(schema_version.c.id == 1)
        ).scalar_one_or_none()
        if found is None:
            raise StorageError(
                f"{self._url_text}: table broker_schema exists but holds no version row; "
                "the store is damaged or was not created by the broker"
            )
        if int(found) > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the store at {self._url_text} has schema version {found}, but this "
                f"broker understands versions up to {SCHEMA_VERSION}: upgrade the broker "
                "before using this store"
            )
        return int(found)

    async def check_schema(self) -> None:
        if self._sqlite_file is not None and not await asyncio.to_thread(
            os.path.exists, self._sqlite_file
        ):
            raise SchemaVersionError(
                f"there is no store at {self._url_text}: the file does not exist. Check "
                "the store URL; broker-main creates the file when it first starts"
            )
        async with self._read("check schema") as conn:
            current = await conn.run_sync(self._stored_version)
        if current is None:
            raise SchemaVersionError(
                f"the database at {self._url_text} holds no broker schema (no "
                f"{schema_version.name} table{self._in_schema()}): it is empty or not the "
                "broker's. Check the store URL; broker-main creates the schema when it first "
                "starts (or run `broker --database-url URL migrate`)"
            )
        if current < SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the store at {self._url_text} has schema version {current}, older than "
                f"the version {SCHEMA_VERSION} this broker needs: start this version's "
                "broker-main, which migrates it, or run `broker --database-url URL migrate` "
                "(stop any older main first)"
            )

    def _in_schema(self) -> str:
        return f" in schema {self._schema!r}" if self._schema else ""

    async def close(self) -> None:
        if self._analyzing is not None:
            self._analyzing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._analyzing
        if self._hot is not None:
            await self._hot[1].close()
        if self._enqueue_pool is not None:
            await self._enqueue_pool.close()
        if self._leader_pool is not None:
            await self._leader_pool.close()
        if self._lite is not None:
            await self._lite.close()
        if self._lite_reads is not None:
            await self._lite_reads.close()
        await self._engine.dispose()
        if self._main_lock is not None:
            self._main_lock.release()

    def _note_inserts(self, count: int) -> None:
        """Keep PostgreSQL's planner statistics fresh after bulk inserts.

        Until autovacuum first analyzes the table (up to a minute, longer under load) the
        planner believes the queue is empty and scans and sorts every queued row on each
        dispatch instead of reading the dispatch index in order: milliseconds per pass at a
        few thousand jobs. A background ``ANALYZE`` after large batches, at most every 30 s,
        keeps dispatch on the index.
        """
        if not self._pg:
            return
        self._unanalyzed_inserts += count
        now = time.monotonic()
        if (
            self._unanalyzed_inserts < _ANALYZE_AFTER_INSERTS
            or now - self._last_analyze < _ANALYZE_INTERVAL
            or (self._analyzing is not None and not self._analyzing.done())
        ):
            return
        self._unanalyzed_inserts = 0
        self._last_analyze = now
        self._analyzing = asyncio.create_task(self._analyze(), name="broker-store-analyze")

    async def _analyze(self) -> None:
        def analyze(conn: sa.Connection) -> None:
            conn.exec_driver_sql(f"ANALYZE {_qualified(conn, self._schema, jobs.name)}")

        try:
            async with self._read_engine.connect() as conn:
                await conn.run_sync(analyze)
        except self._errors as exc:
            logger.warning("could not refresh planner statistics: %r", exc)

    # ------------------------------------------------------------------ enqueue

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        return (await self.enqueue_many([spec]))[0]

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        return await self.enqueue_handed_off(specs, [None] * len(specs))

    async def enqueue_handed_off(
        self, specs: Sequence[JobSpec], claims: Sequence[Claim | None]
    ) -> list[EnqueueResult]:
        if not specs:
            return []
        if self._hot is not None:
            results = await self._enqueue_raw(specs, claims)
        else:
            results = await self._lite_write(
                "enqueue", lambda conn: self._enqueue_lite(conn, specs, claims)
            )
        self._note_inserts(sum(not r.duplicate for r in results))
        return results

    def _enqueue_lite(
        self, conn: sqlite3.Connection, specs: Sequence[JobSpec], claims: Sequence[Claim | None]
    ) -> list[EnqueueResult]:
        """SQLite: the enqueue rule as one transaction on the hot connection, in one hop.

        The rule is a coroutine (:meth:`_enqueue_with`); over ``sqlite3`` none of its
        awaits suspends, so it runs to the end on the hot thread (``complete_now``).
        """

        async def insert(rows: list[dict[str, Any]], moved: list[Payload]) -> set[uuid.UUID]:
            stored: set[uuid.UUID] = set()
            for chunk in _chunks(rows, _LITE_INSERT_ROWS):
                values = [_lite_value(row.get(name)) for row in chunk for name in INSERT_COLUMNS]
                found = conn.execute(_lite_insert(len(chunk)), values).fetchall()
                stored.update(uuid.UUID(hex=job_id) for (job_id,) in found)
            _lite_put(conn, _kept(moved, stored))
            return stored

        async def find(missing: Sequence[JobSpec]) -> list[Job | None]:
            found = conn.execute(
                f"SELECT {_LITE_COLUMNS} FROM broker_jobs "
                "WHERE id IN (SELECT value FROM json_each(?)) "
                "OR idempotency_key IN (SELECT value FROM json_each(?)) "
                "OR (unique_key IN (SELECT value FROM json_each(?)) "
                "AND status IN ('handed_off', 'queued'))",
                (
                    json.dumps([s.id.hex for s in missing]),
                    json.dumps([s.idempotency_key for s in missing if s.idempotency_key]),
                    json.dumps([s.unique_key for s in missing if s.unique_key is not None]),
                ),
            ).fetchall()
            bodies = _lite_bodies(conn, found)
            return _match_holders(missing, [_lite_job(r, bodies) for r in found])

        return complete_now(self._enqueue_with(insert, find, specs, claims))

    async def _enqueue_raw(
        self, specs: Sequence[JobSpec], claims: Sequence[Claim | None]
    ) -> list[EnqueueResult]:
        """PostgreSQL: the main's enqueue, on a connection of its enqueue pool."""
        async with self._driver_conn("enqueue") as (sql, conn):
            return await self._enqueue_on_driver(sql, conn, specs, claims)

    async def enqueue_on_driver_connection(
        self, conn: Any, specs: Sequence[JobSpec]
    ) -> list[EnqueueResult]:
        """PostgreSQL: insert jobs on the caller's own asyncpg connection, with the main's
        own statement: inside the transaction open on ``conn``, if any, else committed by
        the statement itself (a single job, or a batch nothing stands in the way of: see
        :meth:`_enqueue_every`), or by a transaction of its own (any other batch).

        Through SQLAlchemy, a job enqueued in the application's transaction cost its
        process about 1.1 ms of CPU (building and compiling the statement, ``BEGIN`` and
        ``COMMIT``); this costs about 0.3 ms, as PgQueuer's one ``INSERT`` costs its
        client. The checks and duplicate rules are the main's.

        :raises PayloadTooLargeError: a job's args and kwargs exceed ``max_payload_bytes``;
            nothing of the batch is inserted.
        """
        if not specs:
            return []
        if self._hot is None:
            raise ConfigurationError("an asyncpg connection reaches a PostgreSQL store only")
        check_all(specs, self._max_payload_bytes)
        try:
            return await self._enqueue_on_driver(self._hot[0], conn, specs, [None] * len(specs))
        except self._errors as exc:
            raise self._storage_error("enqueue_in_transaction", exc) from exc

    async def _enqueue_on_driver(
        self, sql: HotSql, conn: Any, specs: Sequence[JobSpec], claims: Sequence[Claim | None]
    ) -> list[EnqueueResult]:
        """PostgreSQL: one ``INSERT ... SELECT FROM json_to_recordset(...)`` for the whole
        batch, on an asyncpg connection.

        A single job needs no transaction (its one statement commits on its own, so an
        enqueue is one round trip), nor does a batch of new jobs that all insert
        (:meth:`_enqueue_every`); any other batch takes one, so it is stored all or
        nothing, and so does a job with offloaded payloads (its row and its payloads
        together). Inside a transaction already open on ``conn``, each is a savepoint.
        """

        async def insert(rows: list[dict[str, Any]], moved: list[Payload]) -> set[uuid.UUID]:
            # Jobs written handed off are fenced as a claim is.
            fenced = [self._epoch] if any(claims) else []
            if len(rows) == 1:
                stmt = sql.insert_one_fenced if fenced else sql.insert_one
                values = _INSERT_VALUES({**_NULL_ROW, **rows[0]})
            else:
                stmt = sql.insert_fenced if fenced else sql.insert
                values = [_ROWS_JSON.encode(rows).decode()]
            if not moved:
                return {r["id"] for r in await conn.fetch(stmt, *values, *fenced)}
            async with conn.transaction():  # a savepoint inside a batch's transaction
                stored = {r["id"] for r in await conn.fetch(stmt, *values, *fenced)}
                await _pg_put(sql, conn, _kept(moved, stored))
            return stored

        async def find(missing: Sequence[JobSpec]) -> list[Job | None]:
            found = await conn.fetch(
                sql.holders,
                [s.id for s in missing],
                [s.idempotency_key for s in missing if s.idempotency_key is not None],
                [s.unique_key for s in missing if s.unique_key is not None],
            )
            bodies = await _pg_bodies(sql, conn, found)
            return _match_holders(missing, _whole_jobs(found, bodies))

        if len(specs) == 1:
            return await self._enqueue_with(insert, find, specs, claims)
        if not any(claims) and not conn.is_in_transaction():
            every = await self._enqueue_every(sql, conn, specs)
            if every is not None:
                return every
        async with conn.transaction():
            return await self._enqueue_with(insert, find, specs, claims, _overlapped)

    async def _enqueue_every(
        self, sql: HotSql, conn: Any, specs: Sequence[JobSpec]
    ) -> list[EnqueueResult] | None:
        """PostgreSQL: a batch of new jobs in one plain ``INSERT``, committed on its own,
        when nothing stands in the way; ``None`` when something does (a key or id taken,
        in the store or twice in the batch, a payload to offload, any refusal), and then
        nothing of the batch was stored and it goes the careful way
        (:meth:`_enqueue_with`, in a transaction).

        In a bulk enqueue nothing usually does, and the careful way cost each group
        commit a ``BEGIN`` and a ``COMMIT`` round trip, each waiting its turn on the
        main's loop behind the checks of the next request: a trace of 3,500 jobs
        showed the database idle half the time. A statement that fails changes
        nothing, and outside a transaction (checked) aborts nothing else.
        """
        now = _from_us(self._now())
        job_fields = [settlement.enqueued_fields(spec, now) for spec in specs]
        rows = []
        for spec, each in zip(specs, job_fields, strict=True):
            row, moved = self._row_to_write(spec.id, each)
            if moved:
                return None
            rows.append(row)
        try:
            await conn.execute(sql.insert_every, _ROWS_JSON.encode(rows).decode())
        except self._server_refused:
            return None
        return [EnqueueResult.inserted(each) for each in job_fields]

    def _row_to_write(
        self, job_id: uuid.UUID, job_fields: Mapping[str, Any]
    ) -> tuple[dict[str, Any], list[Payload]]:
        """A new job's row as an enqueue writes it, and the payloads moved out of it."""
        return _offload(job_id, _new_row(job_fields), self._offload_threshold)

    async def enqueue_in_transaction(
        self, conn: AsyncConnection, specs: Sequence[JobSpec]
    ) -> list[EnqueueResult]:
        """Insert jobs on the caller's own connection, inside the caller's transaction.

        The jobs commit or roll back together with the application's own rows, so a job
        never refers to data that was rolled back, and data never lacks its job. ``conn``
        must be on this adapter's database (any engine). On PostgreSQL the insert trigger
        wakes the main at commit; on SQLite the main's short poll finds the jobs.

        :raises PayloadTooLargeError: a job's args and kwargs exceed ``max_payload_bytes``;
            nothing of the batch is inserted.
        """
        if not specs:
            return []
        check_all(specs, self._max_payload_bytes)
        options = self._statement_options()

        async def execute(stmt: sa.Executable, params: Any = None) -> Any:
            return await conn.execute(stmt, params, execution_options=options)

        try:
            return await self._enqueue_on(statements(execute), specs)
        except self._errors as exc:
            raise self._storage_error("enqueue_in_transaction", exc) from exc

    def enqueue_in_sync_transaction(
        self, conn: SyncStatements, specs: Sequence[JobSpec]
    ) -> list[EnqueueResult]:
        """:meth:`enqueue_in_transaction` on a synchronous connection (a ``sa.Connection``,
        or anything that executes Core statements the same way, such as a Django cursor's
        adapter): the same checks, rows and duplicate rules, in the caller's transaction.

        The one definition of the insert-or-find rule is a coroutine; over a synchronous
        connection none of its awaits ever suspends, so it runs to the end in one step
        (:func:`~adapters._sql_statements.complete_now`) without an event loop.
        """
        if not specs:
            return []
        check_all(specs, self._max_payload_bytes)
        options = self._statement_options()

        async def execute(stmt: sa.Executable, params: Any = None) -> Any:
            return conn.execute(stmt, params, execution_options=options)

        try:
            return complete_now(self._enqueue_on(statements(execute), specs))
        except self._errors as exc:
            raise self._storage_error("enqueue_in_transaction", exc) from exc

    def _statement_options(self) -> dict[str, Any]:
        """Execution options for each statement on the application's connection: the
        schema map goes on every statement, never on the connection, whose own tables
        (unqualified, like ours) must keep resolving as the application set them."""
        return {} if self._schema is None else {"schema_translate_map": {None: self._schema}}

    async def _enqueue_on(
        self,
        conn: AsyncConnection,
        specs: Sequence[JobSpec],
        claims: Sequence[Claim | None] | None = None,
    ) -> list[EnqueueResult]:
        async def insert(rows: list[dict[str, Any]], moved: list[Payload]) -> set[uuid.UUID]:
            stmt = self._insert(jobs).on_conflict_do_nothing().returning(jobs.c.id)
            full = [{**_NULL_ROW, **row} for row in rows]
            stored = set((await conn.execute(stmt, full)).scalars())
            kept = _kept(moved, stored)
            if kept:
                await conn.execute(
                    payloads.insert(),
                    [
                        {"job_id": job_id, "kind": kind, "body": body, "digest": digest}
                        for job_id, kind, body, digest in kept
                    ],
                )
            return stored

        async def find(missing: Sequence[JobSpec]) -> list[Job | None]:
            return await self._find_holders(conn, missing)

        return await self._enqueue_with(insert, find, specs, claims)

    async def _enqueue_with(
        self,
        insert: Insert,
        find: Callable[[Sequence[JobSpec]], Awaitable[list[Job | None]]],
        specs: Sequence[JobSpec],
        claims: Sequence[Claim | None] | None,
        overlap: Overlap | None = None,
    ) -> list[EnqueueResult]:
        """Insert ``specs`` (each ``claims[i]``, if any, stores its job handed off, see
        :meth:`enqueue_handed_off`); a duplicate within the batch refers to its first.

        The rule over either kind of connection: ``insert`` stores rows unless a key or
        id is taken (returning the ids stored), and the offloaded payloads of the rows it
        stored in the same transaction; ``find`` names what blocked each. With
        ``overlap`` (:func:`_overlapped`), a batch is inserted in chunks, each built while
        the one before is written.
        """
        now_us = self._now()
        # Within the batch, a repeated key (or id) refers back to its first occurrence.
        canonical: list[int] = []
        first: dict[tuple[str, object], int] = {}
        for index, spec in enumerate(specs):
            found = first.get(("key", spec.idempotency_key)) if spec.idempotency_key else None
            if found is not None:
                check_idempotent_repeat(spec, specs[found])
            else:
                found = first.get(("id", spec.id))
            if found is None:
                found = index
                first[("id", spec.id)] = index
                if spec.idempotency_key is not None:
                    first[("key", spec.idempotency_key)] = index
            canonical.append(found)
        now = _from_us(now_us)

        def enqueued(i: int) -> dict[str, Any]:
            return settlement.enqueued_fields(specs[i], now, claims[i] if claims else None)

        stored = await self._insert_or_find(
            insert, find, specs, sorted(set(canonical)), enqueued, overlap
        )
        return [
            stored[c] if c == i else EnqueueResult(stored[c].job, duplicate=True)
            for i, c in enumerate(canonical)
        ]

    async def _insert_or_find(
        self,
        insert: Insert,
        find: Callable[[Sequence[JobSpec]], Awaitable[list[Job | None]]],
        specs: Sequence[JobSpec],
        indices: list[int],
        enqueued: Callable[[int], dict[str, Any]],
        overlap: Overlap | None,
    ) -> dict[int, EnqueueResult]:
        """Insert the jobs whose fields ``enqueued(i)`` gives for ``indices`` (into
        ``specs``); a job inserted comes back as given (the row holds exactly its values),
        one blocked comes back as its holder."""
        out: dict[int, EnqueueResult] = {}
        fields_at: dict[int, dict[str, Any]] = {}
        hot: dict[int, dict[str, Any]] = {}
        moved: dict[int, list[Payload]] = {}

        def rows(chunk: Sequence[int]) -> tuple[list[dict[str, Any]], list[Payload]]:
            """The rows of ``chunk``'s jobs, and their offloaded payloads."""
            return [hot[i] for i in chunk], [p for i in chunk for p in moved[i]]

        def build(chunk: Sequence[int]) -> tuple[list[dict[str, Any]], list[Payload]]:
            for i in chunk:
                job_fields = fields_at[i] = enqueued(i)
                hot[i], moved[i] = self._row_to_write(specs[i].id, job_fields)
            return rows(chunk)

        chunks = [indices] if overlap is None else _chunks(indices, _OVERLAP_CHUNK)
        pending = indices
        for attempt in range(_ENQUEUE_ROUNDS):
            if attempt:
                inserted = await insert(*rows(pending))
            elif len(chunks) == 1:
                inserted = await insert(*build(indices))
            else:
                assert overlap is not None
                inserted = await overlap(insert, map(build, chunks))
            missing = []
            for i in pending:
                if specs[i].id in inserted:
                    out[i] = EnqueueResult.inserted(fields_at[i])
                else:
                    missing.append(i)
            if not missing:
                return out
            holders = await find([specs[i] for i in missing])
            pending = []
            for i, holder in zip(missing, holders, strict=True):
                if holder is None:
                    pending.append(i)  # the conflicting job was deleted meanwhile: retry
                else:
                    # Raised inside the enqueue's transaction: nothing of the batch stays.
                    check_idempotent_repeat(specs[i], holder)
                    out[i] = EnqueueResult(holder, duplicate=True)
            if not pending:
                return out
        raise StorageError(
            f"enqueue failed on {self._url_text}: the job holding an idempotency or unique "
            "key kept disappearing (or finishing) between insert and lookup"
        )

    async def _find_holders(
        self, conn: AsyncConnection, specs: Sequence[JobSpec]
    ) -> list[Job | None]:
        """For each spec that did not insert, the stored job that blocked it (see
        :func:`_match_holders`)."""
        found: list[Job] = []
        for chunk in _chunks(specs):
            keys = [s.idempotency_key for s in chunk if s.idempotency_key is not None]
            uniques = [s.unique_key for s in chunk if s.unique_key is not None]
            cond: sa.ColumnElement[bool] = jobs.c.id.in_([s.id for s in chunk])
            if keys:
                cond = sa.or_(cond, jobs.c.idempotency_key.in_(keys))
            if uniques:
                # IS_ACTIVE is the partial unique index's own predicate.
                cond = sa.or_(cond, sa.and_(jobs.c.unique_key.in_(uniques), IS_ACTIVE))
            rows = list((await conn.execute(sa.select(jobs).where(cond))).mappings())
            found.extend(_whole_jobs(rows, await _sa_bodies(conn, rows)))
        return _match_holders(specs, found)

    # ------------------------------------------------------------------ dispatch

    async def select_eligible(
        self,
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        limit: int = 100,
        skip: Collection[uuid.UUID] = (),
    ) -> list[Job]:
        if not modes or limit <= 0:
            return []
        if self._hot is not None:
            wanted: list[Any] = [sorted({ExecutionMode(m).value for m in modes})]
            if queues is not None:
                wanted.append(sorted(set(queues)))
            async with self._hot_conn("select_eligible") as (sql, conn):
                statement = sql.eligible if queues is None else sql.eligible_in_queues
                found = await conn.fetch(statement, *wanted, self._now(), limit, list(skip))
            return [_job_from_row(r) for r in found]
        params = _lite_wanted(modes, queues)
        params += (self._now(), limit, json.dumps([job_id.hex for job_id in skip]))
        statement = _LITE_ELIGIBLE_IN_QUEUES if queues is not None else _LITE_ELIGIBLE
        rows = await self._lite_read(
            "select_eligible", lambda conn: conn.execute(statement, params).fetchall()
        )
        return [_lite_job(r) for r in rows]

    async def next_run_at(
        self, *, modes: Collection[ExecutionMode], queues: Collection[str] | None = None
    ) -> datetime | None:
        if not modes:
            return None
        if self._hot is not None:
            wanted = [sorted({ExecutionMode(m).value for m in modes})]
            async with self._hot_conn("next_run_at") as (sql, conn):
                if queues is None:
                    earliest = await conn.fetchval(sql.next_run, *wanted)
                else:
                    earliest = await conn.fetchval(sql.next_run_in_queues, *wanted, sorted(queues))
            return None if earliest is None else _from_us(earliest)
        params = _lite_wanted(modes, queues)
        statement = _LITE_NEXT_RUN
        if queues is None:
            params = params[:1]  # the statement reads no ?2
        else:
            statement = _LITE_NEXT_RUN_IN_QUEUES
        value = await self._lite_read(
            "next_run_at", lambda conn: conn.execute(statement, params).fetchall()[0][0]
        )
        return None if value is None else _from_us(value)

    async def mark_handed_off(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, worker_id: str
    ) -> Job | None:
        claimed = await self.mark_handed_off_many([Claim(job_id, handoff_id, worker_id)])
        return claimed[0] if claimed else None

    async def mark_handed_off_many(self, claims: Sequence[Claim]) -> list[Job]:
        wanted: dict[uuid.UUID, Claim] = {}
        for claim in claims:
            wanted.setdefault(claim.job_id, claim)  # the same job twice: the first claim
        if not wanted:
            return []
        if self._hot is not None:
            return await self._claim_raw(wanted)
        now_us = self._now()
        assert self._lite is not None
        ordered = list(wanted.values())
        return await self._lite_write(
            "mark_handed_off", lambda conn: _claim_lite(conn, ordered, now_us)
        )

    async def _claim_raw(self, wanted: dict[uuid.UUID, Claim]) -> list[Job]:
        """PostgreSQL: one statement claims the wanted jobs, concurrency slots included
        (see ``HotSql.claim``).

        The rare keyed job it cannot decide in one statement (its key has no counter row
        yet, or the key's candidates disagree on the limit) comes back unclaimed and goes
        through :meth:`_claim_keyed`, a short transaction on the same connection.
        """
        now_us = self._now()
        claims = list(wanted.values())
        async with self._hot_conn("mark_handed_off") as (sql, conn):
            by_id = sorted(range(len(claims)), key=lambda i: claims[i].job_id)
            rows = await conn.fetch(
                sql.claim,
                *_claim_arrays([claims[i] for i in by_id]),
                now_us,
                self._epoch,
                [i + 1 for i in by_id],
            )
            stored = [r for r in rows if r["claimed"]]
            unclaimed = {r["id"] for r in rows if not r["claimed"]}
            keyed = [c for c in claims if c.job_id in unclaimed]  # in claim order
            if keyed:
                stored.extend(await self._claim_keyed(sql, conn, keyed, now_us, self._epoch))
            bodies = await _pg_bodies(sql, conn, stored)
        won, refused = _claimed_jobs(
            claims, stored, functools.partial(_job_from_row, bodies=bodies)
        )
        if refused:
            # The claim committed; the fenced settle of its leases fails these jobs dead.
            await self._settle_raw(refused, now_us)
        order = {job_id: i for i, job_id in enumerate(wanted)}
        return sorted(won, key=lambda job: order[job.id])

    @staticmethod
    async def _claim_keyed(
        sql: HotSql, conn: Any, claims: list[Claim], now_us: int, epoch: int | None
    ) -> list[Any]:
        """Claims of keyed jobs, in one transaction: the epoch fence (held to the
        commit), the rows are locked (skipping any another claimer holds), then their
        counters in key order, then the granted rows are handed off and their slots
        taken. Returns the rows as now stored."""
        async with conn.transaction():
            if epoch is not None:
                await conn.execute(sql.fence, epoch)
            candidates = await conn.fetch(sql.lock_claimable, [c.job_id for c in claims], now_us)
            keys = sorted({r["concurrency_key"] for r in candidates} - {None})
            active = {r["key"]: r["active"] for r in await conn.fetch(sql.lock_counters, keys)}
            granted, taken = _grant(
                [(r["id"], r["concurrency_key"], r["concurrency_limit"]) for r in candidates],
                [c.job_id for c in claims],
                active,
            )
            if not granted:
                return []
            if taken:
                await conn.execute(sql.take_slots, list(taken), list(taken.values()))
            chosen = set(granted)
            handed = [c for c in claims if c.job_id in chosen]
            return list(await conn.fetch(sql.hand_off, *_claim_arrays(handed), now_us))

    # ------------------------------------------------------------------ fenced reports

    async def settle_many(self, settlements: Sequence[Settlement]) -> list[bool]:
        if not settlements:
            return []
        now_us = self._now()
        if self._hot is not None:
            return await self._settle_raw(settlements, now_us)
        assert self._lite is not None
        return await self._lite_write(
            "settle",
            lambda conn: _settle_lite(conn, settlements, now_us, self._offload_threshold),
        )

    async def _settle_raw(self, settlements: Sequence[Settlement], now_us: int) -> list[bool]:
        """PostgreSQL: one statement for the whole batch, every shape of move at once,
        fenced per job and giving back the concurrency slots (see ``HotSql.settle``).
        Only the first move per job in a batch can be accepted."""
        first: dict[uuid.UUID, int] = {}
        for i, s in enumerate(settlements):
            first.setdefault(s.job_id, i)
        now = _from_us(now_us)
        columns: list[list[Any]] = [[] for _ in range(14)]
        moved: list[Payload] = []
        for i in first.values():
            s = settlements[i]
            move = settlement.settle(s, now)
            values, offloaded = _offload(s.job_id, _columns(move.changes), self._offload_threshold)
            moved += offloaded
            row = [
                s.job_id,
                s.handoff_id,
                values.pop("status"),
                "result" in values,
                values.pop("result", None),
                "last_error" in values,
                values.pop("last_error", None),
                values.pop("run_at_us", None),
                int(move.counts_attempt),
                values.pop("updated_us"),
                move.releases_slot,
                int(move.counts_recovery),
                "state_holder" in values,
                values.pop("state_holder", None),
            ]
            if values:
                raise TypeError(f"the settle statement cannot set {sorted(values)}")
            for column, value in zip(columns, row, strict=True):
                column.append(value)
        async with self._hot_conn("settle") as (sql, conn):
            if not moved and _completions_only(columns, now_us):
                ids, leases, results = columns[0], columns[1], columns[4]
                accepted = {
                    r["id"]
                    for r in await conn.fetch(
                        sql.settle_completed, ids, leases, results, now_us, self._epoch
                    )
                }
            elif not moved:
                accepted = {r["id"] for r in await conn.fetch(sql.settle, *columns, self._epoch)}
            else:
                # The payloads of the moves the fence lets through, in their transaction.
                async with conn.transaction():
                    accepted = {
                        r["id"] for r in await conn.fetch(sql.settle, *columns, self._epoch)
                    }
                    await _pg_put(sql, conn, _kept(moved, accepted))
        return [first[s.job_id] == i and s.job_id in accepted for i, s in enumerate(settlements)]

    # ------------------------------------------------------------------ checkpoints, progress

    async def save_checkpoints(self, saves: Sequence[CheckpointSave]) -> list[bool]:
        if not saves:
            return []
        now_us = self._now()
        if self._hot is None:
            assert self._lite is not None
            return await self._lite_write(
                "save checkpoints",
                lambda conn: _save_checkpoints_lite(conn, saves, now_us, self._offload_threshold),
            )
        # One statement for the batch; an UPDATE takes one source row per job, so only
        # the newest save of each lease goes in, and the older ones share its answer
        # (a newer state of theirs is what is durable).
        newest: dict[tuple[uuid.UUID, uuid.UUID], CheckpointSave] = {}
        for save in saves:
            key = (save.job_id, save.handoff_id)
            if key not in newest or newest[key].seq < save.seq:
                newest[key] = save
        chosen = list(newest.values())
        states: list[str | None] = []
        moved: dict[tuple[uuid.UUID, uuid.UUID], list[Payload]] = {}
        for key, c in newest.items():
            values, moved[key] = _offload(
                c.job_id, {"checkpoint": _result_text(c.state)}, self._offload_threshold
            )
            states.append(values["checkpoint"])
        arrays = (
            [c.job_id for c in chosen],
            [c.handoff_id for c in chosen],
            [c.seq for c in chosen],
        )
        async with self._hot_conn("save checkpoints") as (sql, conn):
            if not any(moved.values()):
                rows = await conn.fetch(sql.save_checkpoints, *arrays, states, now_us)
            else:
                # The payloads of the saves the fence lets through, in their transaction:
                # by lease, since a batch may hold a stale lease's save of the same job.
                async with conn.transaction():
                    rows = await conn.fetch(sql.save_checkpoints, *arrays, states, now_us)
                    kept = [p for r in rows for p in moved[(r["id"], r["handoff_id"])]]
                    await _pg_put(sql, conn, kept)
        taken = {(r["id"], r["handoff_id"]) for r in rows}
        return [(s.job_id, s.handoff_id) in taken for s in saves]

    async def save_progress(self, updates: Sequence[ProgressUpdate]) -> list[bool]:
        if not updates:
            return []
        if self._hot is None:
            assert self._lite is not None
            return await self._lite_write(
                "save progress", lambda conn: _save_progress_lite(conn, updates)
            )
        # The last update of each lease counts (one source row per job and lease).
        chosen = list({(u.job_id, u.handoff_id): u for u in updates}.values())
        async with self._hot_conn("save progress") as (sql, conn):
            rows = await conn.fetch(
                sql.save_progress,
                [u.job_id for u in chosen],
                [u.handoff_id for u in chosen],
                [u.fraction for u in chosen],
                [u.message for u in chosen],
            )
        taken = {(r["id"], r["handoff_id"]) for r in rows}
        return [(u.job_id, u.handoff_id) in taken for u in updates]

    async def _release(self, conn: AsyncConnection, key: str, slots: int) -> None:
        await conn.execute(
            sa.update(concurrency)
            .where(concurrency.c.key == key)
            .values(
                active=sa.case(
                    (concurrency.c.active > slots, concurrency.c.active - slots), else_=0
                )
            )
        )

    async def complete(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, result: JSONValue = None
    ) -> bool:
        [done] = await self.settle_many([Settlement(job_id, handoff_id, Outcome.COMPLETE, result)])
        return done

    async def fail(
        self,
        job_id: uuid.UUID,
        handoff_id: uuid.UUID,
        error: str,
        retry_at: datetime | None,
    ) -> bool:
        [done] = await self.settle_many(
            [Settlement(job_id, handoff_id, Outcome.FAIL, error=error, run_at=retry_at)]
        )
        return done

    async def reschedule(self, job_id: uuid.UUID, handoff_id: uuid.UUID, run_at: datetime) -> bool:
        [done] = await self.settle_many(
            [Settlement(job_id, handoff_id, Outcome.RESCHEDULE, run_at=run_at)]
        )
        return done

    async def return_to_queue(self, job_id: uuid.UUID, handoff_id: uuid.UUID) -> bool:
        [done] = await self.settle_many([Settlement(job_id, handoff_id, Outcome.RETURN)])
        return done

    # ------------------------------------------------------------------ leadership

    async def elect(self, holder: str, address: str, ttl: float) -> LeaderRecord | None:
        async with self._leader_conn("elect") as (sql, conn):
            row = await conn.fetchrow(sql.elect, holder, address, ttl)
        if row is None:
            return None
        return LeaderRecord(row["epoch"], row["holder"], row["address"], row["live"])

    async def renew(self, holder: str, epoch: int, ttl: float) -> bool:
        async with self._leader_conn("renew") as (sql, conn):
            return await conn.fetchval(sql.renew, holder, epoch, ttl) is not None

    async def resign(self, holder: str, epoch: int) -> None:
        async with self._leader_conn("resign") as (sql, conn):
            await conn.execute(sql.resign, holder, epoch)

    def fence(self, epoch: int | None, on_fenced: Callable[[str], None] | None = None) -> None:
        self._epoch = epoch
        self._on_fenced = on_fenced

    @asynccontextmanager
    async def _leader_conn(self, op: str) -> AsyncIterator[tuple[HotSql, Any]]:
        if self._hot is None or self._leader_pool is None:
            raise ConfigurationError(
                "leader election needs PostgreSQL; a SQLite file holds one main only"
            )
        try:
            async with self._leader_pool.acquire() as conn:
                yield self._hot[0], conn
        except self._errors as exc:
            raise self._storage_error(op, exc) from exc

    # ------------------------------------------------------------------ operator actions

    async def handoffs_for_worker(self, worker_id: str) -> list[Job]:
        stmt = (
            sa.select(jobs)
            .where(jobs.c.worker_id == worker_id, IS_HANDED_OFF)
            .order_by(jobs.c.handed_off_us, jobs.c.id)
        )
        rows, bodies = await self._read_with_bodies("handoffs_for_worker", stmt)
        return [_job_from_row(r, bodies) for r in rows]

    async def cancel(self, job_id: uuid.UUID) -> Job | None:
        select = sa.select(jobs).where(jobs.c.id == job_id)
        if self._pg:
            select = select.with_for_update()
        async with self._write("cancel") as conn:
            row = (await conn.execute(select)).mappings().first()
            if row is None:
                return None
            bodies = await _sa_bodies(conn, [row])
            move = settlement.cancel(row["status"], _from_us(self._now()))
            if move is None:
                return _job_from_row(row, bodies)
            update = (
                sa.update(jobs)
                .where(jobs.c.id == job_id, jobs.c.status == row["status"])
                .values(**_columns(move.changes))
                .returning(*jobs.c)
            )
            cancelled = (await conn.execute(update)).mappings().one()
            if move.releases_slot and row["concurrency_key"] is not None:
                await self._release(conn, row["concurrency_key"], 1)
        return _job_from_row(cancelled, bodies)

    async def retry_dead(self, job_id: uuid.UUID) -> Job | None:
        now_us = self._now()
        update = (
            sa.update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status == JobStatus.FAILED.value)
            .values(**_columns(settlement.revive(_from_us(now_us)).changes))
            .returning(*jobs.c)
        )
        try:
            async with self._write("retry_dead") as conn:
                dead = (
                    await conn.execute(
                        sa.select(jobs.c.unique_key).where(
                            jobs.c.id == job_id, jobs.c.status == JobStatus.FAILED.value
                        )
                    )
                ).first()
                if dead is not None and dead.unique_key is not None:
                    await self._refuse_if_unique_key_held(conn, job_id, dead.unique_key)
                row = (await conn.execute(update)).mappings().first()
                if row is None:
                    select = sa.select(jobs).where(jobs.c.id == job_id)
                    row = (await conn.execute(select)).mappings().first()
                bodies = await _sa_bodies(conn, [] if row is None else [row])
        except StorageError as exc:
            # A job holding the key was enqueued (by another process) after the check.
            if isinstance(exc.__cause__, sa_exc.IntegrityError):
                raise UniqueKeyTakenError(
                    f"job {job_id} cannot be retried: another job took its unique key while "
                    "it is queued or running"
                ) from exc
            raise
        return None if row is None else _job_from_row(row, bodies)

    async def _refuse_if_unique_key_held(
        self, conn: AsyncConnection, job_id: uuid.UUID, key: str
    ) -> None:
        holder = (
            await conn.execute(
                sa.select(jobs.c.id).where(jobs.c.unique_key == key, IS_ACTIVE).limit(1)
            )
        ).scalar()
        if holder is not None:
            raise UniqueKeyTakenError(
                f"job {job_id} cannot be retried: job {holder} holds its unique key {key!r} "
                "while it is queued or running; retry once that job has finished",
                holder_id=holder,
            )

    # ------------------------------------------------------------------ inspection

    async def get_job(self, job_id: uuid.UUID) -> Job | None:
        stmt = sa.select(jobs).where(jobs.c.id == job_id)
        rows, bodies = await self._read_with_bodies("get_job", stmt)
        return _job_from_row(rows[0], bodies) if rows else None

    async def declare_tasks(
        self,
        worker_id: str,
        declarations: Mapping[str, Mapping[str, JSONValue]],
        seen_at: datetime,
    ) -> None:
        seen_us = _to_us(seen_at)
        rows = [
            {
                "task": name,
                "worker_id": worker_id,
                "declaration": json.dumps(dict(declaration), sort_keys=True),
                "seen_us": seen_us,
            }
            for name, declaration in sorted(declarations.items())
        ]
        # The worker's rows go, then its declaration goes in whole: one transaction, and
        # at most MAX_DECLARED_TASKS rows (the main's bound), so no list of names to
        # keep is needed in the statement.
        delete = sa.delete(task_catalog).where(task_catalog.c.worker_id == worker_id)
        async with self._write("declare_tasks") as conn:
            await conn.execute(delete)
            if rows:
                await conn.execute(sa.insert(task_catalog), rows)

    async def task_catalog(
        self, *, tasks: Collection[str] | None = None, limit: int | None = None
    ) -> list[TaskRecord]:
        select = sa.select(task_catalog)
        if limit is not None:
            select = select.order_by(task_catalog.c.seen_us.desc()).limit(limit)
        selects = (
            [select]
            if tasks is None
            else [select.where(task_catalog.c.task.in_(c)) for c in _chunks(sorted(tasks))]
        )
        async with self._read("task_catalog") as conn:
            rows = [row for s in selects for row in (await conn.execute(s)).mappings().all()]
        records = [
            TaskRecord(
                task=row["task"],
                worker_id=row["worker_id"],
                declaration=json.loads(row["declaration"]),
                seen_at=_from_us(row["seen_us"]),
            )
            for row in rows
        ]
        if limit is not None:  # a limit per slice of names: the most recent of them all
            records = sorted(records, key=lambda r: r.seen_at, reverse=True)[:limit]
        return sorted(records, key=lambda r: (r.task, r.worker_id))

    async def forget_tasks(
        self, live_workers: Collection[str], seen_at: datetime, gone_before: datetime
    ) -> int:
        async with self._write("forget_tasks") as conn:
            for chunk in _chunks(sorted(live_workers)):
                await conn.execute(
                    sa.update(task_catalog)
                    .where(task_catalog.c.worker_id.in_(chunk))
                    .values(seen_us=_to_us(seen_at))
                )
            deleted = await conn.execute(
                sa.delete(task_catalog).where(task_catalog.c.seen_us < _to_us(gone_before))
            )
        return int(deleted.rowcount or 0)

    async def list_jobs(
        self,
        job_filter: JobFilter | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
        include_payload: bool = True,
    ) -> JobPage:
        if limit <= 0:
            return JobPage(jobs=[], next_cursor=None)
        conds: list[sa.ColumnElement[bool]] = []
        if job_filter is not None:
            if job_filter.statuses is not None:
                conds.append(
                    jobs.c.status.in_(sorted({JobStatus(s).value for s in job_filter.statuses}))
                )
            if job_filter.queues is not None:
                conds.append(jobs.c.queue.in_(sorted(set(job_filter.queues))))
            if job_filter.tasks is not None:
                conds.append(jobs.c.task.in_(sorted(set(job_filter.tasks))))
        if cursor is not None:
            created_us, last_id = _decode_cursor(cursor)
            conds.append(sa.tuple_(jobs.c.created_us, jobs.c.id) < (created_us, last_id))
        stmt = (
            sa.select(*(jobs.c if include_payload else _SUMMARY_COLUMNS))
            .where(*conds)
            .order_by(jobs.c.created_us.desc(), jobs.c.id.desc())
            .limit(limit + 1)
        )
        rows, bodies = await self._read_with_bodies("list_jobs", stmt, first=limit)
        page = [_job_from_row(r, bodies) for r in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            last = rows[limit - 1]
            next_cursor = _encode_cursor(last["created_us"], last["id"])
        return JobPage(jobs=page, next_cursor=next_cursor)

    def cursor_after(self, job: Job) -> str:
        return _encode_cursor(_to_us(job.created_at), job.id)

    async def count_jobs(self) -> list[QueueCount]:
        stmt = (
            sa.select(jobs.c.queue, jobs.c.status, sa.func.count(), sa.func.min(jobs.c.run_at_us))
            .group_by(jobs.c.queue, jobs.c.status)
            .order_by(jobs.c.queue, jobs.c.status)
        )
        async with self._read("count_jobs") as conn:
            rows = (await conn.execute(stmt)).all()
        return [
            QueueCount(
                queue=queue,
                status=JobStatus(status),
                count=int(count),
                oldest_run_at=_from_us(oldest)
                if status == _QUEUED and oldest is not None
                else None,
            )
            for queue, status, count, oldest in rows
        ]

    # ------------------------------------------------------------------ pruning

    async def prune(
        self,
        *,
        older_than: datetime | None = None,
        keep_latest: int | None = None,
        statuses: Collection[JobStatus] | None = None,
        batch_size: int = 1000,
    ) -> int:
        """Delete terminal jobs in batches, each its own short transaction.

        ``keep_latest`` counts among the statuses being pruned (by ``updated_at``, then
        id); with ``older_than`` too, a job goes only if both allow it. With neither,
        every terminal job of those statuses goes. Idle concurrency counters (no job
        handed off under the key) are deleted as well.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 (got {batch_size})")
        if keep_latest is not None and keep_latest < 0:
            raise ValueError(f"keep_latest must not be negative (got {keep_latest})")
        targets = (
            TERMINAL_STATUSES
            if statuses is None
            else TERMINAL_STATUSES & {JobStatus(s) for s in statuses}
        )
        if not targets:
            return 0
        # IS_TERMINAL is the partial index's own predicate; the second test narrows it.
        status_in: sa.ColumnElement[bool] = IS_TERMINAL
        if targets != TERMINAL_STATUSES:
            status_in = sa.and_(IS_TERMINAL, jobs.c.status.in_(sorted(s.value for s in targets)))
        conds: list[sa.ColumnElement[bool]] = [status_in]
        if older_than is not None:
            conds.append(jobs.c.updated_us < _to_us(older_than))
        if keep_latest:
            boundary = await self._keep_boundary(status_in, keep_latest)
            if boundary is None:
                return 0  # no more than keep_latest candidates: nothing to delete
            conds.append(
                sa.tuple_(jobs.c.updated_us, jobs.c.id)
                < sa.tuple_(
                    sa.literal(boundary[0], sa.BigInteger()), sa.literal(boundary[1], sa.Uuid())
                )
            )
        batch = sa.select(jobs.c.id).where(*conds).limit(batch_size)
        deleted = 0
        while True:
            # The ids first, then a delete by primary key: one ``DELETE ... IN (subquery)``
            # leaves the join to the planner, and with statistics taken while the jobs were
            # still queued PostgreSQL chose a plan that took seconds per batch.
            async with self._write("prune") as conn:
                ids = list((await conn.execute(batch)).scalars())
                count = 0
                if ids:
                    # Re-check the status on the row itself: a job may have been revived.
                    delete = sa.delete(jobs).where(jobs.c.id.in_(ids), status_in)
                    count = (await conn.execute(delete)).rowcount
            deleted += count
            if len(ids) < batch_size:
                break
        async with self._write("prune") as conn:
            # Idle counters of keys no job holds; a claim re-creates them on demand.
            await conn.execute(sa.delete(concurrency).where(concurrency.c.active <= 0))
        return deleted

    async def _keep_boundary(
        self, status_in: sa.ColumnElement[bool], keep_latest: int
    ) -> tuple[int, uuid.UUID] | None:
        """The ``(updated_us, id)`` of the oldest terminal job that ``keep_latest`` keeps."""
        stmt = (
            sa.select(jobs.c.updated_us, jobs.c.id)
            .where(status_in)
            .order_by(jobs.c.updated_us.desc(), jobs.c.id.desc())
            .offset(keep_latest - 1)
            .limit(1)
        )
        async with self._read("prune") as conn:
            row = (await conn.execute(stmt)).first()
        return None if row is None else (int(row.updated_us), row.id)

    # ------------------------------------------------------------------ notifications

    def listen(self, on_wake: Callable[[], None]) -> AbstractAsyncContextManager[None]:
        """While open, ``on_wake()`` runs whenever any process inserts a job (PostgreSQL).

        Notifications come from a trigger on ``broker_jobs``, so inserts made by other
        brokers, other adapters or plain SQL all wake the listener. If the listening
        connection is lost, ``on_wake`` is called once more and a warning is logged;
        the caller's polling timer takes over from there.
        """
        if not self._pg:
            raise ConfigurationError(
                "listen() needs PostgreSQL LISTEN/NOTIFY; a SQLite store has no "
                "notifications (check capabilities.listen_notify and poll instead)"
            )
        return self._listen(on_wake)

    @asynccontextmanager
    async def _listen(self, on_wake: Callable[[], None]) -> AsyncIterator[None]:
        def wake(*_args: object) -> None:
            try:
                on_wake()
            except Exception:
                logger.exception("listen(): on_wake callback failed")

        def lost(*_args: object) -> None:
            logger.warning("listen(): the notification connection to %s was lost", self)
            wake()

        try:
            conn = await self._engine.connect()
        except self._errors as exc:
            raise self._storage_error("listen", exc) from exc
        try:
            try:
                schema = self._schema
                if schema is None:
                    schema = str((await conn.execute(sa.text("SELECT current_schema()"))).scalar())
                    await conn.commit()  # LISTEN must not sit in an open transaction
                channel = notify_channel(schema)
                raw = await conn.get_raw_connection()
                driver_conn: Any = raw.driver_connection
                await driver_conn.add_listener(channel, wake)
                driver_conn.add_termination_listener(lost)
            except self._errors as exc:
                raise self._storage_error("listen", exc) from exc
            try:
                yield
            finally:
                driver_conn.remove_termination_listener(lost)
                with contextlib.suppress(*self._errors):
                    await driver_conn.remove_listener(channel, wake)
        finally:
            with contextlib.suppress(*self._errors):
                await conn.close()


__all__ = ["SUPPORTED_URLS", "SQLAlchemyAdapter"]
