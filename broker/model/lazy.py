"""A package's public names loaded on first use (PEP 562).

Every process that imports any part of a package runs its ``__init__``: a package that
re-exported its heavy modules made ``broker.main.settings`` (which ``broker-worker`` and
``broker`` need for their flags) load the whole main, and a pooled child or the
operator's ``broker status`` paid for modules it never runs. Such a package names its
exports under ``TYPE_CHECKING`` (for mypy and readers) and loads them here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a module path) and returns
    its ``name``, kept in ``namespace`` so the next look-up is an ordinary global."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
