"""``broker-main --http-port`` on a port that is taken stops with a message naming it (and
the main it had started is stopped again), as does a worker's ``--metrics-port``."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from broker.ops import cli


def test_a_taken_dashboard_port_is_a_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main_entry(
            [
                "--database-url",
                f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}",
                "--port",
                "0",
                "--http-port",
                str(port),
            ]
        )
    assert code == 1
    assert f"cannot serve the dashboard on 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_taken_worker_metrics_port_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.worker_entry(
            ["--main", "127.0.0.1:1", "--app", "tests.web_app", "--metrics-port", str(port)]
        )
    assert code == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in capsys.readouterr().err
