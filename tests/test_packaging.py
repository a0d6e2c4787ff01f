"""The built wheel ships all three import packages and imports without the source tree."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_built_wheel_installs_and_imports_broker_adapters_and_runners(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    [wheel] = dist.glob("broker-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    probe = (
        "import broker, adapters, runners, broker.testing.conformance, adapters.memory, "
        "runners.inline, broker.cli; "
        "import os; print(os.path.dirname(broker.__file__))"
    )
    out = subprocess.run(
        [str(python), "-c", probe], cwd=tmp_path, check=True, capture_output=True, text=True
    )
    assert str(env_dir) in out.stdout, f"imported from {out.stdout!r}, not the installed wheel"
    assert (env_dir / "bin" / "broker-main").exists()
    assert (env_dir / "bin" / "broker-worker").exists()
