"""One connection as the main's handoff sees it: its credits, its liveness, its leases.

:class:`Peer` is the record :class:`broker.core.handoff.Handoff` keeps per connection;
the transport holds it as a handle and reports what happens to it as events
(:meth:`Handoff.paused <broker.core.handoff.Handoff.paused>`, ``resumed``,
``write_started``, ``write_ended``, ``pong``), never by writing its fields.

Credits
-------
Exact credit accounting for one worker connection.

A worker's ``ready`` message says how many slots it has free per execution mode
*and* the sequence number of the last ``job`` message it had taken in when it
counted them. The main therefore knows exactly which of its sends the count
already reflects, so a readiness message that crosses jobs on the wire can never
over-credit the worker (the race velocious has with absolute, unsequenced
readiness). Available credit is derived, never stored::

    available(mode) = slots(mode) - sent_but_unseen(mode) - claiming(mode)

where ``claiming`` counts handoffs reserved for this worker whose claim is still
in flight. Restoring admission after a failed or lost claim is just dropping the
reservation: if a newer ``ready`` arrived meanwhile, its count did not include
the reserved job either, so nothing is refunded twice.

The spare credit
----------------
For a mode whose prefetch window holds a job or more (the worker's ``hello`` lists it
in ``prefetch_modes``), the last free credit is kept out of the backlog's reach: a
dispatch pass sees one credit fewer (``available(mode)``), and only a job that
overtakes no waiting job (:meth:`Handoff.plan_at_enqueue
<broker.core.handoff.Handoff.plan_at_enqueue>`: an urgent job enqueued during a drain)
may take it (``available(mode, leading=True)``). Why: in a drain every freed credit went
to the backlog's prefetch at once, so an urgent job rarely found one at its insert and
waited for a pass and a claim of its own (issue 35). Why it never idles a slot: the
credit is ``free slots + window - held``, and a held job means no slot is free; so
leaving one credit unspent with a window of one or more leaves the window one job
short, never a slot empty. It is not stranded either: a leading job spends it, and the
next ``ready`` counts it again. The count stays exact: ``leading`` spends at most the
``available`` of before, and a worker with no window (``--prefetch 0``, an older
worker) keeps no spare.
"""

from __future__ import annotations

import secrets
import uuid
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from broker.exceptions import ProtocolError
from broker.jobs import ExecutionMode, Job
from broker.model.bounds import MAX_CREDIT
from broker.model.rates import Rate
from broker.wire import messages as protocol


def random_ping_base() -> int:
    """A fresh :attr:`Liveness.ping_base`: random, so a peer that does not read our pings
    cannot answer them (the default of :class:`broker.core.handoff.Handoff`'s
    ``new_ping_base``, which tests replace)."""
    return secrets.randbits(62)


class CreditLimitError(ProtocolError):
    """A ``ready`` announced more free slots than the main accepts; it is not applied."""

    code = "over_limit"
    """Not ``malformed``: the worker is told, not dropped (its ``ready`` was readable)."""


