"""The program a pooled or forked child runs: ``python -m runners.child``.

The child talks to its worker over two dedicated channels and nothing else: jobs
arrive on what was fd 0 (moved aside at start-up, with ``/dev/null`` put in its
place) and outcomes leave on the fd named by ``--channel-fd``. A task's ``print()``
goes to the child's real stdout, which the worker reads and logs line by line with
the job id (long lines truncated, floods rate-limited: see
:class:`runners.process.OutputRelay`), so no user output can ever corrupt the protocol.

The child gets the worker's environment without any ``BROKER_*`` variable (see
:func:`runners.process.child_environment`) and the worker's ``sys.path``.

Jobs run through :class:`runners.inline.InlineRunner` on the child's own event loop
(coroutines) or in threads (plain functions), with timeouts left to the parent,
which enforces them by stopping the whole process.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import io
import json
import os
import sys
import uuid
from collections.abc import Sequence
from typing import Any, TextIO

from broker import allocator
from broker.jobs import JSONValue
from broker.tasks.context import running_job
from broker.tasks.hooks import StartupHookFailed, WorkerHooks
from broker.tasks.registry import default_registry
from broker.tasks.runner import Failed, LeaseKey, RunOutcome
from runners import pipe
from runners.inline import InlineRunner, format_error
from runners.process import CHILD_SYS_PATH_ENV, current_rss

STARTUP_FAILED = 3
"""Exit code after reporting a start-up error (the app failed to import, or one of its
start-up hooks raised)."""


class _TaggedStream(io.TextIOBase):
    """Prefixes each output line with the job that wrote it, so the worker's log says
    which job printed what even when several jobs share one child."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner
        self._at_line_start = True

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        job = running_job()
        prefix = f"[job {job.job_id}] " if job is not None else ""
        for piece in text.splitlines(keepends=True):
            if self._at_line_start and prefix:
                self._inner.write(prefix)
            self._inner.write(piece)
            self._at_line_start = piece.endswith("\n")
        self._inner.flush()
        return len(text)

    def flush(self) -> None:
        self._inner.flush()


JOB_LINE_LIMIT = 64 << 20
"""Longest line of jobs read from the worker (a job's arguments travel in it)."""

RSS_SAMPLE_INTERVAL = 1.0
"""Seconds between memory samples while the child runs jobs; the worker recycles on them."""


class _Channel:
    """The outcome channel: messages produced in one event-loop turn leave as one line
    in one ``write`` (see :mod:`runners.pipe`)."""

    def __init__(self, fd: int) -> None:
        self._out = os.fdopen(fd, "wb", buffering=0)
        self._pending: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gone = False

    def send(self, message: pipe.FromChild) -> None:
        """Send at once (before the loop runs, or for the last words of a child)."""
        self._write(pipe.encode_batch([pipe.encode(message)]))

    def queue(self, encoded: bytes) -> None:
        """Send with whatever else this loop turn produces."""
        self._pending.append(encoded)
        if len(self._pending) == 1:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self._write(pipe.encode_batch(batch))

    def _write(self, data: bytes) -> None:
        if self._gone:
            return
        view = memoryview(data)
        try:
            while view:
                written = self._out.write(view)
                view = view[written or 0 :]
        except BrokenPipeError:
            # The worker is gone: nothing written here can reach anyone any more (the
            # main has taken the leases back), and the jobs are being stopped.
            self._gone = True


class _Sampler:
    """Reports the child's memory at most every :data:`RSS_SAMPLE_INTERVAL` seconds, and
    only while jobs finish: one timer per child, never a ``/proc`` read per job."""

    def __init__(self, channel: _Channel, loop: asyncio.AbstractEventLoop) -> None:
        self._channel = channel
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None

    def job_done(self) -> None:
        if self._timer is None:
            self._timer = self._loop.call_later(RSS_SAMPLE_INTERVAL, self._sample)

    def _sample(self) -> None:
        self._timer = None
        self._channel.queue(pipe.encode(pipe.SampleLine(current_rss())))


def _unanswerable() -> Exception:
    from broker.exceptions import CheckpointRejectedError  # only then: see runners.process

    return CheckpointRejectedError(
        "the worker closed this runner process's job channel: the checkpoint was not saved"
    )


class _PipeJobs:
    """The jobs' channel in a child (:class:`broker.tasks.runner.JobChannel`): checkpoints and
    progress go to the worker over the outcome channel, and each checkpoint waits for the
    worker's ``checkpoint_ack``, which comes back with the jobs."""

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel
        self._waiting: dict[tuple[uuid.UUID, int], asyncio.Future[None]] = {}
        self._closed = False

    def save_checkpoint(self, key: LeaseKey, seq: int, state: JSONValue) -> asyncio.Future[None]:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        encoded = pipe.encode(pipe.CheckpointLine(key[1], seq, state))  # ValueError: not sent
        if self._closed:
            waiter.set_exception(_unanswerable())
            return waiter
        self._waiting[(key[1], seq)] = waiter
        self._channel.queue(encoded)
        return waiter

    def closed(self) -> None:
        """The worker closed the job channel while jobs still run (it died, or was
        killed): no acknowledgement can come any more, so a checkpoint waiting for one
        fails instead of holding its job, and this child, for ever."""
        self._closed = True
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            if not waiter.done():
                waiter.set_exception(_unanswerable())

    def report_progress(self, key: LeaseKey, fraction: float, message: str) -> None:
        self._channel.queue(pipe.encode(pipe.ProgressLine(key[1], fraction, message)))

    def answered(self, ack: pipe.CheckpointAckLine) -> None:
        waiter = self._waiting.pop((ack.handoff_id, ack.seq), None)
        if waiter is None or waiter.done():
            return
        if ack.code is None:
            waiter.set_result(None)
            return
        from broker.wire import (
            errors as error_codes,  # only when a checkpoint fails: see runners.process
        )

        waiter.set_exception(error_codes.exception_for(ack.code, ack.error or "not saved"))


