"""The worker's rules without its I/O: events in, effects out, no awaits.

:class:`WorkerState` holds everything a worker decides: which ``seq`` it has seen,
which jobs run, the outbox of reports and which of them this connection has not yet
sent, whether it is draining, and how many slots it may advertise. Its methods take
one event each (connected, job received, run entered or finished, ack, cancel, ping,
drain, disconnected) and return the effects the caller must carry out (start this
run, stop that one, wake the sender, begin draining). Messages to send are pulled
with :meth:`WorkerState.outgoing` and :meth:`WorkerState.take_ready` when the sender
runs, so a burst of events still goes out as one batch with one ``ready`` computed
at the last moment (the shape of h11's ``data_to_send``).

``broker.worker.worker.Worker`` owns the runners, the timers and the tasks, and
``broker.worker.link.Link`` the socket and the reconnect loop (its policy is
:mod:`broker.core.reconnect`); they feed events in here and carry the effects out. Everything here
can therefore be tested by calling methods, without a socket or an event loop.

The runners are the source of truth for free slots: events that need them
(:meth:`WorkerState.job_received`, :meth:`WorkerState.take_ready`, and
:meth:`WorkerState.run_finished` / :meth:`WorkerState.capacity_changed` when they
may start a prefetched job) take a snapshot ``free`` of each runner's
``free_slots()`` at that moment.

**The prefetch window.** Beyond its free slots, a worker may hold up to ``prefetch``
jobs per mode in a local window, so a finished job's slot is refilled at once instead
of after a round trip to the main. It advertises ``free slots + prefetch - held`` in
``ready``; a received job waits in the window until a slot frees. In a small window, run
ends make that ``ready`` due only once half of the window has run since the last one, or
the window is empty (:func:`~broker.core.window.ready_worth`: the line economy of a
one-slot worker); a job refused or cancelled makes it due at once. A draining worker
keeps its prefetched jobs and runs them, like its running ones; a fast stop or the
drain deadline gives them back (released, no attempt counted). When the connection
drops they are dropped too: the main has already returned their leases to the queue,
so running them would only run them twice.

**Priority across the window.** A freed slot takes the held job of its mode with the
highest priority, and among equal priorities the one that arrived first (a heap per
mode, :class:`_Window`). Why a heap and not a FIFO, nor a smaller window: in a drain
of short jobs the window holds a few hundred of the backlog's jobs (up to
:data:`~broker.worker.settings.PREFETCH_MAX_PER_SLOT` per slot), and an urgent job
enqueued meanwhile reached the worker at the next credit but then waited behind all of
them (issue 35: p50 31.5 ms where PgQueuer took 4.5 ms). Shrinking the window to what
a refill needs only shortens that wait, and costs the drain its refills (``--prefetch
0`` cost 32% of it); ordered by priority, the urgent job waits for one slot to free,
whatever the window's size, and the window keeps its whole benefit. The main hands jobs
out in the store's order (priority, then ``run_at``, then creation), so within one
priority the arrival order is that order, and jobs of one priority start in it as
before. The rule is the same for every job: what the main's read-ahead and claims in
flight already committed to this worker never delays a higher-priority job once it is
here; the main's side keeps the order up to here (its read-ahead is dropped by an
insert that stands before what it holds, see :class:`broker.core.pacing.ReadAhead`).
"""

from __future__ import annotations

import heapq
import logging
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.core import jobfields as codec
from broker.core.job_log import JobTags, log_job
from broker.core.window import REPORT_HOLD, AdaptiveWindow, ready_worth, report_waits
from broker.core.worker_effects import (
    CheckpointSettled,
    Drain,
    ProgressLater,
    ReportsLater,
    StartRun,
    StopFast,
    StopRun,
    WakeSender,
    WorkerEffect,
)
from broker.core.worker_rules import (
    ProgressThrottle,
    RetryRules,
    checkpoint_refusal,
    fit_report,
    report_for,
    start_failed,
)
from broker.exceptions import ProtocolError, TaskNotFoundError
from broker.jobs import ExecutionMode, JSONValue
from broker.tasks.registry import Task
from broker.tasks.runner import (
    Assignment,
    Failed,
    LeaseKey,
    Released,
    RunOutcome,
)
from broker.wire import messages as protocol
from broker.wire.codec import encode_item
from broker.wire.messages import ErrorCode

PROGRESS_INTERVAL = 1.0
"""Seconds between two progress updates of one job on the wire: a task may report on
every row, the worker sends the latest at most this often (the first at once)."""


