"""The line protocol between a worker and its pooled or forked children, as typed structs.

Every line on either pipe is a JSON array of messages, each tagged by ``type``: the
side that writes gathers what one event-loop turn produced (several jobs for a child,
several outcomes for the worker) into one line and one ``write``, because a system call
and a line parse per job were the largest costs of the pooled path. Each message is
encoded once (:func:`encode_batch` joins encoded messages, so one message that cannot be
encoded fails alone, before anything is written).

Decoding is strict: an unknown ``type``, a missing or mistyped field or anything but an
array of messages raises :class:`msgspec.ValidationError` or :class:`msgspec.DecodeError`,
and the worker treats its child as broken (see :mod:`runners.process`).

Parent to child: ``job`` (one :class:`~broker.tasks.runner.Assignment`), ``ping``, and
``checkpoint_ack`` per checkpoint. Child to parent: ``ready`` or ``startup_error`` once,
then ``completed`` / ``failed`` / ``rescheduled`` per job, ``checkpoint`` and
``progress`` while a job runs, ``pong`` per ping and ``sample`` (its memory) on a period.
"""

from __future__ import annotations

import asyncio
import dataclasses
import operator
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import msgspec

from broker.jobs import ExecutionMode
from broker.tasks.runner import Assignment, Completed, Failed, Rescheduled, RunOutcome


class _Message(msgspec.Struct, forbid_unknown_fields=True, tag_field="type"):
    """Base of every pipe message: tagged by ``type``, refusing fields it does not know."""


class JobLine(_Message, tag="job"):
    """One assignment, field for field (see :func:`job_line`)."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    task: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    execution_mode: ExecutionMode
    attempt: int
    max_attempts: int
    timeout: float | None
    queue: str
    checkpoint: Any = None
    checkpoint_seq: int = 0
    recoveries: int = 0
    state_lost: bool = False
    trace_context: dict[str, str] | None = None


class CheckpointAckLine(_Message, tag="checkpoint_ack"):
    """The worker's answer to a ``checkpoint``: ``error`` is ``None`` once it is durable,
    else the error code and message the task raises (see :mod:`broker.wire.errors`)."""

    handoff_id: uuid.UUID
    seq: int
    code: str | None = None
    error: str | None = None


class PingLine(_Message, tag="ping"):
    nonce: int


class ReadyLine(_Message, tag="ready"):
    pid: int


class StartupErrorLine(_Message, tag="startup_error"):
    error: str


class CompletedLine(_Message, tag="completed"):
    handoff_id: uuid.UUID
    result: Any = None


class FailedLine(_Message, tag="failed"):
    handoff_id: uuid.UUID
    error: str
    retry: bool


class RescheduledLine(_Message, tag="rescheduled"):
    handoff_id: uuid.UUID
    delay: float


class CheckpointLine(_Message, tag="checkpoint"):
    handoff_id: uuid.UUID
    seq: int
    state: Any = None


class ProgressLine(_Message, tag="progress"):
    handoff_id: uuid.UUID
    fraction: float
    message: str


class PongLine(_Message, tag="pong"):
    nonce: int
    rss: int


class SampleLine(_Message, tag="sample"):
    """The child's resident memory in bytes, sent on a period while it runs jobs (never
    per job: reading ``/proc`` per outcome was a fifth of a child's CPU)."""

    rss: int


ToChild: TypeAlias = JobLine | PingLine | CheckpointAckLine
OutcomeLine: TypeAlias = CompletedLine | FailedLine | RescheduledLine
FromChild: TypeAlias = (
    ReadyLine
    | StartupErrorLine
    | OutcomeLine
    | PongLine
    | SampleLine
    | CheckpointLine
    | ProgressLine
)

_encoder = msgspec.json.Encoder()
to_child_decoder = msgspec.json.Decoder(list[ToChild])
from_child_decoder = msgspec.json.Decoder(list[FromChild])


