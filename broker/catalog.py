"""The task catalog: which tasks the workers serve, and the defaults a job enqueued by name
gets.

A job enqueued by name (``broker enqueue``, or a client without the task module) says
only what its caller said. Each worker declares the tasks it serves, with the defaults
``@task`` gave them (a ``tasks`` message right after ``welcome``), and the main fills
those defaults into every field a request leaves out: a task declared ``retries=0`` runs
once, whoever enqueues it. The catalog lives in the store (``declare_tasks``,
``task_catalog``), so it outlives the main and the operator's command reads it with the
main down; :class:`Catalog` is the copy in memory, read once and written through, so an
enqueue never waits on it (the enqueue path stays one transaction).

The rules, all here:

* **Unknown tasks are refused.** A name no worker has ever declared is almost always a
  typo, and its job would wait forever (or fail on every worker): the enqueue raises
  :class:`~broker.exceptions.UnknownTaskError` and stores nothing, unless the request
  allows unknown tasks, for a deliberate cold start (jobs enqueued before the first
  worker of a new task starts). "Ever": a worker that has gone away still vouches for
  the name. The rule applies once the catalog is in use, that is once any worker has
  declared its tasks to this store: before that (a first start, or workers of a release
  without catalogs during an upgrade) no name can be told from a typo, and refusing
  every one would stop all enqueues by name.
* **The newest declaration wins.** When two workers declare different defaults for one
  name (a rolling deploy, where the new release's workers declare last; or two
  releases side by side), the most recently seen declaration decides, and the main logs
  a warning naming both workers and the fields that differ. Refusing would take the
  whole deploy down for a difference that is usually the deploy itself.
* **What a caller says wins.** Only fields the request leaves out take the task's
  defaults. A client that imports the task module sends every field (``task.enqueue``
  builds the whole job), so the catalog changes nothing for it, except refusing a name
  no worker serves.
* **Transactional enqueue does not consult it** (:mod:`broker.transactional`): it writes
  in the application's own transaction, without the main, and takes the task object's
  defaults (or, by name, the broker's defaults), as documented there.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

import msgspec

from broker import protocol
from broker.exceptions import UnknownTaskError
from broker.jobs import JobSpec, JSONValue
from broker.logs import log_event
from broker.retry import ExponentialBackoff, FixedBackoff, TaskBackoff
from broker.storage import StorageAdapter, TaskRecord
from broker.tasks import Task, TaskRegistry, default_unique_key, fill_key_template

logger = logging.getLogger("broker.main")


# --------------------------------------------------------------------------- worker side


def declaration(task: Task[..., Any]) -> protocol.TaskDeclaration:
    """What a worker declares for ``task``: the defaults its jobs get, and its retry rules
    described for operators."""
    policy = task.retry
    return protocol.TaskDeclaration(
        name=task.name,
        execution_mode=task.execution_mode,
        queue=task.queue,
        priority=task.priority,
        max_attempts=task.retries + 1,
        timeout=task.timeout,
        concurrency_key=task.concurrency_key,
        concurrency_limit=task.concurrency_limit,
        unique=task.unique,
        parameters=task.positional_parameters(),
        retry_on=None if policy is None else _exception_names(policy.retry_on),
        dont_retry_on=[] if policy is None else _exception_names(policy.dont_retry_on),
        backoff=None if task.backoff is None else describe_backoff(task.backoff),
    )


def declarations(registry: TaskRegistry) -> list[protocol.TaskDeclaration]:
    """Every task of ``registry``, as a worker serving it declares them."""
    return [declaration(registry.get(name)) for name in registry.names()]


def _exception_names(types: Collection[type[BaseException]]) -> list[str]:
    return [t.__qualname__ if t.__module__ == "builtins" else _dotted(t) for t in types]


def _dotted(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def describe_backoff(backoff: TaskBackoff) -> str:
    """A backoff as ``broker tasks`` shows it: the built-in ones with their numbers, a
    function by its dotted name."""
    if isinstance(backoff, ExponentialBackoff):
        jitter = ", jittered" if backoff.jitter else ""
        return f"exponential {backoff.base:g}s x{backoff.factor:g} up to {backoff.cap:g}s{jitter}"
    if isinstance(backoff, FixedBackoff):
        return f"fixed {backoff.seconds:g}s"
    if hasattr(backoff, "__qualname__"):
        return _dotted(backoff)
    return type(backoff).__qualname__


# --------------------------------------------------------------------------- main side


def entry(record: TaskRecord) -> dict[str, JSONValue]:
    """A task as one worker declared it, and when: an entry of a ``task_list`` reply and a
    row of ``broker tasks``."""
    return {
        "task": record.task,
        "worker_id": record.worker_id,
        "seen_at": record.seen_at.isoformat(),
        "declaration": record.declaration,
    }


class Catalog:
    """The main's copy of the store's task catalog: read once, written through.

    :meth:`record` updates the copy at once (an enqueue right after a worker's
    declaration sees it); the caller then stores the same declarations with
    :meth:`save`.
    """

    def __init__(self, store: StorageAdapter) -> None:
        self._store = store
        self._records: dict[str, dict[str, TaskRecord]] = {}
        """Task name to worker id to that worker's last declaration."""
        self._newest: dict[str, protocol.TaskDeclaration] = {}
        """Task name to the declaration that decides its defaults (the newest)."""
        self._loaded = False

    async def load(self) -> None:
        """Read the catalog from the store, the first time only."""
        if not self._loaded:
            await self.refresh()

    async def refresh(self) -> None:
        """Read the catalog from the store again: before refusing a name this copy does
        not know, in case another process (a second main, the operator's command on the
        store) recorded it. Only declarations newer than this copy's replace them."""
        for record in await self._store.task_catalog():
            by_worker = self._records.setdefault(record.task, {})
            known = by_worker.get(record.worker_id)
            if known is None or known.seen_at < record.seen_at:
                by_worker[record.worker_id] = record
        for name in self._records:
            self._decide(name)
        self._loaded = True

    @property
    def in_use(self) -> bool:
        """Some worker has declared its tasks: from then on unknown names are refused."""
        return bool(self._newest)

    def declared(self, name: str) -> protocol.TaskDeclaration | None:
        """The declaration that decides ``name``'s defaults; ``None``: never declared."""
        return self._newest.get(name)

    def records(self) -> list[TaskRecord]:
        """Every task and worker that declared it, by task then worker id."""
        return [
            self._records[name][worker]
            for name in sorted(self._records)
            for worker in sorted(self._records[name])
        ]

    def record(
        self, worker_id: str, tasks: Sequence[protocol.TaskDeclaration], now: datetime
    ) -> dict[str, dict[str, Any]]:
        """``worker_id`` declared ``tasks`` at ``now``; returns them as the store keeps them
        (for :meth:`save`). A declaration that differs from another worker's is logged."""
        stored: dict[str, dict[str, Any]] = {}
        for task in tasks:
            as_json = msgspec.to_builtins(task)
            by_worker = self._records.setdefault(task.name, {})
            for other, record in by_worker.items():
                if other != worker_id and record.declaration != as_json:
                    differ = sorted(
                        key
                        for key in {*as_json, *record.declaration}
                        if as_json.get(key) != record.declaration.get(key)
                    )
                    log_event(
                        logger,
                        logging.WARNING,
                        "workers declare a task with different defaults; the newest "
                        "declaration wins",
                        task=task.name,
                        worker_id=worker_id,
                        other_worker_id=other,
                        fields=",".join(differ),
                    )
                    break
            by_worker[worker_id] = TaskRecord(task.name, worker_id, as_json, now)
            self._decide(task.name)
            stored[task.name] = as_json
        return stored

    async def save(
        self, worker_id: str, declared: Mapping[str, Mapping[str, Any]], now: datetime
    ) -> None:
        """Write what :meth:`record` returned through to the store."""
        await self._store.declare_tasks(worker_id, declared, now)

    def _decide(self, name: str) -> None:
        newest = max(self._records[name].values(), key=lambda r: r.seen_at)
        try:
            self._newest[name] = msgspec.convert(newest.declaration, protocol.TaskDeclaration)
        except (msgspec.ValidationError, ValueError) as exc:
            log_event(
                logger,
                logging.WARNING,
                "task declaration unreadable, ignored",
                task=name,
                worker_id=newest.worker_id,
                error=exc,
            )

    def job_spec(
        self, request: protocol.JobRequest, now: datetime, *, allow_unknown: bool
    ) -> JobSpec:
        """The job ``request`` asks for, with its task's defaults where it says nothing.

        :raises UnknownTaskError: no worker has declared the task while others have (the
            catalog is in use), and unknown tasks are not allowed.
        :raises InvalidJobError: the request is invalid, or a concurrency-key template
            of the task names an argument the job does not give.
        """
        declared = self._newest.get(request.task)
        if declared is None:
            if not allow_unknown and self.in_use:
                raise UnknownTaskError(
                    f"no worker has declared task {request.task!r}: check the name "
                    "(`broker tasks` lists the declared ones) and start a worker that "
                    "serves it; to enqueue it anyway (a cold start), pass "
                    "--allow-unknown-task to `broker enqueue`, or "
                    "Client(allow_unknown_tasks=True)"
                )
            return request.to_spec(now)
        return request.to_spec(now, _defaults(declared, request))


def _defaults(declared: protocol.TaskDeclaration, request: protocol.JobRequest) -> dict[str, Any]:
    """The task's defaults for the fields ``request`` leaves out."""
    defaults: dict[str, Any] = {
        "queue": declared.queue,
        "priority": declared.priority,
        "max_attempts": declared.max_attempts,
        "timeout": declared.timeout,
        "execution_mode": declared.execution_mode,
    }
    if request.concurrency_key is None and declared.concurrency_key is not None:
        defaults["concurrency_key"] = _format_key(declared, request)
        defaults["concurrency_limit"] = declared.concurrency_limit
    if request.unique_key is None and declared.unique:
        defaults["unique_key"] = default_unique_key(request.task, request.args, request.kwargs)
    return defaults


def _format_key(declared: protocol.TaskDeclaration, request: protocol.JobRequest) -> str:
    """The task's concurrency-key template filled from the job's arguments, positional
    ones named by the declared parameters (as ``Task`` fills it, except that a parameter
    the job leaves to the function's default cannot be named here)."""
    template = declared.concurrency_key or ""
    if "{" not in template and "}" not in template:
        return template
    values = {**dict(zip(declared.parameters, request.args, strict=False)), **request.kwargs}
    return fill_key_template(template, declared.name, values)
