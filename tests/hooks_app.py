"""Tasks and worker hooks for ``tests/e2e/test_hooks.py``.

Imported only by real worker and child processes (``--app tests.hooks_app``), never by the
test process: its hooks go into the process-wide registry, and would wrap every other
test's inline jobs there.

Each process appends what its hooks did, one ``event pid`` line per write, to the file
named by :data:`EVENTS_ENV`, so a test reads who ran which hook.
"""

from __future__ import annotations

import contextvars
import os
import threading
import time

from broker import JobContext, JobMiddleware, add_middleware, current_job, on_shutdown, on_startup
from broker.tasks.registry import task
from tests.app_env import EVENTS_ENV, FAIL_ENV, HANG_ENV, SLOW_ENV

RESOURCE: dict[str, int] = {}
"""What the start-up hook made (here, the pid it ran in): a module global, which this
process's jobs read."""

REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar("request", default=None)
"""Set by the middleware's ``before`` in the job's context, read by the job."""


def record(event: str) -> None:
    path = os.environ.get(EVENTS_ENV)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{event} {os.getpid()}\n".encode())
        finally:
            os.close(fd)


@on_startup
async def open_resource() -> None:
    if os.environ.get(FAIL_ENV):
        raise RuntimeError("the resource is down")
    seconds = float(os.environ.get(SLOW_ENV, "0"))
    if seconds:
        time.sleep(seconds)  # the slow start-up under test, not a wait for an event
    RESOURCE["pid"] = os.getpid()
    record("startup")


@on_shutdown
def close_resource() -> None:
    record("shutdown")
    if os.environ.get(HANG_ENV):
        threading.Event().wait()  # a hook that hangs: the worker must stop this process


class Tagging(JobMiddleware):
    """A plain middleware: refuses the ``refused`` task, tags every other job."""

    def before(self, job: JobContext) -> None:
        if job.task.endswith(".refused"):
            raise PermissionError("this middleware refuses the job")
        REQUEST.set(f"request-{job.job_id}")

    def on_failure(self, job: JobContext, error: BaseException) -> None:
        record(f"failure:{job.task.rsplit('.', 1)[1]}")


class Recording(JobMiddleware):
    """An async middleware (inside ``Tagging``): records each job's end."""

    async def after(self, job: JobContext, result: object) -> None:
        record(f"after:{job.task.rsplit('.', 1)[1]}")


add_middleware(Tagging())
add_middleware(Recording())


def _seen() -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "resource": RESOURCE.get("pid"),
        "request": REQUEST.get(),
        "job": str(current_job().job_id),
    }


@task(mode="inline")
async def seen_inline() -> dict[str, object]:
    return _seen()


@task(mode="inline")
def seen_inline_sync() -> dict[str, object]:
    return _seen()


@task(mode="pooled")
async def seen_pooled() -> dict[str, object]:
    return _seen()


@task(mode="pooled")
def seen_pooled_sync() -> dict[str, object]:
    return _seen()


@task(mode="forked")
async def seen_forked() -> dict[str, object]:
    return _seen()


@task(mode="forked")
def seen_forked_sync() -> dict[str, object]:
    return _seen()


@task(mode="pooled", retries=3, dont_retry_on=(PermissionError,))
def refused() -> None:
    raise AssertionError("the middleware's before hook should have stopped this job")
