"""OpenTelemetry with real processes: a main and a worker on a SQLite file, the worker's
pooled and forked children, and ``tests.otel_app``, whose start-up hook sets an SDK
provider in each of them that writes every span to a file (see
``docs/howto/tracing.md``). The test process enqueues inside a span of its own, exported
by the SDK's in-memory exporter. Each job's dispatch span, made by the main (whose SDK is
set up at its start, as ``opentelemetry-instrument`` does), must be a child of the
enqueue span, and its run span, made where the job ran, a child of the dispatch span,
all in the same trace."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan

from tests.app_env import SPANS_ENV
from tests.e2e.test_e2e import REPO, Cluster
from tests.unit.test_tracing import sdk_spans

pytestmark = pytest.mark.slow

APP = "tests.otel_app"
OTEL_SITE = Path(__file__).parents[1] / "otel_site"


def _ids(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


async def test_each_run_is_a_child_of_the_span_that_enqueued_it_wherever_it_runs(
    sqlite_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = sqlite_cluster.dir / "spans.jsonl"
    monkeypatch.setenv(SPANS_ENV, str(path))
    # The main's SDK is set up as opentelemetry-instrument does it: a sitecustomize first
    # on its path (the worker's, by the app's start-up hook).
    with monkeypatch.context() as main_env:
        path_now = os.environ.get("PYTHONPATH")
        site = os.pathsep.join([str(OTEL_SITE), str(REPO), *([path_now] if path_now else [])])
        main_env.setenv("PYTHONPATH", site)
        main = await sqlite_cluster.start_main()
    w = await sqlite_cluster.start_worker(
        "otel-worker", "--app", APP, "--pooled-runner-count", "1", "--forked-concurrency", "1"
    )
    spans = sdk_spans()
    results: dict[str, dict[str, object]] = {}
    try:
        async with sqlite_cluster.client() as client:
            for name in ("traced_inline", "traced_pooled", "traced_forked", "traced_failure"):
                with trace.get_tracer("test").start_as_current_span(f"request {name}"):
                    enqueued = await client.enqueue(f"{APP}.{name}")
                job = await client.wait(enqueued.job_id, timeout=60)
                results[name] = job
        mine = {s.name: s for s in spans.get_finished_spans()}
    finally:
        spans.shutdown()
    exported = [json.loads(line) for line in path.read_text().splitlines()]
    ran = {line["name"]: line for line in exported if line["name"].startswith("broker.run ")}
    dispatched = {
        line["name"]: line for line in exported if line["name"].startswith("broker.dispatch ")
    }
    for name, job in results.items():
        request = mine[f"request {name}"]
        enqueue = mine[f"broker.enqueue {APP}.{name}"]
        assert enqueue.kind is trace.SpanKind.PRODUCER
        assert enqueue.parent is not None and enqueue.parent.span_id == int(_ids(request)[1], 16)
        trace_id, enqueue_id = _ids(enqueue)
        # enqueue (the client) -> dispatch (the main) -> run (where the job ran)
        dispatch = dispatched[f"broker.dispatch {APP}.{name}"]
        assert (dispatch["trace_id"], dispatch["parent_id"]) == (trace_id, enqueue_id), name
        assert dispatch["kind"] == "PRODUCER" and dispatch["pid"] == main.pid
        assert dispatch["attributes"] == {
            "broker.job.id": job["id"],
            "broker.task": f"{APP}.{name}",
            "broker.queue": "default",
            "broker.attempt": 1,
            "broker.worker.id": "otel-worker",
        }
        run = ran[f"broker.run {APP}.{name}"]
        assert (run["trace_id"], run["parent_id"]) == (trace_id, dispatch["span_id"]), name
        assert run["kind"] == "CONSUMER"
        assert run["attributes"] == {
            "broker.job.id": job["id"],
            "broker.task": f"{APP}.{name}",
            "broker.queue": "default",
            "broker.attempt": 1,
        }
        if name == "traced_failure":
            assert job["status"] == "failed", job
            assert run["status"] == "ERROR" and "declined" in run["description"]
            continue
        assert job["status"] == "completed", job["last_error"]
        assert run["status"] == "UNSET"
        seen = job["result"]
        assert isinstance(seen, dict)
        # The run's span is the one active in the task, in the process that ran it.
        assert seen == {"span_id": run["span_id"], "pid": run["pid"]}, name
    assert ran[f"broker.run {APP}.traced_inline"]["pid"] == w.pid, "inline: in the worker"
    assert ran[f"broker.run {APP}.traced_pooled"]["pid"] != w.pid, "pooled: in its child"
    assert ran[f"broker.run {APP}.traced_forked"]["pid"] not in {
        w.pid,
        ran[f"broker.run {APP}.traced_pooled"]["pid"],
    }, "forked: in a child of its own"
