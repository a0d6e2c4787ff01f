"""Tasks for ``tests/e2e/test_e2e.py``, loaded by worker processes with ``--app tests.e2e_app``.

Every run appends ``start KEY PID`` when it begins and ``end KEY PID`` when its work is
done to ``runs-PID.log`` in the directory named by ``BROKER_E2E_LOG_DIR``. One file per
process and one ``write`` per line (``O_APPEND``), so a ``kill -9`` can cut a run short
but never leaves a torn line, and the test can tell exactly which process ran what.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

from broker.tasks.context import current_job
from broker.tasks.registry import task

LOG_DIR_ENV = "BROKER_E2E_LOG_DIR"


def _log(event: str, key: str, directory: str | None = None) -> None:
    path = os.path.join(directory or os.environ[LOG_DIR_ENV], f"runs-{os.getpid()}.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{event} {key} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


@task(mode="inline")
async def record(key: str, seconds: float = 0.0) -> int:
    """Log the run, sleep ``seconds``, log the end; the result is the pid that ran it."""
    _log("start", key)
    if seconds > 0:
        await asyncio.sleep(seconds)
    _log("end", key)
    return os.getpid()


@task(mode="inline", rate_limit="20/s", rate_burst=2)
async def record_limited(key: str, seconds: float = 0.0) -> int:
    """:func:`record`, limited to 20 a second across every worker
    (``tests/e2e/test_flow_control.py``)."""
    return await record(key, seconds)


@task(mode="inline", rate_limit="10/s", rate_key="{tenant}")
async def record_per_tenant(key: str, tenant: str, seconds: float = 0.0) -> int:
    """:func:`record`, limited to 10 a second for each tenant apart, across every worker
    (``tests/e2e/test_flow_control.py``)."""
    return await record(key, seconds)


@task(mode="inline")
async def hold(key: str, gate: str, limit: float = 60.0) -> int:
    """Log the run, then run until the file ``gate`` (or ``gate.PID``, for this process
    only) exists, so the test decides when a job ends instead of guessing with sleeps;
    the result is the pid that ran it."""
    _log("start", key)
    await _gate(gate, limit)
    _log("end", key)
    return os.getpid()


async def _gate(gate: str, limit: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    mine = f"{gate}.{os.getpid()}"
    while not (os.path.exists(gate) or os.path.exists(mine)):
        if loop.time() > deadline:
            raise TimeoutError(f"gate {gate} did not open within {limit} s")
        await asyncio.sleep(0.02)


@task(mode="inline", local_state=True)
async def hold_state(key: str, gate: str, limit: float = 60.0) -> dict[str, Any]:
    """:func:`hold` for a task that keeps local state: the result also says what the
    attempt was told (a recovery? its local state gone?)."""
    _log("start", key)
    job = current_job()
    await _gate(gate, limit)
    _log("end", key)
    return {
        "pid": os.getpid(),
        "recoveries": job.recoveries,
        "state_lost": job.state_lost,
    }


@task(mode="pooled", max_recoveries=2)
def kill_own_child(key: str, runs: str) -> None:
    """Log the run (in ``runs``: a pooled child does not inherit ``BROKER_*`` variables),
    then ``kill -9`` the pooled child running it: every attempt is lost."""
    _log("start", key, runs)
    os.kill(os.getpid(), signal.SIGKILL)


@task(mode="inline")
async def nest(levels: int) -> Any:
    """This process's pid inside ``levels`` lists (``[[pid]]`` for 2): a result as deep as
    asked, built here because the main refuses arguments nested that deeply."""
    value: Any = os.getpid()
    for _ in range(levels):
        value = [value]
    return value


@task(mode="pooled")
async def forge_deep_line(levels: int) -> None:
    """Write a line nested ``levels`` deep straight onto this child's outcome channel, as
    a broken child might, then wait to be stopped; only meaningful in a pooled child."""
    fd = int(sys.argv[sys.argv.index("--channel-fd") + 1])
    os.write(fd, b'[{"type":"completed","result":' + b"[" * levels + b"]" * levels + b"}]\n")
    await asyncio.sleep(60)


@task(mode="inline", retries=0, queue="once", timeout=30)
async def charge_once(key: str) -> None:
    """Log the run and fail: declared ``retries=0``, so a job of it must run exactly once,
    even when enqueued by name from the CLI (the task catalog supplies the default)."""
    _log("start", key)
    raise RuntimeError(f"charge {key} failed")


def _effect(key: str, directory: str | None = None) -> None:
    """A workflow step's one side effect, logged with the attempt it belongs to as the
    task was told (``effect KEY ATTEMPT RECOVERIES PID`` in ``effects-PID.log``): the
    test counts effects per attempt against the attempts and recoveries in the store."""
    job = current_job()
    path = os.path.join(directory or os.environ[LOG_DIR_ENV], f"effects-{os.getpid()}.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"effect {key} {job.attempt} {job.recoveries} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


@task(mode="inline")
async def wf_member(key: str, value: int, seconds: float = 0.0, gate: str = "") -> int:
    """A workflow member (``tests/e2e/test_workflows_e2e.py``): logged like :func:`record`,
    held until the file ``gate`` exists if one is named (see :func:`hold`), its effect
    logged by :func:`_effect`, its result ``value * value``."""
    _log("start", key)
    if seconds > 0:
        await asyncio.sleep(seconds)
    if gate:
        await _gate(gate, 120)
    _effect(key)
    _log("end", key)
    return value * value


@task(mode="pooled")
def wf_member_pooled(key: str, value: int, runs: str, gate: str = "") -> int:
    """:func:`wf_member` in a pooled child, which logs to ``runs`` (it does not inherit
    ``BROKER_*`` variables): the pid in its lines is the child's, for the test to kill."""
    _log("start", key, runs)
    _wait_for_file(gate)
    _effect(key, runs)
    _log("end", key, runs)
    return value * value


def _wait_for_file(gate: str, limit: float = 120.0) -> None:
    """:func:`_gate` for a sync task (it runs in a thread of its own); none if ``gate`` is
    empty."""
    deadline = time.monotonic() + limit
    while gate and not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} did not open within {limit} s")
        time.sleep(0.02)


@task(mode="inline")
async def wf_collect(results: list[int], key: str) -> int:
    """A fan-in over ``wf_member`` results: logged, the sum of what it received."""
    _log("start", key)
    _effect(key)
    _log("end", key)
    return sum(results)


@task(mode="inline")
async def wf_step(value: int, key: str, gate: str = "") -> int:
    """A chain step: logged, held by ``gate`` as :func:`wf_member`, one more than the step
    before."""
    _log("start", key)
    if gate:
        await _gate(gate, 120)
    _effect(key)
    _log("end", key)
    return value + 1


@task(mode="pooled")
def wf_step_pooled(value: int, key: str, runs: str, gate: str = "") -> int:
    """:func:`wf_step` in a pooled child (see :func:`wf_member_pooled`)."""
    _log("start", key, runs)
    _wait_for_file(gate)
    _effect(key, runs)
    _log("end", key, runs)
    return value + 1
