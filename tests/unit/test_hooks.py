"""Worker hooks' rules, in one process: the order start-up, shutdown and around-job hooks
run in, what a raising hook does to the job or the process, and that plain and ``async``
hooks follow the same rules around plain and ``async`` tasks (the inline runner, which a
pooled or forked child runs too, drives them)."""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.core.worker_rules import RetryRules
from broker.exceptions import ConfigurationError
from broker.jobs import ExecutionMode
from broker.retry import RetryPolicy
from broker.tasks.context import JobContext
from broker.tasks.hooks import (
    JobMiddleware,
    StartupHookFailed,
    WorkerHooks,
    add_middleware,
    on_shutdown,
    on_startup,
)
from broker.tasks.registry import TaskRegistry, task
from broker.tasks.runner import Assignment, Completed, Failed, NoChannel
from runners.inline import InlineRunner


def assignment(name: str, timeout: float | None = None) -> Assignment:
    return Assignment(
        uuid.uuid4(), uuid.uuid4(), name, (), {}, ExecutionMode.INLINE, 1, 3, timeout, "default"
    )


class Boom(Exception):
    pass


class Layer(JobMiddleware):
    """Records each hook it runs in ``log``; raises in the hook named by ``fail``."""

    def __init__(self, name: str, log: list[str], fail: str = "", use_async: bool = False):
        self.name, self.log, self.fail, self.use_async = name, log, fail, use_async

    def _hook(self, hook: str) -> Any:
        def run() -> None:
            self.log.append(f"{self.name}.{hook}")
            if self.fail == hook:
                raise Boom(f"{self.name}.{hook}")

        if not self.use_async:
            return run()

        async def later() -> None:
            await asyncio.sleep(0)
            run()

        return later()

    def before(self, job: JobContext) -> Any:
        return self._hook("before")

    def after(self, job: JobContext, result: object) -> Any:
        return self._hook("after")

    def on_failure(self, job: JobContext, error: BaseException) -> Any:
        return self._hook("on_failure")


async def run_job(
    layers: list[Layer], log: list[str], *, sync_task: bool, task_fails: bool = False
) -> Any:
    """One job of a fresh registry through the inline runner; its outcome."""
    registry = TaskRegistry()
    for layer in layers:
        add_middleware(layer, registry=registry)

    def body() -> str:
        log.append("task")
        if task_fails:
            raise Boom("task")
        return "done"

    if sync_task:
        task(name="job", registry=registry, mode="inline")(body)
    else:

        async def async_body() -> str:
            return body()

        task(name="job", registry=registry, mode="inline")(async_body)
    runner = InlineRunner(registry)
    await runner.start()
    try:
        return await runner.run(assignment("job"))
    finally:
        await runner.stop(grace=1)


@pytest.mark.parametrize("sync_task", [False, True])
@pytest.mark.parametrize("use_async", [False, True])
async def test_middleware_wraps_a_job_like_an_onion(sync_task: bool, use_async: bool) -> None:
    log: list[str] = []
    layers = [Layer("a", log, use_async=use_async), Layer("b", log, use_async=not use_async)]
    outcome = await run_job(layers, log, sync_task=sync_task)
    assert outcome == Completed("done")
    assert log == ["a.before", "b.before", "task", "b.after", "a.after"]


@pytest.mark.parametrize("sync_task", [False, True])
async def test_a_failing_task_calls_on_failure_innermost_first(sync_task: bool) -> None:
    log: list[str] = []
    outcome = await run_job(
        [Layer("a", log), Layer("b", log, use_async=True)],
        log,
        sync_task=sync_task,
        task_fails=True,
    )
    assert isinstance(outcome, Failed) and outcome.error.startswith(f"{__name__}.Boom: task")
    assert "around-job hook" not in outcome.error, "the task's own failure names no hook"
    assert log == ["a.before", "b.before", "task", "b.on_failure", "a.on_failure"]


@pytest.mark.parametrize("sync_task", [False, True])
async def test_a_raising_before_fails_the_job_unrun_and_names_the_hook(sync_task: bool) -> None:
    log: list[str] = []
    outcome = await run_job(
        [Layer("a", log), Layer("b", log, fail="before"), Layer("c", log)], log, sync_task=sync_task
    )
    assert isinstance(outcome, Failed)
    assert outcome.error.startswith(f"{__name__}.Boom: b.before")
    assert f"(raised by around-job hook {__name__}.Layer.before)" in outcome.error
    # b's layer was never entered: no on_failure of its own; a's layer sees the failure.
    assert log == ["a.before", "b.before", "a.on_failure"]


