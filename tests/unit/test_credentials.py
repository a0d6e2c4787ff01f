"""The rules of per-role credentials: which secret each role takes, who a hello lets in,
what a connection may ask, and how a token file reads."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from adapters.memory import MemoryAdapter
from broker.core.flow import FlowControl
from broker.exceptions import ConfigurationError
from broker.jobs import utcnow
from broker.main.operations import Operations
from broker.main.queues import QueueControl
from broker.main.requests import Requests
from broker.main.settings import MainSettings
from broker.main.waits import Waits
from broker.wire import messages as protocol
from broker.wire.credentials import REQUESTS, Credentials, parse_token_file, role_needed
from broker.wire.messages import Role

NONCE = "9f2c4b1a7d3e8f60a1b2c3d4e5f60718"


def _proof(secret: str) -> str:
    return protocol.make_proof(secret, NONCE)


def test_a_role_takes_its_own_secret_then_the_file_then_the_shared_one() -> None:
    creds = Credentials.combine(
        shared="shared",
        operator="op-flag",
        file={"operator": "op-file", "client": "client-file", "all": "file-all"},
    )
    assert creds == Credentials(worker="shared", client="client-file", operator="op-flag")
    only_file = Credentials.combine(file={"all": "file-all", "worker": "w"})
    assert only_file == Credentials(worker="w", client="file-all", operator="file-all")
    assert not Credentials.combine().required


def test_each_role_proves_its_own_secret_and_no_other() -> None:
    creds = Credentials(worker="w-secret", client="c-secret", operator="o-secret")
    assert creds.refusal(Role.WORKER, NONCE, _proof("w-secret")) is None
    assert creds.refusal(Role.CLIENT, NONCE, _proof("c-secret")) is None
    assert creds.refusal(Role.OPERATOR, NONCE, _proof("o-secret")) is None
    # A client's secret cannot say hello as a worker, nor a worker's as an operator.
    assert creds.refusal(Role.WORKER, NONCE, _proof("c-secret")) is not None
    assert creds.refusal(Role.OPERATOR, NONCE, _proof("w-secret")) is not None
    assert creds.refusal(Role.CLIENT, NONCE, None) == (
        "wrong or missing token proof for the client role"
    )


def test_a_role_without_a_secret_is_closed_once_any_role_has_one() -> None:
    creds = Credentials(worker="w-secret", client="c-secret")
    refusal = creds.refusal(Role.OPERATOR, NONCE, None)
    assert refusal is not None and "accepts no operator connections" in refusal
    assert Credentials().refusal(Role.OPERATOR, NONCE, None) is None, "no secrets: open"


def test_rights_follow_the_role_and_a_shared_token_keeps_every_right() -> None:
    split = Credentials(worker="w", client="c", operator="o")
    assert split.rights(Role.WORKER, NONCE, _proof("w")) == {Role.WORKER}
    assert split.rights(Role.CLIENT, NONCE, _proof("c")) == {Role.CLIENT}
    assert split.rights(Role.OPERATOR, NONCE, _proof("o")) == {Role.CLIENT, Role.OPERATOR}
    shared = Credentials.combine(shared="s")
    assert shared.rights(Role.CLIENT, NONCE, _proof("s")) == {Role.CLIENT, Role.OPERATOR}
    assert shared.rights(Role.WORKER, NONCE, _proof("s")) == {Role.WORKER}
    assert Credentials().rights(Role.CLIENT, NONCE, None) == {Role.CLIENT, Role.OPERATOR}


def test_requests_need_the_client_or_the_operator_role() -> None:
    job = uuid.uuid4()
    assert role_needed(protocol.Enqueue(request_id="r", jobs=[])) is Role.CLIENT
    each = protocol.EnqueueEach(request_id="r", job=protocol.JobRequest(task="t"), arg_sets=[])
    assert role_needed(each) is Role.CLIENT
    assert role_needed(protocol.GetJob(request_id="r", job_id=job)) is Role.CLIENT
    assert role_needed(protocol.Status(request_id="r")) is Role.CLIENT
    assert role_needed(protocol.Cancel(request_id="r", job_id=job)) is Role.OPERATOR
    assert role_needed(protocol.Retry(request_id="r", job_id=job)) is Role.OPERATOR
    assert role_needed(protocol.PauseQueue(request_id="r", queue="q")) is Role.OPERATOR
    assert role_needed(protocol.LimitQueue(request_id="r", queue="q", rate=None)) is Role.OPERATOR
    assert role_needed(protocol.Ping(nonce="n")) is None


async def test_every_request_of_the_one_list_is_answered_by_the_main() -> None:
    """``REQUESTS`` is the one list of client requests: the main routes each to its
    request service, which answers every one of them (none is "not a client request")."""
    job = uuid.uuid4()
    examples: list[protocol.Message] = [
        protocol.Enqueue(request_id="r", jobs=[]),
        protocol.EnqueueEach(request_id="r", job=protocol.JobRequest(task="t"), arg_sets=[]),
        protocol.GetJob(request_id="r", job_id=job),
        protocol.ListJobs(request_id="r"),
        protocol.ListTasks(request_id="r"),
        protocol.Status(request_id="r"),
        protocol.Cancel(request_id="r", job_id=job),
        protocol.Retry(request_id="r", job_id=job),
        protocol.Prune(request_id="r", keep_latest=1),
        protocol.PauseQueue(request_id="r", queue="q"),
        protocol.ResumeQueue(request_id="r", queue="q"),
        protocol.LimitQueue(request_id="r", queue="q", rate="5/s"),
        protocol.WaitJob(request_id="r", job_id=job),
        protocol.GetWorkflow(request_id="r", workflow_id=job),
        protocol.RetryWorkflow(request_id="r", workflow_id=job),
    ]
    assert {type(msg) for msg in examples} == set(REQUESTS)

    async def status() -> dict[str, Any]:
        return {}

    store = MemoryAdapter()
    requests = Requests(
        Operations(store, MainSettings(), clock=utcnow),
        max_in_progress=1,
        wake=lambda: None,
        stop_cancelled=lambda _job: None,
        status=status,
        live_workers=set,
        queues=QueueControl(store, FlowControl(), wake=lambda: None),
        waits=Waits(MemoryAdapter().get_job, lambda _peer: None, per_connection=1),
    )
    for msg in examples:
        if isinstance(msg, protocol.WaitJob):
            continue  # answered on its connection, when the job ends (test_waiters.py)
        reply = await requests.answer(msg)
        assert getattr(reply, "request_id", None) == "r", msg


def test_a_token_file_reads_role_lines_and_refuses_bad_ones_without_echoing_them() -> None:
    text = "# secrets\n\nworker = w1\nclient=c1\nOPERATOR=o=1\nall=s\n"
    assert parse_token_file(text, "f") == {
        "worker": "w1",
        "client": "c1",
        "operator": "o=1",
        "all": "s",
    }
    for bad, problem in [
        ("admin=topsecret\n", "line 1: expected role=secret"),
        ("topsecret\n", "line 1: expected role=secret"),
        ("worker=\n", "the worker secret is empty"),
        ("worker=a\nworker=b\n", "line 2: a second worker secret"),
        ("# nothing\n", "holds no secret"),
    ]:
        with pytest.raises(ConfigurationError, match=problem) as caught:
            parse_token_file(bad, "f")
        assert "topsecret" not in str(caught.value)
