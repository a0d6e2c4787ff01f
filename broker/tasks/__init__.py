"""Declaring and running a task: the registry and ``@task``, schedules and their triggers, the
job context and the runner contract. Applications, the worker, runners and the scheduler import
it; it imports only the foundation.

The names below load on first use, as in :mod:`broker`: a runner child imports
:mod:`broker.tasks.runner` at start, and must not pay for the registry and the cron library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.tasks.registry import (
        Enqueued,
        Task,
        TaskCall,
        TaskRegistry,
        default_registry,
        task,
    )

_PUBLIC = ("Enqueued", "Task", "TaskCall", "TaskRegistry", "default_registry", "task")


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'broker.tasks' has no attribute {name!r}")
    value = getattr(importlib.import_module("broker.tasks.registry"), name)
    globals()[name] = value
    return value


__all__ = ["Enqueued", "Task", "TaskCall", "TaskRegistry", "default_registry", "task"]