def encode(message: _Message) -> bytes:
    """One message, encoded once; raises ``ValueError`` if it cannot be (a result nested
    too deeply, say), so the caller can fail that job alone."""
    try:
        return _encoder.encode(message)
    except RecursionError:
        raise ValueError("it nests too deeply to be encoded as JSON") from None
    except (TypeError, msgspec.EncodeError) as exc:
        raise ValueError(f"it cannot be encoded as JSON: {exc}") from None


def encode_batch(encoded: Iterable[bytes]) -> bytes:
    """One line carrying every already-encoded message, in order."""
    return b"[" + b",".join(encoded) + b"]\n"


class LineChannel(asyncio.Protocol):
    """The reading end of a pipe, a line at a time, by callback: each read hands its
    complete lines to ``on_line`` in the same step, where a reading task cost a wake-up
    (a future and a task step) per read on both ends of the pooled path.

    ``ended`` resolves at a clean end of the pipe, or fails with what stopped the reading:
    a line over ``limit`` bytes, a last line with no newline, or whatever ``on_line``
    raised (nothing is read after that).
    """

    def __init__(
        self, on_line: Callable[[bytes], None], limit: int, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._on_line = on_line
        self._limit = limit
        self._buffer = bytearray()
        self._transport: asyncio.BaseTransport | None = None
        self.ended: asyncio.Future[None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        if self.ended.done():
            return
        buffer = self._buffer
        buffer += data
        start = 0
        try:
            while (end := buffer.find(b"\n", start)) >= 0:
                if end - start > self._limit:
                    raise ValueError(f"a line of {end - start} bytes, over {self._limit}")
                self._on_line(bytes(buffer[start:end]))
                start = end + 1
        except Exception as exc:  # RecursionError too: a line nested too deeply to decode
            self._end(exc)
            return
        del buffer[:start]
        if len(buffer) > self._limit:
            self._end(ValueError(f"a line over {self._limit} bytes"))

    def eof_received(self) -> bool:
        self._end(ValueError("unterminated line") if self._buffer else None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc)

    def close(self) -> None:
        """Stop reading (the other end is gone anyway)."""
        if self._transport is not None:
            self._transport.close()
        self._end(None)

    def _end(self, error: Exception | None) -> None:
        if self.ended.done():
            return
        if error is None:
            self.ended.set_result(None)
        else:
            self.ended.set_exception(error)
            if self._transport is not None:
                self._transport.close()


_ASSIGNMENT_FIELDS = tuple(f.name for f in dataclasses.fields(Assignment))
if JobLine.__struct_fields__ != _ASSIGNMENT_FIELDS:
    raise ImportError("JobLine's fields must be Assignment's, by name and in order")
_assignment_fields = operator.attrgetter(*_ASSIGNMENT_FIELDS)
"""Every field of an assignment (or a ``job`` line), by name, in the order both declare:
the check above keeps the two in step, so each mapping below copies by name, and a
field added to ``Assignment`` fails the import until the pipe carries it too."""


def job_line(a: Assignment) -> JobLine:
    """The ``job`` line that hands assignment ``a`` to a child."""
    return JobLine(*_assignment_fields(a))


def assignment_of(line: JobLine) -> Assignment:
    """The assignment a child runs for a ``job`` line."""
    return Assignment(*_assignment_fields(line))


def outcome_line(handoff_id: uuid.UUID, outcome: RunOutcome) -> OutcomeLine:
    """What a child sends for a job's outcome. A ``Released`` outcome (which a child's
    own runner never produces) travels as a retryable failure."""
    match outcome:
        case Completed(result=result):
            return CompletedLine(handoff_id, result)
        case Failed(error=error, retry=retry):
            return FailedLine(handoff_id, error, retry)
        case Rescheduled(delay=delay):
            return RescheduledLine(handoff_id, delay)
        case _:
            return FailedLine(handoff_id, outcome.reason, True)


def outcome_of(line: OutcomeLine) -> RunOutcome:
    match line:
        case CompletedLine(result=result):
            return Completed(result)
        case FailedLine(error=error, retry=retry):
            return Failed(error, retry=retry)
        case RescheduledLine(delay=delay):
            return Rescheduled(delay)
