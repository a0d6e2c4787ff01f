"""Job ids and leases (``jobs.random_uuid``): random, version 4, never repeated.

Time-ordered (version 7) job ids were tried for issue 35 and taken back: every job made in
the same minute shared the first eight hex digits, which are the short id the dashboard,
the CLI and the id-prefix search show and take."""

from __future__ import annotations

import uuid

from broker.jobs import JobSpec, random_uuid


def test_random_uuids_are_distinct_version_4_uuids() -> None:
    """Job ids and leases: valid RFC 4122 version 4 UUIDs, none repeated, across refills
    of the random bytes."""
    ids = [random_uuid() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert {u.version for u in ids} == {4}
    assert {u.variant for u in ids} == {uuid.RFC_4122}
    assert all(uuid.UUID(str(u)) == u and hash(uuid.UUID(str(u))) == hash(u) for u in ids)


def test_a_job_id_is_random() -> None:
    assert JobSpec(task="t").id.version == 4
