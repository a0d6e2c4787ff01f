"""Enqueue from Django, inside the request's transaction where the store allows it.

Set ``BROKER`` in the Django settings::

    BROKER = {
        "STORE_DATABASE": "default",  # the alias whose PostgreSQL database is the store
        "SCHEMA": None,               # the PostgreSQL schema of the broker's tables
        "MAX_PAYLOAD_BYTES": 16 << 20, # the main's --max-payload-bytes
        "MAIN": "127.0.0.1:7390",     # without STORE_DATABASE: the main to enqueue through
        "TOKEN": None,                # that main's token (its client secret)
        "TLS": False,                 # True: TLS, trusting the system's CAs
        "TLS_CA": None,               # TLS, trusting this CA alone (the main's --tls-ca)
        "TLS_CLIENT_CERT": None,      # mutual TLS: this process's certificate
        "TLS_CLIENT_KEY": None,       #   and its key
    }

With ``STORE_DATABASE``, :func:`enqueue` inserts the job through Django's own
connection to that database, so it commits or rolls back with the view's rows (inside
``transaction.atomic``, or at once under autocommit). Without it (the store is another
database, or SQLite beside the app), the job is sent to the main through a
:class:`~broker.SyncClient` by ``transaction.on_commit``: a rolled-back transaction
then sends nothing, but a crash between the commit and the send loses the job, which
the in-transaction path cannot. With any ``TLS`` setting that client speaks TLS to the
main, verifying its certificate and host name, as ``broker --tls-ca`` does.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Unpack

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from sqlalchemy.dialects.postgresql import psycopg

from broker.client.sync import SyncClient
from broker.client.transactional import EnqueueOptions, enqueue_on_statements, job_spec
from broker.exceptions import ConfigurationError
from broker.jobs import EnqueueResult, JobSpec, JSONValue
from broker.payload import DEFAULT_MAX_PAYLOAD_BYTES
from broker.tasks.registry import Task
from broker.wire.messages import DEFAULT_PORT
from broker.wire.tls import PeerTLS

_DIALECT = psycopg.dialect()  # type: ignore[no-untyped-call]
"""Statements are compiled for PostgreSQL with named ``%(name)s`` parameters, which
Django's PostgreSQL cursor passes through to psycopg (3 or 2) unchanged."""


def enqueue(
    task: str | Task[..., Any],
    args: Sequence[JSONValue] = (),
    kwargs: Mapping[str, JSONValue] | None = None,
    **options: Unpack[EnqueueOptions],
) -> EnqueueResult | None:
    """Enqueue a job with the current transaction of Django's database.

    Returns the stored job when it was inserted in the transaction (``STORE_DATABASE``),
    or ``None`` when it will be sent to the main once the transaction commits.
    """
    spec = job_spec(task, args, kwargs, **options)
    alias = _setting("STORE_DATABASE")
    if alias is not None:
        return enqueue_specs([spec], using=str(alias))[0]
    transaction.on_commit(functools.partial(_send, spec), using=DEFAULT_DB_ALIAS)
    return None


def enqueue_specs(specs: Sequence[JobSpec], *, using: str) -> list[EnqueueResult]:
    """Insert jobs through Django's connection ``using``, in its current transaction."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        raise ConfigurationError(
            f"BROKER['STORE_DATABASE'] is {using!r}, a {connection.vendor} database: the "
            "jobs can go in Django's transaction only when the broker's store is that "
            "PostgreSQL database; leave STORE_DATABASE unset to enqueue on commit instead"
        )
    limit = _setting("MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES)
    schema = _setting("SCHEMA")
    with connection.cursor() as cursor:
        return enqueue_on_statements(
            _CursorStatements(cursor),
            "postgresql",
            specs,
            schema=None if schema is None else str(schema),
            max_payload_bytes=None if limit is None else int(limit),
        )


class _CursorStatements:
    """A Django cursor that executes SQLAlchemy Core statements, as the store's code
    writes them, compiled for PostgreSQL."""

    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor

    def execute(
        self, statement: Any, parameters: Any = None, *, execution_options: Any = None
    ) -> _Rows:
        rows = parameters if isinstance(parameters, list) else [parameters or {}]
        translate = (execution_options or {}).get("schema_translate_map")
        columns: list[str] = []
        fetched: list[tuple[Any, ...]] = []
        for values in rows:
            compiled = statement.compile(
                dialect=_DIALECT,
                column_keys=list(values),
                schema_translate_map=translate,
                compile_kwargs={"render_postcompile": True},
            )
            self._cursor.execute(compiled.string, compiled.construct_params(values))
            if self._cursor.description is not None:
                columns = [column[0] for column in self._cursor.description]
                fetched.extend(self._cursor.fetchall())
        return _Rows(columns, fetched)


class _Rows:
    """The two views of a result the store's enqueue code reads."""

    def __init__(self, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
        self._columns = columns
        self._rows = rows

    def scalars(self) -> list[Any]:
        return [row[0] for row in self._rows]

    def mappings(self) -> list[dict[str, Any]]:
        return [dict(zip(self._columns, row, strict=True)) for row in self._rows]


def _setting(name: str, default: Any = None) -> Any:
    config = getattr(settings, "BROKER", {})
    if not isinstance(config, Mapping):
        raise ConfigurationError("settings.BROKER must be a dict")
    return config.get(name, default)


_client: SyncClient | None = None
_client_lock = threading.Lock()


def _send(spec: JobSpec) -> None:
    """Send a committed transaction's job to the main (run by ``on_commit``)."""
    global _client
    with _client_lock:
        if _client is None:
            host, _, port = str(_setting("MAIN", f"127.0.0.1:{DEFAULT_PORT}")).rpartition(":")
            _client = SyncClient(
                host or "127.0.0.1", int(port), token=_setting("TOKEN"), tls=_tls()
            )
        client = _client
    client.enqueue_many([spec])


def _tls() -> PeerTLS | None:
    """The on-commit client's TLS settings; ``None`` (plain TCP) when none is given."""
    ca, cert, key = (_setting(name) for name in ("TLS_CA", "TLS_CLIENT_CERT", "TLS_CLIENT_KEY"))
    if not (_setting("TLS", False) or ca or cert or key):
        return None
    return PeerTLS(
        ca=None if ca is None else str(ca),
        client_cert=None if cert is None else str(cert),
        client_key=None if key is None else str(key),
    )


def close_client() -> None:
    """Close the connection to the main that on-commit enqueues opened, if any (at
    shutdown, or after changing ``BROKER``); the next such enqueue opens a new one."""
    global _client
    with _client_lock:
        client, _client = _client, None
    if client is not None:
        client.close()


__all__ = ["close_client", "enqueue", "enqueue_specs"]
