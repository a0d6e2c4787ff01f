"""``--main`` (and ``BROKER_MAIN``) addresses: what is accepted, and the clear error for
what is not, instead of a traceback from the socket layer."""

from __future__ import annotations

import pytest

from broker.exceptions import ConfigurationError
from broker.wire.addresses import MainAddresses, parse_address
from broker.wire.messages import DEFAULT_PORT


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:7390", ("127.0.0.1", 7390)),
        ("main.internal:1", ("main.internal", 1)),
        ("localhost", ("localhost", DEFAULT_PORT)),
        ("10.0.0.5", ("10.0.0.5", DEFAULT_PORT)),
        ("[::1]:7391", ("::1", 7391)),
        ("[::1]", ("::1", DEFAULT_PORT)),
        ("::1", ("::1", DEFAULT_PORT)),
    ],
)
def test_accepted(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("127.0.0.1:99999", "must be a number from 1 to 65535"),
        ("127.0.0.1:0", "must be a number from 1 to 65535"),
        ("127.0.0.1:http", "must be a number from 1 to 65535"),
        ("127.0.0.1:", "must be a number from 1 to 65535"),
        (":7390", "expected HOST:PORT"),
        ("[::1", "expected HOST:PORT or [IPv6]:PORT"),
        ("[::1]7390", "expected HOST:PORT or [IPv6]:PORT"),
    ],
)
def test_refused_with_the_text_that_named_it(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("[", r"\[")):
        parse_address(text)


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("main.internal:7601", [("main.internal", 7601)]),
        ("main.internal", [("main.internal", 7600)]),
        ("::1", [("::1", 7600)]),
        ("[::1]:7601", [("::1", 7601)]),
        ("a:7601,b", [("a", 7601), ("b", 7600)]),
    ],
)
def test_a_peer_takes_one_address_or_a_list_as_its_host(
    host: str, expected: list[tuple[str, int]]
) -> None:
    """``Client(host, port)``: a port in ``host`` wins over ``port``, alone or in a list."""
    assert MainAddresses(host, 7600).all == expected
