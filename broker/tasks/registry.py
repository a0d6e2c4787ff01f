"""Task registration: the allow-list of what a worker may run.

A job names its task by string, and that string comes over the network. The
worker looks it up here and nowhere else: nothing is ever imported by a name
that arrived on the wire (the RQ ``import_attribute`` hole). Tasks are registered
by importing the app's own modules, which the operator names on the command line.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import re
import string
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar, cast, overload

from broker.exceptions import (
    ConfigurationError,
    InvalidJobError,
    JobFailedError,
    TaskNotFoundError,
)
from broker.jobs import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_QUEUE,
    MAX_UNIQUE_KEY_BYTES,
    ExecutionMode,
    JobSpec,
    JSONValue,
)
from broker.model.rates import Rate, parse_rate
from broker.retry import RetryPolicy, TaskBackoff
from broker.tasks.arguments import encode_arguments, plan_for
from broker.tasks.hooks import WorkerHooks
from broker.tasks.schedule import Schedule, default_schedules

if TYPE_CHECKING:
    from broker.tasks.workflow import Step

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Enqueued:
    """The main's answer to an enqueue: the job's id, and whether it was already there
    (the same ``idempotency_key``, or an active job holding the ``unique_key``).

    It is also a handle on the job: :meth:`result` waits for its end (pushed by the
    main, not polled) and returns its result, read back as the task's return annotation
    says when the enqueue named a ``Task`` (``task.enqueue()``, ``Client.enqueue(task,
    ...)``); the JSON value as stored otherwise."""

    job_id: uuid.UUID
    duplicate: bool
    task: Task[Any, Any] | None = field(default=None, compare=False, repr=False)
    """The task enqueued, when the call named one: its return annotation decodes the result."""
    client: AsyncWaiter | SyncWaiter | None = field(default=None, compare=False, repr=False)
    """The client the job was enqueued through, which :meth:`result` waits with."""

    async def result(self, *, timeout: float = 60.0) -> Any:  # noqa: ASYNC109 - how long to wait
        """Wait until the job has ended and return its result (see the class docstring).

        :raises JobFailedError: the job ended dead (``failed``) or ``cancelled``: its
            ``status`` says which, its message is the job's ``last_error``.
        :raises TimeoutError: it has not ended after ``timeout`` seconds.
        :raises ConfigurationError: the handle came from a ``SyncClient`` (call
            :meth:`result_sync`) or was built by hand (no client).
        """
        client = self.client
        if client is None or not inspect.iscoroutinefunction(client.wait):
            raise ConfigurationError(
                "result() needs a handle from an asyncio client (broker.Client); from a "
                "SyncClient, call result_sync()"
            )
        job = await cast(AsyncWaiter, client).wait(self.job_id, timeout=timeout)
        return self.decoded(job)

    def result_sync(self, *, timeout: float = 60.0) -> Any:
        """The blocking twin of :meth:`result`, for a handle from a ``SyncClient``."""
        client = self.client
        if client is None or inspect.iscoroutinefunction(client.wait):
            raise ConfigurationError(
                "result_sync() needs a handle from a broker.SyncClient; from an asyncio "
                "Client, await result()"
            )
        return self.decoded(cast(SyncWaiter, client).wait(self.job_id, timeout=timeout))

    def decoded(self, job: Mapping[str, JSONValue]) -> Any:
        """The result of ``job`` (this handle's job once ended, as ``Client.wait`` returns
        it), decoded by the task's return annotation when the handle knows the task.

        :raises JobFailedError: the job did not complete.
        """
        status = str(job.get("status"))
        if status != "completed":
            error = job.get("last_error") or "no error was recorded"
            raise JobFailedError(
                f"job {self.job_id} ended {status}: {error}", job_id=self.job_id, status=status
            )
        value = job.get("result")
        return value if self.task is None else self.task.decode_result(value)


class AsyncWaiter(Protocol):
    """What :meth:`Enqueued.result` waits through: :class:`broker.Client` is one."""

    async def wait(
        self,
        job_id: uuid.UUID | str,
        *,
        timeout: float = 60.0,  # noqa: ASYNC109 - how long to wait
    ) -> dict[str, JSONValue]: ...


class SyncWaiter(Protocol):
    """What :meth:`Enqueued.result_sync` waits through: :class:`broker.SyncClient` is one."""

    def wait(self, job_id: uuid.UUID | str, *, timeout: float = 60.0) -> dict[str, JSONValue]: ...


class AsyncEnqueuer(Protocol):
    """What ``task.enqueue`` sends a job through: :class:`broker.Client` is one."""

    async def enqueue_spec(self, spec: JobSpec, *, delay: float | None = None) -> Enqueued: ...


class SyncEnqueuer(Protocol):
    """What ``task.enqueue_sync`` sends a job through: :class:`broker.SyncClient` is one."""

    def enqueue_spec(self, spec: JobSpec, *, delay: float | None = None) -> Enqueued: ...


class DefaultClients(Protocol):
    """Where a task finds its client when the call names none: :func:`broker.configure`
    installs one (it lives above this module, which must not import the client)."""

    def async_client(self) -> AsyncEnqueuer: ...

    def sync_client(self) -> SyncEnqueuer: ...


_default_clients: DefaultClients | None = None


def set_default_clients(clients: DefaultClients | None) -> None:
    """Install (or, with ``None``, remove) the clients tasks enqueue through by default."""
    global _default_clients
    _default_clients = clients


def _defaults() -> DefaultClients:
    if _default_clients is None:
        raise ConfigurationError(
            "no broker client is configured for task.enqueue(): call "
            "broker.configure(host, port, token=...) once at start-up, or pass one with "
            "task.options(client=...)"
        )
    return _default_clients


@dataclass(frozen=True)
class TaskCall(Generic[P, R]):
    """A task with the options of one enqueue, from :meth:`Task.options`.

    Options live here, apart from the task's own arguments, so a task may have a parameter
    called ``queue`` or ``delay`` and mypy still checks every argument against the task's
    signature.
    """

    task: Task[P, R]
    overrides: Mapping[str, Any] = field(default_factory=dict)
    run_at: datetime | None = None
    delay: float | None = None
    idempotency_key: str | None = None
    client: AsyncEnqueuer | SyncEnqueuer | None = None

    def spec(self, *args: P.args, **kwargs: P.kwargs) -> JobSpec:
        """The job this call would enqueue, its arguments bound against the task's
        signature first (``TypeError`` on a mismatch, and nothing is stored)."""
        self.task.check_arguments(args, kwargs)
        return self.task.spec(
            args,
            kwargs,
            run_at=self.run_at,
            idempotency_key=self.idempotency_key,
            **self.overrides,
        )

    async def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> Enqueued:
        """Enqueue one job through the call's client, else the configured default."""
        spec = self.spec(*args, **kwargs)
        client = self.client if self.client is not None else _defaults().async_client()
        if not inspect.iscoroutinefunction(client.enqueue_spec):
            raise ConfigurationError(
                "enqueue() needs an asyncio client (broker.Client); with a SyncClient, "
                "call enqueue_sync()"
            )
        enqueued = await cast(AsyncEnqueuer, client).enqueue_spec(spec, delay=self.delay)
        return replace(enqueued, task=self.task)

    def bind(self, *args: JSONValue, **kwargs: JSONValue) -> Step:
        """A workflow step of this call (see :meth:`Task.bind`)."""
        from broker.tasks.workflow import bind  # the workflow module builds on this one

        return bind(self, *args, **kwargs)

    def enqueue_sync(self, *args: P.args, **kwargs: P.kwargs) -> Enqueued:
        """:meth:`enqueue` for code without an event loop (WSGI apps, scripts): blocks
        until the main has stored the job."""
        spec = self.spec(*args, **kwargs)
        client = self.client if self.client is not None else _defaults().sync_client()
        if inspect.iscoroutinefunction(client.enqueue_spec):
            raise ConfigurationError(
                "enqueue_sync() needs a broker.SyncClient; with an asyncio Client, await enqueue()"
            )
        enqueued = cast(SyncEnqueuer, client).enqueue_spec(spec, delay=self.delay)
        return replace(enqueued, task=self.task)


