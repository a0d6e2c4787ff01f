"""The documented path of ``open_store`` (``--adapter package.module:factory`` is resolved
there); the composition root itself is :mod:`broker.ops.composition`."""

from __future__ import annotations

from broker.ops.composition import open_store as open_store

__all__ = ["open_store"]
