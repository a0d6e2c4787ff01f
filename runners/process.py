"""One child runner process as its worker sees it, and what pooled and forked share.

The child speaks a small line protocol of its own over two dedicated pipes (see
:mod:`runners.pipe` and :mod:`runners.child`): ``ready`` (or ``startup_error``) once,
then an outcome per job, ``pong`` per ping and a memory ``sample`` now and then.
Anything else, or anything malformed, means the child can no longer be trusted: it is
killed and never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from broker.model import checks
from broker.model.logs import log_event
from broker.model.untrusted import RateLimit
from broker.tasks.registry import TaskRegistry, default_registry
from broker.tasks.runner import Assignment, Failed, JobChannel, NoChannel, Released, RunOutcome
from broker.tasks.runner_options import RunnerOptions
from runners import pipe

logger = logging.getLogger("broker.runner")

CHANNEL_LIMIT = 64 << 20
"""Largest outcome line a child may send (a job's result travels in it)."""

CHILD_SYS_PATH_ENV = "BROKER_CHILD_SYS_PATH"
"""The worker's ``sys.path``, for the child; the child removes it before any app import."""

OUTPUT_CHUNK_BYTES = 64 << 10
"""The child's output is read in pieces of at most this size, never a line at a time."""

OUTPUT_LINE_BYTES = 8 << 10
"""The first bytes of each output line that reach the log; the rest is only counted."""

OUTPUT_LINES_PER_SECOND = 100.0
OUTPUT_BURST_LINES = 500
"""Output lines logged per child: a token bucket of this rate and size. Lines beyond it
are dropped and counted, so one chatty child cannot flood the worker's log."""

OUTPUT_SUMMARY_AFTER = 1.0
"""Seconds after which a count of dropped lines is logged even if the child is quiet."""


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a child, and so user code, is given: the worker's without the
    broker's own configuration.

    Every ``BROKER_*`` variable is the broker's (the token, the database URL in
    ``BROKER_DATABASE_URL``, every option): a task has no business reading them, and a
    task that can read the token can impersonate its worker.
    """
    return {name: value for name, value in environ.items() if not name.startswith("BROKER_")}


class OutputRelay:
    """Turns a child's raw output bytes into log lines, bounded in size and rate.

    Lines are split here rather than by ``readline``, which gives up for good on a line
    longer than its limit. Each line keeps its first :data:`OUTPUT_LINE_BYTES` and says
    how many bytes it lost; lines over the rate are counted and summarised. Control
    characters are escaped by the log's filter (:mod:`broker.model.untrusted`).
    """

    def __init__(
        self,
        pid: int | None,
        *,
        line_bytes: int = OUTPUT_LINE_BYTES,
        rate: float = OUTPUT_LINES_PER_SECOND,
        burst: int = OUTPUT_BURST_LINES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pid = pid
        self._line_bytes = line_bytes
        self._limit = RateLimit(rate, burst, clock)
        self._line = bytearray()
        self._truncated = 0

    def feed(self, data: bytes) -> None:
        start = 0
        while start <= len(data):
            end = data.find(b"\n", start)
            stop = len(data) if end < 0 else end
            room = max(0, self._line_bytes - len(self._line))
            self._line += data[start : min(stop, start + room)]
            self._truncated += max(0, stop - start - room)
            if end < 0:
                return
            self._emit()
            start = end + 1

    def close(self) -> None:
        """The output ended: log a last unterminated line and any count still owed."""
        if self._line or self._truncated:
            self._emit()
        self.report_suppressed()

    @property
    def suppressed(self) -> int:
        """Lines over the rate not yet reported."""
        return self._limit.suppressed

    def report_suppressed(self) -> None:
        if suppressed := self._limit.take_suppressed():
            log_event(
                logger,
                logging.WARNING,
                "runner output suppressed (over its lines a second)",
                pid=self.pid,
                lines=suppressed,
                per_second=self._limit.rate,
            )

    def _emit(self) -> None:
        text = self._line.decode(errors="replace").rstrip()
        if self._truncated:
            text += f" ... ({self._truncated} bytes truncated)"
        self._line.clear()
        self._truncated = 0
        if not self._limit.allow():
            return
        self.report_suppressed()
        log_event(logger, logging.INFO, "runner output", pid=self.pid, line=text)


def current_rss() -> int:
    """This process's resident set size in bytes (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def timeout_for(
    assignment: Assignment, registry: TaskRegistry, default: float | None
) -> float | None:
    """The job's own timeout, else its task's, else the worker's default."""
    if assignment.timeout is not None:
        return assignment.timeout
    if assignment.task in registry:
        task_timeout = registry.get(assignment.task).timeout
        if task_timeout is not None:
            return task_timeout
    return default


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ChildStartupError(Exception):
    """The child died, or reported an error, before its ready handshake."""


