"""The composition root: the one place that wires adapters and runners into the core.

Everything else in ``broker`` depends on the storage and runner *interfaces* only;
the import-layering contract (see ``pyproject.toml``) lets this module alone reach
into the ``adapters`` and ``runners`` packages.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import adapters
from broker.exceptions import ConfigurationError
from broker.jobs import ExecutionMode
from broker.runner import Runner
from broker.storage import StorageAdapter
from broker.tasks import TaskRegistry
from runners.inline import InlineRunner


def open_store(url: str, adapter: str | None = None) -> StorageAdapter:
    """The store for ``url``, or the custom adapter ``module:factory`` called with ``url``."""
    if adapter is None:
        return adapters.open_store(url)
    module_name, _, attr = adapter.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(
            f"--adapter must look like 'package.module:factory' (got {adapter!r})"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load adapter factory {adapter!r}: {exc}") from exc
    return cast(StorageAdapter, cast(Callable[[str], object], factory)(url))


@dataclass(frozen=True)
class RunnerOptions:
    inline_concurrency: int = 4
    default_timeout: float | None = None

    def validate(self) -> None:
        if self.inline_concurrency < 0:
            raise ConfigurationError("inline concurrency must be zero (off) or a positive integer")
        if self.default_timeout is not None and self.default_timeout <= 0:
            raise ConfigurationError("the default job timeout must be a positive number of seconds")


def build_runners(options: RunnerOptions, registry: TaskRegistry) -> dict[ExecutionMode, Runner]:
    """The runners a worker serves; a mode with no runner is never sent to this worker."""
    options.validate()
    built: dict[ExecutionMode, Runner] = {}
    if options.inline_concurrency > 0:
        built[ExecutionMode.INLINE] = InlineRunner(
            registry=registry,
            concurrency=options.inline_concurrency,
            default_timeout=options.default_timeout,
        )
    return built
