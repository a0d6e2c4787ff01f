"""Every error the broker raises on purpose.

The tree, so a caller can catch as broadly or as narrowly as it needs::

    BrokerError
    ├── ConfigurationError        a setting or option is invalid; fix it and restart
    │   └── MissingDriverError    a store URL needs a package that is not installed
    ├── InvalidJobError           an enqueue request is malformed (bad field, bad JSON)
    │   ├── PayloadTooLargeError  args, kwargs or a result exceed the configured limit
    │   ├── UniqueKeyTakenError   another active job holds the unique key (retry_dead)
    │   ├── IdempotencyConflictError  the idempotency key holds a different job
    │   ├── UnknownTaskError      no worker has ever declared the task enqueued
    │   └── InvalidArgumentsError the arguments cannot bind to the task's declared parameters
    ├── StorageError              the job store failed; the operation may be retried
    │   ├── SchemaVersionError    the store's schema is not this code's: newer, older, none
    │   ├── StorageRejectedError  the store refused a value it can never hold; do not retry
    │   └── DeposedError          another main took over the store; this one changed nothing
    ├── ProtocolError             a peer broke the wire protocol; the connection is closed
    │   ├── AuthenticationError   a peer did not prove its role's secret
    │   ├── NotLeaderError        the main reached is a standby; it names the leader
    │   └── OverLimitError        a connection or request is over one of the main's bounds
    ├── BrokerUnavailableError    no main could be reached (also a ConnectionError)
    │   └── ConnectionLostError   the connection dropped before the main answered
    ├── PermissionDeniedError     the connection's role may not make that request
    ├── TaskNotFoundError         a job names a task the worker has not registered
    ├── JobTimeoutError           a job ran past its timeout and was stopped
    ├── RunnerCrashedError        the process running a job died under it
    ├── CheckpointRejectedError   a task's checkpoint was not saved: its lease is gone
    └── JobFailedError            a job awaited for its result ended dead or cancelled

Each class's docstring is its default message, so ``raise StorageError()`` still
tells the reader what happened; pass a message to say more.

Each class also says how it crosses the wire (``code``, ``wire_fields``): the main
answers a failed request with the exception's code and fields, and the peer raises the
same class again (:mod:`broker.wire.errors` reads these attributes; the strings are the
protocol's error codes, written here as plain strings because this module imports
nothing of the wire).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import ClassVar


class BrokerError(Exception):
    """The broker failed."""

    code: str = "internal"
    """The error code this exception crosses the wire with (``docs/protocol.md``, *Error
    codes*); a subclass that names none shares its base's. An instance attribute may
    override it when the code depends on the case (a decode refusal over a bound)."""

    wire_fields: ClassVar[Mapping[str, Callable[[str], object]]] = {}
    """The keyword fields that cross the wire with the message, each with the type that
    reads it back: a field goes out as ``str(value)`` (left out when ``None``) and comes
    back as ``type(text)``, so a new field is one entry here and one keyword of
    ``__init__`` (``tests/unit/test_error_table.py`` checks that they agree)."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or type(self).__name__).strip())


class ConfigurationError(BrokerError):
    """A broker setting is invalid: correct it and start again."""

    code = "configuration"


class MissingDriverError(ConfigurationError):
    """The store URL needs a database driver that is not installed."""

    code = "missing_driver"


class InvalidJobError(BrokerError):
    """The job request is invalid and was not enqueued."""

    code = "invalid_job"


class PayloadTooLargeError(InvalidJobError):
    """The job's payload is larger than the configured limit and was not stored."""

    code = "payload_too_large"


class UniqueKeyTakenError(InvalidJobError):
    """Another queued or running job holds this job's unique key, so it cannot be queued."""

    code = "unique_key_taken"
    wire_fields = {"holder_id": uuid.UUID}

    def __init__(self, message: str | None = None, *, holder_id: uuid.UUID | None = None) -> None:
        super().__init__(message)
        self.holder_id = holder_id
        """The id of the active job holding the key, when the store could tell."""


class IdempotencyConflictError(InvalidJobError):
    """The idempotency key is taken by a job with a different task, arguments or options;
    nothing was enqueued (a faithful repeat of the original request returns its job)."""

    code = "idempotency_conflict"
    wire_fields = {"existing_id": uuid.UUID}

    def __init__(self, message: str | None = None, *, existing_id: uuid.UUID | None = None) -> None:
        super().__init__(message)
        self.existing_id = existing_id
        """The id of the job that holds the key, when the store could tell."""


