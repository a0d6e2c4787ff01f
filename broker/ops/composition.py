"""The composition root: the one place that wires adapters and runners into the core.

Everything else in ``broker`` depends on the storage and runner *interfaces* only;
the import-layering contract (see ``pyproject.toml``) lets this module alone reach
into the ``adapters`` and ``runners`` packages.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Unpack, cast

import adapters
from adapters import DEFAULT_HOT_POOL_SIZE as DEFAULT_HOT_POOL_SIZE
from adapters import DEFAULT_POOL_SIZE as DEFAULT_POOL_SIZE
from broker.exceptions import ConfigurationError
from broker.jobs import ExecutionMode
from broker.storage import StorageAdapter, contract_gaps
from broker.tasks.runner_options import RunnerOptions as RunnerOptions

if TYPE_CHECKING:
    from broker.tasks.registry import TaskRegistry
    from broker.tasks.runner import Runner


class ImportFailure(ConfigurationError):
    """A module the operator named (``--app``, ``--schedules``, ``--adapter``) raised as it
    was imported. Its traceback, from the module's own frames down, is what the operator
    needs to fix it: the commands print it once, below the error, instead of the
    exception's repr as a message and again as its cause."""

    def __init__(self, message: str, error: BaseException) -> None:
        super().__init__(message)
        self.traceback = _module_traceback(error)


def _module_traceback(error: BaseException) -> str:
    """``error``'s traceback without the frames of the import machinery and of
    :func:`import_named`; just the exception when no frame is left (a module
    that does not exist)."""
    frames = traceback.extract_tb(error.__traceback__)
    while frames and (
        frames[0].filename == __file__
        or frames[0].filename.startswith("<frozen ")
        or frames[0].filename == importlib.__file__
    ):
        frames.pop(0)
    shown = traceback.format_exception_only(type(error), error)
    if frames:
        shown = ["Traceback (most recent call last):\n", *frames.format(), *shown]
    return "".join(shown).rstrip("\n")


def import_named(name: str, named_by: str) -> ModuleType:
    """Import the module ``name`` that the operator named with ``named_by`` (a flag);
    whatever it raises becomes an :class:`ImportFailure` carrying its traceback."""
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise ImportFailure(f"cannot import {name!r} (named by {named_by})", exc) from None


def open_store(
    url: str, adapter: str | None = None, **options: Unpack[adapters.StoreOptions]
) -> StorageAdapter:
    """The store for ``url``, or the custom adapter ``module:factory`` called with ``url``.

    ``options`` (``create``, ``read_only``, the pool sizes, ``single_main``,
    ``offload_threshold``) are passed to the built-in adapters (see
    :func:`adapters.open_store`); a custom factory is called with the URL alone. A
    custom adapter that lacks part of the contract is refused here, naming what it lacks.
    """
    if adapter is None:
        return adapters.open_store(url, **options)
    module_name, _, attr = adapter.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(
            f"--adapter must look like 'package.module:factory' (got {adapter!r})"
        )
    module = import_named(module_name, f"--adapter {adapter}")
    try:
        factory = getattr(module, attr)
    except AttributeError as exc:
        raise ConfigurationError(f"cannot load adapter factory {adapter!r}: {exc}") from exc
    store = cast(Callable[[str], object], factory)(url)
    gaps = contract_gaps(store)
    if gaps:
        raise ConfigurationError(
            f"the adapter from {adapter!r} ({type(store).__name__}) does not implement the "
            f"storage contract; it lacks: {', '.join(gaps)} (see docs/adapters.md)"
        )
    return cast(StorageAdapter, store)


def build_runners(options: RunnerOptions, registry: TaskRegistry) -> dict[ExecutionMode, Runner]:
    """The runners a worker serves; a mode with no runner is never sent to this worker.

    Every option is checked here, before any process starts, so a bad value fails the
    worker at once with a message naming it.
    """
    # The runners' modules (processes, pipes, the child's protocol) are the worker's
    # alone: ``broker-main`` and the ``broker`` command import this module for the store.
    from runners.forked import ForkedRunner
    from runners.inline import InlineRunner
    from runners.pooled import PooledRunner

    options.validate()
    built: dict[ExecutionMode, Runner] = {}
    if options.inline_concurrency > 0:
        built[ExecutionMode.INLINE] = InlineRunner(
            registry=registry,
            concurrency=options.inline_concurrency,
            default_timeout=options.default_timeout,
        )
    if options.pooled_runner_count > 0:
        built[ExecutionMode.POOLED] = PooledRunner(
            options.apps,
            registry=registry,
            count=options.pooled_runner_count,
            concurrency=options.pooled_runner_concurrency,
            max_jobs=options.pooled_max_jobs,
            max_rss_bytes=options.pooled_max_rss_bytes,
            max_lifetime=options.pooled_max_lifetime,
            default_timeout=options.default_timeout,
            kill_grace=options.kill_grace,
            startup_timeout=options.startup_timeout,
        )
    if options.forked_concurrency > 0:
        built[ExecutionMode.FORKED] = ForkedRunner(
            options.apps,
            registry=registry,
            concurrency=options.forked_concurrency,
            default_timeout=options.default_timeout,
            kill_grace=options.kill_grace,
            startup_timeout=options.startup_timeout,
        )
    return built
