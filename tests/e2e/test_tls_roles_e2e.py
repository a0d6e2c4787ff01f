"""TLS, mutual TLS and per-role credentials with real processes: a ``broker-main`` whose
secrets come from a token file, a ``broker-worker`` and the operator's ``broker`` command
whose secrets come from the environment (never the command line), and an application's
``Client``. Each does what its role may, and a peer with the wrong credential or without
a client certificate is told so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.client.client import Client
from broker.wire.messages import Role
from tests.e2e.test_e2e import APP, RECORD, REPO, Proc, eventually, free_port, spawn_cli
from tests.support import cli_with_greeting_wait
from tests.tls_certs import Certificates

pytestmark = pytest.mark.slow

SECRETS = {"worker": "w-secret-1", "client": "c-secret-2", "operator": "o-secret-3"}


class TLSCluster:
    command = (sys.executable, "-m", "broker.ops.cli", "broker")

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.certs = Certificates(tmp_path / "certs")
        self.port = free_port()
        self.main_address = f"127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        self.runs = tmp_path / "runs"
        self.runs.mkdir()

    def env(self, **secrets: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
        env["BROKER_E2E_LOG_DIR"] = str(self.runs)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(secrets)
        return env

    def peer_tls_args(self, *, client_cert: bool = True) -> list[str]:
        args = ["--tls-ca", self.certs.ca_path]
        if client_cert:
            args += ["--tls-client-cert", self.certs.peer.cert]
            args += ["--tls-client-key", self.certs.peer.key]
        return args

    async def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        log = self.dir / f"{len(self.procs):02d}-{name}.log"
        process = await spawn_cli(log, argv, env)
        proc = Proc(name, process, log)
        self.procs.append(proc)
        return proc

    async def start_main(self) -> Proc:
        token_file = self.dir / "secrets"
        token_file.write_text("".join(f"{role}={secret}\n" for role, secret in SECRETS.items()))
        token_file.chmod(0o600)
        certs = self.certs
        argv = ["main", "--database-url", f"sqlite+aiosqlite:///{self.dir / 'broker.db'}"]
        argv += ["--port", str(self.port), "--tls-cert", certs.server.cert]
        argv += ["--tls-key", certs.server.key, "--tls-client-ca", certs.ca_path]
        proc = await self.spawn("main", argv, self.env(BROKER_TOKEN_FILE=str(token_file)))
        await proc.wait_for_output("broker-main listening on")
        return proc

    async def worker(self, name: str, secret: str, *, client_cert: bool = True) -> Proc:
        argv = ["worker", "--main", self.main_address, "--app", APP, "--worker-id", name]
        argv += ["--pooled-runner-count", "0", "--forked-concurrency", "0"]
        argv += self.peer_tls_args(client_cert=client_cert)
        return await self.spawn(name, argv, self.env(BROKER_WORKER_TOKEN=secret))

    def broker(
        self, *argv: str, tls: bool = True, **secrets: str
    ) -> subprocess.CompletedProcess[str]:
        """The operator's command, its secrets in its environment. Without TLS it waits
        for a greeting the TLS main never sends: 0.25 s, not the 2 s default."""
        tls_args = self.peer_tls_args() if tls else []
        command = self.command if tls else cli_with_greeting_wait(0.25, "broker")
        return subprocess.run(
            [*command, "--main", self.main_address, *tls_args, *argv],
            cwd=REPO,
            env=self.env(**secrets),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def client(self, role: Role = Role.CLIENT) -> Client:
        return Client(
            "127.0.0.1",
            self.port,
            token=SECRETS[role.value],
            role=role,
            tls=self.certs.peer_tls(self.certs.peer),
        )

    async def close(self) -> None:
        for proc in self.procs:
            await proc.kill()


async def test_tls_mutual_tls_and_roles_end_to_end(tmp_path: Path) -> None:
    cluster = TLSCluster(tmp_path)
    try:
        await cluster.start_main()
        worker = await cluster.worker("tls-worker", SECRETS["worker"])
        await worker.wait_for_output("connected to main")

        # An application's client enqueues over mutual TLS; the worker runs the job.
        async with cluster.client() as client:
            done = await client.enqueue(RECORD, ["k1"], execution_mode="inline")
            delayed = await client.enqueue(RECORD, ["k2"], delay=3600)
            finished = await client.wait(done.job_id, timeout=30)
        assert finished["status"] == "completed"

        # The operator's command reads over TLS with the operator secret from its
        # environment, and a client secret cannot cancel.
        status = cluster.broker("status", "--json", BROKER_OPERATOR_TOKEN=SECRETS["operator"])
        assert status.returncode == 0, status.stderr
        assert '"tls-worker"' in status.stdout
        denied = cluster.broker(
            "cancel", str(delayed.job_id), BROKER_CLIENT_TOKEN=SECRETS["client"]
        )
        assert denied.returncode == 1
        assert "'cancel' needs the operator role" in denied.stderr, denied.stderr
        cancelled = cluster.broker(
            "cancel", str(delayed.job_id), "--json", BROKER_OPERATOR_TOKEN=SECRETS["operator"]
        )
        assert cancelled.returncode == 0, cancelled.stderr
        assert '"cancelled"' in cancelled.stdout

        # Without TLS the command is told the main may be serving TLS.
        plain = cluster.broker("status", tls=False, BROKER_OPERATOR_TOKEN=SECRETS["operator"])
        assert plain.returncode == 1 and "a main serving TLS" in plain.stderr, plain.stderr

        # A worker holding a client's secret cannot join, and gives up saying why.
        intruder = await cluster.worker("intruder", SECRETS["client"])
        assert await intruder.exit_code(timeout=60) != 0
        assert "wrong or missing token proof for the worker role" in intruder.output()

        # A worker without a client certificate is refused by mutual TLS, and says so.
        anonymous = await cluster.worker("anonymous", SECRETS["worker"], client_cert=False)
        await anonymous.wait_for_output("client certificate", timeout=60)
        await anonymous.kill()

        # The good worker was never disturbed: it still runs jobs.
        async with cluster.client() as client:
            again = await client.enqueue(RECORD, ["k3"], execution_mode="inline")
            assert (await client.wait(again.job_id, timeout=30))["status"] == "completed"
        await eventually(lambda: worker.process.returncode is None, "the worker still runs")
    finally:
        await cluster.close()
