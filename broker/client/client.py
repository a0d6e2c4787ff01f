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
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar, cast

import msgspec

from broker.core.reconnect import Reconnect
from broker.exceptions import (
    BrokerError,
    BrokerUnavailableError,
    ConfigurationError,
    ConnectionLostError,
    NotLeaderError,
    OverLimitError,
    PayloadTooLargeError,
    ProtocolError,
)
from broker.jobs import ExecutionMode, JobSpec, JobStatus, JSONValue, keyword_sets
from broker.model import tracing
from broker.model.bounds import MAX_WAIT_SECONDS, MESSAGE_CONTAINERS
from broker.model.rates import parse_rate
from broker.payload import containers_in, too_many_containers
from broker.tasks.registry import Enqueued, Task
from broker.tasks.workflow import (
    EnqueuedWorkflow,
    Workflow,
    final_job,
    final_task,
    workflow_specs,
)
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


RETRY_MAX_DELAY = 1.0
"""The longest pause (seconds) between two attempts to reach a main, in :meth:`Client.connect`
and between the attempts of a request safe to repeat: an election takes a few seconds, so
a client polling a second at most finds the new leader soon after it is elected."""


def _workflow_id(workflow: EnqueuedWorkflow | uuid.UUID | str) -> uuid.UUID:
    if isinstance(workflow, EnqueuedWorkflow):
        return workflow.workflow_id
    return uuid.UUID(str(workflow))


