"""The worker's rules about one job's outcome, apart from the state that tracks it: how
its task judges a failure, and whether its report or checkpoint fits what the main takes.

:class:`~broker.core.worker_state.WorkerState` applies them; each is a value or a
function of its inputs (the main's limits come from ``welcome``), tested on its own.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from broker.jobs import JSONValue
from broker.model.bounds import (
    MESSAGE_CONTAINERS,
    RUNNER_START_FAILURES_FORGIVEN,
    RUNNER_START_FAILURES_TRACKED,
)
from broker.payload import (
    containers_in,
    encoded_size,
    result_too_deep,
    result_too_large_on_wire,
    shape_problem,
    too_many_containers,
)
from broker.retry import RetryPolicy, TaskBackoff, backoff_seconds, reported_exception
from broker.tasks.runner import Completed, Failed, LeaseKey, Released, Rescheduled, RunOutcome
from broker.wire import messages as protocol
from broker.wire.codec import encode_item
from broker.wire.messages import ErrorCode


class MainLimits(Protocol):
    """What the main said in ``welcome`` it takes from this worker."""

    max_line_bytes: int
    max_payload_bytes: int | None
    max_payload_depth: int
    max_checkpoint_bytes: int | None
    max_payload_containers: int | None
    """The main's container bound (``None``: an older main, which has none)."""


@dataclass(frozen=True, slots=True)
class RetryRules:
    """What a running job's task declares about its failures, and which run this is."""

    policy: RetryPolicy | None
    backoff: TaskBackoff | None
    attempt: int

    def judge(self, outcome: Failed) -> Failed:
        """The failure as the task's rules judge it: one its policy's exception rules out
        is not retried (and says why); one that is retried waits what the task's backoff
        says. An exception this process cannot name is retried, as without a policy: only
        a declared rule ends a job early.

        The backoff is the task's own function, called here with the number of failures
        (this run's attempt). A wait it cannot give (it raised, or returned a negative,
        endless or non-numeric value) is refused: the failure goes without one, so the
        main's backoff applies, and the job's error says why."""
        if self.policy is not None:
            error = reported_exception(outcome.error)
            if error is not None and not self.policy.retries(error):
                return Failed(
                    f"{outcome.error}\n(not retried: the task's retry policy excludes "
                    f"{error.__qualname__})",
                    retry=False,
                )
        if self.backoff is None:
            return outcome
        try:
            wait = backoff_seconds(self.backoff, self.attempt)
        except ValueError as exc:
            return Failed(f"{outcome.error}\n({exc}; the main's backoff applies)")
        return Failed(outcome.error, retry_delay=wait)


