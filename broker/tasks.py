"""Task registration: the allow-list of what a worker may run.

A job names its task by string, and that string comes over the network. The
worker looks it up here and nowhere else: nothing is ever imported by a name
that arrived on the wire (the RQ ``import_attribute`` hole). Tasks are registered
by importing the app's own modules, which the operator names on the command line.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, ParamSpec, TypeVar, overload

from broker.exceptions import ConfigurationError, TaskNotFoundError
from broker.jobs import DEFAULT_MAX_RETRIES, DEFAULT_QUEUE, ExecutionMode, JobSpec, JSONValue

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Task(Generic[P, R]):
    """A registered function plus the defaults its jobs get."""

    name: str
    func: Callable[P, R]
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    retries: int = DEFAULT_MAX_RETRIES
    timeout: float | None = None
    execution_mode: ExecutionMode = ExecutionMode.POOLED
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.func)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Calling the task runs the function here and now, as a plain call would."""
        return self.func(*args, **kwargs)

    def spec(
        self,
        args: Sequence[JSONValue] = (),
        kwargs: Mapping[str, JSONValue] | None = None,
        *,
        run_at: datetime | None = None,
        idempotency_key: str | None = None,
        **overrides: Any,
    ) -> JobSpec:
        """A job for this task with the task's defaults, any of which may be overridden."""
        fields: dict[str, Any] = {
            "queue": self.queue,
            "priority": self.priority,
            "max_attempts": self.retries + 1,
            "timeout": self.timeout,
            "execution_mode": self.execution_mode,
            "concurrency_key": self.concurrency_key,
            "concurrency_limit": self.concurrency_limit,
        }
        if "retries" in overrides:
            overrides["max_attempts"] = int(overrides.pop("retries")) + 1
        fields.update(overrides)
        return JobSpec(
            task=self.name,
            args=tuple(args),
            kwargs=dict(kwargs or {}),
            run_at=run_at,
            idempotency_key=idempotency_key,
            **fields,
        )


class TaskRegistry:
    def __init__(self) -> None:
        self._tasks: dict[str, Task[..., Any]] = {}

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
) -> Task[P, R] | Callable[[Callable[P, R]], Task[P, R]]:
    """Register a function as a task, by default under its ``module.function`` path."""

    def register(fn: Callable[P, R]) -> Task[P, R]:
        if retries < 0:
            raise ConfigurationError(f"retries must be >= 0 (got {retries})")
        try:
            execution_mode = ExecutionMode(mode)
        except ValueError:
            raise ConfigurationError(f"unknown execution mode {mode!r}") from None
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
        )
        (registry or default_registry).add(registered)
        return registered

    return register(func) if func is not None else register
