"""The worker's outbox as it goes on the wire: each report encoded once, when it is
measured against the main's line limit, and those very bytes packed into ``reports``
lines (issue 10, items 4 and 5)."""

from __future__ import annotations

from broker import protocol
from broker.runner import Completed, Failed
from tests.unit.test_worker_state import job, make_state, start, welcome


def test_the_bytes_measured_are_the_bytes_sent() -> None:
    state = make_state()
    state.connected(welcome())
    first, second = start(state, job(1)), start(state, job(2))
    state.run_finished(first, Completed({"n": 1}))
    state.run_finished(second, Failed("boom", retry=False))
    reports = [m for m in state.outgoing() if isinstance(m, protocol.Report)]
    assert len(reports) == 2
    items = [state.encoded(report) for report in reports]
    assert items == [protocol.encode_item(report) for report in reports]
    (line,) = protocol.pack(protocol.Reports, items, 1 << 20)
    assert protocol.decode(line) == protocol.Reports(reports)


def test_a_replaced_report_is_sent_as_its_replacement() -> None:
    state = make_state()
    state.connected(welcome(max_line_bytes=300))
    key = start(state, job(1))
    state.run_finished(key, Completed("x" * 500))
    (report,) = state.outgoing()
    assert isinstance(report, protocol.FailedReport)
    line = state.encoded(report)
    assert len(line) <= 300
    assert protocol.decode(line) == report == state.outbox[key]


def test_a_report_sent_again_on_a_new_connection_is_measured_again() -> None:
    state = make_state()
    state.connected(welcome())
    key = start(state, job(1))
    state.run_finished(key, Completed(7))
    (report,) = state.outgoing()
    state.disconnected()
    state.connected(welcome(adopted=[key]))
    (again,) = state.outgoing()
    assert again == report
    assert protocol.decode(state.encoded(again)) == report
