"""TLS between the main and its peers, with the standard library's ``ssl``.

The main serves TLS when given a certificate and key (:class:`ServerTLS`); with a CA for
client certificates it also demands one from every peer (mutual TLS). A peer uses TLS
when given the CA that signed the main's certificate, or the system's trust store
(:class:`PeerTLS`); it always verifies the certificate and that it names the host it
dialled, since a TLS connection to whoever answers would prove nothing.

A failed handshake is described for the operator (:func:`describe`), naming the flag to
check, rather than as OpenSSL's reason code.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass

from broker.exceptions import ConfigurationError


@dataclass(frozen=True)
class ServerTLS:
    """The main's side: ``--tls-cert``, ``--tls-key`` and, for mutual TLS,
    ``--tls-client-ca``."""

    cert: str
    key: str
    client_ca: str | None = None

    def context(self) -> ssl.SSLContext:
        """The server context; unreadable files are a :class:`ConfigurationError`."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # trusts no CA until told
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load(lambda: ctx.load_cert_chain(self.cert, self.key), "--tls-cert/--tls-key")
        if self.client_ca is not None:
            _load(lambda: ctx.load_verify_locations(cafile=self.client_ca), "--tls-client-ca")
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass(frozen=True)
class PeerTLS:
    """A worker's or client's side: ``--tls-ca`` (``None``: the system's trust store;
    given, that CA alone) and, for mutual TLS, ``--tls-client-cert`` and
    ``--tls-client-key``."""

    ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    def context(self) -> ssl.SSLContext:
        """A context that verifies the main's certificate and host name."""
        if self.ca is None:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        else:
            # Only this CA: the system's would also vouch for any public certificate
            # that names the main's host.
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, checks the host
            _load(lambda: ctx.load_verify_locations(cafile=self.ca), "--tls-ca")
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.client_cert is not None:
            _load(
                lambda: ctx.load_cert_chain(self.client_cert or "", self.client_key),
                "--tls-client-cert/--tls-client-key",
            )
        elif self.client_key is not None:
            raise ConfigurationError("--tls-client-key needs --tls-client-cert")
        return ctx


def _load(load: Callable[[], None], flags: str) -> None:
    try:
        load()
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ConfigurationError(f"cannot load {flags}: {exc}") from None


_NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG")
"""OpenSSL's reasons when the other side answered in plain text."""

_CERTIFICATE_WANTED = ("CERTIFICATE_REQUIRED", "HANDSHAKE_FAILURE", "PEER_DID_NOT_RETURN")
_CERTIFICATE_REFUSED = (
    "BAD_CERTIFICATE",
    "CERTIFICATE_EXPIRED",
    "UNKNOWN_CA",
    "CERTIFICATE_UNKNOWN",
)


def describe(exc: ssl.SSLError, where: str) -> str:
    """What a failed TLS handshake with the main at ``where`` means, for a peer's log."""
    reason = (exc.reason or "").upper()
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"the TLS certificate of the main at {where} is not accepted: "
            f"{exc.verify_message}; check --tls-ca, the certificate's dates, and that "
            "--main names a host the certificate is for"
        )
    if any(name in reason for name in _NOT_TLS):
        return (
            f"the main at {where} does not speak TLS ({exc.reason}): start it with "
            "--tls-cert and --tls-key, or connect without --tls-ca"
        )
    if any(name in reason for name in _CERTIFICATE_WANTED):
        return (
            f"the main at {where} requires a client certificate (mutual TLS) and got none "
            f"it accepts ({exc.reason}): pass --tls-client-cert and --tls-client-key"
        )
    if any(name in reason for name in _CERTIFICATE_REFUSED):
        return (
            f"the main at {where} refused this peer's client certificate ({exc.reason}): "
            "check --tls-client-cert against the main's --tls-client-ca, and its dates"
        )
    return f"the TLS handshake with the main at {where} failed: {exc}"


_PEER_NOT_TLS = (*_NOT_TLS, "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "UNEXPECTED_EOF")


def describe_peer_failure(exc: BaseException, deadline: float) -> str:
    """Why a peer's TLS handshake with the main failed, for the main's log."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"its client certificate is not accepted: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        reason = (exc.reason or "").upper()
        if "PEER_DID_NOT_RETURN_A_CERTIFICATE" in reason:
            return "it sent no client certificate (this main requires one: --tls-client-ca)"
        if any(name in reason for name in _PEER_NOT_TLS):
            return f"it does not speak TLS ({exc.reason}); give the peer --tls-ca"
        return str(exc)
    if isinstance(exc, ConnectionAbortedError | TimeoutError):
        return (
            f"no TLS handshake within {deadline:g} s: a peer without TLS (it waits for the "
            "main's greeting), or one too slow; give the peer --tls-ca"
        )
    return str(exc) or type(exc).__name__
