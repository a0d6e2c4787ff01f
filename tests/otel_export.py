"""The OpenTelemetry SDK of the e2e tracing test's processes: every span a process ends,
one JSON line in a file shared by all of them (``tests/e2e/test_tracing.py`` reads which
process made which span, under which parent). Set up by the worker's app
(``tests.otel_app``) and by the main's start-up (``tests/otel_site``)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


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


def export_spans_to(path: str) -> None:
    """Set this process's tracer provider: every span ended goes to ``path`` at once."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    trace.set_tracer_provider(provider)
