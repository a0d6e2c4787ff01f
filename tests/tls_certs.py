"""Certificates for the TLS tests, made with trustme: a CA, certificates it signs for the
main and for peers (good, expired, for another host), and a second CA nobody trusts."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import trustme

from broker.wire.tls import PeerTLS, ServerTLS


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


def _write(cert: trustme.LeafCert, directory: Path, name: str) -> Pair:
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key_path))
    return Pair(str(cert_path), str(key_path))


class Certificates:
    """Every file a TLS test needs, under ``directory``."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        past = {
            "not_before": now - datetime.timedelta(days=2),
            "not_after": now - datetime.timedelta(days=1),
        }
        self.ca = trustme.CA()
        self.ca_path = str(directory / "ca.pem")
        self.ca.cert_pem.write_to_path(self.ca_path)
        other = trustme.CA()
        self.other_ca_path = str(directory / "other-ca.pem")
        other.cert_pem.write_to_path(self.other_ca_path)
        self.server = _write(self.ca.issue_cert("127.0.0.1", "localhost"), directory, "server")
        self.expired_server = _write(
            self.ca.issue_cert("127.0.0.1", **past),
            directory,
            "expired-server",  # type: ignore[arg-type]
        )
        self.wrong_host = _write(self.ca.issue_cert("other.example"), directory, "wrong-host")
        self.peer = _write(self.ca.issue_cert("worker-1"), directory, "peer")
        self.expired_peer = _write(
            self.ca.issue_cert("worker-2", **past),
            directory,
            "expired-peer",  # type: ignore[arg-type]
        )
        self.stranger = _write(other.issue_cert("worker-3"), directory, "stranger")

    def server_tls(self, pair: Pair | None = None, *, mutual: bool = False) -> ServerTLS:
        pair = pair or self.server
        return ServerTLS(pair.cert, pair.key, self.ca_path if mutual else None)

    def peer_tls(self, pair: Pair | None = None, *, ca: str | None = None) -> PeerTLS:
        return PeerTLS(
            ca=ca or self.ca_path,
            client_cert=None if pair is None else pair.cert,
            client_key=None if pair is None else pair.key,
        )
