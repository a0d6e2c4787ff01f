"""The inline runner: jobs run inside the worker process, with no isolation.

Coroutine tasks run on the worker's own event loop, so they are cheap but share
its fate: a task that blocks the loop stalls the worker's pings and the main will
drop it. Plain functions therefore run in a thread of their own, taken from a set of
threads kept for reuse (starting a thread per job was most of a no-op job's cost).

A slot is held for as long as the job's code is actually running, not for as long
as the outcome :meth:`InlineRunner.run` returned is pending. A thread cannot be killed,
so when a sync job times out (or is cancelled) the outcome is the failure at once but
the slot stays busy until the function returns; otherwise the worker would
advertise room it does not have and pile more threads onto a stuck one.
Those threads are daemons, so a stuck one never holds the process open at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import queue
import threading
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker.exceptions import InvalidJobError, TaskNotFoundError
from broker.jobs import ExecutionMode, JSONValue
from broker.model import checks, tracing
from broker.payload import MAX_PAYLOAD_DEPTH_CEILING, result_too_deep
from broker.tasks import hooks as hooks_module
from broker.tasks.arguments import plan_for, to_json_form
from broker.tasks.context import JobContext
from broker.tasks.registry import Task, TaskRegistry, default_registry
from broker.tasks.runner import (
    Assignment,
    Completed,
    Failed,
    JobChannel,
    NoChannel,
    Reschedule,
    Rescheduled,
    RunnerStatus,
    RunOutcome,
)
from broker.tasks.runner_options import RunnerOptions

MAX_ERROR_CHARS = 8 * 1024
"""Bound on a failure's text: it travels in one protocol line and is stored per job."""

_MAX_HEAD_CHARS = 2 * 1024
"""Bound on the ``Type: message`` part, so a huge message still leaves room for frames."""

_MAX_FRAMES = 20

_RUNNER_FILES = frozenset({__file__, hooks_module.__file__})
"""Frames of the runner and of the around-job layers, left out of a job's error."""

_PLAIN = (str, bool)
"""Result types that are JSON as they are: no depth to measure, nothing to encode first."""


def format_error(exc: BaseException) -> str:
    """``Type: message`` and the innermost frames of the job's own code, at most 8 KiB.

    The runner's frames are left out: they are the same for every job and would push
    the frames that locate the bug out of the bounded text.
    """
    head = "".join(traceback.format_exception_only(exc)).strip()
    if len(head) > _MAX_HEAD_CHARS:
        head = head[: _MAX_HEAD_CHARS - 3] + "..."
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename not in _RUNNER_FILES]
    lines = traceback.format_list(frames[-_MAX_FRAMES:])
    while lines:
        text = head + "\nTraceback (innermost last):\n" + "".join(lines).rstrip()
        if len(text) <= MAX_ERROR_CHARS:
            return text
        lines.pop(0)  # the outermost frame is the least likely to locate the bug
    return head


