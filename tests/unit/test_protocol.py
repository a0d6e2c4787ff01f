from __future__ import annotations

import dataclasses
import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.exceptions import InvalidJobError, ProtocolError
from broker.jobs import ExecutionMode, JobSpec, JobStatus
from broker.wire import codec
from broker.wire import messages as p

JOB_ID = uuid.UUID("0b5e6a4e-8a0c-4f5e-9b57-0d7f2c1e9a11")
LEASE_ID = uuid.UUID("6f1c2d3e-4b5a-4c6d-8e7f-9a0b1c2d3e4f")
NOW = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)

SAMPLES: list[p.Message] = [
    p.Challenge(nonce=p.make_nonce(), protocol=p.PROTOCOL_VERSION, auth_required=True),
    p.Hello(
        role=p.Role.WORKER,
        protocol=1,
        proof="ab" * 32,
        worker_id="host-1:123",
        host="host-1",
        pid=123,
        modes=[ExecutionMode.POOLED, ExecutionMode.INLINE],
        queues=["default", "emails"],
        held_leases=[p.LeaseRef(JOB_ID, LEASE_ID)],
    ),
    p.Hello(role=p.Role.CLIENT, protocol=1),
    p.Welcome(
        main_id="main-1",
        protocol=1,
        ping_interval=5.0,
        adopted=[p.LeaseRef(JOB_ID, LEASE_ID)],
        max_line_bytes=1 << 20,
    ),
    p.Ready(slots={ExecutionMode.POOLED: 4, ExecutionMode.FORKED: 0}, seen=17),
    p.JobHandoff(
        seq=18,
        job_id=JOB_ID,
        handoff_id=LEASE_ID,
        task="send_email",
        args=["a@example.com", {"n": 1}, [None, True, 2.5]],
        kwargs={"subject": "hi"},
        execution_mode=ExecutionMode.FORKED,
        attempt=2,
        max_attempts=11,
        timeout=30.0,
        queue="emails",
    ),
    p.CompletedReport(JOB_ID, LEASE_ID, result={"sent": True, "ids": [1, 2]}),
    p.CompletedReport(JOB_ID, LEASE_ID),
    p.FailedReport(JOB_ID, LEASE_ID, error="SMTP 451", retry=False),
    p.RescheduleReport(JOB_ID, LEASE_ID, delay=12.5),
    p.ReleaseReport(JOB_ID, LEASE_ID, reason="draining"),
    p.ReportAck(JOB_ID, LEASE_ID, p.AckStatus.DUPLICATE),
    p.SaveCheckpoint(JOB_ID, LEASE_ID, seq=3, state={"row": 1200, "files": ["a", "b"]}),
    p.SaveCheckpoint(JOB_ID, LEASE_ID, seq=1),
    p.CheckpointAck(JOB_ID, LEASE_ID, 3, p.AckStatus.APPLIED),
    p.CheckpointAck(
        JOB_ID, LEASE_ID, 4, p.AckStatus.STALE, p.ErrorCode.CHECKPOINT_REJECTED, "lease gone"
    ),
    p.Progress(JOB_ID, LEASE_ID, fraction=0.5, message="row 1200 of 2400"),
    p.Progress(JOB_ID, LEASE_ID, fraction=1),
    p.Jobs(
        [
            p.JobHandoff(19, JOB_ID, LEASE_ID, "t", [], {}, ExecutionMode.POOLED, 1, 3, None, "q"),
            p.JobHandoff(20, LEASE_ID, JOB_ID, "t", [1], {}, ExecutionMode.INLINE, 1, 3, 1.5, "q"),
        ]
    ),
    p.Reports(
        [
            p.CompletedReport(JOB_ID, LEASE_ID, result=[1]),
            p.FailedReport(LEASE_ID, JOB_ID, error="boom"),
            p.ReleaseReport(JOB_ID, JOB_ID, reason="draining"),
        ]
    ),
    p.ReportAcks(
        [
            p.ReportAck(JOB_ID, LEASE_ID, p.AckStatus.APPLIED),
            p.ReportAck(LEASE_ID, JOB_ID, p.AckStatus.STALE),
        ]
    ),
    p.Draining(),
    p.Ping(nonce=7),
    p.Pong(nonce=7),
    p.Error(code=p.ErrorCode.MALFORMED, message="bad", fatal=False),
    p.Enqueue(
        request_id="r1",
        jobs=[
            p.JobRequest(task="a"),
            p.JobRequest(
                task="b",
                args=[1],
                kwargs={"k": "v"},
                queue="q",
                priority=-3,
                run_at=NOW.isoformat(),
                max_attempts=3,
                idempotency_key="once",
                concurrency_key="acct-1",
                concurrency_limit=2,
                timeout=9.5,
                execution_mode=ExecutionMode.INLINE,
                id=JOB_ID,
            ),
        ],
    ),
    p.EnqueuedReply(request_id="r1", jobs=[p.EnqueuedRef(JOB_ID, duplicate=True)]),
    p.EnqueueEach(
        request_id="r1",
        job=p.JobRequest(task="a", priority=2, delay=5.0),
        arg_sets=[(1,), (2, "x")],
        kwarg_sets=[{}, {"k": "v"}],
    ),
    p.EnqueuedEach(request_id="r1", job_ids=[JOB_ID, LEASE_ID]),
    p.GetJob(request_id="r2", job_id=JOB_ID),
    p.JobInfo(request_id="r2", job={"id": str(JOB_ID), "status": "queued"}),
    p.JobInfo(request_id="r2", job=None),
    p.WaitJob(request_id="r7", job_id=JOB_ID, timeout=30.0),
    p.WaitPending(request_id="r7"),
    p.GetWorkflow(request_id="r8", workflow_id=LEASE_ID),
    p.RetryWorkflow(request_id="r9", workflow_id=LEASE_ID),
    p.WorkflowInfo(
        request_id="r8",
        workflow=p.WorkflowView(
            workflow_id=LEASE_ID,
            status="failed",
            members=[
                p.WorkflowMember(
                    job_id=LEASE_ID, task="t", status=JobStatus.FAILED, attempts=3, error="boom"
                ),
                p.WorkflowMember(job_id=JOB_ID, task="u", status=JobStatus.CANCELLED, attempts=0),
            ],
            edges=[p.WorkflowEdge(parent=LEASE_ID, child=JOB_ID, done=True)],
        ),
    ),
    p.WorkflowInfo(request_id="r8", workflow=None),
    p.Cancel(request_id="r3", job_id=JOB_ID),
    p.RequestError(request_id="r3", code=p.ErrorCode.NOT_FOUND, message="no such job"),
    p.CancelJob(JOB_ID, LEASE_ID),
    p.WorkerStatus(status={"worker_id": "w1", "runners": {"pooled": {"capacity": 4}}}),
    p.Retry(request_id="r4", job_id=JOB_ID),
    p.Status(request_id="r5"),
    p.StatusInfo(request_id="r5", status={"main_id": "main-1", "queues": []}),
    p.ListJobs(request_id="r6"),
    p.ListJobs(
        request_id="r6",
        statuses=[JobStatus.FAILED, JobStatus.QUEUED],
        queues=["q"],
        tasks=["t"],
        limit=2,
        cursor="abc",
    ),
    p.JobList(request_id="r6", jobs=[{"id": str(JOB_ID)}], next_cursor=None),
    p.Prune(request_id="r7", older_than_seconds=86400.0, keep_latest=10),
    p.Prune(request_id="r7", keep_latest=0, statuses=[JobStatus.COMPLETED]),
    p.Pruned(request_id="r7", deleted=3),
    p.PauseQueue(request_id="r8", queue="mail"),
    p.ResumeQueue(request_id="r8", queue="mail"),
    p.LimitQueue(request_id="r8", queue="mail", rate="50/s", burst=5),
    p.LimitQueue(request_id="r8", queue="mail", rate=None),
    p.QueueInfo(request_id="r8", queue={"queue": "mail", "paused": True}),
    p.TaskCatalog(
        tasks=[
            p.TaskDeclaration(name="t"),
            p.TaskDeclaration(
                name="app.sync",
                execution_mode=ExecutionMode.FORKED,
                queue="q",
                max_attempts=1,
                timeout=2.5,
                concurrency_key="acct:{account}",
                concurrency_limit=1,
                unique=True,
                parameters=["account"],
                retry_on=["ConnectionError"],
                dont_retry_on=["app.Declined"],
                backoff="fixed 5s",
            ),
        ]
    ),
    p.ListTasks(request_id="r8"),
    p.TaskList(request_id="r8", tasks=[{"task": "t", "worker_id": "w1", "declaration": {}}]),
    p.Enqueue(request_id="r9", jobs=[p.JobRequest(task="t")], allow_unknown_tasks=True),
]


