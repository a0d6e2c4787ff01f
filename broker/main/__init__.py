"""broker-main: the I/O shells around :mod:`broker.core.handoff` (connections, the dispatcher,
the settler, the election, client requests) and the main's settings.

``from broker.main import Main, new_token`` is the documented path; the modules are internal.
They load on first use, so importing :mod:`broker.main.settings` (the flags of every
command) does not load the whole main.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.model.lazy import lazy_exports

if TYPE_CHECKING:
    from broker.main.main import Main as Main
    from broker.wire.credentials import new_token as new_token

__getattr__ = lazy_exports(
    globals(), {"Main": "broker.main.main", "new_token": "broker.wire.credentials"}
)

__all__ = ["Main", "new_token"]
