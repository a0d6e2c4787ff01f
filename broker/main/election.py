"""The election's shell: asks the store when :class:`broker.core.election.Election` says
so, and carries out its answers.

The rules (when to ask, what an answer means) are the pure :mod:`broker.core.election`.
What is here is only what needs I/O: the store's rounds under a budget of the main's
running time, the fence every claim and settle checks, loading the handoffs in flight
once elected, and resigning on a clean stop. The main hands it what it needs as
callables, so this module knows nothing of sessions, routing or dispatch.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from broker.core.election import (
    Effect,
    Election,
    Lead,
    Phase,
    Renew,
    RoundBudget,
    StepDown,
    TryElect,
)
from broker.core.handoff import Handoff
from broker.exceptions import StorageError
from broker.main.loops import Spawn, retrying
from broker.model.logs import log_event
from broker.storage import SupportsLeadership

logger = logging.getLogger("broker.main")

_T = TypeVar("_T")


class Leadership:
    """Runs one main's side of the election on a store that holds several mains."""

    def __init__(
        self,
        election: Election,
        store: SupportsLeadership,
        handoff: Handoff,
        *,
        main_id: str,
        address: Callable[[], str],
        load_orphans: Callable[[], Awaitable[None]],
        dispatch: Callable[[], None],
        deposed: Callable[[str], None],
        stopping: Callable[[], bool],
        spawn: Spawn,
        retry_interval: float,
    ) -> None:
        """``address()`` is where peers reach this main; ``load_orphans()`` reads the
        handoffs in flight into ``handoff``; ``dispatch()`` starts what only the leader
        runs; ``deposed(reason)`` stops the main once it stepped down."""
        self.election = election
        self.store = store
        self.handoff = handoff
        self._main_id = main_id
        self._address = address
        self._load_orphans = load_orphans
        self._dispatch = dispatch
        self._deposed = deposed
        self._stopping = stopping
        self._spawn = spawn
        self._retry_interval = retry_interval

    async def first_round(self) -> None:
        """At start-up, before peers are answered: one election round, and if it elects
        this main, the orphans, so a main alone on its store is ready as soon as
        :meth:`Main.start <broker.main.main.Main.start>` returns, as it always was."""
        for effect in self.election.due(asyncio.get_running_loop().time()):
            for outcome in await self._ask(effect):
                if isinstance(outcome, Lead):
                    self._fence(outcome.epoch)
                    await self._load_orphans()

    def begin(self) -> None:
        """The main serves: lead now if the first round elected it, and keep the rounds
        going."""
        if self.election.epoch is not None:
            self._lead_now(self.election.epoch)
        self._spawn(self._elect(), "broker-election")

    async def _elect(self) -> None:
        """Asks the store when the election says so, and carries out its answers, until
        this main stops or steps down."""
        election = self.election
        loop = asyncio.get_running_loop()
        while True:
            for effect in election.due(loop.time()):
                for outcome in await self._ask(effect):
                    match outcome:
                        case Lead(epoch=epoch):
                            # Its own task: the election keeps renewing while it loads.
                            self._spawn(self._lead(epoch), "broker-lead")
                        case StepDown(epoch=epoch, reason=reason):
                            self._step_down(epoch, reason)
            wake = election.wake_at()
            if wake == math.inf:
                return
            await asyncio.sleep(max(0.0, wake - loop.time()))

    async def _ask(self, effect: Effect) -> list[Effect]:
        """Carry out one round the election asked for; returns what its answer decides.
        A round gets the renewal interval of the main's running time (see
        :class:`broker.core.election.RoundBudget`): a store that hangs is a failed round, and
        the lease keeps running out; an answer that came while the loop was stalled is
        used."""
        election = self.election
        try:
            return await within_running_time(self._round(effect), election.timing.renew_every)
        except (TimeoutError, OSError, StorageError) as exc:
            election.failed()
            log_event(
                logger, logging.WARNING, "election round failed", main_id=self._main_id, error=exc
            )
            return []

    async def _round(self, effect: Effect) -> list[Effect]:
        election, store = self.election, self.store
        timing = election.timing
        match effect:
            case TryElect(started=started):
                row = await store.elect(self._main_id, self._address(), timing.ttl)
                if row is None:
                    election.failed()
                    return []
                return election.elected(row.holder, row.epoch, row.address, row.live, started)
            case Renew(epoch=epoch, started=started):
                ok = await store.renew(self._main_id, epoch, timing.ttl)
                return election.renewed(started, ok)
            case _:
                return [effect]

    def _fence(self, epoch: int) -> None:
        self.store.fence(epoch, self._fenced)

    async def resign(self) -> None:
        """A leader that stops cleanly ends its lease, so a standby takes over at its next
        round instead of after the lease; a failure only costs that wait."""
        election = self.election
        if election.phase is not Phase.LEADER:
            return
        assert election.epoch is not None
        election.resigned()
        try:
            async with asyncio.timeout(election.timing.renew_every):
                await self.store.resign(self._main_id, election.epoch)
        except (TimeoutError, OSError, StorageError) as exc:
            log_event(
                logger,
                logging.WARNING,
                "could not resign the lead",
                main_id=self._main_id,
                error=exc,
            )
        else:
            log_event(
                logger,
                logging.INFO,
                "resigned the lead",
                main_id=self._main_id,
                epoch=election.epoch,
            )

    async def _lead(self, epoch: int) -> None:
        """Elected: load the orphans, as a restarted main does, then dispatch."""
        self._fence(epoch)

        def forget_partial_load() -> None:
            self.handoff.orphans_unloaded()

        await retrying(
            "loading the orphans",
            self._load_orphans,
            interval=self._retry_interval,
            logger=logger,
            on_error=forget_partial_load,
            retry_if=lambda exc: isinstance(exc, OSError | StorageError),
        )
        if not self._stopping():
            self._lead_now(epoch)

    def _lead_now(self, epoch: int) -> None:
        log_event(
            logger,
            logging.WARNING,
            "elected leader",
            main_id=self._main_id,
            epoch=epoch,
            address=self._address(),
            orphans=len(self.handoff.orphans),
        )
        self._dispatch()

    def _fenced(self, op: str) -> None:
        """The store refused ``op`` under this main's epoch: another main took over."""
        log_event(logger, logging.WARNING, "epoch fence refused", op=op, main_id=self._main_id)
        for effect in self.election.fenced():
            if isinstance(effect, StepDown):
                self._step_down(effect.epoch, effect.reason)

    def _step_down(self, epoch: int, reason: str) -> None:
        """Stop dispatching at once; the main then stops (see ``deposed``)."""
        log_event(
            logger,
            logging.ERROR,
            "deposed: this main stops dispatching and exits (start it again to stand by)",
            main_id=self._main_id,
            epoch=epoch,
            reason=reason,
        )
        self._deposed(reason)


async def within_running_time(step: Awaitable[_T], budget: float) -> _T:
    """``step``'s answer, or ``TimeoutError`` once it has had ``budget`` seconds of this
    loop's running time (time the loop was stalled does not count, see
    :class:`broker.core.election.RoundBudget`). Given up on, it is cancelled."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(step)
    spent = RoundBudget(budget)
    try:
        while True:
            started = loop.time()
            done, _ = await asyncio.wait({task}, timeout=spent.step)
            if done:
                return task.result()
            if spent.waited(spent.step, loop.time() - started):
                raise TimeoutError(f"no answer within {budget:g} s of the main's running time")
    finally:
        task.cancel()
