"""A broken conformance rule says which rule it is, in words, whatever runs the check
(a test id names it only under pytest)."""

from __future__ import annotations

import dataclasses

import pytest

from adapters.memory import MemoryAdapter
from broker.jobs import Clock, EnqueueResult, JobSpec
from broker.storage import StorageAdapter
from broker.testing.conformance import CHECKS, run_check


class WrongDefaultQueue(MemoryAdapter):
    """An adapter that files every job under another queue than it was given."""

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        return await super().enqueue(dataclasses.replace(spec, queue="elsewhere"))


class Harness:
    async def open(self, clock: Clock) -> StorageAdapter:
        return WrongDefaultQueue(clock=clock)

    async def close(self) -> None:
        return None


async def test_a_failed_check_names_its_rule() -> None:
    [check] = [c for c in CHECKS if c.name == "enqueue_defaults"]
    with pytest.raises(AssertionError) as caught:
        await run_check(check, Harness())
    message = str(caught.value)
    assert message.startswith(f"conformance rule {check.rule!r} is broken: ")
    assert check.rule == "enqueue defaults", "the check has no docstring: its name, in words"


def test_every_rule_has_words() -> None:
    assert all(check.rule and "_" not in check.rule for check in CHECKS)
