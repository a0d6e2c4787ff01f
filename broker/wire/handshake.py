"""The handshake, both sides, without I/O: challenge, then hello, then welcome.

The main speaks first (``challenge``: a nonce, and whether peers must prove a secret),
the peer answers ``hello`` (its role, the protocols it speaks, an HMAC of the nonce),
and the main welcomes it or closes with an ``error``. Every decision of that exchange is
here, once for the main (:class:`ServerHandshake`) and once for every peer
(:class:`PeerHandshake`: the worker, the client and the operator's command refuse the
same answers the same way). The shells (:mod:`broker.main.connections`,
:mod:`broker.worker.link`, :mod:`broker.client.client`) only read and write the lines and
keep the deadlines.

Like h11 raising its protocol errors, the peer's side raises the broker's exception for a
refusal (:class:`~broker.exceptions.AuthenticationError`,
:class:`~broker.exceptions.NotLeaderError`, ...), since that is what its shell raises to
its caller; the main's side returns what to answer, since its shell answers and goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from broker.exceptions import ConfigurationError, ProtocolError
from broker.wire import errors as error_codes
from broker.wire import messages as protocol
from broker.wire.credentials import Credentials


class PeerHandshake:
    """A peer's side: fed the main's greeting, it says the hello to send; fed the answer,
    it says the welcome, or raises why there is none.

    ``hello`` is the peer's hello without its proof (each program fills in what it says
    about itself); the proof of ``token`` is added once the challenge gives the nonce.
    """

    def __init__(self, hello: protocol.Hello, token: str | None) -> None:
        self._hello = hello
        self._token = token

    def challenged(self, greeting: protocol.Challenge | protocol.Error) -> protocol.Hello:
        """The hello answering ``greeting`` (what :func:`broker.wire.framing.read_greeting`
        returned).

        :raises ProtocolError: the main refused the connection before the handshake (a
            connection limit), as the subclass its error code names.
        :raises ConfigurationError: the main requires a token and this peer has none; a
            hello without a proof would only be refused, so none is sent.
        """
        if isinstance(greeting, protocol.Error):
            raise error_codes.refusal(greeting)
        if greeting.auth_required and not self._token:
            role = self._hello.role
            raise ConfigurationError(
                f"the main requires a token: set the {role} secret of the main "
                f"(BROKER_{role.upper()}_TOKEN), or its shared BROKER_TOKEN"
            )
        proof = protocol.make_proof(self._token, greeting.nonce) if self._token else None
        return msgspec.structs.replace(self._hello, proof=proof)

    def answered(self, reply: protocol.Message | None) -> protocol.Welcome:
        """The main's welcome, from its answer to the hello (``None``: it closed).

        :raises ConnectionResetError: the main closed without an answer (retried like an
            unreachable main).
        :raises ProtocolError: the main refused the hello, as the subclass its error code
            names (:class:`~broker.exceptions.AuthenticationError`,
            :class:`~broker.exceptions.NotLeaderError` naming the leader, ...), or
            answered something else than a welcome.
        :raises ConfigurationError: the main chose a protocol this peer does not speak;
            retrying would not change it.
        """
        match reply:
            case None:
                raise ConnectionResetError("the main closed the connection before welcome")
            case protocol.Welcome() as welcome if welcome.protocol in protocol.SUPPORTED_PROTOCOLS:
                return welcome
            case protocol.Welcome() as welcome:
                raise ConfigurationError(
                    f"the main chose protocol {welcome.protocol}, which this "
                    f"{self._hello.role} does not speak: run the same broker version on both"
                )
            case protocol.Error() as error:
                raise error_codes.refusal(error)
            case _:
                raise ProtocolError(f"expected welcome from the main, got {reply.type}")


@dataclass(frozen=True, slots=True)
class Accepted:
    """The hello passed: the peer may join, with the rights its proof earned."""

    hello: protocol.Hello
    rights: frozenset[protocol.Role]
    """The roles whose requests the connection may make
    (:meth:`~broker.wire.credentials.Credentials.rights`)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The hello did not pass: answer ``code`` and ``message`` in a fatal error and close."""

    code: protocol.ErrorCode
    message: str
    role: protocol.Role | None = None
    """Set for a failed authentication, which the main logs with the peer's address within
    a rate (a peer guessing secrets must not flood the log) instead of as a warning."""


class ServerHandshake:
    """The main's side: the challenge to send, then the verdict on the first message."""

    def __init__(self, credentials: Credentials, nonce: str) -> None:
        self._credentials = credentials
        self._nonce = nonce

    def challenge(self) -> protocol.Challenge:
        return protocol.Challenge(
            nonce=self._nonce,
            protocol=protocol.PROTOCOL_VERSION,
            auth_required=self._credentials.required,
        )

    def received(self, first: protocol.Message) -> Accepted | Refused:
        """The verdict on the peer's first message: it must be a hello, prove its role's
        secret, and speak a protocol this main speaks, checked in that order."""
        if not isinstance(first, protocol.Hello):
            return Refused(protocol.ErrorCode.NOT_ALLOWED, "the first message must be hello")
        credentials = self._credentials
        refusal = credentials.refusal(first.role, self._nonce, first.proof)
        if refusal is not None:
            return Refused(protocol.ErrorCode.AUTH_FAILED, refusal, role=first.role)
        if protocol.choose_protocol(first) is None:
            ours = ", ".join(map(str, protocol.SUPPORTED_PROTOCOLS))
            theirs = ", ".join(map(str, first.spoken()))
            return Refused(
                protocol.ErrorCode.PROTOCOL_VERSION,
                f"this main speaks protocol {ours}, not {theirs}",
            )
        return Accepted(first, credentials.rights(first.role, self._nonce, first.proof))


__all__ = ["Accepted", "PeerHandshake", "Refused", "ServerHandshake"]
