"""The store side of checkpoints and progress the handoff core accepted.

Checkpoints are group-committed like reports (every checkpoint that arrived while a batch
was committing goes into the next) and each is acknowledged only after its batch is
durable, because a task that was told its checkpoint is saved must find it on its next
attempt. Progress is the opposite: the latest value per job is written now and then,
never acknowledged, and lost without harm if the main stops first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from broker.core.handoff import checkpoint_ack
from broker.jobs import CheckpointSave, JobStatus, ProgressUpdate
from broker.main.loops import BatchWriter
from broker.model.logs import log_event
from broker.payload import encoded_size, shape_problem
from broker.storage import StorageAdapter
from broker.wire import errors as error_codes
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")

PROGRESS_FLUSH_INTERVAL = 0.5
"""Seconds between two writes of the progress received meanwhile (one statement each)."""

Answer = Callable[[list[tuple[int, protocol.CheckpointAck]]], None]


def checkpoint_problem(
    state: object, limit: int | None, max_depth: int, max_containers: int | None
) -> str | None:
    """Why ``state`` may not be stored as a checkpoint (too deep, too many lists and
    objects, too large), or ``None``. The shape goes first, and its walk stops at either
    bound, so judging a checkpoint costs little whatever it holds."""
    shape = shape_problem(state, max_depth, max_containers, "the checkpoint")
    if shape is not None:
        return f"{shape}; flatten it"
    if limit is None:
        return None
    size = encoded_size(state)
    if size <= limit:
        return None
    return (
        f"the checkpoint is {size} bytes as JSON, over the checkpoint limit of {limit} "
        "bytes; keep large state elsewhere and checkpoint a reference to it"
    )


class CheckpointSaver:
    """Stores accepted checkpoints in batches and answers each once it is durable."""

    def __init__(
        self,
        store: StorageAdapter,
        *,
        answer: Answer,
        stopping: Callable[[], bool],
        batch: int,
        retry_interval: float,
        max_checkpoint_bytes: int | None,
        max_payload_depth: int,
        max_payload_containers: int | None,
    ) -> None:
        self._store = store
        self._answer = answer
        self._max_bytes = max_checkpoint_bytes
        self._max_depth = max_payload_depth
        self._max_containers = max_payload_containers
        self.writer: BatchWriter[
            tuple[int, protocol.SaveCheckpoint], list[tuple[int, protocol.CheckpointAck]]
        ] = BatchWriter(
            "saving checkpoints",
            write=self._save,
            written=lambda _batch, acks: answer(acks),
            unstorable=self._refuse,
            batch=batch,
            retry_interval=retry_interval,
            stopping=stopping,
            logger=logger,
            count_as="checkpoints",
        )
        """Accepted checkpoints, group-committed and answered once durable; a batch that
        fails for good is halved until the checkpoint behind it is refused on its own. Left
        unanswered when the main stops: the worker sends them again to the next main."""

    def add(self, peer: int, msg: protocol.SaveCheckpoint) -> None:
        problem = checkpoint_problem(
            msg.state, self._max_bytes, self._max_depth, self._max_containers
        )
        if problem is not None:
            refused = checkpoint_ack(
                msg, protocol.AckStatus.REFUSED, protocol.ErrorCode.PAYLOAD_TOO_LARGE, problem
            )
            self._answer([(peer, refused)])
            return
        self.writer.add((peer, msg))

    async def run(self) -> None:
        await self.writer.run()

    async def _save(
        self, batch: list[tuple[int, protocol.SaveCheckpoint]]
    ) -> list[tuple[int, protocol.CheckpointAck]]:
        """Store ``batch``; the answer to each."""
        saves = [CheckpointSave(m.job_id, m.handoff_id, m.seq, m.state) for _, m in batch]
        taken = await self._store.save_checkpoints(saves)
        return [
            (peer, await self._answer_for(msg, ok))
            for ok, (peer, msg) in zip(taken, batch, strict=True)
        ]

    async def _refuse(self, item: tuple[int, protocol.SaveCheckpoint], exc: Exception) -> None:
        peer, msg = item
        log_event(
            logger,
            logging.ERROR,
            "checkpoint could not be stored",
            job_id=msg.job_id,
            handoff_id=msg.handoff_id,
            error=repr(exc),
        )
        refused = checkpoint_ack(
            msg, protocol.AckStatus.REFUSED, error_codes.code_of(exc), str(exc)[:1000]
        )
        self._answer([(peer, refused)])

    async def _answer_for(
        self, msg: protocol.SaveCheckpoint, taken: bool
    ) -> protocol.CheckpointAck:
        """``applied`` when stored now; ``duplicate`` when the lease still holds the job
        and this or a newer checkpoint is stored (a copy sent again after a reconnect);
        ``stale`` otherwise. Read from the store, as for a report."""
        if taken:
            return checkpoint_ack(msg, protocol.AckStatus.APPLIED)
        job = await self._store.get_job(msg.job_id)
        if (
            job is not None
            and job.handoff_id == msg.handoff_id
            and job.status is JobStatus.HANDED_OFF
            and job.checkpoint_seq >= msg.seq
        ):
            return checkpoint_ack(msg, protocol.AckStatus.DUPLICATE)
        return checkpoint_ack(
            msg,
            protocol.AckStatus.STALE,
            protocol.ErrorCode.CHECKPOINT_REJECTED,
            "the job's lease is no longer current (the main gave the job to another run, "
            "or it has ended)",
        )


class ProgressWriter:
    """Writes the latest progress of each job every :data:`PROGRESS_FLUSH_INTERVAL`
    seconds; values that arrive in between replace each other."""

    def __init__(self, store: StorageAdapter, *, interval: float = PROGRESS_FLUSH_INTERVAL) -> None:
        self._store = store
        self._interval = interval
        self._latest: dict[tuple[object, object], ProgressUpdate] = {}
        self._ready = asyncio.Event()

    def add(self, update: ProgressUpdate) -> None:
        self._latest[(update.job_id, update.handoff_id)] = update
        self._ready.set()

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            await asyncio.sleep(self._interval)
            self._ready.clear()
            updates, self._latest = list(self._latest.values()), {}
            try:
                await self._store.save_progress(updates)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # progress is best effort: the next update will do
                log_event(
                    logger,
                    logging.WARNING,
                    "recording progress updates failed",
                    updates=len(updates),
                    error=repr(exc),
                )
