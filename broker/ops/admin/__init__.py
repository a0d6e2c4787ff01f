"""The operator's commands behind ``broker``: status, jobs, job, retry, cancel, enqueue, prune.

Every command runs against a *request service*. When the main answers, that is the main
itself, through a :class:`~broker.client.client.Client`, so a cancel reaches the worker
running the job and ``status`` can show the workers. When the main cannot be
reached and a store URL was given, it is the store, opened through the
composition root: the same operations, applied directly. That is safe because
every move out of ``handed_off`` is fenced in the store, so a cancel or a retry
made while the main is down can never be undone by a late report. Without the
main, ``status`` shows job counts only.

The store is opened as it stands, never set up: a URL may name the wrong database,
and a newer ``broker`` must not migrate a schema under an older main. A reading
command opens it read-only; every command first checks that it holds this version's
schema (``check_schema``) and refuses a missing, older or newer one. Only
``broker-main`` and ``broker migrate`` create or migrate a schema.

``--json`` output shapes are part of the interface and are documented in
``docs/reference/cli.md``; the human output is a readable table and may change.

The package: :mod:`~broker.ops.admin.service` says where a command is sent,
:mod:`~broker.ops.admin.commands` holds the commands, :mod:`~broker.ops.admin.format`
their human output and :mod:`~broker.ops.admin.top` the live ``broker top``.
"""

from __future__ import annotations

from broker.ops.admin.commands import (
    enqueue_request,
    migrate,
    only_reads,
    resolve_job,
    run_command,
)
from broker.ops.admin.service import RequestService, StoreService, open_backend
from broker.ops.admin.top import format_top, queue_rates

__all__ = [
    "RequestService",
    "StoreService",
    "enqueue_request",
    "format_top",
    "migrate",
    "only_reads",
    "open_backend",
    "queue_rates",
    "resolve_job",
    "run_command",
]
