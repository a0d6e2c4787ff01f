"""Issue 30, findings 5 and 10, against real processes: one address cannot lock the others
out of the handshake (plain TCP and TLS); a careless token file or a short token beyond
loopback stops the main; failed authentications are logged with the peer, within a
rate; task code cannot read the worker's secrets; a planted state directory, a planted
``json.py`` and bidi controls do no harm; a TLS peer without a client certificate is
logged as such."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.exceptions import AuthenticationError, BrokerError
from broker.jobs import JobSpec, JobStatus
from broker.main.main import Main
from broker.ops.web import Dashboard
from broker.wire.messages import Role
from tests.e2e.test_e2e import REPO, Proc, free_port, spawn_cli
from tests.e2e.test_hardening import TOKEN as HARDENING_TOKEN
from tests.e2e.test_hardening import _env, _worker_process
from tests.e2e.test_tls_roles_e2e import SECRETS, TLSCluster
from tests.integration.test_operator import _closed_port, _run_cli
from tests.support import FAST

pytestmark = pytest.mark.slow

TOKEN = "a-token-long-enough-for-any-host"
ATTACKER = "127.0.0.2"
"""Another loopback address (Linux answers on all of 127.0.0.0/8): the idle sockets come
from it, the honest client from 127.0.0.1."""


async def _spawn(tmp_path: Path, name: str, argv: list[str], env: dict[str, str]) -> Proc:
    log = tmp_path / f"{name}.log"
    process = await spawn_cli(log, argv, env)
    return Proc(name, process, log)


@contextlib.asynccontextmanager
async def _main(tmp_path: Path, *extra: str, **env: str) -> AsyncIterator[tuple[Proc, int]]:
    """A real ``broker-main`` on SQLite, its token in its environment."""
    port = free_port()
    argv = ["main", "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}"]
    argv += ["--port", str(port), *extra]
    main = await _spawn(tmp_path, "main", argv, _env(BROKER_TOKEN=TOKEN, **env))
    try:
        await main.wait_for_output("broker-main listening on", timeout=60)
        yield main, port
    finally:
        await main.kill()


@contextlib.asynccontextmanager
async def _idle_sockets(port: int, count: int) -> AsyncIterator[None]:
    """``count`` sockets from :data:`ATTACKER` that never say hello (nor start TLS), each
    opened again as soon as the main closes it: the handshake slots they can take, they
    hold all the time."""

    async def hold() -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(ATTACKER, 0)
                )
            except OSError:
                await asyncio.sleep(0.05)
                continue
            try:
                await reader.read()  # until the main closes it
            except OSError:
                pass
            finally:
                writer.close()
            await asyncio.sleep(0.05)  # refused at once: no busy loop

    holders = [asyncio.create_task(hold()) for _ in range(count)]
    try:
        yield
    finally:
        for holder in holders:
            holder.cancel()
        await asyncio.gather(*holders, return_exceptions=True)


BIDI = "app.invoice\u202etxt.exe"
"""A task name that a terminal would show as ``app.invoiceexe.txt``."""
BIDI_CHARACTERS = "[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"

IDLE = 80
"""More idle sockets than the handshake slots of one address (64), so some of them wait
in line, and the main's log says when they are all taken."""


async def _handshake_slots_taken(main: Proc, *, tls: bool = False) -> None:
    """Wait until the attacker's slots are all taken: the main refuses its surplus (which
    waited in line for the whole handshake deadline). On a TLS port the line drains as
    the idle handshakes time out, so there the sign is those time-outs: slots held for
    the whole deadline."""
    if tls:
        await main.wait_for_output(f"TLS handshake failed peer={ATTACKER}", timeout=60)
    else:
        await main.wait_for_output(f"connection refused peer={ATTACKER}", timeout=60)


# ------------------------------------------------------------------ finding 5


