"""How a job is a row of ``broker_jobs``, for every path of the SQL store.

The codec (a :class:`~broker.jobs.Job` field to its column and back), time as integer
microseconds since the epoch, payloads moved out of a row into ``broker_payloads`` and
checked on the way back, list cursors, and the claim's grant rule: what both dialects
(:mod:`adapters.sql.postgres`, :mod:`adapters.sql.sqlite`) and the SQLAlchemy paths share,
so a job reads the same whichever path wrote it.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import functools
import itertools
import json
import operator
import sqlite3
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeGuard, TypeVar

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from adapters.sql.schema import HOLLOW, INSERT_COLUMNS, OFFLOADABLE, OFFLOADED, jobs, payloads
from broker import settlement
from broker.exceptions import InvalidJobError, StorageError
from broker.jobs import (
    JOB_DEFAULTS,
    NEW_JOB_FIELDS,
    Claim,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
    JSONValue,
    Settlement,
    compact_json,
    new_job_values,
)
from broker.storage import (
    PayloadIntegrityError,
    check_payload,
    log_refused_at_claim,
    payload_digest,
)

_T = TypeVar("_T")
E = TypeVar("E", bound=enum.Enum)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US = timedelta(microseconds=1)
_CHUNK = 500
"""Most ids bound in one statement (SQLite and asyncpg cap a statement near 32k parameters)."""
SUMMARY_COLUMNS = [
    {
        "args": sa.literal_column("'[]'", sa.Text).label("args"),
        "kwargs": sa.literal_column("'{}'", sa.Text).label("kwargs"),
        "result": sa.null().label("result"),
        "checkpoint": sa.null().label("checkpoint"),
    }.get(column.name, column)
    for column in jobs.c
]
"""What a summary listing selects: constants in place of the payload columns, so the
database never reads them (each may be megabytes) and ``job_from_row`` needs no
special case."""


def to_us(value: datetime) -> int:
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


def at_us(value: int) -> datetime:
    """:func:`from_us` uncached, for a time just read from the clock: a new value at every
    call, which the cache would only miss, at the cost of a node made and an old one
    evicted (the times of rows being decoded). A one-at-a-time enqueue reads the clock
    once a job: through the cache the time cost it 1.5-2.5 us more CPU, caches cold."""
    return _EPOCH + timedelta(microseconds=value)


from_us = functools.lru_cache(maxsize=4096)(at_us)
""":func:`at_us`, cached: the rows decoded together mostly share their times (a bulk
enqueue's jobs one creation time, a claim's jobs one hand-off time), and a datetime is
immutable."""


def enum_decoder(kind: type[E]) -> Callable[[Any], E]:
    """``kind(value)`` by a dict lookup first: an enum's own call cost the decoding of a
    row about 1 µs per enum column. A value not in ``kind`` still raises as the call does."""
    members = {member.value: member for member in kind}

    def decode(value: Any) -> E:
        member = members.get(value)
        return kind(value) if member is None else member

    return decode


_dumps = compact_json
_JSON_DECODE = msgspec.json.Decoder().decode


def loads(text: str | bytes) -> Any:
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


def result_text(value: JSONValue) -> str | None:
    """A reported result as stored; one that JSON cannot hold is the reporter's error."""
    try:
        return None if value is None else _dumps(value)
    except (TypeError, ValueError) as exc:
        raise InvalidJobError(f"result is not JSON-serialisable: {exc}") from exc


