"""The container bound as the main's reader applies it, and as senders keep to it: a line
with too many ``[`` and ``{`` is dropped as it arrives (only its head kept), the stream
stays at a line boundary, and batches are packed within the bound."""

from __future__ import annotations

import asyncio
import json
import uuid
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.jobs import ExecutionMode
from broker.main.sessions import RequestBytes
from broker.model.bounds import MAX_WORKER_STATUS_BYTES, MESSAGE_CONTAINERS
from broker.payload import containers_in, nesting_depth, shape_problem
from broker.tasks.registry import TaskRegistry
from broker.tasks.runner import RunnerStatus
from broker.wire import codec
from broker.wire import framing as wire
from broker.wire import messages as protocol
from broker.worker.worker import Worker
from runners.inline import InlineRunner


def _reader(data: bytes, *, max_line_bytes: int = 1 << 20, chunks: int = 7) -> wire.LineReader:
    stream = asyncio.StreamReader(limit=1 << 16)
    step = max(1, len(data) // chunks)  # arrives in pieces, as from a socket
    for start in range(0, len(data), step):
        stream.feed_data(data[start : start + step])
    stream.feed_eof()
    lines = wire.LineReader(stream, max_line_bytes=max_line_bytes)
    lines.max_containers = 100
    return lines


async def test_a_line_over_the_bound_is_dropped_and_the_next_one_read() -> None:
    head = b'{"type":"enqueue","request_id":"r1","jobs":[{"task":"t","args":'
    over = head + b"[" + b"[]," * 200 + b"[]]}]}\n"
    within = b'{"type":"ping","nonce":1}\n'
    exactly = b"[" * 100 + b"\n"
    lines = _reader(over + within + exactly + over)
    with pytest.raises(wire.TooManyContainersError) as refused:
        await lines.read_line()
    assert refused.value.head == over[: len(over) - 1][: codec.HEAD_BYTES]
    assert await lines.read_line() == within.strip()
    assert await lines.read_line() == exactly.strip()  # at the bound: kept
    with pytest.raises(wire.TooManyContainersError):
        await lines.read_line()
    assert await lines.read_line() is None


async def test_a_dropped_line_still_counts_against_the_line_limit() -> None:
    lines = _reader(b"[" * 5000 + b"\n", max_line_bytes=1000)
    with pytest.raises(wire.LineTooLongError):
        await lines.read_line()


async def test_without_a_bound_the_reader_returns_every_line() -> None:
    lines = _reader(b"[" * 5000 + b"\n")
    lines.max_containers = None
    assert await lines.read_line() == b"[" * 5000


def test_a_refused_line_is_answered_from_its_head() -> None:
    job_id, lease = uuid.uuid4(), uuid.uuid4()
    completed = codec.encode(protocol.CompletedReport(job_id, lease, result=[[]] * 300))
    refusal = codec.container_refusal(completed[: codec.HEAD_BYTES], 100)
    assert isinstance(refusal.instead, protocol.FailedReport) and not refusal.instead.retry
    assert refusal.instead.handoff_id == lease and "lists and objects" in refusal.instead.error
    saved = codec.encode(protocol.SaveCheckpoint(job_id, lease, 3, state=[[]] * 300))
    ack = codec.container_refusal(saved, 100).reply
    assert isinstance(ack, protocol.CheckpointAck) and ack.seq == 3
    assert ack.status is protocol.AckStatus.REFUSED
    enqueue = b'{"type":"enqueue","request_id":"r9","jobs":[{"task":"t","args":[[],[]]}]}'
    refused = codec.container_refusal(enqueue, 100)
    assert refused.request_id == "r9" and refused.code == protocol.ErrorCode.PAYLOAD_TOO_LARGE
    # A head that is not where senders write it, or not a name: a plain refusal.
    assert codec.container_refusal(b"[" * 20000, 100).request_id is None
    bad = b'{"type":"enqueue","request_id":"a\\u0000b"}'
    assert codec.container_refusal(bad, 100).request_id is None


def test_report_batches_are_packed_within_the_container_bound() -> None:
    items = [codec.encode_item(protocol.Ping(nonce=i)) for i in range(3)]
    items += [b'{"type":"completed","result":' + b"[]" * 0 + b"[" + b"[]," * 39 + b"[]]}"] * 5
    lines = codec.pack(protocol.Reports, items, 1 << 20, max_containers=100)
    assert b"".join(lines).count(b"\n") == len(lines) > 1
    for line in lines:
        assert containers_in(line) <= 100 + MESSAGE_CONTAINERS
    assert len(codec.pack(protocol.Reports, items, 1 << 20)) == 1, "no bound: one line"


def test_request_bytes_are_full_at_their_limit() -> None:
    total = RequestBytes(limit=100)
    total.add(60)
    assert not total.full
    total.add(40)
    assert total.full
    total.remove(40)
    assert not total.full and total.bytes == 60


_TEXT = st.text(st.characters(blacklist_characters="[{"), max_size=3)
"""Texts without brackets, so the count of the JSON's ``[`` and ``{`` is exact."""

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _TEXT,
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(_TEXT, inner),
    max_leaves=200,
)


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@given(_JSON, st.integers(min_value=1, max_value=8), st.integers(min_value=0, max_value=60))
def test_the_walk_measures_depth_and_counts_exactly(value: object, limit: int, bound: int) -> None:
    """The level walk says what the plain recursive definition says, and its container
    verdict is the count of ``[`` and ``{`` in the value's JSON (no strings with brackets
    here), which is what the main counts in a line."""
    depth = _depth(value)
    assert nesting_depth(value, limit) == min(depth, limit + 1)
    counted = containers_in(json.dumps(value).encode())
    problem = shape_problem(value, 64, bound, "it")
    assert (problem is not None) == (counted > bound), (counted, problem)


def test_a_worker_trims_its_status_to_the_main_s_bound() -> None:
    """A runner's start-up error the size of a traceback of tracebacks must not make the
    main refuse the worker's status: details go, errors are cut, the capacity stays."""

    class Broken(InlineRunner):
        def status(self) -> RunnerStatus:
            return RunnerStatus(
                ExecutionMode.INLINE, 4, 0, "x" * (1 << 20), {"log": "y" * (1 << 20)}
            )

    worker = Worker(
        "127.0.0.1",
        1,
        worker_id="w",
        runners={ExecutionMode.INLINE: Broken(TaskRegistry(), concurrency=4)},
        registry=TaskRegistry(),
    )
    line = worker._status_message(SimpleNamespace(status_sent=None))  # type: ignore[arg-type]
    assert line is not None and len(line) <= MAX_WORKER_STATUS_BYTES
    msg = codec.decode(line)
    assert isinstance(msg, protocol.WorkerStatus)
    runner = msg.status["runners"]["inline"]
    assert runner["capacity"] == 4 and runner["details"] == {}
    assert len(runner["startup_error"]) == 2000
