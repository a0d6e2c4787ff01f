"""Job ids and leases across a fork (``jobs.random_uuid``): a forked child draws its own."""

from __future__ import annotations

import os

from broker.jobs import random_uuid


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
