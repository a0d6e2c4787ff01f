"""broker-worker: the shell around :mod:`broker.core.worker_state`, the runners it drives and
its state directory. ``broker.worker.Worker`` is the documented path.
"""

from __future__ import annotations

from broker.worker.worker import Worker as Worker

__all__ = ["Worker"]