async def test_idle_sockets_from_one_address_leave_another_address_unaffected(
    tmp_path: Path,
) -> None:
    async with _main(tmp_path) as (main, port), _idle_sockets(port, IDLE):
        started = asyncio.get_running_loop().time()
        await _handshake_slots_taken(main)
        failures: list[BaseException] = []
        for _ in range(20):
            try:
                async with Client("127.0.0.1", port, token=TOKEN, timeout=10) as client:
                    await client.status()
            except BrokerError as exc:
                failures.append(exc)
        assert failures == [], f"{len(failures)} of 20 refused: {failures[0]!r}"
        await main.wait_for_output("not_logged_before=", timeout=60)
        refusals = main.output().count("connection refused")
        elapsed = asyncio.get_running_loop().time() - started
        assert refusals <= 20 + elapsed + 2, "logged within the rate: 20, then 1 a second"


async def test_idle_tls_sockets_from_one_address_leave_another_address_unaffected(
    tmp_path: Path,
) -> None:
    cluster = TLSCluster(tmp_path)
    try:
        main = await cluster.start_main()
        async with _idle_sockets(cluster.port, IDLE):
            await _handshake_slots_taken(main, tls=True)
            for _ in range(20):
                async with cluster.client(Role.OPERATOR) as client:
                    assert await client.status()
    finally:
        await cluster.close()


# ------------------------------------------------------------ TLS without a client certificate


