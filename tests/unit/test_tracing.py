"""OpenTelemetry in the JSON log (:mod:`broker.model.tracing`): a line logged inside a
span carries its trace and span ids, one logged outside carries none, and without
OpenTelemetry installed nothing of it is imported and no line carries them. The SDK's
in-memory exporter holds the spans the test made."""

from __future__ import annotations

import contextvars
import importlib
import io
import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from broker.exceptions import InvalidJobError
from broker.jobs import Job, JobSpec
from broker.model import logs, tracing
from broker.model.bounds import MAX_TRACE_CONTEXT_BYTES, MAX_TRACE_CONTEXT_ENTRIES
from broker.wire.requests import JobRequest
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
        assert not absent.ENABLED
        assert absent.current_ids() is None
        assert absent.start_run("app.send", "job-1", "default", 1, None) is None
    finally:
        monkeypatch.undo()
        importlib.reload(tracing)
    assert tracing.ENABLED


# ------------------------------------------------------------------ the job's trace context


def sdk_spans() -> InMemorySpanExporter:
    """A fresh in-memory exporter on the process's SDK provider, set on first use:
    OpenTelemetry takes one global provider per process, and the broker's spans go to the
    global one, as any instrumented library's. Shut it down after, so it takes no more."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return spans


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = sdk_spans()
    yield exporter
    exporter.shutdown()


def _ids(span: ReadableSpan) -> tuple[int, int]:
    assert span.context is not None
    return span.context.trace_id, span.context.span_id


def test_outside_a_span_a_job_carries_no_context_and_an_enqueue_makes_no_span(
    spans: InMemorySpanExporter,
) -> None:
    assert tracing.inject() is None
    with tracing.enqueue_span("app.send"):
        assert tracing.inject() is None
    assert spans.get_finished_spans() == ()


def test_a_job_enqueued_in_a_span_runs_in_a_child_of_its_enqueue_span(
    spans: InMemorySpanExporter,
) -> None:
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("web request"), tracing.enqueue_span("app.send"):
        carried = tracing.inject()
    assert carried is not None and set(carried) <= {"traceparent", "tracestate"}
    run = tracing.start_run("app.send", "job-1", "mail", 2, carried)
    tracing.end_run(run, None)

    by_name = {s.name: s for s in spans.get_finished_spans()}
    request, enqueue, ran = (
        by_name["web request"],
        by_name["broker.enqueue app.send"],
        by_name["broker.run app.send"],
    )
    assert enqueue.kind is trace.SpanKind.PRODUCER and ran.kind is trace.SpanKind.CONSUMER
    assert enqueue.parent is not None and enqueue.parent.span_id == _ids(request)[1]
    trace_id, enqueue_id = _ids(enqueue)
    assert carried["traceparent"].startswith(f"00-{trace_id:032x}-{enqueue_id:016x}-")
    assert ran.parent is not None and ran.parent.is_remote
    assert (ran.parent.trace_id, ran.parent.span_id) == (trace_id, enqueue_id)
    assert dict(ran.attributes or {}) == {
        "broker.job.id": "job-1",
        "broker.task": "app.send",
        "broker.queue": "mail",
        "broker.attempt": 2,
    }
    assert ran.status.status_code is trace.StatusCode.UNSET


def test_a_failed_run_has_an_error_status_and_a_run_without_context_is_a_root(
    spans: InMemorySpanExporter,
) -> None:
    run = tracing.start_run("app.send", "job-1", "default", 1, None)
    tracing.end_run(run, "ValueError: declined")
    [ran] = spans.get_finished_spans()
    assert ran.parent is None
    assert ran.status.status_code is trace.StatusCode.ERROR
    assert ran.status.description == "ValueError: declined"


def test_an_enqueue_that_raises_marks_its_span_failed(spans: InMemorySpanExporter) -> None:
    with (
        trace.get_tracer("test").start_as_current_span("web request"),
        pytest.raises(ConnectionError),
        tracing.enqueue_span("app.send"),
    ):
        raise ConnectionError("main unreachable")
    enqueue = next(s for s in spans.get_finished_spans() if s.name.startswith("broker."))
    assert enqueue.status.status_code is trace.StatusCode.ERROR


def test_the_run_span_is_the_active_one_in_the_jobs_context(spans: InMemorySpanExporter) -> None:
    run = tracing.start_run("app.send", "job-1", "default", 1, None)
    context = contextvars.copy_context()
    context.run(tracing.activate, run)
    assert context.run(tracing.current_ids) == tuple(
        format(i, w) for i, w in zip(_ids(run), ("032x", "016x"), strict=True)
    )
    assert tracing.current_ids() is None, "only the job's own context"
    tracing.end_run(run, None)


@pytest.mark.parametrize(
    "carried",
    [
        {"traceparent": 5},
        {f"k{i}": "v" for i in range(MAX_TRACE_CONTEXT_ENTRIES + 1)},
        {"tracestate": "x" * MAX_TRACE_CONTEXT_BYTES},
        {"traceparent": "a\nb"},
        ["traceparent"],
    ],
)
def test_a_trace_context_out_of_its_bound_is_refused(carried: object) -> None:
    with pytest.raises(InvalidJobError, match="trace_context"):
        JobSpec(task="app.send", trace_context=carried)  # type: ignore[arg-type]


def test_an_empty_trace_context_is_none_and_the_wire_keeps_one() -> None:
    assert JobSpec(task="app.send", trace_context={}).trace_context is None
    carried = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    spec = JobSpec(task="app.send", trace_context=carried)
    request = JobRequest.from_spec(spec)
    assert request.trace_context == carried
    assert request.to_spec(datetime.now(UTC)).trace_context == carried
    assert Job.from_spec(spec, datetime.now(UTC)).trace_context == carried


def test_a_process_with_no_provider_set_starts_no_run_span(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose app set up no SDK: a job's run costs no span (every one would be
    dropped), even when the job carries a context."""
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    carried = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    assert tracing.start_run("app.send", "job-1", "default", 1, carried) is None