class Credits:
    def __init__(self, max_slots: int = MAX_CREDIT) -> None:
        self._max_slots = max_slots
        self._slots: dict[ExecutionMode, int] = {}
        self._seen = 0
        self._last_sent = 0
        self._unseen: deque[tuple[int, ExecutionMode]] = deque()
        self._unseen_by_mode: Counter[ExecutionMode] = Counter()
        self._claiming: Counter[ExecutionMode] = Counter()
        self._spare: frozenset[ExecutionMode] = frozenset()
        """The modes that keep a spare credit (see the module docstring)."""

    def keep_spare(self, modes: Iterable[ExecutionMode]) -> None:
        """``modes`` keep their last credit for a leading job (their prefetch window
        holds a job or more: the ``hello``'s ``prefetch_modes``)."""
        self._spare = frozenset(modes)

    def on_ready(self, slots: Mapping[ExecutionMode, int], seen: int) -> None:
        """Apply a readiness report; ``seen`` must not go backwards nor run ahead of sends,
        and no mode may announce more than ``max_slots`` (the whole report is refused)."""
        over = {str(mode): n for mode, n in slots.items() if n > self._max_slots}
        if over:
            raise CreditLimitError(
                f"ready.slots {over} is over this main's limit of {self._max_slots} free "
                "slots per mode (--max-credit); the ready was not applied"
            )
        if seen < self._seen or seen > self._last_sent:
            raise ProtocolError(
                f"ready.seen={seen} is outside the jobs sent on this connection "
                f"(already seen {self._seen}, last sent {self._last_sent})"
            )
        self._seen = seen
        while self._unseen and self._unseen[0][0] <= seen:
            _, mode = self._unseen.popleft()
            self._unseen_by_mode[mode] -= 1
        self._slots = {ExecutionMode(mode): max(0, int(n)) for mode, n in slots.items()}

    def available(self, mode: ExecutionMode, *, leading: bool = False) -> int:
        """Free credit of ``mode``: for the backlog, or (``leading``) for a job that
        overtakes no waiting job, which may take the spare (see the module docstring)."""
        free = self._slots.get(mode, 0) - self._unseen_by_mode[mode] - self._claiming[mode]
        if not leading and mode in self._spare:
            free -= 1
        return max(0, free)

    # Only the modes the last ``ready`` listed can have credit (any other has no slot):
    # these two run for every worker in every dispatch pass, and looking at each of the
    # three modes made them a tenth of the main's time with 64 workers of one mode.
    def total_available(self, *, leading: bool = False) -> int:
        return sum(self.available(mode, leading=leading) for mode in self._slots)

    def modes_with_credit(self, *, leading: bool = False) -> set[ExecutionMode]:
        return {mode for mode in self._slots if self.available(mode, leading=leading) > 0}

    def reserve(self, mode: ExecutionMode, *, leading: bool = False) -> bool:
        """Hold one credit for a claim about to be made; ``False`` if there is none (for
        the backlog, or for a ``leading`` job: see :meth:`available`)."""
        if self.available(mode, leading=leading) <= 0:
            return False
        self._claiming[mode] += 1
        return True

    def release(self, mode: ExecutionMode) -> None:
        """The reserved claim did not produce a job for this worker: drop the hold."""
        if self._claiming[mode] <= 0:
            raise RuntimeError(f"no {mode} credit is reserved")
        self._claiming[mode] -= 1

    def commit(self, mode: ExecutionMode) -> int:
        """The reserved claim succeeded and its job is being sent: returns its ``seq``."""
        self.release(mode)
        self._last_sent += 1
        self._unseen.append((self._last_sent, mode))
        self._unseen_by_mode[mode] += 1
        return self._last_sent

    @property
    def in_flight_unseen(self) -> int:
        return len(self._unseen)


@dataclass
class Liveness:
    """When a peer last proved itself alive, and since when a write to it or its outbox
    has been stuck. Times are the event loop's, fed in by the shell: the transport reports
    its pauses and writes to :class:`~broker.core.handoff.Handoff` as events, and
    :meth:`Handoff.tick <broker.core.handoff.Handoff.tick>` judges."""

    last_answer: float
    """Time of the last ``pong`` answering one of our pings (or of the accept). Nothing
    else counts: a peer that sends but never reads cannot answer."""
    ping_base: int
    """Our pings carry ``ping_base + 1, + 2, ...``; random (:func:`random_ping_base`), so
    a peer that does not read them cannot answer them."""
    pings_sent: int = 0
    paused_since: float | None = None
    """Time the outbox went over its cap; ``None`` while under it."""
    write_started: float | None = None
    """Time the write in progress began; ``None`` when the writer is idle."""

    def next_ping(self) -> protocol.Ping:
        self.pings_sent += 1
        return protocol.Ping(nonce=self.ping_base + self.pings_sent)

    def answered(self, nonce: int, now: float) -> None:
        """A ``pong``: it proves the peer alive only if it answers one of our pings."""
        if self.ping_base < nonce <= self.ping_base + self.pings_sent:
            self.last_answer = now

    def excuse(self, stall: float, now: float) -> None:
        """The main itself could not run for ``stall`` seconds: that time does not count
        against the peer (it could not be read from or written to meanwhile)."""
        self.last_answer = min(now, self.last_answer + stall)
        if self.paused_since is not None:
            self.paused_since = min(now, self.paused_since + stall)
        if self.write_started is not None:
            self.write_started = min(now, self.write_started + stall)

    def problem(self, now: float, timeout: float) -> str | None:
        """Why this peer counts as dead at ``now``, or ``None`` while it does not."""
        if now - self.last_answer > timeout:
            return f"no answer to pings for {now - self.last_answer:.1f} s"
        if self.write_started is not None and now - self.write_started > timeout:
            return f"a write has not completed for {now - self.write_started:.1f} s"
        if self.paused_since is not None and now - self.paused_since > timeout:
            return f"over its outbox limit for {now - self.paused_since:.1f} s"
        return None


