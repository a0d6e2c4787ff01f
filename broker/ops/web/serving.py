"""Serving an aiohttp application on one port inside the caller's event loop, and the
worker's ``/metrics`` and ``/healthz`` served that way."""

from __future__ import annotations

from aiohttp import web

from broker.main.metrics import CONTENT_TYPE
from broker.worker.metrics import WorkerLevels
from broker.worker.worker import Worker


class HttpServer:
    """``app`` on ``host``:``port`` (0 picks a free port): an ``AppRunner`` and a
    ``TCPSite`` in the running loop, with no access log and no signal handlers of its
    own (the process that serves it owns those). Start it after what it shows, stop it
    before."""

    def __init__(self, app: web.Application, *, host: str, port: int, what: str) -> None:
        self.app = app
        self._host = host
        self._port = port
        self._what = what
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        """The port it listens on (the one picked, when asked for 0)."""
        if self._runner is None or not self._runner.addresses:
            raise RuntimeError(f"the {self._what} is not listening")
        return int(self._runner.addresses[0][1])

    async def start(self) -> None:
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, self._host, self._port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class WorkerMetricsServer(HttpServer):
    """A worker's ``/metrics`` and ``/healthz`` (``broker-worker --metrics-port``)."""

    def __init__(self, worker: Worker, *, host: str, port: int) -> None:
        self._levels = WorkerLevels(worker.status)
        app = web.Application()
        app.add_routes([web.get("/metrics", self._metrics), web.get("/healthz", self._healthz)])
        super().__init__(app, host=host, port=port, what="metrics server")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._levels.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")
