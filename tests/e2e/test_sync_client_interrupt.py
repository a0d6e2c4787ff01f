"""Ctrl-C stops a script blocked in ``SyncClient.wait()`` at once: the wait is cancelled
on the client's loop thread, ``KeyboardInterrupt`` reaches the script, and the process
exits (it used to sit out the wait's whole timeout, and then hang at exit on the loop's
thread)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import uuid
from pathlib import Path

from adapters.memory import MemoryAdapter
from tests.support import running_main, until

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    from broker import SyncClient

    client = SyncClient("127.0.0.1", int(sys.argv[1]), allow_unknown_tasks=True)
    job = client.enqueue("app.never_runs")
    print(f"waiting {job.job_id}", flush=True)
    try:
        client.wait(job.job_id, timeout=3600)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise
    """
)

EXIT_BOUND = 30.0
"""Generous: the wait itself is an hour; an interrupted one ends in well under a second."""


async def test_ctrl_c_interrupts_a_sync_wait_at_once(tmp_path: Path) -> None:
    script = tmp_path / "waits.py"
    script.write_text(SCRIPT)
    async with running_main(MemoryAdapter()) as main:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            str(main.port),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert child.stdout is not None
            line = await asyncio.wait_for(child.stdout.readline(), 60)
            assert line.startswith(b"waiting "), line
            job_id = uuid.UUID(line.split()[1].decode())
            # The wait is under way at the main (subscribed), not merely about to start.
            await until(lambda: main.waits.waiters.waited_on([job_id]))
            child.send_signal(signal.SIGINT)
            stdout, stderr = await asyncio.wait_for(child.communicate(), EXIT_BOUND)
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
        assert b"interrupted" in stdout, stderr
        assert b"KeyboardInterrupt" in stderr
        assert child.returncode != 0
        # The cancelled wait let go of its connection, and so of its waiter at the main.
        await until(lambda: not main.waits.waiters.waited_on([job_id]))
