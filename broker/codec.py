"""A handed-off job's fields across its boundaries, mapped once each.

A job leaves the store as a :class:`~broker.jobs.Job`, crosses TCP as a ``job`` message
(:class:`broker.protocol.JobHandoff`), reaches a runner as an :class:`~broker.runner.Assignment`
and a child process as a JSON object on its pipe. The fields keep their names across
all four, so each mapping copies by name from the target's dataclass fields and writes
out only what differs (the lease under its own name, the attempt number); a field added
to the target is copied without another line here.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from broker import protocol
from broker.jobs import ExecutionMode, Job, json_field
from broker.runner import Assignment


def _by_name(target: Any, source: object, **differ: Any) -> dict[str, Any]:
    """``target``'s fields taken from ``source`` by name, but for those that ``differ``."""
    names = [f.name for f in fields(target) if f.name not in differ]
    return {**{name: getattr(source, name) for name in names}, **differ}


def job_message(seq: int, job: Job) -> protocol.JobHandoff:
    """The ``job`` message that hands ``job`` (claimed, so under a lease) to a worker."""
    if job.handoff_id is None:
        raise ValueError(f"job {job.id} has no lease: only a claimed job is sent")
    return protocol.JobHandoff(
        **_by_name(
            protocol.JobHandoff,
            job,
            seq=seq,
            job_id=job.id,
            handoff_id=job.handoff_id,
            args=list(job.args),
            attempt=job.attempts + 1,
        )
    )


def assignment(msg: protocol.JobHandoff) -> Assignment:
    """What a worker hands its runner for a ``job`` message."""
    return Assignment(**_by_name(Assignment, msg, args=tuple(msg.args), kwargs=dict(msg.kwargs)))


_FROM_PIPE: dict[str, Callable[[Any], Any]] = {
    "job_id": uuid.UUID,
    "handoff_id": uuid.UUID,
    "args": tuple,
    "kwargs": dict,
    "execution_mode": ExecutionMode,
    "attempt": int,
    "max_attempts": int,
}
"""The assignment fields JSON does not hold as they are; the rest pass unchanged."""


def assignment_to_pipe(a: Assignment) -> dict[str, Any]:
    """An assignment as the ``job`` line a parent writes to a runner child."""
    return {"type": "job", **{f.name: json_field(getattr(a, f.name)) for f in fields(a)}}


def assignment_from_pipe(message: dict[str, Any]) -> Assignment:
    """The child's side of :func:`assignment_to_pipe`."""
    return Assignment(
        **{f.name: _FROM_PIPE.get(f.name, _same)(message[f.name]) for f in fields(Assignment)}
    )


def _same(value: Any) -> Any:
    return value
