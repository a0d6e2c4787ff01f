"""Runs every workload against one system, inside that system's virtual environment.

    <venv>/bin/python -m bench.harness SYSTEM CONFIG.json OUT.json

``bench/__main__.py`` starts one of these per system, with a time limit, and reads
``OUT.json`` (rewritten after every run, so a run that is cut short keeps what it had).
Standard library only; each system's specifics live in a ``Driver`` in ``bench/peers/``.

Workloads (every one repeated ``reps`` times, each run bounded by ``run_timeout``):

* drain: ``one_by_one`` no-op jobs enqueued one call at a time (timed), the rest of
  ``drain_jobs`` in bulk (timed), then the workers start. Where the driver has
  ``enqueue_one_direct`` (the broker on PostgreSQL), as many jobs are first enqueued one
  call at a time straight to the store, not through the system's server (timed apart),
  and, where it has ``enqueue_bulk_direct`` too, as many as that bulk in one call
  (timed), and the store emptied again. Drain time runs from the
  first job body starting to the moment the system's own records show every job
  complete (polled every ``poll_interval``, then every 1% of the time so far, at most
  0.1 s). Start-up is spawn to first job body. Systems with fewer ``drain_jobs`` enqueue
  a fifth of them one at a time.
  A drain still going ``drain_limit`` seconds after its first job started is cut
  there, and its rate is the jobs complete by then over that time (marked).
* cpu: ``cpu_jobs`` jobs of about 5 ms of hashing each, drained the same way.
* latency: workers started and warmed up, then ``latency_jobs`` no-op jobs sent one
  at a time at ``latency_rate`` per second; enqueue-to-start is from just before the
  enqueue call to the job body starting, enqueue-to-complete to the completion time
  that the system itself records (where it records one).
* producers (systems whose driver has ``open_producer``): a backlog of ``producer_jobs``
  no-op jobs enqueued in bulk, ``producers`` producers connected (in a thread of this
  process, each with its own connection where the system allows) and producing for a
  second, then the workers start; the producers each enqueue one job at a time at
  ``producer_rate`` per second until the backlog's worth of jobs is complete; the drain
  rate counts every job completed meanwhile, and each enqueue's time to its
  acknowledgement is kept.

CPU is user + system time from the first job start to the end, per process: the
worker processes themselves, their children (pool children, recycled ones included),
the broker's main and the store server; RSS is the peak of the worker tree's summed
resident memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Config:
    workdir: str
    hash_rounds: int
    reps: int = 3
    drain_jobs: int = 5000
    one_by_one: int = 1000
    cpu_jobs: int = 600
    latency_jobs: int = 200
    latency_rate: float = 50.0
    drain_limit: float = 15.0
    producers: int = 200
    producer_jobs: int = 3000
    """The backlog the producers workload drains: smaller than ``drain_jobs`` to keep
    ``make bench`` near 15 minutes (the cost per job barely moves with backlog size)."""
    producer_rate: float = 2.0
    """Jobs per second each producer offers (one at a time); 0: as fast as each can."""
    run_timeout: float = 60.0
    poll_interval: float = 0.01


class BenchError(Exception):
    """A run failed in a way the report should show."""


# ----------------------------------------------------------------------------- /proc


def _proc_stat(pid: int) -> tuple[int, float, float, int] | None:
    """``(ppid, own cpu seconds, cpu seconds incl. reaped children, rss bytes)`` or ``None``.

    Own CPU (utime + stime) and reaped children's (cutime + cstime) are kept apart so a
    worker's CPU can be split from that of its children, recycled ones included.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    own = int(fields[11]) + int(fields[12])
    reaped = int(fields[13]) + int(fields[14])
    return int(fields[1]), own / _TICK, (own + reaped) / _TICK, int(fields[21]) * _PAGE


def _proc_table() -> dict[int, tuple[int, float, float, int]]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None:
                table[int(entry)] = stat
    return table


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Usage:
    own_cpu: float
    """CPU seconds of the roots themselves."""
    tree_cpu: float
    """CPU seconds of the roots and every descendant, live or reaped."""
    rss: int
    """Summed resident bytes of the roots and their live descendants."""


