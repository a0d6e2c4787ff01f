"""The application's client without an event loop, and the clients ``task.enqueue`` uses.

:class:`SyncClient` runs a :class:`~broker.client.client.Client` on anyio's blocking
portal; :func:`configure` says where ``task.enqueue(...)`` and ``task.enqueue_sync(...)``
send jobs, through one client of each kind made on first use.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import ssl
import threading
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Self, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from broker.client.client import Client, JobListPage
from broker.jobs import JobSpec, JSONValue
from broker.tasks.registry import Enqueued, Task, set_default_clients
from broker.tasks.workflow import EnqueuedWorkflow, Workflow
from broker.wire import messages as protocol
from broker.wire.messages import WorkflowView
from broker.wire.tls import PeerTLS

T = TypeVar("T")


def _daemon_portal() -> tuple[BlockingPortal, threading.Thread]:
    """An anyio blocking portal on an event loop in a daemon thread.

    anyio's ``start_blocking_portal`` runs its loop in a thread pool's thread, which the
    interpreter joins at exit: a script that never closed its client, or that a Ctrl-C
    stopped mid-call, would then hang at exit for ever. A daemon thread is not joined."""
    ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()

    async def serve() -> None:
        async with BlockingPortal() as portal:
            ready.set_result(portal)
            await portal.sleep_until_stopped()

    def run() -> None:
        try:
            anyio.run(serve)
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)

    thread = threading.Thread(target=run, name="broker-sync-client", daemon=True)
    thread.start()
    return ready.result(), thread


class SyncClient:
    """A blocking facade over :class:`Client` for code without an event loop.

    An anyio blocking portal runs the client on an event loop in a daemon thread of its
    own; each call waits there for its answer and raises what the client raised. Ctrl-C
    (``KeyboardInterrupt``) during a call cancels it there and is raised at once. Close
    it (or use it as a context manager) to close the connection and stop that thread.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._arguments = (args, kwargs)
        self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._client = Client(*self._arguments[0], **self._arguments[1])
        portal, self._thread = _daemon_portal()
        self._portal: BlockingPortal | None = portal

    def _call(self, method: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        if self._portal is None:
            raise RuntimeError("this SyncClient is closed")
        if self._pid != os.getpid():
            # A forked child has no copy of the portal's thread: a call would wait forever
            # for it. Start a thread and a connection of the child's own; the parent's
            # objects are dropped unclosed, since closing them would wait on that thread.
            self._forked_from = (self._portal, self._client)
            self._start()
            method = getattr(self._client, method.__name__)
        assert self._portal is not None
        future = self._portal.start_task_soon(functools.partial(method, *args, **kwargs))
        try:
            return future.result()
        except KeyboardInterrupt:
            # Ctrl-C reaches this thread, blocked on the answer: the call is cancelled on
            # the portal's loop (anyio cancels the task when its future is), not left
            # running until its own timeout.
            future.cancel()
            raise

    def _handle(self, enqueued: Enqueued) -> Enqueued:
        """The handle waits through this client (``result_sync``), not the async one."""
        return replace(enqueued, client=self)

    def enqueue(self, task: str | Task[..., Any], *args: Any, **kwargs: Any) -> Enqueued:
        return self._handle(self._call(self._client.enqueue, task, *args, **kwargs))

    def enqueue_spec(self, spec: JobSpec, *, delay: float | None = None) -> Enqueued:
        return self._handle(self._call(self._client.enqueue_spec, spec, delay=delay))

    def enqueue_many(self, specs: Sequence[JobSpec]) -> list[Enqueued]:
        return [self._handle(e) for e in self._call(self._client.enqueue_many, specs)]

    def enqueue_each(
        self,
        task: str | Task[..., Any],
        arg_sets: Sequence[Sequence[JSONValue]],
        kwarg_sets: Sequence[Mapping[str, JSONValue]] | None = None,
        **options: Any,
    ) -> list[uuid.UUID]:
        """:meth:`Client.enqueue_each <broker.client.client.Client.enqueue_each>`."""
        return self._call(self._client.enqueue_each, task, arg_sets, kwarg_sets, **options)

    def enqueue_workflow(self, workflow: Workflow) -> EnqueuedWorkflow:
        flow = self._call(self._client.enqueue_workflow, workflow)
        return replace(flow, final=None if flow.final is None else self._handle(flow.final))

    def get_workflow(self, workflow: EnqueuedWorkflow | uuid.UUID | str) -> WorkflowView | None:
        return self._call(self._client.get_workflow, workflow)

    def retry_workflow(self, workflow: EnqueuedWorkflow | uuid.UUID | str) -> WorkflowView | None:
        return self._call(self._client.retry_workflow, workflow)

    def enqueue_batches(
        self, specs: Iterable[JobSpec], *, batch_size: int = 250, in_flight: int = 3
    ) -> list[Enqueued]:
        enqueued = self._call(
            self._client.enqueue_batches, specs, batch_size=batch_size, in_flight=in_flight
        )
        return [self._handle(e) for e in enqueued]

    def list_tasks(self) -> list[dict[str, JSONValue]]:
        return self._call(self._client.list_tasks)

    def get_job(self, job_id: uuid.UUID | str) -> dict[str, JSONValue] | None:
        return self._call(self._client.get_job, job_id)

    def cancel(self, job_id: uuid.UUID | str) -> dict[str, JSONValue] | None:
        return self._call(self._client.cancel, job_id)

    def cancel_workflow(self, workflow: EnqueuedWorkflow) -> list[dict[str, JSONValue]]:
        return self._call(self._client.cancel_workflow, workflow)

    def retry(self, job_id: uuid.UUID | str) -> dict[str, JSONValue] | None:
        return self._call(self._client.retry, job_id)

    def status(self) -> dict[str, JSONValue]:
        return self._call(self._client.status)

    def list_jobs(self, **kwargs: Any) -> JobListPage:
        return self._call(self._client.list_jobs, **kwargs)

    def prune(self, **kwargs: Any) -> int:
        return self._call(self._client.prune, **kwargs)

    def pause_queue(self, queue: str) -> dict[str, JSONValue]:
        return self._call(self._client.pause_queue, queue)

    def resume_queue(self, queue: str) -> dict[str, JSONValue]:
        return self._call(self._client.resume_queue, queue)

    def limit_queue(self, queue: str, rate: str | None, *, burst: int = 1) -> dict[str, JSONValue]:
        return self._call(self._client.limit_queue, queue, rate, burst=burst)

    def wait(self, job_id: uuid.UUID | str, *, timeout: float = 60.0) -> dict[str, JSONValue]:
        """As :meth:`Client.wait`; Ctrl-C interrupts it at once."""
        return self._call(self._client.wait, job_id, timeout=timeout)

    def close(self) -> None:
        if self._portal is None:
            return
        try:
            self._call(self._client.close)  # in a forked child, on a loop of its own
        finally:
            portal, self._portal = self._portal, None
            if portal is not None:
                portal.call(portal.stop)
                self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ConfiguredClients:
    """The clients ``task.enqueue`` uses by default: one :class:`Client` per event loop (a
    client belongs to the loop it connected on) and one :class:`SyncClient` per process,
    each made on first use. Both reconnect by themselves in a forked child."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._args = args
        self._kwargs = kwargs
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Client] = (
            weakref.WeakKeyDictionary()
        )
        self._sync: SyncClient | None = None

    def async_client(self) -> Client:
        loop = asyncio.get_running_loop()
        client = self._async.get(loop)
        if client is None:
            client = self._async[loop] = Client(*self._args, **self._kwargs)
        return client

    def sync_client(self) -> SyncClient:
        if self._sync is None:
            self._sync = SyncClient(*self._args, **self._kwargs)
        return self._sync


def configure(
    host: str = "127.0.0.1",
    port: int = protocol.DEFAULT_PORT,
    *,
    token: str | None = None,
    timeout: float = 10.0,
    tls: PeerTLS | ssl.SSLContext | None = None,
    retry_timeout: float = 15.0,
) -> None:
    """Say where ``task.enqueue(...)`` and ``task.enqueue_sync(...)`` send jobs (``token``:
    the client secret; ``tls`` and ``retry_timeout``: as for :class:`Client`).

    Call it once at start-up, as a Celery app is configured once (or Dramatiq's
    ``set_broker``); it may run at import time, before a fork: each process, and each
    event loop, then connects on first use. ``timeout`` bounds every call (seconds).
    ``task.options(client=...)`` sends one enqueue through a client of your own instead.
    """
    set_default_clients(
        _ConfiguredClients(
            (host, port),
            {"token": token, "timeout": timeout, "tls": tls, "retry_timeout": retry_timeout},
        )
    )
