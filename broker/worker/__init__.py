"""broker-worker: the shell around :mod:`broker.core.worker_state`, the runners it drives and
its state directory. ``broker.worker.Worker`` is the documented path; it loads on first
use, so importing :mod:`broker.worker.settings` (the worker's flags) does not load the worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.model.lazy import lazy_exports

if TYPE_CHECKING:
    from broker.worker.worker import Worker as Worker

__getattr__ = lazy_exports(globals(), {"Worker": "broker.worker.worker"})

__all__ = ["Worker"]
