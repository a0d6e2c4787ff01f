"""A handed-off job's fields across its boundaries, mapped once each.

A job leaves the store as a :class:`~broker.jobs.Job`, crosses TCP as a ``job`` message
(:class:`broker.wire.messages.JobHandoff`) and reaches a runner as an
:class:`~broker.tasks.runner.Assignment`. The fields keep their names across all of them,
so each mapping here copies by name from the target's fields and writes out only what
differs (the lease under its own name, the attempt number); a field added to the target
is copied without another line here. The child pipe maps an ``Assignment`` to its own
``job`` line itself, by name too (:func:`runners.pipe.job_line`), so a runner child loads
neither the protocol nor this module.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import fields
from typing import Any

import msgspec

from broker.jobs import Job
from broker.tasks.runner import Assignment
from broker.wire import messages as protocol


def _by_name(target: Any, source: object, **differ: Any) -> Any:
    """A ``target`` whose fields are taken from ``source`` by name, but for those that
    ``differ``. ``target`` is a message (a msgspec struct) or a dataclass (an
    ``Assignment``); either takes its fields by position, in order."""
    get, pick = _copied(target, tuple(differ))
    return target(*pick((*get(source), *differ.values())))


@functools.cache
def _copied(target: Any, differ: tuple[str, ...]) -> tuple[Any, Any]:
    """How :func:`_by_name` builds a ``target``, worked out once per target and set of
    differing names (a job message is built per job): a getter of the fields copied from
    the source, and a picker that puts those values and the differing ones (in that
    order) into the target's field order."""
    every = (
        target.__struct_fields__
        if issubclass(target, msgspec.Struct)
        else [f.name for f in fields(target)]
    )
    if unknown := set(differ) - set(every):
        raise TypeError(f"{target.__name__} has no field {sorted(unknown)}")
    copied = [name for name in every if name not in differ]
    at = {name: i for i, name in enumerate([*copied, *differ])}
    return _getter(operator.attrgetter, copied), _getter(
        operator.itemgetter, [at[n] for n in every]
    )


def _getter(make: Any, keys: list[Any]) -> Any:
    """``make(*keys)`` that always returns a tuple (the operator's getters return a
    single value, not a tuple of one, when given one key)."""
    get = make(*keys)
    return get if len(keys) > 1 else lambda source: (get(source),)


def job_message(seq: int, job: Job, *, state_lost: bool = False) -> protocol.JobHandoff:
    """The ``job`` message that hands ``job`` (claimed, so under a lease) to a worker;
    ``state_lost`` when the job's local state is not on that worker."""
    if job.handoff_id is None:
        raise ValueError(f"job {job.id} has no lease: only a claimed job is sent")
    message: protocol.JobHandoff = _by_name(
        protocol.JobHandoff,
        job,
        seq=seq,
        job_id=job.id,
        handoff_id=job.handoff_id,
        args=list(job.args),
        attempt=job.attempts + 1,
        state_lost=state_lost,
    )
    return message


def assignment(msg: protocol.JobHandoff) -> Assignment:
    """What a worker hands its runner for a ``job`` message."""
    assigned: Assignment = _by_name(Assignment, msg, args=tuple(msg.args), kwargs=dict(msg.kwargs))
    return assigned
