"""Tasks for ``tests/e2e/test_checkpoints.py``, loaded with ``--app tests.checkpoint_app``.

Each run writes what it saw and did to ``ckpt-PID.log`` in ``CHECKPOINT_TEST_LOG_DIR``, a
line per event with ``time.monotonic()`` (one clock for every process of the machine),
one ``write`` per line (``O_APPEND``), so a ``kill -9`` never leaves a torn line:

* ``start T ATTEMPT FROM`` when a run begins (``FROM``: the step it resumes from,
  ``-`` for a fresh start);
* ``asked T N`` before a checkpoint of step ``N`` is saved, ``acked T N`` once the
  main acknowledged it, ``rejected T N`` when the save raised.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

from broker.exceptions import CheckpointRejectedError
from broker.tasks.context import current_job
from broker.tasks.registry import task

LOG_DIR_ENV = "CHECKPOINT_TEST_LOG_DIR"
"""Not ``BROKER_*``: a pooled child is given no broker variable."""


def _log(*words: object) -> None:
    path = os.path.join(os.environ[LOG_DIR_ENV], f"ckpt-{os.getpid()}.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        line = " ".join(str(w) for w in (words[0], time.monotonic(), *words[1:]))
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


@task
async def count_up(total: int, pause: float = 0.02, fail_at: int = 0) -> int:
    """Count to ``total``, checkpointing every step and reporting progress; the first
    attempt raises at step ``fail_at`` (0: never)."""
    job = current_job()
    start = job.last_checkpoint["n"] if job.is_continuation else 0
    _log("start", job.attempt, start if job.is_continuation else "-", job.job_id)
    for n in range(start + 1, total + 1):
        await asyncio.sleep(pause)
        if n == fail_at and job.attempt == 1:
            raise RuntimeError(f"failing at step {n} on purpose")
        _log("asked", n)
        try:
            await job.checkpoint({"n": n})
        except CheckpointRejectedError:
            _log("rejected", n)
            raise
        _log("acked", n)
        job.progress(n / total, f"step {n} of {total}")
    return total


@task
def count_up_sync(total: int, pause: float = 0.02, fail_at: int = 0) -> int:
    """:func:`count_up` as a sync task (it runs in a thread)."""
    job = current_job()
    start = job.last_checkpoint["n"] if job.is_continuation else 0
    _log("start", job.attempt, start if job.is_continuation else "-", job.job_id)
    for n in range(start + 1, total + 1):
        time.sleep(pause)
        if n == fail_at and job.attempt == 1:
            raise RuntimeError(f"failing at step {n} on purpose")
        _log("asked", n)
        try:
            job.checkpoint_sync({"n": n})
        except CheckpointRejectedError:
            _log("rejected", n)
            raise
        _log("acked", n)
        job.progress(n / total, f"step {n} of {total}")
    return total


def blob(size: int) -> str:
    """``size`` characters that differ all along (a number every 8), so a checkpoint cut
    short, shifted or swapped for another job's cannot pass for this one."""
    return "".join(f"{i:07d}," for i in range(size // 8))


@task
async def hold_big(size: int) -> dict[str, object]:
    """The first run checkpoints ``blob(size)`` and then waits to be killed; the next
    run reports what it got back (its size and SHA-256) and checkpoints a small state in
    its place."""
    job = current_job()
    _log("start", job.attempt, 1 if job.is_continuation else "-", job.job_id)
    if not job.is_continuation:
        _log("asked", 1)
        await job.checkpoint({"blob": blob(size)})
        _log("acked", 1)
        await asyncio.Event().wait()  # until the test kills this run's worker
    got = job.last_checkpoint["blob"]
    _log("asked", 2)
    await job.checkpoint({"done": True})
    _log("acked", 2)
    return {"size": len(got), "sha256": hashlib.sha256(got.encode()).hexdigest()}
