"""OpenTelemetry, when it is installed (``pip install broker-jobs[otel]``): the ids of the
span active where a line is logged, for the JSON log (:mod:`broker.model.logs`); the W3C
trace context a job carries from the span that enqueued it; the spans of an enqueue, of
its dispatch at the main and of a run.

The one module of the broker that imports OpenTelemetry, and only once the process uses
it: until an application imports it (to set its SDK's provider or to start a span), or
names a provider in ``OTEL_PYTHON_TRACER_PROVIDER`` (which the API loads on first use),
no span is active and no provider set, so nothing of it is imported, and a log line, an
enqueue, a dispatch and a run each cost one check. (Its import at start-up cost every
process, a main, a worker, a runner's child or a ``broker`` command, about 6 ms of CPU,
traced or not.) Only the API is used (an application installs and configures the SDK
and its exporter, as for any instrumented library); with no SDK configured no span is
ever valid, lines carry no ids and jobs no context. See ``docs/howto/tracing.md``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ENABLED = find_spec("opentelemetry") is not None
"""OpenTelemetry is installed: a runner starts a span per run, the main one per dispatch of
a job that carries a trace context, once the application set a provider (one flag read
otherwise)."""

_PROVIDER_VARIABLE = "OTEL_PYTHON_TRACER_PROVIDER"
"""The API's variable naming a provider it loads from the environment on first use."""


class _Api:
    """The parts of OpenTelemetry's API the broker uses, imported once (:func:`_api`)."""

    def __init__(self) -> None:
        # Lazy: OpenTelemetry's import (about 6 ms of a process's start-up) waits until
        # the process uses it.
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.context = context
        self.trace = trace
        self.tracer: Tracer = trace.get_tracer("broker")
        """Taken once: before an application sets its provider this is the API's proxy,
        which follows the provider once it is set."""
        self.propagator: TraceContextTextMapPropagator = TraceContextTextMapPropagator()
        """W3C trace context only (``traceparent``, ``tracestate``), whatever propagators
        the application configured: what a job carries is bounded and the same in every
        process."""


_API: _Api | None = None


def _api(provider_from_environment: bool = False) -> _Api | None:
    """The API once this process uses it: it imported ``opentelemetry.trace`` (nothing
    else starts a span or sets a provider), or, for a caller that asks for the provider
    (``provider_from_environment``), the environment names one. ``None`` before: no span
    is active and no provider is set."""
    global _API
    if _API is None:
        if not ENABLED:
            return None
        if "opentelemetry.trace" not in sys.modules and not (
            provider_from_environment and _PROVIDER_VARIABLE in os.environ
        ):
            return None
        _API = _Api()
    return _API


def _no_provider(api: _Api) -> bool:
    """The application set no provider: every span would be dropped."""
    return isinstance(api.trace.get_tracer_provider(), api.trace.ProxyTracerProvider)


def current_ids() -> tuple[str, str] | None:
    """The active span's trace id (32 hex digits) and span id (16), as the W3C trace
    context writes them; ``None`` outside a valid span, or without OpenTelemetry."""
    api = _api()
    if api is None:
        return None
    context = api.trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def _in_span() -> _Api | None:
    """The API, inside a valid span; ``None`` outside one."""
    api = _api()
    if api is None or not api.trace.get_current_span().get_span_context().is_valid:
        return None
    return api


def inject() -> dict[str, str] | None:
    """The W3C trace context of the active span, for a job to carry (``traceparent`` and,
    if the span has one, ``tracestate``); ``None`` outside a valid span."""
    api = _in_span()
    if api is None:
        return None
    carrier: dict[str, str] = {}
    api.propagator.inject(carrier)
    return carrier or None


_NO_SPAN = contextlib.nullcontext()


