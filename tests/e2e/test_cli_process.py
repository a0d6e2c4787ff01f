"""The operator's ``broker`` command as a real process: a reader that goes away early
ends it quietly, and a bad ``--main`` is a clear error, not a traceback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.memory import MemoryAdapter
from tests.support import running_main

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _broker(*argv: str, **kw: object) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    return subprocess.Popen(
        [sys.executable, "-m", "broker.ops.cli", "broker", *argv],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        **kw,  # type: ignore[call-overload]
    )


async def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    store = MemoryAdapter()
    async with running_main(store) as main:
        read_end, write_end = os.pipe()
        proc = _broker("--main", f"127.0.0.1:{main.port}", "status", "--json", stdout=write_end)
        os.close(write_end)
        os.close(read_end)  # gone before the command has anything to print
        _, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert err.decode() == "", "no 'Broken pipe' error, no traceback"
    assert proc.returncode == 141, "the status of a command ended by SIGPIPE"


def test_a_port_out_of_range_is_a_clear_error() -> None:
    proc = _broker("--main", "127.0.0.1:99999", "status", stdout=subprocess.PIPE)
    _, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode == 2, "a bad --main is a usage error"
    assert "the port in '127.0.0.1:99999' must be a number from 1 to 65535" in text
    assert "Traceback" not in text
