"""The three commands as real processes, before they serve anything: ``--version``, a task
module that cannot be imported, usage errors, comma lists and addresses (issue 34)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow

# Every way a command is started: its console script, and ``python -m broker.cli NAME``.
COMMANDS = {
    "broker-main": ([str(BIN / "broker-main")], [sys.executable, "-m", "broker.cli", "main"]),
    "broker-worker": ([str(BIN / "broker-worker")], [sys.executable, "-m", "broker.cli", "worker"]),
    "broker": ([str(BIN / "broker")], [sys.executable, "-m", "broker.cli", "broker"]),
}


def _run(argv: list[str], cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    return subprocess.run(
        argv,
        cwd=cwd,
        env={**clean, **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("style", [0, 1], ids=["script", "python-m"])
@pytest.mark.parametrize("name", list(COMMANDS))
def test_version_names_the_program_and_the_installed_version(name: str, style: int) -> None:
    done = _run([*COMMANDS[name][style], "--version"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{name} {importlib.metadata.version('broker-jobs')}"
