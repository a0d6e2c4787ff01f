"""``broker-main`` checks its settings and binds its port before it touches the store,
names a bad environment variable as such, and refuses a custom adapter that lacks part
of the contract with the list of what it lacks."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from broker.ops import cli


class HalfAnAdapter:
    """A custom adapter its author has not finished: enqueue and close only."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def enqueue(self, spec: object) -> None: ...

    async def close(self) -> None: ...


def half_an_adapter(url: str) -> HalfAnAdapter:
    return HalfAnAdapter(url)


def test_a_taken_port_leaves_no_store_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "broker.db"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main_entry(
            ["--database-url", f"sqlite+aiosqlite:///{store}", "--port", str(port)]
        )
    assert code == 1
    assert "address already in use" in capsys.readouterr().err.lower()
    assert not store.exists() and list(tmp_path.iterdir()) == []


def test_a_bad_environment_variable_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BROKER_PORT", "seventy")
    with pytest.raises(SystemExit) as exit_:
        cli.main_entry(["--database-url", "memory://"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "environment variable BROKER_PORT='seventy' is not valid" in err
    assert "argument --port" not in err


def test_the_flag_wins_over_a_bad_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BROKER_TIMEOUT", "soon")
    args = cli.parse(cli.broker_parser(), ["--timeout", "3", "status"])
    assert args.timeout == 3.0


def test_a_bad_environment_variable_of_the_operator_command_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BROKER_TIMEOUT", "-1")
    with pytest.raises(SystemExit) as exit_:
        cli.broker_entry(["status"])
    assert exit_.value.code == 2
    assert "environment variable BROKER_TIMEOUT='-1'" in capsys.readouterr().err


def test_a_custom_adapter_missing_methods_is_refused_with_the_list(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = cli.main_entry(
        [
            "--database-url",
            "custom://x",
            "--adapter",
            f"{__name__}:half_an_adapter",
            "--port",
            "0",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "does not implement the storage contract" in err
    assert "lacks: capabilities, setup, enqueue_many, select_eligible" in err
    assert "AttributeError" not in err and "Traceback" not in err


def test_invalid_settings_leave_no_store_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "broker.db"
    code = cli.main_entry(
        [
            "--database-url",
            f"sqlite+aiosqlite:///{store}",
            "--port",
            "0",
            "--ping-interval",
            "5",
            "--liveness-timeout",
            "2",
        ]
    )
    assert code == 1
    assert "liveness_timeout must be longer than ping_interval" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
