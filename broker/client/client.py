"""Enqueue jobs and read their state through a running main.

``Client`` is for asyncio code (:class:`~broker.client.sync.SyncClient` wraps it for WSGI
apps, scripts and anything else without an event loop). It keeps one connection open and
multiplexes requests over it by ``request_id``.

An enqueue is acknowledged only after the main's durable insert. If the call times
out or the connection drops, the outcome is unknown: repeat it with the same
``idempotency_key`` and the main returns the job it already has instead of making
a second one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import ssl
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar

import msgspec

from broker.exceptions import (
    BrokerError,
    ConfigurationError,
    NotLeaderError,
    PayloadTooLargeError,
    ProtocolError,
)
from broker.jobs import ExecutionMode, JobSpec, JobStatus, JSONValue
from broker.model import tracing
from broker.model.bounds import MESSAGE_CONTAINERS
from broker.payload import containers_in, too_many_containers
from broker.tasks.registry import Enqueued, Task
from broker.wire import codec, tls
from broker.wire import errors as error_codes
from broker.wire import framing as wire
from broker.wire import messages as protocol
from broker.wire.addresses import MainAddresses
from broker.wire.handshake import PeerHandshake
from broker.wire.tls import PeerTLS

T = TypeVar("T")
R = TypeVar("R", bound=protocol.Message)

MAX_REPLY_BYTES = 64 << 20
"""The longest reply line the client reads. Replies come from the authenticated main and
may carry whole jobs (args and result) or pages of them, so the cap is generous."""


def _time_out(future: asyncio.Future[protocol.Message]) -> None:
    """A request's deadline passed with no answer: its caller stops waiting."""
    if not future.done():
        future.set_exception(TimeoutError())


@dataclass(frozen=True, slots=True)
class JobListPage:
    jobs: list[dict[str, JSONValue]]
    """Each as :meth:`broker.jobs.Job.to_dict` shows it, newest first (without ``args``,
    ``kwargs`` and ``result`` unless the listing asked for them)."""
    next_cursor: str | None


