"""The worker's outbox as it goes on the wire: each report encoded once, when it is
measured against the main's line limit, and those very bytes packed into ``reports``
lines (issue 10, items 4 and 5)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.payload import result_too_large
from broker.tasks.runner import Completed, Failed
from broker.wire import codec
from broker.wire import messages as protocol
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
    assert items == [codec.encode_item(report) for report in reports]
    (line,) = codec.pack(protocol.Reports, items, 1 << 20)
    assert codec.decode(line) == protocol.Reports(reports)


def test_a_replaced_report_is_sent_as_its_replacement() -> None:
    state = make_state()
    state.connected(welcome(max_line_bytes=300))
    key = start(state, job(1))
    state.run_finished(key, Completed("x" * 500))
    (report,) = state.outgoing()
    assert isinstance(report, protocol.FailedReport)
    line = state.encoded(report)
    assert len(line) <= 300
    assert codec.decode(line) == report == state.outbox[key]


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
    assert codec.decode(state.encoded(again)) == report


_RESULTS = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters() | st.sampled_from(["é", "\U0001f600", "\x01", '"', "\\"]))
    | st.builds(
        lambda char, n: char * n,
        st.sampled_from(["x", "é", "\u20ac", "\U0001f600", "\x01"]),
        st.integers(min_value=0, max_value=300),
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=10,
)


@given(result=_RESULTS, limit=st.integers(min_value=1, max_value=4000))
def test_a_result_fails_for_its_size_exactly_when_the_main_would_fail_it(
    result: object, limit: int
) -> None:
    """The worker skips measuring a result that its line proves small enough; the verdict
    is still the main's (``result_too_large``, on the stored, escaped form)."""
    state = make_state()
    state.connected(welcome(max_payload_bytes=limit))
    key = start(state, job(1))
    state.run_finished(key, Completed(result))
    (report,) = state.outgoing()
    refused = isinstance(report, protocol.FailedReport)
    assert refused == (result_too_large(result, limit) is not None)