class _Threads:
    """Daemon threads kept for sync jobs: a thread that finished a job waits for the next.

    There are never more threads than jobs running at once, plus the idle ones: each job
    takes an idle thread or starts one, so a job never waits for a thread (a stuck one
    keeps its job's slot, and the runner sends nothing beyond its slots). Daemons, so a
    stuck one never holds the process open at exit.
    """

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that thread is this job's
        self._work.put(work)
        if start:
            threading.Thread(target=self._serve, name="broker-inline", daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._work.get()()
            with self._lock:
                self._idle += 1


@dataclass(eq=False)
class _Slot:
    assignment: Assignment
    outcome: asyncio.Future[RunOutcome]
    """What :meth:`InlineRunner.run` returned: resolved by the work's end, its timeout or
    :meth:`InlineRunner.cancel`, whichever comes first."""
    sync: bool = False
    """The job runs in a thread, which cancelling cannot stop."""
    work: asyncio.Future[Any] | None = None
    timer: asyncio.TimerHandle | None = None
    """The job's timeout, if it has one."""
    reported: bool = False
    """The outcome was given while the work may still be running."""
    span: Any = None
    """The run's OpenTelemetry span (:func:`broker.model.tracing.start_run`), if any."""


def _end_span(span: Any, outcome: asyncio.Future[RunOutcome]) -> None:
    """End a run's span with its outcome: a failure (or a cancelled run) sets its error."""
    if outcome.cancelled():
        error: str | None = "cancelled"
    else:
        result = outcome.result()
        error = result.error if isinstance(result, Failed) else None
    tracing.end_run(span, error)


class InlineRunner:
    """Runs ``ExecutionMode.INLINE`` jobs in the worker process, ``concurrency`` at a time.

    A job costs one task (its own coroutine's, for an async task) and no other: the
    outcome is a future settled by callbacks on the work and on its timer, because a
    task per job around the work and an ``asyncio.wait`` on it were a fifth of a pooled
    child's CPU.
    """

    def __init__(
        self,
        registry: TaskRegistry | None = None,
        concurrency: int = RunnerOptions.inline_concurrency,
        default_timeout: float | None = None,
        *,
        enforce_timeouts: bool = True,
        process_hooks: bool = True,
    ) -> None:
        checks.positive_int("inline concurrency", concurrency)
        checks.optional(checks.positive, "default_timeout", default_timeout)
        self._registry = default_registry if registry is None else registry
        self._concurrency = concurrency
        self._default_timeout = default_timeout
        self._enforce_timeouts = enforce_timeouts
        """Off inside a pooled or forked child, whose parent enforces timeouts by killing the
        process: a thread cannot be stopped, and a child must never keep a stuck slot."""
        self._slots: dict[uuid.UUID, _Slot] = {}
        """Busy slots by lease (``handoff_id``): unique even if a job id comes back."""
        self._listener: Callable[[], None] | None = None
        self._channel: JobChannel = NoChannel()
        self._process_hooks = process_hooks
        """Run the app's start-up hooks at :meth:`start` and its shutdown hooks at
        :meth:`stop`: in the worker, for its inline jobs. Off in a pooled or forked child,
        which runs them itself around its whole life (before it says ready, so they never
        count against a job's timeout)."""
        self._hooks_started = False
        self._stopping = False
        self._threads = _Threads()
        self._loop: asyncio.AbstractEventLoop | None = None
        """Kept from the first job: on 3.11 each ``get_running_loop()`` is a ``getpid``."""

    @property
    def mode(self) -> ExecutionMode:
        return ExecutionMode.INLINE

    def free_slots(self) -> int:
        return 0 if self._stopping else self._concurrency - len(self._slots)

    def set_capacity_listener(self, listener: Callable[[], None]) -> None:
        self._listener = listener

    def set_job_channel(self, channel: JobChannel) -> None:
        self._channel = channel

    async def start(self) -> None:
        """Run the app's start-up hooks (see ``process_hooks``); one that raises
        (:class:`~broker.tasks.hooks.StartupHookFailed`) fails the worker's start."""
        self._stopping = False
        if self._process_hooks and not self._hooks_started:
            await self._registry.hooks.start()
            self._hooks_started = True

    def run(self, assignment: Assignment) -> asyncio.Future[RunOutcome]:
        if self.free_slots() <= 0:
            raise RuntimeError("no free inline slot: check free_slots() before run()")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        outcome: asyncio.Future[RunOutcome] = loop.create_future()
        slot = _Slot(assignment, outcome)
        self._slots[assignment.handoff_id] = slot
        if tracing.ENABLED:
            slot.span = tracing.start_run(
                assignment.task,
                assignment.job_id,
                assignment.queue,
                assignment.attempt,
                assignment.trace_context,
            )
            if slot.span is not None:
                outcome.add_done_callback(functools.partial(_end_span, slot.span))
        try:
            task = self._registry.get(assignment.task)
        except TaskNotFoundError as exc:
            self._free(slot)
            outcome.set_result(Failed(str(exc), retry=False))
            return outcome
        try:
            # The task's typed arguments (datetime, UUID...) from their JSON form, by its
            # annotations; one flag read for a task that has none to convert.
            args, kwargs = plan_for(task.func).decode(task.name, assignment.args, assignment.kwargs)
        except InvalidJobError as exc:
            self._free(slot)
            outcome.set_result(Failed(str(exc), retry=False))
            return outcome
        timeout = self._timeout_for(assignment, task)
        slot.sync = not task.is_async
        slot.work = work = self._launch(task, assignment, args, kwargs, loop, slot.span)
        work.add_done_callback(functools.partial(self._work_done, slot))
        if timeout is not None:
            slot.timer = loop.call_later(timeout, self._timed_out, slot, timeout)
        return outcome

    def _timeout_for(self, assignment: Assignment, task: Task[..., Any]) -> float | None:
        if not self._enforce_timeouts:
            return None
        if assignment.timeout is not None:
            return assignment.timeout
        if task.timeout is not None:
            return task.timeout
        return self._default_timeout

    def _launch(
        self,
        task: Task[..., Any],
        assignment: Assignment,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
        span: Any,
    ) -> asyncio.Future[Any]:
        # The task runs in a copy of this context in which current_job() is its job, and
        # the span of its run (if any) is the active one.
        context = contextvars.copy_context()
        if span is not None:
            context.run(tracing.activate, span)
        job_context = JobContext(assignment, self._channel, loop)
        job_context.enter(context)
        hooks = self._registry.hooks if self._registry.hooks.middleware else None
        if task.is_async:
            try:
                # Calling an async function binds its arguments and runs none of its code.
                job = task.func(*args, **kwargs)
            except Exception as exc:  # a bad signature fails the job, not the runner
                failed: asyncio.Future[Any] = loop.create_future()
                failed.set_exception(exc)
                return failed
            if hooks is not None:
                job = hooks.around_async(job_context, job)
            return loop.create_task(job, context=context)
        done: asyncio.Future[Any] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if done.done():
                return
            if ok:
                done.set_result(value)
            else:
                done.set_exception(value)

        call: Callable[[], Any] = functools.partial(task.func, *args, **kwargs)
        if hooks is not None:
            call = functools.partial(hooks.around_sync, job_context, loop, call)

        def target() -> None:
            try:
                result = (True, context.run(call))
            except BaseException as exc:  # SystemExit in a job is the job's failure
                result = (False, exc)
            # RuntimeError: the loop is closed, the worker has exited and nobody waits.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, *result)

        self._threads.submit(target)
        return done

    def _settle(self, slot: _Slot, outcome: RunOutcome) -> None:
        """Give ``outcome`` before the work ended (a timeout, a cancel): a coroutine job is
        cancelled; a thread runs on, holding its slot until it returns."""
        if slot.outcome.done():
            return
        slot.reported = True
        slot.outcome.set_result(outcome)
        self._interrupt(slot)

    def _stop_message(self, slot: _Slot, what: str) -> str:
        still = " (the thread runs on; its slot stays busy until it returns)" if slot.sync else ""
        return f"{what}{still}"

    def _timed_out(self, slot: _Slot, limit: float) -> None:
        self._settle(slot, Failed(self._stop_message(slot, f"timed out after {limit} s")))

    def _work_done(self, slot: _Slot, work: asyncio.Future[Any]) -> None:
        if slot.timer is not None:
            slot.timer.cancel()
        if not slot.outcome.done():
            slot.outcome.set_result(self._outcome_of(work))
        self._free(slot)

    @staticmethod
    def _interrupt(slot: _Slot) -> None:
        """Cancel a coroutine job still running. A thread's future is left alone: it must
        resolve only when the thread returns, because that is what frees the slot."""
        if slot.work is not None and not slot.sync:
            slot.work.cancel()

    @staticmethod
    def _outcome_of(work: asyncio.Future[Any]) -> RunOutcome:
        if work.cancelled():
            return Failed("cancelled")
        exc = work.exception()
        if isinstance(exc, Reschedule):  # its delay was checked when it was raised
            return Rescheduled(exc.delay)
        if exc is not None:
            return Failed(format_error(exc))
        result: JSONValue = work.result()
        if result is None or type(result) in _PLAIN:
            return Completed(result)
        # Before encoding: ``json`` recurses per level, and a RecursionError here would read
        # as a runner bug (and be retried). The main's own, usually lower, depth limit is
        # applied by the worker before it sends the result.
        too_deep = result_too_deep(result, MAX_PAYLOAD_DEPTH_CEILING)
        if too_deep is not None:
            return Failed(too_deep, retry=False)
        try:
            json.dumps(result, allow_nan=False)
        except (TypeError, ValueError):
            try:
                # A datetime, a dataclass...: written in its JSON form here, in the process
                # that ran the task, so the worker, the main and the store only see JSON.
                result = to_json_form(result, "the task's result")
                json.dumps(result, allow_nan=False)
            except InvalidJobError as err:
                return Failed(str(err), retry=False)
            except (TypeError, ValueError) as err:
                return Failed(
                    f"the task returned a value that is not JSON-serialisable ({err}); return "
                    "JSON data or a type listed in docs/reference/arguments.md",
                    retry=False,
                )
        return Completed(result)

    def _free(self, slot: _Slot) -> None:
        if self._slots.get(slot.assignment.handoff_id) is not slot:
            return
        del self._slots[slot.assignment.handoff_id]
        if slot.work is not None and slot.work.done() and not slot.work.cancelled():
            slot.work.exception()  # retrieved: an abandoned job's error was already reported
        # A slot freed with its outcome is re-advertised with that outcome; only one that
        # outlived its outcome (a thread past its timeout) frees on the runner's own account.
        if slot.reported and self._listener is not None:
            self._listener()

    async def cancel(self, job_id: uuid.UUID) -> bool:
        found = False
        for slot in list(self._slots.values()):
            if slot.assignment.job_id == job_id and not slot.outcome.done():
                self._settle(slot, Failed(self._stop_message(slot, "cancelled")))
                found = True
        return found

    async def stop(self, *, grace: float) -> None:
        """Take no more jobs, let running ones finish for ``grace`` s, then cancel them.

        Threads that outlive the grace are left behind (they are daemons); their jobs
        were already reported as cancelled.
        """
        self._stopping = True
        pending = {s.work for s in self._slots.values() if s.work is not None}
        if pending and grace > 0:
            await asyncio.wait(pending, timeout=grace)
        for slot in list(self._slots.values()):
            self._settle(slot, Failed(self._stop_message(slot, "cancelled")))
            self._interrupt(slot)
        if self._hooks_started:
            self._hooks_started = False
            await self._registry.hooks.stop()

    def status(self) -> RunnerStatus:
        stuck = sum(1 for s in self._slots.values() if s.reported)
        return RunnerStatus(
            mode=self.mode,
            capacity=self._concurrency,
            busy=len(self._slots),
            details={"stuck": stuck, "stopping": self._stopping},
        )