_CODECS: dict[str, tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = {
    "args": ("args", _dumps, lambda v: tuple(loads(v))),
    "kwargs": ("kwargs", _dumps, loads),
    "status": ("status", _enum_value(JobStatus), enum_decoder(JobStatus)),
    "run_at": ("run_at_us", to_us, from_us),
    "created_at": ("created_us", to_us, from_us),
    "updated_at": ("updated_us", to_us, from_us),
    "execution_mode": (
        "execution_mode",
        _enum_value(ExecutionMode),
        enum_decoder(ExecutionMode),
    ),
    "handed_off_at": ("handed_off_us", _optional(to_us), _optional(from_us)),
    "result": ("result", result_text, _optional(loads)),
    "timeout": ("timeout_s", _optional(float), _optional(float)),
    "checkpoint": ("checkpoint", result_text, _optional(loads)),
    "checkpoint_at": ("checkpoint_us", _optional(to_us), _optional(from_us)),
    "local_state": ("local_state", bool, bool),
    "trace_context": ("trace_context", _optional(_dumps), _optional(loads)),
}
"""How a :class:`Job` field differs in ``broker_jobs`` (column, encode, decode); every
other field is a column of its own name holding its value as is."""
_FIELDS = [(f.name, *_CODECS.get(f.name, (f.name, _same, _same))) for f in dataclasses.fields(Job)]
COLUMN_OF = {name: column for name, column, _, _ in _FIELDS}
_ENCODE = {name: encode for name, _, encode, _ in _FIELDS}


_ROW_GET = operator.itemgetter(*(column for _, column, _, _ in _FIELDS))
"""A row's columns in :class:`Job`'s field order, in one C call (by name: asyncpg records,
SQLAlchemy mappings and ``sqlite3.Row`` all take one)."""
_DECODED = [(i, decode) for i, (_, _, _, decode) in enumerate(_FIELDS) if decode is not _same]
_PAYLOADS_GET = operator.itemgetter(*OFFLOADABLE)
ROW_COLUMNS = [column for _, column, _, _ in _FIELDS]
"""The columns of ``broker_jobs`` in :class:`Job`'s field order."""
ID_AT = ROW_COLUMNS.index("id")
_PAYLOAD_POSITIONS = [(ROW_COLUMNS.index(column), column) for column in OFFLOADABLE]
PAYLOADS_AT = operator.itemgetter(*(i for i, _ in _PAYLOAD_POSITIONS))
"""A row's payload columns, by position in :class:`Job`'s field order."""


Bodies = Mapping[tuple[uuid.UUID, str], tuple[str, str | None]]
"""Offloaded payloads by ``(job id, column)``, as ``broker_payloads`` holds them: each
one's text and the SHA-256 stored beside it (see :func:`broker.storage.check_payload`)."""


def is_offloaded(row: Mapping[Any, Any] | sqlite3.Row) -> bool:
    return OFFLOADED in _PAYLOADS_GET(row)


def job_from_row(row: Mapping[Any, Any], bodies: Bodies | None = None) -> Job:
    """A :class:`Job` from a ``broker_jobs`` row (or the parameters of its INSERT).

    An offloaded payload column takes its value from ``bodies``; with ``bodies=None``
    (dispatch's selection, which never needs payloads) it reads as empty instead.
    """
    return job_from_values(list(_ROW_GET(row)), bodies)


_ROW_WIDTH = len(ROW_COLUMNS)


def job_from_record(record: Sequence[Any], bodies: Bodies | None = None) -> Job:
    """A :class:`Job` from a row whose first columns are :data:`ROW_COLUMNS`, in order
    (PostgreSQL's hot statements select and return them so); any columns after them are
    the statement's own (a claim's ``claimed``, the eligible read's ``seq``) and ignored.

    By position: an asyncpg record copies its values out in one C call, where reading
    its 35 columns by name (:func:`job_from_row`) cost about 1.3 us a row, twice per
    job dispatched (its selection and its claim)."""
    values = list(record)
    del values[_ROW_WIDTH:]
    return job_from_values(values, bodies)


_SELECTED_DECODED = [(i, decode) for i, decode in _DECODED if ROW_COLUMNS[i] not in HOLLOW]
_ARGS_AT, _KWARGS_AT = ROW_COLUMNS.index("args"), ROW_COLUMNS.index("kwargs")


def selected_job(record: Sequence[Any]) -> Job:
    """:func:`job_from_record` for a row of dispatch's selection, whose payload columns
    all read as their :data:`HOLLOW` literals (see ``adapters.sql.schema.selection``):
    those are set to their empty values rather than decoded. Every job dispatched is
    read here once or more (a read-ahead that ages reads its jobs again), and decoding
    the empty ``args`` and ``kwargs`` texts was about a tenth of a row's decoding."""
    values = list(record)
    del values[_ROW_WIDTH:]
    for i, decode in _SELECTED_DECODED:
        values[i] = decode(values[i])
    values[_ARGS_AT] = ()
    values[_KWARGS_AT] = {}
    return Job(*values)


def job_from_values(values: list[Any], bodies: Bodies | None) -> Job:
    """A :class:`Job` from a row's column values in its fields' order (see
    :func:`job_from_row`), which this decodes in place.

    Columns held as is are copied without a call each, all in one, and the job is built
    from positions: every selected and claimed job passes through here, and the calls and
    the keyword dict were most of its cost.
    """
    if OFFLOADED in PAYLOADS_AT(values):
        return _job_with_bodies(values, bodies)
    for i, decode in _DECODED:
        values[i] = decode(values[i])
    return Job(*values)


def _job_with_bodies(values: list[Any], bodies: Bodies | None) -> Job:
    """:func:`job_from_values` for a row with an offloaded column: each such column is
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
    job_id = values[ID_AT]
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
            # (CoreQueries._read_with_bodies); only a hand-edited store gets here.
            # Saying so beats returning a job with its arguments gone.
            raise StorageError(f"job {job_id}: its offloaded {column} is missing")
        values[i] = check_payload(job_id, column, *stored, _DECODE_AT[i])
        loaded.add(i)
    return loaded


def claimed_jobs(
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


def whole_jobs(rows: Sequence[Mapping[Any, Any]], bodies: Bodies) -> list[Job]:
    """The jobs of ``rows`` whose payloads ``bodies`` holds; a job whose payload went
    between the two reads (its checkpoint replaced meanwhile) is left out, as if it were
    gone: an enqueue looking for the job holding its key then tries again
    (:meth:`adapters.sql.enqueue.EnqueueRule.run`), and reads it as it now stands."""
    return [job_from_row(r, bodies) for r in rows if not _lacks_body(r, bodies)]


def bodies_missing(rows: Sequence[Mapping[Any, Any]], bodies: Bodies) -> bool:
    """Whether a row of ``rows`` marks a payload that ``bodies`` lacks."""
    return any(_lacks_body(row, bodies) for row in rows)


def _lacks_body(row: Mapping[Any, Any], bodies: Bodies) -> bool:
    """Whether ``row`` marks a payload that ``bodies`` lacks."""
    return is_offloaded(row) and any(
        row[column] == OFFLOADED and (row["id"], column) not in bodies for column in OFFLOADABLE
    )


Payload = tuple[uuid.UUID, str, str, str]
"""One ``broker_payloads`` row: ``(job id, column, text, its SHA-256)``."""


def offload(
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
        if moves_out(text := row.get(column), threshold)
    ]
    if not moved:
        return row, moved
    return {**row, **{column: OFFLOADED for _, column, _, _ in moved}}, moved


def moves_out(text: str | None, threshold: int | None) -> TypeGuard[str]:
    """Whether :func:`offload` moves a payload column holding ``text`` out of its row."""
    return threshold is not None and text is not None and len(text) > threshold


def kept(moved: Sequence[Payload], stored: Collection[uuid.UUID]) -> list[Payload]:
    """The payloads of the jobs whose row was written (``stored``): a job fenced out or
    found a duplicate writes none."""
    return [p for p in moved if p[0] in stored]


def encode_changes(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Job field values keyed and encoded as ``broker_jobs`` columns (in one pass: every
    report and claim passes here)."""
    return {COLUMN_OF[name]: _ENCODE[name](value) for name, value in changes.items()}


ROWS_JSON = msgspec.json.Encoder()
"""Rows for PostgreSQL's enqueue (:mod:`adapters.sql.postgres`): column values as JSON (ids
as text; the values are the columns' own, so nothing is lost on the way)."""


def new_row(job_fields: Mapping[str, Any]) -> dict[str, Any]:
    """The columns of a new job's row that are not NULL (what an enqueue inserts: a
    column left out is NULL), from the job's fields by name, those at their defaults
    left out (:func:`~broker.settlement.enqueued_fields`). Most of a new job's are NULL;
    PostgreSQL's enqueue sends its rows as JSON (``json_to_recordset`` reads an absent
    key as NULL), and the nulls were half its text: encoded by the main, sent and parsed
    by the server for nothing. No encoding turns a value into NULL or NULL into a value.

    One pass over the fields given, each column and its encoder found by one lookup,
    over the defaults' row encoded once: every enqueued job passes here, and merging
    the rows and then trying every encoder on the merged row cost 4.9 us a job (of
    the main's 26 in a bulk enqueue), this about half of it."""
    row = _DEFAULT_ROW.copy()
    for name, value in job_fields.items():
        if value is not None:
            column, encode = _COLUMN_ENCODE[name]
            row[column] = value if encode is None else encode(value)
    return row


_COLUMN_ENCODE = {
    name: (column, None if encode is _same else encode) for name, column, encode, _ in _FIELDS
}
"""Each :class:`Job` field's column and encoder (``None``: the value as it is)."""
_DEFAULT_ROW = {
    COLUMN_OF[name]: _ENCODE[name](value)
    for name, value in JOB_DEFAULTS.items()
    if value is not None
}
"""The columns of the :class:`Job` fields whose default is not NULL, at it, encoded:
under every new row."""


def new_columns(field_columns: Mapping[str, list[Any]], count: int) -> dict[str, list[Any]]:
    """:func:`new_row` of each of ``count`` new jobs, by column, from their fields by
    field (:func:`broker.jobs.new_jobs_columns`): each column's values over the jobs, a
    column NULL in every row left out, as :func:`new_row` leaves a NULL out of its row.

    A column of one value (a bulk batch's task, queue, times, status and mode mostly
    are) is encoded once; the others value by value, a NULL one as the defaults' row
    has it. A unit test holds this to :func:`new_row`, row by row."""
    out = {column: [value] * count for column, value in _DEFAULT_ROW.items()}
    for name, values in field_columns.items():
        column, encode = _COLUMN_ENCODE[name]
        default = _DEFAULT_ROW.get(column)
        first = values[0]
        if all(map(operator.is_, values, itertools.repeat(first, count))):
            # The same object (by identity: equal values of different types, ``1`` and
            # ``True`` in an argument list, encode apart).
            if first is not None:
                out[column] = [first if encode is None else encode(first)] * count
            continue  # all NULL: the default's column stays, or none
        if encode is None:
            out[column] = [default if v is None else v for v in values]
        else:
            out[column] = [default if v is None else encode(v) for v in values]
    return out


NULL_ROW = dict.fromkeys(ROW_COLUMNS)
"""Every column NULL: under the columns :func:`new_row` leaves out, for an insert that
names every column in every row (SQLAlchemy's, PostgreSQL's one-job insert)."""
INSERT_VALUES = operator.itemgetter(*INSERT_COLUMNS)
"""A full row's values in :data:`INSERT_COLUMNS` order, in one C call."""


def new_values(spec: JobSpec, now: datetime) -> list[Any]:
    """:func:`new_row` of ``spec``'s new job enqueued at ``now`` (nothing moved out), as
    a full row's values in :data:`INSERT_COLUMNS` order: PostgreSQL's one-job insert
    binds them as its parameters.

    Made in one pass over the new job's fields (:func:`broker.jobs.new_job_values`, the
    definition every new row derives from), each encoded into its place by the codec
    :func:`new_row` uses, over the defaults' values: no dict of the fields, none of the
    row, none of the row over the NULL row. Every one-at-a-time enqueue passes here, and
    right after each wait for the server (caches cold) those three dicts of 16-34
    entries were most of the broker's Python per job. A unit test holds this to
    :func:`new_row` and :func:`new_columns`."""
    values = _NEW_VALUES.copy()
    for (at, encode), value in zip(_NEW_PLACES, new_job_values(spec, now), strict=True):
        if value is not None:
            values[at] = value if encode is None else encode(value)
    return values


_NEW_VALUES = [_DEFAULT_ROW.get(column) for column in INSERT_COLUMNS]
"""The defaults' row (:data:`_DEFAULT_ROW`) as a full row's values, NULL elsewhere."""
_NEW_PLACES = [
    (INSERT_COLUMNS.index(column), encode)
    for column, encode in map(_COLUMN_ENCODE.__getitem__, NEW_JOB_FIELDS)
]
"""Where each of :data:`~broker.jobs.NEW_JOB_FIELDS` goes in a full row, and its encoder."""
ARGS_IN_VALUES = INSERT_COLUMNS.index("args")
KWARGS_IN_VALUES = INSERT_COLUMNS.index("kwargs")
"""Where a new job's payloads (its args and kwargs, as JSON) are in :func:`new_values`'."""


def in_chunks(items: Sequence[_T], size: int = _CHUNK) -> list[Sequence[_T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def encode_cursor(created_us: int, job_id: uuid.UUID) -> str:
    raw = f"{created_us}.{job_id.hex}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[int, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created, _, hex_id = raw.partition(".")
        return int(created), uuid.UUID(hex=hex_id)
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"invalid list_jobs cursor {cursor!r}") from exc


def grant(
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


async def sa_bodies(conn: AsyncConnection, rows: Sequence[Mapping[Any, Any]]) -> Bodies:
    """The offloaded payloads of ``rows`` (a SQLAlchemy connection, or an application's
    connection that offers ``mappings()`` as :func:`adapters.sql.enqueue.statements` describes)."""
    wanted = [r["id"] for r in rows if is_offloaded(r)]
    bodies: dict[tuple[uuid.UUID, str], tuple[str, str | None]] = {}
    for chunk in in_chunks(wanted):
        found = await conn.execute(sa.select(payloads).where(payloads.c.job_id.in_(chunk)))
        bodies.update(
            {(r["job_id"], r["kind"]): (r["body"], r["digest"]) for r in found.mappings()}
        )
    return bodies
