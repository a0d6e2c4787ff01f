"""The built wheel ships all three import packages and imports without the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_built_wheel_installs_and_imports_broker_adapters_and_runners(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    [wheel] = dist.glob("broker_jobs-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # The wheel's dependencies come from the test run's own environment, added as a plain
    # path (its editable install of this tree is a .pth hook there, which a path line does
    # not run), so the probe below imports broker from the wheel and nothing else.
    [deps] = Path(sys.prefix).glob("lib/python*/site-packages")
    [site] = env_dir.glob("lib/python*/site-packages")
    (site / "_test_deps.pth").write_text(f"{deps}\n")
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
        "runners.inline, broker.ops.cli; "
        "import os; print(os.path.dirname(broker.__file__))"
    )
    # Without PYTHONPATH, which would put a source tree ahead of the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(python), "-c", probe],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    assert str(env_dir) in out.stdout, f"imported from {out.stdout!r}, not the installed wheel"
    assert (env_dir / "bin" / "broker-main").exists()
    assert (env_dir / "bin" / "broker-worker").exists()