class Client:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = protocol.DEFAULT_PORT,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        greeting_timeout: float | None = None,
        role: protocol.Role = protocol.Role.CLIENT,
        tls: PeerTLS | ssl.SSLContext | None = None,
        allow_unknown_tasks: bool = False,
    ) -> None:
        """``allow_unknown_tasks``: enqueue jobs of tasks no worker has declared yet (a
        deliberate cold start); by default the main refuses them with
        :class:`~broker.exceptions.UnknownTaskError`, since such a name is usually a typo
        (see :mod:`broker.core.catalog`)."""
        if role is protocol.Role.WORKER:
            raise ConfigurationError("a Client says hello as a client or an operator")
        self._allow_unknown_tasks = allow_unknown_tasks
        self.host = host
        self.port = port
        self._mains = MainAddresses(host, port)
        """``host`` may list several mains sharing one store (``"a:7600,b:7600"``); a
        connection goes to the elected one (see :meth:`connect`)."""
        self._token = token
        """The secret of ``role``: the client secret, the operator secret for
        ``role=Role.OPERATOR`` (cancel, retry and prune), or the main's shared token."""
        self._role = role
        self._tls = tls.context() if isinstance(tls, PeerTLS) else tls
        """``None``: plain TCP. Else the main's certificate and host name are verified."""
        self._timeout = timeout
        self._greeting_timeout = timeout if greeting_timeout is None else greeting_timeout
        """Seconds a connected peer has to send the main's challenge. A main sends it as
        soon as it accepts; PostgreSQL, Redis and HTTP servers wait for the client to
        speak first, so silence this long means the address is another service. The
        operator's command waits briefly; an application's client, by default, as long
        as for any answer, so a main stalled under load is not taken for another
        service."""
        self._ids = itertools.count(1)
        self._reset()

    def _reset(self) -> None:
        """Forget the connection, as a fresh client: at construction, and in a forked
        child, whose copy of the parent's socket, reader task and lock belong to the
        parent's event loop (using them there would interleave bytes with the parent, or
        wait forever on a loop that does not run in this process)."""
        self._pid = os.getpid()
        self._writer: wire.MessageWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Future[protocol.Message]] = {}
        self._connect_lock = asyncio.Lock()
        self._max_line_bytes: int | None = None
        """The main's line cap from its welcome: a longer request would be refused."""
        self._max_containers: int | None = None
        """The main's container bound from its welcome (``None``: an older main)."""

    def _check_fork(self) -> None:
        """In a forked child (gunicorn ``--preload``, multiprocessing's fork), start over:
        the parent keeps its connection, the child opens its own."""
        if self._pid != os.getpid():
            self._reset()

    def _timed_out(self, what: str) -> TimeoutError:
        return TimeoutError(
            f"the main at {self._mains} did not answer {what} within "
            f"{self._timeout:g} s (Client(timeout=...) sets the limit); the request may or "
            "may not have been applied: repeat an enqueue with the same idempotency_key"
        )

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        self._check_fork()
        if self._writer is not None and not self._writer.is_closing:
            return  # connected: every request passes here, without taking the lock
        async with self._connect_lock:
            if self._writer is not None and not self._writer.is_closing:
                return
            # Each main once in turn, plus the leader a standby names; the last error is
            # raised when none welcomes (during a failover: retry the request).
            for attempt in range(len(self._mains.all) + 1):
                try:
                    await self._connect()
                    return
                except ssl.SSLError as exc:
                    # Not an OSError to the caller: the main answered, and refused (the
                    # operator's command must not take it for an unreachable main).
                    raise ConfigurationError(tls.describe(exc, str(self._mains))) from None
                except NotLeaderError as exc:
                    if attempt == len(self._mains.all):
                        raise
                    self._mains.follow(exc.leader)
                except (OSError, TimeoutError):
                    if attempt >= len(self._mains.all) - 1:
                        raise
                    self._mains.failed()

    async def _connect(self) -> None:
        host, port = self._mains.current
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    host,
                    port,
                    limit=MAX_REPLY_BYTES + 2,
                    ssl=self._tls,
                    ssl_handshake_timeout=None if self._tls is None else self._timeout,
                ),
                self._timeout,
            )
        except TimeoutError:
            raise self._timed_out("a connection") from None
        lines = wire.LineReader(reader, max_line_bytes=MAX_REPLY_BYTES)
        out = wire.MessageWriter(writer)
        try:
            handshake = PeerHandshake(
                protocol.Hello(role=self._role, protocol=protocol.PROTOCOL_VERSION), self._token
            )
            greeting = await wire.read_greeting(
                lines,
                str(self._mains),
                min(self._timeout, self._greeting_timeout),
                tls=self._tls is not None,
            )
            await out.send(handshake.challenged(greeting))
            try:
                reply = await asyncio.wait_for(wire.read_message(lines), self._timeout)
            except TimeoutError:
                raise self._timed_out("the hello") from None
            welcome = handshake.answered(reply)
            self._max_line_bytes = welcome.max_line_bytes
            self._max_containers = welcome.max_payload_containers
        except BaseException:
            await out.close()
            raise
        self._writer = out
        self._reader_task = asyncio.create_task(self._read_replies(lines))

    async def close(self) -> None:
        self._check_fork()  # a child closes only what it opened itself
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
            self._reader_task = None
        if self._writer is not None:
            await self._writer.close()
            self._writer = None

    async def _read_replies(self, lines: wire.LineReader) -> None:
        error: BaseException = ConnectionError("the main closed the connection")
        try:
            while True:
                msg = await wire.read_message(lines)
                if msg is None:
                    break
                match msg:
                    case protocol.Ping(nonce=nonce) if self._writer is not None:
                        await self._writer.send(protocol.Pong(nonce=nonce))
                    case protocol.Error(code=code, message=message, fatal=True):
                        error = error_codes.exception_for(
                            code, f"the main closed the connection: {message}"
                        )
                        break
                    case _:
                        rid = getattr(msg, "request_id", None)
                        future = self._pending.pop(rid, None) if rid is not None else None
                        if future is not None and not future.done():
                            future.set_result(msg)
        except (ConnectionError, OSError, ProtocolError) as exc:
            error = exc
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(error)
            self._pending.clear()
            if self._writer is not None:
                self._writer.abort()
                self._writer = None

    async def _request(
        self,
        build: Callable[[str], protocol.Message],
        expect: type[R],
        check: Callable[[bytes], None] | None = None,
    ) -> R:
        """Send the request ``build(request_id)`` and return its reply, which must be an
        ``expect``; a ``request_error`` is raised as the exception the main raised
        (:mod:`broker.wire.errors`). ``check`` sees the encoded line first (encoded once,
        for both) and may refuse it by raising."""
        await self.connect()
        writer = self._writer
        assert writer is not None
        rid = f"r{next(self._ids)}"
        request = build(rid)
        line = codec.encode(request)
        if check is not None:
            check(line)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[protocol.Message] = loop.create_future()
        self._pending[rid] = future
        # The line goes out at once when nothing is queued before it, and the wait for the
        # answer is one timer on its future: a request then takes no lock, no drain and no
        # timeout scope (one at a time, those cost the caller about 15-20 us of its 160).
        # Only a line that must wait its turn to be written waits in a scope, to the same
        # deadline, since that wait is not on the future.
        deadline = loop.time() + self._timeout
        timer = loop.call_at(deadline, _time_out, future)
        try:
            if not writer.write_now(line):
                async with asyncio.timeout_at(deadline):
                    await writer.write_raw(line)
            reply = await future
        except TimeoutError:
            raise self._timed_out(f"a request ({type(request).__name__})") from None
        finally:
            timer.cancel()
            self._pending.pop(rid, None)
        if isinstance(reply, protocol.RequestError):
            raise error_codes.raised_by(reply)
        if not isinstance(reply, expect):
            raise ProtocolError(f"expected {expect.type!r} from the main, got {reply!r}")
        return reply

    async def enqueue(
        self,
        task: str | Task[..., Any],
        args: Sequence[JSONValue] = (),
        kwargs: Mapping[str, JSONValue] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | None = None,
        idempotency_key: str | None = None,
        max_attempts: int | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the job's run timeout
        execution_mode: ExecutionMode | str | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
        unique_key: str | None = None,
    ) -> Enqueued:
        """Enqueue one job; a registered ``Task`` contributes its defaults. By name, the
        main fills every option not given here from the task's declaration (the task
        catalog), and refuses a name no worker has declared (``UnknownTaskError``) unless
        the client allows unknown tasks.

        ``unique_key``: while a queued or running job holds the key, the enqueue returns
        that job with ``duplicate=True`` instead of making another.
        """
        options: dict[str, Any] = {
            "queue": queue,
            "priority": priority,
            "max_attempts": max_attempts,
            "timeout": timeout,
            "execution_mode": ExecutionMode(execution_mode) if execution_mode else None,
            "concurrency_key": concurrency_key,
            "concurrency_limit": concurrency_limit,
            "unique_key": unique_key,
        }
        overrides = {k: v for k, v in options.items() if v is not None}
        if isinstance(task, Task):
            task.check_arguments(args, kwargs or {})
            spec = task.spec(
                args, kwargs, run_at=run_at, idempotency_key=idempotency_key, **overrides
            )
            return await self.enqueue_spec(spec, delay=delay)
        # By name: the main fills in the task's declared defaults for what is not said
        # here (the task catalog). Built as a spec first, so a bad value fails here.
        spec = JobSpec(
            task=task,
            args=tuple(args),
            kwargs=dict(kwargs or {}),
            run_at=run_at,
            idempotency_key=idempotency_key,
            **overrides,
        )
        return await self._enqueue_request(
            protocol.JobRequest.from_spec(spec, said=overrides), delay
        )

    async def enqueue_spec(self, spec: JobSpec, *, delay: float | None = None) -> Enqueued:
        """Enqueue one job as built; ``delay`` (seconds) is counted from the main's clock,
        so the caller's clock does not matter."""
        return await self._enqueue_request(protocol.JobRequest.from_spec(spec), delay)

    async def _enqueue_request(self, request: protocol.JobRequest, delay: float | None) -> Enqueued:
        if delay is not None:
            request = msgspec.structs.replace(request, run_at=None, delay=float(delay))
        with tracing.enqueue_span(request.task):
            return (await self.enqueue_requests([request]))[0]

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[Enqueued]:
        """Enqueue many jobs in one round trip and one store transaction."""
        return await self.enqueue_requests([protocol.JobRequest.from_spec(s) for s in specs])

    async def enqueue_batches(
        self, specs: Iterable[JobSpec], *, batch_size: int = 250, in_flight: int = 3
    ) -> list[Enqueued]:
        """Enqueue any number of jobs, ``batch_size`` to a request, with up to
        ``in_flight`` requests under way at once; the results come back in the order of
        ``specs``.

        Each batch is stored all or none, as :meth:`enqueue_many` stores it, but the
        batches are not one transaction: this is for loads too large for one request
        (Sidekiq's ``push_bulk`` works the same way). While the main stores one batch,
        this process encodes and sends the next, so both work at once: three 1,000-job
        batches in flight enqueued 10,000 jobs about 1.2 times as fast as one batch at a
        time (``bench/enqueue_bench.py``, two cores).

        If a batch is refused, no further batch is sent, the ones under way are waited
        for, and the first refusal is raised. The batches before it, and those that were
        under way, may be stored: give the jobs idempotency keys, and calling again with
        the same specs stores each job once.
        """
        if batch_size < 1 or in_flight < 1:
            raise ValueError("batch_size and in_flight must be at least 1")
        slots = asyncio.Semaphore(in_flight)
        refused = False

        async def send(batch: list[JobSpec]) -> list[Enqueued]:
            nonlocal refused
            try:
                return await self.enqueue_many(batch)
            except BaseException:
                refused = True
                raise
            finally:
                slots.release()

        sent: list[asyncio.Task[list[Enqueued]]] = []
        try:
            batches = iter(specs)
            while batch := list(itertools.islice(batches, batch_size)):
                await slots.acquire()
                if refused:
                    break
                sent.append(asyncio.create_task(send(batch)))
        finally:
            answers = await asyncio.gather(*sent, return_exceptions=True)
        results: list[Enqueued] = []
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
            results += answer
        return results

    async def enqueue_requests(
        self, requests: Sequence[protocol.JobRequest], *, allow_unknown_tasks: bool | None = None
    ) -> list[Enqueued]:
        """Enqueue the requests as given (a field left ``None`` takes the task's declared
        default); ``allow_unknown_tasks`` (``None``: the client's setting) allows tasks no
        worker has declared.

        :raises PayloadTooLargeError: the request would not fit in one line the main
        accepts (it would close the connection), or holds more lists and objects than the
        main reads (``--max-payload-containers``); the main enforces its payload limits
        too."""

        def fits(line: bytes) -> None:
            limit = self._max_line_bytes
            if limit is not None and len(line) - 1 > limit:
                raise PayloadTooLargeError(
                    f"the enqueue request is {len(line) - 1} bytes, over the main's line "
                    f"limit of {limit} bytes; send fewer or smaller jobs"
                )
            bound = self._max_containers
            if bound is not None and containers_in(line) > bound + MESSAGE_CONTAINERS:
                raise PayloadTooLargeError(
                    too_many_containers("the enqueue request (its jobs' args and kwargs)", bound)
                )

        carried = tracing.inject()
        if carried is not None:  # inside a span: each job's run becomes a child of it
            requests = [
                r if r.trace_context else msgspec.structs.replace(r, trace_context=carried)
                for r in requests
            ]
        allow = self._allow_unknown_tasks if allow_unknown_tasks is None else allow_unknown_tasks
        reply = await self._request(
            lambda rid: protocol.Enqueue(
                request_id=rid, jobs=list(requests), allow_unknown_tasks=allow
            ),
            protocol.EnqueuedReply,
            fits,
        )
        return [Enqueued(ref.job_id, ref.duplicate) for ref in reply.jobs]

    async def list_tasks(self) -> list[dict[str, JSONValue]]:
        """The task catalog: one entry per task and worker that declared it (``task``,
        ``worker_id``, ``seen_at``, ``declaration``), by task name."""
        reply = await self._request(
            lambda rid: protocol.ListTasks(request_id=rid), protocol.TaskList
        )
        return reply.tasks

    async def get_job(self, job_id: uuid.UUID | str) -> dict[str, JSONValue] | None:
        """The job as ``Job.to_dict()`` shows it, or ``None`` if the store has no such job."""
        reply = await self._request(
            lambda rid: protocol.GetJob(request_id=rid, job_id=uuid.UUID(str(job_id))),
            protocol.JobInfo,
        )
        return reply.job

    async def cancel(self, job_id: uuid.UUID | str) -> dict[str, JSONValue] | None:
        reply = await self._request(
            lambda rid: protocol.Cancel(request_id=rid, job_id=uuid.UUID(str(job_id))),
            protocol.JobInfo,
        )
        return reply.job

    async def retry(self, job_id: uuid.UUID | str) -> dict[str, JSONValue] | None:
        """Put a dead (``failed``) job back in the queue with a fresh attempt count; a job in
        any other status comes back unchanged, and ``None`` means there is no such job."""
        reply = await self._request(
            lambda rid: protocol.Retry(request_id=rid, job_id=uuid.UUID(str(job_id))),
            protocol.JobInfo,
        )
        return reply.job

    async def status(self) -> dict[str, JSONValue]:
        """The main's operator snapshot: queues, workers, pending recoveries."""
        reply = await self._request(
            lambda rid: protocol.Status(request_id=rid), protocol.StatusInfo
        )
        return reply.status

    async def list_jobs(
        self,
        *,
        statuses: Collection[JobStatus | str] | None = None,
        queues: Collection[str] | None = None,
        tasks: Collection[str] | None = None,
        limit: int = 50,
        cursor: str | None = None,
        include_payload: bool = False,
    ) -> JobListPage:
        """One page of jobs, newest first; pass ``next_cursor`` back for the next page.

        The main may send fewer than ``limit`` jobs, to keep the page within its byte
        budget. Jobs come without ``args``, ``kwargs`` and ``result`` unless
        ``include_payload``; a job too large to send whole even alone then comes
        without them and with ``payload_omitted: true`` (``get_job`` returns it whole).
        """
        request = functools.partial(
            protocol.ListJobs,
            statuses=None if statuses is None else [JobStatus(s) for s in statuses],
            queues=None if queues is None else list(queues),
            tasks=None if tasks is None else list(tasks),
            limit=limit,
            cursor=cursor,
            include_payload=include_payload,
        )
        reply = await self._request(lambda rid: request(request_id=rid), protocol.JobList)
        return JobListPage(jobs=reply.jobs, next_cursor=reply.next_cursor)

    async def prune(
        self,
        *,
        older_than: float | None = None,
        keep_latest: int | None = None,
        statuses: Collection[JobStatus | str] | None = None,
    ) -> int:
        """Delete terminal jobs last updated over ``older_than`` seconds ago, and those beyond
        the newest ``keep_latest``; returns how many were deleted."""
        request = functools.partial(
            protocol.Prune,
            older_than_seconds=None if older_than is None else float(older_than),
            keep_latest=keep_latest,
            statuses=None if statuses is None else [JobStatus(s) for s in statuses],
        )
        reply = await self._request(lambda rid: request(request_id=rid), protocol.Pruned)
        return reply.deleted

    async def wait(
        self,
        job_id: uuid.UUID | str,
        *,
        timeout: float = 60.0,  # noqa: ASYNC109 - a polling budget, not a cancel scope
        interval: float = 0.05,
    ) -> dict[str, JSONValue]:
        """Poll until the job is terminal; raises ``TimeoutError`` if it is not by then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            job = await self.get_job(job_id)
            if job is None:
                raise BrokerError(f"job {job_id} does not exist (pruned, or never enqueued)")
            if JobStatus(str(job["status"])).is_terminal:
                return job
            if loop.time() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job['status']} after {timeout} s")
            await asyncio.sleep(interval)
