"""broker: an asyncio job broker that never loses a job and never lets a stale worker win.

``broker.__all__`` is what users import: ``task`` to declare jobs (and enqueue them:
``send_email.enqueue(...)``), ``configure`` to say once where the main is, ``Client`` and
``SyncClient`` to enqueue and inspect them, ``current_job`` for a running task's
``JobContext`` (its checkpoints and progress), ``on_startup``, ``on_shutdown`` and
``add_middleware`` (with ``JobMiddleware``) for worker hooks, ``enqueue_in`` and
``enqueue_in_async`` to insert jobs in the application's own database transaction,
``Reschedule`` for a task to ask for a later run, ``Schedule`` for periodic jobs, every
exception of the one error tree, and the types a custom storage adapter implements
(``StorageAdapter`` and what its methods take and return). Everything else is internal:
import it at your own risk.
"""

# ruff: noqa: I002
# ``python -m broker.cli`` imports this package while the working directory stands first
# on the module path (``sys.argv[0]`` is "-m" while the module is being found), so a
# ``json.py`` or ``msgspec.py`` planted there would run in place of the real one. The
# directory goes before any other import, ``__future__`` and ``typing`` included: only
# modules loaded at start-up (``os``, ``sys``) come first. The broker puts it back, last,
# only for the operator's own modules (``broker.ops.cli.use_app_directory``).
import os
import sys

if sys.argv[:1] == ["-m"] and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from typing import TYPE_CHECKING

from broker.exceptions import (
    AuthenticationError,
    BrokerError,
    BrokerUnavailableError,
    CheckpointRejectedError,
    ConfigurationError,
    ConnectionLostError,
    DeposedError,
    IdempotencyConflictError,
    InvalidArgumentsError,
    InvalidJobError,
    JobFailedError,
    JobTimeoutError,
    MissingDriverError,
    NotLeaderError,
    OverLimitError,
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
from broker.jobs import (
    Claim,
    EnqueueResult,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
    Outcome,
    Settlement,
)
from broker.model.lazy import lazy_exports
from broker.tasks.runner import Reschedule

if TYPE_CHECKING:
    from broker.client.client import Client
    from broker.client.sync import SyncClient, configure
    from broker.client.transactional import (
        EnqueueOptions,
        enqueue_each_in_async,
        enqueue_in,
        enqueue_in_async,
        enqueue_many_in,
        enqueue_many_in_async,
    )
    from broker.storage import Capabilities, JobFilter, JobPage, QueueCount, StorageAdapter
    from broker.tasks.context import JobContext, current_job
    from broker.tasks.hooks import JobMiddleware, add_middleware, on_shutdown, on_startup
    from broker.tasks.registry import Task, TaskRegistry, task
    from broker.tasks.schedule import Schedule
    from broker.tasks.workflow import EnqueuedWorkflow, Step, chain, group
    from broker.wire.messages import Role, WorkflowEdge, WorkflowMember, WorkflowView
    from broker.wire.tls import PeerTLS

_LAZY = {
    "Capabilities": "broker.storage",
    "JobFilter": "broker.storage",
    "JobPage": "broker.storage",
    "QueueCount": "broker.storage",
    "StorageAdapter": "broker.storage",
    "Client": "broker.client.client",
    "SyncClient": "broker.client.sync",
    "configure": "broker.client.sync",
    "JobContext": "broker.tasks.context",
    "current_job": "broker.tasks.context",
    "JobMiddleware": "broker.tasks.hooks",
    "add_middleware": "broker.tasks.hooks",
    "on_shutdown": "broker.tasks.hooks",
    "on_startup": "broker.tasks.hooks",
    "PeerTLS": "broker.wire.tls",
    "Role": "broker.wire.messages",
    "WorkflowEdge": "broker.wire.messages",
    "WorkflowMember": "broker.wire.messages",
    "WorkflowView": "broker.wire.messages",
    "Schedule": "broker.tasks.schedule",
    "Task": "broker.tasks.registry",
    "TaskRegistry": "broker.tasks.registry",
    "task": "broker.tasks.registry",
    "chain": "broker.tasks.workflow",
    "group": "broker.tasks.workflow",
    "Step": "broker.tasks.workflow",
    "EnqueuedWorkflow": "broker.tasks.workflow",
    "EnqueueOptions": "broker.client.transactional",
    "enqueue_each_in_async": "broker.client.transactional",
    "enqueue_in": "broker.client.transactional",
    "enqueue_in_async": "broker.client.transactional",
    "enqueue_many_in": "broker.client.transactional",
    "enqueue_many_in_async": "broker.client.transactional",
}
"""Loaded on first use: the client (anyio), the task and schedule modules (the cron
library) and the storage contract (its protocols) would add about 100 ms to every process
that imports any part of ``broker``, a runner child's start among them."""


__getattr__ = lazy_exports(globals(), _LAZY)


__all__ = [
    "AuthenticationError",
    "BrokerError",
    "BrokerUnavailableError",
    "Capabilities",
    "CheckpointRejectedError",
    "Claim",
    "Client",
    "ConfigurationError",
    "ConnectionLostError",
    "DeposedError",
    "EnqueueOptions",
    "EnqueueResult",
    "EnqueuedWorkflow",
    "ExecutionMode",
    "IdempotencyConflictError",
    "InvalidArgumentsError",
    "InvalidJobError",
    "Job",
    "JobContext",
    "JobFailedError",
    "JobFilter",
    "JobMiddleware",
    "JobPage",
    "JobSpec",
    "JobStatus",
    "JobTimeoutError",
    "MissingDriverError",
    "NotLeaderError",
    "Outcome",
    "OverLimitError",
    "PayloadTooLargeError",
    "PeerTLS",
    "PermissionDeniedError",
    "ProtocolError",
    "QueueCount",
    "Reschedule",
    "Role",
    "RunnerCrashedError",
    "Schedule",
    "SchemaVersionError",
    "Settlement",
    "Step",
    "StorageAdapter",
    "StorageError",
    "StorageRejectedError",
    "SyncClient",
    "Task",
    "TaskNotFoundError",
    "TaskRegistry",
    "UniqueKeyTakenError",
    "UnknownTaskError",
    "WorkflowEdge",
    "WorkflowMember",
    "WorkflowView",
    "add_middleware",
    "chain",
    "configure",
    "current_job",
    "enqueue_each_in_async",
    "enqueue_in",
    "enqueue_in_async",
    "enqueue_many_in",
    "enqueue_many_in_async",
    "group",
    "on_shutdown",
    "on_startup",
    "task",
]