@pytest.mark.parametrize("sync_task", [False, True])
async def test_a_raising_after_fails_the_job_and_its_own_on_failure_runs(sync_task: bool) -> None:
    log: list[str] = []
    outcome = await run_job(
        [Layer("a", log), Layer("b", log, fail="after")], log, sync_task=sync_task
    )
    assert isinstance(outcome, Failed) and outcome.error.startswith(f"{__name__}.Boom: b.after")
    assert f"(raised by around-job hook {__name__}.Layer.after)" in outcome.error
    assert log == ["a.before", "b.before", "task", "b.after", "b.on_failure", "a.on_failure"]


async def test_a_raising_on_failure_keeps_the_jobs_error_and_adds_a_note() -> None:
    log: list[str] = []
    outcome = await run_job(
        [Layer("a", log), Layer("b", log, fail="on_failure")], log, sync_task=False, task_fails=True
    )
    assert isinstance(outcome, Failed) and outcome.error.startswith(f"{__name__}.Boom: task")
    assert f"around-job hook {__name__}.Layer.on_failure also raised" in outcome.error
    assert log == ["a.before", "b.before", "task", "b.on_failure", "a.on_failure"]


def test_a_hooks_failure_is_judged_by_the_retry_policy_as_the_tasks_own_would_be() -> None:
    error = (
        "PermissionError: refused\n"
        "(raised by around-job hook app.Auth.before)\nTraceback (innermost last):\n  ..."
    )
    rules = RetryRules(RetryPolicy(dont_retry_on=(PermissionError,)), None, attempt=1)
    judged = rules.judge(Failed(error))
    assert not judged.retry and "excludes PermissionError" in judged.error
    assert RetryRules(None, None, attempt=1).judge(Failed(error)).retry, "else retried"


REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="unset")


class Tagging(JobMiddleware):
    def before(self, job: JobContext) -> None:
        REQUEST.set(f"for {job.task}")


@pytest.mark.parametrize("sync_task", [False, True])
async def test_a_contextvar_set_in_a_plain_before_reaches_the_task(sync_task: bool) -> None:
    registry = TaskRegistry()
    add_middleware(Tagging(), registry=registry)

    def read() -> str:
        return REQUEST.get()

    async def read_async() -> str:
        return REQUEST.get()

    task(name="job", registry=registry, mode="inline")(read if sync_task else read_async)
    runner = InlineRunner(registry)
    assert await runner.run(assignment("job")) == Completed("for job")
    assert REQUEST.get() == "unset", "the job's context is its own"


async def test_an_inline_job_past_its_timeout_reaches_on_failure_as_cancelled() -> None:
    registry = TaskRegistry()
    errors: list[BaseException] = []
    seen = asyncio.Event()

    class Watch(JobMiddleware):
        def on_failure(self, job: JobContext, error: BaseException) -> None:
            errors.append(error)
            seen.set()

    add_middleware(Watch(), registry=registry)

    @task(name="stuck", registry=registry, mode="inline")
    async def stuck() -> None:
        await asyncio.Event().wait()

    runner = InlineRunner(registry)
    outcome = await runner.run(assignment("stuck", timeout=0.05))
    assert isinstance(outcome, Failed) and "timed out" in outcome.error
    await asyncio.wait_for(seen.wait(), 10)  # the cancelled job unwinds through its layers
    assert len(errors) == 1 and isinstance(errors[0], asyncio.CancelledError)


async def test_a_middleware_before_that_raises_never_leaves_the_task_coroutine_unawaited() -> None:
    hooks = WorkerHooks()
    log: list[str] = []
    hooks.middleware.append(Layer("a", log, fail="before"))

    async def body() -> None:
        log.append("task")

    job = JobContext(assignment("job"), NoChannel(), asyncio.get_running_loop())
    work = body()
    with pytest.raises(Boom):
        await hooks.around_async(job, work)
    assert log == ["a.before"]
    assert work.cr_frame is None, "closed: no 'never awaited' warning at collection"


# ---------------------------------------------------------------- start-up and shutdown


