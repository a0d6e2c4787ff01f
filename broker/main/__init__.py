"""broker-main: the I/O shells around :mod:`broker.core.handoff` (connections, the dispatcher,
the settler, the election, client requests) and the main's settings.

``from broker.main import Main, new_token`` is the documented path; the modules are internal.
"""

from __future__ import annotations

from broker.main.main import Main as Main
from broker.wire.credentials import new_token as new_token

__all__ = ["Main", "new_token"]
