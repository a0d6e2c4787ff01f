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


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["broker", "--main", "http://127.0.0.1:7390", "status"], "--main"),
        (["broker-worker", "--app", "tasks", "--main", "tcp://127.0.0.1:7390"], "--main"),
        (["broker-worker", "--app", "tasks", "--main", "127.0.0.1:1,http://h:7390/"], "--main"),
        (["broker-main", "--port", "0", "--advertise", "http://h:7390"], "--advertise"),
    ],
)
def test_a_url_where_a_host_and_port_is_expected_is_a_usage_error(
    argv: list[str], flag: str
) -> None:
    """Once the worker retried such an address for ever, the operator's command looked up a
    host called ``http``, and a main advertised it to every peer."""
    done = _run([*COMMANDS[argv[0]][0], *argv[1:]])
    assert done.returncode == 2, done.stderr
    assert "expected HOST:PORT, not a URL" in done.stderr
    assert flag in done.stderr
    assert "Traceback" not in done.stderr


def _modules(directory: Path) -> Path:
    """``present`` (which leaves a mark when it is imported) beside no ``absent``."""
    (directory / "present.py").write_text(
        "from pathlib import Path\nPath('present.imported').write_text('yes')\n"
    )
    return directory / "present.imported"


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["broker-worker", "--main", "127.0.0.1:1", "--app", "present,absent"], {}),
        (["broker-worker", "--main", "127.0.0.1:1"], {"BROKER_APP": "present,absent"}),
        (["broker-main", "--port", "0", "--schedules", "present, absent"], {}),
        (["broker-main", "--port", "0"], {"BROKER_SCHEDULES": "present,absent"}),
    ],
    ids=["--app", "BROKER_APP", "--schedules", "BROKER_SCHEDULES"],
)
def test_a_comma_list_names_several_modules_as_flag_and_as_variable(
    tmp_path: Path, argv: list[str], env: dict[str, str]
) -> None:
    """``--app a,b`` was one module called ``a,b``, while ``BROKER_APP=a,b`` was two."""
    mark = _modules(tmp_path)
    done = _run([*COMMANDS[argv[0]][0], *argv[1:]], cwd=tmp_path, **env)
    assert done.returncode == 1, done.stderr
    assert mark.read_text() == "yes", "the first module of the list was imported"
    assert "No module named 'absent'" in done.stderr, done.stderr
    assert "present," not in done.stderr


@pytest.mark.parametrize(
    ("argv", "named_by"),
    [
        (["broker-worker", "--main", "127.0.0.1:1", "--app", "broken"], "--app"),
        (["broker-main", "--port", "0", "--schedules", "broken"], "--schedules"),
        (
            ["broker-main", "--port", "0", "--database-url", "memory://", "--adapter", "broken:f"],
            "--adapter broken:f",
        ),
    ],
)
def test_a_module_that_fails_to_import_shows_its_traceback_once(
    tmp_path: Path, argv: list[str], named_by: str
) -> None:
    """The exception's repr was printed twice (as the error and as its cause), and the
    line in the operator's module that raised was nowhere."""
    (tmp_path / "broken.py").write_text(
        "x = 1\n\n\ndef fail():\n    raise RuntimeError('no db')\n\n\nfail()\n"
    )
    done = _run([*COMMANDS[argv[0]][0], *argv[1:]], cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"error: cannot import 'broken' (named by {named_by})",
        "    Traceback (most recent call last):",
        f'      File "{tmp_path / "broken.py"}", line 8, in <module>',
        "        fail()",
        f'      File "{tmp_path / "broken.py"}", line 5, in fail',
        "        raise RuntimeError('no db')",
        "    RuntimeError: no db",
    ]


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["broker", "prune"], "usage: broker prune "),
        (["broker", "migrate"], "usage: broker migrate "),
        (["broker", "enqueue", "app.task", "not json"], "usage: broker enqueue "),
        (["broker", "job"], "usage: broker job "),
    ],
)
def test_a_subcommand_usage_error_shows_that_subcommands_usage(argv: list[str], usage: str) -> None:
    """``broker prune`` without a limit printed the whole ``broker`` usage."""
    done = _run([*COMMANDS[argv[0]][0], *argv[1:]])
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(usage), done.stderr
    assert "{status,top," not in done.stderr, "not the top-level usage"


@pytest.mark.parametrize(
    "argv",
    [
        ["broker-worker", "--main", "127.0.0.1:1"],
        ["broker-worker", "--app", "tasks", "--tls-client-cert", "c.pem"],
        ["broker-main", "--port", "0", "--tls-key", "k.pem"],
        ["broker", "--tls-client-key", "k.pem", "status"],
    ],
    ids=["no --app", "worker half a TLS pair", "main half a TLS pair", "broker half a TLS pair"],
)
def test_a_flag_missing_or_without_its_pair_is_a_usage_error(
    tmp_path: Path, argv: list[str]
) -> None:
    """These exited 1, as a broker error, where the documented code of a usage error is 2."""
    done = _run([*COMMANDS[argv[0]][0], *argv[1:]], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"usage: {argv[0]} "), done.stderr
    assert not (tmp_path / "broker.db").exists()