@dataclass(eq=False)
class Peer:
    """One connection as the handoff sees it. Leases belong to a connection, not to a
    worker id, so a dropped socket gives back only what was handed to that socket."""

    id: int
    liveness: Liveness
    credits: Credits = field(default_factory=Credits)
    role: protocol.Role | None = None
    worker_id: str | None = None
    modes: frozenset[ExecutionMode] = frozenset()
    queues: frozenset[str] | None = None
    tasks: frozenset[str] | None = None
    """The tasks it declared (its ``tasks`` message, :mod:`broker.core.catalog`); ``None``
    until it declares any: a worker of a release without catalogs, or one whose catalog
    was not taken (over a bound), is taken to run any task, as before routing by task."""
    rate_limits: Mapping[str, Rate] = field(default_factory=dict)
    """The rate limits it declared with its tasks (``@task(rate_limit=...)``)."""
    keyed_limits: frozenset[str] = frozenset()
    """The tasks of :attr:`rate_limits` limited per key (``@task(rate_key=...)``)."""
    declared_order: int = 0
    """When it declared, as a count of declarations the main took: the newest declaration
    of a task's limit wins (:meth:`Handoff.declared <broker.core.handoff.Handoff.declared>`)."""
    leases: dict[uuid.UUID, Job] = field(default_factory=dict)
    draining: bool = False

    @property
    def dispatchable(self) -> bool:
        return self.role is protocol.Role.WORKER and not self.draining and not self.paused

    @property
    def paused(self) -> bool:
        """Its outbox is over its cap (:meth:`Handoff.paused
        <broker.core.handoff.Handoff.paused>`): it takes no jobs, and the main reads no
        more of its messages, until it is back under."""
        return self.liveness.paused_since is not None

    def serves(self, job: Job) -> bool:
        """Whether this connection may be handed ``job``: it serves the job's queue and
        declared its task. The one rule of routing by task: a worker never receives a job
        it did not say it can run (a rolling deploy's old workers never see a new task)."""
        return self.serves_queue(job.queue) and self.serves_task(job.task)

    def serves_task(self, task: str) -> bool:
        """Whether this connection declared ``task`` (``tasks`` ``None``: it runs any)."""
        return self.tasks is None or task in self.tasks

    def serves_queue(self, queue: str) -> bool:
        """Whether this connection takes jobs of ``queue`` (``queues`` ``None``: all)."""
        return self.queues is None or queue in self.queues


class Holders:
    """Which worker connection holds each lease: an index over every :attr:`Peer.leases`.

    Why: a report's settlement, a forgotten lease and a cancel each looked their lease
    up in every worker connection's map, which at 64 workers was about a fifth of the
    main's profile. Each :attr:`Peer.leases` stays its connection's truth (what it holds,
    what it gives back when it ends); this index is derived from them, and every change
    to a peer's leases goes through here so that the two never disagree."""

    def __init__(self) -> None:
        self._by_lease: dict[uuid.UUID, Peer] = {}

    @property
    def by_lease(self) -> Mapping[uuid.UUID, Peer]:
        """The holder of every held lease (read only)."""
        return self._by_lease

    def hold(self, peer: Peer, lease: uuid.UUID, job: Job) -> None:
        """``peer`` holds ``lease`` for ``job`` (as handed off), and no other does."""
        peer.leases[lease] = job
        self._by_lease[lease] = peer

    def job(self, lease: uuid.UUID) -> Job | None:
        """The job held under ``lease``, as handed off; ``None`` when no connection holds it."""
        peer = self._by_lease.get(lease)
        return peer.leases[lease] if peer is not None else None

    def drop(self, lease: uuid.UUID) -> Peer | None:
        """``lease`` leaves the connection holding it: that connection, or ``None``."""
        peer = self._by_lease.pop(lease, None)
        if peer is not None:
            del peer.leases[lease]
        return peer

    def drop_all(self, peer: Peer) -> None:
        """``peer`` holds nothing any more (it ended; its leases went elsewhere)."""
        for lease in peer.leases:
            del self._by_lease[lease]
        peer.leases.clear()
