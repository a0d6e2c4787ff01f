"""Tasks for the pooled and forked runner tests; imported by real child processes."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time

from broker.tasks.registry import task


@task(mode="pooled")
def whoami() -> int:
    return os.getpid()


@task(mode="pooled")
async def nap(seconds: float) -> int:
    await asyncio.sleep(seconds)
    return os.getpid()


@task(mode="pooled")
def noisy(text: str) -> str:
    print(text)
    print('second line with a {"type": "outcome"} lookalike')
    return text


@task(mode="pooled")
def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@task(mode="pooled")
async def stubborn(seconds: float) -> None:
    """Ignores SIGTERM and blocks its process: only SIGKILL can stop it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)


@task(mode="pooled")
def hog(megabytes: int) -> int:
    global _HOARD
    _HOARD = bytearray(megabytes << 20)
    for i in range(0, len(_HOARD), 4096):
        _HOARD[i] = 1
    return os.getpid()


_HOARD = bytearray()


@task(mode="forked")
def forked_pid() -> int:
    return os.getpid()


@task(mode="inline")
def inline_pid() -> int:
    return os.getpid()


@task(mode="pooled")
def hash_5ms() -> int:
    data = b"x" * 1024
    deadline = time.perf_counter() + 0.005
    n = 0
    while time.perf_counter() < deadline:
        data = hashlib.sha256(data).digest() * 32
        n += 1
    return n


@task(mode="pooled")
def noop() -> None:
    return None


@task(mode="pooled")
def echo_blob(blob: str, size: int) -> dict[str, str]:
    """A result of ``size`` characters made from the digest of the whole argument, so the
    caller can tell the child saw every byte of it."""
    digest = hashlib.sha256(blob.encode()).hexdigest()
    return {"digest": digest, "blob": (digest * (size // len(digest) + 1))[:size]}
