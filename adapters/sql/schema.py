"""Tables, indexes and forward migrations for :mod:`adapters.sql`.

Every table is defined without a schema; on PostgreSQL the adapter maps ``None`` to
its configured schema with ``schema_translate_map``, so one definition serves both.

Times are BIGINT microseconds since the Unix epoch (UTC): they compare and index the
same way on every backend and never lose precision to a driver's datetime handling.

A migration is a function of a synchronous connection (run under ``run_sync``) that
moves the store from version ``n - 1`` to ``n``; :data:`MIGRATIONS` lists them in
order. ``setup()`` runs the missing ones inside one locked transaction.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from broker.storage import SCHEMA_VERSION, payload_digest

_QUEUED = "queued"
_HANDED_OFF = "handed_off"


def _define(
    md: sa.MetaData, version: int, dialect: str | None = None
) -> tuple[sa.Table, sa.Table, sa.Table]:
    """The tables as they stand at schema ``version``, defined on ``md``, with their
    indexes for ``dialect`` (the connection's, ``"sqlite"`` or ``"postgresql"``) when one
    is given.

    A migration's DDL must never change once released, so everything added after
    version 1 is gated on ``version`` here: :func:`_v1_initial` builds the version-1
    shape from this very function, and later migrations add the rest step by step.

    Only DDL needs the indexes, and an index's partial ``WHERE`` is a dialect's option:
    SQLAlchemy loads a dialect to check its options, and the PostgreSQL one imports every
    PostgreSQL driver module (about 30 ms of a SQLite main's start-up, which the test
    suite pays per main). So statements' tables (:data:`metadata`) have no indexes, and
    a migration names its connection's dialect alone.
    """
    jobs = sa.Table(
        "broker_jobs",
        md,
        sa.Column("id", sa.Uuid(), primary_key=True),
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("args", sa.Text(), nullable=False),
        sa.Column("kwargs", sa.Text(), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.BigInteger(), nullable=False),
        sa.Column("run_at_us", sa.BigInteger(), nullable=False),
        sa.Column("created_us", sa.BigInteger(), nullable=False),
        sa.Column("updated_us", sa.BigInteger(), nullable=False),
        sa.Column("execution_mode", sa.Text(), nullable=False),
        sa.Column("handoff_id", sa.Uuid(), nullable=True),
        sa.Column("worker_id", sa.Text(), nullable=True),
        sa.Column("handed_off_us", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("concurrency_key", sa.Text(), nullable=True),
        sa.Column("concurrency_limit", sa.BigInteger(), nullable=True),
        sa.Column("timeout_s", sa.Double(), nullable=True),
        # Enqueue order, the last tie-break of dispatch order (jobs of one batch share a
        # creation time). PostgreSQL fills it from an identity (added in the migration, so
        # raw-SQL inserts get one too); SQLite leaves it NULL and orders by ``rowid``.
        sa.Column("seq", sa.BigInteger(), nullable=True),
        sa.CheckConstraint(
            _STATUS_CHECK_V15 if version >= WAITING_VERSION else _STATUS_CHECK_V1,
            name="ck_broker_jobs_status",
        ),
        sa.CheckConstraint(
            "(concurrency_key IS NULL) = (concurrency_limit IS NULL)",
            name="ck_broker_jobs_concurrency",
        ),
    )
    concurrency = sa.Table(
        "broker_concurrency",
        md,
        sa.Column("key", sa.Text(), primary_key=True),
        sa.Column("active", sa.Integer(), nullable=False),
    )
    schema_version = sa.Table(
        "broker_schema",
        md,
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("version", sa.Integer(), nullable=False),
    )
    is_queued, is_handed_off, is_terminal, is_active = _predicates(jobs)

    def index(
        name: str,
        *expressions: Any,
        where: sa.ColumnElement[bool] | None = None,
        unique: bool = False,
    ) -> None:
        if dialect is not None:
            options: dict[str, Any] = {} if where is None else {f"{dialect}_where": where}
            sa.Index(name, *expressions, unique=unique, **options)

    # Dispatch: the best queued jobs first. seq is NULL on SQLite, where the index's
    # implicit trailing rowid breaks ties instead.
    index(
        DISPATCH_INDEX,
        jobs.c.priority.desc(),
        jobs.c.run_at_us,
        jobs.c.created_us,
        jobs.c.seq,
        where=is_queued,
    )
    # Version 3 leaves jobs without a key out of the key indexes: most jobs have none,
    # and each of their rows cost an index entry on every insert and every move.
    has_key = jobs.c.idempotency_key.is_not(None) if version >= 3 else None
    index(
        IDEMPOTENCY_INDEX,
        jobs.c.idempotency_key,
        unique=True,
        where=has_key,
    )
    index(
        HANDED_OFF_INDEX,
        jobs.c.worker_id,
        where=is_handed_off,
    )
    # Pruning: terminal rows by age. Partial, so no status index tempts the planner away
    # from the dispatch index for queued rows.
    index(
        "ix_broker_jobs_terminal_updated",
        jobs.c.updated_us,
        jobs.c.id,
        where=is_terminal,
    )
    # Listings, newest first (dropped on PostgreSQL by version 12, see there).
    index(CREATED_INDEX, jobs.c.created_us, jobs.c.id)
    if version >= 2:
        # Unique jobs: one active (queued or handed-off) job per unique key. Partial, so
        # finished jobs keep their key without blocking a new job.
        jobs.append_column(sa.Column("unique_key", sa.Text(), nullable=True))
        held = is_active if version < 3 else sa.and_(is_active, jobs.c.unique_key.is_not(None))
        index(
            UNIQUE_ACTIVE_INDEX,
            jobs.c.unique_key,
            unique=True,
            where=held,
        )
    if version >= 5:
        for column in _v5_columns():
            jobs.append_column(column)
    if version >= 6:
        for column in _recovery_columns():
            jobs.append_column(column)
    if version >= WAITING_VERSION:
        jobs.append_column(_has_dependents_column())
    if version >= TRACE_CONTEXT_VERSION:
        jobs.append_column(_trace_context_column())
    if version >= RATE_KEY_VERSION:
        jobs.append_column(_rate_key_column())
    if version >= DUE_INDEX_VERSION:
        # The next run time: the earliest queued job of a mode, one probe per mode
        # (see _v19_due_index).
        index(
            DUE_INDEX,
            jobs.c.execution_mode,
            jobs.c.run_at_us,
            where=is_queued,
        )
    return jobs, concurrency, schema_version


WAITING_VERSION = 15
"""The schema version of job dependencies (:mod:`broker.dependencies`): the ``waiting``
status, ``broker_jobs.has_dependents`` and the ``broker_job_links``/``broker_job_edges``
tables."""

TRACE_CONTEXT_VERSION = 17
"""The schema version of ``broker_jobs.trace_context`` (see ``docs/howto/tracing.md``)."""

DUE_INDEX_VERSION = 19
"""The schema version of :data:`DUE_INDEX` (see :func:`_v19_due_index`)."""
_STATUS_CHECK_V1 = "status IN ('queued', 'handed_off', 'completed', 'failed', 'cancelled')"
_STATUS_CHECK_V15 = (
    "status IN ('queued', 'handed_off', 'completed', 'failed', 'cancelled', 'waiting')"
)


def _has_dependents_column() -> sa.Column[Any]:
    """Version 15: set on a job once another job names it in ``depends_on``, in that
    enqueue's transaction (which locks the parent's row to set it). PostgreSQL's
    everyday settle leaves such a job out (``AND NOT has_dependents``) and settles it in a
    transaction of its own with its dependents instead; set under the row lock, it is
    seen by a settle that waited on that lock (the re-check reads the new row)."""
    return sa.Column("has_dependents", sa.Boolean(), nullable=False, server_default=sa.false())


def _link_tables(md: sa.MetaData) -> tuple[sa.Table, sa.Table]:
    """Version 15's tables. ``broker_job_links``: one row per job enqueued with parents or
    in a workflow: how many parents it still waits for (``pending``, counted down under
    the row's lock) and its options. ``broker_job_edges``: one row per parent of a job, in
    ``depends_on`` order, ``done`` once counted (so each edge counts once). Both go with
    the child (``ON DELETE CASCADE``); retention keeps a parent while a child waits."""
    links = sa.Table(
        "broker_job_links",
        md,
        sa.Column(
            "job_id",
            sa.Uuid(),
            sa.ForeignKey("broker_jobs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("pending", sa.Integer(), nullable=False),
        sa.Column("on_parent_failure", sa.Text(), nullable=False),
        sa.Column("parent_results", sa.Text(), nullable=False),
        sa.Column("workflow_id", sa.Uuid(), nullable=True),
    )
    sa.Index("ix_broker_job_links_workflow", links.c.workflow_id)
    edges = sa.Table(
        "broker_job_edges",
        md,
        sa.Column(
            "child_id",
            sa.Uuid(),
            sa.ForeignKey("broker_jobs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("position", sa.Integer(), primary_key=True),
        sa.Column("parent_id", sa.Uuid(), nullable=False),
        sa.Column("done", sa.Boolean(), nullable=False),
    )
    sa.Index("ix_broker_job_edges_parent", edges.c.parent_id)
    return links, edges


def _v5_columns() -> list[sa.Column[Any]]:
    """Version 5's columns: the last checkpoint of a job's runs and its last progress."""
    return [
        sa.Column("checkpoint", sa.Text(), nullable=True),
        sa.Column("checkpoint_seq", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("checkpoint_us", sa.BigInteger(), nullable=True),
        sa.Column("progress", sa.Double(), nullable=True),
        sa.Column("progress_message", sa.Text(), nullable=True),
    ]


def _recovery_columns() -> list[sa.Column[Any]]:
    """Version 6's columns: recovery attempts counted apart from failures, and affinity."""
    return [
        sa.Column("max_recoveries", sa.Integer(), nullable=True),
        sa.Column("local_state", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("recoveries", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("state_holder", sa.Text(), nullable=True),
    ]


def _trace_context_column() -> sa.Column[Any]:
    """Version 15's column: the W3C trace context of the span that enqueued the job, as
    JSON text (``NULL``: none)."""
    return sa.Column("trace_context", sa.Text(), nullable=True)


def _rate_key_column() -> sa.Column[Any]:
    """Version 18's column: the job's per-key rate limit bucket (``@task(rate_key=...)``
    filled at enqueue; ``NULL``: none), which dispatch reads leave out while it has no
    token."""
    return sa.Column("rate_key", sa.Text(), nullable=True)


RATE_KEY_VERSION = 18
"""The schema version of per-key rate limits (the ``rate_key`` column)."""


UNIQUE_ACTIVE_INDEX = "ux_broker_jobs_unique_key_active"
DISPATCH_INDEX = "ix_broker_jobs_dispatch"
IDEMPOTENCY_INDEX = "ux_broker_jobs_idempotency_key"
CREATED_INDEX = "ix_broker_jobs_created"
DUE_INDEX = "ix_broker_jobs_due"
HANDED_OFF_INDEX = "ix_broker_jobs_worker"


def _predicates(
    jobs: sa.Table,
) -> tuple[
    sa.ColumnElement[bool], sa.ColumnElement[bool], sa.ColumnElement[bool], sa.ColumnElement[bool]
]:
    """The predicates of the partial indexes. Queries use these very expressions, so the
    planner can prove the index applies: they render as inline literals, never as bound
    parameters (PostgreSQL cannot match ``$1`` in a generic plan, SQLite never can)."""
    is_queued = jobs.c.status == sa.literal(_QUEUED, sa.Text(), literal_execute=True)
    is_handed_off = jobs.c.status == sa.literal(_HANDED_OFF, sa.Text(), literal_execute=True)
    is_terminal = jobs.c.status.in_(
        sa.bindparam(
            "terminal_statuses",
            ("cancelled", "completed", "failed"),
            expanding=True,
            literal_execute=True,
        )
    )
    is_active = jobs.c.status.in_(
        sa.bindparam(
            "active_statuses",
            (_HANDED_OFF, _QUEUED),
            expanding=True,
            literal_execute=True,
        )
    )
    return is_queued, is_handed_off, is_terminal, is_active


OFFLOADED = ""
"""What a payload column of ``broker_jobs`` holds when its value lives in
``broker_payloads`` instead: no JSON value encodes to the empty string, so the mark can
never be mistaken for a value, and the hot row keeps a few bytes in place of megabytes."""

OFFLOADABLE = ("args", "kwargs", "result", "checkpoint")
"""The ``broker_jobs`` columns whose value moves to ``broker_payloads`` (under the column's
name as its ``kind``) when it is longer than the adapter's offload threshold. A checkpoint
is the one value written again and again: a save that stays in its row deletes the payload
of the checkpoint it replaces, in the save's own transaction."""


HOLLOW = {"args": "[]", "kwargs": "{}", "result": None, "checkpoint": None}
"""What a payload column reads as where payloads are left out (dispatch's selection,
summaries, an offloaded value without its body): the JSON of an empty value."""


def selection(columns: Sequence[str], prefix: str = "") -> str:
    """A select list of ``columns`` in their order, each payload column (see
    :data:`OFFLOADABLE`) read as its :data:`HOLLOW` literal instead. Dispatch's selection
    never needs payloads (the claim returns the rows in full), and reading arguments of
    kilobytes for every job read, only to decode and drop them, cost the store, the wire
    and the main."""
    out = []
    for column in columns:
        if column in HOLLOW:
            value = HOLLOW[column]
            literal = "NULL" if value is None else f"'{value}'"
            out.append(f"{literal} AS {column}")
        else:
            out.append(f"{prefix}{column}")
    return ", ".join(out)


PAYLOAD_DIGESTS_VERSION = 14
"""The schema version from which every ``broker_payloads`` row has its ``digest``."""


def _define_payloads(md: sa.MetaData, version: int = SCHEMA_VERSION) -> sa.Table:
    """Schema version 4's side table: one large JSON value of one job per row.

    Deleting a job deletes its payloads (``ON DELETE CASCADE``), whoever deletes it, so
    retention can never leave one behind. ``kind`` names the job column it stands in for
    (see :data:`OFFLOADABLE`). From :data:`PAYLOAD_DIGESTS_VERSION`, ``digest`` holds the
    SHA-256 of ``body`` (:func:`broker.storage.payload_digest`), checked at every load.
    """
    digest = [sa.Column("digest", sa.Text())] if version >= PAYLOAD_DIGESTS_VERSION else []
    return sa.Table(
        "broker_payloads",
        md,
        sa.Column(
            "job_id",
            sa.Uuid(),
            sa.ForeignKey("broker_jobs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("kind", sa.Text(), primary_key=True),
        sa.Column("body", sa.Text(), nullable=False),
        *digest,
    )


metadata = sa.MetaData()
"""The current schema (:data:`SCHEMA_VERSION`), which every query is written against:
tables without their indexes, which only the migrations create (see :func:`_define`)."""
jobs, concurrency, schema_version = _define(metadata, SCHEMA_VERSION)
payloads = _define_payloads(metadata)
_, IS_HANDED_OFF, IS_TERMINAL, IS_ACTIVE = _predicates(jobs)
job_links, job_edges = _link_tables(metadata)
INSERT_COLUMNS = [c.name for c in jobs.c if c.name not in ("seq", "has_dependents")]
"""What the hot paths' enqueue writes: every column but ``seq``, which PostgreSQL fills
in (SQLite leaves it NULL and orders by ``rowid``), and ``has_dependents`` (false)."""

CHANNEL_PREFIX = "broker_jobs_"
_MAX_IDENTIFIER_BYTES = 63


def notify_channel(schema: str) -> str:
    """The LISTEN channel that inserts into ``schema``'s job table notify.

    Must agree with the plpgsql in :func:`_create_notify_trigger`.
    """
    channel = CHANNEL_PREFIX + schema
    if len(channel.encode()) > _MAX_IDENTIFIER_BYTES:
        channel = CHANNEL_PREFIX + hashlib.md5(schema.encode(), usedforsecurity=False).hexdigest()
    return channel


def _qualified(conn: sa.Connection, schema: str | None, name: str) -> str:
    quote = conn.dialect.identifier_preparer.quote
    return f"{quote(schema)}.{quote(name)}" if schema else quote(name)


def _create_notify_trigger(conn: sa.Connection, schema: str | None) -> None:
    """A statement-level trigger, so inserts by any process, even raw SQL, wake listeners.

    The channel is derived from the table's schema at run time (``TG_TABLE_SCHEMA``),
    so it stays right whatever ``search_path`` the creating session had.
    """
    _create_notify_function(conn, schema, quiet_sessions=False)
    _create_notify_statement_trigger(conn, schema, when="")


def _create_notify_statement_trigger(conn: sa.Connection, schema: str | None, when: str) -> None:
    """(Re)create the statement-level trigger itself; ``when``: its ``WHEN`` clause, if any."""
    table = _qualified(conn, schema, "broker_jobs")
    conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS broker_jobs_notify ON {table}")
    conn.exec_driver_sql(
        f"CREATE TRIGGER broker_jobs_notify AFTER INSERT ON {table} FOR EACH STATEMENT {when} "
        f"EXECUTE FUNCTION {_qualified(conn, schema, 'broker_jobs_notify')}()"
    )


QUIET_INSERTS_SETTING = "broker.quiet_inserts"
"""A session setting: a session that sets it ``on`` inserts jobs without notifying
(schema version 7 on). The main's own enqueue sessions do: the main wakes its dispatcher
itself after each enqueue, and the notification only came back to it as a second wake,
at the cost of a round of work in the inserting backend, the listening one and the main."""


def _create_notify_function(conn: sa.Connection, schema: str | None, quiet_sessions: bool) -> None:
    """The trigger's function; ``quiet_sessions``: skipped in a session that sets
    :data:`QUIET_INSERTS_SETTING` (schema version 7 on)."""
    func = _qualified(conn, schema, "broker_jobs_notify")
    quiet = (
        f"IF current_setting('{QUIET_INSERTS_SETTING}', true) = 'on' THEN RETURN NULL; END IF;"
        if quiet_sessions
        else ""
    )
    conn.exec_driver_sql(
        f"""
        CREATE OR REPLACE FUNCTION {func}() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            channel text := '{CHANNEL_PREFIX}' || TG_TABLE_SCHEMA;
        BEGIN
            {quiet}
            IF octet_length(channel) > {_MAX_IDENTIFIER_BYTES} THEN
                channel := '{CHANNEL_PREFIX}' || md5(TG_TABLE_SCHEMA);
            END IF;
            PERFORM pg_notify(channel, '');
            RETURN NULL;
        END
        $$
        """
    )


def _index_at(conn: sa.Connection, version: int, name: str) -> sa.Index:
    """Index ``name`` as schema ``version`` defines it for ``conn``'s dialect: a migration
    creates what its own version defined, whatever later versions change."""
    jobs = _define(sa.MetaData(), version, conn.dialect.name)[0]
    (index,) = (i for i in jobs.indexes if i.name == name)
    return index


def _v1_initial(conn: sa.Connection, schema: str | None) -> None:
    """Version 1: the three tables, their indexes and (PostgreSQL) the notify trigger."""
    # The caller has checked, under the setup lock, that no table exists yet.
    v1 = sa.MetaData()
    _define(v1, 1, conn.dialect.name)
    v1.create_all(conn, checkfirst=False)
    conn.execute(schema_version.insert().values(id=1, version=0))
    if conn.dialect.name == "postgresql":
        table = _qualified(conn, schema, "broker_jobs")
        conn.exec_driver_sql(
            f"ALTER TABLE {table} ALTER COLUMN seq SET NOT NULL, "
            "ALTER COLUMN seq ADD GENERATED BY DEFAULT AS IDENTITY"
        )
        _create_notify_trigger(conn, schema)


def _v2_unique_key(conn: sa.Connection, schema: str | None) -> None:
    """Version 2: ``unique_key`` and its partial unique index over active jobs.

    The column is nullable with no default, so adding it rewrites no rows on either
    backend; the index is empty for existing rows, whose key is NULL.
    """
    table = _qualified(conn, schema, "broker_jobs")
    conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN unique_key TEXT")
    _index_at(conn, 2, UNIQUE_ACTIVE_INDEX).create(conn)


def _v3_partial_key_indexes(conn: sa.Connection, schema: str | None) -> None:
    """Version 3: the idempotency and unique-key indexes leave out rows without a key.

    Measured with ``EXPLAIN (ANALYZE, WAL)`` on PostgreSQL, a job's insert, claim and
    settle wrote 19.3 WAL records (1,588 bytes) before and 14.3 (1,265 bytes) after:
    every non-HOT update of a keyless row had added a NULL entry to both. The indexes
    are rebuilt as version 3 defines them; queries already test the key for
    equality, which implies ``IS NOT NULL``, so the planner still uses them.
    """
    for name in (IDEMPOTENCY_INDEX, UNIQUE_ACTIVE_INDEX):
        conn.exec_driver_sql(f"DROP INDEX {_qualified(conn, schema, name)}")
        _index_at(conn, 3, name).create(conn)


def _v5_checkpoints(conn: sa.Connection, schema: str | None) -> None:
    """Version 5: checkpoints and progress (``docs/howto/long-jobs.md``).

    Every column is nullable or has a constant default, so adding them rewrites no rows
    on PostgreSQL (11 and later) or SQLite; no index is needed: they are only read with
    their row and written under its primary key.
    """
    table = _qualified(conn, schema, "broker_jobs")
    for column in _v5_columns():
        kind = column.type.compile(dialect=conn.dialect)
        default = "" if column.nullable else " NOT NULL DEFAULT 0"
        conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column.name} {kind}{default}")


def _task_catalog_table(md: sa.MetaData) -> sa.Table:
    """The task catalog (version 9): one row per task and worker that declared it, with
    the declaration as JSON text (the store never reads inside it) and when it was last
    seen, in microseconds like every time here."""
    return sa.Table(
        "broker_tasks",
        md,
        sa.Column("task", sa.Text(), primary_key=True),
        sa.Column("worker_id", sa.Text(), primary_key=True),
        sa.Column("declaration", sa.Text(), nullable=False),
        sa.Column("seen_us", sa.BigInteger(), nullable=False),
    )


task_catalog = _task_catalog_table(metadata)


def _v9_task_catalog(conn: sa.Connection, schema: str | None) -> None:
    """Version 9: the task catalog, a new table (no existing row changes)."""
    _task_catalog_table(sa.MetaData()).create(conn)


def _queue_settings_table(md: sa.MetaData) -> sa.Table:
    """The queues' operator settings (version 15): one row per queue that has any (paused,
    or a rate limit: ``rate_count`` dispatches per ``rate_per``, ``s``, ``m`` or ``h``, with
    ``rate_burst``). A queue with nothing set has no row."""
    return sa.Table(
        "broker_queue_settings",
        md,
        sa.Column("queue", sa.Text(), primary_key=True),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("rate_count", sa.Integer()),
        sa.Column("rate_per", sa.Text()),
        sa.Column("rate_burst", sa.Integer()),
    )


queue_settings = _queue_settings_table(metadata)


def _v16_queue_settings(conn: sa.Connection, schema: str | None) -> None:
    """Version 16: the queue settings, a new table (no existing row changes); left as it
    is if a store rolled back to an older version by hand kept it."""
    _queue_settings_table(sa.MetaData()).create(conn, checkfirst=True)


def _v4_payloads(conn: sa.Connection, schema: str | None) -> None:
    """Version 4: ``broker_payloads``, where values over the offload threshold live.

    A new table only: existing rows keep their payloads inline, which every reader
    still understands (only the empty string, never JSON, marks a value as offloaded).
    """
    v4 = sa.MetaData()
    _define(v4, 4)
    _define_payloads(v4, 4).create(conn, checkfirst=False)


def _v6_recoveries(conn: sa.Connection, schema: str | None) -> None:
    """Version 6: ``recoveries`` (lost attempts, counted apart from ``attempts``), the
    job's own ``max_recoveries``, and ``local_state`` with its ``state_holder`` for
    affinity. The defaults are constants, so neither backend rewrites existing rows."""
    table = _qualified(conn, schema, "broker_jobs")
    for column in _recovery_columns():
        ddl = sa.schema.CreateColumn(column).compile(dialect=conn.dialect)
        conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {ddl}")


def _v7_quiet_main_inserts(conn: sa.Connection, schema: str | None) -> None:
    """Version 7: the notify trigger stays silent in sessions that set
    :data:`QUIET_INSERTS_SETTING` (the main's own enqueues). Only the trigger's function
    is replaced; rows, indexes and the trigger itself are untouched. SQLite has no trigger.
    """
    if conn.dialect.name == "postgresql":
        _create_notify_function(conn, schema, quiet_sessions=True)


LEADER_TABLE = "broker_leader"
FENCE_FUNCTION = "broker_fence"
FENCED_SQLSTATE = "BR001"
"""What :data:`FENCE_FUNCTION` raises for a statement made under an older epoch."""


def _v8_leader(conn: sa.Connection, schema: str | None) -> None:
    """Version 8 (PostgreSQL only): the leader row and the epoch fence of several mains.

    ``broker_leader`` holds at most one row: the elected main (``holder``), the address
    its peers reach it at, its ``epoch`` (one more at every takeover) and when its lease
    ends, in the database's own clock so that the mains' clocks never matter.

    ``broker_fence(epoch)`` is called by every claim and settle statement of an elected
    main: it takes ``FOR KEY SHARE`` on the leader row and raises SQLSTATE ``BR001`` when
    the row's epoch is not the caller's, which aborts the whole statement. Why that is
    safe under READ COMMITTED: ``epoch`` is unique, so it is a key column, and a
    takeover, which changes it, locks the row ``FOR UPDATE``, which conflicts with
    ``FOR KEY SHARE``. If the takeover committed first, the function (a fresh snapshot
    per query, as any volatile function's) reads the new epoch and raises. If the
    statement's lock came first, the takeover waits for the statement's transaction to
    commit, so the new leader's orphan scan, made after the takeover, sees what the old
    leader changed. If the takeover is in progress, the lock waits for it, then reads
    the row's newest version (the locking clause's re-check) and raises. A renewal
    changes only ``expires_at`` (``FOR NO KEY UPDATE``), which does not conflict: claims
    and settles never hold up the leader's renewals, however many overlap.

    An epoch of NULL (a store used without election: tests, the operator's command) is
    not fenced. SQLite stores hold one main only (:class:`adapters.sql.connect.MainLock`) and have
    neither.
    """
    if conn.dialect.name != "postgresql":
        return
    table = _qualified(conn, schema, LEADER_TABLE)
    conn.exec_driver_sql(
        f"""
        CREATE TABLE {table} (
            id SMALLINT PRIMARY KEY CHECK (id = 1),
            epoch BIGINT NOT NULL UNIQUE,
            holder TEXT NOT NULL,
            address TEXT NOT NULL,
            expires_at TIMESTAMPTZ NOT NULL
        )
        """
    )
    conn.exec_driver_sql(
        f"""
        CREATE FUNCTION {_qualified(conn, schema, FENCE_FUNCTION)}(wanted BIGINT)
        RETURNS BOOLEAN LANGUAGE plpgsql VOLATILE AS $$
        DECLARE
            current BIGINT;
        BEGIN
            IF wanted IS NULL THEN
                RETURN true;
            END IF;
            SELECT epoch INTO current FROM {table} WHERE id = 1 FOR KEY SHARE;
            IF current IS DISTINCT FROM wanted THEN
                RAISE EXCEPTION 'deposed: epoch % is not the leader''s (it is %)',
                    wanted, current USING ERRCODE = '{FENCED_SQLSTATE}';
            END IF;
            RETURN true;
        END
        $$
        """
    )


def _v10_offloaded_checkpoints(conn: sa.Connection, schema: str | None) -> None:
    """Version 10: a checkpoint over the offload threshold lives in ``broker_payloads``
    (kind ``checkpoint``), its row holding :data:`OFFLOADED`. No table changes; the version
    is what makes an older broker refuse the store, since it would take the mark for a
    checkpoint (and fail to decode it) instead of loading the payload. Rows written before
    keep their checkpoints inline, which this version reads as ever."""


def _v11_dispatch_by_mode(conn: sa.Connection, schema: str | None) -> None:
    """Version 11 (PostgreSQL only): the dispatch index leads with ``execution_mode``.

    Dispatch reads each mode's best queued jobs (a read per mode with free slots, see
    ``adapters.sql.postgres_sql``). With the mode as a mere filter, a read for a mode with no
    queued job walked every queued row of the others before coming back empty: 0.5 ms of
    the server's CPU per read at a 5,000-job backlog, two such reads per dispatch pass in
    a pooled drain whose worker also had inline and forked slots free. Led by the mode,
    each read is an ordered index scan of that mode's rows alone, a few entries deep.

    SQLite keeps the version-1 index: its reads of several modes at once sort nothing
    there, and it has no per-mode statement.
    """
    if conn.dialect.name != "postgresql":
        return
    table = _qualified(conn, schema, "broker_jobs")
    conn.exec_driver_sql(f"DROP INDEX {_qualified(conn, schema, DISPATCH_INDEX)}")
    conn.exec_driver_sql(
        f"CREATE INDEX {DISPATCH_INDEX} ON {table} "
        "(execution_mode, priority DESC, run_at_us, created_us, seq) WHERE status = 'queued'"
    )


def _v12_no_creation_index(conn: sa.Connection, schema: str | None) -> None:
    """Version 12 (PostgreSQL only): ``ix_broker_jobs_created`` is dropped.

    Only listings read it, yet every claim and every settlement wrote to it: a job's
    status is in the partial indexes' predicates, so none of its moves is a HOT update,
    and each new row version takes an entry in every full index. A listing instead
    scans the rows its filter keeps (the whole table, unfiltered) and keeps the newest
    ``limit`` of them in a bounded sort: linear in the table's size, which pruning
    bounds, for an operator's page read, instead of two index writes per job drained.

    SQLite keeps the index: it touches an index on UPDATE only when one of that index's
    columns changes, so there the index costs the moves nothing.
    """
    if conn.dialect.name != "postgresql":
        return
    conn.exec_driver_sql(f"DROP INDEX {_qualified(conn, schema, CREATED_INDEX)}")


def _v13_quiet_inserts_skip_the_trigger(conn: sa.Connection, schema: str | None) -> None:
    """Version 13 (PostgreSQL only): the quiet-session test moves from the trigger's
    function (version 7) into the trigger's ``WHEN`` clause, so a main's own inserts no
    longer start the plpgsql function at all: the server skipped ~15 us of CPU per insert
    statement, which a one-at-a-time enqueue pays in full. The function goes back to its
    version-1 body, the test being the trigger's now; other writers still notify."""
    if conn.dialect.name != "postgresql":
        return
    _create_notify_function(conn, schema, quiet_sessions=False)
    _create_notify_statement_trigger(
        conn,
        schema,
        when=f"WHEN (current_setting('{QUIET_INSERTS_SETTING}', true) IS DISTINCT FROM 'on')",
    )


_DIGEST_BACKFILL_ROWS = 16
"""Payload rows hashed per round of SQLite's version-14 backfill: each may be megabytes,
so the migration holds a few at a time, never the whole table."""


def _v14_payload_digests(conn: sa.Connection, schema: str | None) -> None:
    """Version 14: ``broker_payloads.digest``, the SHA-256 of each offloaded value's text,
    which every load checks (see :class:`broker.storage.SupportsOffload`).

    Rows written before get theirs here, computed from their body as it stands at the
    upgrade: they are trusted as they were stored (an older broker wrote no digest to
    check them against), and from then on checked like any other. So after the
    migration no row lacks a digest, and a load treats a missing one as a failed check
    (only a hand edit can remove it). PostgreSQL hashes in one statement on the server;
    SQLite has no SHA-256 function, so its rows are read and hashed a few at a time.
    The column is nullable only because SQLite cannot add a NOT NULL column without a
    default; the broker never writes a NULL.
    """
    table = _qualified(conn, schema, "broker_payloads")
    conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN digest TEXT")
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            f"UPDATE {table} SET digest = encode(sha256(convert_to(body, 'UTF8')), 'hex')"
        )
        return
    after = 0  # rowids start at 1; in their order, each round seeks past the last one read
    while True:
        rows = conn.exec_driver_sql(
            f"SELECT rowid, body FROM {table} WHERE rowid > ? ORDER BY rowid "
            f"LIMIT {_DIGEST_BACKFILL_ROWS}",
            (after,),
        ).fetchall()
        if not rows:
            return
        conn.exec_driver_sql(
            f"UPDATE {table} SET digest = ? WHERE rowid = ?",
            [(payload_digest(body), rowid) for rowid, body in rows],
        )
        after = rows[-1][0]


def _v15_dependencies(conn: sa.Connection, schema: str | None) -> None:
    """Version 15: job dependencies. The status check admits ``waiting``, every job gets
    ``has_dependents`` (false: a constant default, no row rewritten on PostgreSQL), and
    the two link tables are created empty. Each step is skipped where the store already
    has it (a store rebuilt by hand from the current definitions).

    """
    table = _qualified(conn, schema, "broker_jobs")
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            f"ALTER TABLE {table} DROP CONSTRAINT ck_broker_jobs_status, "
            f"ADD CONSTRAINT ck_broker_jobs_status CHECK ({_STATUS_CHECK_V15}), "
            "ADD COLUMN IF NOT EXISTS has_dependents BOOLEAN NOT NULL DEFAULT false"
        )
    else:
        # SQLite cannot alter a check in place. The check only admits one value more,
        # which every stored row satisfies, so SQLite's documented shortcut for
        # loosening a constraint applies: the table's stored definition is edited and
        # the schema cookie bumped (nothing on disk changes, no row is copied).
        (create,) = conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'broker_jobs'"
        ).one()
        if _STATUS_CHECK_V15 not in create:
            if create.count(_STATUS_CHECK_V1) != 1:
                raise RuntimeError("broker_jobs' status check is not the one version 14 made")
            (cookie,) = conn.exec_driver_sql("PRAGMA schema_version").one()
            conn.exec_driver_sql("PRAGMA writable_schema = ON")
            conn.exec_driver_sql(
                "UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = 'broker_jobs'",
                (create.replace(_STATUS_CHECK_V1, _STATUS_CHECK_V15),),
            )
            conn.exec_driver_sql(f"PRAGMA schema_version = {int(cookie) + 1}")
            conn.exec_driver_sql("PRAGMA writable_schema = OFF")
        columns = {row[1] for row in conn.exec_driver_sql("PRAGMA table_info(broker_jobs)")}
        if "has_dependents" not in columns:
            conn.exec_driver_sql(
                "ALTER TABLE broker_jobs ADD COLUMN has_dependents BOOLEAN NOT NULL DEFAULT 0"
            )
    v15 = sa.MetaData()
    _define(v15, WAITING_VERSION)
    _define_payloads(v15)
    for table_ in _link_tables(v15):
        table_.create(conn, checkfirst=True)


def _v17_trace_context(conn: sa.Connection, schema: str | None) -> None:
    """Version 17: ``trace_context``, nullable, so neither backend rewrites existing rows
    (they were enqueued outside any trace the broker kept)."""
    table = _qualified(conn, schema, "broker_jobs")
    ddl = sa.schema.CreateColumn(_trace_context_column()).compile(dialect=conn.dialect)
    conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {ddl}")


def _v18_rate_key(conn: sa.Connection, schema: str | None) -> None:
    """Version 18: ``rate_key``, nullable, so neither backend rewrites existing rows (they
    were enqueued before per-key limits, and spend their task's key-less bucket)."""
    table = _qualified(conn, schema, "broker_jobs")
    ddl = sa.schema.CreateColumn(_rate_key_column()).compile(dialect=conn.dialect)
    conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {ddl}")


def _v19_due_index(conn: sa.Connection, schema: str | None) -> None:
    """Version 19: :data:`DUE_INDEX`, the queued jobs by mode and ``run_at_us``.

    The next run time (when an idle dispatcher must look again) was ``min(run_at_us)``
    over the queued jobs of its modes, which no index ordered: the dispatch index leads
    with the priority, so the minimum took a walk of every queued entry, 150-190 ms at a
    million queued rows, paid after every insert another process made (issue 35). Led
    by the mode, then the time, the earliest queued job of a mode is the index's first
    entry for it: one probe, however deep the backlog. A queued row costs one more index
    entry at its insert; a claim's new row version is not queued, so takes none. Built
    from the rows already stored, in the migration's transaction; left as it is if a
    store rolled back to an older version by hand kept it.
    """
    index = _index_at(conn, DUE_INDEX_VERSION, DUE_INDEX)
    conn.execute(sa.schema.CreateIndex(index, if_not_exists=True))


Migration = Callable[[sa.Connection, str | None], None]

MIGRATIONS: tuple[tuple[int, Migration], ...] = (
    (1, _v1_initial),
    (2, _v2_unique_key),
    (3, _v3_partial_key_indexes),
    (4, _v4_payloads),
    (5, _v5_checkpoints),
    (6, _v6_recoveries),
    (7, _v7_quiet_main_inserts),
    (8, _v8_leader),
    (9, _v9_task_catalog),
    (10, _v10_offloaded_checkpoints),
    (11, _v11_dispatch_by_mode),
    (12, _v12_no_creation_index),
    (13, _v13_quiet_inserts_skip_the_trigger),
    (14, _v14_payload_digests),
    (15, _v15_dependencies),
    (16, _v16_queue_settings),
    (17, _v17_trace_context),
    (18, _v18_rate_key),
    (19, _v19_due_index),
)
"""``(version, migration)`` in ascending order; the last version is :data:`SCHEMA_VERSION`."""

assert [v for v, _ in MIGRATIONS] == list(range(1, SCHEMA_VERSION + 1)), (
    "MIGRATIONS must list every version from 1 to SCHEMA_VERSION in order"
)


def migrate(conn: sa.Connection, schema: str | None, current: int) -> None:
    """Run every migration after ``current`` and record the new version."""
    for version, step in MIGRATIONS:
        if version > current:
            step(conn, schema)
            conn.execute(
                schema_version.update().where(schema_version.c.id == 1).values(version=version)
            )
