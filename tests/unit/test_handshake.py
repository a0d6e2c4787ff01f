"""The handshake's every branch, both sides, without a socket (:mod:`broker.wire.handshake`):
the worker, the client and the operator refuse the same answers the same way."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from broker.exceptions import (
    AuthenticationError,
    ConfigurationError,
    NotLeaderError,
    ProtocolError,
)
from broker.wire import messages as protocol
from broker.wire.credentials import Credentials
from broker.wire.handshake import Accepted, PeerHandshake, Refused, ServerHandshake
from broker.wire.messages import ErrorCode, Role

NONCE = "9f2c4b1a7d3e8f60a1b2c3d4e5f60718"
PEERS = [
    protocol.Hello(
        role=Role.WORKER,
        protocol=protocol.PROTOCOL_VERSION,
        protocols=list(protocol.SUPPORTED_PROTOCOLS),
        worker_id="w1",
        held_leases=[protocol.LeaseRef(uuid.uuid4(), uuid.uuid4())],
    ),
    protocol.Hello(role=Role.CLIENT, protocol=protocol.PROTOCOL_VERSION),
    protocol.Hello(role=Role.OPERATOR, protocol=protocol.PROTOCOL_VERSION),
]
"""A worker's hello, and a client's and an operator's as :class:`broker.client.Client`
says them."""


def challenge(*, auth_required: bool) -> protocol.Challenge:
    return protocol.Challenge(
        nonce=NONCE, protocol=protocol.PROTOCOL_VERSION, auth_required=auth_required
    )


def welcome(version: int = protocol.PROTOCOL_VERSION) -> protocol.Welcome:
    return protocol.Welcome(
        main_id="m", protocol=version, ping_interval=5.0, adopted=[], max_line_bytes=1000
    )


def error(code: ErrorCode, message: str, leader: str | None = None) -> protocol.Error:
    return protocol.Error(code=code, message=message, fatal=True, leader=leader)


# ------------------------------------------------------------------ the peer's side


@pytest.mark.parametrize("hello", PEERS, ids=lambda h: h.role)
def test_the_hello_carries_the_proof_of_the_token_and_nothing_else_changes(
    hello: protocol.Hello,
) -> None:
    sent = PeerHandshake(hello, "s3cret").challenged(challenge(auth_required=True))
    assert sent.proof == protocol.make_proof("s3cret", NONCE)
    assert protocol.check_proof("s3cret", NONCE, sent.proof)
    assert msgspec.structs.replace(sent, proof=None) == hello


@pytest.mark.parametrize("hello", PEERS, ids=lambda h: h.role)
def test_without_a_token_the_hello_has_no_proof_where_none_is_required(
    hello: protocol.Hello,
) -> None:
    assert PeerHandshake(hello, None).challenged(challenge(auth_required=False)) == hello
    # A token is proved even where none is required: the main checks it only if it must.
    proved = PeerHandshake(hello, "t").challenged(challenge(auth_required=False))
    assert proved.proof == protocol.make_proof("t", NONCE)


@pytest.mark.parametrize("hello", PEERS, ids=lambda h: h.role)
@pytest.mark.parametrize("token", [None, ""])
def test_every_peer_without_a_token_refuses_a_main_that_requires_one(
    hello: protocol.Hello, token: str | None
) -> None:
    """The worker always did; the client sent a hello without a proof, only to be refused."""
    with pytest.raises(ConfigurationError, match="the main requires a token") as raised:
        PeerHandshake(hello, token).challenged(challenge(auth_required=True))
    role = hello.role
    assert f"the {role} secret of the main (BROKER_{role.upper()}_TOKEN)" in str(raised.value)


def test_the_workers_refusal_keeps_its_documented_wording() -> None:
    with pytest.raises(ConfigurationError) as raised:
        PeerHandshake(PEERS[0], None).challenged(challenge(auth_required=True))
    assert str(raised.value) == (
        "the main requires a token: set the worker secret of the main "
        "(BROKER_WORKER_TOKEN), or its shared BROKER_TOKEN"
    )


@pytest.mark.parametrize("hello", PEERS, ids=lambda h: h.role)
def test_a_greeting_that_refuses_raises_the_mains_reason(hello: protocol.Hello) -> None:
    over = error(ErrorCode.OVER_LIMIT, "too many connections (--max-connections)")
    with pytest.raises(ProtocolError, match=r"^the main refused the connection: too many"):
        PeerHandshake(hello, None).challenged(over)


@pytest.mark.parametrize("hello", PEERS, ids=lambda h: h.role)
def test_a_welcome_in_a_protocol_spoken_is_the_handshakes_end(hello: protocol.Hello) -> None:
    assert PeerHandshake(hello, None).answered(welcome()) == welcome()


@pytest.mark.parametrize("hello", PEERS, ids=lambda h: h.role)
def test_every_peer_refuses_a_welcome_in_a_protocol_it_does_not_speak(
    hello: protocol.Hello,
) -> None:
    """The worker always did; the client went on in a protocol it could misread."""
    with pytest.raises(ConfigurationError, match=f"protocol 99, which this {hello.role} does"):
        PeerHandshake(hello, None).answered(welcome(99))


@pytest.mark.parametrize("hello", PEERS, ids=lambda h: h.role)
@pytest.mark.parametrize(
    ("reply", "raised", "match"),
    [
        (None, ConnectionResetError, "closed the connection before welcome"),
        (error(ErrorCode.AUTH_FAILED, "wrong token"), AuthenticationError, "wrong token"),
        (
            error(ErrorCode.PROTOCOL_VERSION, "this main speaks protocol 4, not 3"),
            ConfigurationError,
            "speaks protocol 4",
        ),
        (protocol.Pong(nonce=1), ProtocolError, "expected welcome from the main, got pong"),
    ],
)
def test_every_other_answer_to_the_hello_raises(
    hello: protocol.Hello,
    reply: protocol.Message | None,
    raised: type[Exception],
    match: str,
) -> None:
    with pytest.raises(raised, match=match):
        PeerHandshake(hello, None).answered(reply)


@pytest.mark.parametrize("hello", PEERS, ids=lambda h: h.role)
def test_a_standby_names_the_leader(hello: protocol.Hello) -> None:
    standby = error(ErrorCode.NOT_LEADER, "this main is a standby", leader="b:7390")
    with pytest.raises(NotLeaderError) as raised:
        PeerHandshake(hello, None).answered(standby)
    assert raised.value.leader == "b:7390"


# ------------------------------------------------------------------ the main's side


def test_the_challenge_says_whether_a_proof_is_required() -> None:
    open_main = ServerHandshake(Credentials(), NONCE).challenge()
    assert open_main == challenge(auth_required=False)
    closed_main = ServerHandshake(Credentials(client="c"), NONCE).challenge()
    assert closed_main == challenge(auth_required=True)


def test_the_first_message_must_be_a_hello() -> None:
    verdict = ServerHandshake(Credentials(), NONCE).received(protocol.Ping(nonce=1))
    assert verdict == Refused(ErrorCode.NOT_ALLOWED, "the first message must be hello")


def test_a_wrong_proof_is_an_authentication_failure_of_its_role() -> None:
    server = ServerHandshake(Credentials(worker="w", client="c"), NONCE)
    hello = PeerHandshake(PEERS[0], "c").challenged(server.challenge())
    assert server.received(hello) == Refused(
        ErrorCode.AUTH_FAILED, "wrong or missing token proof for the worker role", Role.WORKER
    )
    operator = PeerHandshake(PEERS[2], "c").challenged(server.challenge())
    verdict = server.received(operator)
    assert isinstance(verdict, Refused) and verdict.role is Role.OPERATOR
    assert "accepts no operator connections" in verdict.message


def test_a_hello_in_no_protocol_the_main_speaks_is_refused() -> None:
    server = ServerHandshake(Credentials(), NONCE)
    future = protocol.Hello(role=Role.CLIENT, protocol=99, protocols=[98, 99])
    assert server.received(future) == Refused(
        ErrorCode.PROTOCOL_VERSION,
        f"this main speaks protocol {protocol.PROTOCOL_VERSION}, not 98, 99",
    )


def test_authentication_is_checked_before_the_protocol() -> None:
    server = ServerHandshake(Credentials(client="c"), NONCE)
    verdict = server.received(protocol.Hello(role=Role.CLIENT, protocol=99))
    assert isinstance(verdict, Refused) and verdict.code is ErrorCode.AUTH_FAILED


@pytest.mark.parametrize(
    ("hello", "token", "rights"),
    [
        (PEERS[0], "w", {Role.WORKER}),
        (PEERS[1], "c", {Role.CLIENT}),
        (PEERS[1], "shared", {Role.CLIENT, Role.OPERATOR}),
        (PEERS[2], "o", {Role.CLIENT, Role.OPERATOR}),
    ],
)
def test_an_accepted_hello_earns_the_rights_of_its_proof(
    hello: protocol.Hello, token: str, rights: set[Role]
) -> None:
    credentials = Credentials(worker="w", client="c", operator="o")
    if token == "shared":
        credentials = Credentials(worker="shared", client="shared", operator="shared")
    server = ServerHandshake(credentials, NONCE)
    sent = PeerHandshake(hello, token).challenged(server.challenge())
    assert server.received(sent) == Accepted(sent, frozenset(rights))


def test_an_open_main_accepts_any_hello_with_every_right_but_a_workers() -> None:
    server = ServerHandshake(Credentials(), NONCE)
    for hello in PEERS:
        verdict = server.received(PeerHandshake(hello, None).challenged(server.challenge()))
        assert isinstance(verdict, Accepted)
        expected = {Role.WORKER} if hello.role is Role.WORKER else {Role.CLIENT, Role.OPERATOR}
        assert verdict.rights == expected