def usage(roots: Iterable[int]) -> Usage:
    """CPU and RSS of ``roots`` and all their descendants, from one read of ``/proc``."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    root_set = {p for p in roots if p in table}
    seen: set[int] = set()
    stack = list(root_set)
    own, cpu, rss = 0.0, 0.0, 0
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if pid in root_set:
            own += table[pid][1]
        cpu += table[pid][2]
        rss += table[pid][3]
        stack.extend(children.get(pid, ()))
    return Usage(own, cpu, rss)


def tree_usage(roots: Iterable[int]) -> tuple[float, int]:
    """CPU seconds and RSS bytes of ``roots`` and all their descendants."""
    u = usage(roots)
    return u.tree_cpu, u.rss


def service_pids(name: str) -> list[int]:
    """Top processes called ``name`` (``redis-server``; ``postgres`` finds the postmaster)."""
    found = [int(p) for p in os.listdir("/proc") if p.isdigit() and _comm(int(p)) == name]
    tops = []
    for pid in found:
        stat = _proc_stat(pid)
        if stat is not None and stat[0] not in found:
            tops.append(pid)
    return tops


# ----------------------------------------------------------------------------- workers

_LIVE: list[Workers] = []


class Workers:
    """Worker processes, each in a session of its own so a stop reaches its children."""

    def __init__(
        self, commands: list[list[str]], env: dict[str, str], log: Path, what: str = "a worker"
    ) -> None:
        self.log = log
        self.what = what
        self._out = open(log, "ab")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        self.procs = [
            subprocess.Popen(
                cmd,
                env=full_env,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=self._out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for cmd in commands
        ]
        _LIVE.append(self)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise BenchError(f"{self.what} exited with code {p.returncode}: {self.tail()}")

    def tail(self, lines: int = 6) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])[-800:]

    def stop(self, grace: float = 5.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                _killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            _killpg(p.pid, signal.SIGKILL)  # stragglers, orphaned children included
            p.wait()
        self._out.close()
        if self in _LIVE:
            _LIVE.remove(self)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# ----------------------------------------------------------------------------- driver


class Driver:
    """One system. Subclasses fill in the blanks; ``enqueued`` counts jobs since reset."""

    label = ""
    setup_text = ""
    durability = ""
    packages: tuple[str, ...] = ()
    has_bulk = True
    bulk_text = ""
    has_direct = False
    """Whether :meth:`enqueue_one_direct` exists: the system's client can also write a job
    straight into the store, bypassing its server (the broker's ``enqueue_in_async``)."""
    drain_jobs: int | None = None
    cpu_jobs: int | None = None
    server = ""
    """``redis-server`` or ``postgres``: whose CPU the report charges as the store's."""
    mode = ""
    """The broker's execution mode (``pooled``, ``inline``): which floor the row is held to."""

    def __init__(self, name: str, cfg: Config) -> None:
        self.name = name
        self.cfg = cfg
        self.enqueued = 0
        self.workdir = Path(cfg.workdir)

    # What every driver provides.
    def setup(self) -> None:
        """Once, before any run."""

    def reset(self) -> None:
        """Before every run: an empty store (and ``enqueued = 0``)."""
        raise NotImplementedError

    def enqueue_one(self, kind: str, arg: int) -> Any:
        """Enqueue one job (``kind`` is ``noop`` or ``cpu``); returns its handle."""
        raise NotImplementedError

    def enqueue_bulk(self, kind: str, args: list[int]) -> None:
        raise NotImplementedError

    def analyze(self) -> None:
        """After a large bulk enqueue: the store's planner statistics brought up to date,
        as autovacuum would within its minute. The urgent workload times its probes right
        after enqueueing 100,000 jobs into a table emptied by ``reset``; without this,
        whichever system does not run ``ANALYZE`` itself is timed on plans made for an
        empty table (PgQueuer's drain fell to 321-542 jobs/s there, from 6,500 over a
        1,000,000-job backlog that ``bench.scale`` analyzes). Nothing to do for a store
        with no planner statistics."""

    def enqueue_urgent(self, kind: str, arg: int, priority: int) -> Any:
        """Enqueue one job of ``priority`` (higher runs first), one call, as
        :meth:`enqueue_one` (the urgent-jobs workload, ``bench/urgent.py``)."""
        raise NotImplementedError

    def enqueue_one_direct(self, kind: str, arg: int) -> Any:
        """Enqueue one job straight into the store (only where ``has_direct``)."""
        raise NotImplementedError

    def enqueue_bulk_direct(self, kind: str, args: list[int]) -> None:
        """Enqueue ``args`` in one call straight into the store (only where
        ``has_direct`` and ``has_bulk``)."""
        raise NotImplementedError

    def worker_commands(self) -> list[list[str]]:
        raise NotImplementedError

    def worker_env(self) -> dict[str, str]:
        return {}

    def done_count(self) -> int:
        """Jobs the system's own records show complete, since the last reset."""
        raise NotImplementedError

    def completion_times(self, handles: list[Any]) -> list[float | None] | None:
        """Epoch seconds at which the system recorded each job complete; ``None``: it does not."""
        return None

    def main_pids(self) -> list[int]:
        """The broker's main process (the broker only)."""
        return []

    producer_text = ""
    """How the producers connect; empty: the system has no producers workload."""

    async def open_producer(self) -> tuple[Callable[[], Awaitable[Any]], Callable[[], Any]]:
        """A producer of its own, on the running loop: ``(enqueue one no-op job, close)``.

        Called from the producers' thread; each producer enqueues one job at a time.
        """
        raise NotImplementedError

    def versions(self) -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version

        out = {}
        for dist in self.packages:
            try:
                out[dist] = version(dist)
            except PackageNotFoundError:
                out[dist] = "?"
        return out

    def teardown(self) -> None:
        pass


# ----------------------------------------------------------------------------- producers


PRODUCER_WARMUP = 1.0
"""Seconds the producers run before the workers start and their figures are kept."""


class Producers:
    """``count`` producers in a thread of their own, each enqueueing one job at a time.

    Each offers ``rate`` jobs per second (0: as fast as its enqueues return), starting at
    a random phase so they do not arrive in step; a producer that falls behind sends its
    next job at once instead of catching up in a burst. Every acknowledged job adds one
    to ``driver.enqueued`` (only this thread writes it while the producers run).
    """

    CONNECTING_AT_ONCE = 20
    """Connections opened at once: below the broker's default handshake limit (64)."""

    def __init__(self, driver: Driver, count: int, rate: float) -> None:
        self.d = driver
        self.count = count
        self.rate = rate
        self.latencies_ms: list[float] = []
        self.failures: list[str] = []
        """The first few failed enqueues' errors."""
        self.failed = 0
        self.elapsed = 0.0
        self._ready = threading.Event()
        self._error: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._go: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._since = 0.0
        self._thread = threading.Thread(target=self._main, name="producers", daemon=True)

    def start(self, timeout: float) -> None:
        """Opens every producer's connection; returns once all are open."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise BenchError(f"{self.count} producers not connected after {timeout:.0f} s")
        if self._error is not None:
            raise BenchError(f"producers could not connect: {self._error}")

    def go(self) -> None:
        self._signal(self._go)

    def mark(self) -> None:
        """Forgets the enqueues so far: the figures cover what follows (after a warm-up)."""
        self._call(self._mark)

    def _mark(self) -> None:
        self.latencies_ms = []
        self.failed = 0
        self._since = time.perf_counter()

    def stop(self) -> None:
        self._signal(self._go)  # a crowd stopped before it went: it ends at once
        self._signal(self._stop)
        self._thread.join(60)

    def _signal(self, event: asyncio.Event | None) -> None:
        if event is not None:
            self._call(event.set)

    def _call(self, fn: Callable[[], Any]) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(fn)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except Exception as exc:
            self._error = _describe(exc)
        finally:
            self._ready.set()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._go, self._stop = asyncio.Event(), asyncio.Event()
        gate = asyncio.Semaphore(self.CONNECTING_AT_ONCE)

        async def connect() -> tuple[Callable[[], Awaitable[Any]], Callable[[], Any]]:
            async with gate:
                return await self.d.open_producer()

        results = await asyncio.gather(
            *(connect() for _ in range(self.count)), return_exceptions=True
        )
        opened = [r for r in results if not isinstance(r, BaseException)]
        try:
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed  # the ones that did open are closed below
            self._ready.set()
            await self._go.wait()
            self._mark()
            tasks = [asyncio.create_task(self._produce(enqueue)) for enqueue, _ in opened]
            await self._stop.wait()
            self.elapsed = time.perf_counter() - self._since
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for _, close in opened:
                with contextlib.suppress(Exception):
                    closing = close()
                    if asyncio.iscoroutine(closing):
                        await closing

    async def _produce(self, enqueue: Callable[[], Awaitable[Any]]) -> None:
        interval = 1.0 / self.rate if self.rate > 0 else 0.0
        next_at = time.perf_counter() + random.uniform(0.0, interval)
        while True:
            pause = next_at - time.perf_counter()
            if pause > 0:
                await asyncio.sleep(pause)
            sent = time.perf_counter()
            try:
                await enqueue()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failed += 1
                if len(self.failures) < 5:
                    self.failures.append(_describe(exc))
                # At least 10 ms before the next try: a producer whose enqueue fails at
                # once must not spin and starve the loop (rate 0 has no pause).
                next_at = max(next_at + interval, time.perf_counter() + 0.01)
                continue
            now = time.perf_counter()
            self.latencies_ms.append(1000 * (now - sent))
            self.d.enqueued += 1
            next_at = max(next_at + interval, now)


# ----------------------------------------------------------------------------- runs


class Runner:
    def __init__(self, driver: Driver, cfg: Config, out: Path) -> None:
        self.d = driver
        self.cfg = cfg
        self.out = out
        self.run_no = 0
        self.result: dict[str, Any] = {
            "system": driver.name,
            "label": driver.label,
            "setup": driver.setup_text,
            "durability": driver.durability,
            "bulk": driver.bulk_text,
            "has_bulk": driver.has_bulk,
            "has_direct": driver.has_direct,
            "mode": driver.mode,
            "versions": {},
            "config": asdict(cfg),
            "drain": [],
            "cpu": [],
            "latency": [],
            "producers": [],
            "errors": [],
        }

    def save(self) -> None:
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        tmp.replace(self.out)

    def _paths(self, what: str) -> tuple[Path, Path]:
        self.run_no += 1
        base = self.d.workdir / f"{self.d.name}-{what}-{self.run_no}"
        return base.with_suffix(".marks"), base.with_suffix(".log")

    def _start_workers(self, marks: Path, log: Path) -> Workers:
        marks.write_bytes(b"")
        env = {**self.d.worker_env(), "BENCH_MARKS": str(marks)}
        return Workers(self.d.worker_commands(), env, log)

    def _server_cpu(self) -> float:
        return tree_usage(service_pids(self.d.server))[0] if self.d.server else 0.0

    def drain(
        self, kind: str, n: int, one_by_one: int, backlog: Callable[[], Any] | None = None
    ) -> dict[str, Any]:
        """``backlog``: called on the fresh store before the measured jobs are enqueued,
        to put other jobs there first (``bench/scale.py``)."""
        d = self.d
        arg = -1 if kind == "noop" else self.cfg.hash_rounds
        run: dict[str, Any] = {"jobs": n}
        direct = one_by_one if d.has_direct else 0
        rest = n - one_by_one
        d.reset()
        if direct or (d.has_direct and d.has_bulk and rest):
            # Straight into the store, on the fresh store, which is then emptied again, so
            # the drain's jobs are the same as every other system's: as many jobs one at a
            # time as through the server below (on an empty table, as theirs), then as many
            # in one call as the bulk below (on top of those, as the bulk below is).
            if direct:
                d.enqueue_one_direct(kind, arg)  # its connection opened and warm
                started = time.perf_counter()
                for _ in range(direct - 1):
                    d.enqueue_one_direct(kind, arg)
                run["enqueue_direct_per_s"] = (direct - 1) / (time.perf_counter() - started)
            if d.has_bulk and rest:
                d.enqueue_bulk_direct(kind, [arg])  # its statement prepared, as above
                started = time.perf_counter()
                d.enqueue_bulk_direct(kind, [arg] * rest)
                run["enqueue_bulk_direct_per_s"] = rest / (time.perf_counter() - started)
            d.reset()
        if backlog is not None:
            backlog()
        started = time.perf_counter()
        for _ in range(one_by_one):
            d.enqueue_one(kind, arg)
        if one_by_one:
            run["enqueue_one_per_s"] = one_by_one / (time.perf_counter() - started)
        started = time.perf_counter()
        if d.has_bulk and rest:
            d.enqueue_bulk(kind, [arg] * rest)
            run["enqueue_bulk_per_s"] = rest / (time.perf_counter() - started)
        else:
            for _ in range(rest):
                d.enqueue_one(kind, arg)
        return self.drain_queued(kind, n, run)

    def drain_queued(self, what: str, n: int, run: dict[str, Any]) -> dict[str, Any]:
        """Starts the workers on the ``n`` jobs enqueued since the reset and fills ``run``
        as they drain (see :meth:`_watch`)."""
        d = self.d
        marks, log = self._paths(what)
        if d.done_count() != 0:
            raise BenchError("jobs completed before any worker started")
        spawned = time.time()
        workers = self._start_workers(marks, log)
        try:
            self._watch(workers, marks, spawned, n, run)
        finally:
            workers.stop()
        return run

    def producers(self, n: int) -> dict[str, Any]:
        """A backlog of ``n`` no-op jobs drained while the producers enqueue more."""
        d, cfg = self.d, self.cfg
        d.reset()
        marks, log = self._paths("producers")
        if d.has_bulk:
            d.enqueue_bulk("noop", [-1] * n)
        else:
            for _ in range(n):
                d.enqueue_one("noop", -1)
        crowd = Producers(d, cfg.producers, cfg.producer_rate)
        run: dict[str, Any] = {
            "jobs": n,
            "producers": cfg.producers,
            "producer_rate": cfg.producer_rate,
        }
        try:
            crowd.start(cfg.run_timeout)
            # A second of producing before the workers start: every connection has sent
            # and prepared its first enqueue, and the figures start from a steady stream.
            crowd.go()
            time.sleep(PRODUCER_WARMUP)
            crowd.mark()
            spawned = time.time()
            workers = self._start_workers(marks, log)
            try:
                self._watch(workers, marks, spawned, n, run)
            finally:
                workers.stop()
        finally:
            crowd.stop()
        if crowd.failed:
            run["enqueue_failed"] = crowd.failed
            run["enqueue_failures"] = crowd.failures
            self.result["errors"].append(
                f"producers: {crowd.failed} enqueues failed, the first: {crowd.failures[0]}"
            )
        lat = crowd.latencies_ms
        run.update(
            enqueued=len(lat),
            enqueue_per_s=len(lat) / crowd.elapsed if crowd.elapsed else None,
            enqueue_p50_ms=percentile(lat, 50),
            enqueue_p99_ms=percentile(lat, 99),
            enqueue_max_ms=max(lat, default=None),
        )
        return run

    def _watch(
        self, workers: Workers, marks: Path, spawned: float, n: int, run: dict[str, Any]
    ) -> None:
        """Polls until all ``n`` are complete or the run's time is up; fills ``run``."""
        d = self.d
        deadline = time.monotonic() + self.cfg.run_timeout
        at_first: tuple[Usage, float, float] | None = None
        peak_rss, peak_main_rss, polls = 0, 0, 0
        while True:
            done = d.done_count()
            now = time.time()
            if at_first is None and marks.stat().st_size > 0:
                at_first = (
                    usage(workers.pids),
                    self._server_cpu(),
                    tree_usage(d.main_pids())[0],
                )
                deadline = min(deadline, time.monotonic() + self.cfg.drain_limit)
            if done >= n or time.monotonic() > deadline:
                break
            workers.check()
            polls += 1
            if polls % 10 == 1:
                peak_rss = max(peak_rss, tree_usage(workers.pids)[1])
                peak_main_rss = max(peak_main_rss, tree_usage(d.main_pids())[1])
            # Every poll_interval at first, then about every 1% of the time so far: the
            # end is known to within 1%, and a long drain is not slowed by the polling.
            time.sleep(min(0.1, max(self.cfg.poll_interval, 0.01 * (now - spawned))))
        worker = usage(workers.pids)
        main_cpu, main_rss = tree_usage(d.main_pids())
        server_cpu = self._server_cpu()
        firsts = [float(line.split()[1]) for line in _lines(marks) if line.startswith("F ")]
        if not firsts or at_first is None:
            raise BenchError(
                f"no job started within {self.cfg.run_timeout:.0f} s: {workers.tail()}"
            )
        first = min(firsts)
        run.update(
            startup_s=first - spawned,
            done=done,
            timed_out=done < n,
            seconds=now - first,
            per_s=done / (now - first),
            worker_cpu_s=worker.tree_cpu - at_first[0].tree_cpu,
            worker_own_cpu_s=worker.own_cpu - at_first[0].own_cpu,
            children_cpu_s=(worker.tree_cpu - worker.own_cpu)
            - (at_first[0].tree_cpu - at_first[0].own_cpu),
            server_cpu_s=server_cpu - at_first[1],
            main_cpu_s=main_cpu - at_first[2],
            worker_rss_mb=max(peak_rss, worker.rss) / 2**20,
            main_rss_mb=max(peak_main_rss, main_rss) / 2**20,
        )

    def _wait_done(self, workers: Workers, limit: float) -> None:
        deadline = time.monotonic() + limit
        while self.d.done_count() < self.d.enqueued:
            if time.monotonic() > deadline:
                raise BenchError(
                    f"{self.d.done_count()} of {self.d.enqueued} complete after {limit:.0f} s"
                )
            workers.check()
            time.sleep(self.cfg.poll_interval)

    def latency(self) -> None:
        d, cfg = self.d, self.cfg
        d.reset()
        marks, log = self._paths("latency")
        workers = self._start_workers(marks, log)
        try:
            for _ in range(10):  # warm-up: every process has started and run a job
                d.enqueue_one("noop", -1)
            self._wait_done(workers, cfg.run_timeout)
            time.sleep(1.0)
            for rep in range(cfg.reps):
                self.result["latency"].append(self._latency_series(workers, marks, rep))
                self.save()
                time.sleep(0.5)
        finally:
            workers.stop()

    def _latency_series(self, workers: Workers, marks: Path, rep: int) -> dict[str, Any]:
        d, cfg = self.d, self.cfg
        sent: dict[int, float] = {}
        handles: dict[int, Any] = {}
        interval = 1.0 / cfg.latency_rate
        next_at = time.perf_counter()
        for i in range(cfg.latency_jobs):
            tag = rep * 100_000 + i
            pause = next_at - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            sent[tag] = time.time()
            handles[tag] = d.enqueue_one("noop", tag)
            next_at += interval
        self._wait_done(workers, cfg.run_timeout)
        time.sleep(0.3)  # completion records some systems write in batches
        starts = {}
        for line in _lines(marks):
            if line.startswith("L "):
                _, tag_text, at = line.split()
                starts[int(tag_text)] = float(at)
        tags = sorted(sent)
        start_ms = [1000 * (starts[t] - sent[t]) for t in tags if t in starts]
        series: dict[str, Any] = {"jobs": len(tags), "started": len(start_ms)}
        series.update(start_p50_ms=percentile(start_ms, 50), start_p99_ms=percentile(start_ms, 99))
        completed = d.completion_times([handles[t] for t in tags])
        if completed is not None:
            done_ms = [1000 * (c - sent[t]) for t, c in zip(tags, completed, strict=True) if c]
            series.update(
                completed=len(done_ms),
                complete_p50_ms=percentile(done_ms, 50),
                complete_p99_ms=percentile(done_ms, 99),
            )
        return series

    def attempt(self, what: str, body: Callable[[], Any]) -> Any:
        try:
            return body()
        except (Exception, KeyboardInterrupt, SystemExit) as exc:
            self.result["errors"].append(f"{what}: {_describe(exc)}")
            self.save()
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            return None

    def run_all(self) -> None:
        cfg, d = self.cfg, self.d
        d.setup()
        self.result["versions"] = d.versions()
        self.save()
        n = d.drain_jobs or cfg.drain_jobs
        cpu_n = d.cpu_jobs or cfg.cpu_jobs
        for rep in range(cfg.reps):
            run = self.attempt(
                f"drain run {rep + 1}", lambda: self.drain("noop", n, min(cfg.one_by_one, n // 5))
            )
            if run is not None:
                self.result["drain"].append(run)
            self.save()
        for rep in range(cfg.reps):
            run = self.attempt(f"cpu run {rep + 1}", lambda: self.drain("cpu", cpu_n, 0))
            if run is not None:
                self.result["cpu"].append(run)
            self.save()
        self.attempt("latency", self.latency)
        self.save()
        if d.producer_text and cfg.producers > 0:
            self.result["producer_text"] = d.producer_text
            for rep in range(cfg.reps):
                run = self.attempt(
                    f"producers run {rep + 1}",
                    lambda: self.producers(min(n, cfg.producer_jobs)),
                )
                if run is not None:
                    self.result["producers"].append(run)
                self.save()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BenchError):
        return str(exc)
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {Path(frame[0].filename).name}:{frame[0].lineno}" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"[:600]


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def percentile(values: list[float], pct: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * pct / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def main(argv: list[str]) -> int:
    name, config_path, out_path = argv
    cfg = Config(**json.loads(Path(config_path).read_text()))

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum} (time limit)")

    signal.signal(signal.SIGTERM, stop)
    from bench.systems import BY_NAME

    module = importlib.import_module(BY_NAME[name].module)
    driver: Driver = module.DRIVERS[name](name, cfg)
    runner = Runner(driver, cfg, Path(out_path))
    try:
        runner.attempt("run", runner.run_all)
    finally:
        for workers in list(_LIVE):
            workers.stop(grace=1.0)
        try:
            driver.teardown()
        except Exception as exc:
            runner.result["errors"].append(f"teardown: {_describe(exc)}")
        runner.save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