async def _start_app(hooks: WorkerHooks, channel: _Channel) -> bool:
    """Run the app's start-up hooks; one that raises is this child's start-up error.

    Before ``ready``: the worker starts a job's clock only then, so the app's start-up
    never counts against a job's timeout (it counts against the start-up timeout)."""
    try:
        await hooks.start()
    except StartupHookFailed as exc:
        assert exc.__cause__ is not None
        error = format_error(exc.__cause__)
        channel.send(pipe.StartupErrorLine(f"start-up hook {exc.hook} raised {error}"))
        return False
    return True


async def _serve(jobs_fd: int, channel: _Channel, concurrency: int, one_shot: bool) -> int:
    loop = asyncio.get_running_loop()
    runner = InlineRunner(concurrency=concurrency, enforce_timeouts=False, process_hooks=False)
    jobs = _PipeJobs(channel)
    runner.set_job_channel(jobs)
    sampler = _Sampler(channel, loop)
    running: set[asyncio.Future[RunOutcome]] = set()

    def done(handoff_id: uuid.UUID, outcome: asyncio.Future[RunOutcome]) -> None:
        running.discard(outcome)
        try:
            encoded = pipe.encode(pipe.outcome_line(handoff_id, outcome.result()))
        except ValueError as exc:
            # The inline runner already turns non-JSON and too-deep results into failures;
            # this is the last guard, because an outcome never sent would leave the job
            # hanging in the worker (nothing was queued: encoding comes first).
            failed = Failed(f"the job's outcome cannot be sent as JSON: {exc}", retry=False)
            encoded = pipe.encode(pipe.outcome_line(handoff_id, failed))
        channel.queue(encoded)
        sampler.job_done()

    def run(line: pipe.JobLine) -> None:
        """Start a job: a callback on its outcome sends it, with no task of our own."""
        outcome = runner.run(pipe.assignment_of(line))
        running.add(outcome)
        outcome.add_done_callback(functools.partial(done, line.handoff_id))

    def on_line(line: bytes) -> None:
        for message in pipe.to_child_decoder.decode(line):
            match message:
                case pipe.PingLine(nonce=nonce):
                    channel.queue(pipe.encode(pipe.PongLine(nonce, current_rss())))
                case pipe.CheckpointAckLine():
                    jobs.answered(message)
                case pipe.JobLine() if not (one_shot and started.is_set()):
                    run(message)
                    started.set()

    def closed(ended: asyncio.Future[None]) -> None:
        if not ended.cancelled() and ended.exception() is None:
            # The worker closed our job channel. It retires a child only once it is idle,
            # so jobs still running here lost their worker (it died, or was killed): no
            # outcome of theirs can be reported, and the main gives their leases to
            # another attempt. They stop now instead of running on beside that attempt
            # (a job waiting for an event that never comes would keep this process for
            # ever); a sync job's thread is a daemon and does not hold the exit. (No
            # job can come any more either, so the runner stops even when idle.)
            jobs.closed()
            stopping.append(loop.create_task(runner.stop(grace=0)))

    started = asyncio.Event()
    stopping: list[asyncio.Task[None]] = []
    lines = pipe.LineChannel(on_line, JOB_LINE_LIMIT, loop)
    await loop.connect_read_pipe(lambda: lines, os.fdopen(jobs_fd, "rb", buffering=0))
    reading = lines.ended
    reading.add_done_callback(closed)
    channel.send(pipe.ReadyLine(os.getpid()))
    if one_shot:
        # One job, then exit; the channel is still read meanwhile, for the job's
        # checkpoint acknowledgements.
        first = loop.create_task(started.wait())
        either: set[asyncio.Future[Any]] = {reading, first}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        first.cancel()
        if running:
            await asyncio.wait(running)
        reading.cancel()
    await asyncio.gather(reading, return_exceptions=one_shot)
    if running:
        await asyncio.wait(running)
    channel.flush()
    return 0


async def _live(jobs_fd: int, channel: _Channel, concurrency: int, one_shot: bool) -> int:
    """The child's life: the app's start-up hooks, its jobs until the worker closes
    their channel (or its one job is done), then, on that clean end, the app's shutdown
    hooks (the worker gives them the kill grace, then stops the process)."""
    hooks = default_registry.hooks
    if not await _start_app(hooks, channel):
        return STARTUP_FAILED
    code = await _serve(jobs_fd, channel, concurrency, one_shot)
    await hooks.stop()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runners.child")
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--app", action="append", default=[])
    parser.add_argument("--one-shot", action="store_true")
    args = parser.parse_args(argv)
    allocator.tune()  # a process of broker's own: see broker.allocator
    channel = _Channel(args.channel_fd)
    jobs_fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    sys.stdout = _TaggedStream(sys.stdout)
    sys.stderr = _TaggedStream(sys.stderr)
    worker_path = os.environ.pop(CHILD_SYS_PATH_ENV, None)
    if worker_path:
        sys.path[:] = json.loads(worker_path)
    try:
        for module in args.app:
            importlib.import_module(module)
    except BaseException as exc:
        channel.send(
            pipe.StartupErrorLine(f"the task modules failed to import: {format_error(exc)}")
        )
        return STARTUP_FAILED
    return asyncio.run(_live(jobs_fd, channel, args.concurrency, args.one_shot))


if __name__ == "__main__":
    raise SystemExit(main())
