"""The main's settings: every knob, its default, and the rules between them.

Kept apart from :mod:`broker.main.main` so the CLI, the request service and the tests can
build and check settings without loading the main's machinery.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from broker.core.affinity import DEFAULT_MAX_WAIT
from broker.core.election import DEFAULT_FAILOVER_TIMEOUT
from broker.exceptions import ConfigurationError
from broker.jobs import DEFAULT_MAX_RECOVERIES
from broker.model import checks
from broker.model.bounds import (
    DEFAULT_MAX_CHECKPOINT_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_MAX_PAYLOAD_CONTAINERS,
    DEFAULT_MAX_PAYLOAD_DEPTH,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_REQUEST_BYTES_PER_CONNECTION,
    DEFAULT_TASK_GRACE,
    HANDSHAKE_TIMEOUT,
    LIVENESS_TIMEOUT,
    MAX_AGE_SECONDS,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
    MAX_CREDIT,
    MAX_ERRORS_PER_CONNECTION,
    MAX_OUTBOX_BYTES,
    MAX_PAYLOAD_BYTES_CEILING,
    MAX_PAYLOAD_DEPTH_CEILING,
    MAX_REQUESTS,
    MAX_REQUESTS_PER_CONNECTION,
    MAX_UNAUTHENTICATED,
    MAX_UNAUTHENTICATED_PER_ADDRESS,
    MIN_TOKEN_CHARACTERS,
    PING_INTERVAL,
    PREAUTH_MAX_LINE_BYTES,
)
from broker.model.setting import check_rows, comma_list, setting
from broker.payload import LINE_HEADROOM_BYTES, MAX_LINE_BYTES_CEILING
from broker.wire.addresses import parse_address
from broker.wire.credentials import Credentials
from broker.wire.messages import DEFAULT_PORT
from broker.wire.tls import ServerTLS

MIN_LINE_BYTES = 2 << 20
"""2 MiB: the default line limit for a small payload limit, or none."""

DEFAULT_LIST_PAGE_BYTES = 1 << 20
"""1 MiB: a page of jobs that a client decodes, and the main encodes, in a few milliseconds."""


def line_limit_for(max_payload_bytes: int | None, max_checkpoint_bytes: int | None) -> int:
    """The default ``max_line_bytes`` for a payload and a checkpoint limit: room for a job
    message carrying both at their limits and 1 MiB more, at least :data:`MIN_LINE_BYTES`
    and at most what a worker accepts (:data:`MAX_LINE_BYTES_CEILING`; a checkpoint
    limit that does not fit then is lowered, see :attr:`MainSettings.checkpoint_limit`)."""
    if max_payload_bytes is None:
        return DEFAULT_MAX_LINE_BYTES
    wanted = max_payload_bytes + (max_checkpoint_bytes or 0) + (1 << 20)
    return max(MIN_LINE_BYTES, min(wanted, MAX_LINE_BYTES_CEILING))


def _limit(help: str) -> Any:
    """A resource limit of the main: a positive count, its current value in ``--help``."""
    return {"parse": int, "check": checks.positive, "metavar": "N", "help": help + _SHOWN}


_SHOWN = " (default: %(default)s)"


def _port(name: str, value: int) -> object:
    return checks.int_in_range(name, value, 0, 65535)


def _address(name: str, value: str) -> object:
    """``advertise`` is a ``HOST:PORT`` peers can dial; a bad one (a URL) is refused as
    the flag is parsed, not after the main has started."""
    try:
        return parse_address(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{name}: {exc}") from None


def _depth(name: str, value: int) -> object:
    return checks.int_in_range(
        name,
        value,
        1,
        MAX_PAYLOAD_DEPTH_CEILING,
        why="Python's json cannot reliably handle deeper values",
    )


@dataclass(frozen=True)
class MainSettings:
    """Every knob of the main, each with its default, its flag and its rule once (the
    table :mod:`broker.ops.cli` builds ``broker-main``'s flags and ``BROKER_*`` variables
    from; see :mod:`broker.model.setting`)."""

    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(DEFAULT_PORT, parse=int, check=_port, help="port to listen on")
    token: str | None = None
    """The shared secret: every role's, unless the role has its own below."""
    worker_token: str | None = None
    client_token: str | None = None
    operator_token: str | None = None
    allow_unauthenticated: bool = setting(
        False,
        parse=bool,
        help="listen on a non-loopback address without credentials (the main's port only; "
        "see --http-allow-unauthenticated)",
    )
    """Permit a non-loopback listen address without credentials (say, inside a private
    network)."""
    tls: ServerTLS | None = None
    """The main's certificate and key (and the CA of client certificates for mutual TLS);
    ``None``: plain TCP."""
    max_line_bytes: int = setting(
        DEFAULT_MAX_LINE_BYTES,
        parse=int,
        check=checks.positive,
        derived=True,
        help="largest protocol message accepted after the handshake "
        "(default: the payload limit plus the checkpoint limit plus 1 MiB, at least 2 MiB, "
        "at most 33 MiB)",
    )
    """Longest line accepted after the handshake; must exceed ``max_payload_bytes`` by at
    least 64 KiB so a job at the payload limit still fits in one message. The flag's
    default is derived (:func:`line_limit_for`)."""
    max_payload_bytes: int | None = setting(
        DEFAULT_MAX_PAYLOAD_BYTES,
        parse=int,
        check=checks.positive,
        help="largest args+kwargs of a job, and largest result, as JSON "
        f"(at most {MAX_PAYLOAD_BYTES_CEILING})",
    )
    """Largest args + kwargs of a job, and largest result, as JSON; ``None``: no limit."""
    max_payload_depth: int = setting(
        DEFAULT_MAX_PAYLOAD_DEPTH,
        parse=int,
        check=_depth,
        help="how many lists and objects deep each argument and each result may nest",
    )
    """How many lists and objects deep each argument and each result may nest; workers
    learn it from ``welcome``."""
    max_checkpoint_bytes: int | None = setting(
        DEFAULT_MAX_CHECKPOINT_BYTES,
        parse=int,
        check=checks.positive,
        help="largest checkpoint a task may save, as JSON (docs/howto/long-jobs.md)",
    )
    """Largest checkpoint a task may save, as JSON; ``None``: only what a line can hold.
    A job message carries its arguments and its checkpoint, so the limit in force
    (:attr:`checkpoint_limit`) may be lower."""
    max_payload_containers: int = setting(
        DEFAULT_MAX_PAYLOAD_CONTAINERS,
        **_limit(
            "lists and objects ('[' and '{') one message may hold, so one payload, result or "
            "checkpoint too; counted before the message is decoded"
        ),
    )
    """How many lists and objects (``[`` and ``{``) one message from a peer may hold, so one
    payload, result or checkpoint too; counted in the line before it is decoded, and
    learnt by workers and clients from ``welcome``."""
    preauth_max_line_bytes: int = setting(PREAUTH_MAX_LINE_BYTES, check=checks.positive)
    handshake_timeout: float = setting(HANDSHAKE_TIMEOUT, check=checks.positive)
    ping_interval: float = setting(
        PING_INTERVAL, parse=float, check=checks.positive, help="seconds between pings"
    )
    liveness_timeout: float = setting(
        LIVENESS_TIMEOUT,
        parse=float,
        check=checks.positive,
        help="seconds of silence after which a peer is treated as gone",
    )
    orphan_grace: float = setting(
        30.0,
        parse=float,
        check=checks.non_negative,
        help="seconds a restarted (or stalled) main waits for workers to reclaim their leases",
    )
    """How long handoffs found in the store at start-up wait for their worker to come back."""
    max_recoveries: int = setting(
        DEFAULT_MAX_RECOVERIES,
        parse=int,
        check=checks.non_negative_int,
        help="lost attempts (worker, child or connection died) a job recovers from, unless "
        "its task sets max_recoveries; the next one ends it dead",
    )
    """Lost attempts a job recovers from (runs again at once) unless it sets its own
    ``max_recoveries``; the next lost attempt ends it dead."""
    affinity_grace: float = setting(
        60.0,
        parse=float,
        check=checks.non_negative,
        help="seconds a local_state job's recovery waits for the worker holding its state "
        "after that worker left",
    )
    """How long the recovery of a ``local_state`` job waits for the worker holding its
    state after that worker left, and how far each extension of its wait moves it (while
    the holder stays connected, up to ``affinity_max_wait``)."""
    affinity_max_wait: float = setting(
        DEFAULT_MAX_WAIT,
        parse=float,
        check=checks.positive,
        help="seconds at most a local_state job's recovery waits for the worker holding its "
        "state, even while that worker stays connected; then any worker runs it, told its "
        "state is lost (default: 1 hour)",
    )
    """The cap on a recovery's wait for its state holder (:mod:`broker.core.affinity`)."""
    task_grace: float = setting(
        DEFAULT_TASK_GRACE,
        parse=float,
        check=checks.positive,
        help="seconds the task catalog keeps the declarations of a worker no longer "
        "connected (default: 7 days)",
    )
    """Seconds the task catalog keeps the declarations of a worker no longer connected
    (:mod:`broker.core.catalog`)."""
    error_retry_interval: float = setting(1.0, check=checks.positive)
    poll_interval: float = setting(0.5, check=checks.positive)
    """How often to look for jobs other processes wrote, when the store cannot notify."""
    notify_fallback_interval: float = setting(30.0, check=checks.positive)
    """A slow safety poll for stores that notify, in case a notification is ever lost."""
    claim_batch: int = setting(256, check=checks.positive)
    """Most jobs one dispatch pass claims in one store call, unless the workers with free
    credit would each get less than a line of it (:func:`broker.core.handoff.pass_size`)."""
    max_claims_in_flight: int = setting(2, check=checks.positive)
    """Claims the dispatcher keeps under way at once: the next pass reads while the last
    claim's round trip is still out, so credit freed meanwhile is used at once."""
    report_batch: int = setting(512, check=checks.positive)
    enqueue_batch: int = setting(1000, check=checks.positive)
    """Most jobs one group commit of concurrent enqueues writes in one transaction."""
    max_errors_per_connection: int = setting(MAX_ERRORS_PER_CONNECTION, check=checks.positive)
    list_page_bytes: int = setting(
        DEFAULT_LIST_PAGE_BYTES,
        parse=int,
        check=checks.positive,
        help="about how many bytes of jobs one page of a job listing may carry",
    )
    """About how many bytes of jobs one ``list_jobs`` reply may carry (never more than fits
    in ``max_line_bytes``); the page ends early, with a cursor, once they are used up."""
    max_outbox_bytes: int = setting(
        MAX_OUTBOX_BYTES,
        **_limit(
            "bytes queued for one peer before the main stops reading from it; a peer over it "
            "for the liveness timeout is disconnected"
        ),
    )
    """Bytes queued for one peer before the main stops reading its messages (until half
    have been sent); a peer over it for ``liveness_timeout`` is disconnected."""
    max_requests_per_connection: int = setting(
        MAX_REQUESTS_PER_CONNECTION,
        **_limit(
            "client requests one connection may have in progress (then the main stops reading it)"
        ),
    )
    """Client requests one connection may have in progress; at the cap the main stops
    reading that connection, so TCP holds the rest back at the peer."""
    max_request_bytes_per_connection: int = setting(
        DEFAULT_MAX_REQUEST_BYTES_PER_CONNECTION,
        **_limit(
            "bytes of one connection's client requests in progress (then the main stops reading it)"
        ),
    )
    """Bytes of the lines of one connection's client requests in progress; at the cap the
    main stops reading that connection until they finish."""
    max_request_bytes: int = setting(
        DEFAULT_MAX_REQUEST_BYTES,
        **_limit("bytes of all client requests in progress (then the main stops reading clients)"),
    )
    """Bytes of the lines of all client requests in progress; at the cap the main stops
    reading client connections (not workers') until they finish."""
    max_requests: int = setting(
        MAX_REQUESTS, **_limit("client requests in progress across all connections")
    )
    """Client requests in progress across all connections. Below the SQL adapter's pool
    (5 connections plus 10 overflow), so requests can never take every database connection
    from dispatch, settlement, recovery and the listener."""
    max_connections: int = setting(
        MAX_CONNECTIONS, **_limit("connections in all; more are refused")
    )
    max_connections_per_address: int = setting(
        MAX_CONNECTIONS_PER_ADDRESS,
        **_limit("connections from one IP address; more are refused"),
    )
    max_unauthenticated: int = setting(
        MAX_UNAUTHENTICATED,
        **_limit("connections still in the handshake; more wait in line for a slot"),
    )
    """Connections that have not finished the handshake yet, from all addresses."""
    max_unauthenticated_per_address: int = setting(
        MAX_UNAUTHENTICATED_PER_ADDRESS,
        **_limit("connections from one IP address still in the handshake; more wait in line"),
    )
    """Connections from one address that have not finished the handshake yet, so one
    address cannot take every handshake slot."""
    max_credit: int = setting(
        MAX_CREDIT,
        **_limit("free slots a worker may announce per mode; a larger ready is refused"),
    )
    """Free slots a worker may announce per mode in ``ready``; a larger ``ready`` is refused."""
    failover_timeout: float = setting(
        DEFAULT_FAILOVER_TIMEOUT,
        parse=float,
        check=checks.positive,
        help="several mains on one PostgreSQL store: seconds, at most, from the leader's "
        "death to a standby dispatching (the leader's lease is 60%% of it)",
    )
    """With several mains on one PostgreSQL store: the longest a standby takes to
    dispatch after the leader died (its lease is 60% of it; see
    :class:`broker.core.election.Timing`)."""
    advertise: str | None = setting(
        None,
        metavar="HOST:PORT",
        check=_address,
        help="where peers reach this main, as standbys name it to them once it leads "
        "(default: the listen address and port; this host's name for 0.0.0.0)",
    )
    """``HOST:PORT`` a standby names to peers as this main's address once it leads;
    ``None``: the listen address and port (this host's name for a wildcard address)."""
    http_host: str = setting(
        "127.0.0.1", help="address of the web dashboard, /metrics and /healthz"
    )
    http_port: int | None = setting(
        None,
        parse=int,
        check=_port,
        help="port of the web dashboard, /metrics and /healthz (default: none, no HTTP)",
    )
    """Where the web dashboard, ``/metrics`` and ``/healthz`` listen (``broker.ops.web``);
    ``None``: nowhere. Its pages show jobs' arguments, so an address off loopback needs
    ``http_read_token`` or ``http_allow_unauthenticated``."""
    http_allowed_hosts: tuple[str, ...] = setting(
        (),
        parse=comma_list,
        metavar="NAMES",
        help="comma-separated Host names the dashboard answers to besides loopback names "
        "and --http-host (any other Host is refused: DNS rebinding)",
    )
    """``Host`` names the dashboard answers to besides loopback names and ``http_host``
    (a request naming any other host is refused: DNS rebinding)."""
    http_read_token: str | None = setting(
        None,
        help="the secret every dashboard read and /metrics needs (a bearer token or a "
        "Basic password; the operator secret reads too); default: none",
    )
    """The secret every dashboard read and ``/metrics`` needs (the operator secret reads
    too); ``None``: reads need none."""
    http_allow_unauthenticated: bool = setting(
        False,
        parse=bool,
        help="serve the dashboard off loopback with no --http-read-token; the main's port "
        "keeps its own rule",
    )
    """Serve the dashboard off loopback with no read token. Only the HTTP port's: the
    main's own port keeps its rule (``allow_unauthenticated``)."""

    @property
    def credentials(self) -> Credentials:
        """Each role's secret (:mod:`broker.wire.credentials`)."""
        return Credentials.combine(
            shared=self.token,
            worker=self.worker_token,
            client=self.client_token,
            operator=self.operator_token,
        )

    @property
    def checkpoint_limit(self) -> int | None:
        """The checkpoint limit in force: ``max_checkpoint_bytes``, lowered so that a job
        message (its arguments, its checkpoint and 64 KiB for the rest) always fits in
        one line, of the main's and of a worker's (:data:`MAX_LINE_BYTES_CEILING`). With
        the defaults (21 MiB lines, 16 MiB payload) it is the 4 MiB asked for; a line
        limit set just above the payload limit leaves no room, and every checkpoint is
        refused with this limit in its message (raise ``max_line_bytes``)."""
        line = min(self.max_line_bytes, MAX_LINE_BYTES_CEILING)
        room = line - (self.max_payload_bytes or 0) - LINE_HEADROOM_BYTES
        if self.max_checkpoint_bytes is None:
            return max(0, room) if self.max_payload_bytes is not None else None
        return max(0, min(self.max_checkpoint_bytes, room))

    def validate(self) -> None:
        """Each field's rule from the table, then the rules between fields."""
        check_rows(self)
        if self.task_grace > MAX_AGE_SECONDS:  # a date that far back does not exist
            raise checks.refuse("task_grace", "at most a hundred years", self.task_grace)
        if self.max_payload_bytes is not None:
            checks.require(
                self.max_payload_bytes <= MAX_PAYLOAD_BYTES_CEILING,
                f"max_payload_bytes ({self.max_payload_bytes}) may be at most "
                f"{MAX_PAYLOAD_BYTES_CEILING} (32 MiB): a job at the limit must fit in a "
                "worker's line bound and a child's pipe; pass larger data by reference",
            )
            checks.require(
                self.max_line_bytes >= self.max_payload_bytes + LINE_HEADROOM_BYTES,
                f"max_line_bytes ({self.max_line_bytes}) must exceed max_payload_bytes "
                f"({self.max_payload_bytes}) by at least {LINE_HEADROOM_BYTES} bytes, so "
                "a job at the payload limit fits in one message; raise --max-line-bytes "
                f"(e.g. to {line_limit_for(self.max_payload_bytes, self.max_checkpoint_bytes)}) "
                "or lower --max-payload-bytes",
            )
        checks.require(
            self.liveness_timeout > self.ping_interval,
            "liveness_timeout must be longer than ping_interval",
        )
        checks.require(
            self.credentials.required or self.allow_unauthenticated or _is_loopback(self.host),
            f"refusing to listen on {self.host!r} without a token for any role: set BROKER_TOKEN "
            "(or a secret per role, or --token-file), listen on 127.0.0.1, or pass "
            "--allow-unauthenticated if the network is private",
        )
        short = [] if _is_loopback(self.host) else self.credentials.too_short(MIN_TOKEN_CHARACTERS)
        checks.require(
            not short,
            f"refusing to listen on {self.host!r} with a {' and '.join(map(str, short))} "
            f"secret of fewer than {MIN_TOKEN_CHARACTERS} characters: anyone who reaches the "
            "port could guess it; make one with "
            "python -c 'from broker.main import new_token; print(new_token())'",
        )
        if self.http_port is not None:
            checks.require(
                bool(self.http_read_token)
                or self.http_allow_unauthenticated
                or _is_loopback(self.http_host),
                f"refusing to serve the dashboard on {self.http_host!r} with no read token: "
                "its pages and /metrics show jobs' arguments, so set --http-read-token "
                "(BROKER_HTTP_READ_TOKEN), keep --http-host on loopback and reach it through "
                "a tunnel, or pass --http-allow-unauthenticated if the network is private "
                "(--allow-unauthenticated is the main port's alone)",
            )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
