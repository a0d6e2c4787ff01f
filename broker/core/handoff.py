"""The main's handoff rules, without I/O: events in, effects out.

:class:`Handoff` holds everything the main knows about who may run what: the peers
(per connection: role, worker id, modes, queues, credits, held leases, draining), the
handoffs found in the store after a restart (*orphans*), the claims in flight and the
leases waiting to go back to the store (the recovery ledger's entries). It never awaits,
reads a clock or touches a socket: :class:`broker.main.main.Main` feeds it events (a
hello, a ``ready``, a batch of eligible jobs, a claim's result, a report, a disconnect, a
liveness tick, a pause of a connection's outbox...) and carries out the effects it
returns (:class:`Send`, :class:`Dispatch`, :class:`ReturnLease`, :class:`Abort`,
:class:`Settle`, :class:`ClaimJobs`, :class:`WakeDispatcher`...), in order. That is what
lets ``tests/unit/test_handoff.py`` drive it through random interleavings and check its
invariants after every step.

Every lease the core mints is, at any moment, in exactly one place: an in-flight claim,
one peer's held leases, the orphans, the parked leases (a connection that ended while the
main itself was stalled, see :meth:`Handoff.disconnect`), or the returns; or it has left
the main for good (not won, settled, returned, cancelled). The rules that keep it so:

1. a claim is planned only against a reserved credit, and its lease is minted here,
   before the store sees the claim;
2. a won claim goes to its peer (and out as a ``job`` message) only if that peer is
   still dispatchable; every other exit of a lease goes through :meth:`Handoff._return`;
3. a report is accepted only from the connection holding its lease (the fence in front
   of the store's fence).

Its parts live beside it, each an idea of its own: a connection's record
(:mod:`broker.core.peers`: credits, liveness), the effects (:mod:`broker.core.effects`),
the drained proofs (:mod:`broker.core.drained`), which worker takes a job
(:mod:`broker.core.placement`) and the leases waiting for their worker's hello
(:mod:`broker.core.waiting`). This module keeps the events and the lease bookkeeping.

Decisions are logged under ``broker.main``, where operators look for them.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from broker.core.affinity import DEFAULT_MAX_WAIT
from broker.core.drained import DrainedModes, may_requeue

# The effects are the handoff's vocabulary: importable from here, as its events are.
from broker.core.effects import Abort as Abort
from broker.core.effects import ClaimJobs as ClaimJobs
from broker.core.effects import Dispatch as Dispatch
from broker.core.effects import HandoffEffect as HandoffEffect
from broker.core.effects import PlannedClaim as PlannedClaim
from broker.core.effects import ReturnLease as ReturnLease
from broker.core.effects import Send as Send
from broker.core.effects import Settle as Settle
from broker.core.effects import StoreCheckpoint as StoreCheckpoint
from broker.core.effects import StoreProgress as StoreProgress
from broker.core.effects import WakeDispatcher as WakeDispatcher
from broker.core.effects import checkpoint_ack as checkpoint_ack
from broker.core.effects import report_ack
from broker.core.flow import FlowControl
from broker.core.peers import Credits, Holders, Liveness, Peer, random_ping_base
from broker.core.placement import Placement
from broker.core.waiting import STALL as STALL
from broker.core.waiting import STALL_AFTERMATH as STALL_AFTERMATH
from broker.core.waiting import Parked, WaitingLeases
from broker.core.window import WIDE_LINE_WINDOW
from broker.jobs import (
    DispatchKey,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
    ProgressUpdate,
    dispatch_key,
    random_uuid,
)
from broker.model.bounds import MAX_CREDIT
from broker.model.logs import log_event
from broker.model.rates import Rate
from broker.settlement import claimable_at_enqueue
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")

Leads = Callable[[ExecutionMode, str, DispatchKey], bool]
"""Whether a job of a mode, in a queue, that stands at a key of the dispatch order would
stand before every job of its mode still waiting (:meth:`Handoff.plan_at_enqueue`)."""


@dataclass(frozen=True, slots=True)
class Loss:
    """A lease in the returns whose attempt may have run and was lost: ``job`` as it was
    handed off under it, and why the main took it back."""

    job: Job
    reason: str


LINE = WIDE_LINE_WINDOW
"""The jobs a dispatch pass gives a worker at least, credit and batch allowing
(:func:`pass_size`): the whole window of a one-slot worker of the shortest jobs, which
is free after a ``ready`` of its emptied window (one per half window otherwise,
:func:`broker.core.window.ready_worth`). Half of it (16), 64 x 1, alternating (branch
``fleet3``, load 24-42): the main's CPU per job 53.5 / 49, 53.5 / 52, 54 / 51.5, 53.5
/ 52, 53 / 47.5 µs (16 / 32), the workers' 15% higher."""