class _Window:
    """The prefetched jobs of one mode in the order they start: highest priority first,
    then arrival (see the module docstring). A heap of ``(-priority, arrival, lease)``:
    pushing and taking the next cost a logarithm of the window, not a pass over it.

    A job taken out of the window another way (a cancel, a release) is not searched for
    here: its entry is skipped when it comes up (:meth:`take`), since the job is then no
    longer in ``held``."""

    __slots__ = ("_arrivals", "_heap")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, LeaseKey]] = []
        self._arrivals = 0

    def put(self, key: LeaseKey, priority: int) -> None:
        self._arrivals += 1
        heapq.heappush(self._heap, (-priority, self._arrivals, key))

    def take(self, held: Mapping[LeaseKey, object]) -> LeaseKey | None:
        """The next job to start among those still ``held``; ``None`` when there is none."""
        heap = self._heap
        while heap:
            key = heapq.heappop(heap)[2]
            if key in held:
                return key
        return None

    def clear(self) -> None:
        self._heap.clear()


@dataclass(eq=False)
class _Link:
    """What lives and dies with one connection to the main (its limits, from ``welcome``,
    are a :class:`~broker.core.worker_rules.MainLimits`)."""

    max_line_bytes: int
    max_payload_bytes: int | None
    max_payload_depth: int
    max_checkpoint_bytes: int | None = None
    max_payload_containers: int | None = None
    """The main's container bound (``None``: an older main, which has none)."""
    seen: int = 0
    """The ``seq`` of the last job decided on; ``seq`` starts again at 1 per connection."""
    unsent: deque[LeaseKey] = field(default_factory=deque)
    encoded: dict[LeaseKey, bytes] = field(default_factory=dict)
    """Reports :meth:`WorkerState.outgoing` measured, as encoded for the line: the sender
    packs these very bytes (:meth:`WorkerState.encoded`), so no report is encoded twice."""
    pongs: list[int] = field(default_factory=list)
    draining_sent: bool = False
    unsent_checkpoints: deque[tuple[LeaseKey, int]] = field(default_factory=deque)
    progress_due: bool = False
    unspent: Counter[ExecutionMode] = field(default_factory=Counter)
    """Per mode, the credit the last ``ready`` advertised less the jobs received since:
    what the main still knows of (:func:`~broker.core.window.ready_worth`)."""
    reports_wait: bool = False
    """The reports in :attr:`unsent` wait for the next ``ready`` (or their timer,
    :class:`ReportsLater`): short runs' (:func:`~broker.core.window.report_waits`)."""


