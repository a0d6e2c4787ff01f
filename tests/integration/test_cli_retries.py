"""``broker enqueue --retries N``: the command cannot import the task, so a task that must
not repeat is enqueued with ``--retries 0`` and its job allows one run."""

from __future__ import annotations

import asyncio
import contextlib
import io
import uuid

from adapters.memory import MemoryAdapter
from broker.ops import cli
from tests.support import running_main


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.broker_entry(argv)
    return code, out.getvalue()


async def test_enqueue_retries_sets_the_jobs_attempts() -> None:
    store = MemoryAdapter()
    async with running_main(store) as main:
        address = f"127.0.0.1:{main.port}"
        once = await asyncio.to_thread(
            _run, ["--main", address, "enqueue", "app.charge", "[1]", "--retries", "0"]
        )
        plain = await asyncio.to_thread(_run, ["--main", address, "enqueue", "app.charge"])
    assert once[0] == 0 and plain[0] == 0
    jobs = [await store.get_job(uuid.UUID(out.strip())) for _, out in (once, plain)]
    assert [j.max_attempts for j in jobs if j is not None] == [1, 11]
