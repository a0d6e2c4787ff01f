"""Job ids and leases (``jobs.random_uuid``): random, version 4, never repeated."""

from __future__ import annotations

import os
import uuid

from broker.jobs import random_uuid


def test_random_uuids_are_distinct_version_4_uuids() -> None:
    """Job ids and leases: valid RFC 4122 version 4 UUIDs, none repeated, across refills
    of the random bytes."""
    ids = [random_uuid() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert {u.version for u in ids} == {4}
    assert {u.variant for u in ids} == {uuid.RFC_4122}
    assert all(uuid.UUID(str(u)) == u and hash(uuid.UUID(str(u))) == hash(u) for u in ids)


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    """The random bytes read ahead are dropped in a forked child: otherwise parent and
    child would hand out the same ids."""
    random_uuid()  # bytes in reserve
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, b"".join(random_uuid().bytes for _ in range(8)))
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        theirs = f.read()
    ours = b"".join(random_uuid().bytes for _ in range(8))
    assert len(theirs) == 128 and theirs != ours
    assert {theirs[i : i + 16] for i in range(0, 128, 16)}.isdisjoint(
        ours[i : i + 16] for i in range(0, 128, 16)
    )