class WorkerState:
    """The worker's decisions, with no I/O.

    :param modes: the execution modes this worker has a runner for.
    :param queues: serve only these queues (``None``: every queue).
    :param lookup_task: raises :class:`~broker.exceptions.TaskNotFoundError` for a task
        this worker may not run (``TaskRegistry.get``); a :class:`~broker.tasks.registry.Task` it
        returns also has its job's arguments checked and its retry policy applied.
    """

    def __init__(
        self,
        *,
        modes: Iterable[ExecutionMode],
        queues: Sequence[str] | None,
        lookup_task: Callable[[str], object],
        logger: logging.Logger,
        prefetch: int | Mapping[ExecutionMode, int | AdaptiveWindow] = 0,
        progress_interval: float = PROGRESS_INTERVAL,
    ) -> None:
        self._modes = tuple(modes)
        windows: Mapping[ExecutionMode, int | AdaptiveWindow] = (
            prefetch if isinstance(prefetch, Mapping) else dict.fromkeys(self._modes, prefetch)
        )
        self._adaptive = {
            mode: window for mode, window in windows.items() if isinstance(window, AdaptiveWindow)
        }
        """The modes whose window follows their completion rate (the rest are fixed)."""
        self._prefetch = {
            mode: window.size if isinstance(window, AdaptiveWindow) else window
            for mode, window in windows.items()
        }
        """The window of each mode now (see the module docstring)."""
        if any(window < 0 for window in self._prefetch.values()):
            raise ValueError("prefetch must be 0 or more")
        self._queues = None if queues is None else list(queues)
        self._lookup_task = lookup_task
        self._logger = logger
        self._link: _Link | None = None
        self._running: dict[LeaseKey, Assignment] = {}
        """What each running job is (its task, queue and attempt go on its log lines)."""
        self._rules: dict[LeaseKey, RetryRules] = {}
        """The retry policy and backoff of each running job whose task declares one."""
        self._starting: Counter[ExecutionMode] = Counter()
        """Jobs started here whose runner has not yet taken their slot (their
        :class:`StartRun` not yet carried out): subtracted from the runner's free slots
        until :meth:`run_entered` says it has."""
        self._queued: dict[LeaseKey, Assignment] = {}
        """Prefetched jobs waiting for a slot, in arrival order (the order they start in
        is :attr:`_windows`')."""
        self._windows: dict[ExecutionMode, _Window] = {}
        """The order each mode's prefetched jobs start in: priority, then arrival."""
        self._held: Counter[ExecutionMode] = Counter()
        """Prefetched jobs per mode: the credit of every job received and every ``ready``
        subtracts them, and counting the FIFO each time cost a pass over the window."""
        self._outbox: dict[LeaseKey, protocol.Report] = {}
        self._given_up: set[LeaseKey] = set()
        self._cancelled: set[LeaseKey] = set()
        """Jobs the main cancelled while they ran here: their end (however the runner
        words it) and the main's ``stale`` answer to its report are the cancel working,
        not failures, and are logged as such."""
        self._ready_due = False
        self._reports_timer = False
        """A :class:`ReportsLater` timer is set and has not fired: reports that start to
        wait before it fires go when it does, so none waits longer than its delay."""
        self._freed: Counter[ExecutionMode] = Counter()
        """Runs ended per mode since the last ``ready`` (:func:`~broker.core.window.ready_worth`
        looks at them at every run's end); a mode is here without a ``ready`` due only
        while its window still holds a job, so a slot never waits on it."""
        self._entered_at: dict[LeaseKey, float] = {}
        """When each running job's runner took its slot (loop time), for its run's length."""
        self._draining = False
        self._fast = False
        self._checkpoints: dict[LeaseKey, dict[int, JSONValue]] = {}
        """Checkpoints not yet acknowledged, by lease and number: sent again on every new
        connection until the main answers (their tasks are waiting)."""
        self._progress = ProgressThrottle(progress_interval)
        self._start_failures: dict[uuid.UUID, int] = {}
        """Start-up failures of its runner process per job id (see :meth:`_start_failed`),
        least recently failed first; at most :data:`RUNNER_START_FAILURES_TRACKED`."""

    # ------------------------------------------------------------------ views

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def fast(self) -> bool:
        """A fast stop was asked for: running jobs are given back, not waited for."""
        return self._fast

    @property
    def running(self) -> Mapping[LeaseKey, Assignment]:
        """Leases with a run started and not finished, and the job each runs (its mode,
        and the task, queue and attempt its log lines carry)."""
        return self._running

    @property
    def queued(self) -> Mapping[LeaseKey, Assignment]:
        """Prefetched jobs not yet started, in the order they arrived (they start highest
        priority first, see the module docstring)."""
        return self._queued

    @property
    def outbox(self) -> Mapping[LeaseKey, protocol.Report]:
        """Reports not yet acknowledged, in the order they were made."""
        return self._outbox

    @property
    def idle(self) -> bool:
        return not self._running and not self._queued

    @property
    def flushed(self) -> bool:
        """Every report was acknowledged: a draining worker may exit."""
        return not self._outbox

    def held_leases(self) -> list[LeaseKey]:
        """What ``hello`` lists: leases with a running or prefetched job or an
        unacknowledged report."""
        return [
            *self._running,
            *self._queued,
            *(key for key in self._outbox if key not in self._running),
        ]

    def prefetching(self) -> list[ExecutionMode]:
        """What ``hello`` lists as its prefetch modes: those whose window holds a job or
        more. A window never shrinks, so the main may keep the last credit of each for a
        job that overtakes the backlog without ever leaving a slot idle
        (:class:`broker.core.peers.Credits`)."""
        return [mode for mode in self._modes if self._prefetch.get(mode, 0) > 0]

    # ------------------------------------------------------------------ connection events

    def connected(self, welcome: protocol.Welcome) -> list[WorkerEffect]:
        """A new connection: every unacknowledged report goes out again (the main fences
        by lease, so a repeat is harmless), and a fresh ``ready`` starts the credit."""
        adopted = {(ref.job_id, ref.handoff_id) for ref in welcome.adopted}
        for key in self.held_leases():
            if key not in adopted:
                self._log_job(
                    logging.INFO, "lease not adopted by the main; its report will be stale", key
                )
        self._link = _Link(
            max_line_bytes=welcome.max_line_bytes,
            max_payload_bytes=welcome.max_payload_bytes,
            max_payload_depth=welcome.max_payload_depth,
            max_checkpoint_bytes=welcome.max_checkpoint_bytes,
            max_payload_containers=welcome.max_payload_containers,
            unsent=deque(self._outbox),
            unsent_checkpoints=deque(
                (key, seq) for key, saves in self._checkpoints.items() for seq in saves
            ),
            progress_due=bool(self._progress.latest),
        )
        self._ready_due = True
        return self._effects()

    def disconnected(self) -> list[WorkerEffect]:
        """The connection is gone: what it had not sent stays in the outbox for the next.

        Prefetched jobs are dropped: the main returns a lost connection's leases to the
        queue (at once, or, when its own stall made this worker give up, at the next
        ``hello``, which does not list them), so they will be handed out again (to this
        worker or another)."""
        self._link = None
        if self._queued:
            self._logger.info(
                "connection lost: dropping %d prefetched jobs; the main gives them back",
                len(self._queued),
                extra={"event": "prefetch_dropped"},
            )
            self._queued.clear()
            self._held.clear()
            for window in self._windows.values():
                window.clear()
        return []

    def ping_received(self, nonce: int) -> list[WorkerEffect]:
        self._require_link().pongs.append(nonce)
        return self._effects()

    def capacity_changed(
        self, free: Mapping[ExecutionMode, int] | None = None
    ) -> list[WorkerEffect]:
        """A runner's free slots may have changed on its own account: start prefetched
        jobs that now have a slot (given ``free``), and re-advertise."""
        self._ready_due = True
        return self._start_queued(free) + self._effects()

    # ------------------------------------------------------------------ job events

    def job_received(
        self, msg: protocol.JobHandoff, free: Mapping[ExecutionMode, int]
    ) -> list[WorkerEffect]:
        """One job handed over on its own: see :meth:`jobs_received`."""
        return self.jobs_received((msg,), free)

    def jobs_received(
        self, msgs: Sequence[protocol.JobHandoff], free: Mapping[ExecutionMode, int]
    ) -> list[WorkerEffect]:
        """Decide the fate of the jobs of one ``jobs`` line and advance ``seen`` in the
        same step, so no ``ready`` can count their slots twice. ``free``: each runner's
        free slots right now. The jobs taken wait in the window until all are decided,
        then start together, as many as have room, highest priority first: a line's
        urgent job never waits behind the line's others. As for credit it is the same as
        one at a time (each taken job counts against it, and none starts between two of
        them), for one count of the slots per line instead of per job.

        Raises :class:`~broker.exceptions.ProtocolError`, before taking any of them, if
        ``seq`` does not advance from job to job.
        """
        link = self._require_link()
        last = link.seen
        for msg in msgs:
            if msg.seq <= last:
                raise ProtocolError(f"job seq {msg.seq} is not after the last one seen ({last})")
            last = msg.seq
        for msg in msgs:
            link.unspent[msg.execution_mode] -= 1
            key = (msg.job_id, msg.handoff_id)
            held = False
            if key in self._running or key in self._queued or key in self._outbox:
                # Never run one lease twice, and never release it: that would free a job
                # this worker is still running or has already reported.
                self._log_job(logging.WARNING, "job already held here; ignoring the repeat", key)
            else:
                held = self._decide(msg, key, free)
            if not held:
                # The main holds a credit for this job until a ``ready`` has seen it;
                # without one, a worker whose every slot was "spent" this way would never
                # get work again.
                self._ready_due = True
        link.seen = last
        started = self._start_queued(free)
        # The jobs received spent credit the main knew of: a slot freed since the last
        # ready that was not worth one while the main knew of more (its next jobs were
        # coming) may be now, with the window empty and the main's credit down to the
        # spare it keeps (a window grown at a run's end left a slot idle until the next).
        if self._freed and not self._ready_due:
            self._ready_due = self._worth_a_ready(free)
        return started + self._effects()

    def _decide(
        self, msg: protocol.JobHandoff, key: LeaseKey, free: Mapping[ExecutionMode, int]
    ) -> bool:
        """Take the job into the window (it starts from there at once if a slot is
        free), or report why not; says whether it was taken."""
        mode = msg.execution_mode
        if self._draining:
            self._release(key, "the worker is draining", msg)
            return False
        if mode not in self._modes:
            self._release(key, f"this worker does not run {mode} jobs", msg)
            return False
        if self._queues is not None and msg.queue not in self._queues:
            self._release(key, f"this worker does not serve queue {msg.queue!r}", msg)
            return False
        try:
            # Checked here as well as in the runner, so an unknown name never reaches a
            # child process and never costs a slot.
            task = self._lookup_task(msg.task)
        except TaskNotFoundError as exc:
            log_job(self._logger, logging.ERROR, "job failed: unknown task", key, msg)
            self._report(key, protocol.FailedReport(*key, error=str(exc), retry=False))
            return False
        if isinstance(task, Task):
            try:
                # A job stored by name (the CLI, a client without the task module) was
                # never bound; arguments that do not fit fail every run alike.
                task.check_arguments(msg.args, msg.kwargs)
            except TypeError as exc:
                log_job(self._logger, logging.ERROR, "job failed: bad arguments", key, msg)
                error = f"{exc} (not retried: the same arguments fail on every run)"
                self._report(key, protocol.FailedReport(*key, error=error, retry=False))
                return False
        if self._credit(mode, free) <= 0:
            self._release(key, f"no free {mode} slot", msg)
            return False
        self._queued[key] = codec.assignment(msg)
        self._held[mode] += 1
        window = self._windows.get(mode)
        if window is None:
            window = self._windows[mode] = _Window()
        window.put(key, msg.priority)
        return True

    def _room(self, mode: ExecutionMode, free: Mapping[ExecutionMode, int]) -> int:
        """Slots of ``mode`` a job can start in now."""
        return max(0, free.get(mode, 0) - self._starting[mode])

    def _unqueue(self, key: LeaseKey) -> Assignment | None:
        """Take a prefetched job out of the window (it starts, or goes back unstarted);
        its entry in :attr:`_windows` is skipped when it comes up."""
        assignment = self._queued.pop(key, None)
        if assignment is not None:
            self._held[assignment.execution_mode] -= 1
            if not self._queued:  # whatever the windows still list was taken out: drop it
                for window in self._windows.values():
                    window.clear()
        return assignment

    def _credit(self, mode: ExecutionMode, free: Mapping[ExecutionMode, int]) -> int:
        """Jobs of ``mode`` this worker can take now: its room plus the prefetch window,
        less the prefetched jobs it already holds."""
        return max(0, self._room(mode, free) + self._prefetch.get(mode, 0) - self._held[mode])

    def _start_queued(self, free: Mapping[ExecutionMode, int] | None) -> list[WorkerEffect]:
        """Start prefetched jobs while their mode has room, each mode's highest priority
        first, then oldest (see the module docstring).

        The rooms are counted first, so a full window is not looked at for every job
        received while each slot is busy."""
        if free is None or not self._queued:
            return []
        chosen: list[LeaseKey] = []
        for mode, held in self._held.items():
            left = self._room(mode, free) if held else 0
            window = self._windows[mode] if left > 0 else None
            while window is not None and left > 0:
                key = window.take(self._queued)
                if key is None:
                    break
                chosen.append(key)
                left -= 1
        effects: list[WorkerEffect] = []
        debug = self._logger.isEnabledFor(logging.DEBUG)  # then no fields are built per job
        for key in chosen:
            assignment = self._queued[key]
            mode = assignment.execution_mode
            self._unqueue(key)
            self._starting[mode] += 1
            self._running[key] = assignment
            self._remember_rules(key, assignment.task, assignment.attempt)
            if debug:
                self._log_job(logging.DEBUG, "job started", key, mode=mode.value)
            effects.append(StartRun(assignment))
        return effects

    def _remember_rules(self, key: LeaseKey, name: str, attempt: int) -> None:
        """Keep the retry policy and backoff of a job's task while it runs, to judge its
        failure."""
        try:
            task = self._lookup_task(name)
        except TaskNotFoundError:
            return
        if isinstance(task, Task) and (task.retry is not None or task.backoff is not None):
            self._rules[key] = RetryRules(task.retry, task.backoff, attempt)

    def run_entered(self, key: LeaseKey, now: float | None = None) -> list[WorkerEffect]:
        """The runner took the job's slot at ``now`` (loop time, for an adaptive window;
        ``None``: not known): its own count now covers it."""
        self._starting[self._running[key].execution_mode] -= 1
        if now is not None and self._adaptive:
            self._entered_at[key] = now
        return []

    def run_finished(
        self,
        key: LeaseKey,
        outcome: RunOutcome | None,
        free: Mapping[ExecutionMode, int] | None = None,
        now: float | None = None,
    ) -> list[WorkerEffect]:
        """A run ended with ``outcome`` (``None``: abandoned while shutting down, nothing
        to report) at ``now`` (loop time, for an adaptive window); its report joins the
        outbox, the next prefetched job (highest priority, then oldest) takes its slot
        (given ``free``, the runners' slots now), and the rest is advertised."""
        mode = self._running[key].execution_mode  # kept until its report is logged
        window = self._adaptive.get(mode)
        entered = self._entered_at.pop(key, None)
        ran = None if entered is None or now is None else now - entered
        if window is not None and now is not None and window.finished(now, ran):
            self._prefetch[mode] = window.size
        self._progress.forget(key)  # the outcome supersedes any progress not sent yet
        if isinstance(outcome, Released):
            outcome = self._start_failed(key, outcome)
        elif self._start_failures and outcome is not None:
            self._start_failures.pop(key[0], None)  # it ran: its count starts again
        rules = self._rules.pop(key, None) if self._rules else None
        if isinstance(outcome, Failed) and outcome.retry and not outcome.lost and rules:
            outcome = rules.judge(outcome)  # a lost attempt is a recovery, not a failure
        if outcome is None:
            self._given_up.discard(key)
        else:
            self._finish(key, outcome)
        del self._running[key]
        started = self._start_queued(free)
        self._freed[mode] += 1
        self._ready_due = self._ready_due or self._worth_a_ready(free)
        timer = self._hold_reports(None if outcome is None else ran, mode)
        return started + timer + self._effects()

    def _hold_reports(self, ran: float | None, mode: ExecutionMode) -> list[WorkerEffect]:
        """After a run of ``mode`` ended (``ran``: its length, ``None`` when unknown or it
        made no report): the unsent reports wait for the next ``ready`` if this run's may
        (:func:`~broker.core.window.report_waits`; never while draining), with a timer
        set for the longest they may; else they go now, those waiting included."""
        link = self._link
        if link is None:
            return []
        # The runs are looked for only when no ready is due: never for a wide window's.
        link.reports_wait = (
            not self._draining
            and not self._ready_due
            and report_waits(self._ready_due, ran, self._more_runs(mode))
        )
        if not link.reports_wait or self._reports_timer:
            return []
        self._reports_timer = True
        return [ReportsLater(REPORT_HOLD)]

    def _more_runs(self, mode: ExecutionMode) -> bool:
        """Whether a job of ``mode`` is held or running: a run's end is still to come."""
        return self._held[mode] > 0 or any(
            job.execution_mode is mode for job in self._running.values()
        )

    def reports_due(self) -> list[WorkerEffect]:
        """The timer of :class:`ReportsLater` fired: the reports waiting go now."""
        self._reports_timer = False
        link = self._link
        if link is None or not link.reports_wait:
            return []
        link.reports_wait = False
        return self._effects()

    def _worth_a_ready(self, free: Mapping[ExecutionMode, int] | None) -> bool:
        """Whether the credit the runs that ended freed is worth a ``ready`` now
        (:func:`~broker.core.window.ready_worth`); without ``free`` (a run abandoned at
        shut-down), it is."""
        link = self._link
        if free is None or link is None:  # a new connection's ready is due anyway
            return True
        unspent = link.unspent
        return any(
            ready_worth(self._prefetch.get(mode, 0), self._held[mode], freed, unspent[mode])
            for mode, freed in self._freed.items()
        )

    def _start_failed(self, key: LeaseKey, outcome: Released) -> RunOutcome:
        """The runner could not start a process for the job: counted against the job
        (:func:`~broker.core.worker_rules.start_failed`), unless the main cancelled it or
        this worker's drain stopped it (their release is the cancel or the stop working)."""
        if key in self._cancelled or self._draining:
            return outcome
        return start_failed(self._start_failures, key[0], outcome)

    def _finish(self, key: LeaseKey, outcome: RunOutcome) -> None:
        cancelled = bool(self._cancelled) and key in self._cancelled
        given_up = bool(self._given_up) and key in self._given_up
        report, level, event, fields = report_for(key, outcome, cancelled, given_up)
        self._log_job(level, event, key, **fields)
        if self._given_up:
            self._given_up.discard(key)
        self._report(key, report)

    def cancel_received(self, msg: protocol.CancelJob) -> list[WorkerEffect]:
        """The main cancelled this job: stop it. Its outcome is still reported, and the
        main acknowledges it ``stale`` because the store already says ``cancelled``."""
        key = (msg.job_id, msg.handoff_id)
        if (queued := self._unqueue(key)) is not None:
            self._release(key, "cancelled before it started", queued)
            self._ready_due = True
            return self._effects()
        running = self._running.get(key)
        if running is None:
            self._log_job(logging.INFO, "cancel for a job not running here; nothing to stop", key)
            return []
        self._log_job(logging.INFO, "job cancelled by the main; stopping it", key)
        self._cancelled.add(key)
        return [StopRun(key, running.execution_mode)]

    def ack_received(self, ack: protocol.ReportAck) -> list[WorkerEffect]:
        """The main settled a report (applied, duplicate, stale or refused): forget it."""
        key = (ack.job_id, ack.handoff_id)
        report = self._outbox.pop(key, None)
        if report is None:
            return []  # an ack for a report re-sent on an earlier connection, already settled
        cancelled = bool(self._cancelled) and key in self._cancelled
        if cancelled:
            self._cancelled.discard(key)
        if cancelled and ack.status is protocol.AckStatus.STALE:
            self._log_job(
                logging.INFO, "cancelled job's report acknowledged stale, as expected", key
            )
        elif ack.status is protocol.AckStatus.STALE:
            self._log_job(
                logging.WARNING,
                "report stale: the main had moved the job on",
                key,
                outcome=report.type,
            )
        elif ack.status is protocol.AckStatus.REFUSED:
            self._log_job(
                logging.ERROR,
                "report refused: the main could not store it and gave the job back",
                key,
                outcome=report.type,
            )
        elif self._logger.isEnabledFor(logging.DEBUG):  # an enum's value costs, even unused
            self._log_job(logging.DEBUG, "report acknowledged", key, status=ack.status.value)
        return []

    # ------------------------------------------------------------------ checkpoints, progress

    def checkpoint_requested(self, key: LeaseKey, seq: int, state: JSONValue) -> list[WorkerEffect]:
        """A running job saves checkpoint ``seq``: it goes out (and out again on every new
        connection) until the main answers. Refused at once when the run has ended (a
        thread left behind by a timeout, say) or the state is over the main's limit."""
        if key not in self._running:
            return [
                CheckpointSettled(
                    key, seq, ErrorCode.CHECKPOINT_REJECTED, "the job's run has already ended"
                )
            ]
        refusal = checkpoint_refusal(state, self._link)
        if refusal is not None:  # the main would refuse it: say so at once
            return [CheckpointSettled(key, seq, *refusal)]
        self._checkpoints.setdefault(key, {})[seq] = state
        if self._link is not None:
            self._link.unsent_checkpoints.append((key, seq))
        return self._effects()

    def checkpoint_ack_received(self, ack: protocol.CheckpointAck) -> list[WorkerEffect]:
        """The main answered a checkpoint: wake its task with the answer. ``applied`` and
        ``duplicate`` both mean durable (a duplicate was stored on an earlier send)."""
        key = (ack.job_id, ack.handoff_id)
        saves = self._checkpoints.get(key)
        if saves is None or ack.seq not in saves:
            return []  # answered already, on an earlier connection
        del saves[ack.seq]
        if not saves:
            del self._checkpoints[key]
        if ack.status in (protocol.AckStatus.APPLIED, protocol.AckStatus.DUPLICATE):
            return [CheckpointSettled(key, ack.seq)]
        self._log_job(logging.WARNING, "checkpoint not saved", key, status=ack.status.value)
        code = ack.code or ErrorCode.CHECKPOINT_REJECTED
        message = ack.message or f"the main answered {ack.status.value}"
        return [CheckpointSettled(key, ack.seq, code, message)]

    def progress_reported(
        self, key: LeaseKey, fraction: float, message: str, now: float
    ) -> list[WorkerEffect]:
        """A running job's progress: kept as its latest, and sent at most once per
        ``progress_interval`` per job (see :meth:`outgoing`); a job's first goes at once."""
        if key not in self._running:
            return []
        self._progress.latest[key] = (fraction, message)
        return self._progress_effects(now)

    def progress_due(self, now: float) -> list[WorkerEffect]:
        """The timer of :class:`ProgressLater` fired."""
        self._progress.timer = False
        return self._progress_effects(now)

    def _progress_effects(self, now: float) -> list[WorkerEffect]:
        link = self._link
        if link is None or not self._progress.latest:
            return []
        due, delay = self._progress.plan(now)
        effects: list[WorkerEffect] = []
        if due:
            link.progress_due = True
            effects += self._effects()
        if delay is not None:
            effects.append(ProgressLater(delay))
        return effects

    # ------------------------------------------------------------------ stopping

    def drain_requested(self, fast: bool = False) -> list[WorkerEffect]:
        """Start draining: advertise no slots, say ``draining``, release jobs that arrive.
        A second request (or ``fast``) gives running jobs back instead of waiting."""
        effects: list[WorkerEffect] = []
        if not self._draining:
            self._draining = True
            self._ready_due = True
            self._logger.info(
                "draining: %d running, %d reports unacknowledged",
                len(self._running),
                len(self._outbox),
                extra={"event": "draining"},
            )
            effects.append(Drain())
            if not fast:
                return effects + self._effects()
        if not self._fast:
            self._fast = True
            self._logger.warning(
                "stopping fast: cancelling %d running jobs",
                len(self._running),
                extra={"event": "stopping_fast"},
            )
            self.give_back_queued()
            effects.append(StopFast())
        return effects + self._effects()

    def give_back_queued(self) -> list[WorkerEffect]:
        """Release every prefetched job unstarted (a fast stop, or the drain deadline):
        it goes back to the queue without an attempt counted."""
        for key in list(self._queued):
            self._release(key, "the worker stopped before the job started", self._unqueue(key))
        return self._effects()

    def stop_run(self, key: LeaseKey, *, give_up: bool) -> StopRun | None:
        """Stop a running job at the drain deadline: it fails (it ran too long), unless
        ``give_up``, when it is released back to the queue unharmed. ``None`` if the job
        has already ended (the caller stops jobs one at a time, awaiting each)."""
        running = self._running.get(key)
        if running is None:
            return None
        if give_up:
            self._given_up.add(key)
        return StopRun(key, running.execution_mode)

    # ------------------------------------------------------------------ sending

    def outgoing(self, now: float = 0.0) -> list[protocol.Message]:
        """Everything due on the connection except ``ready``: pongs, ``draining`` once,
        checkpoints, the progress due at ``now``, then reports in outbox order (each made
        sendable)."""
        link = self._require_link()
        batch: list[protocol.Message] = [protocol.Pong(nonce=n) for n in link.pongs]
        link.pongs.clear()
        if self._draining and not link.draining_sent:
            batch.append(protocol.Draining())
            link.draining_sent = True
        while link.unsent_checkpoints:
            key, seq = link.unsent_checkpoints.popleft()
            saves = self._checkpoints.get(key)
            if saves is not None and seq in saves:
                batch.append(protocol.SaveCheckpoint(*key, seq=seq, state=saves[seq]))
        if link.progress_due:
            link.progress_due = False
            batch += self._progress.take_due(now)
        while link.unsent:
            key = link.unsent.popleft()
            report = self._outbox.get(key)
            if report is not None:
                batch.append(self._sendable(key, report, link))
        link.reports_wait = False
        return batch

    def take_ready(self, free: Mapping[ExecutionMode, int]) -> protocol.Ready | None:
        """The ``ready`` due, if one is, computed from ``free`` (each runner's free slots
        now) at the moment it is sent: exact credit, never more than the runners have."""
        if not self._ready_due:
            return None
        self._ready_due = False
        self._freed.clear()
        slots = {mode: 0 if self._draining else self._credit(mode, free) for mode in self._modes}
        link = self._require_link()
        link.unspent = Counter(slots)
        return protocol.Ready(slots=slots, seen=link.seen)

    def _sendable(self, key: LeaseKey, report: protocol.Report, link: _Link) -> protocol.Report:
        """``report`` if the main can take it; otherwise the failure that replaces it in
        the outbox (:func:`~broker.core.worker_rules.fit_report`)."""
        fitted, link.encoded[key], problem = fit_report(key, report, link)
        if problem is not None:
            self._log_job(logging.ERROR, "report replaced", key, reason=problem[:200])
            self._outbox[key] = fitted
        return fitted

    def encoded(self, report: protocol.Report) -> bytes:
        """``report`` (from :meth:`outgoing`) as encoded when it was measured."""
        key = (report.job_id, report.handoff_id)
        line = self._require_link().encoded.pop(key, None)
        # Absent only if one lease's report was listed twice: encode the repeat again.
        return encode_item(report) if line is None else line

    # ------------------------------------------------------------------ helpers

    def _require_link(self) -> _Link:
        if self._link is None:
            raise RuntimeError("no connection: this event comes only from a connected main")
        return self._link

    def _release(self, key: LeaseKey, reason: str, job: JobTags | None = None) -> None:
        log_job(self._logger, logging.INFO, "job released", key, job, reason=reason)
        self._report(key, protocol.ReleaseReport(*key, reason=reason))

    def _report(self, key: LeaseKey, report: protocol.Report) -> None:
        """``report`` joins the outbox and goes out at the next send, with any report
        waiting for a ``ready``: only a run's end puts reports on hold
        (:meth:`_hold_reports`, after this)."""
        self._outbox[key] = report
        if self._link is not None:
            self._link.unsent.append(key)
            self._link.reports_wait = False

    def _effects(self) -> list[WorkerEffect]:
        """``[WakeSender()]`` if the connection has something to send, else nothing."""
        link = self._link
        if link is None:
            return []
        due = (
            link.pongs
            or (link.unsent and not link.reports_wait)
            or link.unsent_checkpoints
            or link.progress_due
            or self._ready_due
            or (self._draining and not link.draining_sent)
        )
        return [WakeSender()] if due else []

    def job_of(self, key: LeaseKey) -> Assignment | None:
        """The job running (or waiting for a slot) under ``key``, if any."""
        return self._running.get(key) or self._queued.get(key)

    def _log_job(self, level: int, event: str, key: LeaseKey, **fields: Any) -> None:
        if self._logger.isEnabledFor(level):
            log_job(self._logger, level, event, key, self.job_of(key), **fields)
