"""A client made before a fork works in the forked child (the gunicorn ``--preload``
pattern): the child notices its pid changed and opens its own connection, instead of
waiting forever on the parent's event-loop thread or writing into the parent's socket."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from adapters.memory import MemoryAdapter
from broker.storage import JobFilter
from tests.support import running_main

ROOT = Path(__file__).resolve().parents[2]

APP = textwrap.dedent(
    """
    import asyncio, os, sys
    import broker
    from broker import Client, SyncClient

    port = int(sys.argv[1])
    # Made and used at import time in the parent, as a preloaded web app would.
    sync = SyncClient("127.0.0.1", port, timeout=10)
    sync.enqueue("app.parent_sync")
    broker.configure("127.0.0.1", port, timeout=10)

    async def parent_async(client):
        await client.enqueue("app.parent_async")

    client = Client("127.0.0.1", port, timeout=10)
    asyncio.run(parent_async(client))

    pid = os.fork()
    if pid == 0:
        try:
            sync.enqueue("app.child_sync")

            async def child_async():
                await client.enqueue("app.child_async")
                await client.close()

            asyncio.run(child_async())
        except BaseException as exc:
            print(f"child failed: {exc!r}", flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    sync.enqueue("app.parent_after_fork")  # the parent's connection still works
    sync.close()
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


async def test_clients_made_before_a_fork_enqueue_from_the_child(tmp_path: Path) -> None:
    store = MemoryAdapter()
    script = tmp_path / "preloaded_app.py"
    script.write_text(APP)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    async with running_main(store) as main:
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, str(script), str(main.port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        tasks = sorted(j.task for j in (await store.list_jobs(JobFilter())).jobs)
    assert tasks == [
        "app.child_async",
        "app.child_sync",
        "app.parent_after_fork",
        "app.parent_async",
        "app.parent_sync",
    ]
