"""The error table: every exception of the tree has its own wire code, and a failure
encoded by the main decodes in the client as the same exception with the same fields."""

from __future__ import annotations

import inspect
import uuid
from typing import Any

import pytest

from broker import exceptions
from broker.core.peers import CreditLimitError
from broker.exceptions import (
    AuthenticationError,
    BrokerError,
    ConfigurationError,
    IdempotencyConflictError,
    JobFailedError,
    NotLeaderError,
    OverLimitError,
    ProtocolError,
    StorageError,
    UniqueKeyTakenError,
)
from broker.wire import codec
from broker.wire import errors as error_codes
from broker.wire import framing as wire
from broker.wire import messages as protocol
from broker.wire.messages import ErrorCode


def _tree() -> list[type[BrokerError]]:
    """Every class of the tree ``broker/exceptions.py`` declares."""
    found: list[type[BrokerError]] = []
    todo: list[type[BrokerError]] = [BrokerError]
    while todo:
        cls = todo.pop()
        if cls.__module__ == exceptions.__name__:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


FIELDS: dict[type[BrokerError], dict[str, Any]] = {
    UniqueKeyTakenError: {"holder_id": uuid.UUID("0b5e6a4e-8a0c-4f5e-9b57-0d7f2c1e9a11")},
    NotLeaderError: {"leader": "main-b.internal:7600"},
    IdempotencyConflictError: {"existing_id": uuid.UUID("5d1c3e2a-0f4b-4c6d-8e7f-9a0b1c2d3e4f")},
    JobFailedError: {
        "job_id": uuid.UUID("7a1c3e2a-0f4b-4c6d-8e7f-9a0b1c2d3e4f"),
        "status": "failed",
    },
}
"""A sample of each field an exception takes besides its message."""


def _sample(cls: type[BrokerError]) -> BrokerError:
    extra = [
        name
        for name, param in inspect.signature(cls).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert sorted(extra) == sorted(FIELDS.get(cls, {})), (
        f"{cls.__name__} takes fields {extra}: add samples to FIELDS, and the fields to "
        "the class's wire_fields"
    )
    assert sorted(cls.wire_fields) == sorted(extra), f"{cls.__name__}.wire_fields"
    return cls(f"{cls.__name__} happened: a message with 'quotes' and ü", **FIELDS.get(cls, {}))


def _across_the_wire(exc: BaseException) -> BrokerError:
    """What the main sends for ``exc``, as the client's decoder reads and raises it."""
    line = codec.encode(error_codes.request_error("r1", exc))
    reply = codec.decode(line)
    assert isinstance(reply, protocol.RequestError) and reply.request_id == "r1"
    return error_codes.raised_by(reply)


def test_the_tree_is_the_one_the_module_documents() -> None:
    names = {cls.__name__ for cls in _tree()}
    assert len(names) == 25
    assert all(name in (exceptions.__doc__ or "") for name in names)


@pytest.mark.parametrize("cls", _tree(), ids=lambda cls: cls.__name__)
def test_every_exception_has_its_own_code(cls: type[BrokerError]) -> None:
    assert cls in error_codes.CODES, f"{cls.__name__} has no wire code"
    code = error_codes.CODES[cls]
    assert isinstance(code, ErrorCode)
    assert error_codes.CLASSES[code] is cls


def test_no_two_exceptions_share_a_code() -> None:
    codes = list(error_codes.CODES.values())
    assert len(codes) == len(set(codes))


@pytest.mark.parametrize("cls", _tree(), ids=lambda cls: cls.__name__)
def test_every_exception_round_trips_with_its_fields(cls: type[BrokerError]) -> None:
    sent = _sample(cls)
    received = _across_the_wire(sent)
    assert type(received) is cls
    assert str(received) == str(sent)
    assert vars(received) == vars(sent)


def test_a_unique_key_conflict_keeps_its_holder_on_the_wire() -> None:
    holder = uuid.uuid4()
    reply = error_codes.request_error("r2", UniqueKeyTakenError("taken", holder_id=holder))
    assert reply.code == ErrorCode.UNIQUE_KEY_TAKEN
    assert reply.details == {"holder_id": str(holder)}
    received = _across_the_wire(UniqueKeyTakenError("taken", holder_id=holder))
    assert isinstance(received, UniqueKeyTakenError) and received.holder_id == holder


def test_an_exception_without_fields_sends_no_details() -> None:
    assert error_codes.request_error("r", StorageError("down")).details is None
    assert error_codes.request_error("r", UniqueKeyTakenError("taken")).details is None


@pytest.mark.parametrize("details", [None, {}, {"holder_id": 7}, {"holder_id": "not a uuid"}])
def test_unreadable_details_still_raise_the_error(details: dict[str, Any] | None) -> None:
    received = error_codes.exception_for(ErrorCode.UNIQUE_KEY_TAKEN, "taken", details)
    assert isinstance(received, UniqueKeyTakenError) and received.holder_id is None


def test_a_subclass_outside_the_table_takes_its_nearest_base_code() -> None:
    exc = codec.DecodeError("list_jobs.cursor is not valid")
    assert error_codes.code_of(exc) == ErrorCode.MALFORMED
    assert type(_across_the_wire(exc)) is ProtocolError


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (CreditLimitError("ready.slots over the limit"), ErrorCode.OVER_LIMIT),
        (codec.DecodeError("message has no type"), ErrorCode.MALFORMED),
        (codec.UnknownTypeError("unknown message type 'launch'"), ErrorCode.UNKNOWN_TYPE),
        (wire.LineTooLongError("line exceeds 10 bytes"), ErrorCode.LINE_TOO_LONG),
        (wire.UnterminatedLineError("closed mid-line"), ErrorCode.UNTERMINATED),
        (wire.TooManyContainersError(b"{"), ErrorCode.PAYLOAD_TOO_LARGE),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else str(value),
)
def test_an_internal_protocol_error_carries_its_own_code(
    exc: ProtocolError, code: ErrorCode
) -> None:
    """The shells answer these with ``code_of``: the code is the class's, never chosen
    inline, and the peer raises the public base for it."""
    assert error_codes.code_of(exc) == code
    assert type(_across_the_wire(exc)) is error_codes.CLASSES[code]
    assert issubclass(error_codes.CLASSES[code], ProtocolError | exceptions.InvalidJobError)