async def test_start_up_hooks_run_in_order_and_the_first_failure_stops_the_rest() -> None:
    registry = TaskRegistry()
    log: list[str] = []

    @on_startup(registry=registry)
    def first() -> None:
        log.append("first")

    @on_startup(registry=registry)
    async def second() -> None:
        log.append("second")
        raise Boom("no database")

    @on_startup(registry=registry)
    def third() -> None:
        log.append("third")

    with pytest.raises(StartupHookFailed) as raised:
        await registry.hooks.start()
    assert log == ["first", "second"]
    assert str(raised.value) == (
        f"start-up hook {__name__}.{second.__qualname__} raised {__name__}.Boom: no database"
    )
    assert isinstance(raised.value, ConfigurationError), "the worker reports it as it does others"


async def test_shutdown_hooks_run_in_reverse_and_one_failing_stops_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = TaskRegistry()
    log: list[str] = []

    @on_shutdown(registry=registry)
    def opened_first() -> None:
        log.append("opened_first")

    @on_shutdown(registry=registry)
    async def opened_second() -> None:
        log.append("opened_second")
        raise Boom("close failed")

    await registry.hooks.stop()
    assert log == ["opened_second", "opened_first"]
    assert "shutdown hook" in caplog.text and "opened_second" in caplog.text


async def test_the_inline_runner_runs_process_hooks_once_unless_its_child_runs_them() -> None:
    registry = TaskRegistry()
    log: list[str] = []
    on_startup(registry=registry)(lambda: log.append("up"))
    on_shutdown(registry=registry)(lambda: log.append("down"))
    runner = InlineRunner(registry)
    await runner.start()
    await runner.start()
    await runner.stop(grace=0)
    await runner.stop(grace=0)
    assert log == ["up", "down"]
    in_child = InlineRunner(registry, process_hooks=False)
    await in_child.start()
    await in_child.stop(grace=0)
    assert log == ["up", "down"], "a child runs them itself, around its whole life"


async def test_a_raising_start_up_hook_fails_the_inline_runners_start() -> None:
    registry = TaskRegistry()

    @on_startup(registry=registry)
    def broken() -> None:
        raise Boom("cache unreachable")

    with pytest.raises(StartupHookFailed, match="cache unreachable"):
        await InlineRunner(registry).start()


def test_declaring_a_hook_twice_keeps_one_and_bad_declarations_are_refused() -> None:
    registry = TaskRegistry()

    def hook() -> None:
        pass

    on_startup(hook, registry=registry)  # type: ignore[call-overload]
    on_startup(registry=registry)(hook)
    middleware = JobMiddleware()
    add_middleware(middleware, registry=registry)
    add_middleware(middleware, registry=registry)
    assert registry.hooks.startup == [hook] and registry.hooks.middleware == [middleware]
    with pytest.raises(ConfigurationError, match="JobMiddleware"):
        add_middleware(object(), registry=registry)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="must be a function"):
        on_shutdown(registry=registry)(42)  # type: ignore[type-var]


# ---------------------------------------------------------------- the onion, as a property


def expected_trace(depth: int, fail: str | None) -> list[str]:
    """What the rules say runs for ``depth`` layers when ``fail`` raises (``"task"``,
    ``"before:i"`` or ``"after:i"``): befores outward-in until one raises, the task if all
    passed, then each entered layer inward-out, ``after`` while nothing has failed and
    ``on_failure`` once something has (its own ``after`` included)."""
    trace: list[str] = []
    entered = depth
    failing = False
    for i in range(depth):
        trace.append(f"{i}.before")
        if fail == f"before:{i}":
            entered, failing = i, True
            break
    if not failing:
        trace.append("task")
        failing = fail == "task"
    for i in reversed(range(entered)):
        if not failing:
            trace.append(f"{i}.after")
            failing = fail == f"after:{i}"
        if failing:
            trace.append(f"{i}.on_failure")
    return trace


@given(
    depth=st.integers(0, 4),
    data=st.data(),
    sync_task=st.booleans(),
    async_hooks=st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_any_failure_point_follows_the_onion_rules(
    depth: int, data: st.DataObject, sync_task: bool, async_hooks: list[bool]
) -> None:
    points = [None, "task"] + [f"{h}:{i}" for i in range(depth) for h in ("before", "after")]
    fail = data.draw(st.sampled_from(points))
    log: list[str] = []

    def fails_in(i: int) -> str:
        hook, _, index = (fail or "").partition(":")
        return hook if index == str(i) else ""

    layers = [Layer(str(i), log, fail=fails_in(i), use_async=async_hooks[i]) for i in range(depth)]
    outcome = asyncio.run(run_job(layers, log, sync_task=sync_task, task_fails=fail == "task"))
    assert log == expected_trace(depth, fail)
    assert isinstance(outcome, Completed) == (fail is None)
