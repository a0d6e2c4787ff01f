"""The package as a user gets it: the built wheel installed with pip into a fresh virtual
environment, the tutorial's commands run from a directory that has nothing to do with
the source tree, and a foreign ``adapters`` distribution in the same environment
stopping the commands with a message that names the conflict and the fix."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = (ROOT / "docs" / "tutorial.md").read_text()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    [built] = dist.glob("broker_jobs-*.whl")
    return built


def fresh_venv(where: Path, *wheels: Path) -> Path:
    """A new environment with ``wheels`` pip-installed in order; the dependencies come
    from the test run's environment as a plain path line (see test_packaging.py)."""
    venv.EnvBuilder(with_pip=False).create(where)
    [deps] = Path(sys.prefix).glob("lib/python*/site-packages")
    [site] = where.glob("lib/python*/site-packages")
    (site / "_test_deps.pth").write_text(f"{deps}\n")
    pip = [sys.executable, "-m", "pip", "--python", str(where / "bin" / "python")]
    for wheel in wheels:
        subprocess.run(
            [*pip, "install", "--quiet", "--no-deps", str(wheel)],
            check=True,
            capture_output=True,
        )
    return where / "bin"


def user_env(bin_dir: Path) -> dict[str, str]:
    """An activated venv, without the PYTHONPATH that would put the source tree first."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    env["PYTHONUNBUFFERED"] = "1"  # the main's "listening on" line, read through a pipe
    return env


def tutorial_block(after: str, language: str = "python") -> str:
    """The first ``language`` code block of the tutorial after the text ``after``."""
    start = TUTORIAL.index(after)
    match = re.compile(rf"```{language}\n(.*?)```", re.S).search(TUTORIAL, start)
    assert match is not None, f"no {language} block after {after!r}"
    return match.group(1)


@pytest.fixture
def main_process(tmp_path: Path, wheel: Path) -> Iterator[tuple[Path, Path, int]]:
    bin_dir = fresh_venv(tmp_path / "venv", wheel)
    work = tmp_path / "broker-tutorial"
    (work / "myapp").mkdir(parents=True)
    (work / "myapp" / "__init__.py").write_text("")
    (work / "myapp" / "tasks.py").write_text(tutorial_block("Create `myapp/tasks.py`"))
    main = subprocess.Popen(
        ["broker-main", "--database-url", "sqlite+aiosqlite:///./broker.db", "--port", "0"],
        cwd=work,
        env=user_env(bin_dir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    ports: queue.Queue[int | None] = queue.Queue()

    def read_log() -> None:
        """Find the port in the main's log, and keep draining it so the main never
        blocks on a full pipe."""
        assert main.stderr is not None
        for line in main.stderr:
            found = re.search(r"broker-main listening on [\d.]+:(\d+)", line)
            if found:
                ports.put(int(found.group(1)))
        ports.put(None)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        port = ports.get(timeout=60)
        assert port is not None, "broker-main exited without listening"
        yield bin_dir, work, port
    finally:
        main.terminate()
        main.wait(30)
        reader.join(30)
        assert main.stderr is not None
        main.stderr.close()


def test_the_tutorial_works_from_the_installed_wheel(main_process: tuple[Path, Path, int]) -> None:
    bin_dir, work, port = main_process
    env = user_env(bin_dir)
    assert "pip install broker-jobs" in TUTORIAL
    worker = subprocess.Popen(
        ["broker-worker", "--main", f"127.0.0.1:{port}", "--app", "myapp.tasks"],
        cwd=work,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def broker(*argv: str) -> str:
        done = subprocess.run(
            ["broker", "--main", f"127.0.0.1:{port}", *argv],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def settled(job_id: str) -> dict[str, object]:
        for _ in range(600):
            job: dict[str, object] = json.loads(broker("job", job_id, "--json"))
            if job["status"] in ("completed", "failed", "cancelled"):
                return job
            time.sleep(0.1)  # polling a separate process's state, as the user would
        raise AssertionError(f"job {job_id} did not finish: {job}")

    try:
        job_id = broker("enqueue", "myapp.tasks.send_email", '["a@example.com"]').strip()
        job = settled(job_id)
        assert (job["status"], job["result"]) == ("completed", {"sent_to": "a@example.com"})

        def tutorial_script(name: str, after: str) -> str:
            """Run the tutorial's Python block after the text ``after`` as ``name``."""
            (work / name).write_text(tutorial_block(after).replace("7390", str(port)))
            out = subprocess.run(
                [str(bin_dir / "python"), name],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stdout + out.stderr
            return out.stdout

        first, again = tutorial_script("enqueue_async.py", "Create\n`enqueue_async.py`").split(
            "\n"
        )[:2]
        assert first.endswith(" False")
        assert settled(first.split()[0])["status"] == "completed"
        assert settled(again.strip())["priority"] == 1, "the options came with the call"
        charged = tutorial_script("charge.py", "`charge_card` always raises. Enqueue it:")
        charge = json.loads(broker("job", charged.strip(), "--json"))
        assert charge["max_attempts"] == 4, "the task's retries=3 came with the task object"
    finally:
        worker.terminate()
        worker.wait(30)


def stand_in_adapters_wheel(where: Path) -> Path:
    """A wheel of a distribution called ``adapters`` with a top-level ``adapters``
    package that needs torch, as AdapterHub's does."""
    wheel = where / "adapters-1.0-py3-none-any.whl"
    files = {
        "adapters/__init__.py": b"import torch  # noqa\n",
        "adapters-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: adapters\nVersion: 1.0\n",
        "adapters-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        "adapters-1.0.dist-info/top_level.txt": b"adapters\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(data)}")
    record.append("adapters-1.0.dist-info/RECORD,,")
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr("adapters-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return wheel


def test_a_foreign_adapters_package_stops_every_command_with_the_fix(
    tmp_path: Path, wheel: Path
) -> None:
    foreign = stand_in_adapters_wheel(tmp_path)
    bin_dir = fresh_venv(tmp_path / "venv", wheel, foreign)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for command in (
        ["broker-main", "--database-url", "sqlite+aiosqlite:///./b.db", "--port", "0"],
        ["broker-worker", "--main", "127.0.0.1:1", "--app", "json"],
        ["broker", "--main", "127.0.0.1:1", "status"],
    ):
        done = subprocess.run(
            command,
            cwd=elsewhere,
            env=user_env(bin_dir),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert "torch" not in done.stderr, "the check runs before adapters is imported"
        message = done.stderr
        assert "broker-jobs cannot start" in message
        assert "'adapters' is also installed by adapters 1.0" in message
        assert "adapters/__init__.py is not the file broker-jobs installed" in message
        assert "virtual environment of its own" in message
