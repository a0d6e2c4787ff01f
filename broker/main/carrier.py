"""Carrying out the handoff core's effects: what each effect is in I/O.

The core (:mod:`broker.core.handoff`) returns effects in order; this is the one place
they are carried out, against the connections, the leader's writers and the metrics.
The dispatcher makes the claims itself (``ClaimJobs`` is its own store call to await).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import msgspec

from broker.core import jobfields as codec
from broker.core.handoff import (
    Abort,
    ClaimJobs,
    Dispatch,
    HandoffEffect,
    ReturnLease,
    Send,
    Settle,
    StoreCheckpoint,
    StoreProgress,
    WakeDispatcher,
)
from broker.main.leader import Leader
from broker.main.metrics import MainMetrics
from broker.main.sessions import Gathered, Session
from broker.model import tracing
from broker.model.logs import log_event
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")


def carry(
    effects: Sequence[HandoffEffect],
    sessions: Mapping[int, Session],
    leader: Leader,
    metrics: MainMetrics,
) -> None:
    """Carry out the handoff's effects, in order.

    The jobs, and the acknowledgements, that one call sends a peer go out together as
    batch lines (see :class:`broker.main.sessions.Gathered`).
    """
    out = Gathered(sessions)
    for effect in effects:
        # The three effects every job makes come first: each case is a type test.
        match effect:
            case Dispatch(peer=peer, seq=seq, job=job, state_lost=state_lost):
                handoff = codec.job_message(seq, job, state_lost=state_lost)
                # One flag read per job without OpenTelemetry (or a job outside a trace).
                traced = tracing.ENABLED and job.trace_context is not None
                out.add(
                    peer, protocol.Jobs, _traced(handoff, sessions.get(peer)) if traced else handoff
                )
                metrics.handed_off(job)
            case Settle(peer=peer, report=report):
                leader.settler.add(peer, report)
            case Send(peer=peer, message=protocol.ReportAck() as ack):
                out.add(peer, protocol.ReportAcks, ack)
            case Send(peer=peer, message=protocol.CheckpointAck() as ack):
                metrics.checkpoint_answered(ack.status.value)
                out.send(peer, ack)
            case Send(peer=peer, message=message):
                out.send(peer, message)
            case ReturnLease():
                leader.ledger.kick()
            case Abort(peer=peer, reason=reason):
                out.drop(peer)
                if (session := sessions.get(peer)) is not None:
                    log_event(
                        logger,
                        logging.WARNING,
                        "peer unresponsive, treating as disconnected",
                        session=peer,
                        worker_id=session.worker_id,
                        reason=reason,
                    )
                    session.abort()
            case WakeDispatcher():
                leader.dispatcher.nudge()
            case ClaimJobs():
                pass  # a store call to await: the dispatcher makes it
            case StoreCheckpoint(peer=peer, message=message):
                leader.checkpoints.add(peer, message)
            case StoreProgress(update=update):
                metrics.progress_received()
                leader.progress.add(update)
    out.send_all()


def _traced(message: protocol.JobHandoff, session: Session | None) -> protocol.JobHandoff:
    """``message`` carrying the context of its dispatch's span (:func:`tracing.dispatch`)
    instead of the enqueue's: the run becomes the dispatch's child."""
    assert message.trace_context is not None
    onward = tracing.dispatch(
        message.task,
        message.job_id,
        message.queue,
        message.attempt,
        None if session is None else session.worker_id,
        message.trace_context,
    )
    if onward is message.trace_context:
        return message
    return msgspec.structs.replace(message, trace_context=dict(onward))