def test_samples_cover_every_message_type() -> None:
    assert {type(m).type for m in SAMPLES} == set(p.MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).type)
def test_round_trip(msg: p.Message) -> None:
    line = codec.encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert b": " not in line and b", " not in line  # compact separators
    assert json.loads(line)["type"] == type(msg).type
    assert codec.decode(line) == msg
    assert codec.decode(line.decode().rstrip("\n")) == msg  # str input, no newline


def test_decoded_fields_have_python_types() -> None:
    msg = codec.decode(codec.encode(SAMPLES[1]))
    assert isinstance(msg, p.Hello)
    assert msg.role is p.Role.WORKER
    assert msg.modes == [ExecutionMode.POOLED, ExecutionMode.INLINE]
    assert isinstance(msg.held_leases[0].job_id, uuid.UUID)
    ready = codec.decode(b'{"type":"ready","slots":{"pooled":2},"seen":0}')
    assert isinstance(ready, p.Ready)
    assert list(ready.slots) == [ExecutionMode.POOLED]
    assert type(next(iter(ready.slots))) is ExecutionMode


def test_optional_fields_default_when_absent() -> None:
    msg = codec.decode(f'{{"type":"completed","job_id":"{JOB_ID}","handoff_id":"{LEASE_ID}"}}')
    assert msg == p.CompletedReport(JOB_ID, LEASE_ID, result=None)
    failed = codec.decode(
        f'{{"type":"failed","job_id":"{JOB_ID}","handoff_id":"{LEASE_ID}","error":"x"}}'
    )
    assert isinstance(failed, p.FailedReport) and failed.retry is True


