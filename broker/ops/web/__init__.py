"""The main's web dashboard, ``/metrics`` and ``/healthz``, on one HTTP port.

Served with aiohttp: it runs inside the main's own event loop (an ``AppRunner`` and a
``TCPSite``, no second server to supervise and no signal handlers of its own, where
uvicorn would want to own the process), and it is one well-kept package with its own
HTTP parser, where Starlette would need uvicorn beside it.

Every read and action goes through the main's request service (:meth:`Requests.answer`
with the same messages a client sends), so a retry or a cancel here is checked, woken and
stopped on its worker exactly as ``broker retry`` / ``broker cancel`` are. Those requests
take the dashboard's own slots (:data:`DASHBOARD_REQUESTS`), never the clients': a page
load or an id search, which needs no client credential, cannot hold a client back.
Actions need the main's operator secret (``--operator-token``, or the shared ``--token``;
a form field ``token`` or ``Authorization: Bearer``); a main without one has no dashboard
actions, since a page on a loopback port is still reachable by any web page the
operator's browser opens.

Reads are guarded too (:func:`~broker.ops.web.access.guard`, before any handler runs): a
request whose ``Host`` is not a loopback name, the ``--http-host`` address or one of
``--http-allowed-hosts`` is refused, so a page that rebinds its own DNS name to
127.0.0.1 reads nothing; with ``--http-read-token`` every read needs it (or the operator
secret), as a bearer token or a Basic password, which a browser prompts for. Every
answer carries a CSP that admits only this page's own style and script and no framing,
``nosniff``, no referrer and ``no-store``. ``/healthz`` alone is open, for load
balancers. The dashboard speaks plain HTTP: keep it on loopback or behind a proxy with
TLS (see docs/howto/security.md).

The pages are plain HTML (every value escaped), with a few lines of vanilla
JavaScript that re-fetch the live part of the page every two seconds: no build step.

The package: :mod:`~broker.ops.web.pages` writes the pages (with their size bounds),
:mod:`~broker.ops.web.access` guards every request, :mod:`~broker.ops.web.dashboard`
handles them, and :mod:`~broker.ops.web.serving` starts and stops both this server
and the worker's ``/metrics`` one.
"""

from __future__ import annotations

from broker.ops.web.dashboard import Dashboard
from broker.ops.web.serving import WorkerMetricsServer

__all__ = ["Dashboard", "WorkerMetricsServer"]
