"""The hot statements on PostgreSQL, run on asyncpg directly, one round trip each.

Why: half the main's CPU went to SQLAlchemy building, compiling and unpacking the claim
and settle statements, and a claim took five round trips (select, ``BEGIN``, ``SELECT
... FOR UPDATE``, ``UPDATE``, ``COMMIT``). Here each is one statement over arrays
(``unnest``), sent through asyncpg's own prepared-statement cache and run without an
explicit transaction, so it commits on its own. SQLAlchemy keeps the schema,
migrations and every other query.

The hot connections are a pool of their own (:class:`HotPool`), so enqueues and
listings waiting for the general pool never hold up dispatch and settlement.

This module only knows SQL text and connections; :mod:`adapters.sql.postgres` encodes the
values (with the same codecs as its SQLAlchemy path) and decodes the rows.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg_dialect

from adapters.sql.rows import ROW_COLUMNS
from adapters.sql.schema import (
    FENCE_FUNCTION,
    INSERT_COLUMNS,
    LEADER_TABLE,
    OFFLOADED,
    concurrency,
    job_edges,
    job_links,
    jobs,
    payloads,
    selection,
)

_PG: sa.Dialect = pg_dialect.dialect()  # type: ignore[no-untyped-call]


def _pg_type(column: sa.Column[Any]) -> str:
    return str(column.type.compile(dialect=_PG))


class HotSql:
    """The statements' text for one schema (``None``: the connection's search path).

    Status tests are inline literals, as the partial indexes' own predicates are, so
    the planner can use those indexes under a generic plan.
    """

    def __init__(self, schema: str | None) -> None:
        quote = _PG.identifier_preparer.quote
        prefix = f"{quote(schema)}." if schema else ""
        t = f"{prefix}{quote(jobs.name)}"
        c = f"{prefix}{quote(concurrency.name)}"
        p = f"{prefix}{quote(payloads.name)}"
        leader = f"{prefix}{quote(LEADER_TABLE)}"
        self.link_tables = (
            t,
            p,
            f"{prefix}{quote(job_links.name)}",
            f"{prefix}{quote(job_edges.name)}",
        )
        """Jobs, payloads, links and edges, for :class:`adapters.sql.links.PgLinks`."""

        def fence(n: int) -> str:
            """The epoch fence on parameter ``$n`` (see ``adapters.sql.schema._v8_leader``): an
            uncorrelated sub-select, so it runs once per statement, before the first row
            it guards changes; under an older epoch it raises and the statement changes
            nothing. A NULL epoch is not fenced."""
            return f"(SELECT {prefix}{quote(FENCE_FUNCTION)}(${n}::bigint))"

        hand_off_set = (
            "status = 'handed_off', handoff_id = w.handoff_id, worker_id = w.worker_id, "
            "handed_off_us = $4, state_holder = NULL, updated_us = $4"
        )
        wanted = "unnest($1::uuid[], $2::uuid[], $3::text[]) AS w(id, handoff_id, worker_id)"
        returned = ", ".join(f"j.{column}" for column in ROW_COLUMNS)
        """What a claim returns of a job: every column in :class:`Job`'s field order, then
        ``claimed``, so a row is decoded by position (``adapters.sql.rows.job_from_record``)."""
        # Claim, in one statement. A row without a concurrency key is handed off by the
        # UPDATE alone, whose WHERE says it is still queued and due: a claimer that
        # meets it locked waits, then checks that WHERE again on the row as committed,
        # so two claims never both win it. Locking it first (``FOR UPDATE``) wrote a
        # WAL record per row beside the UPDATE's own, for a claim only the leader makes.
        # Keyed rows keep the lock order every keyed claim keeps: the due, queued rows
        # among the wanted ones (never waiting on a row another claimer holds), then the
        # counters of their keys in key order (the latest committed counts). A keyed row
        # is granted while its key has room, in claim order (``ord``): with one limit
        # for the key, the rn-th candidate fits when active + rn <= limit, which is the
        # grant rule (adapters.sql.rows.grant). The slots taken are added to the counters
        # locked above. A key with no counter row yet, or whose candidates disagree on
        # the limit, comes back unclaimed (``claimed`` false) for ``lock_claimable`` and
        # the rest, a short transaction that applies the rule. The claims come sorted by
        # job id, with their claim order in ``$6``: the UPDATE walks them in id order
        # against the primary key, so two claims of the same rows (tests, scripts: the
        # main never makes two) wait on each other in one order and never deadlock.
        self.claim = f"""
            WITH w AS (
                SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $6::int[])
                    AS w(id, handoff_id, worker_id, ord)
            ),
            c AS (
                SELECT j.id, j.concurrency_key AS key, j.concurrency_limit AS lim
                FROM {t} j JOIN w ON j.id = w.id
                WHERE j.status = 'queued' AND j.run_at_us <= $4
                    AND j.concurrency_key IS NOT NULL AND {fence(5)}
                ORDER BY j.id
                FOR UPDATE OF j SKIP LOCKED
            ),
            k AS MATERIALIZED (
                SELECT n.key, n.active FROM {c} n
                WHERE n.key IN (SELECT c.key FROM c)
                ORDER BY n.key
                FOR UPDATE OF n
            ),
            r AS (
                SELECT c.id, c.key, c.lim, k.active,
                    row_number() OVER (PARTITION BY c.key ORDER BY w.ord) AS rn,
                    min(c.lim) OVER (PARTITION BY c.key) = max(c.lim) OVER (PARTITION BY c.key)
                        AS uniform
                FROM c JOIN w ON w.id = c.id LEFT JOIN k ON k.key = c.key
            ),
            g AS (
                SELECT id, key FROM r WHERE uniform AND active IS NOT NULL AND active + rn <= lim
            ),
            s AS (
                UPDATE {c} n SET active = n.active + t.taken
                FROM (SELECT key, count(*)::int AS taken FROM g GROUP BY key) t
                WHERE n.key = t.key
            ),
            u AS (
                UPDATE {t} j SET {hand_off_set}
                FROM w
                WHERE j.id = w.id AND j.status = 'queued' AND j.run_at_us <= $4
                    AND (j.concurrency_key IS NULL OR j.id IN (SELECT id FROM g)) AND {fence(5)}
                RETURNING {returned}
            )
            SELECT u.*, true AS claimed FROM u
            UNION ALL
            SELECT {returned}, false FROM {t} j JOIN r ON j.id = r.id
            WHERE NOT (r.uniform AND r.active IS NOT NULL)
        """
        # The keyed claim, inside a transaction: lock the rows, then the counters in key
        # order (creating missing ones), then the hand-off of the granted rows.
        self.fence = f"SELECT {fence(1)}"
        """The fence alone, first in a transaction: it holds the leader row's share lock
        until the commit, so the transaction's later statements need no fence."""
        self.lock_claimable = f"""
            SELECT * FROM {t}
            WHERE id = ANY($1::uuid[]) AND status = 'queued' AND run_at_us <= $2
            ORDER BY id
            FOR UPDATE SKIP LOCKED
        """
        self.lock_counters = f"""
            INSERT INTO {c} AS c (key, active)
            SELECT k, 0 FROM unnest($1::text[]) AS k ORDER BY k
            ON CONFLICT (key) DO UPDATE SET active = c.active
            RETURNING key, active
        """
        self.take_slots = f"""
            UPDATE {c} c SET active = c.active + t.n
            FROM unnest($1::text[], $2::int[]) AS t(key, n)
            WHERE c.key = t.key
        """
        self.hand_off = f"""
            UPDATE {t} j SET {hand_off_set}
            FROM {wanted}
            WHERE j.id = w.id AND j.status = 'queued'
            RETURNING {returned}, true AS claimed
        """

        def released(which: str) -> str:
            """The slots the settled jobs ``u`` give back (those where ``which`` holds):
            ``r``, their counters locked in key order first (``l``), as claims take them."""
            return f"""
            k AS (
                SELECT concurrency_key AS key, count(*)::int AS n FROM u
                WHERE {which} AND concurrency_key IS NOT NULL GROUP BY concurrency_key
            ),
            l AS MATERIALIZED (
                SELECT c.key FROM {c} c JOIN k ON c.key = k.key ORDER BY c.key FOR UPDATE OF c
            ),
            r AS (
                UPDATE {c} c SET active = GREATEST(c.active - k.n, 0)
                FROM k JOIN l ON l.key = k.key
                WHERE c.key = k.key
            )"""

        # Settle: every shape of move in one statement. A NULL run_at keeps the job's, a
        # false set_* keeps the column; the fence is in the WHERE. The job rows are
        # updated in id order (the input is sorted, and the plan walks it against the
        # primary key), then the counters given back are locked in key order, as claims
        # take them, by a MATERIALIZED CTE whose sorted FOR UPDATE runs before the
        # UPDATE that joins it. Locking the job rows first the same way would cost a
        # WAL record per job (measured: 4.2 -> 5.2 per settle) against a deadlock that
        # needs two settles of the same jobs at once, which PostgreSQL would detect.
        self.settle = f"""
            WITH s AS (
                SELECT * FROM unnest(
                    $1::uuid[], $2::uuid[], $3::text[], $4::bool[], $5::text[], $6::bool[],
                    $7::text[], $8::bigint[], $9::int[], $10::bigint[], $11::bool[],
                    $12::int[], $13::bool[], $14::text[], $15::float8[]
                ) AS s(id, lease, status, set_result, result, set_error, last_error,
                       run_at_us, attempts, updated_us, releases, recoveries, set_holder,
                       state_holder, progress)
                ORDER BY id
            ),
            u AS (
                UPDATE {t} j SET
                    status = s.status,
                    result = CASE WHEN s.set_result THEN s.result ELSE j.result END,
                    last_error = CASE WHEN s.set_error THEN s.last_error ELSE j.last_error END,
                    run_at_us = COALESCE(s.run_at_us, j.run_at_us),
                    attempts = j.attempts + s.attempts,
                    recoveries = j.recoveries + s.recoveries,
                    state_holder = CASE WHEN s.set_holder THEN s.state_holder
                                        ELSE j.state_holder END,
                    progress = COALESCE(s.progress, j.progress),
                    updated_us = s.updated_us
                FROM s
                WHERE j.id = s.id AND j.handoff_id = s.lease AND j.status = 'handed_off'
                    AND NOT j.has_dependents AND {fence(16)}
                RETURNING j.id, j.concurrency_key, s.releases
            ),
            {released("releases")}
            SELECT id FROM u
        """
        # A parent (``has_dependents``) is left out of both everyday statements: it is
        # settled by this one instead, in a transaction that also walks its dependents.
        self.settle_parents = (
            self.settle.replace("AND NOT j.has_dependents", "AND j.has_dependents")
            .replace("SELECT id FROM u", "SELECT id, status FROM u")
            .replace(
                "RETURNING j.id, j.concurrency_key, s.releases",
                "RETURNING j.id, j.status, j.concurrency_key, s.releases",
            )
        )
        # Completions alone (the everyday batch): the same move with one array per value
        # that differs between jobs ($6: the progress every completion sets). Binding the
        # 15 arrays cost the main a type check per element in asyncpg, about a fifth of
        # its CPU per settled job.
        self.settle_completed = f"""
            WITH s AS (
                SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[]) AS s(id, lease, result)
                ORDER BY id
            ),
            u AS (
                UPDATE {t} j SET status = 'completed', result = s.result, updated_us = $4,
                    progress = $6
                FROM s
                WHERE j.id = s.id AND j.handoff_id = s.lease AND j.status = 'handed_off'
                    AND NOT j.has_dependents AND {fence(5)}
                RETURNING j.id, j.concurrency_key
            ),
            {released("true")}
            SELECT id FROM u
        """
        # Checkpoints and progress: fenced by the lease as a settle is (and a checkpoint
        # by its number too), one statement per batch, at most one input row per job and
        # lease. A saved checkpoint kept in its row deletes the payload of an offloaded
        # one it replaces, in the same statement; one offloaded (its row holds the mark)
        # has its payload written by ``put_payloads`` in the statement's transaction.
        self.save_checkpoints = f"""
            WITH u AS (
                UPDATE {t} j SET checkpoint = s.state, checkpoint_seq = s.seq, checkpoint_us = $5
                FROM unnest($1::uuid[], $2::uuid[], $3::int[], $4::text[])
                    AS s(id, lease, seq, state)
                WHERE j.id = s.id AND j.handoff_id = s.lease AND j.status = 'handed_off'
                    AND j.checkpoint_seq < s.seq
                RETURNING j.id, j.handoff_id, j.checkpoint
            ),
            d AS (
                DELETE FROM {p} p USING u
                WHERE p.job_id = u.id AND p.kind = 'checkpoint'
                    AND u.checkpoint IS DISTINCT FROM '{OFFLOADED}'
            )
            SELECT id, handoff_id FROM u
        """
        self.save_progress = f"""
            UPDATE {t} j SET progress = s.fraction, progress_message = s.message
            FROM unnest($1::uuid[], $2::uuid[], $3::float8[], $4::text[])
                AS s(id, lease, fraction, message)
            WHERE j.id = s.id AND j.handoff_id = s.lease AND j.status = 'handed_off'
            RETURNING j.id, j.handoff_id
        """
        in_queues = " AND queue = ANY($2::text[])"
        not_in_queues = " AND queue <> ALL($2::text[])"
        not_full = (
            f"NOT EXISTS (SELECT 1 FROM {c} c WHERE c.key = j.concurrency_key "
            "AND c.active >= j.concurrency_limit)"
        )
        order = "ORDER BY priority DESC, run_at_us, created_us, seq"

        # In Job's field order, decoded by position as a claim's rows are; then ``seq``,
        # which the outer ORDER BY breaks ties with.
        selected = f"{selection(ROW_COLUMNS, 'j.')}, j.seq"

        def eligible(queue_test: str, now: int) -> str:
            """The best due jobs of the modes in ``$1``, of the tasks in ``$now + 3``
            (``NULL``: any), but those in the skipped ids (``$now + 2``) and those of the
            (task, rate key) pairs left out (``$now + 4``, ``$now + 5``: ``NULL``, none;
            a job without a key is its task's key ``''``), their payloads left out (see
            ``adapters.sql.schema.selection``), at most ``$now + 1``.

            Read from the dispatch index, which leads with the mode (see
            ``adapters.sql.schema._v11_dispatch_by_mode``), then the priority, then the
            time: per mode, its priority levels one probe each, from the highest down
            (the recursive ``lv``, a loose index scan), and per level its due jobs in
            order, an index range that ends at the first job not yet due. The mode's own
            ``LIMIT`` stops the walk once the levels read hold the limit's jobs: the
            recursion runs only as far as the rows pulled from it (the lateral join is a
            nested loop over ``lv`` in its order), so a store with jobs at a thousand
            priority levels pays for the levels a read needs, not all of them at every
            pass; the outer ``ORDER BY`` then sorts at most the limit's rows per mode.
            A read with the due bound a mere filter walked every future entry of a level
            whenever fewer due jobs than the limit stood in front of them: 38 ms at a
            million jobs scheduled ahead, paid after every insert another process made
            (issue 35). A mode without queued jobs costs one probe; each level at most the
            limit's rows; then the best of them all."""
            limit, skip, tasks, key_tasks, keys = now + 1, now + 2, now + 3, now + 4, now + 5
            level = "SELECT priority FROM {t} WHERE status = 'queued' AND execution_mode = m.mode"
            return f"""
                SELECT e.* FROM unnest($1::text[]) AS m(mode) CROSS JOIN LATERAL (
                    WITH RECURSIVE lv(p) AS (
                        SELECT ({level.format(t=t)} ORDER BY priority DESC LIMIT 1)
                        UNION ALL
                        SELECT ({level.format(t=t)} AND priority < lv.p
                                ORDER BY priority DESC LIMIT 1)
                        FROM lv WHERE lv.p IS NOT NULL
                    )
                    SELECT d.* FROM lv CROSS JOIN LATERAL (
                        SELECT {selected} FROM {t} j
                        WHERE status = 'queued' AND execution_mode = m.mode
                            AND priority = lv.p{queue_test}
                            AND run_at_us <= ${now} AND {not_full}
                            AND NOT (id = ANY(${skip}::uuid[]))
                            AND (${tasks}::text[] IS NULL OR task = ANY(${tasks}::text[]))
                            AND (${key_tasks}::text[] IS NULL OR NOT EXISTS (
                                SELECT 1 FROM unnest(${key_tasks}::text[], ${keys}::text[])
                                    AS b(task, key)
                                WHERE b.task = j.task AND b.key = COALESCE(j.rate_key, '')
                            ))
                        ORDER BY run_at_us, created_us, seq LIMIT ${limit}
                    ) d
                    LIMIT ${limit}
                ) e
                {order} LIMIT ${limit}
            """

        self.eligible = eligible("", 2)
        self.eligible_in_queues = eligible(in_queues, 3)
        self.eligible_not_in_queues = eligible(not_in_queues, 3)

        def next_run(queue_test: str) -> str:
            """The earliest ``run_at_us`` of the queued jobs of the modes in ``$1``: per
            mode, the first entry of the due index (``adapters.sql.schema._v19_due_index``)
            that passes the queue test, rather than a walk of every queued row."""
            return f"""
                SELECT min(f.run_at_us) FROM unnest($1::text[]) AS m(mode) CROSS JOIN LATERAL (
                    SELECT run_at_us FROM {t}
                    WHERE status = 'queued' AND execution_mode = m.mode{queue_test}
                    ORDER BY run_at_us LIMIT 1
                ) f
            """

        self.next_run = next_run("")
        self.next_run_in_queues = next_run(in_queues)
        self.next_run_not_in_queues = next_run(not_in_queues)
        # Enqueue: the rows come as one JSON array of objects keyed by column, not as an
        # array per column. Binding 23 arrays cost the main about 11 us of CPU per job
        # (asyncpg checks each element for nesting); the JSON, encoded by msgspec, 2 us,
        # for about 10 us more of the server's, which runs beside the main.
        typed = ", ".join(f"{name} {_pg_type(jobs.c[name])}" for name in INSERT_COLUMNS)
        names = ", ".join(INSERT_COLUMNS)
        insert = f"""
            INSERT INTO {t} ({names})
            SELECT {names} FROM ROWS FROM (json_to_recordset($1::json) AS ({typed}))
                WITH ORDINALITY AS r({names}, ord)
            {{where}}
            ORDER BY ord
            {{conflict}}
        """
        taken = "ON CONFLICT DO NOTHING RETURNING id"
        self.insert = insert.format(where="", conflict=taken)
        self.insert_fenced = insert.format(where=f"WHERE {fence(2)}", conflict=taken)
        """The insert of a batch holding jobs written handed off: fenced like a claim."""
        # A batch of new jobs by column (``adapters.sql.rows.new_columns``): one JSON object
        # of an array per column, each array read as the column's array type and the
        # arrays unnested side by side (a column left out is NULL in every row). No
        # object per job to build, encode or parse: the caller's rows and dicts were most
        # of a bulk enqueue's CPU per job. Not arrays bound by asyncpg: it checks every
        # element of each (see above).
        arrays = ", ".join(f"{name} {_pg_type(jobs.c[name])}[]" for name in INSERT_COLUMNS)
        columns = f"""
            INSERT INTO {t} ({names})
            SELECT {", ".join(f"r.{name}" for name in INSERT_COLUMNS)}
            FROM json_to_record($1::json) AS c({arrays})
                CROSS JOIN LATERAL unnest({", ".join(f"c.{name}" for name in INSERT_COLUMNS)})
                WITH ORDINALITY AS r({names}, ord)
            {{where}}
            ORDER BY ord
            {{conflict}}
        """
        self.insert_columns = columns.format(where="", conflict="")
        """Every row or none: a taken key or id fails the whole statement."""
        # One job (every one-at-a-time enqueue): its columns as parameters, in
        # INSERT_COLUMNS order. Against the JSON form, a one-job insert cost the server
        # about 40 us less (no JSON to parse, no recordset to sort) and the main about
        # 30 us less: asyncpg binds the values directly, with no JSON text to build.
        params = ", ".join(
            f"${n}::{_pg_type(jobs.c[name])}" for n, name in enumerate(INSERT_COLUMNS, 1)
        )
        one = f"INSERT INTO {t} ({names}) SELECT {params} {{where}} {{conflict}}"
        self.insert_one = one.format(where="", conflict=taken)
        self.insert_one_new = one.format(where="", conflict="RETURNING id")
        """One job with no key (no ``idempotency_key``, no ``unique_key``), outside a
        transaction: only its id can be taken, and then the statement fails (a unique
        violation) rather than doing nothing. Without ``ON CONFLICT`` the server skips the
        speculative insertion: the probe of every unique index before the insert, the
        speculative lock and the record confirming the row (one-job inserts alternated,
        200 a block over 30 blocks: 151 -> 146 us of the backend's CPU, 770 -> 725
        bytes of WAL a job)."""
        self.insert_one_fenced = one.format(
            where=f"WHERE {fence(len(INSERT_COLUMNS) + 1)}", conflict=taken
        )
        """One job written handed off, fenced like a claim."""

        def with_counters(template: str, where: str, conflict: str) -> str:
            """The insert ``template`` (with ``where`` and ``conflict``) that also creates
            the concurrency counters of the keys of the jobs it stored, at zero, in key
            order; an existing counter is left as it is, unlocked. A claim finds a key
            without a counter too new to decide in its one statement, and takes a
            transaction of its own to create it (see ``claim``): at one key per job
            (30,000 distinct keys), every claim did, and the drain fell to a fifth of
            its rate at 1,000 keys (issue 35)."""
            returning = "RETURNING id, concurrency_key"
            inserted = template.format(where=where, conflict=f"{conflict} {returning}")
            return f"""
                WITH ins AS ({inserted}),
                k AS (
                    INSERT INTO {c} (key, active)
                    SELECT DISTINCT concurrency_key, 0 FROM ins
                    WHERE concurrency_key IS NOT NULL ORDER BY 1
                    ON CONFLICT (key) DO NOTHING
                )
                SELECT id FROM ins
            """

        nothing = "ON CONFLICT DO NOTHING"
        one_fence = f"WHERE {fence(len(INSERT_COLUMNS) + 1)}"
        self.with_counters = {
            self.insert: with_counters(insert, "", nothing),
            self.insert_fenced: with_counters(insert, f"WHERE {fence(2)}", nothing),
            self.insert_columns: with_counters(columns, "", ""),
            self.insert_one: with_counters(one, "", nothing),
            self.insert_one_new: with_counters(one, "", ""),
            self.insert_one_fenced: with_counters(one, one_fence, nothing),
        }
        """Each insert, as the one that also creates its keys' counters (an enqueue in a
        transaction of its own; see ``adapters.sql.postgres``)."""
        # The election (see ``adapters.sql.schema._v8_leader``), by the database's clock. Taking
        # over: insert the row, or take it when its lease has run out (the epoch grows).
        # Neither locks a live row, so a standby's rounds never hold up the leader's
        # statements. The row as it stands comes back either way, to name the leader;
        # none when another main inserted it concurrently (ask again).
        self.elect = f"""
            WITH ins AS (
                INSERT INTO {leader} (id, epoch, holder, address, expires_at)
                VALUES (1, 1, $1, $2, clock_timestamp() + make_interval(secs => $3))
                ON CONFLICT (id) DO NOTHING
                RETURNING epoch, holder, address, true AS live
            ),
            upd AS (
                UPDATE {leader} l SET
                    epoch = l.epoch + 1, holder = $1, address = $2,
                    expires_at = clock_timestamp() + make_interval(secs => $3)
                WHERE l.id = 1 AND l.expires_at <= clock_timestamp()
                RETURNING epoch, holder, address, true AS live
            )
            SELECT * FROM ins
            UNION ALL
            SELECT * FROM upd
            UNION ALL
            SELECT epoch, holder, address, expires_at > clock_timestamp() FROM {leader}
            WHERE id = 1 AND NOT EXISTS (SELECT 1 FROM ins) AND NOT EXISTS (SELECT 1 FROM upd)
        """
        # Renewing: while the row still names this main and its epoch, nobody has been
        # elected since, so no other main ever dispatched; a lease that ran out meanwhile
        # (the main paused or starved past it, and no standby took over) is renewed as
        # if on time. Against a standby's takeover the one row decides: whichever update
        # commits first wins, and the other's condition, checked again on the row it
        # waited for, fails. A resigned lease ('-infinity') stays resigned.
        self.renew = f"""
            UPDATE {leader} SET expires_at = clock_timestamp() + make_interval(secs => $3)
            WHERE id = 1 AND holder = $1 AND epoch = $2 AND expires_at > '-infinity'
            RETURNING epoch
        """
        self.resign = f"""
            UPDATE {leader} SET expires_at = '-infinity'
            WHERE id = 1 AND holder = $1 AND epoch = $2
        """
        # Offloaded payloads: read for the jobs whose rows carry the mark, written (or
        # replaced) in the transaction that writes the row they belong to.
        # Each with its SHA-256 (``digest``), which every load checks.
        self.payloads_of = (
            f"SELECT job_id, kind, body, digest FROM {p} WHERE job_id = ANY($1::uuid[])"
        )
        self.put_payloads = f"""
            INSERT INTO {p} (job_id, kind, body, digest)
            SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[])
            ON CONFLICT (job_id, kind) DO UPDATE SET body = EXCLUDED.body, digest = EXCLUDED.digest
        """
        self.holders = f"""
            SELECT * FROM {t}
            WHERE id = ANY($1::uuid[]) OR idempotency_key = ANY($2::text[])
               OR (unique_key = ANY($3::text[]) AND status IN ('handed_off', 'queued'))
        """