def test_int_accepted_where_float_expected() -> None:
    msg = codec.decode(
        f'{{"type":"reschedule","job_id":"{JOB_ID}","handoff_id":"{LEASE_ID}","delay":3}}'
    )
    assert isinstance(msg, p.RescheduleReport) and msg.delay == 3.0 and type(msg.delay) is float


def test_unknown_extra_fields_are_ignored() -> None:
    msg = codec.decode(b'{"type":"ping","nonce":3,"from_the_future":{"x":1}}')
    assert msg == p.Ping(nonce=3)


def _line(**fields: Any) -> str:
    return json.dumps(fields)


def _ready(**over: Any) -> str:
    return _line(**{"type": "ready", "slots": {"pooled": 1}, "seen": 0, **over})


def _completed(**over: Any) -> str:
    return _line(
        **{"type": "completed", "job_id": str(JOB_ID), "handoff_id": str(LEASE_ID), **over}
    )


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        pytest.param(b"{not json", "invalid JSON", id="invalid-json"),
        pytest.param(b"\xff\xfe", "invalid JSON", id="invalid-utf8"),
        pytest.param(b"", "invalid JSON", id="empty"),
        pytest.param(b"[" * 100_000, "invalid JSON", id="deep-nesting"),
        pytest.param(b'{"type":"ping","nonce":NaN}', "invalid JSON", id="nan"),
        pytest.param(b'{"type":"reschedule","delay":1e999}', "invalid JSON", id="inf"),
        pytest.param(b'["ping"]', "JSON object", id="array"),
        pytest.param(b"42", "JSON object", id="number"),
        pytest.param(b'{"nonce":1}', "no type", id="missing-type"),
        pytest.param(b'{"type":7}', "type must be a string", id="type-not-string"),
        pytest.param(_ready(slots={"pooled": True}), "ready.slots.pooled", id="bool-for-int"),
        pytest.param(_ready(seen=True), "ready.seen must be an integer", id="bool-seen"),
        pytest.param(_ready(seen=1.0), "ready.seen must be an integer", id="float-for-int"),
        pytest.param(_ready(seen="1"), "ready.seen must be an integer", id="str-for-int"),
        pytest.param(_ready(seen=2**70), "ready.seen must be an integer", id="int-too-big"),
        pytest.param(_ready(slots={"pooled": -1}), "must not be negative", id="negative-slots"),
        pytest.param(_ready(seen=-1), "seen must not be negative", id="negative-seen"),
        pytest.param(_ready(slots={"gpu": 1}), "ready.slots key must be one of", id="bad-mode"),
        pytest.param(_ready(slots=[1]), "ready.slots must be an object", id="list-for-dict"),
        pytest.param(_ready(slots=None), "ready.slots must be an object", id="null-not-allowed"),
        pytest.param(_completed(job_id="nope"), "completed.job_id must be a UUID", id="bad-uuid"),
        pytest.param(_completed(job_id=5), "completed.job_id must be a UUID", id="int-uuid"),
        pytest.param(_completed(handoff_id=None), "completed.handoff_id must be", id="null-id"),
        pytest.param(
            _line(type="report_ack", job_id=str(JOB_ID), handoff_id=str(LEASE_ID), status="ok"),
            "report_ack.status must be one of 'applied', 'duplicate', 'stale'",
            id="bad-enum",
        ),
        pytest.param(
            _line(type="prune", request_id="r1", older_than_seconds=1e300),
            "older_than_seconds must be from 0 to",
            id="prune-age-overflows-a-date",
        ),
        pytest.param(
            _line(type="hello", role="admin", protocol=1), "hello.role must be one of", id="role"
        ),
        pytest.param(
            _line(type="hello", role="client", protocol=1, pid="12"),
            "hello.pid must be an integer or null",
            id="optional-wrong-type",
        ),
        pytest.param(
            _line(type="hello", role="client", protocol=1, modes=["pooled", "gpu"]),
            "hello.modes[1] must be one of",
            id="bad-list-item",
        ),
        pytest.param(
            _line(type="hello", role="client", protocol=1, held_leases=[{"job_id": str(JOB_ID)}]),
            "hello.held_leases[0].handoff_id is required",
            id="nested-missing",
        ),
        pytest.param(_line(type="ping"), "ping.nonce is required", id="missing-field"),
        pytest.param(_line(type="error", code="x", message="y"), "error.fatal is required", id="m"),
        pytest.param(_line(type="error", code="x", message="y", fatal=1), "error.fatal", id="b"),
        pytest.param(
            _line(type="challenge", nonce="xyz", protocol=1, auth_required=True),
            "nonce must be a non-empty hex string",
            id="nonce-not-hex",
        ),
        pytest.param(
            _line(type="enqueue", request_id="r", jobs=[{"args": []}]),
            "enqueue.jobs[0].task is required",
            id="job-request-missing-task",
        ),
        pytest.param(
            _line(type="job_info", request_id="r", job=[]),
            "job_info.job must be an object or null",
            id="job-info-list",
        ),
    ],
)
def test_rejects(line: bytes | str, fragment: str) -> None:
    with pytest.raises(codec.DecodeError, match=re.escape(fragment)) as info:
        codec.decode(line)
    assert isinstance(info.value, ProtocolError)
    assert info.value.code == p.ErrorCode.MALFORMED


