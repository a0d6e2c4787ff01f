"""Worker hooks: start-up and shutdown per process, and middleware around every job.

Declared in the app module beside its tasks (``@broker.on_startup``,
``@broker.on_shutdown``, ``broker.add_middleware(...)``), because every process that runs
jobs imports that module and then runs what it declared: the worker for inline jobs, and
each pooled or forked child for its own (see ``docs/howto/hooks.md``). Kept on the
:class:`~broker.tasks.registry.TaskRegistry` the tasks are on, so a test's own registry
carries its own hooks.

The rules, one place for every mode:

* start-up hooks run in declaration order, before the process takes its first job (a
  child says ready only after them, so they count against the runner start-up timeout,
  never against a job's timeout); the first that raises stops the rest and the process
  serves nothing (:class:`StartupHookFailed`);
* shutdown hooks run in reverse declaration order when the process ends cleanly; one that
  raises is logged and the others still run;
* middleware wraps each job like layers of an onion: ``before`` in declaration order,
  then the task, then ``after`` in reverse order. ``on_failure`` of a middleware runs
  when anything inside its layer raised (an inner middleware, the task, or its own
  ``after``), innermost first; a middleware whose ``before`` raised gets no ``on_failure``
  (its layer was never entered). A hook's exception fails the job as the task's own
  would, with a note naming the hook.

Every hook may be a plain or an ``async`` function, as tasks may.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar, overload

from broker.exceptions import ConfigurationError

if TYPE_CHECKING:
    from broker.tasks.context import JobContext
    from broker.tasks.registry import TaskRegistry

logger = logging.getLogger("broker.hooks")

R = TypeVar("R")
ProcessHook = Callable[[], object]
"""A start-up or shutdown hook: no arguments; plain, or ``async`` (then awaited)."""
H = TypeVar("H", bound=ProcessHook)


class JobMiddleware:
    """Code around every job of this process. Override any of the three; each may be a
    plain method or an ``async`` one, and gets the running job's
    :class:`~broker.tasks.context.JobContext` (the one :func:`broker.current_job` returns).

    For an async task every hook runs on the event loop in the task's own context, so a
    ``contextvars.ContextVar`` set in ``before`` is seen by the task. For a sync task a
    plain hook runs in the task's thread, in its context too; an ``async`` hook of a sync
    task runs on the event loop, outside it (what it sets there the task does not see).
    """

    def before(self, job: JobContext) -> object:
        """Runs before the task; raising here fails the job without running it."""
        return None

    def after(self, job: JobContext, result: object) -> object:
        """Runs after the task returned ``result``; raising here fails the job."""
        return None

    def on_failure(self, job: JobContext, error: BaseException) -> object:
        """Runs when the task, an inner middleware or this one's ``after`` raised
        ``error`` (a :class:`broker.Reschedule` and an inline job's cancellation too). The
        job fails with ``error`` whatever this returns; raising here only adds a note."""
        return None


class StartupHookFailed(ConfigurationError):
    """A start-up hook raised: this process serves no job (a child reports it as its
    start-up error, the worker fails to start)."""

    def __init__(self, hook: str, error: BaseException) -> None:
        shown = "".join(traceback.format_exception_only(error)).strip()
        super().__init__(f"start-up hook {hook} raised {shown}")
        self.hook = hook


def hook_name(hook: object) -> str:
    """How an error names a hook: ``module.qualname`` of the function or the middleware's
    class, so the operator finds it in the app's code."""
    target = hook if callable(hook) and not isinstance(hook, JobMiddleware) else type(hook)
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or repr(target)
    return f"{module}.{qualname}"


async def _call(hook: Callable[..., object], *args: object) -> object:
    result = hook(*args)
    if inspect.isawaitable(result):
        return await result
    return result


async def _awaited(awaitable: Awaitable[R]) -> R:
    return await awaitable


def _call_blocking(
    loop: asyncio.AbstractEventLoop, hook: Callable[..., object], *args: object
) -> object:
    """A hook called from a sync job's thread: an ``async`` one runs on ``loop`` (its
    resources, made at start-up, belong to that loop) while the thread waits."""
    result = hook(*args)
    if inspect.isawaitable(result):
        return asyncio.run_coroutine_threadsafe(_awaited(result), loop).result()
    return result


def _named(error: BaseException, middleware: JobMiddleware, method: str) -> None:
    error.add_note(f"(raised by around-job hook {hook_name(middleware)}.{method})")


def _failure_note(error: BaseException, middleware: JobMiddleware, hook_error: Exception) -> None:
    shown = "".join(traceback.format_exception_only(hook_error)).strip()
    error.add_note(f"(around-job hook {hook_name(middleware)}.on_failure also raised {shown})")
    logger.error("around-job hook on_failure raised", exc_info=hook_error)


class WorkerHooks:
    """The hooks one registry's app declared (see the module docstring for the rules)."""

    def __init__(self) -> None:
        self.startup: list[ProcessHook] = []
        self.shutdown: list[ProcessHook] = []
        self.middleware: list[JobMiddleware] = []

    async def start(self) -> None:
        """Run the start-up hooks in order.

        :raises StartupHookFailed: naming the first hook that raised (the rest do not run).
        """
        for hook in self.startup:
            try:
                await _call(hook)
            except Exception as exc:
                raise StartupHookFailed(hook_name(hook), exc) from exc

    async def stop(self) -> None:
        """Run the shutdown hooks in reverse order; one that raises is logged, and the
        rest still run (each releases its own resource)."""
        for hook in reversed(self.shutdown):
            try:
                await _call(hook)
            except Exception:
                logger.exception("shutdown hook %s raised", hook_name(hook))

    async def around_async(self, job: JobContext, work: Coroutine[Any, Any, R]) -> R:
        """Run the async task's coroutine ``work`` inside the middleware layers."""
        try:
            return await self._layer_async(0, job, work)
        finally:
            if inspect.getcoroutinestate(work) == inspect.CORO_CREATED:
                work.close()  # a before hook failed: the task never started

    async def _layer_async(self, depth: int, job: JobContext, work: Coroutine[Any, Any, R]) -> R:
        if depth == len(self.middleware):
            return await work
        middleware = self.middleware[depth]
        try:
            await _call(middleware.before, job)
        except BaseException as exc:
            _named(exc, middleware, "before")
            raise
        try:
            result = await self._layer_async(depth + 1, job, work)
            try:
                await _call(middleware.after, job, result)
            except BaseException as exc:
                _named(exc, middleware, "after")
                raise
        except BaseException as exc:
            try:
                await _call(middleware.on_failure, job, exc)
            except Exception as hook_error:
                _failure_note(exc, middleware, hook_error)
            raise
        return result

    def around_sync(
        self, job: JobContext, loop: asyncio.AbstractEventLoop, work: Callable[[], R]
    ) -> R:
        """Run the sync task ``work`` inside the middleware layers, in its own thread."""
        return self._layer_sync(0, job, loop, work)

    def _layer_sync(
        self, depth: int, job: JobContext, loop: asyncio.AbstractEventLoop, work: Callable[[], R]
    ) -> R:
        if depth == len(self.middleware):
            return work()
        middleware = self.middleware[depth]
        try:
            _call_blocking(loop, middleware.before, job)
        except BaseException as exc:
            _named(exc, middleware, "before")
            raise
        try:
            result = self._layer_sync(depth + 1, job, loop, work)
            try:
                _call_blocking(loop, middleware.after, job, result)
            except BaseException as exc:
                _named(exc, middleware, "after")
                raise
        except BaseException as exc:
            try:
                _call_blocking(loop, middleware.on_failure, job, exc)
            except Exception as hook_error:
                _failure_note(exc, middleware, hook_error)
            raise
        return result


def _hooks_of(registry: TaskRegistry | None) -> WorkerHooks:
    if registry is None:
        # Here, not at the top: the registry module holds a WorkerHooks per registry.
        from broker.tasks.registry import default_registry

        registry = default_registry
    return registry.hooks


def _process_hook(kind: str, func: H | None, registry: TaskRegistry | None) -> H | Callable[[H], H]:
    def register(hook: H) -> H:
        if not callable(hook):
            raise ConfigurationError(f"a {kind} hook must be a function (got {hook!r})")
        hooks = _hooks_of(registry)
        declared = hooks.startup if kind == "startup" else hooks.shutdown
        if hook not in declared:  # a module imported twice declares each hook once
            declared.append(hook)
        return hook

    return register(func) if func is not None else register


@overload
def on_startup(func: H, /) -> H: ...


@overload
def on_startup(*, registry: TaskRegistry | None = None) -> Callable[[H], H]: ...


def on_startup(
    func: H | None = None, /, *, registry: TaskRegistry | None = None
) -> H | Callable[[H], H]:
    """Declare a start-up hook: a function of no arguments (plain or ``async``) that every
    process running this app's jobs calls once before its first job (each pooled or
    forked child, and the worker itself when it runs inline jobs). What it makes (a
    connection pool, a warm cache) goes in the module's own globals, which that process's
    jobs then read. Use as ``@on_startup`` or ``@on_startup(registry=...)``."""
    return _process_hook("startup", func, registry)


@overload
def on_shutdown(func: H, /) -> H: ...


@overload
def on_shutdown(*, registry: TaskRegistry | None = None) -> Callable[[H], H]: ...


def on_shutdown(
    func: H | None = None, /, *, registry: TaskRegistry | None = None
) -> H | Callable[[H], H]:
    """Declare a shutdown hook: runs once when a process that ran the start-up hooks ends
    cleanly (a pooled child retired or stopped, a forked child after its job, the worker
    at its exit), in reverse declaration order. A process that is killed (a job's
    timeout, a cancel) runs none."""
    return _process_hook("shutdown", func, registry)


def add_middleware(middleware: JobMiddleware, *, registry: TaskRegistry | None = None) -> None:
    """Wrap every job of this app in ``middleware`` (a :class:`JobMiddleware`); the first
    added is the outermost layer."""
    if not isinstance(middleware, JobMiddleware):
        raise ConfigurationError(
            f"middleware must be a broker.JobMiddleware instance (got {middleware!r})"
        )
    hooks = _hooks_of(registry)
    if middleware not in hooks.middleware:
        hooks.middleware.append(middleware)


__all__ = [
    "JobMiddleware",
    "StartupHookFailed",
    "WorkerHooks",
    "add_middleware",
    "on_shutdown",
    "on_startup",
]
