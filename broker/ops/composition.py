"""The composition root: the one place that wires adapters and runners into the core.

Everything else in ``broker`` depends on the storage and runner *interfaces* only;
the import-layering contract (see ``pyproject.toml``) lets this module alone reach
into the ``adapters`` and ``runners`` packages.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Unpack, cast

import adapters
from adapters import DEFAULT_HOT_POOL_SIZE as DEFAULT_HOT_POOL_SIZE
from adapters import DEFAULT_POOL_SIZE as DEFAULT_POOL_SIZE
from broker.exceptions import ConfigurationError
from broker.jobs import ExecutionMode
from broker.storage import StorageAdapter, contract_gaps
from broker.tasks.registry import TaskRegistry
from broker.tasks.runner import Runner
from broker.tasks.runner_options import RunnerOptions as RunnerOptions
from runners.forked import ForkedRunner
from runners.inline import InlineRunner
from runners.pooled import PooledRunner


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
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
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