async def test_a_peer_without_a_client_certificate_is_logged_as_such(tmp_path: Path) -> None:
    cluster = TLSCluster(tmp_path)
    try:
        main = await cluster.start_main()
        anonymous = await cluster.worker("anonymous", SECRETS["worker"], client_cert=False)
        await anonymous.wait_for_output("client certificate", timeout=60)
        await anonymous.kill()
        tls = cluster.peer_tls_args(client_cert=False)
        refused = subprocess.run(
            [*cluster.command, "--main", cluster.main_address, *tls, "status"],
            cwd=REPO,
            env=cluster.env(BROKER_OPERATOR_TOKEN=SECRETS["operator"]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 1, refused.stderr
        await main.wait_for_output("TLS handshake failed", count=2, timeout=30)
        failures = [line for line in main.output().splitlines() if "TLS handshake failed" in line]
        assert all("it sent no client certificate" in line for line in failures), failures
        assert "no TLS handshake within" not in main.output()
    finally:
        await cluster.close()


# ------------------------------------------------------------------ the worker's secrets


async def test_task_code_cannot_read_the_workers_secrets_from_proc(tmp_path: Path) -> None:
    async with _worker_process(tmp_path) as worker:
        for task in ("pooled_ancestors_environments", "forked_ancestors_environments"):
            job = await worker.run(task)
            assert job.status is JobStatus.COMPLETED, job.last_error
            environments = job.result
            assert isinstance(environments, list) and environments, task
            assert "BROKER_MAIN=" in environments[0] or any(
                "BROKER_MAIN=" in seen for seen in environments
            ), "the worker's own block was read (its other variables stay)"
            for seen in environments:
                assert HARDENING_TOKEN not in seen, task
                assert "db-pa55word" not in seen, task


# ------------------------------------------------------------------ token file and length


async def test_a_token_file_others_may_read_is_refused_by_a_real_main(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    secrets.write_text(f"all={TOKEN}\n")
    secrets.chmod(0o644)
    argv = ["main", "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'b.db'}", "--port", "0"]
    main = await _spawn(tmp_path, "main", [*argv, "--token-file", str(secrets)], _env())
    try:
        assert await main.exit_code(timeout=60) != 0
    finally:
        await main.kill()
    assert f"--token-file {secrets} is accessible to its group or others (mode 0644)" in (
        main.output()
    ), main.output()
    assert "chmod 600" in main.output()
    assert TOKEN not in main.output()


async def test_a_short_token_beyond_loopback_is_refused_by_a_real_main(tmp_path: Path) -> None:
    argv = ["main", "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'b.db'}"]
    argv += ["--host", "0.0.0.0", "--port", str(free_port())]
    main = await _spawn(tmp_path, "main", argv, _env(BROKER_TOKEN="x"))
    try:
        assert await main.exit_code(timeout=60) != 0
    finally:
        await main.kill()
    assert "secret of fewer than 16 characters" in main.output(), main.output()


# ------------------------------------------------------------------ failed authentications


async def test_failed_authentications_are_logged_with_the_peer_within_a_rate(
    tmp_path: Path,
) -> None:
    async with _main(tmp_path) as (main, port):
        attempts = 0
        while "not_logged_before=" not in main.output():
            assert attempts < 2000, "the rate never let a line through with its count"
            with pytest.raises(AuthenticationError):
                async with Client("127.0.0.1", port, token="not-the-token-at-all") as client:
                    await client.status()
            attempts += 1
        lines = [line for line in main.output().splitlines() if "authentication failed" in line]
    assert all("peer=('127.0.0.1', " in line for line in lines), lines[:3]
    assert "wrong or missing token proof for the client role" in lines[0]
    unlogged = int(re.findall(r"not_logged_before=(\d+)", lines[-1])[0])
    assert len(lines) < attempts and len(lines) + unlogged == attempts, (len(lines), attempts)
    assert len(lines) <= 20 + 1 + 60, "a burst of 20, then about 1 a second"


# ------------------------------------------------------------------ the state directory


async def test_a_worker_refuses_a_state_directory_that_is_a_symbolic_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "someone-elses"
    elsewhere.mkdir()
    (elsewhere / "worker-id").write_text("precious\n")
    planted = tmp_path / "state"
    planted.symlink_to(elsewhere)
    argv = ["worker", "--main", f"127.0.0.1:{_closed_port()}", "--app", "tests.hardening_app"]
    argv += ["--pooled-runner-count", "0", "--forked-concurrency", "0"]
    worker = await _spawn(tmp_path, "worker", [*argv, "--state-dir", str(planted)], _env())
    try:
        assert await worker.exit_code(timeout=60) != 0
    finally:
        await worker.kill()
    assert f"cannot use {planted} as the state directory: it is a symbolic link" in (
        worker.output()
    ), worker.output()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["worker-id"], "nothing written there"
    assert (elsewhere / "worker-id").read_text() == "precious\n"


# ------------------------------------------------------------------ python -m and the cwd


def test_python_m_broker_cli_never_imports_json_or_msgspec_from_the_working_directory(
    tmp_path: Path,
) -> None:
    markers = []
    for name in ("json", "msgspec", "typing", "__future__"):
        marker = tmp_path / f"{name}-ran"
        (tmp_path / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'w').close()\nraise ImportError('planted')\n"
        )
        markers.append(marker)
    done = subprocess.run(
        [sys.executable, "-m", "broker.ops.cli", "broker", "--help"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert [m.name for m in markers if m.exists()] == []


# ------------------------------------------------------------------ bidi controls


async def test_the_operator_cli_escapes_bidi_controls(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'jobs.db'}"
    store = SQLAlchemyAdapter(url)
    await store.setup()
    job = (await store.enqueue(JobSpec(task="app.plain"))).job
    await store.close()
    with sqlite3.connect(tmp_path / "jobs.db") as db:
        db.execute("UPDATE broker_jobs SET task = ? WHERE id = ?", (BIDI, job.id.hex))
    common = ["--main", f"127.0.0.1:{_closed_port()}", "--database-url", url, "--timeout", "2"]
    for command in (["jobs"], ["job", str(job.id)]):
        code, out, err = await asyncio.to_thread(_run_cli, [*common, *command])
        assert code == 0, err
        assert "app.invoice\\u202etxt.exe" in out, out
        assert not re.search(BIDI_CHARACTERS, out), out


async def test_the_dashboard_escapes_bidi_controls(tmp_path: Path) -> None:
    store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}")
    main = Main(store, FAST, retention=None)
    await main.start()
    site = Dashboard(main, host="127.0.0.1", port=0)
    await site.start()
    try:
        [result] = await store.enqueue_many([JobSpec(task=BIDI, queue="q\u2066x")])
        async with aiohttp.ClientSession() as http:
            for path in ("/jobs", f"/jobs/{result.job.id}", "/"):
                async with http.get(f"http://127.0.0.1:{site.port}{path}") as response:
                    assert response.status == 200, path
                    page = await response.text()
                assert not re.search(BIDI_CHARACTERS, page), path
                assert "app.invoice\\u202etxt.exe" in page or path == "/", path
    finally:
        await site.stop()
        await main.stop()
