"""A handed-off job's fields across its boundaries, mapped once each.

A job leaves the store as a :class:`~broker.jobs.Job`, crosses TCP as a ``job`` message
(:class:`broker.protocol.JobHandoff`) and reaches a runner as an
:class:`~broker.runner.Assignment`; the child pipe's mapping lives beside ``Assignment``
in :mod:`broker.runner`, so a runner child never loads the protocol module. The fields
keep their names across all of them, so each mapping copies by name from the target's
dataclass fields and writes out only what differs (the lease under its own name, the
attempt number); a field added to the target is copied without another line here.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import fields
from typing import Any

import msgspec

from broker import protocol
from broker.jobs import Job
from broker.runner import Assignment


@functools.cache
def _copier(target: Any, differ: tuple[str, ...]) -> tuple[tuple[str, ...], Any]:
    """``target``'s field names but ``differ``, and one getter of them all: made once per
    call site, not per job (a worker maps every job it receives)."""
    every = (
        target.__struct_fields__
        if issubclass(target, msgspec.Struct)
        else [f.name for f in fields(target)]
    )
    names = tuple(name for name in every if name not in differ)
    if len(names) > 1:
        return names, operator.attrgetter(*names)
    return names, lambda source: tuple(getattr(source, name) for name in names)


def _by_name(target: Any, source: object, **differ: Any) -> dict[str, Any]:
    """``target``'s fields taken from ``source`` by name, but for those that ``differ``.
    ``target`` is a message (a msgspec struct) or a dataclass (an ``Assignment``)."""
    names, get = _copier(target, tuple(differ))
    copied = dict(zip(names, get(source), strict=True))
    copied.update(differ)
    return copied


def job_message(seq: int, job: Job, *, state_lost: bool = False) -> protocol.JobHandoff:
    """The ``job`` message that hands ``job`` (claimed, so under a lease) to a worker;
    ``state_lost`` when the job's local state is not on that worker."""
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
            state_lost=state_lost,
        )
    )


def assignment(msg: protocol.JobHandoff) -> Assignment:
    """What a worker hands its runner for a ``job`` message."""
    return Assignment(**_by_name(Assignment, msg, args=tuple(msg.args), kwargs=dict(msg.kwargs)))