def test_a_dispatch_is_a_child_of_the_enqueue_and_the_parent_of_the_run(
    spans: InMemorySpanExporter,
) -> None:
    """The main's span for handing a job to a worker sits between its enqueue and its
    run: the job message carries the dispatch span's context on."""
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("web request"), tracing.enqueue_span("app.send"):
        carried = tracing.inject()
    assert carried is not None
    onward = tracing.dispatch("app.send", "job-1", "mail", 1, "worker-a", carried)
    run = tracing.start_run("app.send", "job-1", "mail", 1, dict(onward))
    tracing.end_run(run, None)

    by_name = {s.name: s for s in spans.get_finished_spans()}
    enqueue, dispatch, ran = (
        by_name["broker.enqueue app.send"],
        by_name["broker.dispatch app.send"],
        by_name["broker.run app.send"],
    )
    trace_id, enqueue_id = _ids(enqueue)
    assert dispatch.kind is trace.SpanKind.PRODUCER
    assert dispatch.parent is not None
    assert (dispatch.parent.trace_id, dispatch.parent.span_id) == (trace_id, enqueue_id)
    assert ran.parent is not None
    assert (ran.parent.trace_id, ran.parent.span_id) == _ids(dispatch)
    assert dict(dispatch.attributes or {}) == {
        "broker.job.id": "job-1",
        "broker.task": "app.send",
        "broker.queue": "mail",
        "broker.attempt": 1,
        "broker.worker.id": "worker-a",
    }


def test_a_main_with_no_provider_set_passes_the_enqueue_context_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No SDK in the main: no dispatch span, and the run stays the enqueue's child."""
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    carried = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    assert tracing.dispatch("app.send", "job-1", "default", 1, None, carried) is carried