def pass_size(batch: int, credits: Iterable[int]) -> int:
    """How many jobs one dispatch pass places, given each worker's free ``credits`` of a
    mode: all of them, up to ``batch``, or up to a line per worker (each worker's credit
    up to :data:`LINE`, or up to ``batch`` if smaller, summed) when that is more.

    Why the second: a pass places its jobs on the workers with the most free credit,
    in turns, so a pass cut short of the credit spreads itself thin: 64 one-slot
    workers of short jobs freed about eight credits each per ``ready``, and a pass of
    256 handed each four, in two ``jobs`` lines a ``ready`` instead of one. Each line
    out comes back as a ``reports`` line and goes out again as an acknowledgement, and
    every line costs the main a system call and the Python around it (issue 35,
    bench/README.md, "fleet3": a pass of a line per worker halved the lines per job at
    64 x 1). A line per worker lets each take its whole ``ready``'s credit at once.
    One worker is never above ``batch`` for it (a line is at most the batch), nor are
    fewer workers than ``batch / LINE``: only a fleet wider than that claims more in
    one call, a line per worker at most."""
    line = min(LINE, batch)
    total = lines = 0
    for credit in credits:
        total += credit
        lines += min(credit, line)
    return min(total, max(batch, lines))


# ---------------------------------------------------------------------- the core