def test_a_decode_refusal_over_a_bound_carries_the_code_it_names() -> None:
    exc = codec.OverBoundError("worker_status too long", code=ErrorCode.OVER_LIMIT)
    assert error_codes.code_of(exc) == ErrorCode.OVER_LIMIT


def test_anything_else_is_internal_and_arrives_as_a_broker_error() -> None:
    assert error_codes.code_of(KeyError("x")) == ErrorCode.INTERNAL
    received = _across_the_wire(ZeroDivisionError("oops"))
    assert type(received) is BrokerError and str(received) == "oops"


def test_a_code_from_a_newer_version_arrives_as_a_broker_error() -> None:
    received = error_codes.exception_for("quota_exceeded", "over quota", {"quota": 3})
    assert type(received) is BrokerError and str(received) == "over quota"


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (ErrorCode.AUTH_FAILED, AuthenticationError),
        (ErrorCode.PROTOCOL_VERSION, ConfigurationError),
        (ErrorCode.OVER_LIMIT, OverLimitError),
        (ErrorCode.HANDSHAKE_TIMEOUT, ProtocolError),
        (ErrorCode.NOT_ALLOWED, ProtocolError),
        (ErrorCode.LINE_TOO_LONG, ProtocolError),
        (ErrorCode.MALFORMED, ProtocolError),
    ],
)
def test_a_refused_connection_raises_the_exception_its_code_names(
    code: ErrorCode, cls: type[BrokerError]
) -> None:
    error = protocol.Error(code=code, message="wrong or missing token proof", fatal=True)
    raised = error_codes.refusal(error)
    assert type(raised) is cls
    assert str(raised) == "the main refused the connection: wrong or missing token proof"


def test_every_code_of_the_protocol_is_raised_as_something_specific_or_unused() -> None:
    unmapped = {code for code in ErrorCode if code not in error_codes.CLASSES}
    assert unmapped == {ErrorCode.NOT_FOUND}, "not_found is documented but never sent"


def test_an_older_request_error_without_details_still_decodes() -> None:
    reply = codec.decode(
        '{"type":"request_error","request_id":"r3","code":"invalid_job","message":"bad"}'
    )
    assert isinstance(reply, protocol.RequestError) and reply.details is None
    assert type(error_codes.raised_by(reply)) is exceptions.InvalidJobError
