"""Tasks for tests/e2e/test_hardening.py; imported by real worker and child processes."""

from __future__ import annotations

import os
import sys

from broker.tasks.registry import task


@task(mode="pooled")
def pooled_environment() -> dict[str, str]:
    return dict(os.environ)


@task(mode="forked")
def forked_environment() -> dict[str, str]:
    return dict(os.environ)


@task(mode="pooled")
def long_line(megabytes: int) -> int:
    """One line of ``megabytes`` MiB, written in pieces, then its newline."""
    piece = "x" * (1 << 20)
    for _ in range(megabytes):
        sys.stdout.write(piece)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return megabytes


@task(mode="pooled")
def say(text: str) -> str:
    print(text)
    return text


def _ancestors_environments() -> list[str]:
    """The start-up environment of each ancestor this process may read (its parent, the
    worker, and theirs), as ``/proc/<pid>/environ`` shows it to task code."""
    seen: list[str] = []
    pid = os.getppid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/environ", "rb") as file:
                seen.append(file.read().decode(errors="replace"))
            with open(f"/proc/{pid}/stat", "rb") as file:
                pid = int(file.read().rsplit(b")", 1)[1].split()[1])
        except OSError:
            break
    return seen


@task(mode="pooled")
def pooled_ancestors_environments() -> list[str]:
    return _ancestors_environments()


@task(mode="forked")
def forked_ancestors_environments() -> list[str]:
    return _ancestors_environments()
