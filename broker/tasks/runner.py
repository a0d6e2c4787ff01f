"""The runner interface: how a worker hands a job to whatever executes it.

The worker never knows *how* a job runs (on its own loop, in a warm child, in a
fresh process); it only asks a runner for free slots and awaits an outcome.
Runners live in the ``runners`` package and are wired in by the composition root,
so the core never imports them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from broker.exceptions import CheckpointRejectedError
from broker.jobs import ExecutionMode, JSONValue
from broker.model.values import check_delay


@dataclass(frozen=True, slots=True)
class Assignment:
    """One job as a runner receives it: everything needed to run it, and its lease."""

    job_id: uuid.UUID
    handoff_id: uuid.UUID
    task: str
    args: tuple[JSONValue, ...]
    kwargs: dict[str, JSONValue]
    execution_mode: ExecutionMode
    attempt: int
    max_attempts: int
    timeout: float | None
    """The job's own time limit, if it has one. It counts from the job's start: a pooled
    or forked runner starts the clock once a ready child has the job, never while its
    child is still starting (that is bounded by the runner's start-up timeout)."""
    queue: str
    checkpoint: JSONValue = None
    """The last checkpoint of the job's earlier runs (see :mod:`broker.tasks.context`)."""
    checkpoint_seq: int = 0
    """How many checkpoints the job's runs saved; 0: this run starts afresh."""
    recoveries: int = 0
    """Attempts of this job lost before this one (its worker, child or connection died):
    more than 0 means this attempt is a recovery."""
    state_lost: bool = False
    """The job keeps local state (``@task(local_state=True)``), but this attempt runs on
    another worker than the one that held it (or that worker said it lost it): whatever
    the last attempt kept on its machine is not here."""
    trace_context: dict[str, str] | None = None
    """The W3C trace context of the span that enqueued the job, the parent of the span of
    its run (:func:`broker.model.tracing.run_span`)."""


@dataclass(frozen=True, slots=True)
class Completed:
    result: JSONValue = None


@dataclass(frozen=True, slots=True)
class Failed:
    error: str
    retry: bool = True
    """``False`` when retrying cannot help (an unknown task, say): the job dies at once."""
    retry_delay: float | None = None
    """Seconds before the next run, from the task's own backoff (``None``: the main's)."""
    lost: bool = False
    """The attempt did not fail by itself: the process running it died under it. The main
    counts a recovery instead of a failure, and runs the job again at once."""


@dataclass(frozen=True, slots=True)
class Rescheduled:
    delay: float


@dataclass(frozen=True, slots=True)
class Released:
    """The job never started (its runner could not start a process for it): give it back
    to the queue without counting an attempt. The worker forgives only a few of these per
    job (:data:`broker.model.bounds.RUNNER_START_FAILURES_FORGIVEN`); each later one counts as a
    failed attempt, so a job whose processes keep failing to start cannot go back for ever."""

    reason: str


RunOutcome = Completed | Failed | Rescheduled | Released


class Reschedule(Exception):
    """Raise inside a task to run it again after ``delay`` seconds without using a retry.

    ``delay`` must be from 0 to ten years (:data:`broker.model.values.MAX_DELAY_SECONDS`);
    another value raises ``ValueError`` right here, so the task fails with a clear error
    in the worker instead of reporting a time no store can hold.
    """

    def __init__(self, delay: float) -> None:
        check_delay("Reschedule delay", delay)
        super().__init__(f"reschedule in {delay} s")
        self.delay = delay


@dataclass
class RunnerStatus:
    """What the worker shows about a runner in its status (and the operator's CLI)."""

    mode: ExecutionMode
    capacity: int
    busy: int
    startup_error: str | None = None
    details: dict[str, JSONValue] = field(default_factory=dict)


LeaseKey = tuple[uuid.UUID, uuid.UUID]
"""``(job_id, handoff_id)``: one handoff of one job."""


class JobChannel(Protocol):
    """Where a running job's checkpoints and progress go: the worker, which sends them to
    the main (a pooled or forked child's channel is its pipe to the worker)."""

    def save_checkpoint(self, key: LeaseKey, seq: int, state: JSONValue) -> Awaitable[None]:
        """Resolves once checkpoint ``seq`` of the job under lease ``key`` is durable, or
        raises why it was not saved (the lease is gone, it is too large)."""

    def report_progress(self, key: LeaseKey, fraction: float, message: str) -> None:
        """Pass on the job's latest progress; the worker rate-limits what it sends."""


class NoChannel:
    """The channel of a runner that no worker has connected (one driven on its own, in a
    test say): checkpoints are refused, progress goes nowhere."""

    async def save_checkpoint(self, key: LeaseKey, seq: int, state: JSONValue) -> None:
        raise CheckpointRejectedError("this runner has no worker to save checkpoints")

    def report_progress(self, key: LeaseKey, fraction: float, message: str) -> None:
        return None


class Runner(Protocol):
    """Executes jobs of one execution mode with a bounded number of slots."""

    @property
    def mode(self) -> ExecutionMode: ...

    def free_slots(self) -> int:
        """Slots that can take a job right now; the worker advertises exactly this."""

    def set_capacity_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever ``free_slots`` may have changed on the runner's own
        account (a child died, a replacement started), so the worker re-advertises."""

    def set_job_channel(self, channel: JobChannel) -> None:
        """Where the jobs this runner runs send their checkpoints and progress (see
        :mod:`broker.tasks.context`); the worker sets itself before :meth:`start`."""

    async def start(self) -> None: ...

    def run(self, assignment: Assignment) -> asyncio.Future[RunOutcome]:
        """Start one job and return the future of its outcome. Job errors become
        ``Failed``; the future never fails for them. Takes the job's slot before it
        returns, so the caller's count is exact. A future, not a coroutine: the worker
        settles a job with a callback on it, and a task per job was a tenth of its CPU.
        Cancelling the future only stops waiting for it; :meth:`cancel` stops the job."""

    async def cancel(self, job_id: uuid.UUID) -> bool:
        """Stop a running job (its outcome becomes ``Failed``); ``False`` if unknown."""

    async def stop(self, *, grace: float) -> None:
        """Stop taking jobs, give running ones ``grace`` seconds, then stop them hard."""

    def status(self) -> RunnerStatus: ...
