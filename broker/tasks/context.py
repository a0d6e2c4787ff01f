"""What a running task can ask about its own job, and how it saves checkpoints and progress.

A task asks for its context with :func:`current_job` (the shape of Celery's
``self.request`` or a Temporal activity's ``activity.info()``, without a ``bind=True``
or an extra parameter, so a task's signature stays the arguments it is enqueued with)::

    @task
    async def crunch(path: str) -> int:
        job = broker.current_job()
        start = job.last_checkpoint["row"] if job.is_continuation else 0
        for row in range(start, total):
            ...
            await job.checkpoint({"row": row + 1})  # returns once it is durable
            job.progress((row + 1) / total, f"row {row + 1} of {total}")

A sync task calls :meth:`JobContext.checkpoint_sync` instead. The context is the same in
every runner: the inline runner builds it in the worker, a pooled or forked child builds
it in the child, and each hands it a :class:`JobChannel` that carries checkpoints and
progress to the worker (the child's goes over its pipe). The worker sends them to the
main, which stores a checkpoint under the job's lease and only then acknowledges it.

What the assignment says about the job (its id, attempt, last checkpoint, and whatever
later fields say about how this attempt came to be) is read through the context's
properties, so a field added to :class:`~broker.tasks.runner.Assignment` needs one property.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import uuid

from broker.jobs import JSONValue
from broker.tasks.runner import Assignment, JobChannel

_CURRENT: contextvars.ContextVar[JobContext | None] = contextvars.ContextVar(
    "broker_current_job", default=None
)


def current_job() -> JobContext:
    """The context of the job the calling task runs for.

    :raises RuntimeError: called outside a task run by a worker (a task function called
        directly, in a test say, has no job).
    """
    context = _CURRENT.get()
    if context is None:
        raise RuntimeError(
            "broker.current_job() is only available inside a task run by a worker "
            "(not in a task function called directly)"
        )
    return context


def running_job() -> JobContext | None:
    """The context of the job the calling task runs for, or ``None`` outside one: for code
    that must not fail there (a child tags its jobs' output lines with their ids)."""
    return _CURRENT.get()


class JobContext:
    """One run of one job, as its task sees it (see the module docstring)."""

    def __init__(
        self,
        assignment: Assignment,
        channel: JobChannel,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._assignment = assignment
        self._channel = channel
        self._loop = loop
        self._next_seq = assignment.checkpoint_seq + 1
        self._last = assignment.checkpoint
        self._key = (assignment.job_id, assignment.handoff_id)

    def enter(self, context: contextvars.Context) -> None:
        """Make this the job :func:`current_job` returns inside ``context`` (the copy of
        the context the task runs in)."""
        context.run(_CURRENT.set, self)

    @property
    def job_id(self) -> uuid.UUID:
        return self._assignment.job_id

    @property
    def task(self) -> str:
        return self._assignment.task

    @property
    def queue(self) -> str:
        return self._assignment.queue

    @property
    def attempt(self) -> int:
        """This run's number among those that count against :attr:`max_attempts`, from 1:
        a failure retry counts one more; a lost run does not (it is a recovery, counted in
        :attr:`recoveries`), so a recovery runs with the same number as the lost run."""
        return self._assignment.attempt

    @property
    def max_attempts(self) -> int:
        return self._assignment.max_attempts

    @property
    def recoveries(self) -> int:
        """Attempts of this job lost before this one (its worker, child or connection
        died): more than 0 means this run is a recovery."""
        return self._assignment.recoveries

    @property
    def state_lost(self) -> bool:
        """The job keeps local state (``@task(local_state=True)``) that this worker does
        not hold: the attempt that built it was lost elsewhere, and its worker did not
        come back within the affinity grace (or said its state is gone)."""
        return self._assignment.state_lost

    @property
    def is_continuation(self) -> bool:
        """Whether an earlier run of this job saved a checkpoint (this run should resume
        from :attr:`last_checkpoint` rather than start over)."""
        return self._assignment.checkpoint_seq > 0

    @property
    def last_checkpoint(self) -> JSONValue:
        """The newest checkpoint saved for this job: by an earlier run at first, then by
        this one's acknowledged saves; ``None`` when there is none (see
        :attr:`is_continuation`, since ``None`` may be a checkpoint too)."""
        return self._last

    async def checkpoint(self, state: JSONValue) -> None:
        """Save ``state`` (plain JSON) as this job's checkpoint; returns once it is durable.

        The next attempt of this job, whatever ends this one (a failure, a crash, a lost
        worker), receives the newest checkpoint acknowledged here, or a newer one whose
        acknowledgement was lost on the way.

        :raises PayloadTooLargeError: ``state`` is over the main's checkpoint limit.
        :raises CheckpointRejectedError: this run's lease is no longer the job's (the
            main gave the job to another worker): stop, the work is someone else's now.
        :raises TypeError: ``state`` is not plain JSON.
        """
        _check_json(state)
        seq = self._next_seq
        self._next_seq += 1
        await self._channel.save_checkpoint(self._key, seq, state)
        self._last = state

    def checkpoint_sync(self, state: JSONValue) -> None:
        """:meth:`checkpoint` for a sync task (it runs in a thread of its own): blocks
        until the checkpoint is durable, and raises as :meth:`checkpoint` does."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError("an async task saves with `await job.checkpoint(state)`")
        asyncio.run_coroutine_threadsafe(self.checkpoint(state), self._loop).result()

    def progress(self, fraction: float, message: str = "") -> None:
        """Report how far the job is (``fraction`` from 0 to 1) with a short ``message``.

        Never blocks and is never acknowledged; the worker sends at most one update per
        job a second (the latest), and the main stores the last it got (a crash may lose
        it). Callable from async and sync tasks alike.
        """
        if not isinstance(fraction, int | float) or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"progress fraction must be from 0 to 1, got {fraction!r}")
        if not isinstance(message, str):
            raise TypeError("progress message must be a string")
        self._loop.call_soon_threadsafe(
            self._channel.report_progress, self._key, float(fraction), message
        )


def _check_json(state: JSONValue) -> None:
    try:
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a checkpoint must be plain JSON: {exc}") from None
    except RecursionError:
        raise TypeError("a checkpoint must be plain JSON: it nests too deeply") from None


__all__ = ["JobContext", "current_job"]
