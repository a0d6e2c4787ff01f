"""Where the operator's commands are sent: the main through a :class:`Client`, or the
store through the main's own :class:`~broker.main.operations.Operations`.

Both are one :class:`RequestService`, stated in the client's words: a :class:`Client`
is one as it stands, so a command sent to a running main goes through no wrapper, and
:class:`StoreService` says the same in front of the store, turning the stored jobs into
the dicts the main would have sent.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from broker.client.client import Client, JobListPage
from broker.exceptions import BrokerError, ConfigurationError
from broker.jobs import Clock, Job, JobStatus, JSONValue, utcnow
from broker.storage import JobFilter, StorageAdapter, SupportsSchemaCheck
from broker.tasks.registry import Enqueued
from broker.wire import framing as wire
from broker.wire import messages as protocol
from broker.wire.tls import PeerTLS

if TYPE_CHECKING:
    from broker.main.queues import QueueControl


class RequestService(Protocol):
    """The requests the operator's commands make, as :class:`Client` names them: a
    client connected to the main is one, and so is :class:`StoreService`."""

    async def status(self) -> Mapping[str, Any]:
        """The ``broker status`` snapshot; one that says no ``source`` is the main's."""

    async def list_jobs(
        self,
        *,
        statuses: Collection[JobStatus] | None,
        queues: Collection[str] | None,
        tasks: Collection[str] | None,
        limit: int,
        cursor: str | None,
        include_payload: bool,
    ) -> JobListPage: ...

    async def get_job(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None: ...

    async def cancel(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None: ...

    async def retry(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None: ...

    async def get_workflow(self, workflow: uuid.UUID) -> protocol.WorkflowView | None: ...

    async def retry_workflow(self, workflow: uuid.UUID) -> protocol.WorkflowView | None: ...

    async def enqueue_requests(
        self, requests: Sequence[protocol.JobRequest], *, allow_unknown_tasks: bool = False
    ) -> list[Enqueued]: ...

    async def list_tasks(self) -> list[dict[str, JSONValue]]:
        """The task catalog, as :func:`broker.core.catalog.entry` shows each declaration."""

    async def prune(
        self,
        *,
        older_than: float | None,
        keep_latest: int | None,
        statuses: Collection[JobStatus] | None,
    ) -> int: ...

    async def pause_queue(self, queue: str) -> dict[str, JSONValue]: ...

    async def resume_queue(self, queue: str) -> dict[str, JSONValue]: ...

    async def limit_queue(
        self, queue: str, rate: str | None, *, burst: int = 1
    ) -> dict[str, JSONValue]: ...

    async def close(self) -> None: ...


async def read_status(service: RequestService) -> dict[str, Any]:
    """The ``broker status`` snapshot with where it came from: the main's own says
    nothing of that, so ``source`` is ``main`` unless the service says otherwise (the
    store does, with why the main was not used)."""
    return {"source": "main", "main_error": None, **await service.status()}


class StoreService:
    """The job store itself, for when the main is down. ``main_error`` says why.

    The requests are the main's own (:class:`~broker.main.operations.Operations`), under a
    default main's limits: this main's own are unknown here, and the defaults keep
    every job deliverable. The main's modules load here, not with this module: a
    command the main answers never needs them."""

    def __init__(self, store: StorageAdapter, main_error: str, *, clock: Clock = utcnow) -> None:
        from broker.main.operations import Operations
        from broker.main.settings import MainSettings

        self.store = store
        self.main_error = main_error
        self.operations = Operations(store, MainSettings(), clock=clock)

    async def status(self) -> dict[str, Any]:
        return {
            "source": "store",
            "main_error": self.main_error,
            **await self.operations.status(),
        }

    async def list_jobs(
        self,
        *,
        statuses: Collection[JobStatus] | None,
        queues: Collection[str] | None,
        tasks: Collection[str] | None,
        limit: int,
        cursor: str | None,
        include_payload: bool,
    ) -> JobListPage:
        try:
            page = await self.operations.list_jobs(
                JobFilter(statuses=statuses, queues=queues, tasks=tasks),
                limit=limit,
                cursor=cursor,
                include_payload=include_payload,
            )
        except ValueError as exc:
            raise ConfigurationError(f"--cursor is not valid: {exc}") from None
        return JobListPage(jobs=page.jobs, next_cursor=page.next_cursor)

    async def get_job(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None:
        return _as_dict(await self.operations.get(job_id))

    async def cancel(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None:
        return _as_dict(await self.operations.cancel(job_id))

    async def retry(self, job_id: uuid.UUID) -> dict[str, JSONValue] | None:
        return _as_dict(await self.operations.retry(job_id))

    async def get_workflow(self, workflow: uuid.UUID) -> protocol.WorkflowView | None:
        return await self.operations.get_workflow(workflow)

    async def retry_workflow(self, workflow: uuid.UUID) -> protocol.WorkflowView | None:
        return await self.operations.retry_workflow(workflow)

    async def enqueue_requests(
        self, requests: Sequence[protocol.JobRequest], *, allow_unknown_tasks: bool = False
    ) -> list[Enqueued]:
        results = await self.operations.enqueue(requests, allow_unknown_tasks=allow_unknown_tasks)
        return [Enqueued(result.job.id, result.duplicate) for result in results]

    async def list_tasks(self) -> list[dict[str, JSONValue]]:
        from broker.core import catalog

        # The main is down (or this is a test's store): nobody knows who is connected.
        return [catalog.entry(record, None) for record in await self.operations.tasks()]

    async def prune(
        self,
        *,
        older_than: float | None,
        keep_latest: int | None,
        statuses: Collection[JobStatus] | None,
    ) -> int:
        try:
            return await self.operations.prune(
                older_than_seconds=older_than, keep_latest=keep_latest, statuses=statuses
            )
        except ValueError as exc:
            raise ConfigurationError(f"prune: {exc}") from None

    async def pause_queue(self, queue: str) -> dict[str, JSONValue]:
        from broker.main.queues import settings_info

        return settings_info(await (await self._queues()).pause(queue))

    async def resume_queue(self, queue: str) -> dict[str, JSONValue]:
        from broker.main.queues import settings_info

        return settings_info(await (await self._queues()).resume(queue))

    async def limit_queue(
        self, queue: str, rate: str | None, *, burst: int = 1
    ) -> dict[str, JSONValue]:
        from broker.main.queues import settings_info
        from broker.model.rates import parse_rate

        limit = None if rate is None else parse_rate(rate, burst)
        return settings_info(await (await self._queues()).limit(queue, limit))

    async def _queues(self) -> QueueControl:
        """The main's own queue settings rules over the store: what is written here, the
        main reads when it next starts to lead."""
        from broker.core.flow import FlowControl
        from broker.main.queues import QueueControl

        control = QueueControl(self.store, FlowControl(), wake=lambda: None)
        await control.load()
        return control

    async def close(self) -> None:
        await self.store.close()


def _note(text: str) -> None:
    print(text, file=sys.stderr)


def _as_dict(job: Job | None) -> dict[str, JSONValue] | None:
    return job.to_dict() if job is not None else None


async def open_backend(
    host: str,
    port: int,
    *,
    token: str | None = None,
    role: protocol.Role = protocol.Role.OPERATOR,
    tls: PeerTLS | None = None,
    timeout: float = 10.0,  # noqa: ASYNC109 - a connect budget for the client
    database_url: str | None = None,
    adapter: str | None = None,
    read_only: bool = False,
    note: Callable[[str], None] | None = None,
) -> Client | StoreService:
    """The main if it answers; else the store at ``database_url``; else a clear error.

    Only a main that cannot be reached (refused, unreachable, timed out) sends the
    command to the store: a main that answers and refuses (a wrong token, say) is an
    error, because the store would bypass the refusal, and so is a service that is not
    a main at all (it has :data:`~broker.wire.framing.GREETING_TIMEOUT` to greet, not
    the whole ``timeout``). ``read_only`` opens the store without the right to write (for
    the commands that only read). ``note`` tells the operator that the store is used (by
    default a ``note:`` line on stderr). ``token`` is the secret of ``role``.
    """
    client = Client(
        host,
        port,
        token=token,
        role=role,
        tls=tls,
        timeout=timeout,
        greeting_timeout=wire.GREETING_TIMEOUT,
        retry_timeout=0,  # an operator's command answers now, or works on the store
    )
    try:
        await client.connect()
    except (OSError, TimeoutError) as exc:
        await client.close()
        reason = f"cannot reach the main at {host}:{port} ({str(exc) or type(exc).__name__})"
        if not database_url:
            raise BrokerError(
                f"{reason}; start broker-main, or pass --database-url (or set "
                "BROKER_DATABASE_URL) to work on the store directly"
            ) from None
        from broker.ops import composition

        store = composition.open_store(database_url, adapter, create=False, read_only=read_only)
        try:
            if isinstance(store, SupportsSchemaCheck):
                await store.check_schema()
        except BaseException:
            await store.close()
            raise
        (note or _note)(f"note: {reason}; working on the store directly")
        return StoreService(store, reason)
    return client
