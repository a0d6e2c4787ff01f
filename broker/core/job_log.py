"""One log line about one lease: the worker's, and its core's, way to name a job in the log.

The everyday events of a job that goes well are logged at DEBUG and cost nothing below
that level, because a worker logs about every job it runs.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from broker.model import logs
from broker.tasks.runner import LeaseKey


class JobTags(Protocol):
    """What a log line names a job by, besides its lease: a ``job`` message or an
    :class:`~broker.tasks.runner.Assignment`."""

    @property
    def task(self) -> str: ...
    @property
    def queue(self) -> str: ...
    @property
    def attempt(self) -> int: ...


def log_job(
    logger: logging.Logger,
    level: int,
    event: str,
    key: LeaseKey,
    job: JobTags | None = None,
    /,
    *,
    exc_info: BaseException | None = None,
    **fields: Any,
) -> None:
    """One log line about one lease: its ids, the ``job``'s task, queue and attempt when
    known, and ``fields``, as structured fields (see :func:`broker.model.logs.log_event`).

    The everyday events of a job that goes well (started, completed, acknowledged) are
    logged at DEBUG, and nothing is built before the level check: at a thousand jobs a
    second, three INFO lines per job were a seventh of the worker's CPU.
    """
    if not logger.isEnabledFor(level):
        return
    if job is not None:
        fields = {"task": job.task, "queue": job.queue, "attempt": job.attempt, **fields}
    logs.log_event(
        logger, level, event, job_id=key[0], handoff_id=key[1], exc_info=exc_info, **fields
    )
