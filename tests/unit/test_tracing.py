"""OpenTelemetry in the JSON log (:mod:`broker.model.tracing`): a line logged inside a
span carries its trace and span ids, one logged outside carries none, and without
OpenTelemetry installed nothing of it is imported and no line carries them. The SDK's
in-memory exporter holds the spans the test made."""

from __future__ import annotations

import importlib
import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from broker.model import logs, tracing
from tests.unit.test_logs import stream

__all__ = ["stream"]  # the fixture, shared with the log tests


@pytest.fixture
def exporter() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    yield provider, spans
    provider.shutdown()


def _lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_line_logged_in_a_span_carries_its_ids(
    stream: io.StringIO, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, spans = exporter
    logs.configure("INFO", "json", stream=stream)
    logger = logging.getLogger("broker.test")
    with provider.get_tracer("test").start_as_current_span("web request"):
        logs.log_event(logger, logging.INFO, "job enqueued", job_id="j-1")
    logs.log_event(logger, logging.INFO, "after the request")

    [span] = spans.get_finished_spans()
    inside, outside = _lines(stream)
    assert span.context is not None
    assert inside["trace_id"] == f"{span.context.trace_id:032x}"
    assert inside["span_id"] == f"{span.context.span_id:016x}"
    assert "trace_id" not in outside and "span_id" not in outside


def test_no_field_can_pass_for_the_trace_ids(stream: io.StringIO) -> None:
    logs.configure("INFO", "json", stream=stream)
    logs.log_event(logging.getLogger("broker.test"), logging.INFO, "x", trace_id="forged")
    [line] = _lines(stream)
    assert "trace_id" not in line


def test_without_opentelemetry_nothing_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extra not installed: the module imports no part of it and says no ids."""
    for name in [m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # an import of it fails
    try:
        absent = importlib.reload(tracing)
        assert absent.trace is None
        assert absent.current_ids() is None
    finally:
        monkeypatch.undo()
        importlib.reload(tracing)
    assert tracing.trace is not None
