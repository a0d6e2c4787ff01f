"""The main's routing of what its peers send once welcomed: which message goes to the
handoff core (and the effects back to the main's carrier), which to the request service,
which to the task catalog, and what each role may send at all.

A worker's messages (credits, reports, checkpoints, progress, its status and its tasks)
are taken from a worker connection only; client requests, listed once in
:data:`broker.wire.credentials.REQUESTS`, from a connection whose credential has the role the
request needs. Anything else is answered ``not_allowed`` and counted against the
connection's error budget, which keeps it open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from broker.core.catalog import CatalogLimitError
from broker.core.handoff import Handoff, HandoffEffect
from broker.exceptions import PermissionDeniedError, ProtocolError
from broker.main.catalog import Declarations
from broker.main.requests import Requests
from broker.main.sessions import Session
from broker.model.logs import log_event
from broker.wire import errors as error_codes
from broker.wire import messages as protocol
from broker.wire.credentials import role_needed

logger = logging.getLogger("broker.main")


class Router:
    """Hands each message of a welcomed peer to the part of the main that takes it."""

    def __init__(
        self,
        handoff: Handoff,
        *,
        carry: Callable[[Sequence[HandoffEffect]], None],
        requests: Requests,
        declarations: Declarations,
    ) -> None:
        """``carry`` carries out the core's effects (``Main._carry``)."""
        self._handoff = handoff
        self._carry = carry
        self._requests = requests
        self._declarations = declarations

    def handle(self, session: Session, msg: protocol.Message) -> None:
        """Route ``msg`` from a peer that said hello (as ``session.role``). A client
        request is told by its type first: no message a worker reports is one, and a
        producer's enqueue then passes no pattern of the worker's messages."""
        needed = role_needed(msg)
        if needed is not None:
            self._request(session, msg, needed)
            return
        worker = session.role is protocol.Role.WORKER
        match msg:
            case protocol.Ping(nonce=nonce):
                session.send(protocol.Pong(nonce=nonce))
            case protocol.Pong(nonce=nonce):
                self._handoff.pong(session.id, nonce, asyncio.get_running_loop().time())
            case protocol.Ready(slots=slots, seen=seen) if worker:
                try:
                    self._carry(self._handoff.ready(session.id, slots, seen))
                except ProtocolError as exc:
                    session.errors += 1
                    code = error_codes.code_of(exc)
                    session.send(protocol.Error(code=code, message=str(exc), fatal=False))
            case protocol.Draining() if worker:
                self._carry(self._handoff.draining(session.id))
            case (
                protocol.CompletedReport()
                | protocol.FailedReport()
                | protocol.RescheduleReport()
                | protocol.ReleaseReport()
            ) if worker:
                self._carry(self._handoff.report(session.id, msg))
            case protocol.Reports(reports=reports) if worker:
                self._carry(
                    [
                        effect
                        for report in reports
                        for effect in self._handoff.report(session.id, report)
                    ]
                )
            case protocol.SaveCheckpoint() if worker:
                self._carry(self._handoff.checkpoint(session.id, msg))
            case protocol.Progress() if worker:
                self._carry(self._handoff.progress(session.id, msg))
            case protocol.WorkerStatus(status=status) if worker:
                session.reported_status = status
            case protocol.TaskCatalog(tasks=tasks) if worker and session.worker_id:
                self._declare(session, tasks)
            case _:
                session.errors += 1
                session.send(
                    protocol.Error(
                        code=protocol.ErrorCode.NOT_ALLOWED,
                        message=f"{msg.type!r} is not allowed from a {session.role} connection",
                        fatal=False,
                    )
                )

    def _declare(self, session: Session, tasks: list[protocol.TaskDeclaration]) -> None:
        """A worker declared the tasks it serves (:meth:`Declarations.declare
        <broker.main.catalog.Declarations.declare>`). Over a bound of the catalog it is
        told (``over_limit``, not fatal: it keeps working). Either way it is handed only
        jobs of those tasks from now on (:meth:`Handoff.declared
        <broker.core.handoff.Handoff.declared>`): the catalog's bounds keep the store
        small, while the names, within the line limit, are what the worker can run."""
        assert session.worker_id is not None
        try:
            self._declarations.declare(session.worker_id, tasks)
        except CatalogLimitError as exc:
            session.send(
                protocol.Error(code=protocol.ErrorCode.OVER_LIMIT, message=str(exc), fatal=False)
            )
        limits = {task.name: rate for task in tasks if (rate := task.limit()) is not None}
        keyed = [task.name for task in tasks if task.rate_key is not None and task.name in limits]
        names = [task.name for task in tasks]
        self._carry(self._handoff.declared(session.id, names, limits, keyed))

    def _request(self, session: Session, msg: protocol.Message, needed: protocol.Role) -> None:
        """Start a client request if the connection's role may make it (``needed``, see
        :data:`broker.wire.credentials.REQUESTS`); else answer ``permission_denied`` (the
        connection stays open)."""
        if needed in session.rights:
            self._requests.start(session, msg)
            return
        log_event(
            logger,
            logging.WARNING,
            "request denied",
            session=session.id,
            type=msg.type,
            role=session.role,
            needs=needed,
        )
        denied = PermissionDeniedError(
            f"{msg.type!r} needs the {needed} role; this connection said hello as "
            f"{session.role} (use a credential of that role: the operator's command uses "
            "the operator secret)"
        )
        session.send(error_codes.request_error(getattr(msg, "request_id", ""), denied))
