"""RQ's job functions, in a module of their own: a forked work horse imports it per job."""

from __future__ import annotations

from bench import jobs


def noop(tag: int = -1) -> None:
    jobs.noop(tag)


def cpu(rounds: int) -> int:
    return jobs.cpu(rounds)
