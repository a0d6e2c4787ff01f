"""What :class:`~broker.core.worker_state.WorkerState` asks its shell to do: the effects
its events return.

Each is a frozen value the worker's shell (:mod:`broker.worker.worker`) carries out:
start or stop a run, wake the sender, begin or hurry the drain, wake a task waiting on
its checkpoint, set a timer for progress or reports held back. Messages to send are not effects:
the sender pulls them (:meth:`~broker.core.worker_state.WorkerState.outgoing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from broker.jobs import ExecutionMode
from broker.tasks.runner import Assignment, LeaseKey


@dataclass(frozen=True, slots=True)
class StartRun:
    """Hand this job to the runner for its mode; call :meth:`WorkerState.run_entered`
    when the runner takes its slot and :meth:`WorkerState.run_finished` when it ends."""

    assignment: Assignment


@dataclass(frozen=True, slots=True)
class StopRun:
    """Ask the runner for ``mode`` to stop the job under this lease; its outcome still
    arrives through :meth:`WorkerState.run_finished`."""

    key: LeaseKey
    mode: ExecutionMode


@dataclass(frozen=True, slots=True)
class WakeSender:
    """Messages wait in :meth:`WorkerState.outgoing` / :meth:`WorkerState.take_ready`:
    wake the sender."""


@dataclass(frozen=True, slots=True)
class Drain:
    """Draining began: stop the serving loop and run the drain sequence (wait for the
    running jobs, then for the last acknowledgements)."""


@dataclass(frozen=True, slots=True)
class StopFast:
    """Stop waiting for running jobs: stop them now and give them back."""


@dataclass(frozen=True, slots=True)
class CheckpointSettled:
    """Checkpoint ``seq`` of this lease is settled: wake its task. ``code`` ``None``: it is
    durable; else the error code (:mod:`broker.wire.errors`) and ``message`` it failed with."""

    key: LeaseKey
    seq: int
    code: str | None = None
    message: str | None = None


@dataclass(frozen=True, slots=True)
class ProgressLater:
    """Progress is held back by the rate limit: call :meth:`WorkerState.progress_due`
    after ``delay`` seconds."""

    delay: float


@dataclass(frozen=True, slots=True)
class ReportsLater:
    """Reports of short runs wait for the next ``ready``: call
    :meth:`WorkerState.reports_due` after ``delay`` seconds, the most they wait
    (:data:`~broker.core.window.REPORT_HOLD`)."""

    delay: float


WorkerEffect: TypeAlias = (
    StartRun
    | StopRun
    | WakeSender
    | Drain
    | StopFast
    | CheckpointSettled
    | ProgressLater
    | ReportsLater
)