class ChildProcess:
    """A handle on one child. It exists before its process does, so a slot can be
    reserved on it synchronously while the process is still starting."""

    def __init__(
        self,
        *,
        apps: Sequence[str],
        concurrency: int,
        one_shot: bool,
        on_exit: Callable[[ChildProcess], None],
        startup_timeout: float,
        on_sample: Callable[[ChildProcess], None] | None = None,
        channel: JobChannel | None = None,
        kill_grace: float = RunnerOptions.kill_grace,
    ) -> None:
        self.apps = list(apps)
        self.concurrency = concurrency
        self.one_shot = one_shot
        self.started_at = time.monotonic()
        self.jobs_run = 0
        self.rss = 0
        self.retiring = False
        self.started = False
        self.exited = False
        self.exit_code: int | None = None
        self.startup_error: str | None = None
        self.inflight: dict[uuid.UUID, asyncio.Future[RunOutcome]] = {}
        self.kill_reasons: dict[uuid.UUID, str] = {}
        self.bystanders: set[uuid.UUID] = set()
        """Jobs stopped because another job on this process timed out or was cancelled:
        their attempts are lost, not failed."""
        self.job_ids: dict[uuid.UUID, uuid.UUID] = {}
        """Job id by lease, for cancelling a job by its id."""
        self.last_pong = time.monotonic()
        self._outgoing: list[bytes] = []
        self._on_exit = on_exit
        self._on_sample = on_sample
        self._channel = channel or NoChannel()
        """Where the child's jobs' checkpoints and progress go (the worker)."""
        self._startup_timeout = startup_timeout
        self._proc: asyncio.subprocess.Process | None = None
        # Kept, because every ``get_running_loop()`` is a ``getpid`` system call on 3.11.
        self.loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[None] = self.loop.create_future()
        self._tasks: list[asyncio.Task[None]] = []
        self._channel_in: pipe.LineChannel | None = None
        """The outcome channel's reading end, once the process is started."""
        self._stopper: asyncio.Task[None] | None = None
        """A :meth:`terminate_soon` under way."""
        self._kill_grace = kill_grace
        self._exit_timer: asyncio.TimerHandle | None = None
        """Set once the child has no more jobs and should end on its own (see
        :meth:`_expect_exit`)."""
        self._boot = self.loop.create_task(self._start(), name="broker-child-start")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def free(self) -> int:
        return 0 if self.retiring or self.exited else self.concurrency - len(self.inflight)

    @property
    def age(self) -> float:
        return time.monotonic() - self.started_at

    async def wait_ready(self) -> None:
        """Returns once the child has handshaken; raises :class:`ChildStartupError` if it
        never will."""
        await asyncio.shield(self._ready)

    def when_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the child has handshaken; never if it fails to start
        (its reserved jobs are released then)."""

        def ready(handshake: asyncio.Future[None]) -> None:
            if not handshake.cancelled() and handshake.exception() is None:
                callback()

        self._ready.add_done_callback(ready)

    async def _start(self) -> None:
        read_fd, write_fd = os.pipe()
        # -P: the working directory does not go first on the child's path; the child
        # takes the worker's path instead, where an app directory comes last.
        argv = [sys.executable, "-P", "-m", "runners.child", "--channel-fd", str(write_fd)]
        argv += ["--concurrency", str(self.concurrency)]
        for app in self.apps:
            argv += ["--app", app]
        if self.one_shot:
            argv.append("--one-shot")
        env = child_environment(os.environ)
        env[CHILD_SYS_PATH_ENV] = json.dumps(sys.path)
        env["PYTHONUNBUFFERED"] = "1"
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                pass_fds=(write_fd,),
                env=env,
                # Its own session: a Ctrl-C or a signal to the worker's process group must
                # reach the worker, which drains, not kill jobs mid-run under it.
                start_new_session=True,
            )
        except OSError as exc:
            os.close(read_fd)
            self._fail_start(f"could not start a runner process: {exc}")
            self._finish(None)
            return
        finally:
            os.close(write_fd)
        if self.retiring and self._proc.stdin is not None:
            # Retired (its pool stopping) while the process was being created: it must
            # not wait for jobs that will never come, and outlive its worker's loop.
            self._proc.stdin.close()
        loop = asyncio.get_running_loop()
        channel = pipe.LineChannel(self._on_line, CHANNEL_LIMIT, loop)
        await loop.connect_read_pipe(lambda: channel, os.fdopen(read_fd, "rb", buffering=0))
        self._channel_in = channel
        channel.ended.add_done_callback(self._channel_ended)
        self._tasks = [asyncio.create_task(self._relay_output(), name="broker-child-output")]
        exited = asyncio.ensure_future(self._proc.wait())
        waiters: set[asyncio.Future[Any]] = {exited, self._ready}
        await asyncio.wait(
            waiters, timeout=self._startup_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if not self._ready.done() and not exited.done():
            self._fail_start(f"no ready handshake within {self._startup_timeout} s")
            self.kill()
        code = await exited
        # The last outcome may still be in the pipe when the exit is noticed: read it first.
        await asyncio.wait({channel.ended}, timeout=1.0)
        self._finish(code)

    def _fail_start(self, error: str) -> None:
        if not self._ready.done():
            self.startup_error = error
            self._ready.set_exception(ChildStartupError(error))
            self._ready.exception()  # retrieved here; waiters get it through wait_ready

    def _on_line(self, line: bytes) -> None:
        for message in pipe.from_child_decoder.decode(line):
            self._on_message(message)

    def _channel_ended(self, ended: asyncio.Future[None]) -> None:
        exc = None if ended.cancelled() else ended.exception()
        if exc is None:
            return
        log_event(
            logger,
            logging.ERROR,
            "runner process broke its protocol, killing it",
            pid=self.pid,
            error=repr(exc),
        )
        for handoff_id in self.inflight:
            self.kill_reasons.setdefault(
                handoff_id, f"its runner process broke its protocol and was killed: {exc!r}"
            )
        self.kill()

    def _on_message(self, m: pipe.FromChild) -> None:
        match m:
            case pipe.ReadyLine() if not self.started:
                self.started = True
                self.last_pong = time.monotonic()
                self._ready.set_result(None)
            case pipe.StartupErrorLine(error=error) if not self.started:
                self._fail_start(error)  # the child says what failed: an import, a hook
            case pipe.CompletedLine() | pipe.FailedLine() | pipe.RescheduledLine() if self.started:
                future = self.inflight.pop(m.handoff_id, None)
                self.job_ids.pop(m.handoff_id, None)
                if future is None:
                    raise ValueError(f"outcome for a job this child was not given: {m.handoff_id}")
                self.jobs_run += 1
                if not future.done():
                    future.set_result(pipe.outcome_of(m))
                if self.retiring and not self.inflight:
                    self._close_input()
                elif self.one_shot and not self.inflight:
                    self._expect_exit()
            case pipe.CheckpointLine(handoff_id=handoff_id, seq=seq, state=state) if self.started:
                self._checkpoint(handoff_id, seq, state)
            case pipe.ProgressLine(handoff_id=handoff_id) if self.started:
                job_id = self.job_ids.get(handoff_id)
                if job_id is not None:
                    self._channel.report_progress((job_id, handoff_id), m.fraction, m.message)
            case pipe.PongLine(rss=rss) if self.started:
                self.last_pong = time.monotonic()
                self._sampled(rss)
            case pipe.SampleLine(rss=rss) if self.started:
                self._sampled(rss)
            case other:
                raise ValueError(f"unexpected child message {type(other).__name__}")

    def _checkpoint(self, handoff_id: uuid.UUID, seq: int, state: object) -> None:
        """Pass a job's checkpoint to the worker, and its answer back to the child."""
        job_id = self.job_ids.get(handoff_id)
        if job_id is None:
            raise ValueError(f"checkpoint for a job this child is not running: {handoff_id}")
        saved = asyncio.ensure_future(
            self._channel.save_checkpoint((job_id, handoff_id), seq, state)
        )

        def answer(done: asyncio.Future[None]) -> None:
            exc = None if done.cancelled() else done.exception()
            if done.cancelled():
                exc = asyncio.CancelledError()
            line = pipe.CheckpointAckLine(handoff_id, seq)
            if exc is not None:
                # Here, not at the top: the child imports this module, and the error table
                # would load the wire protocol into every child for a rare path.
                from broker.wire import errors as error_codes

                line = pipe.CheckpointAckLine(
                    handoff_id, seq, error_codes.code_of(exc), str(exc) or type(exc).__name__
                )
            self.send(line)

        saved.add_done_callback(answer)

    def _sampled(self, rss: int) -> None:
        self.rss = rss
        if self._on_sample is not None:
            self._on_sample(self)

    async def _relay_output(self) -> None:
        """Log the child's output until it closes, whatever it writes: the child blocks
        once the pipe is full, so a relay that stopped reading would hang its jobs."""
        assert self._proc is not None and self._proc.stdout is not None
        stdout = self._proc.stdout
        relay = OutputRelay(self.pid)
        try:
            while True:
                try:
                    # While lines are being suppressed, wake up to report how many even
                    # if the child has gone quiet.
                    wait = OUTPUT_SUMMARY_AFTER if relay.suppressed else None
                    chunk = await asyncio.wait_for(stdout.read(OUTPUT_CHUNK_BYTES), wait)
                except TimeoutError:
                    relay.report_suppressed()
                    continue
                if not chunk:
                    break
                relay.feed(chunk)
        except OSError:
            pass
        finally:
            relay.close()  # also when cancelled at the child's exit: the count is still owed

    def _finish(self, code: int | None) -> None:
        self.exited = True
        self.exit_code = code
        if self._exit_timer is not None:
            self._exit_timer.cancel()
        for task in self._tasks:
            task.cancel()
        if self._channel_in is not None:
            self._channel_in.close()
        self._fail_start(f"the runner process {describe_exit(code)} before it was ready")
        for handoff_id, future in list(self.inflight.items()):
            if future.done():
                continue
            if not self.started:
                future.set_result(
                    Released(f"the runner process could not start: {self.startup_error}")
                )
            else:
                reason = self.kill_reasons.get(handoff_id)
                if reason is None or handoff_id in self.bystanders:
                    # Nothing this job did ended it: the attempt is lost, not failed.
                    reason = (
                        reason or f"the runner process {describe_exit(code)} while running the job"
                    )
                    future.set_result(Failed(reason, lost=True))
                else:
                    future.set_result(Failed(reason))
        self.inflight.clear()
        self._on_exit(self)

    def reserve(self, assignment: Assignment) -> asyncio.Future[RunOutcome]:
        """Take a slot now (synchronously); the job is sent once the child is ready."""
        future: asyncio.Future[RunOutcome] = self.loop.create_future()
        self.inflight[assignment.handoff_id] = future
        self.job_ids[assignment.handoff_id] = assignment.job_id
        return future

    def send(self, message: pipe.ToChild) -> None:
        """Queue a message for the child; messages queued in one event-loop turn go out
        as one line in one write, because a system call per job was the pooled path's
        largest cost.

        Raises ``ValueError`` if ``message`` cannot be encoded; nothing is queued.
        """
        if self._proc is None or self._proc.stdin is None or self.exited:
            return
        self._outgoing.append(pipe.encode(message))
        if len(self._outgoing) == 1:
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        lines, self._outgoing = self._outgoing, []
        if self._proc is None or self._proc.stdin is None or self.exited or not lines:
            return
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            self._proc.stdin.write(pipe.encode_batch(lines))

    def retire(self) -> None:
        """No more jobs: the job channel closes, and the child exits, once it is idle.

        Not before: a job still running there gets its checkpoint acknowledgements over
        that channel, and would wait for them for ever."""
        self.retiring = True
        if not self.inflight:
            self._close_input()

    def _close_input(self) -> None:
        self._flush()
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.close()
        self._expect_exit()

    def _expect_exit(self) -> None:
        """The child has no more jobs and ends on its own, once the app's shutdown hooks
        have run: it gets the kill grace for them, then it is stopped, so a hook that
        hangs cannot keep a process (and a forked job's slot) for ever."""
        if self._exit_timer is None and not self.exited:
            grace = self._kill_grace
            self._exit_timer = self.loop.call_later(grace, self.terminate_soon, grace)

    def stop_bystanders(self, reason: str) -> None:
        """Every other job running here is about to be stopped for ``reason`` (another
        job's timeout or cancel): each keeps the first reason it was given."""
        for other in self.inflight:
            if other not in self.kill_reasons:
                self.kill_reasons[other] = reason
                self.bystanders.add(other)

    def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    async def terminate(self, grace: float) -> None:
        """SIGTERM, then SIGKILL if the child is still there after ``grace`` seconds."""
        if self._proc is None and not self._boot.done():
            self.retiring = True  # being created: ``_start`` closes its job channel at once
        elif self._proc is None or self._proc.returncode is not None:
            return
        else:
            with contextlib.suppress(ProcessLookupError):
                self._proc.terminate()
        try:
            await asyncio.wait_for(asyncio.shield(self._boot), grace)
        except TimeoutError:
            self.kill()
        await asyncio.shield(self._boot)

    def terminate_soon(self, grace: float) -> None:
        """:meth:`terminate` in the background (a job's timer cannot await it)."""
        if self._stopper is None or self._stopper.done():
            self._stopper = self.loop.create_task(self.terminate(grace))

    async def closed(self) -> None:
        await asyncio.shield(self._boot)


