"""The application's side: :class:`Client`, :class:`SyncClient`, :func:`configure`, and
enqueueing inside the application's own SQL transaction (:mod:`broker.client.transactional`).

They load on first use: the operator's ``broker`` command needs the asyncio client alone,
not the thread-bridged :class:`SyncClient` (anyio).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.model.lazy import lazy_exports

if TYPE_CHECKING:
    from broker.client.client import Client as Client
    from broker.client.sync import SyncClient as SyncClient
    from broker.client.sync import configure as configure

__getattr__ = lazy_exports(
    globals(),
    {
        "Client": "broker.client.client",
        "SyncClient": "broker.client.sync",
        "configure": "broker.client.sync",
    },
)

__all__ = ["Client", "SyncClient", "configure"]
