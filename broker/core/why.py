"""Why a job waits, without I/O: the one rule behind ``wait_reason`` in ``get_job``,
``broker job ID`` and the dashboard's job page.

A queued job that is due and not running is waiting for something only the dispatching
main knows (its queue paused, a rate limit's next token, a worker that declares its task
or serves its queue, its state holder, a free slot); a ``waiting`` job waits on its
parents. :func:`wait_reason` reads the main's state (:class:`broker.core.handoff.Handoff`
and its :class:`~broker.core.flow.FlowControl`) and says which, in words an operator can
act on, the first that applies in the order the dispatcher itself checks them. ``None``:
nothing holds the job back that the main knows of (it is not queued, not due yet, or
about to go).
"""

from __future__ import annotations

from datetime import datetime

from broker.core.handoff import Handoff
from broker.jobs import Job, JobStatus


def _seconds(wait: float) -> str:
    return f"{wait:.3f}".rstrip("0").rstrip(".") + " s" if wait > 0 else "now"


def undeclared(task: str) -> str:
    """Why the jobs of ``task`` wait when no connected worker declares it (also what
    ``broker status`` says of such a task)."""
    return f"no connected worker declares task {task!r}"


def wait_reason(job: Job, core: Handoff, now: float, wall: datetime) -> str | None:
    """Why ``job`` is not running, as the dispatching main sees it at loop time ``now``
    and wall-clock time ``wall``; ``None`` when nothing the main knows of holds it back.
    Spends nothing and changes nothing (unlike the flow's ``admits``)."""
    if job.status is JobStatus.WAITING:
        return "waiting on its parent jobs (workflow): it is queued once they end"
    if job.status is not JobStatus.QUEUED or job.run_at > wall:
        return None
    flow = core.flow
    settings = flow.settings.get(job.queue)
    if settings is not None and settings.paused:
        return f"queue {job.queue!r} is paused (`broker queue resume {job.queue}`)"
    wait = flow.token_wait(job.queue, now)
    if wait > 0 and settings is not None and settings.rate is not None:
        return (
            f"waiting for the rate limit of queue {job.queue!r} ({settings.rate}): "
            f"the next token in {_seconds(wait)}"
        )
    if flow.limits(job.task):
        wait = flow.task_wait(job.task, job.rate_key, now)
        if wait > 0:
            rate = flow.task_rates[job.task]
            whose = (
                f"key {job.rate_key or ''!r} of task {job.task!r}"
                if job.task in flow.keyed
                else f"task {job.task!r}"
            )
            return (
                f"waiting for the rate limit of {whose} ({rate}): the next token in "
                f"{_seconds(wait)}"
            )
    if core.unserved([job.task]):
        return undeclared(job.task)
    served = core.served_queues()
    if served is not None and job.queue not in served:
        return f"no connected worker serves queue {job.queue!r}"
    holder = core.awaiting.get(job.id)
    if holder is not None:
        return f"waiting for worker {holder!r}, which holds its local state (affinity)"
    mode = job.execution_mode
    if core.credit(mode) == 0:
        if not any(mode in peer.modes for peer in core.workers()):
            # Not a busy fleet but one that cannot run the job at all: a job enqueued by
            # name before any worker declared its task gets ``pooled`` (the broker's
            # default), which a worker serving only the task's declared mode never takes.
            return f"no connected worker runs {mode.value} jobs"
        return f"no connected worker has a free {mode.value} slot"
    return None