def run_on_child(
    child: ChildProcess,
    assignment: Assignment,
    limit: float | None,
    kill_grace: float,
) -> asyncio.Future[RunOutcome]:
    """Start one job on ``child`` (a slot must already be reserved) and return the future
    of its outcome: the slot's own, which the child's outcome line or its exit settles.
    No task per job: the job goes out now, or when the child is ready, by callback.

    The time ``limit`` counts from the moment the job goes to a ready child, never from
    the child's spawn: a child's start-up (its interpreter, the app's imports) is not the
    job's time. Counted from the spawn, a job whose limit is shorter than the start-up
    stopped its child before it was ready, which gave the job back unstarted and flagged
    the mode broken, for ever. A child that never gets ready is bounded by the start-up
    timeout instead (see :class:`ChildProcess`).

    A job past its time limit stops the whole child (SIGTERM, then SIGKILL after the grace):
    only a process boundary can stop code that ignores cancellation. Every other job on
    that child then fails too, saying why, so each is retried.
    """
    future = child.inflight[assignment.handoff_id]
    if child.started:
        _start_job(child, assignment, limit, kill_grace)
    else:
        child.when_ready(functools.partial(_start_job, child, assignment, limit, kill_grace))
    return future


def _start_job(
    child: ChildProcess, assignment: Assignment, limit: float | None, kill_grace: float
) -> None:
    """Send the job to its ready child and start its clock (no timer without a limit)."""
    future = child.inflight.get(assignment.handoff_id)
    if future is None or future.done():
        return  # settled while the child was starting (its exit, a cancel)
    _send_job(child, assignment)
    if limit is not None and not future.done():
        timer = child.loop.call_later(limit, _timed_out, child, assignment, limit, kill_grace)
        future.add_done_callback(lambda _: timer.cancel())


