"""TLS and mutual TLS on a real main over real TCP: good peers get in; each bad case gets
an error that says what is wrong, and never disturbs a connection that is already up."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from adapters.memory import MemoryAdapter
from broker.client.client import Client
from broker.exceptions import BrokerError, ConfigurationError, ProtocolError
from broker.main.main import Main
from broker.wire.tls import PeerTLS, ServerTLS
from tests.support import FAST, running_main, until
from tests.tls_certs import Certificates


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates(tmp_path_factory.mktemp("certs"))


@asynccontextmanager
async def tls_main(tls: ServerTLS | None) -> AsyncIterator[Main]:
    async with running_main(MemoryAdapter(), replace(FAST, tls=tls)) as main:
        yield main


def _client(main: Main, tls: PeerTLS | None, host: str = "127.0.0.1") -> Client:
    return Client(host, main.port, tls=tls, timeout=5, greeting_timeout=1.5)


async def _refused(main: Main, tls: PeerTLS | None, host: str = "127.0.0.1") -> BrokerError:
    client = _client(main, tls, host)
    try:
        await client.connect()
    except BrokerError as exc:
        return exc
    finally:
        await client.close()
    raise AssertionError("the connection was accepted")


async def test_a_peer_that_trusts_the_ca_works_over_tls(certs: Certificates) -> None:
    async with tls_main(certs.server_tls()) as main, _client(main, certs.peer_tls()) as client:
        job = await client.enqueue("t.task")
        assert (await client.get_job(job.job_id)) is not None


@pytest.mark.parametrize(
    ("case", "error", "text"),
    [
        ("wrong CA", ConfigurationError, "is not accepted: unable to get local issuer"),
        ("expired", ConfigurationError, "is not accepted: certificate has expired"),
        ("wrong host", ConfigurationError, "mismatch, certificate is not valid for '127.0.0.1'"),
        ("plaintext", ProtocolError, "or a main serving TLS (a peer connects to it with --tls-ca)"),
    ],
)
async def test_each_bad_case_is_a_clear_error_and_disturbs_no_other_connection(
    certs: Certificates, case: str, error: type[BrokerError], text: str
) -> None:
    server = {"expired": certs.expired_server, "wrong host": certs.wrong_host}.get(case)
    tls = {
        "wrong CA": certs.peer_tls(ca=certs.other_ca_path),
        "plaintext": None,
    }.get(case, certs.peer_tls())
    async with tls_main(certs.server_tls(server)) as main:
        # A peer already connected (it skips verification, to reach even a bad certificate).
        lenient = certs.peer_tls().context()
        lenient.check_hostname = False
        lenient.verify_mode = 0  # ssl.CERT_NONE
        async with Client("127.0.0.1", main.port, tls=lenient, timeout=5) as bystander:
            exc = await _refused(main, tls)
            assert isinstance(exc, error), repr(exc)
            assert text in str(exc), str(exc)
            assert await bystander.status()


async def test_a_tls_peer_of_a_plain_main_is_told_the_main_does_not_speak_tls(
    certs: Certificates,
) -> None:
    async with tls_main(None) as main:
        exc = await _refused(main, certs.peer_tls())
        assert isinstance(exc, ConfigurationError)
        assert "does not speak TLS" in str(exc), str(exc)


async def test_mutual_tls_admits_a_peer_with_a_certificate_of_the_ca(
    certs: Certificates,
) -> None:
    server = certs.server_tls(mutual=True)
    async with tls_main(server) as main, _client(main, certs.peer_tls(certs.peer)) as client:
        assert await client.status()


@pytest.mark.parametrize("case", ["missing", "stranger", "expired"])
async def test_mutual_tls_refuses_a_peer_without_a_valid_client_certificate(
    certs: Certificates, case: str
) -> None:
    pair = {"missing": None, "stranger": certs.stranger, "expired": certs.expired_peer}[case]
    async with (
        tls_main(certs.server_tls(mutual=True)) as main,
        _client(main, certs.peer_tls(certs.peer)) as bystander,
    ):
        exc = await _refused(main, certs.peer_tls(pair))
        # Under TLS 1.3 the main refuses the certificate after the peer's side of the
        # handshake is done, and closes: the peer sees the close (or, if the alert
        # arrives first, the alert itself); both messages name the flags to check.
        assert isinstance(exc, ProtocolError | ConfigurationError), repr(exc)
        assert "client certificate" in str(exc) and "--tls-client-cert" in str(exc), str(exc)
        assert await bystander.status()


def test_unreadable_files_are_a_configuration_error(tmp_path: Path, certs: Certificates) -> None:
    with pytest.raises(ConfigurationError, match="cannot load --tls-cert/--tls-key"):
        ServerTLS(str(tmp_path / "none.pem"), str(tmp_path / "none.key")).context()
    with pytest.raises(ConfigurationError, match="cannot load --tls-ca"):
        PeerTLS(ca=certs.server.key).context()


@pytest.mark.parametrize(
    ("case", "logged"),
    [
        ("missing", "it sent no client certificate"),
        ("stranger", "its client certificate is not accepted: unable to get local issuer"),
        ("expired", "its client certificate is not accepted: certificate has expired"),
        ("plaintext", "no TLS handshake within 0.5 s: a peer without TLS"),
    ],
)
async def test_the_main_logs_each_failed_handshake_with_its_reason(
    certs: Certificates, case: str, logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    pair = {"stranger": certs.stranger, "expired": certs.expired_peer}.get(case)
    peer = None if case == "plaintext" else certs.peer_tls(pair)
    async with tls_main(certs.server_tls(mutual=True)) as main:
        await _refused(main, peer)
        await until(lambda: "TLS handshake failed" in caplog.text)
    assert f"TLS handshake failed peer=127.0.0.1 reason={logged}" in caplog.text, caplog.text


async def test_tls_handshakes_over_the_limit_wait_their_turn(certs: Certificates) -> None:
    settings = replace(FAST, tls=certs.server_tls(), max_unauthenticated=2, handshake_timeout=30)
    async with running_main(MemoryAdapter(), settings) as main:
        silent = [await asyncio.open_connection("127.0.0.1", main.port) for _ in range(2)]
        await until(lambda: len(main.connections.tls_handshakes) == 2)
        third = await asyncio.open_connection("127.0.0.1", main.port)
        await until(lambda: main.connections.admission.waiting == 1)  # in line, not closed
        silent[0][1].close()  # a handshake ends: the one in line takes its slot
        await until(lambda: main.connections.admission.waiting == 0)
        for _, writer in [silent[1], third]:
            writer.close()
        async with Client("127.0.0.1", main.port, tls=certs.peer_tls()) as client:
            assert (await client.status())["main_id"] == main.main_id


def test_a_given_ca_is_the_only_one_trusted(certs: Certificates) -> None:
    peer = certs.peer_tls().context()
    assert len(peer.get_ca_certs()) == 1, "not the system's CAs as well"
    assert peer.check_hostname and peer.verify_mode == ssl.CERT_REQUIRED
    server = certs.server_tls(mutual=True).context()
    assert len(server.get_ca_certs()) == 1 and server.verify_mode == ssl.CERT_REQUIRED
    assert certs.server_tls().context().verify_mode == ssl.CERT_NONE
