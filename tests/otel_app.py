"""Tasks for ``tests/e2e/test_tracing.py``, and the OpenTelemetry SDK set up in every
process that runs them, as ``docs/howto/tracing.md`` tells an application to.

Imported only by real worker and child processes (``--app tests.otel_app``): its start-up
hook sets the process-wide tracer provider (:mod:`tests.otel_export`). Each process
writes every span it ends as one JSON line to the file named by :data:`SPANS_ENV`, so
the test reads which process made which span, under which parent.
"""

from __future__ import annotations

import os

from opentelemetry import trace

from broker import on_startup
from broker.tasks.registry import task
from tests.app_env import SPANS_ENV
from tests.otel_export import export_spans_to


@on_startup
def configure_tracing() -> None:
    export_spans_to(os.environ[SPANS_ENV])


def _active() -> dict[str, object]:
    """The span active in the task: its run's, if the runner made it the current one."""
    context = trace.get_current_span().get_span_context()
    return {"span_id": f"{context.span_id:016x}", "pid": os.getpid()}


@task(mode="inline")
async def traced_inline() -> dict[str, object]:
    return _active()


@task(mode="pooled")
def traced_pooled() -> dict[str, object]:
    return _active()


@task(mode="forked")
async def traced_forked() -> dict[str, object]:
    return _active()


@task(mode="pooled", retries=0)
def traced_failure() -> None:
    raise ValueError("the card was declined")