class Handoff:
    """The main's handoff state machine (see the module docstring)."""

    def __init__(
        self,
        *,
        max_credit: int = MAX_CREDIT,
        new_lease: Callable[[], uuid.UUID] | None = None,
        new_ping_base: Callable[[], int] = random_ping_base,
        affinity_grace: float = 60.0,
        affinity_max_wait: float = DEFAULT_MAX_WAIT,
        reconnect_grace: float = 30.0,
    ) -> None:
        self.max_credit = max_credit
        self.waiting = WaitingLeases(reconnect_grace)
        """The orphans and the parked leases (:mod:`broker.core.waiting`)."""
        self.placement = Placement(affinity_grace, affinity_max_wait)
        """Which worker takes a job (:mod:`broker.core.placement`)."""
        self.flow = FlowControl()
        """Paused queues and rate limits (:mod:`broker.core.flow`): a plan places a job
        only if its queue admits it, and spends a token once its slot is reserved."""
        self.affinity = self.placement.affinity
        """Where the holders of local state are; decides who may take their recoveries."""
        self.awaiting = self.placement.awaiting
        """Jobs the last plans held back for their state holder (job id -> holder): the
        dispatcher reads past them, and wakes when one of their graces ends."""
        self._new_lease = new_lease or random_uuid
        self._new_ping_base = new_ping_base
        """Where each connection's :attr:`Liveness.ping_base` comes from (random; a test
        passes a counter), as leases come from ``new_lease``."""
        self._proofs = DrainedModes()
        """The change log and the modes proven drained (:mod:`broker.core.drained`)."""
        self.peers: dict[int, Peer] = {}
        """Connections past their hello, by connection id."""
        self.worker_peers: dict[int, Peer] = {}
        """The worker connections among :attr:`peers`: the only ones that hold leases or
        take jobs. Every report, settle and dispatch step looks a lease or a worker up,
        and a main with hundreds of clients connected (each an app's ``Client``) spent
        more on passing over them than on the lookups themselves."""
        self.holders = Holders()
        """Which worker connection holds each lease (:class:`broker.core.peers.Holders`):
        a report, a settle or a cancel finds its lease without walking every worker."""
        self.claiming: dict[uuid.UUID, PlannedClaim] = {}
        """Planned claims whose store call has not answered yet, by lease."""
        self.returns: dict[uuid.UUID, uuid.UUID] = {}
        """Leases to give back to the store (lease -> job id): the recovery ledger."""
        self.losses: dict[uuid.UUID, Loss] = {}
        """The returns whose attempt was lost (by lease): each counts a recovery."""
        self.dispatched = 0
        self._runnable: frozenset[str] | None = None
        """:meth:`runnable_tasks`, as last worked out."""
        self._runnable_stale = True
        """Whether a worker joined, declared or left since (work it out again)."""
        self._declarations = 0
        """How many ``tasks`` declarations were taken: orders them (newest wins)."""

    @property
    def orphans(self) -> dict[uuid.UUID, Job]:
        """Handoffs found in the store at start-up, waiting for their worker's hello."""
        return self.waiting.orphans

    @property
    def parked(self) -> dict[uuid.UUID, Parked]:
        """Leases of connections that ended while the main was stalled: they wait for
        their worker's hello (see :meth:`disconnect`)."""
        return self.waiting.parked

    def serving(self, now: float) -> None:
        """The main starts serving at ``now``: a state holder it has not seen yet counts
        as having left then, so its recoveries wait the affinity grace from now."""
        self.affinity.started = now

    def new_peer(self, peer_id: int, now: float) -> Peer:
        """The record of a connection just accepted; it joins at :meth:`hello`."""
        liveness = Liveness(last_answer=now, ping_base=self._new_ping_base())
        return Peer(peer_id, liveness, Credits(self.max_credit))

    # ------------------------------------------------------------------ peers

    def hello(
        self, peer: Peer, hello: protocol.Hello
    ) -> tuple[list[protocol.LeaseRef], list[HandoffEffect]]:
        """``peer`` passed its handshake. A worker adopts the leases its hello says it still
        holds, where they are still current; returns those and the effects.

        Three sources: handoffs found in the store at start-up (the main restarted), only
        those the store records for this worker id; leases parked when a connection of
        this worker id ended while the main was stalled (:meth:`disconnect`); and another
        live connection of the same worker id (the worker reconnected before the main
        noticed the old socket was dead), only leases that connection holds for the job
        the hello names. Start-up handoffs and parked leases of this worker that it no
        longer holds go back to the queue now rather than after the grace period.
        Whatever is not adopted stays where it was, and this connection's reports for it
        are answered ``stale`` (see :meth:`report`). The worker id itself is only as
        trustworthy as the shared token.
        """
        peer.role = hello.role
        peer.worker_id = hello.worker_id
        peer.modes = frozenset(hello.modes)
        peer.queues = frozenset(hello.queues) if hello.queues is not None else None
        self.peers[peer.id] = peer
        if hello.role is not protocol.Role.WORKER:
            return [], []
        self.worker_peers[peer.id] = peer
        peer.credits.keep_spare(hello.prefetch_modes)
        self._runnable_stale = True
        # What was proven drained was proven for the modes and queues served until now.
        self.queue_changed()
        self.affinity.joined(hello.worker_id or "", state_kept=not hello.local_state_lost)
        held = {ref.handoff_id: ref.job_id for ref in hello.held_leases}
        adopted: list[protocol.LeaseRef] = []
        effects: list[HandoffEffect] = []
        for lease, job in self.waiting.take(hello.worker_id):
            if held.get(lease) == job.id:
                self.holders.hold(peer, lease, job)
                adopted.append(protocol.LeaseRef(job_id=job.id, handoff_id=lease))
            else:
                effects.append(
                    self._return(job.id, lease, "worker reconnected without this lease", job)
                )
        for other in self.worker_peers.values():
            if other is peer or other.worker_id != peer.worker_id:
                continue
            for lease in [
                lease for lease, job in other.leases.items() if held.get(lease) == job.id
            ]:
                job = other.leases[lease]
                self.holders.drop(lease)
                self.holders.hold(peer, lease, job)
                adopted.append(protocol.LeaseRef(job_id=job.id, handoff_id=lease))
        for ref in adopted:
            log_event(
                logger,
                logging.INFO,
                "lease adopted",
                job_id=ref.job_id,
                handoff_id=ref.handoff_id,
                worker_id=peer.worker_id,
            )
        return adopted, effects

    def declared(
        self,
        peer_id: int,
        tasks: Collection[str],
        rate_limits: Mapping[str, Rate] | None = None,
        keyed: Collection[str] = (),
    ) -> list[HandoffEffect]:
        """A worker declared the ``tasks`` it runs (its ``tasks`` message, taken into the
        catalog): from now on it is handed only jobs of those
        (:meth:`Peer.serves <broker.core.peers.Peer.serves>`). Jobs no worker could run
        until now may go: what was proven drained was proven for the tasks served before.
        ``rate_limits`` are the limits it declared for some of them, per key for those
        in ``keyed`` (see :meth:`_limit_tasks`)."""
        peer = self.worker_peers.get(peer_id)
        if peer is None:
            return []
        peer.tasks = frozenset(tasks)
        self._declarations += 1
        peer.declared_order = self._declarations
        peer.rate_limits = dict(rate_limits or {})
        peer.keyed_limits = frozenset(keyed)
        self._limit_tasks()
        self._runnable_stale = True
        self.queue_changed()
        return [WakeDispatcher()]

    def _limit_tasks(self) -> None:
        """The tasks' rate limits from the connected workers' declarations: the newest
        declaration that limits a task decides its rate (a rolling deploy's new release
        declares last), and a limit no connected worker declares any more (removed from
        the code, its old workers gone) is dropped. Kept in the one place every dispatch
        asks, :class:`FlowControl`, so a limit holds across every worker."""
        rates: dict[str, Rate] = {}
        keyed: dict[str, bool] = {}
        for peer in sorted(self.worker_peers.values(), key=lambda p: p.declared_order):
            rates.update(peer.rate_limits)
            keyed.update((task, task in peer.keyed_limits) for task in peer.rate_limits)
        self.flow.limit_tasks(rates, [task for task, per_key in keyed.items() if per_key])

    def tasks_to_read(self, now: float) -> frozenset[str] | None:
        """The tasks a dispatch read at ``now`` asks for: those some connected worker
        declared (:meth:`runnable_tasks`), less those whose rate limit has no token now
        (:meth:`FlowControl.leave_out_tasks`), so that a head of held-back jobs never
        hides the jobs of other tasks behind it, nor makes the dispatcher read it again
        and again. ``None``: any task.

        While a worker that declared no tasks is connected (it runs any, so
        :meth:`runnable_tasks` is ``None``) and some task is blocked, the read asks for
        the tasks the other workers declared, less the blocked: a task nobody declared
        then waits until the blocked task's next token, or until that worker declares
        (every worker of this release declares right after its welcome). That keeps the
        store's read an allow-list, as routing by task made it, rather than add an
        exclusion to every adapter."""
        blocked = self.flow.leave_out_tasks(now)
        runnable = self.runnable_tasks()
        if not blocked:
            return runnable
        if runnable is None:
            runnable = frozenset().union(
                *(peer.tasks for peer in self.worker_peers.values() if peer.tasks is not None)
            )
        return runnable - blocked

    def runnable_tasks(self) -> frozenset[str] | None:
        """The tasks some connected worker declared, for the dispatcher's read of eligible
        jobs (which leaves the others out, so a backlog no worker can run never hides the
        jobs behind it); ``None`` while a worker that declared no tasks is connected (it
        runs any). Kept until a worker joins, declares or leaves."""
        if self._runnable_stale:
            self._runnable_stale = False
            runnable: set[str] = set()
            for peer in self.worker_peers.values():
                if peer.tasks is None:
                    self._runnable = None
                    break
                runnable |= peer.tasks
            else:
                self._runnable = frozenset(runnable)
        return self._runnable

    def unserved(self, tasks: Iterable[str]) -> list[str]:
        """Those of ``tasks`` no connected worker declared, sorted: their jobs wait (none
        while a worker that declared no tasks is connected, which runs any)."""
        runnable = self.runnable_tasks()
        if runnable is None:
            return []
        return sorted({task for task in tasks if task not in runnable})

    def ready(
        self, peer_id: int, slots: Mapping[ExecutionMode, int], seen: int
    ) -> list[HandoffEffect]:
        """A worker's ``ready``. Raises :class:`~broker.exceptions.ProtocolError` (and
        applies nothing) when it is out of order or over the credit limit."""
        self.peers[peer_id].credits.on_ready(slots, seen)
        return [WakeDispatcher()]

    def draining(self, peer_id: int) -> list[HandoffEffect]:
        """The worker takes no new jobs; its claims in flight go back when they land."""
        peer = self.peers[peer_id]
        peer.draining = True
        log_event(
            logger,
            logging.INFO,
            "worker draining",
            worker_id=peer.worker_id,
            leases=len(peer.leases),
        )
        return []

    def pong(self, peer_id: int, nonce: int, now: float) -> None:
        self.peers[peer_id].liveness.answered(nonce, now)

    # The transport's events about a connection take its record itself: a connection
    # writes before its hello and after its disconnect, when it is in no registry here.

    def paused(self, peer: Peer, now: float) -> None:
        """``peer``'s outbox went over its cap at ``now``: it takes no jobs until
        :meth:`resumed`, and :meth:`tick` drops it once that lasts the liveness timeout."""
        if peer.liveness.paused_since is None:
            peer.liveness.paused_since = now

    def resumed(self, peer: Peer) -> list[HandoffEffect]:
        """``peer``'s outbox is back under its cap. A worker that can take jobs again
        wakes the dispatcher, and what was proven drained is proven no more: it was
        proven for the queues the other workers serve (as after a :meth:`hello`)."""
        if peer.liveness.paused_since is None:
            return []
        peer.liveness.paused_since = None
        if not peer.dispatchable or self.worker_peers.get(peer.id) is not peer:
            return []
        self.queue_changed()
        return [WakeDispatcher()]

    def write_started(self, peer: Peer, now: float) -> None:
        """A write to ``peer`` began at ``now``; :meth:`tick` drops the peer if it has not
        ended (:meth:`write_ended`) within the liveness timeout."""
        peer.liveness.write_started = now

    def write_ended(self, peer: Peer) -> None:
        peer.liveness.write_started = None

    def disconnect(
        self, peer_id: int, now: float, *, stall: float = 0.0, stopping: bool = False
    ) -> list[HandoffEffect]:
        """A connection ended at ``now``. Its leases go back to the queue, unless the main
        is stopping: then the workers keep running their jobs and the next main adopts
        them. A state holder's grace starts now, so jobs waiting for it get a wake-up.

        Unless the main itself was stalled: ``stall`` is how long its loop has been late
        at ``now`` (a stall still being caught up on), and a stall that :meth:`tick`
        measured counts for :data:`STALL_AFTERMATH` after it ended. A worker whose main
        did not answer for its liveness timeout gives the socket up, but keeps running
        its jobs and says hello again with their leases; returning them now would hand
        them out a second time while they run. So they are *parked*: the same worker id
        adopts them at its next hello (:meth:`hello`), or they go back to the queue
        ``reconnect_grace`` after the disconnect (:meth:`tick`), as the orphans of a
        restart do. Only this connection's own leases are parked, each under its own
        lease, so a newer lease is never touched."""
        peer = self.peers.pop(peer_id, None)
        if peer is None:
            return []
        effects: list[HandoffEffect] = []
        if self.worker_peers.pop(peer_id, None) is not None:
            self._runnable_stale = True
            if peer.rate_limits:
                self._limit_tasks()
            log_event(
                logger,
                logging.INFO,
                "worker disconnected",
                worker_id=peer.worker_id,
                session=peer.id,
                returning=len(peer.leases),
            )
            self.affinity.left(peer.worker_id or "", now)
            if peer.worker_id in self.awaiting.values():
                effects.append(WakeDispatcher())
        if stopping:
            pass  # the main is shutting down: the leases stay with their jobs in the store
        elif peer.leases and peer.worker_id and self.waiting.stalled(now, stall):
            self.waiting.park(peer.worker_id, peer.leases, now)
            log_event(
                logger,
                logging.WARNING,
                "worker connection ended while the main was stalled; its leases wait for it "
                "to reconnect",
                worker_id=peer.worker_id,
                session=peer.id,
                parked=len(peer.leases),
                grace=self.waiting.reconnect_grace,
            )
        else:
            for lease, job in peer.leases.items():
                effects.append(self._return(job.id, lease, "worker connection ended", job))
        self.holders.drop_all(peer)
        return effects

    def tick(self, now: float, *, stall: float, timeout: float, ping: bool) -> list[HandoffEffect]:
        """A liveness check at ``now``: abort the peers dead for ``timeout``, ping the rest
        when ``ping``. ``stall`` is how late the check runs: while the main could not
        run, it could neither read answers nor write, so that time is excused; nor could
        a worker whose leases are parked reconnect, so their wait grows by it too. Parked
        leases whose wait is over go back to the queue."""
        reason = "worker did not reconnect within the grace after the main's stall"
        over = self.waiting.expire(now, stall)
        effects: list[HandoffEffect] = [self._return(j.id, lease, reason, j) for lease, j in over]
        for peer in self.peers.values():
            if stall > 0:
                peer.liveness.excuse(stall, now)
            problem = peer.liveness.problem(now, timeout)
            if problem is not None:
                effects.append(Abort(peer.id, problem))
            elif ping:
                effects.append(Send(peer.id, peer.liveness.next_ping()))
        return effects

    # ------------------------------------------------------------------ orphans

    def load_orphans(self, jobs: Iterable[Job]) -> None:
        """Handoffs the store holds at start-up: they wait for their worker's hello."""
        self.waiting.load(jobs)

    def orphans_unloaded(self) -> None:
        """Loading the orphans failed part way: those loaded are dropped, so the next
        attempt reads them whole (no worker was welcomed meanwhile to adopt any)."""
        self.orphans.clear()

    def orphan_deadline(self) -> list[HandoffEffect]:
        """The grace period is over: the orphans nobody adopted go back to the queue."""
        effects: list[HandoffEffect] = [
            self._return(job.id, lease, "worker did not reconnect within the grace period", job)
            for lease, job in self.orphans.items()
        ]
        self.orphans.clear()
        return effects

    # ------------------------------------------------------------------ dispatch

    def workers(self) -> list[Peer]:
        return [peer for peer in self.worker_peers.values() if peer.dispatchable]

    def modes_with_credit(self, *, leading: bool = False) -> set[ExecutionMode]:
        """The modes some dispatchable worker has a free slot of (``leading``: counting
        the spare credits, which only jobs that overtake no waiting job may take:
        :class:`broker.core.peers.Credits`)."""
        modes: set[ExecutionMode] = set()
        for peer in self.workers():
            modes |= peer.credits.modes_with_credit(leading=leading)
        return modes

    def served_queues(self) -> set[str] | None:
        """The queues some dispatchable worker serves; ``None``: some worker serves all."""
        queues: set[str] = set()
        for peer in self.workers():
            if peer.queues is None:
                return None
            queues |= peer.queues
        return queues

    def credit(self, mode: ExecutionMode | None = None, *, leading: bool = False) -> int:
        """Free slots across dispatchable workers, for ``mode`` or for every mode
        (``leading``: counting the spare credits, see :meth:`modes_with_credit`)."""
        workers = self.workers()
        if mode is None:
            return sum(peer.credits.total_available(leading=leading) for peer in workers)
        return sum(peer.credits.available(mode, leading=leading) for peer in workers)

    def read_limit(
        self, batch: int, modes: Iterable[ExecutionMode], *, leading: bool = False
    ) -> int:
        """How many jobs a dispatch read for ``modes`` asks for: the largest free credit
        among them, not their sum, and at most ``batch`` or a line for each worker
        (:func:`pass_size`). Each job takes a slot of its own mode, and a backlog is
        mostly one mode's: asking for the sum (a pooled worker's inline and forked
        slots, free all along) read and decoded rows that no slot could take (the
        dispatcher reads again, for the modes left with free slots, when a read leaves
        some unused)."""
        workers = self.workers()
        return max(
            pass_size(batch, [peer.credits.available(mode, leading=leading) for peer in workers])
            for mode in modes
        )

    def plan(self, jobs: Sequence[Job], now: float, *, leading: bool = False) -> list[PlannedClaim]:
        """A worker and a freshly minted lease for each job that has a free slot somewhere
        (jobs already being claimed are skipped); the slot is reserved now, before the
        claim, and the lease exists before the store ever sees it. A job whose local
        state a worker holds goes only where :meth:`Affinity.route` lets it at ``now``.
        ``leading``: the jobs overtake no waiting job, and may take a worker's spare
        credit (:class:`broker.core.peers.Credits`); a dispatch pass's may not."""
        workers = self.workers()
        claiming = {planned.job.id for planned in self.claiming.values()}
        plan: list[PlannedClaim] = []
        self.affinity.forget_departed(now)
        self.placement.start(workers, leading=leading)
        flow = self.flow
        for job in jobs:
            if job.id in claiming or not flow.admits(job.queue, now, job.task, job.rate_key):
                continue
            peer, route = self.placement.pick(job, now)
            if peer is None or not peer.credits.reserve(job.execution_mode, leading=leading):
                continue  # the credit check: no free slot for this job anywhere
            flow.admitted(job.queue, now, job.task, job.rate_key)
            self.placement.reserved(peer, job.execution_mode)
            self.placement.placed(job)
            planned = PlannedClaim(
                peer.id,
                peer.worker_id or "",
                job,
                self._new_lease(),
                state_lost=route is not None and route.state_lost,
            )
            self.claiming[planned.lease] = planned
            claiming.add(job.id)
            plan.append(planned)
        return plan

    def wake_at(self, now: float) -> float | None:
        """When an idle dispatcher must look again by itself: a job awaiting its state
        holder may go elsewhere (:meth:`Placement.wake_at`, for the modes some worker has
        a free slot of), or a queue held back for a rate limit gets its next token
        (:meth:`FlowControl.wake_at`)."""
        affinity = self.placement.wake_at(self.modes_with_credit())
        times = [t for t in (affinity, self.flow.wake_at(now)) if t is not None]
        return min(times, default=None)

    # The drained proofs (broker.core.drained), as the dispatcher and the enqueue see them.

    def queue_changed(self) -> None:
        """Jobs may have become eligible: no mode counts as drained until a read started
        after this says so (:meth:`DrainedModes.changed`)."""
        self._proofs.changed()

    def jobs_added(self, modes: Iterable[ExecutionMode]) -> None:
        """Queued jobs of ``modes`` were stored, and nothing else changed: only those
        modes stop counting as drained (:meth:`DrainedModes.added`)."""
        self._proofs.added(modes)

    @property
    def drained(self) -> frozenset[ExecutionMode]:
        """The modes an enqueue may hand off at once (see :meth:`plan_at_enqueue`)."""
        return self._proofs.modes

    @property
    def queue_changes(self) -> int:
        """The change count a read started now passes to :meth:`read_eligible`."""
        return self._proofs.count

    def read_eligible(
        self,
        started: int,
        modes: Iterable[ExecutionMode],
        *,
        full: bool,
        queues: Collection[str] | None,
    ) -> None:
        """A read of eligible jobs, begun at change count ``started``, came back and was
        planned: short and all placed, it proves ``modes`` drained in ``queues``
        (:meth:`DrainedModes.read`)."""
        self._proofs.read(started, modes, full=full, queues=queues)

    def plan_at_enqueue(
        self,
        specs: Sequence[JobSpec],
        now: datetime,
        leads: Leads | None = None,
    ) -> list[PlannedClaim | None]:
        """For each job about to be enqueued, a worker and a lease if it can start at once:
        no waiting job would be overtaken (its mode is drained, or ``leads`` says it
        stands before every job of its mode still waiting: see
        :meth:`ReadAhead.leads <broker.core.pacing.ReadAhead.leads>`), it is due, has no
        concurrency key, neither its queue has settings nor its task a rate limit (their
        jobs go through the dispatcher, which asks :mod:`broker.core.flow`), and a serving
        worker has a free slot. The slot is reserved and the lease minted here, before
        the insert, exactly as :meth:`plan` does for a claim; the store's answer comes
        back through :meth:`claimed` (or :meth:`claim_unknown`).

        Overtaking none, such a job may take the spare credit a dispatch pass leaves
        (:class:`broker.core.peers.Credits`): during a drain every other credit goes to
        the backlog's prefetch as soon as it frees, and an urgent job would find none."""
        drained = self._proofs.modes
        covered = bool(drained) and self._proofs.covers(self.served_queues())
        flow = self.flow
        jobs: list[Job | None] = []
        for spec in specs:
            mode = spec.execution_mode
            # The job's own terms first: the read-ahead's word (its dispatch key built,
            # the jobs held searched) is asked only for a job that could go at all.
            go = (
                claimable_at_enqueue(spec, now)
                and not flow.governed(spec.queue)
                and not flow.limits(spec.task)
                and (
                    (covered and mode in drained)
                    or (
                        leads is not None
                        and leads(
                            mode, spec.queue, dispatch_key(spec.priority, spec.run_at or now, now)
                        )
                    )
                )
            )
            jobs.append(Job.from_spec(spec, now) if go else None)
        candidates = [job for job in jobs if job is not None]
        if not candidates:  # the common case behind a backlog: no plan, no walk of workers
            return [None] * len(jobs)
        # One plan for them all, in order, as one plan per job would place them (the same
        # rotation, each reservation seen by the next), without a walk over every worker
        # per job. A new job has no state holder, so the time affinity judges by is moot.
        planned = {p.job.id: p for p in self.plan(candidates, self.affinity.started, leading=True)}
        return [planned.get(job.id) if job is not None else None for job in jobs]

    def claimed(self, claims: Sequence[PlannedClaim], won: Sequence[Job]) -> list[HandoffEffect]:
        """The claim call answered: ``won`` are the jobs it handed off (as claimed). Each
        won job goes to its peer if that peer can still take it, else back to the queue;
        a claim not won just frees its credit."""
        by_id = {job.id: job for job in won}
        effects: list[HandoffEffect] = []
        for planned in claims:
            del self.claiming[planned.lease]
            peer = self.peers.get(planned.peer)
            mode = planned.job.execution_mode
            got = by_id.get(planned.job.id)
            if got is None or got.handoff_id != planned.lease:
                if peer is not None:
                    peer.credits.release(mode)
                # Not won: it may still be queued, and the reads meanwhile skipped it.
                self.queue_changed()
                continue
            if peer is None or not peer.dispatchable:
                if peer is not None:
                    peer.credits.release(mode)
                effects.append(
                    self._return(got.id, planned.lease, "worker left while the claim was in flight")
                )
                continue
            seq = peer.credits.commit(mode)
            self.holders.hold(peer, planned.lease, got)
            self.dispatched += 1
            effects.append(Dispatch(peer.id, seq, got, planned.state_lost))
            if logger.isEnabledFor(logging.DEBUG):  # one line per job: off by default
                log_event(
                    logger,
                    logging.DEBUG,
                    "job handed off",
                    job_id=got.id,
                    handoff_id=planned.lease,
                    task=got.task,
                    queue=got.queue,
                    attempt=got.attempts + 1,
                    worker_id=peer.worker_id,
                    seq=seq,
                )
        return effects

    def claim_unknown(self, claims: Sequence[PlannedClaim]) -> list[HandoffEffect]:
        """The claim call raised: nobody knows whether it committed, so each lease goes
        back (a no-op in the store if it never committed) and its credit is freed."""
        effects: list[HandoffEffect] = []
        for planned in claims:
            del self.claiming[planned.lease]
            effects.append(self._return(planned.job.id, planned.lease, "claim outcome unknown"))
            peer = self.peers.get(planned.peer)
            if peer is not None:
                peer.credits.release(planned.job.execution_mode)
        return effects

    def claim_refused(self, claims: Sequence[PlannedClaim]) -> list[HandoffEffect]:
        """The claim call raised an error that would recur (a value the store refuses).
        Its leases go back as for an unknown outcome; then the batch is claimed again in
        halves under fresh leases (keeping their credits) until the job or worker behind
        the error stands alone, so one bad row never stops dispatch to the others."""
        if len(claims) <= 1:
            return self.claim_unknown(claims)
        effects: list[HandoffEffect] = []
        fresh: list[PlannedClaim] = []
        for planned in claims:
            del self.claiming[planned.lease]
            effects.append(self._return(planned.job.id, planned.lease, "claim outcome unknown"))
            again = replace(planned, lease=self._new_lease())
            self.claiming[again.lease] = again
            fresh.append(again)
        half = len(fresh) // 2
        effects += [ClaimJobs(tuple(fresh[:half])), ClaimJobs(tuple(fresh[half:]))]
        return effects

    # ------------------------------------------------------------------ reports

    def report(self, peer_id: int, msg: protocol.Report) -> list[HandoffEffect]:
        """Accept a report for settlement, but only for a lease this connection holds:
        handed to it, or adopted at its hello. The store's fence alone would let any peer
        with the token settle any running job whose lease it learnt, so anything else (a
        lease held by another connection, forged, already settled, returned or
        cancelled) is answered ``stale`` at once and never reaches the store."""
        peer = self.peers.get(peer_id)
        held = peer.leases.get(msg.handoff_id) if peer is not None else None
        if held is None or held.id != msg.job_id:
            log_event(
                logger,
                logging.INFO,
                "report stale",
                job_id=msg.job_id,
                handoff_id=msg.handoff_id,
                outcome=msg.type,
                worker_id=peer.worker_id if peer is not None else None,
                session=peer_id,
                reason="lease not held by this connection",
            )
            return [Send(peer_id, report_ack(msg, protocol.AckStatus.STALE))]
        if isinstance(msg, protocol.FailedReport) and msg.lost and held.local_state:
            self.affinity.holds_again(held.worker_id or "")  # its child died, not its disk
        return [Settle(peer_id, msg)]

    def settled(
        self, results: Sequence[tuple[int, protocol.Report, protocol.AckStatus]]
    ) -> list[HandoffEffect]:
        """Settled reports, each with the store's answer, acknowledged to their peers: a
        lease that settled its job (or was already settled) is forgotten; one whose
        report could not be stored goes back to the queue."""
        effects: list[HandoffEffect] = []
        for peer_id, msg, status in results:
            if status is protocol.AckStatus.APPLIED and may_requeue(
                msg, self.held_job(msg.handoff_id)
            ):
                self.queue_changed()
            if status in (protocol.AckStatus.APPLIED, protocol.AckStatus.DUPLICATE):
                self.forget(msg.handoff_id)
            elif status is protocol.AckStatus.REFUSED:
                held = self.held_job(msg.handoff_id)
                self.forget(msg.handoff_id)
                effects.append(
                    self._return(msg.job_id, msg.handoff_id, "its report could not be stored", held)
                )
            # An applied report is the everyday case, one per job: DEBUG, so a busy main
            # does not format a line per job. Anything else is news for an operator.
            level = logging.DEBUG if status is protocol.AckStatus.APPLIED else logging.INFO
            if logger.isEnabledFor(level):
                peer = self.peers.get(peer_id)
                log_event(
                    logger,
                    level,
                    f"report {status.value}",
                    job_id=msg.job_id,
                    handoff_id=msg.handoff_id,
                    outcome=msg.type,
                    worker_id=peer.worker_id if peer is not None else None,
                )
            effects.append(Send(peer_id, report_ack(msg, status)))
        if any(status is protocol.AckStatus.APPLIED for _, _, status in results):
            effects.append(WakeDispatcher())
        return effects

    def checkpoint(self, peer_id: int, msg: protocol.SaveCheckpoint) -> list[HandoffEffect]:
        """A running job's checkpoint: stored only for a lease this connection holds, as a
        report is (:meth:`report`); anything else is answered ``stale`` at once and never
        reaches the store, whose own fence would stop it anyway."""
        if self._holds(peer_id, msg.job_id, msg.handoff_id):
            return [StoreCheckpoint(peer_id, msg)]
        log_event(
            logger,
            logging.INFO,
            "checkpoint stale",
            job_id=msg.job_id,
            handoff_id=msg.handoff_id,
            seq=msg.seq,
            session=peer_id,
        )
        ack = checkpoint_ack(
            msg,
            protocol.AckStatus.STALE,
            protocol.ErrorCode.CHECKPOINT_REJECTED,
            "the job's lease is no longer held by this worker (the main gave it back)",
        )
        return [Send(peer_id, ack)]

    def progress(self, peer_id: int, msg: protocol.Progress) -> list[HandoffEffect]:
        """A running job's progress: recorded for a lease this connection holds, dropped
        otherwise (it is never answered)."""
        if not self._holds(peer_id, msg.job_id, msg.handoff_id):
            return []
        return [
            StoreProgress(ProgressUpdate(msg.job_id, msg.handoff_id, msg.fraction, msg.message))
        ]

    def _holds(self, peer_id: int, job_id: uuid.UUID, lease: uuid.UUID) -> bool:
        peer = self.peers.get(peer_id)
        held = peer.leases.get(lease) if peer is not None else None
        return held is not None and held.id == job_id

    def held_job(self, lease: uuid.UUID) -> Job | None:
        """The job a connection holds (or a parked entry keeps) under ``lease``, as it was
        handed off."""
        job = self.holders.job(lease)
        if job is not None:
            return job
        parked = self.parked.get(lease)
        return parked.job if parked is not None else None

    def forget(self, lease: uuid.UUID | None) -> None:
        """``lease`` has settled its job: no connection holds it any more."""
        if lease is None:
            return
        self.parked.pop(lease, None)
        self.holders.drop(lease)

    def cancelled(self, job: Job) -> list[HandoffEffect]:
        """The store has cancelled ``job`` (or found it finished): forget its lease and
        tell the worker holding it to stop it. Whatever that worker reports later is
        fenced out (``stale``)."""
        lease = job.handoff_id
        if lease is None:
            return []
        self.waiting.drop(lease)
        peer = self.holders.drop(lease)
        if peer is None or job.status is not JobStatus.CANCELLED:
            return []
        log_event(
            logger,
            logging.INFO,
            "running job cancelled",
            job_id=job.id,
            handoff_id=lease,
            task=job.task,
            queue=job.queue,
            attempt=job.attempts + 1,
            worker_id=peer.worker_id,
        )
        return [Send(peer.id, protocol.CancelJob(job_id=job.id, handoff_id=lease))]

    # ------------------------------------------------------------------ returns (the ledger)

    def _return(
        self, job_id: uuid.UUID, lease: uuid.UUID, reason: str, lost: Job | None = None
    ) -> ReturnLease:
        """Queue ``lease`` for return. With ``lost`` (the job as handed off), the attempt
        under it may have run and was lost: the return counts a recovery (see
        :func:`broker.retry.lost_attempt`). Without, the job never reached a worker."""
        log_event(
            logger,
            logging.INFO,
            "lease queued for return",
            job_id=job_id,
            handoff_id=lease,
            reason=reason,
            lost=lost is not None,
        )
        self.returns[lease] = job_id
        if lost is not None:
            self.losses[lease] = Loss(lost, reason)
            if lost.local_state and lost.worker_id is not None:
                self.affinity.holds_again(lost.worker_id)
        # Its job waits in the queue again (or will, once the store has it back): no mode
        # counts as drained until a read after this one says so.
        self.queue_changed()
        return ReturnLease(job_id, lease, reason)

    def returned(self, lease: uuid.UUID, job_id: uuid.UUID) -> None:
        """The store answered a return of ``lease`` (returned it, or found it already
        settled): the entry is done."""
        if self.returns.get(lease) == job_id:
            del self.returns[lease]
            self.losses.pop(lease, None)