def _send_job(child: ChildProcess, assignment: Assignment) -> None:
    try:
        child.send(pipe.job_line(assignment))
    except ValueError as exc:
        # The job never reached the child: free its slot there and fail it for good (the
        # same arguments would fail the same way).
        future = child.inflight.pop(assignment.handoff_id, None)
        child.job_ids.pop(assignment.handoff_id, None)
        if child.one_shot:
            child.retire()  # started for this job alone: let it exit instead of waiting
        if future is not None and not future.done():
            future.set_result(
                Failed(f"the job cannot be sent to its runner process: {exc}", retry=False)
            )


def _timed_out(child: ChildProcess, assignment: Assignment, limit: float, grace: float) -> None:
    future = child.inflight.get(assignment.handoff_id)
    if future is None or future.done():
        return  # settled in the same loop turn as the timer fired
    child.kill_reasons[assignment.handoff_id] = f"timed out after {limit} s"
    child.stop_bystanders(f"stopped because job {assignment.job_id} on the same process timed out")
    log_event(
        logger,
        logging.WARNING,
        "job timed out, stopping its runner process",
        job_id=assignment.job_id,
        handoff_id=assignment.handoff_id,
        task=assignment.task,
        queue=assignment.queue,
        attempt=assignment.attempt,
        pid=child.pid,
    )
    child.terminate_soon(grace)