def _said(**options: Any) -> dict[str, Any]:
    """The options a call gave (not ``None``), the execution mode parsed: by name, the
    main fills every other one from the task's declaration, so an option left out must
    not be sent as its default."""
    if options.get("execution_mode"):
        options["execution_mode"] = ExecutionMode(options["execution_mode"])
    return {k: v for k, v in options.items() if v is not None}


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
        retry_timeout: float = 15.0,
    ) -> None:
        """``allow_unknown_tasks``: enqueue jobs of tasks no worker has declared yet (a
        deliberate cold start); by default the main refuses them with
        :class:`~broker.exceptions.UnknownTaskError`, since such a name is usually a typo
        (see :mod:`broker.core.catalog`).

        ``timeout`` bounds each attempt to connect and each answer. ``retry_timeout``
        bounds the retries that ride out a restart or a failover: :meth:`connect` tries
        again, with jittered backoff, for that long while no main welcomes (refused, over
        its admission limit, none elected yet); a request that is safe to repeat (a read,
        a wait, an enqueue whose every job has an ``idempotency_key``) is sent again for
        that long after the connection is lost. ``0``: each main is tried once, nothing is
        repeated. Other requests raise :class:`~broker.exceptions.ConnectionLostError` at
        once: the main may have applied them, and only the caller knows whether a second
        job would be acceptable."""
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
        self._retry_timeout = retry_timeout
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
        self._features: frozenset[str] = frozenset()
        """The optional requests the main answers, from its welcome (``welcome.features``)."""

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
        """Connect to the elected main, if not connected. Every main listed is tried, and
        tried again with jittered backoff while none welcomes, for up to ``retry_timeout``
        (each attempt within ``timeout``): a fleet that restarts at once, or a failover,
        gets in without the caller retrying.

        :raises BrokerUnavailableError: no main welcomed this client in time.
        :raises NotLeaderError: mains answered, but none is elected.
        :raises ConfigurationError: the TLS handshake failed (a certificate or name).
        """
        self._check_fork()
        if self._writer is not None and not self._writer.is_closing:
            return  # connected: every request passes here, without taking the lock
        async with self._connect_lock:
            if self._writer is not None and not self._writer.is_closing:
                return
            loop = asyncio.get_running_loop()
            give_up = loop.time() + self._retry_timeout
            policy = Reconnect(self._mains, RETRY_MAX_DELAY)
            tried = 0
            while True:
                try:
                    await self._connect()
                    return
                except ssl.SSLError as exc:
                    # The main answered, and refused: a setting to correct, not an outage.
                    raise ConfigurationError(tls.describe(exc, str(self._mains))) from None
                except NotLeaderError as exc:
                    last: BrokerError = exc
                    delay = policy.not_leader(exc.leader)
                except (OSError, TimeoutError, OverLimitError) as exc:
                    last = BrokerUnavailableError(
                        f"no main at {self._mains} welcomed this client: "
                        f"{str(exc) or type(exc).__name__}"
                    )
                    last.__cause__ = exc
                    delay = policy.unreachable()
                tried += 1
                if tried < len(self._mains.all):
                    continue  # each main once at once, then back off
                if loop.time() + delay >= give_up:
                    raise last
                await asyncio.sleep(delay)

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
            self._features = frozenset(welcome.features)
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
        error: BaseException = ConnectionLostError("the main closed the connection")
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
        except ProtocolError as exc:
            error = exc
        except OSError as exc:
            error = ConnectionLostError(f"the connection to the main was lost: {exc!r}")
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
        reply = await self._exchange(build, check)
        if not isinstance(reply, expect):
            raise ProtocolError(f"expected {expect.type!r} from the main, got {reply!r}")
        return reply

    async def _exchange(
        self,
        build: Callable[[str], protocol.Message],
        check: Callable[[bytes], None] | None = None,
        *,
        longer: float = 0.0,
    ) -> protocol.Message:
        """Send ``build(request_id)`` and return its reply, which the main may take
        ``longer`` seconds beyond the client's ``timeout`` to send (a ``wait_job``)."""
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
        deadline = loop.time() + self._timeout + longer
        timer = loop.call_at(deadline, _time_out, future)
        try:
            if not writer.write_now(line):
                async with asyncio.timeout_at(deadline):
                    await writer.write_raw(line)
            reply = await future
        except TimeoutError:
            raise self._timed_out(f"a request ({type(request).__name__})") from None
        except OSError as exc:
            if isinstance(exc, BrokerError):
                raise
            raise ConnectionLostError(f"sending to the main failed: {exc!r}") from exc
        finally:
            timer.cancel()
            self._pending.pop(rid, None)
        if isinstance(reply, protocol.RequestError):
            raise error_codes.raised_by(reply)
        return reply

    async def _repeatable(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, a request safe to send twice, sent again while the main cannot be
        reached or the connection is lost (a failover, a restart), with jittered backoff,
        for up to ``retry_timeout`` from the first failure; then its error is raised.
        Each attempt connects again, following a standby to the new leader."""
        loop = asyncio.get_running_loop()
        give_up: float | None = None
        policy = Reconnect(self._mains, RETRY_MAX_DELAY)
        while True:
            try:
                return await call()
            except (BrokerUnavailableError, NotLeaderError):
                now = loop.time()
                if give_up is None:
                    give_up = now + self._retry_timeout
                delay = policy.unreachable()
                if now + delay >= give_up:
                    raise
            await asyncio.sleep(delay)

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

        ``args`` is one list (not the arguments spread out, as ``task.enqueue(*args)``
        takes them): a string or a number there is refused here with the right form, not
        read as a sequence of characters or failed on deep inside.
        """
        if not isinstance(args, list | tuple):
            raise TypeError(
                "Client.enqueue takes the task's positional arguments as one list, "
                f"e.g. client.enqueue(task, [a, b], {{'k': v}}); got {type(args).__name__}"
            )
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise TypeError(
                "Client.enqueue takes the task's keyword arguments as one mapping, "
                f"e.g. client.enqueue(task, [a], {{'k': v}}); got {type(kwargs).__name__}"
            )
        overrides = _said(
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            execution_mode=execution_mode,
            concurrency_key=concurrency_key,
            concurrency_limit=concurrency_limit,
            unique_key=unique_key,
        )
        if isinstance(task, Task):
            task.check_arguments(args, kwargs or {})
            spec = task.spec(
                args, kwargs, run_at=run_at, idempotency_key=idempotency_key, **overrides
            )
            return replace(await self.enqueue_spec(spec, delay=delay), task=task)
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

    async def enqueue_workflow(self, workflow: Workflow) -> EnqueuedWorkflow:
        """Enqueue a chain, a group or a fan-in (:func:`broker.chain`, :func:`broker.group`)
        in one request: every job at once, the later ones waiting for their parents. Wait
        on ``final_job_id`` for the workflow's result."""
        specs = workflow_specs(workflow)
        enqueued = await self.enqueue_many(specs)
        workflow_id = specs[0].workflow_id
        assert workflow_id is not None
        final = final_job(workflow, specs)
        return EnqueuedWorkflow(
            workflow_id,
            tuple(e.job_id for e in enqueued),
            final,
            None if final is None else replace(enqueued[-1], task=final_task(workflow)),
        )

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

    async def enqueue_each(
        self,
        task: str | Task[..., Any],
        arg_sets: Sequence[Sequence[JSONValue]],
        kwarg_sets: Sequence[Mapping[str, JSONValue]] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | None = None,
        max_attempts: int | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the jobs' run timeout
        execution_mode: ExecutionMode | str | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
    ) -> list[uuid.UUID]:
        """One job of ``task`` for each of ``arg_sets`` (with the keyword arguments at the
        same place in ``kwarg_sets``, if given), the options given once for all, in one
        request stored all or none: a bulk enqueue as
        :func:`~broker.enqueue_each_in_async` is one on the application's own connection.
        The new jobs' ids, in order.

        By name, the request carries the task and its options once and the argument sets
        as lists, and the main checks the options once (the task's declared defaults for
        what is not said here) and each job's arguments, and builds no spec per job
        (``enqueue_each`` in ``docs/protocol.md``). A :class:`~broker.Task` (whose
        argument checks and keys are per job), or a main too old to know the request
        (its welcome does not list it), gets the same jobs as one ``enqueue``
        request, a job each.

        :raises InvalidJobError: an option or an argument set is invalid; nothing is
            stored.
        :raises PayloadTooLargeError: the request would not fit in one line the main
            accepts, or holds more lists and objects than it reads (send fewer jobs a
            call); or a job's arguments are over the main's payload limit.
        """
        overrides = _said(
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            execution_mode=execution_mode,
            concurrency_key=concurrency_key,
            concurrency_limit=concurrency_limit,
        )
        kwargs = keyword_sets(len(arg_sets), kwarg_sets)
        if isinstance(task, Task):
            specs = []
            for args, keywords in zip(arg_sets, kwargs, strict=True):
                task.check_arguments(args, keywords)
                specs.append(task.spec(args, keywords, run_at=run_at, **overrides))
            each = [protocol.JobRequest.from_spec(spec) for spec in specs]
        else:
            # Built as a spec first, so a bad option fails here.
            template = protocol.JobRequest.from_spec(
                JobSpec(task=task, run_at=run_at, **overrides), said=overrides
            )
            # No id: each job gets its own (the main mints them).
            template = msgspec.structs.replace(template, id=None)
            if delay is not None:
                template = msgspec.structs.replace(template, run_at=None, delay=float(delay))
            await self.connect()
            if protocol.ENQUEUE_EACH in self._features:
                return await self._enqueue_each(template, arg_sets, kwarg_sets)
            each = [
                msgspec.structs.replace(template, args=list(a), kwargs=dict(k))
                for a, k in zip(arg_sets, kwargs, strict=True)
            ]
        if delay is not None:
            each = [msgspec.structs.replace(r, run_at=None, delay=float(delay)) for r in each]
        return [enqueued.job_id for enqueued in await self.enqueue_requests(each)]

    async def _enqueue_each(
        self,
        template: protocol.JobRequest,
        arg_sets: Sequence[Sequence[JSONValue]],
        kwarg_sets: Sequence[Mapping[str, JSONValue]] | None,
    ) -> list[uuid.UUID]:
        """The ``enqueue_each`` request, sent once (its jobs have no key to repeat it by)."""
        carried = tracing.inject()
        if carried is not None:  # inside a span: each job's run becomes a child of it
            template = msgspec.structs.replace(template, trace_context=carried)
        allow = self._allow_unknown_tasks
        # The argument sets go as given: the encoder writes any sequence as a list, and
        # copying each into the type the main decodes it as would cost a copy per job.
        sets = cast(list[tuple[JSONValue, ...]], list(arg_sets))
        keywords = cast(list[dict[str, JSONValue]] | None, kwarg_sets and list(kwarg_sets))
        with tracing.enqueue_span(template.task):
            reply = await self._request(
                lambda rid: protocol.EnqueueEach(
                    request_id=rid,
                    job=template,
                    arg_sets=sets,
                    kwarg_sets=keywords,
                    allow_unknown_tasks=allow,
                ),
                protocol.EnqueuedEach,
                self._fits,
            )
        return reply.job_ids

    def _fits(self, line: bytes) -> None:
        """Refuse an enqueue's ``line`` that the main would refuse unread: over its line
        limit (it would close the connection) or its container bound.

        :raises PayloadTooLargeError: so."""
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
        carried = tracing.inject()
        if carried is not None:  # inside a span: each job's run becomes a child of it
            requests = [
                r if r.trace_context else msgspec.structs.replace(r, trace_context=carried)
                for r in requests
            ]
        allow = self._allow_unknown_tasks if allow_unknown_tasks is None else allow_unknown_tasks

        def send() -> Awaitable[protocol.EnqueuedReply]:
            return self._request(
                lambda rid: protocol.Enqueue(
                    request_id=rid, jobs=list(requests), allow_unknown_tasks=allow
                ),
                protocol.EnqueuedReply,
                self._fits,
            )

        # Sent again after a lost connection only when every job has an idempotency key:
        # the main then returns the jobs it stored the first time instead of new ones.
        keyed = all(r.idempotency_key is not None for r in requests)
        reply = await (self._repeatable(send) if keyed else send())
        return [Enqueued(ref.job_id, ref.duplicate, client=self) for ref in reply.jobs]

    async def list_tasks(self) -> list[dict[str, JSONValue]]:
        """The task catalog: one entry per task and worker that declared it (``task``,
        ``worker_id``, ``seen_at``, ``declaration``), by task name."""
        reply = await self._repeatable(
            lambda: self._request(lambda rid: protocol.ListTasks(request_id=rid), protocol.TaskList)
        )
        return reply.tasks

    async def get_job(self, job_id: uuid.UUID | str) -> dict[str, JSONValue] | None:
        """The job as ``Job.to_dict()`` shows it, or ``None`` if the store has no such job."""
        job = uuid.UUID(str(job_id))
        reply = await self._repeatable(
            lambda: self._request(
                lambda rid: protocol.GetJob(request_id=rid, job_id=job), protocol.JobInfo
            )
        )
        return reply.job

    async def cancel(self, job_id: uuid.UUID | str) -> dict[str, JSONValue] | None:
        reply = await self._request(
            lambda rid: protocol.Cancel(request_id=rid, job_id=uuid.UUID(str(job_id))),
            protocol.JobInfo,
        )
        return reply.job

    async def cancel_workflow(self, workflow: EnqueuedWorkflow) -> list[dict[str, JSONValue]]:
        """Cancel every job of ``workflow`` not finished yet: waiting and queued ones are
        cancelled, running ones too (their workers are asked to stop, as for
        :meth:`cancel`). Children go first, so none is released by a parent's cancel
        (``on_parent_failure="run"``) before its own. Returns the jobs as they now stand."""
        jobs = [await self.cancel(job_id) for job_id in reversed(workflow.job_ids)]
        return [job for job in reversed(jobs) if job is not None]

    async def get_workflow(
        self, workflow: EnqueuedWorkflow | uuid.UUID | str
    ) -> protocol.WorkflowView | None:
        """A workflow (by its id, or the id of one of its jobs) as it stands: its
        ``status`` (``running``, ``completed``, ``failed``, ``cancelled``), its
        ``members`` (job id, task, status, attempts, the first line of the error; parents
        first, else in enqueue order) and ``edges`` (parent to child); ``None`` if no job
        carries that workflow id (never enqueued, or pruned)."""
        workflow_id = _workflow_id(workflow)
        reply = await self._repeatable(
            lambda: self._request(
                lambda rid: protocol.GetWorkflow(request_id=rid, workflow_id=workflow_id),
                protocol.WorkflowInfo,
            )
        )
        return reply.workflow

    async def retry_workflow(
        self, workflow: EnqueuedWorkflow | uuid.UUID | str
    ) -> protocol.WorkflowView | None:
        """Queue the workflow's dead members again, and make the dependents they cancelled
        wait for them again, so its continuation still runs once, when they complete. A
        member an operator cancelled stays cancelled. Needs the operator role. Returns
        the workflow as it then stands (``None``: no such workflow)."""
        workflow_id = _workflow_id(workflow)
        reply = await self._request(
            lambda rid: protocol.RetryWorkflow(request_id=rid, workflow_id=workflow_id),
            protocol.WorkflowInfo,
        )
        return reply.workflow

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
        reply = await self._repeatable(
            lambda: self._request(lambda rid: protocol.Status(request_id=rid), protocol.StatusInfo)
        )
        return reply.status

    async def pause_queue(self, queue: str) -> dict[str, JSONValue]:
        """Dispatch no more of ``queue``'s jobs until :meth:`resume_queue` (its running jobs
        finish; new and scheduled ones wait, queued). Kept in the store: a restart or a
        failover keeps it. Needs the operator role. Returns the queue's settings."""
        reply = await self._request(
            lambda rid: protocol.PauseQueue(request_id=rid, queue=queue), protocol.QueueInfo
        )
        return reply.queue

    async def resume_queue(self, queue: str) -> dict[str, JSONValue]:
        """Dispatch ``queue``'s jobs again, at once (see :meth:`pause_queue`)."""
        reply = await self._request(
            lambda rid: protocol.ResumeQueue(request_id=rid, queue=queue), protocol.QueueInfo
        )
        return reply.queue

    async def limit_queue(
        self, queue: str, rate: str | None, *, burst: int = 1
    ) -> dict[str, JSONValue]:
        """Dispatch at most ``rate`` of ``queue``'s jobs (``"50/s"``, ``"600/m"``,
        ``"100/h"``), ``burst`` of them at once after a quiet spell, across every worker;
        ``rate=None`` clears the limit. Kept in the store. Needs the operator role.

        :raises ValueError: ``rate`` or ``burst`` is not valid (before anything is sent).
        """
        if rate is not None:
            parse_rate(rate, burst)
        reply = await self._request(
            lambda rid: protocol.LimitQueue(request_id=rid, queue=queue, rate=rate, burst=burst),
            protocol.QueueInfo,
        )
        return reply.queue

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
        reply = await self._repeatable(
            lambda: self._request(lambda rid: request(request_id=rid), protocol.JobList)
        )
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
        timeout: float = 60.0,  # noqa: ASYNC109 - how long to wait, not a cancel scope
    ) -> dict[str, JSONValue]:
        """Wait until the job is terminal and return it, as :meth:`get_job` shows it.

        Nothing is polled: the main answers when the job's end is settled (``wait_job``,
        ``docs/protocol.md``). If the connection is lost (a failover), the wait is made
        again at the main that answers, which reads the job once, so an end in between is
        not missed (within ``retry_timeout``).

        :raises TimeoutError: the job has not ended after ``timeout`` seconds.
        :raises BrokerError: no such job (pruned, or never enqueued).
        """
        job = uuid.UUID(str(job_id))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        async def once() -> protocol.Message:
            # Each attempt (again after a lost connection) waits what is left, at most
            # the main's bound; a longer wait is several in turn.
            left = min(max(deadline - loop.time(), 0.0), MAX_WAIT_SECONDS)
            return await self._exchange(
                lambda rid: protocol.WaitJob(request_id=rid, job_id=job, timeout=left),
                longer=left,
            )

        while True:
            reply = await self._repeatable(once)
            match reply:
                case protocol.JobInfo(job=None):
                    raise BrokerError(f"job {job} does not exist (pruned, or never enqueued)")
                case protocol.JobInfo(job=dict() as found):
                    return found
                case protocol.WaitPending():
                    if loop.time() >= deadline:
                        raise TimeoutError(f"job {job} has not ended after {timeout} s")
                case _:
                    raise ProtocolError(f"expected a job_info from the main, got {reply!r}")