class ProgressThrottle:
    """The progress of running jobs on its way out: a task may report on every row, the
    latest of each job goes out at most once per ``interval`` seconds (the first at
    once), and older values not sent yet are dropped."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self.latest: dict[LeaseKey, tuple[float, str]] = {}
        """The latest progress of each running job not sent yet."""
        self._sent: dict[LeaseKey, float] = {}
        """When each running job's progress last went out (the rate limit's clock)."""
        self.timer = False
        """A timer is set to look again (a :class:`~broker.core.worker_effects.ProgressLater`
        not yet fired): no second one is needed."""

    def forget(self, key: LeaseKey) -> None:
        """The job ended: its outcome supersedes any progress not sent yet. (Each look-up
        hashes two UUIDs in Python, so the usually empty maps are not looked in.)"""
        if self.latest:
            self.latest.pop(key, None)
        if self._sent:
            self._sent.pop(key, None)

    def plan(self, now: float) -> tuple[bool, float | None]:
        """Whether some progress may go at ``now``, and the delay of a timer to set for
        the rest (``None``: none held back, or a timer is already set)."""
        waits = [self._wait(key, now) for key in self.latest]
        later = [wait for wait in waits if wait > 0]
        delay = None
        if later and not self.timer:
            self.timer = True
            delay = min(later)
        return min(waits) <= 0, delay

    def take_due(self, now: float) -> list[protocol.Progress]:
        """The progress messages that may go at ``now``; they count as sent."""
        due: list[protocol.Progress] = []
        for key, (fraction, message) in list(self.latest.items()):
            if self._wait(key, now) <= 0:
                due.append(protocol.Progress(*key, fraction=fraction, message=message))
                self._sent[key] = now
                del self.latest[key]
        return due

    def _wait(self, key: LeaseKey, now: float) -> float:
        sent = self._sent.get(key)
        return 0.0 if sent is None else sent + self._interval - now


def fit_report(
    key: LeaseKey, report: protocol.Report, limits: MainLimits
) -> tuple[protocol.Report, bytes, str | None]:
    """``report`` as the main can take it, with its encoding, and ``None``; or, when the
    main could not take it, a failure that says why, its encoding, and why.

    Without this, a result the main rejects (too long, not JSON) would close the
    connection, come back from the outbox on reconnect, and close it again forever;
    and a result nested too deeply to encode would take the send loop down, with the
    job handed to the next worker to do the same. A result over the main's payload
    limits (from ``welcome``) fails here, as the main would fail it, without being sent.
    """
    limit = limits.max_line_bytes
    completed = report if isinstance(report, protocol.CompletedReport) else None
    problem = None
    containers = limits.max_payload_containers
    if completed is not None:
        # Shape first: encoding a value nested too deeply would itself recurse too far,
        # and the walk stops at the container bound, so a huge result costs little.
        problem = result_too_deep(completed.result, limits.max_payload_depth, containers)
    if problem is None:
        try:
            encoded = encode_item(report)
        except ValueError as exc:
            problem = f"the outcome cannot be sent as JSON: {exc}"
        else:
            size = len(encoded)
            if completed is not None:
                problem = result_too_large_on_wire(completed.result, size, limits.max_payload_bytes)
            if (
                problem is None
                and containers is not None
                and containers_in(encoded) > containers + MESSAGE_CONTAINERS - 2
            ):
                # The main counts ``[`` and ``{`` in the line, strings included.
                problem = too_many_containers(f"the {report.type} report", containers)
            if problem is None and size <= limit:
                return report, encoded, None
            problem = problem or (
                f"the {report.type} report is {size} bytes, over the main's limit of {limit}"
            )
    if isinstance(report, protocol.FailedReport):
        # Keep the retry decision; JSON spends at most 6 bytes on a character.
        error = report.error[: limit // 8]
        fitted = protocol.FailedReport(
            *key,
            error=error,
            retry=report.retry,
            retry_delay=report.retry_delay,
            lost=report.lost,
        )
    else:
        fitted = protocol.FailedReport(*key, error=problem[:1000], retry=False)
    return fitted, encode_item(fitted), problem


def checkpoint_refusal(state: JSONValue, limits: MainLimits | None) -> tuple[ErrorCode, str] | None:
    """Why the main would refuse checkpoint ``state`` (its code and message), so the task
    hears it at once instead of after a round trip; ``None`` when it may go (or no main
    is connected to say its limits)."""
    if limits is None:
        return None
    shape = shape_problem(
        state, limits.max_payload_depth, limits.max_payload_containers, "the checkpoint"
    )
    if shape is not None:
        return ErrorCode.PAYLOAD_TOO_LARGE, f"{shape}; flatten it"
    limit = limits.max_checkpoint_bytes
    if limit is not None:
        size = encoded_size(state)
        if size > limit:
            return ErrorCode.PAYLOAD_TOO_LARGE, (
                f"the checkpoint is {size} bytes as JSON, over the main's checkpoint "
                f"limit of {limit} bytes; keep large state elsewhere and checkpoint a "
                "reference to it"
            )
    return None


def report_for(
    key: LeaseKey, outcome: RunOutcome, cancelled: bool, given_up: bool
) -> tuple[protocol.Report, int, str, dict[str, Any]]:
    """The report a run's ``outcome`` becomes, with the level, event and fields of its
    log line. A job the main ``cancelled`` ends as the runner worded it (the main
    answers ``stale``: the cancel working); a job this worker ``given_up`` at its drain
    deadline goes back to the queue unharmed instead of failing."""
    match outcome:
        case Completed(result=result):
            return protocol.CompletedReport(*key, result=result), logging.DEBUG, "job completed", {}
        case Failed() | Released() if cancelled:
            report: protocol.Report = (
                protocol.FailedReport(*key, error=outcome.error, retry=outcome.retry)
                if isinstance(outcome, Failed)
                else protocol.ReleaseReport(*key, reason=outcome.reason)
            )
            return report, logging.INFO, "job stopped by its cancel", {}
        case Failed() if given_up:
            report = protocol.ReleaseReport(*key, reason="the worker stopped before the job ended")
            return report, logging.WARNING, "job given back", {"error": outcome.error}
        case Failed(error=error, lost=True):
            report = protocol.FailedReport(*key, error=error, lost=True)
            return report, logging.WARNING, "job attempt lost", {"error": error}
        case Failed(error=error, retry=retry, retry_delay=wait):
            report = protocol.FailedReport(*key, error=error, retry=retry, retry_delay=wait)
            return report, logging.WARNING, "job failed", {"error": error, "retry": retry}
        case Released(reason=reason):
            report = protocol.ReleaseReport(*key, reason=reason)
            return report, logging.WARNING, "job released by its runner", {"reason": reason}
        case Rescheduled(delay=delay):
            try:
                report = protocol.RescheduleReport(*key, delay=delay)
            except ValueError as exc:
                report = protocol.FailedReport(*key, error=f"invalid reschedule: {exc}")
            return report, logging.INFO, "job rescheduled", {"delay": delay}


def start_failed(
    failures: dict[uuid.UUID, int], job_id: uuid.UUID, outcome: Released
) -> RunOutcome:
    """The runner could not start a process for the job (it failed to import the apps,
    crashed or hung before its handshake): the runner's fault, not the job's, so the
    job goes back to the queue unharmed, and the runner's start-up guard stops the
    mode's credit until a process starts again.

    But when processes start for the mode's probe and keep failing for one job, that
    job would go back and forth for ever. So past
    :data:`~broker.model.bounds.RUNNER_START_FAILURES_FORGIVEN` failures for one job on this
    worker (counted in ``failures``, least recently failed first, at most
    :data:`~broker.model.bounds.RUNNER_START_FAILURES_TRACKED` jobs), each counts as a
    failed attempt, retried by the job's rules like any failure: the job ends, dead with
    that error once its attempts are spent.
    """
    count = failures.pop(job_id, 0) + 1
    failures[job_id] = count  # now the most recent
    if len(failures) > RUNNER_START_FAILURES_TRACKED:
        del failures[next(iter(failures))]
    if count <= RUNNER_START_FAILURES_FORGIVEN:
        return outcome
    return Failed(
        f"its runner process failed to start {count} times for this job (after "
        f"{RUNNER_START_FAILURES_FORGIVEN}, each failure counts as an attempt); "
        f"the last time: {outcome.reason}"
    )
