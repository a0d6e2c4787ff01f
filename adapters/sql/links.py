"""Job dependencies in the SQL store: :class:`broker.dependencies.DependencyStore` over each
dialect's own connection, inside the transaction of the move that ended a parent.

The rule is :func:`broker.dependencies.propagate`; this module only reads and writes its
rows (``broker_job_links``: a child's count and options; ``broker_job_edges``: one row per
parent, ``done`` once counted). SQLite runs it on the hot connection's thread (none of
its awaits suspends, see :func:`~adapters.sql.enqueue.complete_now`), PostgreSQL on an
asyncpg connection in a transaction, where the count is taken down by an ``UPDATE`` of
the child's links row, so two parents ending at once serialise on that row lock.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from adapters.sql.rows import Payload, loads, offload
from adapters.sql.schema import OFFLOADED, notify_channel
from broker import dependencies
from broker.dependencies import Waiting
from broker.jobs import (
    TERMINAL_STATUSES,
    JobSpec,
    JobStatus,
    JSONValue,
    ParentFailure,
    ParentResults,
    compact_json,
)
from broker.storage import check_payload

_TERMINAL = ", ".join(f"'{s.value}'" for s in sorted(TERMINAL_STATUSES))


def linked(specs: Sequence[JobSpec]) -> bool:
    """Whether an enqueue of ``specs`` has links to write (parents or a workflow)."""
    return any(s.depends_on or s.workflow_id is not None for s in specs)


def _value(
    job_id: uuid.UUID, kind: str, text: str | None, body: tuple[str, str | None] | None
) -> Any:
    """A payload column's value: decoded from the row, or from its offloaded body."""
    if text is None:
        return None
    if text == OFFLOADED and body is not None:
        return check_payload(job_id, kind, *body, loads)
    return loads(text)


