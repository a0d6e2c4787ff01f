"""The alert rules in ``docs/howto/monitoring.md`` against the metrics it documents: a rule
that reads a main's gauge fires on the leader only (a standby has no workers by design,
so ``BrokerNoWorkers`` fired on every standby), and every metric a rule names is one the
page documents and the main or a worker serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

from broker.main.metrics import MainExposition, MainMetrics
from tests.unit.test_metrics import levels

DOC = Path(__file__).resolve().parents[2] / "docs" / "howto" / "monitoring.md"
LEADER_JOIN = "and on(instance) broker_main_leader == 1"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def alert_rules() -> dict[str, str]:
    """Each documented alert's name and expression (folded ``>-`` ones joined)."""
    block = _section(DOC.read_text(), "## Alert rules").split("```yaml\n", 1)[1].split("```")[0]
    rules: dict[str, str] = {}
    name: str | None = None
    folded: list[str] | None = None
    for line in block.splitlines():
        stripped = line.strip()
        if folded is not None:
            if stripped and not re.match(r"^(for|labels|annotations|- alert):", stripped):
                folded.append(stripped)
                continue
            assert name is not None
            rules[name] = " ".join(folded)
            folded = None
        if match := re.match(r"^- alert: (\w+)$", stripped):
            name = match[1]
        elif stripped.startswith("expr:"):
            assert name is not None
            expr = stripped.removeprefix("expr:").strip()
            if expr == ">-":
                folded = []
            else:
                rules[name] = expr
    if folded is not None and name is not None:
        rules[name] = " ".join(folded)
    return rules


def documented_metrics(heading: str) -> dict[str, str]:
    """The metrics table under ``heading``: each name and its type."""
    rows = re.findall(r"^\| `(broker_\w+)` \| (\w+) \|", _section(DOC.read_text(), heading), re.M)
    return dict(rows)


def test_the_page_documents_the_alerts_it_is_about() -> None:
    rules = alert_rules()
    assert {"BrokerNoWorkers", "BrokerNoLeader", "BrokerJobsWaiting"} <= set(rules)
    assert all(rules.values()), rules


def test_every_rule_on_a_main_gauge_fires_on_the_leader_only() -> None:
    metrics = documented_metrics("### From the main")
    assert metrics["broker_main_leader"] == "gauge"
    gauges = {name for name, kind in metrics.items() if kind == "gauge"} - {"broker_main_leader"}
    for name, expr in alert_rules().items():
        if gauges & set(re.findall(r"broker_\w+", expr)):
            assert LEADER_JOIN in expr, f"{name} would fire on a standby: {expr}"


def test_every_metric_a_rule_names_is_documented() -> None:
    known = documented_metrics("### From the main") | documented_metrics("### From each worker")
    for name, expr in alert_rules().items():
        for metric in re.findall(r"broker_\w+", expr):
            assert metric in known, f"{name} names {metric}, undocumented"


def test_the_leader_gauge_says_the_role() -> None:
    for leader in (True, False):
        shown = MainExposition(MainMetrics()).render(levels(leader=leader)).decode()
        assert f"broker_main_leader {float(leader)}" in shown


def exported_metrics() -> set[str]:
    """Every series name the main's ``/metrics`` can show: each family's name, with a
    histogram's ``_bucket``, ``_sum`` and ``_count``."""
    shown = MainExposition(MainMetrics()).render(levels(leader=True)).decode()
    names: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\w+) (\w+)$", shown, re.M):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def chart_queries() -> list[str]:
    """The PromQL the page gives for the history view's charts, a query a line."""
    section = _section(DOC.read_text(), "### The same charts from Prometheus")
    block = section.split("```promql\n", 1)[1].split("```")[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_every_chart_has_a_query_on_metrics_the_main_exports() -> None:
    queries = chart_queries()
    exported = exported_metrics()
    named = {metric for query in queries for metric in re.findall(r"broker_\w+", query)}
    # One per chart of the history view: runs by outcome, waits, depth, oldest wait.
    assert {
        "broker_jobs_completed_total",
        "broker_jobs_failed_total",
        "broker_jobs_dead_total",
        "broker_job_wait_seconds_bucket",
        "broker_queue_jobs",
        "broker_queue_oldest_eligible_age_seconds",
    } <= named
    for query in queries:
        for metric in re.findall(r"broker_\w+", query):
            assert metric in exported, f"{query} names {metric}, which the main does not export"


GRAFANA = DOC.parents[1] / "grafana" / "broker-history.json"


def without_variables(expr: str) -> str:
    """A dashboard query with its variables' matchers (``queue=~"$queue"``) taken out."""
    return re.sub(r',?\s*\w+=~"\$\w+"', "", expr).replace("{, ", "{").replace("{}", "")


def test_the_grafana_dashboard_charts_the_documented_queries() -> None:
    """``docs/grafana/broker-history.json`` is valid JSON, each of its queries names only
    metrics the main exports, and each is a query of the page once its dashboard
    variables (``$queue``, ``$task``) are taken out: the dashboard and the page cannot
    drift apart."""
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(dashboard["panels"]) == 4, "a panel per chart of the history view"
    exported = exported_metrics()
    documented = set(chart_queries())
    for expr in exprs:
        for metric in re.findall(r"broker_\w+", expr):
            assert metric in exported, f"{expr} names {metric}, which the main does not export"
        assert without_variables(expr) in documented, f"{expr} is not a query of {DOC.name}"
    charted = {without_variables(expr) for expr in exprs}
    assert documented <= charted, "a documented chart is missing from the dashboard"
