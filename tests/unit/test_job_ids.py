"""Leases (``jobs.random_uuid``): random, version 4; job ids (``jobs.time_ordered_uuid``):
version 7, in time order; neither ever repeated."""

from __future__ import annotations

import time
import uuid

from broker.jobs import JobSpec, random_uuid, time_ordered_uuid


def test_random_uuids_are_distinct_version_4_uuids() -> None:
    """Job ids and leases: valid RFC 4122 version 4 UUIDs, none repeated, across refills
    of the random bytes."""
    ids = [random_uuid() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert {u.version for u in ids} == {4}
    assert {u.variant for u in ids} == {uuid.RFC_4122}
    assert all(uuid.UUID(str(u)) == u and hash(uuid.UUID(str(u))) == hash(u) for u in ids)


def test_job_ids_are_version_7_uuids_in_time_order() -> None:
    """A job's id (``JobSpec``'s default) is a valid RFC 9562 version 7 UUID whose first
    48 bits are the time in milliseconds, so ids made a millisecond apart sort in that
    order (as text too, as SQLite stores them); none repeats."""
    before = time.time_ns() // 1_000_000
    ids = [time_ordered_uuid() for _ in range(1000)]
    after = time.time_ns() // 1_000_000
    assert len(set(ids)) == 1000
    assert {u.version for u in ids} == {7}
    assert {u.variant for u in ids} == {uuid.RFC_4122}
    assert all(before <= u.int >> 80 <= after for u in ids)
    assert all(uuid.UUID(str(u)) == u and hash(uuid.UUID(str(u))) == hash(u) for u in ids)
    while time.time_ns() // 1_000_000 <= after:  # the next millisecond: the time's order
        pass
    later = JobSpec(task="t").id
    assert later.version == 7
    assert max(ids) < later and max(u.hex for u in ids) < later.hex