def _link_rows(specs: Sequence[JobSpec]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    links = [
        (s.id, len(s.depends_on), s.on_parent_failure.value, s.parent_results.value, s.workflow_id)
        for s in specs
    ]
    edges = [(s.id, i, p) for s in specs for i, p in enumerate(s.depends_on)]
    return links, edges


class LiteLinks:
    """The links on SQLite's hot connection (ids as 32 hex digits, as the store keeps them)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        now_us: int,
        threshold: int | None,
        put: Callable[[sqlite3.Connection, Sequence[Payload]], None],
    ) -> None:
        self._conn = conn
        self._put = put
        self._now_us = now_us
        self._threshold = threshold

    def _body(self, job_id: uuid.UUID, kind: str) -> tuple[str, str | None] | None:
        row = self._conn.execute(
            "SELECT body, digest FROM broker_payloads WHERE job_id = ? AND kind = ?",
            (job_id.hex, kind),
        ).fetchone()
        return None if row is None else (row[0], row[1])

    async def link(self, specs: Sequence[JobSpec]) -> None:
        """Write the links and edges of the jobs just inserted, then count the parents that
        have ended already (in the enqueue's transaction)."""
        links, edges = _link_rows(specs)
        conn = self._conn
        conn.executemany(
            "INSERT INTO broker_job_links (job_id, pending, on_parent_failure, parent_results, "
            "workflow_id) VALUES (?, ?, ?, ?, ?)",
            [(c.hex, n, f, r, w.hex if w else None) for c, n, f, r, w in links],
        )
        conn.executemany(
            "INSERT INTO broker_job_edges (child_id, position, parent_id, done) "
            "VALUES (?, ?, ?, 0)",
            [(c.hex, i, p.hex) for c, i, p in edges],
        )
        parents = sorted({p for _, _, p in edges})
        status_of: dict[uuid.UUID, JobStatus] = {}
        for chunk in range(0, len(parents), 500):
            ids = json.dumps([p.hex for p in parents[chunk : chunk + 500]])
            for job_id, status in conn.execute(
                "UPDATE broker_jobs SET has_dependents = 1 "
                "WHERE id IN (SELECT value FROM json_each(?)) RETURNING id, status",
                (ids,),
            ):
                status_of[uuid.UUID(hex=job_id)] = JobStatus(status)
        await dependencies.count_ended_at_enqueue(self, specs, status_of)

    async def open_edges(
        self, parent_ids: Sequence[uuid.UUID]
    ) -> list[tuple[uuid.UUID, uuid.UUID]]:
        rows = self._conn.execute(
            "UPDATE broker_job_edges SET done = 1 "
            "WHERE done = 0 AND parent_id IN (SELECT value FROM json_each(?)) "
            "RETURNING child_id, parent_id",
            (json.dumps([p.hex for p in parent_ids]),),
        ).fetchall()
        return [(uuid.UUID(hex=c), uuid.UUID(hex=p)) for c, p in rows]

    async def count_down(self, child_id: uuid.UUID, parents: int) -> Waiting | None:
        conn = self._conn
        row = conn.execute(
            "UPDATE broker_job_links SET pending = pending - ? WHERE job_id = ? "
            "RETURNING pending, on_parent_failure, parent_results",
            (parents, child_id.hex),
        ).fetchone()
        job = conn.execute(
            "SELECT status, args FROM broker_jobs WHERE id = ?", (child_id.hex,)
        ).fetchone()
        if row is None or job is None:
            return None
        args = _value(child_id, "args", job[1], self._body(child_id, "args"))
        return Waiting(
            JobStatus(job[0]), row[0], ParentFailure(row[1]), ParentResults(row[2]), tuple(args)
        )

    async def parent_results(self, child_id: uuid.UUID) -> list[JSONValue]:
        rows = self._conn.execute(
            "SELECT e.parent_id, j.status, j.result FROM broker_job_edges e "
            "LEFT JOIN broker_jobs j ON j.id = e.parent_id "
            "WHERE e.child_id = ? ORDER BY e.position",
            (child_id.hex,),
        ).fetchall()
        results = []
        for parent_hex, status, text in rows:
            parent = uuid.UUID(hex=parent_hex)
            done = status == JobStatus.COMPLETED.value
            body = self._body(parent, "result") if done and text == OFFLOADED else None
            results.append(_value(parent, "result", text, body) if done else None)
        return results

    async def release(self, child_id: uuid.UUID, args: tuple[JSONValue, ...]) -> None:
        values, moved = offload(child_id, {"args": compact_json(list(args))}, self._threshold)
        conn = self._conn
        conn.execute(
            "UPDATE broker_jobs SET status = 'queued', args = ?, updated_us = ? "
            "WHERE id = ? AND status = 'waiting'",
            (values["args"], self._now_us, child_id.hex),
        )
        conn.execute(
            "DELETE FROM broker_payloads WHERE job_id = ? AND kind = 'args'", (child_id.hex,)
        )
        self._put(conn, moved)

    async def cancel_waiting(self, child_id: uuid.UUID, reason: str) -> None:
        self._conn.execute(
            "UPDATE broker_jobs SET status = 'cancelled', last_error = ?, updated_us = ? "
            "WHERE id = ? AND status = 'waiting'",
            (reason, self._now_us, child_id.hex),
        )

    async def stranded(self) -> list[tuple[uuid.UUID, JobStatus]]:
        """Parents that ended with an edge left to count (a cancel whose walk was cut off
        by a crash): walked again at start-up."""
        rows = self._conn.execute(
            "SELECT DISTINCT j.id, j.status FROM broker_job_edges e "
            "JOIN broker_jobs j ON j.id = e.parent_id "
            f"WHERE e.done = 0 AND j.status IN ({_TERMINAL})"
        ).fetchall()
        return [(uuid.UUID(hex=i), JobStatus(s)) for i, s in rows]


class PgLinks:
    """The links on an asyncpg connection, inside a transaction the caller opened;
    ``tables``: the schema-qualified names of jobs, payloads, links and edges."""

    def __init__(
        self,
        conn: Any,
        tables: tuple[str, str, str, str],
        now_us: int,
        threshold: int | None,
        put: Callable[[Any, Sequence[Payload]], Awaitable[None]],
        schema: str | None,
    ) -> None:
        self._conn = conn
        self._schema = schema
        self._put = put
        self._jobs, self._payloads, self._links, self._edges = tables
        self._now_us = now_us
        self._threshold = threshold

    async def _body(self, job_id: uuid.UUID, kind: str) -> tuple[str, str | None] | None:
        row = await self._conn.fetchrow(
            f"SELECT body, digest FROM {self._payloads} WHERE job_id = $1 AND kind = $2",
            job_id,
            kind,
        )
        return None if row is None else (row["body"], row["digest"])

    async def link(self, specs: Sequence[JobSpec]) -> None:
        """As :meth:`LiteLinks.link`. The parents' rows are locked (in id order) and marked
        ``has_dependents`` first, so a settle of one waits for this enqueue and then
        settles it with its dependents, or has settled it before and this sees it ended."""
        links, edges = _link_rows(specs)
        conn = self._conn
        await conn.executemany(
            f"INSERT INTO {self._links} (job_id, pending, on_parent_failure, parent_results, "
            "workflow_id) VALUES ($1, $2, $3, $4, $5)",
            links,
        )
        await conn.executemany(
            f"INSERT INTO {self._edges} (child_id, position, parent_id, done) "
            "VALUES ($1, $2, $3, false)",
            edges,
        )
        parents = sorted({p for _, _, p in edges})
        rows = await conn.fetch(
            f"""
            WITH l AS (
                SELECT id FROM {self._jobs} WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE
            )
            UPDATE {self._jobs} j SET has_dependents = true FROM l WHERE j.id = l.id
            RETURNING j.id, j.status
            """,
            parents,
        )
        status_of = {r["id"]: JobStatus(r["status"]) for r in rows}
        await dependencies.count_ended_at_enqueue(self, specs, status_of)

    async def open_edges(
        self, parent_ids: Sequence[uuid.UUID]
    ) -> list[tuple[uuid.UUID, uuid.UUID]]:
        rows = await self._conn.fetch(
            f"UPDATE {self._edges} SET done = true "
            "WHERE NOT done AND parent_id = ANY($1::uuid[]) RETURNING child_id, parent_id",
            list(parent_ids),
        )
        return [(r["child_id"], r["parent_id"]) for r in rows]

    async def count_down(self, child_id: uuid.UUID, parents: int) -> Waiting | None:
        conn = self._conn
        row = await conn.fetchrow(
            f"UPDATE {self._links} SET pending = pending - $2 WHERE job_id = $1 "
            "RETURNING pending, on_parent_failure, parent_results",
            child_id,
            parents,
        )
        job = await conn.fetchrow(
            f"SELECT status, args FROM {self._jobs} WHERE id = $1 FOR UPDATE", child_id
        )
        if row is None or job is None:
            return None
        body = await self._body(child_id, "args") if job["args"] == OFFLOADED else None
        args = _value(child_id, "args", job["args"], body)
        return Waiting(
            JobStatus(job["status"]),
            row["pending"],
            ParentFailure(row["on_parent_failure"]),
            ParentResults(row["parent_results"]),
            tuple(args),
        )

    async def parent_results(self, child_id: uuid.UUID) -> list[JSONValue]:
        rows = await self._conn.fetch(
            f"SELECT e.parent_id, j.status, j.result FROM {self._edges} e "
            f"LEFT JOIN {self._jobs} j ON j.id = e.parent_id "
            "WHERE e.child_id = $1 ORDER BY e.position",
            child_id,
        )
        results = []
        for r in rows:
            done = r["status"] == JobStatus.COMPLETED.value
            text = r["result"]
            body = (
                await self._body(r["parent_id"], "result") if done and text == OFFLOADED else None
            )
            results.append(_value(r["parent_id"], "result", text, body) if done else None)
        return results

    async def release(self, child_id: uuid.UUID, args: tuple[JSONValue, ...]) -> None:
        values, moved = offload(child_id, {"args": compact_json(list(args))}, self._threshold)
        conn = self._conn
        await conn.execute(
            f"UPDATE {self._jobs} SET status = 'queued', args = $2, updated_us = $3 "
            "WHERE id = $1 AND status = 'waiting'",
            child_id,
            values["args"],
            self._now_us,
        )
        await conn.execute(
            f"DELETE FROM {self._payloads} WHERE job_id = $1 AND kind = 'args'", child_id
        )
        await self._put(conn, moved)
        # A job made due announces itself as an insert does (delivered at the commit):
        # a main whose modes were drained reads again only when told something changed.
        schema = self._schema or await conn.fetchval("SELECT current_schema()")
        await conn.execute("SELECT pg_notify($1, '')", notify_channel(schema))

    async def cancel_waiting(self, child_id: uuid.UUID, reason: str) -> None:
        await self._conn.execute(
            f"UPDATE {self._jobs} SET status = 'cancelled', last_error = $2, updated_us = $3 "
            "WHERE id = $1 AND status = 'waiting'",
            child_id,
            reason,
            self._now_us,
        )

    async def stranded(self) -> list[tuple[uuid.UUID, JobStatus]]:
        """As :meth:`LiteLinks.stranded`."""
        rows = await self._conn.fetch(
            f"SELECT DISTINCT j.id, j.status FROM {self._edges} e "
            f"JOIN {self._jobs} j ON j.id = e.parent_id "
            f"WHERE NOT e.done AND j.status IN ({_TERMINAL})"
        )
        return [(r["id"], JobStatus(r["status"])) for r in rows]
