"""What the main's handoff core asks its shell to do: the effects its events return.

:class:`broker.core.handoff.Handoff` returns them in a list, and the main carries them out
in that order (:meth:`broker.main.main.Main._carry`). Each is a frozen value naming a
connection by its id, never a socket.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from broker.jobs import Claim, Job, ProgressUpdate
from broker.wire import messages as protocol


@dataclass(frozen=True, slots=True)
class Send:
    """Queue ``message`` on connection ``peer`` (dropped if it has closed meanwhile)."""

    peer: int
    message: protocol.Message


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send the claimed ``job`` to ``peer`` as its ``job`` message number ``seq``;
    ``state_lost``: the job's local state is not on that worker
    (see :mod:`broker.core.affinity`)."""

    peer: int
    seq: int
    job: Job
    state_lost: bool = False


@dataclass(frozen=True, slots=True)
class ReturnLease:
    """``lease`` now waits in the returns: give it back to the store (fenced on that exact
    lease, so a newer one is never touched)."""

    job_id: uuid.UUID
    lease: uuid.UUID
    reason: str


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop connection ``peer`` at once: it is judged dead."""

    peer: int
    reason: str


@dataclass(frozen=True, slots=True)
class Settle:
    """An accepted report: apply it to the store, then tell the core with
    :meth:`Handoff.settled`."""

    peer: int
    report: protocol.Report


@dataclass(frozen=True, slots=True)
class ClaimJobs:
    """Claim these planned jobs in one store call, then tell the core how it went."""

    claims: tuple[PlannedClaim, ...]


@dataclass(frozen=True, slots=True)
class WakeDispatcher:
    """Run another dispatch pass: credit or a peer became available. It says nothing about
    the queue: where a job became eligible, the core counts that itself
    (:meth:`Handoff.queue_changed`), so that a freed slot alone costs no re-read of the
    modes proven drained, nor of the next run time."""


@dataclass(frozen=True, slots=True)
class StoreCheckpoint:
    """An accepted checkpoint: store it (fenced again in the store), then answer ``peer``
    with a ``checkpoint_ack``."""

    peer: int
    message: protocol.SaveCheckpoint


@dataclass(frozen=True, slots=True)
class StoreProgress:
    """An accepted progress update: record it when convenient (nobody waits on it)."""

    update: ProgressUpdate


HandoffEffect = (
    Send
    | Dispatch
    | ReturnLease
    | Abort
    | Settle
    | ClaimJobs
    | WakeDispatcher
    | StoreCheckpoint
    | StoreProgress
)


@dataclass(frozen=True, slots=True)
class PlannedClaim:
    """A job reserved for a peer under a freshly minted lease, not yet claimed."""

    peer: int
    worker_id: str
    job: Job
    lease: uuid.UUID
    state_lost: bool = False

    @property
    def claim(self) -> Claim:
        return Claim(self.job.id, self.lease, self.worker_id)


# The answers the core sends (in Send effects), built in one place for it and the shell.


def checkpoint_ack(
    msg: protocol.SaveCheckpoint,
    status: protocol.AckStatus,
    code: str | None = None,
    message: str | None = None,
) -> protocol.CheckpointAck:
    """The answer to a checkpoint; ``code`` and ``message`` say why one was not saved."""
    return protocol.CheckpointAck(
        job_id=msg.job_id,
        handoff_id=msg.handoff_id,
        seq=msg.seq,
        status=status,
        code=code,
        message=message,
    )


def report_ack(msg: protocol.Report, status: protocol.AckStatus) -> protocol.ReportAck:
    """The answer to a report."""
    return protocol.ReportAck(job_id=msg.job_id, handoff_id=msg.handoff_id, status=status)
