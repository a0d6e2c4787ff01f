"""broker: an asyncio job broker that never loses a job and never lets a stale worker win."""

from __future__ import annotations

from broker.exceptions import (
    AuthenticationError,
    BrokerError,
    ConfigurationError,
    InvalidJobError,
    JobTimeoutError,
    MissingDriverError,
    PayloadTooLargeError,
    ProtocolError,
    RunnerCrashedError,
    SchemaVersionError,
    StorageError,
    StorageRejectedError,
    TaskNotFoundError,
)
from broker.jobs import (
    Claim,
    EnqueueResult,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
)
from broker.storage import Capabilities, JobFilter, JobPage, QueueCount, StorageAdapter

__all__ = [
    "AuthenticationError",
    "BrokerError",
    "Capabilities",
    "Claim",
    "ConfigurationError",
    "EnqueueResult",
    "ExecutionMode",
    "InvalidJobError",
    "Job",
    "JobFilter",
    "JobPage",
    "JobSpec",
    "JobStatus",
    "JobTimeoutError",
    "MissingDriverError",
    "PayloadTooLargeError",
    "ProtocolError",
    "QueueCount",
    "RunnerCrashedError",
    "SchemaVersionError",
    "StorageAdapter",
    "StorageError",
    "StorageRejectedError",
    "TaskNotFoundError",
]
