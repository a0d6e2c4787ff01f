"""A stalled main, with real processes: a slow moment of the main never deposes it and
never runs a job twice.

* A leader whose loop stalls while each lease renewal is out (the answer waits in the
  socket, as it does while a slow request holds the loop) keeps leading with a standby
  beside it: the store did renew, and that answer is read instead of being thrown away
  by a timer that fired late. It used to count the renewals failed and step down (or
  let its lease run out, and the standby took over).
* A main paused (SIGSTOP) longer than its workers' liveness timeout, while they run jobs:
  the workers give their sockets up, and at SIGCONT they reconnect and adopt their
  leases; every job completes exactly once. The main used to return those leases the
  moment it read the dropped sockets, and ran the jobs a second time.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from adapters.sql import SQLAlchemyAdapter
from broker.main.main import Main
from tests.e2e.test_e2e import (
    Cluster,
    RunLog,
    enqueue,
    eventually,
    fresh_database,
    hold_spec,
    observe,
    record_spec,
    sqlite_url,
    wait_until_all_terminal,
)
from tests.e2e.test_failover import _each_completed_once
from tests.support import FAST, until

pytestmark = pytest.mark.slow

FAILOVER_TIMEOUT = 6.0
"""A lease of 3.6 s, renewed every 1.2 s (the renewal's old timeout), a standby's poll
every 0.6 s."""
STALL = 2.0
"""Longer than the renewal's timeout, shorter than the lease."""
STALLED_RENEWALS = 4
WORKER_LIVENESS = 4.0
"""The worker's ``--liveness-timeout``: how long the main is paused, at least. Its default
(15 s) made the test wait that long; pings every second keep a loaded main well clear of it
until the pause."""
WORKER_PING = 1.0


class StallingStore(SQLAlchemyAdapter):
    """The real PostgreSQL adapter, whose loop stalls (``time.sleep`` on the event loop,
    as a slow request's work would) while each renewal's statement is out: the answer
    comes back and waits in the socket until the loop runs again."""

    stall = 0.0
    stalled = 0
    """Renewals answered after a stall (granted or not)."""
    granted = 0

    async def renew(self, holder: str, epoch: int, ttl: float) -> bool:
        stall = self.stall
        if stall:
            asyncio.get_running_loop().call_soon(time.sleep, stall)
        ok = await super().renew(holder, epoch, ttl)
        self.stalled += bool(stall)
        self.granted += ok
        return ok


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    async with fresh_database("broker_stall") as url:
        yield url


@pytest.mark.postgres
@pytest.mark.parametrize("with_standby", [True, False], ids=["standby", "alone"])
async def test_a_leader_whose_loop_stalls_during_renewals_keeps_leading(
    tmp_path: Path, pg_url: str, with_standby: bool
) -> None:
    """Alone, it used to step down at its last chance (the store would have renewed it);
    with a standby, the same, or its lease ran out and the standby took over."""
    store = StallingStore(pg_url)
    leader = Main(store, replace(FAST, failover_timeout=FAILOVER_TIMEOUT), retention=None)
    cluster = Cluster(tmp_path, pg_url)
    await leader.start()
    try:
        assert leader.leading
        standby = None
        if with_standby:
            standby = await cluster.start_main("--failover-timeout", str(FAILOVER_TIMEOUT))
        store.stall = STALL
        await until(
            lambda: store.stalled >= STALLED_RENEWALS or leader.deposed.is_set(), timeout=90
        )
        store.stall = 0.0
        assert not leader.deposed.is_set(), leader.step_down_reason
        granted = store.granted
        await until(lambda: store.granted > granted, timeout=30)  # and it goes on renewing
        assert leader.leading and not leader.deposed.is_set(), leader.step_down_reason
        if standby is not None:
            assert standby.process.returncode is None, standby.tail()
            assert "elected leader" not in standby.output(), standby.tail()
    finally:
        await leader.stop()
        await cluster.close()


async def test_a_main_paused_past_the_workers_liveness_timeout_runs_no_job_twice(
    tmp_path: Path,
) -> None:
    url = sqlite_url(tmp_path)
    cluster = Cluster(tmp_path, url)
    gate = tmp_path / "gate"
    try:
        # The workers get the default grace (30 s) to come back, well over their delay.
        main = await cluster.start_main("--orphan-grace", "30")
        liveness = ("--ping-interval", str(WORKER_PING), "--liveness-timeout", str(WORKER_LIVENESS))
        worker = await cluster.start_worker(
            "worker-0", "--reconnect-max-delay", "1", *liveness, concurrency=4
        )
        held = [hold_spec(gate) for _ in range(3)]
        keys = await enqueue(cluster, held)
        await eventually(lambda: len(RunLog.read(cluster.runs).starts) == 3, "the jobs to run")
        # Counted from here: a loaded machine may have made the worker leave once already.
        lost = worker.output().count("connection to the main lost")
        connected = worker.output().count("connected to main")
        main.process.send_signal(signal.SIGSTOP)
        try:  # the worker's liveness timeout runs out and it gives the socket up
            await worker.wait_for_output(
                "connection to the main lost", count=lost + 1, timeout=WORKER_LIVENESS + 30
            )
        finally:
            main.process.send_signal(signal.SIGCONT)
        await worker.wait_for_output("connected to main", count=connected + 1)
        gate.touch()
        keys += await enqueue(cluster, [record_spec() for _ in range(10)])
        async with observe(url) as store:
            await wait_until_all_terminal(store, len(keys), cluster, timeout=60)
        assert await worker.terminate() == 0
        assert await main.terminate() == 0
    finally:
        await cluster.close()

    assert "held 3 leases, 3 adopted" in worker.output(), worker.tail()
    assert "worker connection ended while the main was stalled" in main.output(), main.tail()
    await _each_completed_once(url, cluster, keys)  # type: ignore[arg-type]
