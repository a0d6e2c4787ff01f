"""The task catalog: which tasks the workers serve, and the defaults a job enqueued by name
gets.

A job enqueued by name (``broker enqueue``, or a client without the task module) says
only what its caller said. Each worker declares the tasks it serves, with the defaults
``@task`` gave them (a ``tasks`` message right after ``welcome``), and the main fills
those defaults into every field a request leaves out: a task declared ``retries=0`` runs
once, whoever enqueues it. The catalog lives in the store (``declare_tasks``,
``task_catalog``, ``forget_tasks``), so it outlives the main and the operator's command
reads it with the main down; :class:`Catalog` is the copy in memory, read once and
written through, so an enqueue never waits on it (the enqueue path stays one
transaction).

The rules, all here:

* **Unknown tasks are refused.** A name no worker has ever declared is almost always a
  typo, and its job would wait forever (or fail on every worker): the enqueue raises
  :class:`~broker.exceptions.UnknownTaskError` and stores nothing, unless the request
  allows unknown tasks, for a deliberate cold start (jobs enqueued before the first
  worker of a new task starts). A worker that has gone away still vouches for the name
  for the task grace (``--task-grace``, a week by default), so a fleet that is down for a
  while does not turn enqueues away; after that its declarations are dropped. The rule
  applies once the catalog is in use, that is once any worker has declared its tasks to
  this store: before that (a first start, or workers of a release without catalogs
  during an upgrade) no name can be told from a typo, and refusing every one would stop
  all enqueues by name.
* **A worker's declaration replaces its earlier one, within bounds.** At most
  :data:`~broker.model.bounds.MAX_DECLARED_TASKS` tasks of at most
  :data:`~broker.model.bounds.MAX_DECLARATION_BYTES` each, concurrency-key templates with
  plain fields only, and :data:`~broker.model.bounds.MAX_CATALOG_ENTRIES` in the whole
  catalog: a worker credential cannot grow the main, the store or every start-up read
  without bound. A ``tasks`` message over a bound is refused whole (``over_limit``).
* **The newest declaration wins.** When two workers declare different defaults for one
  name (a rolling deploy, where the new release's workers declare last; or two
  releases side by side), the most recently seen declaration decides, and the main logs
  a warning naming both workers and the fields that differ. Refusing would take the
  whole deploy down for a difference that is usually the deploy itself.
* **Arguments are checked against the declared signature.** A worker declares every
  parameter of the task's function (name, kind, whether it has a default); the main
  binds each job's arguments to the newest declaration and refuses those that cannot
  bind (:class:`~broker.exceptions.InvalidArgumentsError`, ``invalid_arguments``, nothing
  stored), since such a job could only fail at its worker. A task no worker has declared
  yet (a cold start), or declared without a signature (a worker of an earlier release,
  or a function ``inspect`` cannot read), is not checked: there is nothing to check
  against, and the worker still checks every job before it runs it.
* **What a caller says wins.** Only fields the request leaves out take the task's
  defaults. A client that imports the task module sends every field (``task.enqueue``
  builds the whole job), so the catalog changes nothing for it, except refusing a name
  no worker serves.
* **Transactional enqueue does not consult it** (:mod:`broker.client.transactional`): it writes
  in the application's own transaction, without the main, and takes the task object's
  defaults (or, by name, the broker's defaults), as documented there.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

import msgspec

from broker.dependencies import due_args
from broker.exceptions import InvalidArgumentsError, InvalidJobError, UnknownTaskError
from broker.jobs import JobSpec, JSONValue, ParentResults, SpecColumns
from broker.model.bounds import MAX_CATALOG_ENTRIES, MAX_DECLARATION_BYTES, MAX_DECLARED_TASKS
from broker.model.logs import log_event
from broker.retry import ExponentialBackoff, FixedBackoff, TaskBackoff
from broker.storage import TaskRecord
from broker.tasks.registry import (
    Task,
    TaskRegistry,
    default_unique_key,
    fill_key_template,
    key_template_fields,
    task_defaults,
)
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")


# --------------------------------------------------------------------------- worker side


def declaration(task: Task[..., Any]) -> protocol.TaskDeclaration:
    """What a worker declares for ``task``: the defaults its jobs get, its parameters (for
    the main's check of arguments by name), and its retry rules described for operators.

    A declaration whose signature would take it over
    :data:`~broker.model.bounds.MAX_DECLARATION_BYTES` goes without it (its arguments are
    then not checked at the main), rather than have the main refuse the worker's whole
    catalog for a long parameter list."""
    policy = task.retry
    declared = protocol.TaskDeclaration(
        name=task.name,
        **task_defaults(task),
        unique=task.unique,
        parameters=task.positional_parameters(),
        signature=_declared_signature(task),
        retry_on=None if policy is None else _exception_names(policy.retry_on),
        dont_retry_on=[] if policy is None else _exception_names(policy.dont_retry_on),
        backoff=None if task.backoff is None else describe_backoff(task.backoff),
        rate_limit=None if task.rate_limit is None else str(task.rate_limit),
        rate_burst=None if task.rate_limit is None else task.rate_limit.burst,
        rate_key=task.rate_key,
    )
    if len(msgspec.json.encode(declared)) > MAX_DECLARATION_BYTES:
        declared = msgspec.structs.replace(declared, signature=None)
    return declared


_KIND_NAMES: dict[inspect._ParameterKind, protocol.ParameterKind] = {
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}
"""How a declaration names each kind of parameter."""
_KINDS = {name: kind for kind, name in _KIND_NAMES.items()}
"""A declared kind of parameter to the kind (:data:`_KIND_NAMES` read backwards)."""


def _declared_signature(task: Task[..., Any]) -> list[protocol.ParameterDeclaration] | None:
    """Every parameter of ``task``'s function, for the main's check of a job's arguments;
    ``None`` for a function without a signature."""
    try:
        parameters = inspect.signature(task.func).parameters.values()
    except (TypeError, ValueError):
        return None
    return [
        protocol.ParameterDeclaration(
            name=p.name, kind=_KIND_NAMES[p.kind], required=p.default is inspect.Parameter.empty
        )
        for p in parameters
    ]


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


def entry(record: TaskRecord, live: Collection[str] | None) -> dict[str, JSONValue]:
    """A task as one worker declared it, and when: an entry of a ``task_list`` reply and a
    row of ``broker tasks``. ``connected`` says whether that worker is connected now
    (``live``: the worker ids connected to the main that answers), so a reader tells
    the workers serving a task from those that only still vouch for it for the task
    grace; ``None`` when nobody knows (the operator's command reading the store with
    the main down)."""
    return {
        "task": record.task,
        "worker_id": record.worker_id,
        "seen_at": record.seen_at.isoformat(),
        "connected": None if live is None else record.worker_id in live,
        "declaration": record.declaration,
    }


class CatalogLimitError(ValueError):
    """A worker's ``tasks`` message breaks a bound of the catalog (:mod:`broker.model.bounds`):
    nothing of it is recorded, and the main answers ``over_limit``."""


def check_declarations(tasks: Sequence[protocol.TaskDeclaration]) -> None:
    """Refuse declarations over the catalog's bounds: how many a worker declares, the
    bytes of each, and plain fields in a concurrency-key template.

    Cheap by construction: the count is checked before anything is encoded, and encoding
    at most :data:`~broker.model.bounds.MAX_DECLARED_TASKS` declarations is one C call each.

    :raises CatalogLimitError: naming the bound and the task that breaks it.
    """
    if len(tasks) > MAX_DECLARED_TASKS:
        raise CatalogLimitError(
            f"a worker declares at most {MAX_DECLARED_TASKS} tasks, this one declared "
            f"{len(tasks)}; nothing of it is recorded"
        )
    for task in tasks:
        size = len(msgspec.json.encode(task))
        if size > MAX_DECLARATION_BYTES:
            raise CatalogLimitError(
                f"the declaration of task {task.name[:100]!r} is {size} bytes, over "
                f"the limit of {MAX_DECLARATION_BYTES}; nothing of it is recorded"
            )
        for option, template in (
            ("concurrency_key", task.concurrency_key),
            ("rate_key", task.rate_key),
        ):
            if template is None:
                continue
            try:
                key_template_fields(template)
            except ValueError as exc:
                raise CatalogLimitError(
                    f"task {task.name[:100]!r}: {option} "
                    f"{template[:100]!r}: {exc}; nothing of it is recorded"
                ) from None


class Catalog:
    """The main's copy of the store's task catalog: read once, written through, and
    bounded (:data:`~broker.model.bounds.MAX_CATALOG_ENTRIES`).

    :meth:`record` updates the copy at once (an enqueue right after a worker's
    declaration sees it); the caller then stores the same declarations. :meth:`mark_seen`
    and :meth:`drop_gone` are a pass of the task grace. Pure: the reads and writes of the
    store are :class:`broker.main.catalog.StoredCatalog`'s.
    """

    def __init__(self) -> None:
        self._records: dict[str, dict[str, TaskRecord]] = {}
        """Task name to worker id to that worker's last declaration."""
        self._by_worker: dict[str, set[str]] = {}
        """Worker id to the names it declares (its share of :attr:`_records`)."""
        self._entries = 0
        """Declarations held, the sum of :attr:`_by_worker`'s sets."""
        self._declared_at: dict[tuple[str, str], datetime] = {}
        """``(task, worker id)`` to when the worker declared it, which decides the newest
        declaration: a record's ``seen_at`` also moves when a pass of the grace marks a
        connected worker seen, which says nothing about whose declaration is newer."""
        self._newest: dict[str, protocol.TaskDeclaration] = {}
        """Task name to the declaration that decides its defaults (the newest)."""
        self._signatures: dict[str, _Signature] = {}
        """Task name to the newest declaration's signature, where it declared one."""

    def merge(self, records: Sequence[TaskRecord]) -> None:
        """Take the store's ``records`` where they are newer than this copy's, within the
        bound on entries (:data:`~broker.model.bounds.MAX_CATALOG_ENTRIES`)."""
        changed = set()
        for record in records:
            by_worker = self._records.setdefault(record.task, {})
            known = by_worker.get(record.worker_id)
            if known is None:
                if self._entries >= MAX_CATALOG_ENTRIES:
                    continue
                self._entries += 1
                self._by_worker.setdefault(record.worker_id, set()).add(record.task)
            elif known.seen_at >= record.seen_at:
                continue
            by_worker[record.worker_id] = record
            self._declared_at[record.task, record.worker_id] = record.seen_at
            changed.add(record.task)
        for name in changed:
            self._decide(name)
        for name in [name for name, by_worker in self._records.items() if not by_worker]:
            del self._records[name]

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
        """``worker_id`` declared ``tasks`` at ``now``, in place of what it declared before;
        returns them as the store keeps them (for
        :meth:`StoredCatalog.save <broker.main.catalog.StoredCatalog.save>`). A declaration that
        differs from another worker's is logged.

        :raises CatalogLimitError: the declarations break a bound (too many, one too big,
            a template with a format spec, or the catalog is full); nothing changes.
        """
        check_declarations(tasks)
        names = {task.name for task in tasks}
        previous = self._by_worker.get(worker_id, set())
        entries = self._entries - len(previous) + len(names)
        if entries > MAX_CATALOG_ENTRIES:
            raise CatalogLimitError(
                f"the task catalog holds at most {MAX_CATALOG_ENTRIES} declarations (task "
                f"and worker), and these {len(names)} would make {entries}; they are "
                "recorded once workers that have gone are dropped (after the task grace)"
            )
        for name in previous - names:
            self._drop(name, worker_id)
        stored: dict[str, dict[str, Any]] = {}
        for task in tasks:
            as_json = msgspec.to_builtins(task)
            by_worker = self._records.setdefault(task.name, {})
            self._warn_if_different(task.name, worker_id, as_json, by_worker)
            by_worker[worker_id] = TaskRecord(task.name, worker_id, as_json, now)
            self._declared_at[task.name, worker_id] = now
            self._decide(task.name)
            stored[task.name] = as_json
        self._by_worker[worker_id] = names
        self._entries = entries
        return stored

    @staticmethod
    def _warn_if_different(
        name: str, worker_id: str, as_json: dict[str, Any], by_worker: dict[str, TaskRecord]
    ) -> None:
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
                    "workers declare a task with different defaults; the newest declaration wins",
                    task=name,
                    worker_id=worker_id,
                    other_worker_id=other,
                    fields=",".join(differ),
                )
                return

    def mark_seen(self, live: Collection[str], now: datetime) -> None:
        """The workers in ``live`` (connected now) are seen at ``now``.

        A connected worker declares once, when it connects: marking it seen on each pass
        of the task grace lets a main that restarts keep the declarations of the workers
        it had for the grace (less one pass), rather than from when they connected."""
        for worker_id in live:
            for name in self._by_worker.get(worker_id, ()):
                record = self._records[name][worker_id]
                self._records[name][worker_id] = dataclasses.replace(record, seen_at=now)

    def drop_gone(self, live: Collection[str], gone_before: datetime) -> int:
        """Drop the declarations of workers not in ``live`` and not seen since
        ``gone_before``; returns how many were dropped."""
        dropped = 0
        for worker_id, names in list(self._by_worker.items()):
            if worker_id in live:
                continue
            for name in list(names):
                if self._records[name][worker_id].seen_at < gone_before:
                    self._drop(name, worker_id)
                    dropped += 1
        if dropped:
            log_event(
                logger, logging.INFO, "declarations of gone workers dropped", declarations=dropped
            )
        return dropped

    def _drop(self, name: str, worker_id: str) -> None:
        by_worker = self._records[name]
        del by_worker[worker_id]
        del self._declared_at[name, worker_id]
        names = self._by_worker[worker_id]
        names.discard(name)
        if not names:
            del self._by_worker[worker_id]
        self._entries -= 1
        if by_worker:
            self._decide(name)
        else:
            del self._records[name]
            self._newest.pop(name, None)
            self._signatures.pop(name, None)

    def _decide(self, name: str) -> None:
        newest = max(
            self._records[name].values(), key=lambda r: self._declared_at[r.task, r.worker_id]
        )
        try:
            declared = msgspec.convert(newest.declaration, protocol.TaskDeclaration)
            self._newest[name] = declared
            self._signatures.pop(name, None)
            if declared.signature is not None:
                self._signatures[name] = _Signature(declared.signature)
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
        :raises InvalidArgumentsError: the job's arguments cannot bind to the task's
            declared parameters.
        :raises InvalidJobError: the request is invalid, or a concurrency-key template
            of the task names an argument the job does not give.
        """
        declared = self._newest.get(request.task)
        signature = self._signatures.get(request.task)
        if signature is not None:
            # A workflow's step runs with its parents' results in front of its own
            # arguments (placeholders here: only the shape binds).
            parents = [None] * len(request.depends_on)
            args = due_args(ParentResults(request.parent_results), request.args, parents)
            signature.check(request.task, args, request.kwargs)
        return self._with_defaults(request, declared, now, allow_unknown=allow_unknown)

    def job_template(
        self, template: protocol.JobRequest, now: datetime, *, allow_unknown: bool
    ) -> JobTemplate | None:
        """The options of an ``enqueue_each``'s jobs: ``template``'s task and options,
        with its task's defaults where it says nothing, checked once for all; its
        :meth:`JobTemplate.columns` makes the jobs of argument sets, with no
        :class:`~broker.jobs.JobSpec` per job. Decided once per request, so a declaration
        that arrives while its jobs are being written changes none of them.

        ``None`` when the task declares a key made from each job's arguments (a
        concurrency or rate key template, or ``unique``) that ``template`` does not set:
        the jobs' options then differ, and each must go as an ``enqueue`` of its own
        request would (the caller's to do).

        :raises UnknownTaskError: as :meth:`job_spec`.
        :raises InvalidJobError: ``template`` carries arguments of its own, or an option
            that names or links one job.
        """
        if template.args or template.kwargs:
            raise InvalidJobError(
                "an enqueue_each's job carries no args or kwargs: they are its arg_sets "
                "and kwarg_sets"
            )
        declared = self._newest.get(template.task)
        if declared is not None and _keys_per_job(declared, template):
            SpecColumns.check_template(template.to_spec(now))
            return None
        spec = self._with_defaults(template, declared, now, allow_unknown=allow_unknown)
        SpecColumns.check_template(spec)
        return JobTemplate(spec, self._signatures.get(template.task))

    def _with_defaults(
        self,
        request: protocol.JobRequest,
        declared: protocol.TaskDeclaration | None,
        now: datetime,
        *,
        allow_unknown: bool,
    ) -> JobSpec:
        """``request``'s job with its task's defaults (``declared``), or refused as an
        unknown task."""
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


@dataclasses.dataclass(frozen=True, slots=True)
class JobTemplate:
    """An ``enqueue_each``'s options, checked (:meth:`Catalog.job_template`), and the
    task's declared signature then, which each job's arguments must bind to."""

    spec: JobSpec
    signature: _Signature | None

    def columns(
        self,
        arg_sets: Sequence[Sequence[JSONValue]],
        kwarg_sets: Sequence[Mapping[str, JSONValue]] | None,
    ) -> SpecColumns:
        """The jobs of ``arg_sets`` (and ``kwarg_sets``), each with a fresh id.

        :raises InvalidArgumentsError: an argument set cannot bind to the declared
            signature.
        :raises InvalidJobError: an argument set is invalid.
        """
        jobs = SpecColumns.of(self.spec, arg_sets, kwarg_sets)
        signature = self.signature
        if signature is not None:
            # Binding depends on the shape alone (how many positional arguments, which
            # keywords): each distinct one is bound once, with placeholders.
            shapes: set[tuple[int, tuple[str, ...]]]
            if kwarg_sets is None:
                shapes = {(count, ()) for count in set(map(len, jobs.args))}
            else:
                shapes = set(zip(map(len, jobs.args), map(tuple, jobs.kwargs), strict=True))
            for count, names in sorted(shapes):
                signature.check(self.spec.task, (None,) * count, dict.fromkeys(names))
        return jobs


class _Signature:
    """A declared signature, to bind jobs' arguments to; each shape of arguments (how many
    positional ones, which keywords) is bound once, up to :data:`SHAPES_KEPT` shapes per
    task, since binding depends on nothing else."""

    def __init__(self, parameters: Sequence[protocol.ParameterDeclaration]) -> None:
        self._signature: inspect.Signature | None
        try:
            self._signature = inspect.Signature(
                [
                    inspect.Parameter(
                        p.name,
                        _KINDS[p.kind],
                        default=inspect.Parameter.empty if p.required else None,
                    )
                    for p in parameters
                ]
            )
        except (ValueError, TypeError):  # not a signature Python could have made
            self._signature = None
        self._shapes: dict[tuple[int, tuple[str, ...]], str | None] = {}

    def check(self, task: str, args: Sequence[JSONValue], kwargs: dict[str, JSONValue]) -> None:
        """:raises InvalidArgumentsError: ``args`` and ``kwargs`` cannot bind."""
        if self._signature is None:
            return
        shape = (len(args), tuple(kwargs))
        if shape in self._shapes:
            problem = self._shapes[shape]
        else:
            try:
                self._signature.bind(*args, **kwargs)
                problem = None
            except TypeError as exc:
                problem = str(exc)
            if len(self._shapes) < SHAPES_KEPT:
                self._shapes[shape] = problem
        if problem is not None:
            raise InvalidArgumentsError(
                f"the job's arguments do not fit task {task}{self._signature} as its "
                f"workers declare it: {problem}"
            )


SHAPES_KEPT = 64
"""Shapes of arguments (positional count, keywords) a declared signature keeps the
outcome of binding for: by-name enqueues bind each shape once."""


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
    if request.rate_key is None and declared.rate_key is not None and declared.rate_limit:
        defaults["rate_key"] = _format_key(declared, request, declared.rate_key, "rate_key")
    if request.unique_key is None and declared.unique:
        defaults["unique_key"] = default_unique_key(request.task, request.args, request.kwargs)
    return defaults


def _keys_per_job(declared: protocol.TaskDeclaration, request: protocol.JobRequest) -> bool:
    """Whether :func:`_defaults` fills ``request`` with a key made from the job's own
    arguments (a concurrency or rate key template naming one, or ``unique``): then jobs
    of one template but different arguments get different keys."""
    return (
        (request.concurrency_key is None and _templated(declared.concurrency_key))
        or (
            request.rate_key is None and bool(declared.rate_limit) and _templated(declared.rate_key)
        )
        or (request.unique_key is None and declared.unique)
    )


def _templated(template: str | None) -> bool:
    """Whether a declared key ``template`` names fields to fill (else it is the key)."""
    return template is not None and ("{" in template or "}" in template)


def _format_key(
    declared: protocol.TaskDeclaration,
    request: protocol.JobRequest,
    template: str | None = None,
    option: str = "concurrency_key",
) -> str:
    """One of the task's key templates (its concurrency key's unless ``template`` is
    given, with the ``option`` it is named by) filled from the job's arguments,
    positional ones named by the declared parameters (as ``Task`` fills it, except that
    a parameter the job leaves to the function's default cannot be named here: such a
    job is refused, ``InvalidJobError``)."""
    template = (declared.concurrency_key or "") if template is None else template
    if not _templated(template):
        return template
    values = {**dict(zip(declared.parameters, request.args, strict=False)), **request.kwargs}
    return fill_key_template(template, declared.name, values, option)
