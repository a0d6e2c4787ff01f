"""The pooled runner: warm child processes that import the app once and run many jobs.

Capacity is ``count x concurrency`` slots, and :meth:`PooledRunner.free_slots` is
exact: busy slots on live children are taken away, and a child that is retiring
or dead gives its place to a replacement, which is counted as free (it is spawned
on demand). The worker advertises that number as credit, so one readiness message
can fill the whole pool.

Children are recycled make-before-break, never in the middle of a job and never on
the hot path: past ``max_rss_bytes`` of memory, ``max_lifetime`` seconds or (only if
set) ``max_jobs`` jobs, a successor is started while the old child keeps taking jobs;
once the successor has said ready it takes the old child's place, and only then does
the old child stop taking work and exit once idle. A child start costs a quarter of a
second of CPU and half a second of wall time, so no job ever waits for one while a
started child has a free slot. There is no job-count limit by default: a count says
nothing about a leak that memory and age do not say better.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence

from broker.jobs import ExecutionMode
from broker.model import checks
from broker.model.logs import log_event
from broker.tasks.registry import TaskRegistry
from broker.tasks.runner import (
    Assignment,
    RunnerStatus,
    RunOutcome,
)
from broker.tasks.runner_options import RunnerOptions
from runners import pipe
from runners.process import (
    RESPAWN_MAX_DELAY,
    ChildProcess,
    ChildRunner,
    StartupGuard,
    run_on_child,
    timeout_for,
)

logger = logging.getLogger("broker.runner.pooled")


async def _warm(child: ChildProcess) -> None:
    """Returns once ``child`` is ready, or has exited after failing to start: its exit
    is what revokes the pool's slots (the start-up guard), so the worker's first
    ``ready`` already says so."""
    try:
        await child.wait_ready()
    except Exception:
        await child.closed()


class PooledRunner(ChildRunner):
    def __init__(
        self,
        apps: Sequence[str],
        *,
        registry: TaskRegistry | None = None,
        count: int | None = None,
        concurrency: int = RunnerOptions.pooled_runner_concurrency,
        max_jobs: int | None = RunnerOptions.pooled_max_jobs,
        max_rss_bytes: int = RunnerOptions.pooled_max_rss_bytes,
        max_lifetime: float = RunnerOptions.pooled_max_lifetime,
        default_timeout: float | None = RunnerOptions.default_timeout,
        kill_grace: float = RunnerOptions.kill_grace,
        startup_timeout: float = RunnerOptions.startup_timeout,
        ping_interval: float = 5.0,
        respawn_max_delay: float = RESPAWN_MAX_DELAY,
    ) -> None:
        self._count = checks.positive_int("pooled runner count", count or os.cpu_count() or 1)
        self._concurrency = checks.positive_int("pooled runner concurrency", concurrency)
        self._max_jobs = checks.optional(
            checks.positive_int, "max jobs per pooled runner", max_jobs
        )
        self._max_rss = checks.positive_int("max RSS bytes per pooled runner", max_rss_bytes)
        self._max_lifetime = checks.positive("max pooled runner lifetime", max_lifetime)
        self._ping_interval = checks.positive("runner ping interval", ping_interval)
        super().__init__(
            apps, registry, default_timeout, kill_grace, startup_timeout, respawn_max_delay
        )
        self._successors: dict[ChildProcess, ChildProcess] = {}
        """Children still starting to take the place of another (successor: predecessor);
        they take no job until they are ready and have taken that place."""
        self._pinger: asyncio.Task[None] | None = None
        self._counts = {"child_starts": 0, "child_crashes": 0, "child_recycles": 0}
        """Counted for the worker's metrics (``broker_worker_child_*``)."""

    @property
    def mode(self) -> ExecutionMode:
        return ExecutionMode.POOLED

    @property
    def capacity(self) -> int:
        return self._count * self._concurrency

    def _serving(self) -> list[ChildProcess]:
        """The children that hold one of the ``count`` places and may take jobs."""
        return [
            c
            for c in self._children
            if not c.retiring and not c.exited and c not in self._successors
        ]

    def free_slots(self) -> int:
        if self._stopping or (self._guard is not None and self._guard.failing):
            return 0
        # One pass, no lists: the worker asks this for every job it receives and ends.
        serving = room = busy = 0
        successors = self._successors
        for c in self._children:
            inflight = len(c.inflight)
            busy += inflight
            if not c.retiring and not c.exited and c not in successors:
                serving += 1
                room += c.concurrency - inflight
        room += (self._count - serving) * self._concurrency
        # A retiring child still finishing jobs counts against capacity, so its
        # replacement cannot push the pool past count x concurrency meanwhile.
        return max(0, min(room, self.capacity - busy))

    async def start(self) -> None:
        """Start the children and return once each has said ready or failed to start
        (within the start-up timeout), so the worker connects with a warm pool: a job
        handed to a child still importing the app waits for it while the other children
        run jobs, and under load a child can be ready a third of a second after its
        sibling."""
        self._stopping = False
        self._guard = StartupGuard(self._probe, self._listener, max_delay=self._respawn_max_delay)
        first = [self._spawn() for _ in range(self._count)]
        self._pinger = asyncio.create_task(self._ping_loop(), name="broker-pool-ping")
        await asyncio.gather(*(_warm(child) for child in first))

    def _spawn(self) -> ChildProcess:
        child = ChildProcess(
            apps=self._apps,
            concurrency=self._concurrency,
            one_shot=False,
            on_exit=self._on_exit,
            startup_timeout=self._startup_timeout,
            on_sample=self._maybe_recycle,
            channel=self._channel,
            kill_grace=self._kill_grace,
        )
        self._children.append(child)
        self._counts["child_starts"] += 1
        watcher = asyncio.create_task(self._watch_start(child))
        self._background.add(watcher)
        watcher.add_done_callback(self._background.discard)
        return child

    def _probe(self) -> None:
        """The start-up guard's retry: replace a child that is due, else fill a place."""
        serving = self._serving()
        due = [c for c in serving if c.started and self._recycle_reason(c) is not None]
        if due:
            self._maybe_recycle(due[0], probing=True)
        elif len(serving) < self._count:
            self._spawn()
        elif all(c.started for c in serving):
            assert self._guard is not None
            self._guard.succeeded()

    async def _watch_start(self, child: ChildProcess) -> None:
        try:
            await child.wait_ready()
        except Exception:
            return
        log_event(logger, logging.INFO, "pooled runner started", pid=child.pid)
        predecessor = self._successors.pop(child, None)
        if predecessor is not None and not predecessor.exited:
            # Make before break: the successor is ready, so the place changes hands in
            # this one step and the pool never counts a place that cannot run a job now.
            log_event(
                logger,
                logging.INFO,
                "pooled runner takes the place of one that retires",
                pid=child.pid,
                retiring_pid=predecessor.pid,
            )
            predecessor.retire()
        assert self._guard is not None
        self._guard.succeeded()

    def _on_exit(self, child: ChildProcess) -> None:
        if child in self._children:
            self._children.remove(child)
        self._successors.pop(child, None)
        for successor, predecessor in list(self._successors.items()):
            if predecessor is child:  # its successor, still starting, holds the place now
                del self._successors[successor]
        if self._stopping:
            return
        if not child.started:
            assert self._guard is not None
            self._guard.failed(child.startup_error or "the runner process did not start")
            return
        if "cancelled" in child.kill_reasons.values():  # stopped by cancel_on, on purpose
            log_event(
                logger,
                logging.INFO,
                "pooled runner stopped to cancel a job; replacing it",
                pid=child.pid,
            )
        elif not child.retiring:
            self._counts["child_crashes"] += 1
            log_event(
                logger,
                logging.WARNING,
                "pooled runner died; its slots are free again",
                pid=child.pid,
                exit=child.exit_code,
            )
            if len(self._serving()) < self._count:
                self._spawn()  # now, so it is warm before a job needs its place
        self._listener()

    def _pick(self) -> ChildProcess | None:
        """The ready child with the most free slots (least loaded), else a starting one."""
        best: ChildProcess | None = None
        best_rank: tuple[bool, int, int] | None = None
        successors = self._successors
        for c in self._children:
            if c.retiring or c.exited or c in successors:
                continue
            free = c.concurrency - len(c.inflight)
            rank = (c.started, free, -c.jobs_run)
            if free > 0 and (best_rank is None or rank > best_rank):
                best, best_rank = c, rank
        return best

    def run(self, assignment: Assignment) -> asyncio.Future[RunOutcome]:
        if self.free_slots() <= 0:
            raise RuntimeError("no free pooled slot: check free_slots() before run()")
        child = self._pick()
        if child is None:
            child = self._spawn()
        child.reserve(assignment)
        timeout = timeout_for(assignment, self._registry, self._default_timeout)
        outcome = run_on_child(child, assignment, timeout, self._kill_grace)
        if self._max_jobs is not None:
            # Memory and age are checked on the child's samples and pings; only a job
            # count needs a look at every job's end.
            outcome.add_done_callback(lambda _: self._maybe_recycle(child))
        return outcome

    def _recycle_reason(self, child: ChildProcess) -> str | None:
        if self._max_jobs is not None and child.jobs_run >= self._max_jobs:
            return f"ran {child.jobs_run} jobs"
        if child.rss >= self._max_rss:
            return f"uses {child.rss} bytes of memory"
        if child.age >= self._max_lifetime:
            return f"is {child.age:.0f} s old"
        return None

    def _maybe_recycle(self, child: ChildProcess, *, probing: bool = False) -> None:
        """Start a successor for ``child`` if it is due; it keeps serving meanwhile."""
        if child.exited or child.retiring or not child.started or self._stopping:
            return
        if child in self._successors or child in self._successors.values():
            return
        if self._guard is not None and self._guard.failing and not probing:
            return  # children cannot start now: the guard's probe will try, at its pace
        reason = self._recycle_reason(child)
        if reason is None:
            return
        log_event(
            logger,
            logging.INFO,
            "recycling pooled runner; it serves until its successor is ready",
            pid=child.pid,
            reason=reason,
        )
        self._counts["child_recycles"] += 1
        self._successors[self._spawn()] = child

    async def _ping_loop(self) -> None:
        """Kills an idle child that stopped answering: a wedged interpreter cannot be trusted."""
        nonce = 0
        while True:
            await asyncio.sleep(self._ping_interval)
            nonce += 1
            now = time.monotonic()
            for child in list(self._children):
                if not child.started or child.exited or child.retiring:
                    continue
                self._maybe_recycle(child)  # age and memory, for a child with no jobs
                # A busy child may be blocked by its job's own code; that is the job
                # timeout's business. An idle one that stops answering is wedged.
                if child.inflight:
                    child.last_pong = now
                elif now - child.last_pong > 3 * self._ping_interval + self._kill_grace:
                    log_event(
                        logger,
                        logging.ERROR,
                        "pooled runner stopped answering, killing it",
                        pid=child.pid,
                    )
                    child.kill()
                else:
                    child.send(pipe.PingLine(nonce))

    async def stop(self, *, grace: float) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
        await self._stop_children(grace, retire=True)

    def status(self) -> RunnerStatus:
        serving = self._serving()
        return RunnerStatus(
            mode=self.mode,
            capacity=self.capacity,
            busy=sum(len(c.inflight) for c in self._children),
            startup_error=self._guard.error if self._guard is not None else None,
            details={
                "children": [
                    {
                        "pid": c.pid,
                        "ready": c.started,
                        "busy": len(c.inflight),
                        "jobs_run": c.jobs_run,
                        "rss": c.rss,
                        "retiring": c.retiring,
                        "successor": c in self._successors,
                    }
                    for c in self._children
                ],
                "serving": len(serving),
                "children_alive": sum(1 for c in self._children if not c.exited),
                **self._counts,
            },
        )