def test_unknown_type_has_its_own_code() -> None:
    with pytest.raises(codec.UnknownTypeError, match="unknown message type 'launch'") as info:
        codec.decode(b'{"type":"launch"}')
    assert info.value.code == p.ErrorCode.UNKNOWN_TYPE
    assert info.value.msg_type == "launch"


def test_worker_hello_needs_worker_id() -> None:
    with pytest.raises(codec.DecodeError, match="worker_id is required"):
        codec.decode(_line(type="hello", role="worker", protocol=1))
    with pytest.raises(codec.DecodeError, match="worker_id is required"):
        codec.decode(_line(type="hello", role="worker", protocol=1, worker_id=""))
    with pytest.raises(ValueError, match="worker_id is required"):
        p.Hello(role=p.Role.WORKER, protocol=1)


def test_error_carries_request_id_so_the_main_can_answer_the_request() -> None:
    with pytest.raises(codec.DecodeError) as info:
        codec.decode(_line(type="enqueue", request_id="r9", jobs=[{"task": 1}]))
    assert info.value.request_id == "r9"
    assert info.value.msg_type == "enqueue"
    assert "enqueue.jobs[0].task must be a string" in str(info.value)


def test_error_does_not_echo_large_values() -> None:
    with pytest.raises(codec.DecodeError) as info:
        codec.decode(_ready(seen="x" * 10_000))
    assert len(str(info.value)) < 200


