"""The application's side: :class:`Client`, :class:`SyncClient`, :func:`configure`, and
enqueueing inside the application's own SQL transaction (:mod:`broker.client.transactional`).
"""

from __future__ import annotations

from broker.client.client import Client as Client
from broker.client.sync import SyncClient as SyncClient
from broker.client.sync import configure as configure

__all__ = ["Client", "SyncClient", "configure"]
