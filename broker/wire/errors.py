"""Every exception's wire code, and back: one table for the main and its peers.

The main answers a failed request with ``request_error`` carrying the code of the
exception it caught (and that exception's fields, in ``details``); the client and
the worker raise the exception that code names. So an error crosses the wire as
itself: a ``UniqueKeyTakenError`` arrives as a ``UniqueKeyTakenError`` with its
``holder_id``, not as a bare ``InvalidJobError``, and a refused token is an
``AuthenticationError`` in a client as in a worker. The codes are listed in
``docs/protocol.md`` (*Error codes*); a code this version does not know arrives as
a plain :class:`~broker.exceptions.BrokerError`, as the protocol asks.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from broker.exceptions import (
    AuthenticationError,
    BrokerError,
    CheckpointRejectedError,
    ConfigurationError,
    DeposedError,
    IdempotencyConflictError,
    InvalidJobError,
    JobTimeoutError,
    MissingDriverError,
    NotLeaderError,
    PayloadTooLargeError,
    PermissionDeniedError,
    ProtocolError,
    RunnerCrashedError,
    SchemaVersionError,
    StorageError,
    StorageRejectedError,
    TaskNotFoundError,
    UniqueKeyTakenError,
    UnknownTaskError,
)
from broker.jobs import JSONValue
from broker.wire import messages as protocol
from broker.wire.messages import ErrorCode

CODES: Mapping[type[BrokerError], ErrorCode] = {
    BrokerError: ErrorCode.INTERNAL,
    ConfigurationError: ErrorCode.CONFIGURATION,
    MissingDriverError: ErrorCode.MISSING_DRIVER,
    InvalidJobError: ErrorCode.INVALID_JOB,
    PayloadTooLargeError: ErrorCode.PAYLOAD_TOO_LARGE,
    UniqueKeyTakenError: ErrorCode.UNIQUE_KEY_TAKEN,
    IdempotencyConflictError: ErrorCode.IDEMPOTENCY_CONFLICT,
    UnknownTaskError: ErrorCode.UNKNOWN_TASK,
    StorageError: ErrorCode.STORAGE,
    SchemaVersionError: ErrorCode.SCHEMA_VERSION,
    StorageRejectedError: ErrorCode.STORAGE_REJECTED,
    DeposedError: ErrorCode.DEPOSED,
    ProtocolError: ErrorCode.MALFORMED,
    AuthenticationError: ErrorCode.AUTH_FAILED,
    NotLeaderError: ErrorCode.NOT_LEADER,
    PermissionDeniedError: ErrorCode.PERMISSION_DENIED,
    TaskNotFoundError: ErrorCode.TASK_NOT_FOUND,
    JobTimeoutError: ErrorCode.JOB_TIMEOUT,
    RunnerCrashedError: ErrorCode.RUNNER_CRASHED,
    CheckpointRejectedError: ErrorCode.CHECKPOINT_REJECTED,
}
"""The code of each exception in the tree; a subclass not listed takes its nearest
listed base's code, and anything that is not a ``BrokerError`` is ``internal``."""

CLASSES: Mapping[str, type[BrokerError]] = {
    **{code: cls for cls, code in CODES.items()},
    # Codes of the connection itself, which name no exception of their own.
    ErrorCode.UNKNOWN_TYPE: ProtocolError,
    ErrorCode.LINE_TOO_LONG: ProtocolError,
    ErrorCode.UNTERMINATED: ProtocolError,
    ErrorCode.HANDSHAKE_TIMEOUT: ProtocolError,
    ErrorCode.NOT_ALLOWED: ProtocolError,
    ErrorCode.OVER_LIMIT: ProtocolError,
    # Peers of different versions: a deployment to correct, which retrying cannot fix.
    ErrorCode.PROTOCOL_VERSION: ConfigurationError,
}
"""The exception each code is raised as on the receiving side."""


def code_of(exc: BaseException) -> ErrorCode:
    """The code ``exc`` crosses the wire with."""
    for cls in type(exc).__mro__:
        code = CODES.get(cls)
        if code is not None:
            return code
    return ErrorCode.INTERNAL


def details_of(exc: BaseException) -> dict[str, JSONValue] | None:
    """The fields of ``exc`` beyond its message, as JSON; ``None`` when it has none.

    Every exception with fields has its branch here and in :func:`exception_for`
    (``tests/unit/test_error_table.py`` fails for one that does not)."""
    if isinstance(exc, UniqueKeyTakenError) and exc.holder_id is not None:
        return {"holder_id": str(exc.holder_id)}
    if isinstance(exc, NotLeaderError) and exc.leader is not None:
        return {"leader": exc.leader}
    if isinstance(exc, IdempotencyConflictError) and exc.existing_id is not None:
        return {"existing_id": str(exc.existing_id)}
    return None


def exception_for(
    code: str, message: str, details: Mapping[str, JSONValue] | None = None
) -> BrokerError:
    """The exception ``code`` names, with ``message`` and the fields from ``details``.

    A field that is missing or unreadable is left unset rather than refused: the
    error itself still arrives."""
    cls = CLASSES.get(code, BrokerError)
    if cls is UniqueKeyTakenError:
        return UniqueKeyTakenError(message, holder_id=_uuid((details or {}).get("holder_id")))
    if cls is NotLeaderError:
        leader = (details or {}).get("leader")
        return NotLeaderError(message, leader=leader if isinstance(leader, str) else None)
    if cls is IdempotencyConflictError:
        return IdempotencyConflictError(
            message, existing_id=_uuid((details or {}).get("existing_id"))
        )
    return cls(message)


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


def _uuid(value: JSONValue | None) -> uuid.UUID | None:
    try:
        return uuid.UUID(value) if isinstance(value, str) else None
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