def enqueue_span(task: str) -> contextlib.AbstractContextManager[object]:
    """Around a client's enqueue of one job of ``task``: a producer span, active meanwhile
    so that :func:`inject` gives the job its context. Only inside an active span (an
    enqueue outside any trace starts none, and gets a context manager that does nothing,
    with no generator to run: one enqueue at a time, that cost about 2 us in each); an
    exception raised out of it marks the span failed (``start_as_current_span`` does)."""
    api = _in_span()
    if api is None:
        return _NO_SPAN
    return api.tracer.start_as_current_span(
        f"broker.enqueue {task}",
        kind=api.trace.SpanKind.PRODUCER,
        attributes={"broker.task": task},
    )


def dispatch(
    task: str,
    job_id: object,
    queue: str,
    attempt: int,
    worker: str | None,
    carried: Mapping[str, str],
) -> Mapping[str, str]:
    """The span of the main handing one job of ``task`` to ``worker``, a child of the
    span that enqueued it (``carried``, the job's trace context). Returns the context the
    ``job`` message carries to the worker instead, the dispatch span's, so the run is its
    child: enqueue, dispatch and run are one chain, and a retry's dispatch and run are a
    branch of their own. The span ends at once: it marks when the job left the main
    (after its wait in the queue, before its time in transit and in the worker's
    prefetch window). ``carried`` unchanged in a process where the application set no
    provider, and without OpenTelemetry the caller does not call (:data:`ENABLED`)."""
    api = _api(provider_from_environment=True)
    if api is None or _no_provider(api):
        return carried
    span = api.tracer.start_span(
        f"broker.dispatch {task}",
        context=api.propagator.extract(carried),
        kind=api.trace.SpanKind.PRODUCER,
        attributes={
            **_job_attributes(job_id, task, queue, attempt),
            "broker.worker.id": worker or "",
        },
    )
    try:
        onward: dict[str, str] = {}
        api.propagator.inject(onward, context=api.trace.set_span_in_context(span))
        return onward or carried
    finally:
        span.end()


def _job_attributes(job_id: object, task: str, queue: str, attempt: int) -> dict[str, Any]:
    """The attributes every span of one attempt of a job carries (dispatch and run)."""
    return {
        "broker.job.id": str(job_id),
        "broker.task": task,
        "broker.queue": queue,
        "broker.attempt": attempt,
    }


def start_run(
    task: str, job_id: object, queue: str, attempt: int, carried: Mapping[str, str] | None
) -> Any:
    """Start the consumer span of one run of a job, a child of the span that enqueued it
    (``carried``, the job's trace context; a root span without one). Returns the span, to
    give :func:`activate` and :func:`end_run`; ``None`` without OpenTelemetry, or in a
    process where the application set no provider (its spans would all be dropped, and
    the job's own would not cost a span, a context and a callback for nothing)."""
    api = _api(provider_from_environment=True)
    if api is None or _no_provider(api):
        return None
    parent = None if carried is None else api.propagator.extract(carried)
    return api.tracer.start_span(
        f"broker.run {task}",
        context=parent,
        kind=api.trace.SpanKind.CONSUMER,
        attributes=_job_attributes(job_id, task, queue, attempt),
    )


def activate(span: Any) -> None:
    """Make ``span`` the active one in the current context (call it in the copy of the
    context a job runs in): the task's own spans become its children, and its log lines
    carry its ids. The copy is dropped with the job, so nothing is detached."""
    api = _api()
    assert api is not None, "a span comes from start_run, which loaded the API"
    api.context.attach(api.trace.set_span_in_context(span))


def end_run(span: Any, error: str | None) -> None:
    """End a run's span; ``error``: the run failed with that message (an error status)."""
    if error is not None:
        api = _api()
        assert api is not None, "a span comes from start_run, which loaded the API"
        span.set_status(api.trace.Status(api.trace.StatusCode.ERROR, error))
    span.end()


__all__ = [
    "ENABLED",
    "activate",
    "current_ids",
    "dispatch",
    "end_run",
    "enqueue_span",
    "inject",
    "start_run",
]