class HotPool:
    """A small asyncpg pool of its own, opened on first use and closed with the adapter.

    ``connect_kwargs`` are what SQLAlchemy's dialect would pass to ``asyncpg.connect``
    for the same URL, so both pools reach the same database the same way.

    Its sessions plan each statement once (``plan_cache_mode = force_generic_plan``):
    PostgreSQL otherwise kept re-planning the settle statement as a custom plan, 0.3 ms
    of planning on a 0.1 ms execution. The generic plans are the ones wanted: status
    tests are literals, ids come in arrays, and ``run_at_us <= $n`` reads the dispatch
    index in order either way. And without JIT compilation (``jit = off``): a generic plan
    knows neither the limit nor how many priority levels the eligible read walks, and
    its estimate passed ``jit_above_cost``, so every read compiled itself for 1.3 s to run
    for a millisecond. No statement here runs long enough for JIT to pay.

    It is a pool of its own rather than asyncpg's, which cost every claim, settle and
    enqueue a reset query (``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *;
    RESET ALL``: one more round trip) and a task to shield its release (one more turn of
    the event loop). These statements leave no session state behind (no locks, cursors,
    listeners or settings), so a connection goes back as it is, unless its use ended in
    an error other than the server refusing a statement: then it is closed, whatever
    state it was left in (a statement cancelled half-way, a lost connection), and the
    next use opens a fresh one.
    """

    def __init__(self, size: int, connect_kwargs: dict[str, Any]) -> None:
        settings = {**connect_kwargs.get("server_settings", {})}
        settings["plan_cache_mode"] = "force_generic_plan"
        settings["jit"] = "off"
        self._connect_kwargs = {**connect_kwargs, "server_settings": settings}
        self._slots = asyncio.Semaphore(size)
        self._idle: list[Any] = []
        self._closed = False

    def acquire(self) -> _PoolUse:
        """A connection for an ``async with`` block, given back at its end."""
        return _PoolUse(self)

    def _give_back(self, conn: Any) -> None:
        if self._closed or conn.is_closed() or conn.is_in_transaction():
            conn.terminate()
        else:
            self._idle.append(conn)

    async def _take(self) -> Any:
        while self._idle:
            conn = self._idle.pop()
            if not conn.is_closed():
                return conn
        return await asyncpg.connect(**self._connect_kwargs)

    async def close(self) -> None:
        """Close the idle connections; one in use is closed when its use ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()


class _PoolUse:
    """One use of a :class:`HotPool` connection: a class rather than an
    ``asynccontextmanager``, whose generator cost each claim, settle and enqueue about
    3 us of the main's CPU to enter and leave. A use that ends in the server refusing a
    statement gives the connection back (the session is fine); one that ends in any other
    error closes it."""

    __slots__ = ("_conn", "_pool")

    def __init__(self, pool: HotPool) -> None:
        self._pool = pool

    async def __aenter__(self) -> Any:
        slots = self._pool._slots
        await slots.acquire()
        try:
            self._conn = await self._pool._take()
        except BaseException:
            slots.release()
            raise
        return self._conn

    async def __aexit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        try:
            if exc is None or isinstance(exc, asyncpg.PostgresError):
                self._pool._give_back(self._conn)
            else:
                self._conn.terminate()
        finally:
            self._pool._slots.release()
