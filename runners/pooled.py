"""The pooled runner: warm child processes that import the app once and run many jobs.

Capacity is ``count x concurrency`` slots, and :meth:`PooledRunner.free_slots` is
exact: busy slots on live children are taken away, and a child that is retiring
or dead gives its place to a replacement, which is counted as free (it is spawned
on demand). The worker advertises that number as credit, so one readiness message
can fill the whole pool.

Children are recycled after a job's outcome is in, never in the middle of one:
past ``max_jobs`` jobs, ``max_rss_bytes`` of memory or ``max_lifetime`` seconds a
child takes no more work, exits once idle, and a replacement starts at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence

from broker import checks
from broker.jobs import ExecutionMode
from broker.runner import Assignment, Released, RunnerStatus, RunOutcome
from broker.tasks import TaskRegistry, default_registry
from runners.process import (
    ChildProcess,
    StartupGuard,
    cancel_on,
    run_on_child,
    timeout_for,
)

logger = logging.getLogger("broker.runner.pooled")


class PooledRunner:
    def __init__(
        self,
        apps: Sequence[str],
        *,
        registry: TaskRegistry | None = None,
        count: int | None = None,
        concurrency: int = 1,
        max_jobs: int = 100,
        max_rss_bytes: int = 512 << 20,
        max_lifetime: float = 3600.0,
        default_timeout: float | None = None,
        kill_grace: float = 5.0,
        startup_timeout: float = 30.0,
        ping_interval: float = 5.0,
        respawn_max_delay: float = 30.0,
    ) -> None:
        self._apps = list(apps)
        self._registry = default_registry if registry is None else registry
        self._count = checks.positive_int("pooled runner count", count or os.cpu_count() or 1)
        self._concurrency = checks.positive_int("pooled runner concurrency", concurrency)
        self._max_jobs = checks.positive_int("max jobs per pooled runner", max_jobs)
        self._max_rss = checks.positive_int("max RSS bytes per pooled runner", max_rss_bytes)
        self._max_lifetime = checks.positive("max pooled runner lifetime", max_lifetime)
        self._default_timeout = checks.optional(checks.positive, "job timeout", default_timeout)
        self._kill_grace = checks.positive("kill grace", kill_grace)
        self._startup_timeout = checks.positive("runner start-up timeout", startup_timeout)
        self._ping_interval = checks.positive("runner ping interval", ping_interval)
        self._respawn_max_delay = checks.positive("respawn delay cap", respawn_max_delay)
        self._children: list[ChildProcess] = []
        self._listener: Callable[[], None] = lambda: None
        self._guard: StartupGuard | None = None
        self._pinger: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._counts = {"child_starts": 0, "child_crashes": 0, "child_recycles": 0}
        """Counted for the worker's metrics (``broker_worker_child_*``)."""

    @property
    def mode(self) -> ExecutionMode:
        return ExecutionMode.POOLED

    @property
    def capacity(self) -> int:
        return self._count * self._concurrency

    def _serving(self) -> list[ChildProcess]:
        return [c for c in self._children if not c.retiring and not c.exited]

    def free_slots(self) -> int:
        if self._stopping or (self._guard is not None and self._guard.failing):
            return 0
        serving = self._serving()
        spawnable = self._count - len(serving)
        room = sum(c.free for c in serving) + spawnable * self._concurrency
        # A retiring child still finishing jobs counts against capacity, so its
        # replacement cannot push the pool past count x concurrency meanwhile.
        busy = sum(len(c.inflight) for c in self._children)
        return max(0, min(room, self.capacity - busy))

    def set_capacity_listener(self, listener: Callable[[], None]) -> None:
        self._listener = listener

    async def start(self) -> None:
        self._stopping = False
        self._guard = StartupGuard(self._spawn, self._listener, max_delay=self._respawn_max_delay)
        for _ in range(self._count):
            self._spawn()
        self._pinger = asyncio.create_task(self._ping_loop(), name="broker-pool-ping")

    def _spawn(self) -> ChildProcess:
        child = ChildProcess(
            apps=self._apps,
            concurrency=self._concurrency,
            one_shot=False,
            on_exit=self._on_exit,
            startup_timeout=self._startup_timeout,
        )
        self._children.append(child)
        self._counts["child_starts"] += 1
        watcher = asyncio.create_task(self._watch_start(child))
        self._background.add(watcher)
        watcher.add_done_callback(self._background.discard)
        return child

    async def _watch_start(self, child: ChildProcess) -> None:
        try:
            await child.wait_ready()
        except Exception:
            return
        logger.info("pooled runner started pid=%s", child.pid)
        assert self._guard is not None
        self._guard.succeeded()

    def _on_exit(self, child: ChildProcess) -> None:
        if child in self._children:
            self._children.remove(child)
        if self._stopping:
            return
        if not child.started:
            assert self._guard is not None
            self._guard.failed(child.startup_error or "the runner process did not start")
            return
        if "cancelled" in child.kill_reasons.values():  # stopped by cancel_on, on purpose
            logger.info("pooled runner stopped to cancel a job pid=%s; replacing it", child.pid)
        elif not child.retiring:
            self._counts["child_crashes"] += 1
            logger.warning(
                "pooled runner died pid=%s exit=%s; its slots are free again",
                child.pid,
                child.exit_code,
            )
        self._listener()

    def _pick(self) -> ChildProcess | None:
        """The ready child with the most free slots (least loaded), else a starting one."""
        candidates = [c for c in self._serving() if c.free > 0]
        if not candidates:
            return None
        return max(candidates, key=lambda c: (c.started, c.free, -c.jobs_run))

    async def run(self, assignment: Assignment) -> RunOutcome:
        if self.free_slots() <= 0:
            raise RuntimeError("no free pooled slot: check free_slots() before run()")
        child = self._pick()
        if child is None:
            child = self._spawn()
        child.reserve(assignment)
        timeout = timeout_for(assignment, self._registry, self._default_timeout)
        outcome = await run_on_child(child, assignment, timeout, self._kill_grace)
        if not isinstance(outcome, Released):
            self._maybe_recycle(child)
        return outcome

    def _maybe_recycle(self, child: ChildProcess) -> None:
        if child.exited or child.retiring:
            return
        reason = None
        if child.jobs_run >= self._max_jobs:
            reason = f"ran {child.jobs_run} jobs"
        elif child.rss >= self._max_rss:
            reason = f"uses {child.rss} bytes of memory"
        elif child.age >= self._max_lifetime:
            reason = f"is {child.age:.0f} s old"
        if reason is None:
            return
        logger.info("recycling pooled runner pid=%s: it %s", child.pid, reason)
        self._counts["child_recycles"] += 1
        child.retire()
        self._spawn()

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
                # A busy child may be blocked by its job's own code; that is the job
                # timeout's business. An idle one that stops answering is wedged.
                if child.inflight:
                    child.last_pong = now
                elif now - child.last_pong > 3 * self._ping_interval + self._kill_grace:
                    logger.error("pooled runner stopped answering, killing it pid=%s", child.pid)
                    child.kill()
                else:
                    child.send({"type": "ping", "nonce": nonce})

    async def cancel(self, job_id: uuid.UUID) -> bool:
        return await cancel_on(self._children, job_id, self._kill_grace)

    async def stop(self, *, grace: float) -> None:
        self._stopping = True
        if self._guard is not None:
            self._guard.cancel()
        if self._pinger is not None:
            self._pinger.cancel()
        busy = [f for c in self._children for f in c.inflight.values()]
        if busy and grace > 0:
            await asyncio.wait(busy, timeout=grace)
        children = list(self._children)
        for child in children:
            child.retire()
        await asyncio.gather(*(c.terminate(self._kill_grace) for c in children))

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
                    }
                    for c in self._children
                ],
                "serving": len(serving),
                "children_alive": sum(1 for c in self._children if not c.exited),
                **self._counts,
            },
        )