def test_encode_rejects_non_json_payload() -> None:
    with pytest.raises(ValueError, match="cannot encode completed"):
        codec.encode(p.CompletedReport(JOB_ID, LEASE_ID, result=float("nan")))
    with pytest.raises(ValueError, match="cannot encode completed"):
        codec.encode(p.CompletedReport(JOB_ID, LEASE_ID, result={1, 2}))


def test_encode_is_ascii_even_for_lone_surrogates() -> None:
    msg = codec.decode(
        b'{"type":"release","job_id":"%s","handoff_id":"%s","reason":"\\ud800 \xc3\xa9"}'
        % (str(JOB_ID).encode(), str(LEASE_ID).encode())
    )
    assert isinstance(msg, p.ReleaseReport) and msg.reason == "\ud800 é"
    assert codec.decode(codec.encode(msg)) == msg


# --------------------------------------------------------------------------- proofs


def test_proof_helpers() -> None:
    nonce = p.make_nonce()
    assert len(nonce) == 32 and nonce != p.make_nonce()
    proof = p.make_proof("s3cret", nonce)
    assert p.check_proof("s3cret", nonce, proof)
    assert not p.check_proof("wrong", nonce, proof)
    assert not p.check_proof("s3cret", p.make_nonce(), proof)
    assert not p.check_proof("s3cret", nonce, None)
    assert not p.check_proof("s3cret", nonce, "")
    assert not p.check_proof("s3cret", nonce, "\ud800é")


# --------------------------------------------------------------------------- job requests


def test_job_request_to_spec_with_delay() -> None:
    spec = p.JobRequest(task="t", delay=30).to_spec(NOW)
    assert spec.run_at == NOW + timedelta(seconds=30)
    assert spec.max_attempts == JobSpec(task="t").max_attempts


def test_job_request_to_spec_with_run_at() -> None:
    spec = p.JobRequest(task="t", run_at="2024-06-01T00:00:00Z").to_spec(NOW)
    assert spec.run_at == datetime(2024, 6, 1, tzinfo=UTC)


def test_a_field_left_out_takes_the_tasks_default_then_the_specs() -> None:
    """A request's ``None`` takes the task's default when one is given, else the spec's
    own (a fresh id, empty kwargs); a field the request says wins over both."""
    bare = p.JobRequest(task="t").to_spec(NOW)
    assert bare == dataclasses.replace(JobSpec("t"), id=bare.id)
    assert p.JobRequest(task="t").to_spec(NOW).id != bare.id
    defaults = {"queue": "tq", "priority": 3, "timeout": None, "max_attempts": 7}
    said = p.JobRequest(task="t", priority=9, kwargs={"k": 1}).to_spec(NOW, defaults)
    expected = JobSpec("t", kwargs={"k": 1}, queue="tq", priority=9, max_attempts=7)
    assert said == dataclasses.replace(expected, id=said.id)


_TASK_DEFAULT_VALUES = {
    "queue": "tq",
    "priority": 3,
    "max_attempts": 7,
    "timeout": 2.5,
    "execution_mode": ExecutionMode.INLINE,
    "concurrency_key": "ck",
    "concurrency_limit": 2,
    "unique_key": "uk",
    "rate_key": "rk",
}


