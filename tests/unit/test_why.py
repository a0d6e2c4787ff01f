"""Why a job waits (:func:`broker.core.why.wait_reason`): each reason the dispatching main
knows, in the order the dispatcher checks them, and none for a job that is about to go,
not due yet or not queued."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import msgspec

from broker.core.handoff import Handoff
from broker.core.why import wait_reason
from broker.jobs import ExecutionMode, JobStatus
from broker.model.rates import parse_rate
from broker.storage import QueueSettings
from tests.unit.test_handoff import EPOCH, make_job, worker_hello

POOLED = ExecutionMode.POOLED
FORKED = ExecutionMode.FORKED


def _core(*tasks: str, slots: int = 2) -> Handoff:
    core = Handoff(max_credit=10)
    peer = core.new_peer(1, 0.0)
    core.hello(peer, worker_hello("w1"))
    core.declared(1, tasks)
    core.ready(1, {POOLED: slots}, 0)
    return core


def test_each_reason_the_main_knows_and_none_when_the_job_may_go() -> None:
    job = make_job(1)  # task "t", queue "a", due at EPOCH
    core = _core("t")
    assert wait_reason(job, core, 0.0, EPOCH) is None, "it goes at the next pass"
    later = replace(job, run_at=EPOCH + timedelta(seconds=5))
    assert wait_reason(later, core, 0.0, EPOCH) is None, "not due yet: its run_at says so"
    running = replace(job, status=JobStatus.HANDED_OFF)
    assert wait_reason(running, core, 0.0, EPOCH) is None
    waiting = replace(job, status=JobStatus.WAITING)
    assert "parent jobs" in (wait_reason(waiting, core, 0.0, EPOCH) or "")

    core.flow.apply(QueueSettings("a", paused=True))
    assert wait_reason(job, core, 0.0, EPOCH) == "queue 'a' is paused (`broker queue resume a`)"
    core.flow.apply(QueueSettings("a", rate=parse_rate("10/s")))
    core.flow.admitted("a", 0.0)
    assert wait_reason(job, core, 0.05, EPOCH) == (
        "waiting for the rate limit of queue 'a' (10/s): the next token in 0.05 s"
    )
    assert wait_reason(job, core, 0.1, EPOCH) is None, "a token is due now: nothing to say"


def test_a_task_or_key_token_names_its_limit_and_the_time() -> None:
    core = _core("t")
    core.flow.limit_tasks({"t": parse_rate("2/s")})
    job = make_job(1)
    core.flow.admitted("a", 0.0, "t")
    assert wait_reason(job, core, 0.25, EPOCH) == (
        "waiting for the rate limit of task 't' (2/s): the next token in 0.25 s"
    )
    core.flow.limit_tasks({"t": parse_rate("2/s")}, keyed=["t"])
    acme = replace(job, rate_key="acme")
    core.flow.admitted("a", 0.0, "t", "acme")
    assert wait_reason(acme, core, 0.1, EPOCH) == (
        "waiting for the rate limit of key 'acme' of task 't' (2/s): the next token in 0.4 s"
    )
    assert wait_reason(replace(job, rate_key="globex"), core, 0.1, EPOCH) is None


def test_workers_holders_and_slots() -> None:
    job = make_job(1)
    assert wait_reason(job, Handoff(), 0.0, EPOCH) == "no connected worker declares task 't'"
    assert wait_reason(job, _core("other"), 0.0, EPOCH) == "no connected worker declares task 't'"
    busy = _core("t", slots=0)
    assert wait_reason(job, busy, 0.0, EPOCH) == "no connected worker has a free pooled slot"
    forked_only = Handoff(max_credit=10)
    peer = forked_only.new_peer(1, 0.0)
    forked_only.hello(peer, msgspec.structs.replace(worker_hello("w1"), modes=[FORKED]))
    forked_only.declared(1, ["t"])
    forked_only.ready(1, {FORKED: 1}, 0)
    assert wait_reason(job, forked_only, 0.0, EPOCH) == "no connected worker runs pooled jobs"
    forked_job = replace(job, execution_mode=FORKED)
    assert wait_reason(forked_job, forked_only, 0.0, EPOCH) is None
    core = _core("t")
    core.awaiting[job.id] = "w9"
    assert wait_reason(job, core, 0.0, EPOCH) == (
        "waiting for worker 'w9', which holds its local state (affinity)"
    )
