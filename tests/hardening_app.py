"""Tasks for tests/e2e/test_hardening.py; imported by real worker and child processes."""

from __future__ import annotations

import os
import sys

from broker.tasks import task


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