@settings(max_examples=200, deadline=None)
@given(
    said=st.sets(st.sampled_from(sorted(_TASK_DEFAULT_VALUES))),
    declared=st.sets(st.sampled_from(sorted(_TASK_DEFAULT_VALUES))),
    nulls=st.sets(st.sampled_from(sorted(_TASK_DEFAULT_VALUES))),
)
def test_each_field_left_out_takes_the_tasks_default_else_the_specs(
    said: set[str], declared: set[str], nulls: set[str]
) -> None:
    """Field by field: what the request says wins, else the task's default when it is
    not None, else the spec's own."""
    said_values = {"queue": "rq", "priority": -1, "max_attempts": 2, "timeout": 9.0}
    said_values |= {"execution_mode": ExecutionMode.FORKED, "unique_key": "ru", "rate_key": "rr"}
    said_values |= {"concurrency_key": "rc", "concurrency_limit": 5}
    pair = {"concurrency_key", "concurrency_limit"}  # said or declared together, or neither
    said = said - pair if len(said & pair) == 1 else said
    defaults = {n: None if n in nulls else _TASK_DEFAULT_VALUES[n] for n in declared}
    half = (defaults.get("concurrency_key") is None) != (defaults.get("concurrency_limit") is None)
    if said & pair or half:
        defaults = {n: v for n, v in defaults.items() if n not in pair}
    request = p.JobRequest(task="t", **{n: said_values[n] for n in said})
    spec = request.to_spec(NOW, defaults)
    plain = JobSpec("t")
    for name in _TASK_DEFAULT_VALUES:
        if name in said:
            expected = said_values[name]
        elif defaults.get(name) is not None:
            expected = defaults[name]
        else:
            expected = getattr(plain, name)
        assert getattr(spec, name) == expected, name


@pytest.mark.parametrize(
    ("request_", "fragment"),
    [
        (p.JobRequest(task=""), "task"),
        (p.JobRequest(task="t", run_at="tomorrow"), "ISO-8601"),
        (p.JobRequest(task="t", run_at="2024-06-01T00:00:00"), "timezone-aware"),
        (p.JobRequest(task="t", run_at=NOW.isoformat(), delay=1), "not both"),
        (p.JobRequest(task="t", delay=-1), "delay"),
        (p.JobRequest(task="t", max_attempts=0), "max_attempts"),
        (p.JobRequest(task="t", concurrency_key="k"), "go together"),
        (p.JobRequest(task="t", priority=2**40), "32 bits"),
    ],
)
def test_job_request_invalid(request_: p.JobRequest, fragment: str) -> None:
    with pytest.raises(InvalidJobError, match=fragment):
        request_.to_spec(NOW)


def test_job_request_from_spec_round_trips() -> None:
    spec = JobSpec(
        task="t",
        args=(1, "two"),
        kwargs={"k": [3]},
        queue="q",
        priority=5,
        run_at=NOW,
        max_attempts=4,
        idempotency_key="i",
        concurrency_key="c",
        concurrency_limit=1,
        timeout=2.5,
        execution_mode=ExecutionMode.FORKED,
        unique_key="u",
        max_recoveries=2,
        local_state=True,
    )
    wire = codec.decode(codec.encode(p.Enqueue("r", [p.JobRequest.from_spec(spec)])))
    assert isinstance(wire, p.Enqueue)
    assert wire.jobs[0].to_spec(NOW + timedelta(days=1)) == spec


# --------------------------------------------------------------------------- the spec


def test_every_example_in_the_spec_decodes() -> None:
    """docs/protocol.md shows an example line per message; they must stay valid."""
    spec = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
    lines = [ln for ln in spec.read_text().splitlines() if ln.startswith('{"type":')]
    seen = {type(codec.decode(ln)).type for ln in lines}
    assert seen == set(p.MESSAGE_TYPES)


def test_a_job_request_leaves_its_defaults_off_the_line() -> None:
    """Only what differs from the defaults is sent (a bulk enqueue's line is half as long),
    and the line reads back as the same request."""
    request = p.JobRequest(task="t", args=[1], priority=0)
    encoded = codec._ENCODER.encode(request)
    assert encoded == b'{"task":"t","args":[1],"priority":0}'
    message = p.Enqueue(request_id="r1", jobs=[request])
    assert codec.decode(codec.encode(message)) == message
