"""Tasks for ``tests/e2e/test_tracing.py``, and the OpenTelemetry SDK set up in every
process that runs them, as ``docs/howto/tracing.md`` tells an application to.

Imported only by real worker and child processes (``--app tests.otel_app``): its start-up
hook sets the process-wide tracer provider. Each process writes every span it ends as
one JSON line to the file named by :data:`SPANS_ENV`, so the test reads which process
made which span, under which parent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from broker import on_startup
from broker.tasks.registry import task
from tests.app_env import SPANS_ENV


class JsonLinesExporter(SpanExporter):
    """One line per span, each written with one ``write`` to a file opened for appending,
    so the lines of several processes never interleave."""

    def __init__(self, path: str) -> None:
        self._path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for span in spans:
                os.write(fd, (json.dumps(_as_dict(span)) + "\n").encode())
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS


def _as_dict(span: ReadableSpan) -> dict[str, object]:
    assert span.context is not None
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{span.context.trace_id:032x}",
        "span_id": f"{span.context.span_id:016x}",
        "parent_id": None if span.parent is None else f"{span.parent.span_id:016x}",
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "description": span.status.description,
        "pid": os.getpid(),
    }


@on_startup
def configure_tracing() -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(os.environ[SPANS_ENV])))
    trace.set_tracer_provider(provider)


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