async def cancel_on(children: Sequence[ChildProcess], job_id: uuid.UUID, grace: float) -> bool:
    """Stop the process running ``job_id``: the only way to stop arbitrary code. Other
    jobs on that process fail with the reason, and are retried."""
    for child in list(children):
        for handoff_id, running_job in list(child.job_ids.items()):
            if running_job == job_id and handoff_id in child.inflight:
                child.kill_reasons[handoff_id] = "cancelled"
                child.stop_bystanders(
                    f"stopped because job {job_id} on the same process was cancelled"
                )
                await child.terminate(grace)
                return True
    return False


RESPAWN_MAX_DELAY = 30.0
"""The longest wait between probes of a runner whose processes cannot start (the wait
doubles from half a second up to this)."""


class StartupGuard:
    """Keeps a runner whose processes cannot start from driving a crash loop.

    While failing, the runner advertises no slots, so the main sends it nothing; a
    probe process is started after a capped, doubling delay, and the first process
    that completes its handshake restores the slots.
    """

    def __init__(
        self,
        spawn_probe: Callable[[], object],
        on_change: Callable[[], None],
        *,
        first_delay: float = 0.5,
        max_delay: float = RESPAWN_MAX_DELAY,
    ) -> None:
        self.error: str | None = None
        self._spawn_probe = spawn_probe
        self._on_change = on_change
        self._first_delay = first_delay
        self._max_delay = max_delay
        self._delay = first_delay
        self._timer: asyncio.TimerHandle | None = None

    @property
    def failing(self) -> bool:
        return self.error is not None

    def failed(self, error: str) -> None:
        previous = self.error
        self.error = error
        log_event(
            logger, logging.ERROR, "runner process failed to start; slots revoked", error=error
        )
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay, self._probe)
            self._delay = min(self._delay * 2, self._max_delay)
        if error != previous:  # a new error is news too: the worker's status shows it
            self._on_change()

    def succeeded(self) -> None:
        self._delay = self._first_delay
        if self.failing:
            self.error = None
            logger.info("runner process started again; slots restored")
            self._on_change()

    def _probe(self) -> None:
        self._timer = None
        self._spawn_probe()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ChildRunner:
    """What the pooled and forked runners share: the apps their children import, the
    limits every child is held to (a job's timeout, the start-up, the grace between
    SIGTERM and SIGKILL), the start-up guard, and how a job is cancelled and the children
    are stopped. Each subclass says how many children it keeps and what a job runs on."""

    def __init__(
        self,
        apps: Sequence[str],
        registry: TaskRegistry | None,
        default_timeout: float | None,
        kill_grace: float,
        startup_timeout: float,
        respawn_max_delay: float,
    ) -> None:
        self._apps = list(apps)
        self._registry = default_registry if registry is None else registry
        self._default_timeout = checks.optional(checks.positive, "job timeout", default_timeout)
        self._kill_grace = checks.positive("kill grace", kill_grace)
        self._startup_timeout = checks.positive("runner start-up timeout", startup_timeout)
        self._respawn_max_delay = checks.positive("respawn delay cap", respawn_max_delay)
        self._children: list[ChildProcess] = []
        self._channel: JobChannel = NoChannel()
        self._listener: Callable[[], None] = lambda: None
        self._guard: StartupGuard | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False

    def set_capacity_listener(self, listener: Callable[[], None]) -> None:
        self._listener = listener

    def set_job_channel(self, channel: JobChannel) -> None:
        self._channel = channel

    async def cancel(self, job_id: uuid.UUID) -> bool:
        return await cancel_on(self._children, job_id, self._kill_grace)

    async def _stop_children(self, grace: float, *, retire: bool) -> None:
        """Give running jobs ``grace`` seconds, then end every child (``retire``: let an
        idle one close its job channel first, as a pooled child's checkpoints need)."""
        self._stopping = True
        if self._guard is not None:
            self._guard.cancel()
        busy = [f for c in self._children for f in c.inflight.values()]
        if busy and grace > 0:
            await asyncio.wait(busy, timeout=grace)
        children = list(self._children)
        if retire:
            for child in children:
                child.retire()
            # An idle child now ends on its own, after the app's shutdown hooks; a SIGTERM
            # at once would end it before them. It has the kill grace for them.
            idle = [asyncio.ensure_future(c.closed()) for c in children if not c.inflight]
            if idle:
                await asyncio.wait(idle, timeout=self._kill_grace)
        await asyncio.gather(*(c.terminate(self._kill_grace) for c in children))
