"""OpenTelemetry, when it is installed (``pip install broker-jobs[otel]``): the ids of the
span active where a line is logged, for the JSON log (:mod:`broker.model.logs`).

The one module of the broker that imports OpenTelemetry, and only if it is there: without
the extra nothing is imported and a log line costs one ``is None`` check. Only the API is
used (an application installs and configures the SDK and its exporter, as for any
instrumented library); with no SDK configured no span is ever valid, and lines carry no
ids. See ``docs/howto/tracing.md``.
"""

from __future__ import annotations

try:
    from opentelemetry import trace
except ImportError:  # the extra is not installed
    trace = None  # type: ignore[assignment]


def current_ids() -> tuple[str, str] | None:
    """The active span's trace id (32 hex digits) and span id (16), as the W3C trace
    context writes them; ``None`` outside a valid span, or without OpenTelemetry."""
    if trace is None:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


__all__ = ["current_ids"]