class UnknownTaskError(InvalidJobError):
    """No worker has ever declared this task, so the main refuses to enqueue it (a
    misspelt name would otherwise wait forever); allow it explicitly for a cold start."""

    code = "unknown_task"


class InvalidArgumentsError(InvalidJobError):
    """A job's arguments cannot bind to its task's parameters as a worker declared them
    (the task catalog, :mod:`broker.core.catalog`): refused at enqueue, since the job
    could only fail at the worker."""

    code = "invalid_arguments"


class StorageError(BrokerError):
    """The job store failed; the operation did not complete and may be retried."""

    code = "storage"


class SchemaVersionError(StorageError):
    """The store's schema is not the version this broker needs: written by a newer broker
    (upgrade this one), older and not migrated yet (start broker-main or run ``broker
    migrate``), or missing (check the store URL); the message says which."""

    code = "schema_version"


class StorageRejectedError(StorageError):
    """The job store refused a value it can never hold; the same call would fail again.

    Raised for errors about the data itself (a character the database cannot store, a
    constraint), never for trouble with the store (a lost connection, a timeout), so the
    main retries only what may succeed and isolates the rest (see
    :class:`broker.main.loops.BatchWriter`).
    """

    code = "storage_rejected"


class DeposedError(StorageError):
    """This main is no longer the elected leader: another main took over the store (a
    newer epoch), so the store refused the claim or settle and changed nothing."""

    code = "deposed"


class ProtocolError(BrokerError):
    """The peer broke the broker protocol; the connection is closed."""

    code = "malformed"


class NotLeaderError(ProtocolError):
    """The main reached is a standby: only the elected main dispatches and answers peers;
    ``leader`` is where it is (``None``: no main is elected yet)."""

    code = "not_leader"
    wire_fields = {"leader": str}

    def __init__(self, message: str | None = None, *, leader: str | None = None) -> None:
        super().__init__(message)
        self.leader = leader
        """The elected main's ``HOST:PORT``, as the standby last saw it."""


class AuthenticationError(ProtocolError):
    """The peer did not prove the secret of the role it said hello as."""

    code = "auth_failed"


class OverLimitError(ProtocolError):
    """A connection or request is over one of the main's bounds (``docs/reference``,
    the bounds table); the message names the bound and the option that sets it."""

    code = "over_limit"


class BrokerUnavailableError(BrokerError, ConnectionError):
    """No main could be reached: refused, reset, timed out or closed before its welcome.

    Also a :class:`ConnectionError` (so an ``OSError``), since code written before this
    class caught those; a failover or a restart raises it until a main is back, and the
    client retries what is safe to repeat for its ``retry_timeout`` first."""

    code = "unavailable"


class ConnectionLostError(BrokerUnavailableError):
    """The connection to the main dropped while a request was under way: the main may
    or may not have applied it (repeat an enqueue with the same ``idempotency_key``)."""

    code = "connection_lost"


class PermissionDeniedError(BrokerError):
    """This connection's role may not make that request (cancel, retry and prune need an
    operator's credential)."""

    code = "permission_denied"


class TaskNotFoundError(BrokerError):
    """The job names a task that this worker has not registered."""

    code = "task_not_found"


class JobTimeoutError(BrokerError):
    """The job ran past its timeout and was stopped."""

    code = "job_timeout"


class RunnerCrashedError(BrokerError):
    """The process running the job died before reporting an outcome."""

    code = "runner_crashed"


class CheckpointRejectedError(BrokerError):
    """The checkpoint was not saved: this run's lease is no longer the job's (the main
    gave the job to another run), or the run has already ended."""

    code = "checkpoint_rejected"


class JobFailedError(BrokerError):
    """The job ended dead (``failed``) or ``cancelled``: it has no result (a handle's
    ``result()``). Its ``last_error`` is the message."""

    code = "job_failed"
    wire_fields = {"job_id": uuid.UUID, "status": str}

    def __init__(
        self,
        message: str | None = None,
        *,
        job_id: uuid.UUID | None = None,
        status: str | None = None,
    ) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.status = status
        """``failed`` or ``cancelled``."""


def transient(exc: BaseException) -> bool:
    """Whether a store call that raised ``exc`` may succeed if simply made again: trouble
    reaching the store (the ``StorageError`` the storage contract asks adapters to raise,
    ``OSError``, ``TimeoutError``). A value the store refused (``StorageRejectedError``)
    and any other error, such as a date out of range, would recur on every attempt."""
    return isinstance(exc, StorageError | OSError | TimeoutError) and not isinstance(
        exc, StorageRejectedError
    )
