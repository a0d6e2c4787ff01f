"""Who may connect as what, and what each role may ask: the main's secrets per role.

Three roles hold three secrets. A *worker* receives jobs, payloads and all, so an app
server that only enqueues must not be able to pose as one; a *client* enqueues and reads;
an *operator* also cancels, retries and prunes (the operator's command and the
dashboard's actions). A peer's hello names its role and proves that role's secret (an
HMAC of the main's nonce, :func:`broker.wire.messages.check_proof`), so a client's secret
cannot say hello as a worker, and a worker's cannot cancel.

One shared secret (``--token``) stands for every role, as before roles existed. A role
given no secret of its own takes the shared one; with neither, while another role has a
secret, that role is closed: a main that demands credentials never lets a role in
without one.

Pure: no I/O. The CLI reads the token file and passes its text to :func:`parse_token_file`.
"""

from __future__ import annotations

import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from broker.exceptions import ConfigurationError
from broker.wire import messages as protocol
from broker.wire.messages import Role

ALL_ROLES = "all"
"""The name a token file gives the shared secret, which every role takes unless it has
its own."""

REQUESTS: Mapping[type[protocol.Message], Role] = {
    protocol.Enqueue: Role.CLIENT,
    protocol.EnqueueEach: Role.CLIENT,
    protocol.GetJob: Role.CLIENT,
    protocol.GetWorkflow: Role.CLIENT,
    protocol.WaitJob: Role.CLIENT,
    protocol.ListJobs: Role.CLIENT,
    protocol.ListTasks: Role.CLIENT,
    protocol.Status: Role.CLIENT,
    protocol.Cancel: Role.OPERATOR,
    protocol.Retry: Role.OPERATOR,
    protocol.RetryWorkflow: Role.OPERATOR,
    protocol.Prune: Role.OPERATOR,
    protocol.PauseQueue: Role.OPERATOR,
    protocol.ResumeQueue: Role.OPERATOR,
    protocol.LimitQueue: Role.OPERATOR,
}
"""Every client request, and the role it needs (an operator may do all a client may):
the one list of them. The main routes what is here to its request service
(:mod:`broker.main.requests`), which answers each."""


def role_needed(msg: protocol.Message) -> Role | None:
    """The role a request needs; ``None``: not a client request."""
    return REQUESTS.get(type(msg))


@dataclass(frozen=True)
class Credentials:
    """The secret of each role (``None``: that role has none)."""

    worker: str | None = None
    client: str | None = None
    operator: str | None = None

    @classmethod
    def combine(
        cls,
        *,
        shared: str | None = None,
        worker: str | None = None,
        client: str | None = None,
        operator: str | None = None,
        file: Mapping[str, str] | None = None,
    ) -> Credentials:
        """Each role's secret: its own (flag or environment), else its line in the token
        file, else the shared secret, else the file's ``all`` line."""
        lines = file or {}

        def pick(own: str | None, role: Role) -> str | None:
            return own or lines.get(role.value) or shared or lines.get(ALL_ROLES) or None

        return cls(
            worker=pick(worker, Role.WORKER),
            client=pick(client, Role.CLIENT),
            operator=pick(operator, Role.OPERATOR),
        )

    @property
    def required(self) -> bool:
        """Whether peers must prove a secret at all (any role has one)."""
        return any((self.worker, self.client, self.operator))

    def too_short(self, minimum: int) -> list[Role]:
        """The roles whose secret has fewer than ``minimum`` characters."""
        return [role for role in Role if len(self.secret(role) or "x" * minimum) < minimum]

    def secret(self, role: Role) -> str | None:
        match role:
            case Role.WORKER:
                return self.worker
            case Role.CLIENT:
                return self.client
            case Role.OPERATOR:
                return self.operator

    def refusal(self, role: Role, nonce: str, proof: str | None) -> str | None:
        """Why a hello as ``role`` with ``proof`` of ``nonce`` is refused, or ``None``.

        The proof is checked against ``role``'s secret only, in constant time."""
        if not self.required:
            return None
        secret = self.secret(role)
        if secret is None:
            return (
                f"this main has no {role} secret, so it accepts no {role} connections "
                f"(set --{role}-token or --token on the main)"
            )
        if not protocol.check_proof(secret, nonce, proof):
            return f"wrong or missing token proof for the {role} role"
        return None

    def rights(self, role: Role, nonce: str, proof: str | None) -> frozenset[Role]:
        """The roles whose requests a connection that said hello as ``role`` may make.

        A worker makes none. An operator may do all a client may. A client gets an
        operator's rights too where its proof also proves the operator's secret (one
        shared token), and wherever no secret is required (anyone could say hello as an
        operator there anyway), so an application's ``Client.cancel`` keeps working.
        """
        if role is Role.WORKER:
            return frozenset({Role.WORKER})
        if role is Role.OPERATOR or not self.required:
            return frozenset({Role.CLIENT, Role.OPERATOR})
        operator = self.operator
        if operator is not None and protocol.check_proof(operator, nonce, proof):
            return frozenset({Role.CLIENT, Role.OPERATOR})
        return frozenset({Role.CLIENT})


def check_private_file(mode: int, where: str) -> None:
    """Refuse a file of secrets that others than its owner may read or write (``mode``
    as ``stat`` gives it), as ssh refuses such a private key: another user may already
    have copied the secrets, or put their own in.

    :raises ConfigurationError: naming the file, its mode and the fix.
    """
    if mode & 0o077:
        raise ConfigurationError(
            f"{where} is accessible to its group or others (mode {stat.S_IMODE(mode):04o}); "
            "a file of secrets must be for its owner only: chmod 600 it"
        )


def parse_token_file(text: str, where: str) -> dict[str, str]:
    """The secrets in a token file: ``role=secret`` lines (``worker``, ``client``,
    ``operator``, or ``all`` for every role), blank lines and ``#`` comments ignored.

    A bad line is refused with its number, never its text (it may hold a secret)."""
    names = {role.value for role in Role} | {ALL_ROLES}
    found: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, equals, secret = line.partition("=")
        name, secret = name.strip().lower(), secret.strip()
        if not equals or name not in names:
            raise ConfigurationError(
                f"{where} line {number}: expected role=secret with a role among "
                f"{', '.join(sorted(names))}"
            )
        if not secret:
            raise ConfigurationError(f"{where} line {number}: the {name} secret is empty")
        if name in found:
            raise ConfigurationError(f"{where} line {number}: a second {name} secret")
        found[name] = secret
    if not found:
        raise ConfigurationError(f"{where} holds no secret (expected role=secret lines)")
    return found


def new_token() -> str:
    """A fresh random token, for operators setting up ``BROKER_TOKEN`` (documented as
    ``broker.main.new_token``)."""
    return secrets.token_urlsafe(32)
