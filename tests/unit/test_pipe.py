"""The child pipe's messages (runners/pipe.py): every field survives, batches keep their
order, and anything malformed is refused rather than guessed at."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
import pytest

from broker.jobs import ExecutionMode
from broker.runner import Assignment, Completed, Failed, Released, Rescheduled
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
