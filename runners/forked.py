"""The forked runner: a fresh process for every job, for jobs that must share nothing.

Each job pays a process start and the app's imports (a fresh interpreter, started
with exec rather than ``fork()`` from the worker, which holds threads and an event
loop that a forked copy must not inherit). Timeouts, crashes and start-up failures
follow the same rules as the pooled runner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from broker.jobs import ExecutionMode
from broker.model import checks
from broker.tasks.registry import TaskRegistry
from broker.tasks.runner import Assignment, RunnerStatus, RunOutcome
from broker.tasks.runner_options import RunnerOptions
from runners.process import (
    RESPAWN_MAX_DELAY,
    ChildProcess,
    ChildRunner,
    StartupGuard,
    run_on_child,
    timeout_for,
)


class ForkedRunner(ChildRunner):
    def __init__(
        self,
        apps: Sequence[str],
        *,
        registry: TaskRegistry | None = None,
        concurrency: int = RunnerOptions.forked_concurrency,
        default_timeout: float | None = RunnerOptions.default_timeout,
        kill_grace: float = RunnerOptions.kill_grace,
        startup_timeout: float = RunnerOptions.startup_timeout,
        respawn_max_delay: float = RESPAWN_MAX_DELAY,
    ) -> None:
        self._concurrency = checks.positive_int("forked concurrency", concurrency)
        super().__init__(
            apps, registry, default_timeout, kill_grace, startup_timeout, respawn_max_delay
        )
        self._starts = 0
        """Children started, for the worker's metrics (``broker_worker_child_starts``)."""

    @property
    def mode(self) -> ExecutionMode:
        return ExecutionMode.FORKED

    def free_slots(self) -> int:
        if self._stopping or (self._guard is not None and self._guard.failing):
            return 0
        return self._concurrency - len(self._children)

    async def start(self) -> None:
        self._stopping = False
        self._guard = StartupGuard(self._probe, self._listener, max_delay=self._respawn_max_delay)

    def _child(self) -> ChildProcess:
        child = ChildProcess(
            apps=self._apps,
            concurrency=1,
            one_shot=True,
            on_exit=self._on_exit,
            startup_timeout=self._startup_timeout,
            channel=self._channel,
            kill_grace=self._kill_grace,
        )
        self._children.append(child)
        self._starts += 1
        return child

    def _probe(self) -> None:
        """A process with no job, to learn whether processes can start again."""
        child = self._child()

        async def check() -> None:
            try:
                await child.wait_ready()
            except Exception:
                return
            child.retire()

        task = asyncio.create_task(check())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_exit(self, child: ChildProcess) -> None:
        if child in self._children:
            self._children.remove(child)
        if self._stopping or self._guard is None:
            return
        if child.started:
            self._guard.succeeded()
        else:
            self._guard.failed(child.startup_error or "the runner process did not start")
        self._listener()

    def run(self, assignment: Assignment) -> asyncio.Future[RunOutcome]:
        if self.free_slots() <= 0:
            raise RuntimeError("no free forked slot: check free_slots() before run()")
        child = self._child()
        child.reserve(assignment)
        timeout = timeout_for(assignment, self._registry, self._default_timeout)
        # A task per job here costs nothing next to the process each job starts.
        return child.loop.create_task(
            self._run(child, run_on_child(child, assignment, timeout, self._kill_grace))
        )

    @staticmethod
    async def _run(child: ChildProcess, outcome: asyncio.Future[RunOutcome]) -> RunOutcome:
        """The outcome once the job's process has exited, so its slot is free with it."""
        result = await outcome
        await child.closed()
        return result

    async def stop(self, *, grace: float) -> None:
        await self._stop_children(grace, retire=False)

    def status(self) -> RunnerStatus:
        return RunnerStatus(
            mode=self.mode,
            capacity=self._concurrency,
            busy=len(self._children),
            startup_error=self._guard.error if self._guard is not None else None,
            details={"children_alive": len(self._children), "child_starts": self._starts},
        )
