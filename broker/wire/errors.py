"""Every exception's wire code, and back: one table for the main and its peers.

The main answers a failed request with ``request_error`` carrying the code of the
exception it caught (and that exception's fields, in ``details``); the client and
the worker raise the exception that code names. So an error crosses the wire as
itself: a ``UniqueKeyTakenError`` arrives as a ``UniqueKeyTakenError`` with its
``holder_id``, not as a bare ``InvalidJobError``, and a refused token is an
``AuthenticationError`` in a client as in a worker. The codes are listed in
``docs/protocol.md`` (*Error codes*); a code this version does not know arrives as
a plain :class:`~broker.exceptions.BrokerError`, as the protocol asks.

Each exception class carries its code and its fields (``code``, ``wire_fields``, see
:class:`~broker.exceptions.BrokerError`), the internal ones too (a decode error, a line
too long, a ``ready`` over the credit limit), so the table here is derived from the
classes and a shell that answers an error asks :func:`code_of` instead of choosing a
code itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from broker import exceptions
from broker.exceptions import BrokerError, ConfigurationError, ProtocolError
from broker.jobs import JSONValue
from broker.wire import messages as protocol
from broker.wire.messages import ErrorCode

CODES: Mapping[type[BrokerError], ErrorCode] = {
    cls: ErrorCode(cls.code)
    for cls in vars(exceptions).values()
    if isinstance(cls, type) and issubclass(cls, BrokerError)
}
"""The code of each exception of the tree (:mod:`broker.exceptions`), read from the
classes. Internal subclasses (:class:`broker.wire.codec.DecodeError`,
:class:`broker.wire.framing.LineTooLongError`,
:class:`broker.core.peers.CreditLimitError`, ...) carry their codes the same way but
arrive as their public base, so they are not keys here."""

CLASSES: Mapping[str, type[BrokerError]] = {
    **{code: cls for cls, code in CODES.items()},
    # Codes of the connection itself, or of internal errors: raised as the public base.
    ErrorCode.UNKNOWN_TYPE: ProtocolError,
    ErrorCode.LINE_TOO_LONG: ProtocolError,
    ErrorCode.UNTERMINATED: ProtocolError,
    ErrorCode.HANDSHAKE_TIMEOUT: ProtocolError,
    ErrorCode.NOT_ALLOWED: ProtocolError,
    # Peers of different versions: a deployment to correct, which retrying cannot fix.
    ErrorCode.PROTOCOL_VERSION: ConfigurationError,
}
"""The exception each code is raised as on the receiving side."""


def code_of(exc: BaseException) -> ErrorCode:
    """The code ``exc`` crosses the wire with: the one its class (or, for a decode
    refusal over a bound, the exception itself) carries; ``internal`` for anything that
    is not a ``BrokerError``."""
    if not isinstance(exc, BrokerError):
        return ErrorCode.INTERNAL
    try:
        return ErrorCode(exc.code)
    except ValueError:  # tests/unit/test_error_table.py keeps the classes from this
        return ErrorCode.INTERNAL


def details_of(exc: BaseException) -> dict[str, JSONValue] | None:
    """The fields of ``exc`` beyond its message (its class's ``wire_fields`` that are
    set), as JSON strings; ``None`` when it has none."""
    if not isinstance(exc, BrokerError):
        return None
    details: dict[str, JSONValue] = {
        name: str(value)
        for name in exc.wire_fields
        if (value := getattr(exc, name, None)) is not None
    }
    return details or None


def exception_for(
    code: str, message: str, details: Mapping[str, JSONValue] | None = None
) -> BrokerError:
    """The exception ``code`` names, with ``message`` and the fields from ``details``.

    A field that is missing or unreadable is left unset rather than refused: the
    error itself still arrives."""
    cls = CLASSES.get(code, BrokerError)
    given = details or {}
    fields = {name: _read(kind, given.get(name)) for name, kind in cls.wire_fields.items()}
    return cls(message, **fields)


def request_error(request_id: str, exc: BaseException) -> protocol.RequestError:
    """The ``request_error`` answering a request that raised ``exc``."""
    return protocol.RequestError(
        request_id=request_id, code=code_of(exc), message=str(exc), details=details_of(exc)
    )


def raised_by(reply: protocol.RequestError) -> BrokerError:
    """The exception a ``request_error`` stands for, to raise in the requester."""
    return exception_for(reply.code, reply.message, reply.details)


def refusal(error: protocol.Error) -> BrokerError:
    """The exception for an ``error`` the main closed a connection with (a wrong token,
    another protocol version, a connection over a limit, a line too long, a standby
    naming the leader)."""
    details: dict[str, JSONValue] | None = (
        None if error.leader is None else {"leader": error.leader}
    )
    return exception_for(error.code, f"the main refused the connection: {error.message}", details)


def _read(kind: Callable[[str], object], value: JSONValue | None) -> object:
    """A field read back from its JSON string, or ``None`` when it is not one ``kind``
    accepts."""
    if not isinstance(value, str):
        return None
    try:
        return kind(value)
    except ValueError:
        return None


__all__ = [
    "CLASSES",
    "CODES",
    "code_of",
    "details_of",
    "exception_for",
    "raised_by",
    "refusal",
    "request_error",
]
