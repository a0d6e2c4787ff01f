"""A worker pointed at a port where something other than a broker main listens says so
within a few seconds, in a real ``broker-worker`` process: a service that waits for the
client to speak first (a silent TCP server, the machine's Redis) and one that answers with
something else both read as "not a broker main", not as an unreachable main."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support import cli_with_greeting_wait

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


SHORT_GREETING = 0.25
"""The worker's greeting wait here (the default is 2 s): a silent service is outwaited,
and judged the same whatever the wait."""


@contextmanager
def _server(banner: bytes | None) -> Iterator[int]:
    """A TCP server that accepts, then stays silent or writes ``banner`` (like an SSH or
    SMTP server would), and keeps each connection open."""
    listener = socket.create_server(("127.0.0.1", 0))
    kept: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            kept.append(conn)
            if banner is not None:
                conn.sendall(banner)

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for conn in kept:
            conn.close()


def _first_complaint(port: int) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    proc = subprocess.Popen(
        [
            *cli_with_greeting_wait(SHORT_GREETING, "worker"),
            "--main",
            f"127.0.0.1:{port}",
            "--pooled-runner-count",
            "0",
            "--forked-concurrency",
            "0",
            "--app",
            "tests.e2e_app",
        ],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "cannot reach the main" in line or "not a broker main" in line:
                return line
        raise AssertionError(f"the worker ended without a complaint, exit {proc.wait()}")
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


@pytest.mark.parametrize("banner", [None, b"SSH-2.0-OpenSSH_9.2\r\n"])
def test_a_worker_says_the_service_is_not_a_main(banner: bytes | None) -> None:
    with _server(banner) as port:
        line = _first_complaint(port)
    assert "not a broker main" in line, line


def test_a_worker_pointed_at_redis_says_it_is_not_a_main() -> None:
    try:
        socket.create_connection(("127.0.0.1", 6379), timeout=1).close()
    except OSError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("no Redis at 127.0.0.1:6379")
    assert "not a broker main" in _first_complaint(6379)