_MAX_SHAPES = 64
"""Call shapes remembered per task (see :meth:`Task.check_arguments`): a bound on memory
for callers that vary their keywords without end."""


@dataclass(frozen=True)
class Task(Generic[P, R]):
    """A registered function plus the defaults its jobs get.

    ``concurrency_key`` may be a template such as ``"sync:{account_id}"``: each job's key
    is formatted from its arguments, keyword or positional (bound to parameter names).
    With ``unique=True`` each job gets :func:`default_unique_key` unless one is given.
    """

    name: str
    func: Callable[P, R]
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    retries: int = DEFAULT_MAX_RETRIES
    timeout: float | None = None
    execution_mode: ExecutionMode = ExecutionMode.POOLED
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    unique: bool = False
    retry: RetryPolicy | None = None
    """Which exceptions are worth a retry (``None``: every ``Exception``)."""
    backoff: TaskBackoff | None = None
    """The wait before each retry (``None``: the main's ``--retry-backoff``)."""
    max_recoveries: int | None = None
    """Lost attempts its jobs recover from (``None``: the main's default)."""
    local_state: bool = False
    """Its jobs keep state on their worker's machine: recoveries wait for that worker."""
    rate_limit: Rate | None = None
    """At most this many of its jobs dispatched, across all workers (the main enforces it,
    :mod:`broker.core.flow`); ``None``: no limit of its own."""
    rate_key: str | None = None
    """A template such as ``"{tenant}"``: :attr:`rate_limit` then holds for each key apart,
    each job's key filled from its arguments at enqueue (:meth:`spec`)."""

    @functools.cached_property
    def _signature(self) -> inspect.Signature | None:
        """Computed once: the worker checks every job's arguments against it."""
        try:
            return inspect.signature(self.func)
        except (TypeError, ValueError):
            return None

    @functools.cached_property
    def is_async(self) -> bool:
        """Computed once: a runner asks it for every job."""
        return inspect.iscoroutinefunction(self.func)

    @functools.cached_property
    def _bindings(self) -> dict[tuple[int, tuple[str, ...]], str | None]:
        """Whether a call binds, by its shape (see :meth:`check_arguments`)."""
        return {}

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Calling the task runs the function here and now, as a plain call would."""
        return self.func(*args, **kwargs)

    def options(
        self,
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: float | None = None,
        run_at: datetime | None = None,
        idempotency_key: str | None = None,
        retries: int | None = None,
        timeout: float | None = None,
        mode: ExecutionMode | str | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
        unique_key: str | None = None,
        client: AsyncEnqueuer | SyncEnqueuer | None = None,
    ) -> TaskCall[P, R]:
        """This task with options for one enqueue (``None`` keeps the task's default):
        ``send_email.options(queue="mail", delay=10).enqueue(to)``."""
        if delay is not None and run_at is not None:
            raise InvalidJobError("give delay or run_at, not both")
        given = {
            "queue": queue,
            "priority": priority,
            "retries": retries,
            "timeout": timeout,
            "execution_mode": None if mode is None else ExecutionMode(mode),
            "concurrency_key": concurrency_key,
            "concurrency_limit": concurrency_limit,
            "unique_key": unique_key,
        }
        return TaskCall(
            self,
            {k: v for k, v in given.items() if v is not None},
            run_at=run_at,
            delay=None if delay is None else float(delay),
            idempotency_key=idempotency_key,
            client=client,
        )

    async def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> Enqueued:
        """Enqueue one job of this task with its defaults, through the default client
        (:func:`broker.configure`); the arguments are checked against the function's
        signature here, so a wrong call raises ``TypeError`` and stores nothing."""
        return await self.options().enqueue(*args, **kwargs)

    def enqueue_sync(self, *args: P.args, **kwargs: P.kwargs) -> Enqueued:
        """The blocking twin of :meth:`enqueue`, through the default ``SyncClient``."""
        return self.options().enqueue_sync(*args, **kwargs)

    def bind(self, *args: JSONValue, **kwargs: JSONValue) -> Step:
        """A workflow step (:func:`broker.chain`, :func:`broker.group`) of this task with
        these arguments; a step after another receives the parent's result (a chain) or
        the list of results (a fan-in) first, before these. The arguments are checked
        against the signature, the received result included, when the workflow is built."""
        return self.options().bind(*args, **kwargs)

    def check_arguments(self, args: Sequence[JSONValue], kwargs: Mapping[str, JSONValue]) -> None:
        """Raise ``TypeError`` unless a call with ``args`` and ``kwargs`` would bind to the
        function's parameters: a job that could never run is refused before it is stored,
        instead of failing in a worker and being retried."""
        signature = self._signature
        if signature is None:
            return  # a callable without a signature (a builtin): nothing to check against
        # Binding depends on the number of positional arguments and the keywords' names
        # only, never on values, so each shape is bound once (a worker checks every job).
        shape = (len(args), tuple(kwargs))
        bindings = self._bindings
        if shape in bindings:
            problem = bindings[shape]
        else:
            try:
                signature.bind(*args, **kwargs)
                problem = None
            except TypeError as exc:
                problem = str(exc)
            if len(bindings) < _MAX_SHAPES:
                bindings[shape] = problem
        if problem is not None:
            raise TypeError(f"task {self.name!r} cannot take these arguments: {problem}")

    def spec(
        self,
        args: Sequence[JSONValue] = (),
        kwargs: Mapping[str, JSONValue] | None = None,
        *,
        run_at: datetime | None = None,
        idempotency_key: str | None = None,
        **overrides: Any,
    ) -> JobSpec:
        """A job for this task with the task's defaults, any of which may be overridden.

        The arguments are written in their JSON form first (``datetime``, ``UUID``,
        dataclasses...: see :mod:`broker.tasks.arguments`), so keys made from them are
        the ones an enqueue by name of the same values makes."""
        args, kwargs = encode_arguments(self.name, self.func, args, kwargs or {})
        fields: dict[str, Any] = {
            "queue": self.queue,
            "priority": self.priority,
            "max_attempts": self.retries + 1,
            "timeout": self.timeout,
            "execution_mode": self.execution_mode,
            "concurrency_key": self.concurrency_key,
            "concurrency_limit": self.concurrency_limit,
            "max_recoveries": self.max_recoveries,
            "local_state": self.local_state,
        }
        if "retries" in overrides:
            overrides["max_attempts"] = int(overrides.pop("retries")) + 1
        fields.update(overrides)
        if "concurrency_key" not in overrides and self.concurrency_key is not None:
            fields["concurrency_key"] = self._format_key(self.concurrency_key, args, kwargs)
        if "rate_key" not in overrides and self.rate_key is not None:
            fields["rate_key"] = self._format_key(self.rate_key, args, kwargs, "rate_key")
        if self.unique and fields.get("unique_key") is None:
            fields["unique_key"] = default_unique_key(self.name, args, kwargs)
        return JobSpec(
            task=self.name,
            args=tuple(args),
            kwargs=dict(kwargs),
            run_at=run_at,
            idempotency_key=idempotency_key,
            **fields,
        )

    def decode_result(self, value: JSONValue) -> Any:
        """A result of this task's job, read back from its JSON form as the function's
        return annotation says (a ``datetime``, a dataclass...); the JSON form as it is
        when the annotation needs no conversion.

        :raises InvalidJobError: the value does not fit the annotation (a result stored by
            another version of the task, say).
        """
        return plan_for(self.func).decode_result(self.name, value)

    def positional_parameters(self) -> list[str]:
        """The names a job's positional arguments bind to, in order (what the task
        catalog needs to fill a concurrency-key template at the main)."""
        signature = self._signature
        if signature is None:
            return []
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return [p.name for p in signature.parameters.values() if p.kind in kinds]

    def _format_key(
        self,
        template: str,
        args: Sequence[JSONValue],
        kwargs: Mapping[str, JSONValue],
        option: str = "concurrency_key",
    ) -> str:
        """``template`` (the task's ``option``) with ``{name}`` fields filled from this
        job's arguments."""
        if "{" not in template and "}" not in template:
            return template
        values = _bound_arguments(self.func, args, kwargs)
        return fill_key_template(template, self.name, values, option)


def key_template_fields(template: str) -> list[str]:
    """The argument names a concurrency-key ``template`` fills (``{name}``, ``{name.attr}``
    or ``{name[key]}``).

    A field may not carry a conversion (``!r``) or a format spec (``:>400000000``): a
    width in a template declared by a worker would make every enqueue by name allocate
    that many characters at the main, and a key needs neither.

    :raises ValueError: the template is malformed, or a field has a conversion or a spec.
    """
    fields = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if spec or conversion:
            raise ValueError(
                f"field {{{name}}} has a conversion or format spec; a concurrency-key "
                "template fills plain fields only"
            )
        fields.append(name)
    return fields


def fill_key_template(
    template: str, task_name: str, values: Mapping[str, Any], option: str = "concurrency_key"
) -> str:
    """A key ``template`` of task ``task_name`` (its ``option``: ``concurrency_key`` or
    ``rate_key``) filled from a job's arguments by parameter name (``values``). Plain
    fields only (:func:`key_template_fields`), so the key costs no more than the
    arguments' text, whatever the template says.

    :raises InvalidJobError: the template names an argument the job does not give, or
        cannot be formatted with the values given: the job is refused at enqueue, since
        it has no key to be limited or counted by.
    """
    try:
        key_template_fields(template)
        return template.format_map(values)
    except KeyError as exc:
        raise InvalidJobError(
            f"{option} {template!r} of task {task_name!r} needs the argument "
            f"{exc.args[0]!r}, which this job does not give (by keyword or by position)"
        ) from None
    except (IndexError, AttributeError, TypeError, ValueError) as exc:
        raise InvalidJobError(
            f"cannot format {option} {template!r} of task {task_name!r}: {exc}"
        ) from None


def _bound_arguments(
    func: Callable[..., Any], args: Sequence[JSONValue], kwargs: Mapping[str, JSONValue]
) -> dict[str, Any]:
    """The job's arguments by parameter name (defaults applied), as a call would bind them."""
    values: dict[str, Any] = dict(kwargs)
    try:
        signature = inspect.signature(func)
        bound = signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return values  # arguments that do not fit the signature: keyword names only
    bound.apply_defaults()
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            values.update(value)
        else:
            values[name] = value
    return values


def _check_key_template(
    fn: Callable[..., Any], template: str, option: str = "concurrency_key"
) -> None:
    """Refuse, at registration, a key template (the task's ``option``) the function
    cannot fill."""
    try:
        names = key_template_fields(template)
    except ValueError as exc:
        raise ConfigurationError(f"{option} {template!r} is not a valid template: {exc}") from None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name in names:
        base = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not base.isidentifier():
            raise ConfigurationError(
                f"{option} {template!r} must name parameters (e.g. {{account_id}}), "
                f"not positions ({{{name}}})"
            )
        if base not in params and not open_ended:
            raise ConfigurationError(
                f"{option} {template!r} names {base!r}, which is not a parameter "
                f"of {fn.__qualname__}"
            )


def default_unique_key(
    task_name: str, args: Sequence[JSONValue], kwargs: Mapping[str, JSONValue]
) -> str:
    """The unique key of a ``@task(unique=True)`` job: the task name and its arguments.

    ``f"{task_name}:{json}"``, where ``json`` is ``{"args": [...], "kwargs": {...}}``
    compact, with sorted keys and non-ASCII escaped. Keys longer than
    :data:`~broker.jobs.MAX_UNIQUE_KEY_BYTES` become ``f"{task_name}:sha256:{hex}"`` of
    that JSON. ``f(1)`` and ``f(x=1)`` are different keys: arguments are taken as given.
    """
    try:
        text = json.dumps(
            {"args": list(args), "kwargs": dict(kwargs)},
            sort_keys=True,
            separators=(",", ":"),
            allow_nan=False,
        )
    except (TypeError, ValueError) as exc:
        raise InvalidJobError(f"args and kwargs must be JSON-serialisable: {exc}") from exc
    except RecursionError:
        raise InvalidJobError("args and kwargs nest too deeply to be encoded as JSON") from None
    key = f"{task_name}:{text}"
    if len(key.encode("utf-8", "surrogatepass")) <= MAX_UNIQUE_KEY_BYTES:
        return key
    return f"{task_name}:sha256:{hashlib.sha256(text.encode()).hexdigest()}"


class TaskRegistry:
    def __init__(self) -> None:
        self._tasks: dict[str, Task[..., Any]] = {}
        self.hooks = WorkerHooks()
        """The start-up, shutdown and around-job hooks the app declared beside its tasks
        (:mod:`broker.tasks.hooks`)."""

    def add(self, task: Task[..., Any]) -> None:
        existing = self._tasks.get(task.name)
        if existing is not None and existing.func is not task.func:
            raise ConfigurationError(
                f"two functions are registered as task {task.name!r}; give one an explicit name="
            )
        self._tasks[task.name] = task

    def get(self, name: str) -> Task[..., Any]:
        try:
            return self._tasks[name]
        except KeyError:
            raise TaskNotFoundError(
                f"task {name!r} is not registered on this worker; check that its module is "
                "passed with --app and that the name matches the @task registration"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._tasks)

    def __contains__(self, name: object) -> bool:
        return name in self._tasks


def _module_name(fn: Callable[..., Any]) -> str:
    """The importable module path, even for a module run as ``python -m pkg.mod``, whose
    functions say ``__main__``; a worker importing ``pkg.mod`` must find the same name."""
    module = fn.__module__
    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None and spec.name:
            return str(spec.name)
    return module


default_registry = TaskRegistry()
"""The process-wide registry that ``@task`` fills and workers read."""


def _declared_schedule(
    task: Task[..., Any],
    *,
    cron: str | None,
    every: timedelta | None,
    timezone: str | None,
    catch_up: bool | None,
) -> Schedule | None:
    """The schedule ``@task(cron=..., every=..., ...)`` declares, named after the task, with
    the task's job options; ``None`` when the decorator declares none."""
    if cron is None and every is None and timezone is None and catch_up is None:
        return None
    return Schedule(
        name=task.name,
        task=task.name,
        cron=cron,
        every=every,
        timezone=timezone,
        catch_up=True if catch_up is None else catch_up,
        **task_defaults(task),
    )


def task_defaults(task: Task[..., Any]) -> dict[str, Any]:
    """The job options ``task`` gives its jobs, by job field: what its schedule's ticks
    carry and what a worker declares for a job enqueued by name
    (``broker.wire.messages.TASK_DEFAULTS``, less the unique key and the rate key, each
    job's own, made from its arguments)."""
    return {
        "queue": task.queue,
        "priority": task.priority,
        "max_attempts": task.retries + 1,
        "timeout": task.timeout,
        "execution_mode": task.execution_mode,
        "concurrency_key": task.concurrency_key,
        "concurrency_limit": task.concurrency_limit,
    }


@overload
def task(func: Callable[P, R], /) -> Task[P, R]: ...


@overload
def task(
    *,
    name: str | None = None,
    queue: str = DEFAULT_QUEUE,
    priority: int = 0,
    retries: int = DEFAULT_MAX_RETRIES,
    timeout: float | None = None,
    mode: ExecutionMode | str = ExecutionMode.POOLED,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
    registry: TaskRegistry | None = None,
    cron: str | None = None,
    every: timedelta | None = None,
    timezone: str | None = None,
    catch_up: bool | None = None,
    unique: bool = False,
    retry_on: tuple[type[BaseException], ...] | None = None,
    dont_retry_on: tuple[type[BaseException], ...] | None = None,
    backoff: TaskBackoff | None = None,
    max_recoveries: int | None = None,
    local_state: bool = False,
    rate_limit: str | None = None,
    rate_burst: int = 1,
    rate_key: str | None = None,
) -> Callable[[Callable[P, R]], Task[P, R]]: ...


def task(
    func: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    queue: str = DEFAULT_QUEUE,
    priority: int = 0,
    retries: int = DEFAULT_MAX_RETRIES,
    timeout: float | None = None,
    mode: ExecutionMode | str = ExecutionMode.POOLED,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
    registry: TaskRegistry | None = None,
    cron: str | None = None,
    every: timedelta | None = None,
    timezone: str | None = None,
    catch_up: bool | None = None,
    unique: bool = False,
    retry_on: tuple[type[BaseException], ...] | None = None,
    dont_retry_on: tuple[type[BaseException], ...] | None = None,
    backoff: TaskBackoff | None = None,
    max_recoveries: int | None = None,
    local_state: bool = False,
    rate_limit: str | None = None,
    rate_burst: int = 1,
    rate_key: str | None = None,
) -> Task[P, R] | Callable[[Callable[P, R]], Task[P, R]]:
    """Register a function as a task, by default under its ``module.function`` path.

    ``cron`` (with an explicit ``timezone``) or ``every`` also declares a periodic job of
    this task, named after it, in :data:`broker.tasks.schedule.default_schedules`.

    ``concurrency_key`` may name the function's parameters, as in
    ``"sync:{account_id}"``; ``unique=True`` keeps at most one queued or running job per
    task and arguments (see :func:`default_unique_key`).

    ``retries`` is how many runs may follow a failed first one; ``retry_on`` and
    ``dont_retry_on`` (exception classes) narrow which failures use them (see
    :class:`broker.retry.RetryPolicy`). Arguments that do not fit the function are never
    retried. ``backoff`` sets the wait before each retry: an
    :class:`~broker.retry.ExponentialBackoff`, a :class:`~broker.retry.FixedBackoff`, or
    any function of the number of failures returning a ``timedelta`` or seconds (it runs
    in the worker; without one, the main's ``--retry-backoff`` applies).

    ``max_recoveries`` is how many times a job runs again after an attempt was *lost*
    (its worker, child or connection died): counted apart from ``retries``, and without
    backoff (``None``: the main's ``--max-recoveries``, 3 by default). ``local_state=True``
    says the task keeps state on its worker's machine (files, a warm cache) that its next
    attempt wants: a lost attempt's recovery waits for the same worker id first, for the
    main's affinity grace (see ``docs/howto/long-jobs.md``).

    ``rate_limit`` (``"100/s"``, ``"600/m"``, ``"1000/h"``) caps how fast the main
    dispatches this task's jobs, across every worker, with ``rate_burst`` at once after a
    quiet spell; workers declare it with the task (see ``docs/howto/rate-limits.md``).
    With ``rate_key`` (a template naming parameters, as ``"{tenant}"``) the limit holds
    for each key apart: each job's key is filled from its arguments at enqueue, and a
    job whose arguments leave a field of it unfilled is refused there
    (``InvalidJobError``), since it has no key to be limited by.
    """

    def register(fn: Callable[P, R]) -> Task[P, R]:
        if retries < 0:
            raise ConfigurationError(f"retries must be >= 0 (got {retries})")
        if max_recoveries is not None and max_recoveries < 0:
            raise ConfigurationError(f"max_recoveries must be >= 0 (got {max_recoveries})")
        try:
            execution_mode = ExecutionMode(mode)
        except ValueError:
            raise ConfigurationError(f"unknown execution mode {mode!r}") from None
        if concurrency_key is not None:
            _check_key_template(fn, concurrency_key)
        try:
            rate = None if rate_limit is None else parse_rate(rate_limit, rate_burst)
        except ValueError as exc:
            raise ConfigurationError(f"rate_limit: {exc}") from None
        if rate_key is not None:
            if rate is None:
                raise ConfigurationError("rate_key needs a rate_limit (the rate of each key)")
            _check_key_template(fn, rate_key, "rate_key")
        if backoff is not None and not callable(backoff):
            raise ConfigurationError(
                f"backoff must be a function of the number of failures (got {backoff!r})"
            )
        policy = None
        if retry_on is not None or dont_retry_on is not None:
            policy = RetryPolicy(
                retry_on=(Exception,) if retry_on is None else retry_on,
                dont_retry_on=() if dont_retry_on is None else dont_retry_on,
            )
        registered = Task(
            name=name or f"{_module_name(fn)}.{fn.__qualname__}",
            func=fn,
            queue=queue,
            priority=priority,
            retries=retries,
            timeout=timeout,
            execution_mode=execution_mode,
            concurrency_key=concurrency_key,
            concurrency_limit=concurrency_limit,
            unique=unique,
            retry=policy,
            backoff=backoff,
            max_recoveries=max_recoveries,
            local_state=local_state,
            rate_limit=rate,
            rate_key=rate_key,
        )
        periodic = _declared_schedule(
            registered, cron=cron, every=every, timezone=timezone, catch_up=catch_up
        )
        (registry or default_registry).add(registered)
        if periodic is not None:
            default_schedules.add(periodic)
        return registered

    return register(func) if func is not None else register
