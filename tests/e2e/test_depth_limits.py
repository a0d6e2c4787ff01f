"""Nesting depth: arguments and results deeper than the limit (64 by default) are refused
with a clear error at enqueue and at report time, and a value nested far too deeply for
Python's ``json`` (about 1,000 levels) never crashes the main, a worker or a child.

The finding: a job whose result nested ~978 levels deep crashed ``broker-worker`` with
``RecursionError`` in ``send_many``; the job was handed out again and crashed the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.exceptions import ConfigurationError, InvalidJobError
from broker.jobs import ExecutionMode, JobSpec, JobStatus
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.ops import cli
from broker.payload import (
    DEFAULT_MAX_PAYLOAD_DEPTH,
    check_args,
    nesting_depth,
    result_problem,
)
from broker.tasks.registry import TaskRegistry, default_unique_key, task
from broker.tasks.runner import Assignment, Completed, Failed, RunOutcome
from broker.wire import codec
from broker.wire import messages as protocol
from broker.worker.worker import Worker
from runners.forked import ForkedRunner
from runners.inline import InlineRunner
from runners.pooled import PooledRunner
from tests import support
from tests.e2e.test_e2e import Cluster, sqlite_url
from tests.support import FakeWorker, until

APP = "tests.e2e_app"
NEST = f"{APP}.nest"
FAST = replace(
    support.FAST,
    liveness_timeout=2.0,
    orphan_grace=MainSettings().orphan_grace,
    handshake_timeout=MainSettings().handshake_timeout,
)


def nested(levels: int, leaf: Any = 0) -> Any:
    """``leaf`` inside ``levels`` lists: ``nested(2)`` is ``[[0]]``, nesting 2 deep."""
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def _main(
    store: Any, settings: MainSettings = FAST
) -> contextlib.AbstractAsyncContextManager[Main]:
    return support.running_main(store, settings)


async def _terminal(store: Any, job_id: uuid.UUID) -> Any:
    job = await store.get_job(job_id)
    return job if job is not None and job.status.is_terminal else None


# ------------------------------------------------------------------ measuring


def test_depth_is_measured_without_recursion_and_stops_past_the_limit() -> None:
    assert nesting_depth(7, 64) == 0
    assert nesting_depth([], 64) == 1
    assert nesting_depth({"a": [1, {"b": ()}]}, 64) == 4
    assert nesting_depth(nested(64), 64) == 64
    # Far beyond the recursion limit, and it stops counting just past the limit.
    assert nesting_depth(nested(100_000), 64) == 65
    looped: list[Any] = []
    looped.append(looped)
    assert nesting_depth(looped, 64) == 65, "a value containing itself is over any limit"


def test_check_args_and_result_problem_check_depth_before_size() -> None:
    check_args(JobSpec(task="t", args=[nested(64)]), None)
    with pytest.raises(InvalidJobError, match="more than 64 levels deep"):
        check_args(JobSpec(task="t", kwargs={"k": nested(65)}), None)
    with pytest.raises(InvalidJobError, match="more than 3 levels deep"):
        check_args(JobSpec(task="t", args=[nested(4)]), 1 << 20, max_depth=3)
    deep = nested(100_000)  # measuring its size first would raise RecursionError
    problem = result_problem(deep, 1 << 20, DEFAULT_MAX_PAYLOAD_DEPTH)
    assert problem is not None and "more than 64 levels deep" in problem
    assert result_problem(nested(64), 1 << 20, DEFAULT_MAX_PAYLOAD_DEPTH) is None


def test_the_depth_limit_is_a_setting_with_a_flag_and_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert MainSettings().max_payload_depth == DEFAULT_MAX_PAYLOAD_DEPTH == 64
    for bad in (0, 501):
        with pytest.raises(ConfigurationError, match="max_payload_depth"):
            MainSettings(max_payload_depth=bad).validate()
    assert cli.main_parser().parse_args([]).max_payload_depth == 64
    assert cli.main_parser().parse_args(["--max-payload-depth", "10"]).max_payload_depth == 10
    monkeypatch.setenv("BROKER_MAX_PAYLOAD_DEPTH", "32")
    assert cli.main_parser().parse_args([]).max_payload_depth == 32


# ------------------------------------------------------------------ the wire


def test_decoding_a_line_nested_100000_deep_is_a_decode_error() -> None:
    line = b'{"type":"completed","result":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(codec.DecodeError, match="nests too deeply"):
        codec.decode(line)


def test_encoding_a_message_nested_too_deeply_is_a_value_error() -> None:
    report = protocol.CompletedReport(uuid.uuid4(), uuid.uuid4(), result=nested(100_000))
    with pytest.raises(ValueError, match="nests too deeply"):
        codec.encode(report)


def test_a_job_spec_nested_too_deeply_to_encode_is_an_invalid_job() -> None:
    with pytest.raises(InvalidJobError, match="too deeply"):
        JobSpec(task="t", args=[nested(100_000)])


# ------------------------------------------------------------------ (a) enqueue


async def test_enqueue_refuses_arguments_nested_deeper_than_the_limit() -> None:
    store = MemoryAdapter()
    async with _main(store) as main, Client("127.0.0.1", main.port) as client:
        with pytest.raises(InvalidJobError, match="too deeply"):
            await client.enqueue("t", [nested(1000)])
        assert not (await client.enqueue("t", [nested(64)])).duplicate
        too_deep = JobSpec(task="t", args=[nested(65)])
        with pytest.raises(InvalidJobError) as raised:
            await client.enqueue_many([JobSpec(task="t"), too_deep])
        assert str(too_deep.id) in str(raised.value)
        assert "more than 64 levels deep" in str(raised.value)
        with pytest.raises(InvalidJobError, match="more than 64 levels deep"):
            await client.enqueue("t", kwargs={"k": nested(65)})
        # The connection still serves, and only the 64-deep job was stored.
        assert len((await store.list_jobs()).jobs) == 1


async def test_the_limit_is_configurable_and_told_to_workers_in_welcome() -> None:
    settings = MainSettings(**{**FAST.__dict__, "max_payload_depth": 100})
    async with _main(MemoryAdapter(), settings) as main:
        async with Client("127.0.0.1", main.port) as client:
            await client.enqueue("t", [nested(100)])
            with pytest.raises(InvalidJobError, match="more than 100 levels deep"):
                await client.enqueue("t", [nested(101)])
        worker = FakeWorker(main.port)
        welcome = await worker.connect()
        assert welcome.max_payload_depth == 100
        assert welcome.max_payload_bytes == settings.max_payload_bytes
        await worker.close()


async def test_enqueue_in_transaction_refuses_arguments_nested_too_deeply(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    store = SQLAlchemyAdapter(url)
    await store.setup()
    app = create_async_engine(url)
    try:
        with pytest.raises(InvalidJobError, match="more than 64 levels deep"):
            async with app.begin() as conn:
                await store.enqueue_in_transaction(conn, [JobSpec(task="t", args=[nested(65)])])
        assert (await store.list_jobs()).jobs == []
    finally:
        await app.dispose()
        await store.close()


async def test_the_operator_cli_refuses_arguments_nested_too_deeply() -> None:
    async with _main(MemoryAdapter()) as main:
        main_opt = ["--main", f"127.0.0.1:{main.port}"]
        for args_json in ("[" * 100_000 + "]" * 100_000, json.dumps([nested(65)])):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    code = await asyncio.to_thread(
                        cli.broker_entry, [*main_opt, "enqueue", "t", args_json]
                    )
                except SystemExit as exit_:  # JSON too deep to decode: a usage error
                    code = int(exit_.code or 0)
            assert code != 0 and "deep" in err.getvalue(), err.getvalue()


def test_a_unique_key_of_arguments_nested_too_deeply_is_an_invalid_job() -> None:
    with pytest.raises(InvalidJobError, match="too deeply"):
        default_unique_key("t", [nested(100_000)], {})


# ------------------------------------------------------------------ results


async def test_the_main_fails_a_job_whose_reported_result_is_too_deep() -> None:
    store = MemoryAdapter()
    async with _main(store) as main:
        worker = FakeWorker(main.port)
        await worker.connect()
        [made] = await store.enqueue_many([JobSpec(task="t", max_attempts=5)])
        await worker.ready(pooled=1)
        sent = await worker.next_job()
        ack = await worker.report(
            protocol.CompletedReport(sent.job_id, sent.handoff_id, nested(200))
        )
        assert ack.status is protocol.AckStatus.APPLIED
        job = await store.get_job(made.job.id)
        assert job is not None and job.status is JobStatus.FAILED, "dead at once, no retry"
        assert job.result is None and job.attempts == 1
        assert "more than 64 levels deep" in (job.last_error or "")
        await worker.close()


class _DeepResults(InlineRunner):
    """Completes the ``deep`` task with a result nested 1,000 levels deep, as a runner
    without the inline runner's own ceiling might: what reaches the worker's send loop."""

    def run(self, assignment: Assignment) -> asyncio.Future[RunOutcome]:
        outcome = super().run(assignment)
        if assignment.task != "deep":
            return outcome
        deep: asyncio.Future[RunOutcome] = outcome.get_loop().create_future()
        outcome.add_done_callback(lambda _: deep.set_result(Completed(nested(1000))))
        return deep


async def _run_on_a_worker(
    settings: MainSettings, runner: InlineRunner, registry: TaskRegistry, specs: list[JobSpec]
) -> list[Any]:
    """Run ``specs`` on a real worker under a real main; each job once it is terminal."""
    store = MemoryAdapter()
    async with _main(store, settings) as main:
        worker = Worker(
            "127.0.0.1",
            main.port,
            worker_id="w-depth",
            runners={ExecutionMode.INLINE: runner},
            registry=registry,
        )
        run = asyncio.create_task(worker.run())
        try:
            await store.enqueue_many(specs)
            main.wake()
            done = [await until(lambda s=s: _terminal(store, s.id), 10) for s in specs]
            assert not run.done(), "the worker is still running"
        finally:
            worker.request_stop()
            await asyncio.wait_for(run, 10)
    return done


async def test_a_worker_fails_a_too_deep_result_and_keeps_serving() -> None:
    registry = TaskRegistry()

    @task(name="deep", registry=registry, mode="inline")
    async def deep() -> None:
        return None

    @task(name="wrap", registry=registry, mode="inline")
    async def wrap(value: Any) -> Any:
        return [value]

    inline = ExecutionMode.INLINE
    specs = [
        JobSpec(task="deep", execution_mode=inline),
        # Arguments within the limit, and a result one level deeper than them.
        JobSpec(task="wrap", args=[nested(64)], execution_mode=inline),
        JobSpec(task="wrap", args=[nested(63)], execution_mode=inline),
        JobSpec(task="wrap", args=["fine"], execution_mode=inline),
    ]
    runner = _DeepResults(registry, concurrency=2)
    deep_job, over, fits, fine = await _run_on_a_worker(FAST, runner, registry, specs)
    for job in (deep_job, over):
        assert job.status is JobStatus.FAILED and job.result is None
        assert job.attempts == 1 and job.max_attempts > 1, "failed without retry"
        assert "more than 64 levels deep" in (job.last_error or "")
    assert fits.status is JobStatus.COMPLETED and fits.result == [nested(63)]
    assert fine.status is JobStatus.COMPLETED and fine.result == ["fine"]


async def test_without_a_payload_limit_a_worker_still_fits_its_reports_to_the_line() -> None:
    registry = TaskRegistry()

    @task(name="sized", registry=registry, mode="inline")
    async def sized(n: int) -> str:
        return "z" * n

    settings = MainSettings(
        **{**FAST.__dict__, "max_payload_bytes": None, "max_line_bytes": 70_000}
    )
    specs = [
        JobSpec(task="sized", args=[n], execution_mode=ExecutionMode.INLINE)
        for n in (60_000, 100_000)
    ]
    runner = InlineRunner(registry, concurrency=2)
    fits, over_line = await _run_on_a_worker(settings, runner, registry, specs)
    assert fits.status is JobStatus.COMPLETED and fits.result == "z" * 60_000
    assert over_line.status is JobStatus.FAILED and over_line.attempts == 1
    assert "over the main's limit of 70000" in (over_line.last_error or "")


# ------------------------------------------------------------------ (d) the child pipe


def _assignment(task_name: str, *args: Any) -> Assignment:
    return Assignment(
        job_id=uuid.uuid4(),
        handoff_id=uuid.uuid4(),
        task=task_name,
        args=args,
        kwargs={},
        execution_mode=ExecutionMode.POOLED,
        attempt=1,
        max_attempts=3,
        timeout=30.0,
        queue="default",
    )


@pytest.mark.slow
async def test_a_pooled_child_fails_a_too_deep_result_and_serves_the_next_job() -> None:
    pool = PooledRunner([APP], registry=TaskRegistry(), count=1, startup_timeout=20.0)
    await pool.start()
    try:
        first = await pool.run(_assignment(NEST, 2))
        assert isinstance(first, Completed), first
        [[child_pid]] = first.result
        outcome = await pool.run(_assignment(NEST, 1000))
        assert isinstance(outcome, Failed) and not outcome.retry, outcome
        assert "levels deep" in outcome.error
        # Arguments too deep to encode for the child (a job stored before the limit
        # existed) fail without reaching it, and its slot is given back.
        unsendable = await pool.run(_assignment(NEST, nested(100_000)))
        assert isinstance(unsendable, Failed) and not unsendable.retry, unsendable
        assert "too deeply" in unsendable.error
        assert pool.free_slots() == 1
        after = await pool.run(_assignment(NEST, 2))
        assert isinstance(after, Completed) and after.result == [[child_pid]], (
            "the same child served the next job"
        )
    finally:
        await pool.stop(grace=1.0)


@pytest.mark.slow
async def test_a_line_from_a_child_too_deep_to_decode_fails_its_jobs_clearly() -> None:
    pool = PooledRunner([APP], registry=TaskRegistry(), count=1, startup_timeout=20.0)
    await pool.start()
    try:
        first = await pool.run(_assignment(NEST, 1))
        assert isinstance(first, Completed), first
        outcome = await pool.run(_assignment(f"{APP}.forge_deep_line", 100_000))
        assert isinstance(outcome, Failed), outcome
        assert "broke its protocol" in outcome.error and "RecursionError" in outcome.error
        # The broken child is gone, and a new one serves the next job.
        after = await asyncio.wait_for(pool.run(_assignment(NEST, 1)), 20)
        assert isinstance(after, Completed) and after.result != first.result, after
    finally:
        await pool.stop(grace=1.0)


@pytest.mark.slow
async def test_a_forked_job_whose_arguments_cannot_be_encoded_fails_without_hanging() -> None:
    forked = ForkedRunner([APP], registry=TaskRegistry(), concurrency=1, startup_timeout=20.0)
    await forked.start()
    try:
        assignment = dataclasses.replace(
            _assignment(NEST, nested(100_000)), execution_mode=ExecutionMode.FORKED
        )
        outcome = await asyncio.wait_for(forked.run(assignment), 20)
        assert isinstance(outcome, Failed) and not outcome.retry, outcome
        assert "too deeply" in outcome.error
        assert forked.free_slots() == 1
    finally:
        await forked.stop(grace=1.0)


# ------------------------------------------------------------------ (b) real processes


@pytest.mark.slow
@pytest.mark.parametrize("mode", [ExecutionMode.POOLED, ExecutionMode.INLINE])
async def test_a_real_worker_fails_a_1000_deep_result_and_keeps_running(
    tmp_path: Path, mode: ExecutionMode
) -> None:
    cluster = Cluster(tmp_path, sqlite_url(tmp_path))
    try:
        await cluster.start_main()
        argv = ["worker", "--main", f"127.0.0.1:{cluster.port}", "--app", APP]
        argv += ["--worker-id", f"w-{mode}", "--inline-concurrency", "2"]
        argv += ["--pooled-runner-count", "1", "--forked-concurrency", "0"]
        worker = await cluster.spawn("worker", *argv)
        await worker.wait_for_output("connected to main")
        async with cluster.client() as client:

            async def run(levels: int) -> dict[str, Any]:
                made = await client.enqueue(NEST, [levels], execution_mode=mode, max_attempts=3)

                async def settled() -> dict[str, Any] | None:
                    job = await client.get_job(made.job_id)
                    done = job is not None and job["status"] in {"completed", "failed"}
                    return job if done else None

                return dict(await until(settled, 20))

            before = await run(2)
            deep = await run(1000)
            after = await run(2)
        assert deep["status"] == "failed" and deep["result"] is None, deep
        assert deep["attempts"] == 1, "failed without retry: the same job gives the same result"
        assert "levels deep" in str(deep["last_error"])
        assert worker.process.returncode is None, "the worker is still running"
        assert "RecursionError" not in worker.output()
        assert before["status"] == after["status"] == "completed"
        if mode is ExecutionMode.INLINE:
            assert after["result"] == [[worker.pid]]
        else:
            assert after["result"] == before["result"], "the same child served the next job"
    finally:
        await cluster.close()
