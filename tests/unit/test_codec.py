"""Each boundary's field mapping (broker/core/jobfields.py, Job.from_spec/to_dict, JobRequest,
Schedule.spec) carries every field, so adding a field is a change in one place."""

from __future__ import annotations

import uuid
from dataclasses import MISSING, FrozenInstanceError, fields, replace
from datetime import UTC, datetime, timedelta

import pytest

from broker import settlement
from broker.core import jobfields as codec
from broker.exceptions import InvalidJobError
from broker.jobs import DEPENDENCY_FIELDS, Claim, ExecutionMode, Job, JobSpec, spec_from
from broker.tasks.runner import Assignment
from broker.tasks.schedule import Schedule
from broker.wire import messages as protocol

NOW = datetime(2030, 1, 1, tzinfo=UTC)

SPEC = JobSpec(
    "tasks.add",
    args=(1, [2]),
    kwargs={"x": {"y": None}},
    queue="q",
    priority=3,
    run_at=NOW + timedelta(seconds=5),
    max_attempts=4,
    idempotency_key="idem",
    concurrency_key="ck",
    concurrency_limit=2,
    timeout=1.5,
    execution_mode=ExecutionMode.FORKED,
    unique_key="uk",
)


def claimed() -> Job:
    job = Job.from_spec(SPEC, NOW)
    job = settlement.apply(job, settlement.hand_off(Claim(SPEC.id, uuid.uuid4(), "w"), NOW))
    return replace(job, attempts=2)


def test_job_from_spec_copies_every_spec_field() -> None:
    """Every field but the dependency ones, which a store keeps beside the job."""
    job = Job.from_spec(SPEC, NOW)
    for name in JobSpec.__dataclass_fields__:
        if name in DEPENDENCY_FIELDS:
            assert not hasattr(job, name), name
            continue
        assert getattr(job, name) == getattr(SPEC, name), name
    assert (job.attempts, job.created_at, job.updated_at) == (0, NOW, NOW)
    assert Job.from_spec(JobSpec("t"), NOW).run_at == NOW


def test_job_request_round_trips_a_spec() -> None:
    request = protocol.JobRequest.from_spec(SPEC)
    assert request.to_spec(NOW) == SPEC
    # A bare request takes the spec's defaults (a fresh id among them).
    bare = protocol.JobRequest(task="t").to_spec(NOW)
    assert bare.max_attempts == JobSpec("t").max_attempts and bare.run_at is None
    assert protocol.JobRequest(task="t", delay=2).to_spec(NOW).run_at == NOW + timedelta(seconds=2)


def test_to_dict_shows_every_field_but_the_lease() -> None:
    job = claimed()
    shown = job.to_dict()
    assert set(shown) == set(Job.__dataclass_fields__) - {"handoff_id"}
    assert shown["id"] == str(job.id) and shown["args"] == [1, [2]]
    assert shown["status"] == "handed_off" and shown["execution_mode"] == "forked"
    assert shown["run_at"] == job.run_at.isoformat() and shown["handed_off_at"] == NOW.isoformat()


def test_a_job_message_carries_every_field_under_its_lease() -> None:
    job = claimed()
    msg = codec.job_message(7, job)
    assert (msg.seq, msg.job_id, msg.handoff_id, msg.attempt) == (7, job.id, job.handoff_id, 3)
    assert (msg.task, msg.args, msg.kwargs, msg.queue) == ("tasks.add", [1, [2]], job.kwargs, "q")
    assert (msg.execution_mode, msg.max_attempts, msg.timeout) == (ExecutionMode.FORKED, 4, 1.5)


def test_an_assignment_carries_every_field() -> None:
    msg = codec.job_message(1, claimed())
    a = codec.assignment(msg)
    for f in fields(Assignment):  # every field by name, as Worker._start copies them
        want = getattr(msg, f.name)
        assert getattr(a, f.name) == (tuple(want) if f.name == "args" else want), f.name


def test_a_schedule_s_tick_carries_every_job_option() -> None:
    schedule = Schedule(
        name="s",
        task="app.job",
        every=timedelta(minutes=1),
        args=[1],
        kwargs={"k": 2},
        queue="q",
        priority=4,
        max_attempts=2,
        timeout=3.0,
        execution_mode=ExecutionMode.INLINE,
        concurrency_key="ck",
        concurrency_limit=1,
    )
    tick = NOW + timedelta(minutes=3)
    spec = schedule.spec(tick)
    assert (spec.task, list(spec.args), dict(spec.kwargs)) == ("app.job", [1], {"k": 2})
    assert (spec.queue, spec.priority, spec.max_attempts, spec.timeout) == ("q", 4, 2, 3.0)
    assert spec.execution_mode is ExecutionMode.INLINE
    assert (spec.concurrency_key, spec.concurrency_limit) == ("ck", 1)
    assert (spec.run_at, spec.idempotency_key) == (tick, schedule.key(tick))
    assert spec_from(schedule, run_at=tick).unique_key is None, "a field it lacks: default"


def test_a_job_is_built_as_its_dataclass_says() -> None:
    """Job's own ``__init__`` (it fills the slots directly, see ``jobs._slot_init``) takes
    every field by position or name, applies the declared defaults, refuses a missing
    field or an unknown one, and the job stays frozen."""
    job = claimed()
    assert Job(*[getattr(job, f.name) for f in fields(Job)]) == job
    assert Job(**{f.name: getattr(job, f.name) for f in fields(Job)}) == job
    required = {f.name: getattr(job, f.name) for f in fields(Job) if f.default is MISSING}
    defaults = {f.name: f.default for f in fields(Job) if f.default is not MISSING}
    assert Job(**required) == replace(job, **defaults)
    with pytest.raises(TypeError):
        Job(**{k: v for k, v in required.items() if k != "task"})
    with pytest.raises(TypeError):
        Job(**required, nope=1)  # type: ignore[call-arg]
    with pytest.raises(FrozenInstanceError):
        job.status = job.status  # type: ignore[misc]


def test_a_job_spec_is_built_as_its_dataclass_says() -> None:
    """JobSpec's own ``__init__`` (``jobs._slot_init``) runs its checks, calls a default
    factory per spec (a fresh id, a kwargs dict of its own) and keeps what is given."""
    spec = JobSpec(task="t", args=[1], run_at=datetime(2030, 1, 1, tzinfo=UTC))
    assert JobSpec(*[getattr(spec, f.name) for f in fields(JobSpec)]) == spec
    assert spec.args == (1,)
    a, b = JobSpec(task="t"), JobSpec(task="t")
    assert a.id != b.id and a.kwargs is not b.kwargs
    with pytest.raises(InvalidJobError):
        JobSpec(task=" ")
    with pytest.raises(TypeError):
        JobSpec()  # type: ignore[call-arg]
    with pytest.raises(FrozenInstanceError):
        spec.task = "u"  # type: ignore[misc]


def test_a_mapping_refuses_a_field_its_target_lacks() -> None:
    """A differing value under a name the target does not have is a mistake in the
    mapping, not something to drop quietly."""
    with pytest.raises(TypeError, match="nope"):
        codec._by_name(protocol.JobHandoff, claimed(), nope=1)
