"""The child pipe's messages (runners/pipe.py): every field survives, batches keep their
order, and anything malformed is refused rather than guessed at."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec
import pytest

from broker.jobs import ExecutionMode
from broker.tasks.runner import Assignment, Completed, Failed, Released, Rescheduled
from runners import pipe


def _assignment() -> Assignment:
    return Assignment(
        uuid.uuid4(),
        uuid.uuid4(),
        "tasks.add",
        (1, [2], {"a": None}),
        {"x": {"y": [1.5, "z"]}},
        ExecutionMode.POOLED,
        3,
        4,
        1.5,
        "q",
    )


def test_an_assignment_crosses_the_pipe_with_every_field() -> None:
    a = _assignment()
    line = pipe.encode_batch([pipe.encode(pipe.job_line(a)), pipe.encode(pipe.PingLine(7))])
    assert line.endswith(b"\n") and line.count(b"\n") == 1, "one line for the whole batch"
    job, ping = pipe.to_child_decoder.decode(line)
    assert isinstance(job, pipe.JobLine) and pipe.assignment_of(job) == a
    assert ping == pipe.PingLine(7)


def test_an_assignment_with_every_field_set_maps_to_the_same_job_line_bytes() -> None:
    """The mapping goes by name; the line is the pipe protocol, so its bytes are pinned."""
    a = Assignment(
        uuid.UUID(int=1),
        uuid.UUID(int=2),
        "tasks.add",
        (1, [2], {"a": None}),
        {"x": {"y": [1.5, "z"]}},
        ExecutionMode.FORKED,
        3,
        4,
        1.5,
        "q",
        {"done": 7},
        2,
        1,
        True,
        {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
    )
    line = pipe.job_line(a)
    assert pipe.encode(line) == (
        b'{"type":"job","job_id":"00000000-0000-0000-0000-000000000001",'
        b'"handoff_id":"00000000-0000-0000-0000-000000000002","task":"tasks.add",'
        b'"args":[1,[2],{"a":null}],"kwargs":{"x":{"y":[1.5,"z"]}},"execution_mode":"forked",'
        b'"attempt":3,"max_attempts":4,"timeout":1.5,"queue":"q","checkpoint":{"done":7},'
        b'"checkpoint_seq":2,"recoveries":1,"state_lost":true,'
        b'"trace_context":{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}'
    )
    [decoded] = pipe.to_child_decoder.decode(pipe.encode_batch([pipe.encode(line)]))
    assert isinstance(decoded, pipe.JobLine) and pipe.assignment_of(decoded) == a
    assert all(
        getattr(line, name) == getattr(a, name) for name in pipe.JobLine.__struct_fields__
    ), "each field keeps its name"


@pytest.mark.parametrize(
    "outcome",
    [Completed({"k": [1, 2.5, None]}), Completed(), Failed("boom", retry=False), Rescheduled(2.0)],
)
def test_each_outcome_crosses_the_pipe_unchanged(outcome: Any) -> None:
    handoff = uuid.uuid4()
    line = pipe.encode_batch([pipe.encode(pipe.outcome_line(handoff, outcome))])
    [message] = pipe.from_child_decoder.decode(line)
    assert isinstance(message, pipe.CompletedLine | pipe.FailedLine | pipe.RescheduledLine)
    assert message.handoff_id == handoff and pipe.outcome_of(message) == outcome


def test_a_released_outcome_travels_as_a_retryable_failure() -> None:
    line = pipe.outcome_line(uuid.uuid4(), Released("no process"))
    assert pipe.outcome_of(line) == Failed("no process", retry=True)


@pytest.mark.parametrize(
    "line",
    [
        b'{"type":"ready","pid":1}\n',  # a message, not a batch
        b'[{"type":"outcome","pid":1}]\n',  # a type the pipe does not have
        b'[{"type":"ready"}]\n',  # a field missing
        b'[{"type":"ready","pid":"1"}]\n',  # a field of the wrong type
        b'[{"type":"ready","pid":1,"extra":true}]\n',  # a field it does not know
        b'[{"type":"failed","handoff_id":"not-a-uuid","error":"e","retry":true}]\n',
        b'[{"type":"rescheduled","handoff_id":"'
        + str(uuid.UUID(int=7)).encode()
        + b'","delay":true}]\n',
        b"[{]\n",  # not JSON
    ],
)
def test_a_malformed_line_from_a_child_is_refused(line: bytes) -> None:
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        pipe.from_child_decoder.decode(line)


def test_a_job_the_child_side_does_not_know_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        pipe.to_child_decoder.decode(b'[{"type":"sample","rss":1}]\n')


def test_a_message_too_deep_to_encode_fails_alone_with_a_clear_error() -> None:
    deep: Any = None
    for _ in range(100_000):
        deep = [deep]
    good = pipe.encode(pipe.PingLine(1))
    with pytest.raises(ValueError, match="nests too deeply"):
        pipe.encode(pipe.outcome_line(uuid.uuid4(), Completed(deep)))
    assert pipe.to_child_decoder.decode(pipe.encode_batch([good])) == [pipe.PingLine(1)]


class _Transport(asyncio.BaseTransport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _channel(limit: int = 100) -> tuple[pipe.LineChannel, list[bytes], _Transport]:
    lines: list[bytes] = []
    channel = pipe.LineChannel(lines.append, limit, asyncio.get_running_loop())
    transport = _Transport()
    channel.connection_made(transport)
    return channel, lines, transport


async def test_the_line_channel_hands_over_whole_lines_however_the_reads_cut_them() -> None:
    channel, lines, transport = _channel()
    for piece in (b"[1]\n[2", b"]\n", b"\n[3]\n[", b"4]\n"):
        channel.data_received(piece)
    assert lines == [b"[1]", b"[2]", b"", b"[3]", b"[4]"]
    channel.eof_received()
    assert channel.ended.done() and channel.ended.exception() is None
    assert not transport.closed


@pytest.mark.parametrize(
    ("pieces", "error"),
    [
        ([b"x" * 101 + b"\n"], "over 100"),
        ([b"x" * 60, b"x" * 60], "over 100"),
        ([b"[1]\n[2"], "unterminated"),
    ],
)
async def test_the_line_channel_stops_at_a_line_it_cannot_take(
    pieces: list[bytes], error: str
) -> None:
    channel, lines, _transport = _channel()
    for piece in pieces:
        channel.data_received(piece)
    channel.eof_received()
    with pytest.raises(ValueError, match=error):
        channel.ended.result()
    assert lines == ([b"[1]"] if error == "unterminated" else [])


async def test_the_line_channel_reads_nothing_after_its_reader_fails() -> None:
    seen: list[bytes] = []

    def on_line(line: bytes) -> None:
        seen.append(line)
        if line == b"bad":
            raise ValueError("broken")

    channel = pipe.LineChannel(on_line, 100, asyncio.get_running_loop())
    transport = _Transport()
    channel.connection_made(transport)
    channel.data_received(b"ok\nbad\nnever\n")
    channel.data_received(b"later\n")
    assert seen == [b"ok", b"bad"]
    assert transport.closed
    with pytest.raises(ValueError, match="broken"):
        channel.ended.result()
