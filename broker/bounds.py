"""Every bound on a value from outside, declared once: the table the code enforces, the docs show.

A value that crosses a trust boundary (the wire, a direct enqueue, the task catalog, a
worker's status, an HTTP request) must have a ceiling on what it can cost the main, or
one legal request can freeze or bloat it. Each ceiling is a :class:`Bound` in
:data:`BOUNDS`: the constant the code checks against, the default, the flag that moves
it (if any) and what a breach does. ``docs/howto/security.md`` lists them in its
"Every limit" tables, and a test holds every row of those tables to this one, so the two
cannot drift.

This module sits at the bottom of the import graph: the modules that enforce a bound
import its constant from here, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    """One row of the security how-to's limit tables."""

    limit: str
    """What is bounded, as the docs' first column says it (the row's key)."""
    default: str
    """The default as the docs show it (``"1024 bytes"``, ``"16 MiB (at most 32 MiB)"``)."""
    flag: str | None
    """The command-line flag that moves it, ``None`` when it is fixed or only a setting."""
    breach: str
    """What a breach does, as the docs' last column says it."""
    section: str
    """The docs' ``###`` heading the row sits under."""


BOUNDS: list[Bound] = []
"""Every declared bound. Add a row beside the constant it describes; the docs test
(``tests/unit/test_bounds_docs.py``) fails until ``docs/howto/security.md`` shows it."""


# --------------------------------------------------------------------------- connections
# (the handshake and framing limits that predate this table; their rows are below)

MAX_CONNECTIONS = 1024
"""Connections a main holds in all (``--max-connections``)."""

MAX_CONNECTIONS_PER_ADDRESS = 64
"""Connections from one IP address (``--max-connections-per-address``)."""

MAX_UNAUTHENTICATED = 64
"""Connections (and TLS handshakes) still in the handshake (``--max-unauthenticated``)."""

HANDSHAKE_TIMEOUT = 2.0
"""Seconds a peer has, after accept, to send ``hello``."""

PREAUTH_MAX_LINE_BYTES = 64 << 10
"""The longest line before a peer has authenticated. Small, because an unauthenticated
peer should cost little; not tiny, because ``hello`` carries the worker's held leases
(about 100 bytes each)."""

MAX_ERRORS_PER_CONNECTION = 20
"""Bad messages one connection may send before it is closed."""

# --------------------------------------------------------------------------- back-pressure

MAX_OUTBOX_BYTES = 8 << 20
"""8 MiB queued for one peer: four replies at the default line cap, far more than a peer
that reads ever has waiting."""

MAX_REQUESTS_PER_CONNECTION = 16
"""Client requests one connection may have in progress."""

MAX_REQUESTS = 8
"""Client requests in progress across all connections: below the SQL adapter's pool
(5 connections plus 10 overflow), so requests never take every database connection."""

MAX_CREDIT = 10_000
"""Free slots one worker may announce per mode. Far above any real runner, and low enough
that a rogue or buggy ``ready`` (up to 2**63) cannot make one worker the pick for every job."""

LIVENESS_TIMEOUT = 15.0
PING_INTERVAL = 5.0
"""A peer that answers no ping (sent every ``PING_INTERVAL``) for ``LIVENESS_TIMEOUT`` s
is disconnected."""

# --------------------------------------------------------------------------- values

MAX_DELAY_SECONDS = 10 * 365 * 24 * 3600
"""Ten years: the longest ``delay`` of an enqueue or a ``Reschedule``."""

MAX_AGE_SECONDS = 100 * 365 * 24 * 3600
"""A hundred years: the oldest cut-off a ``prune`` may name; ``now - age`` must stay a date
the stores hold, where an age like ``1e300`` would overflow."""

MAX_TEXT_CHARS = 64 * 1024
"""The longest error text stored for a job; a longer one is cut and says so."""


_CONNECTIONS = "Connections and the handshake"
_BACK_PRESSURE = "Back-pressure and liveness"
_VALUES = "Values"

BOUNDS += [
    # ----------------------------------------------------------------------- connections
    Bound(
        "Connections in all",
        "1024",
        "--max-connections",
        "`error` `over_limit` (fatal) instead of `challenge`; closed",
        _CONNECTIONS,
    ),
    Bound(
        "Connections from one IP address",
        "64",
        "--max-connections-per-address",
        "the same",
        _CONNECTIONS,
    ),
    Bound(
        "Connections still in the handshake",
        "64",
        "--max-unauthenticated",
        "the same",
        _CONNECTIONS,
    ),
    Bound(
        "TLS handshakes under way (with `--tls-cert`; each must finish within the handshake "
        "deadline)",
        "64",
        "--max-unauthenticated",
        "closed at once, and logged (no `error` line: the peer expects TLS)",
        _CONNECTIONS,
    ),
    Bound(
        "Handshake deadline: `hello` must arrive this soon after accept",
        "2 s",
        None,
        "`handshake_timeout` error; closed",
        _CONNECTIONS,
    ),
    Bound(
        "Read-ahead and longest line before `welcome` (at most about 512 KiB buffered per "
        "unauthenticated connection, so 64 of them stay under about 32 MiB)",
        "64 KiB",
        None,
        "`line_too_long` error; closed",
        _CONNECTIONS,
    ),
    Bound(
        "Longest line after `welcome` (only authenticated peers reach it; it bounds what one "
        "message may hold in memory)",
        "21 MiB (the payload limit plus the checkpoint limit plus 1 MiB)",
        "--max-line-bytes",
        "`line_too_long` error; closed; the reader never resynchronises mid-line",
        _CONNECTIONS,
    ),
    Bound(
        "Bad messages on one connection (malformed, unknown type, not allowed, over a bound)",
        "20",
        None,
        "closed",
        _CONNECTIONS,
    ),
    Bound("A line cut off by EOF", "—", None, "dropped, never parsed", _CONNECTIONS),
    # ----------------------------------------------------------------------- back-pressure
    Bound(
        "Bytes queued for one peer",
        "8 MiB",
        "--max-outbox-bytes",
        "the peer is paused (no new jobs, its messages not read) until half has been sent; "
        "still over it after the liveness timeout: disconnected, its leases returned",
        _BACK_PRESSURE,
    ),
    Bound(
        "Client requests in progress on one connection",
        "16",
        "--max-requests-per-connection",
        "the main stops reading that connection, so TCP holds the rest back at the peer",
        _BACK_PRESSURE,
    ),
    Bound(
        "Client requests in progress in all",
        "8",
        "--max-requests",
        "requests wait; kept below the SQL pool (5 + 10 overflow) so requests never take "
        "every database connection from dispatch and settlement",
        _BACK_PRESSURE,
    ),
    Bound(
        "Free slots a worker may announce per mode in `ready`",
        "10 000",
        "--max-credit",
        "that `ready` is refused (`over_limit`, not fatal); the worker gets no extra work",
        _BACK_PRESSURE,
    ),
    Bound(
        "Liveness: no answer to the main's own pings, a write stuck, or over the queue cap, "
        "for this long",
        "15 s (pings every 5 s)",
        "--liveness-timeout",
        "disconnected; its leases go back to the queue. Time the main itself was stalled is "
        "excused, so a slow moment in the main never returns live workers' leases",
        _BACK_PRESSURE,
    ),
    Bound("Requests of a connection that closed", "—", None, "cancelled", _BACK_PRESSURE),
    # ----------------------------------------------------------------------- values
    Bound(
        "Arguments + keyword arguments of a job, and a result, as JSON",
        "16 MiB (at most 32 MiB)",
        "--max-payload-bytes",
        "enqueue: `invalid_job`; result: the job fails, without retry",
        _VALUES,
    ),
    Bound(
        "Nesting depth of each argument, keyword argument and result",
        "64 (allowed 1–500)",  # noqa: RUF001 - the docs' en dash
        "--max-payload-depth",
        "the same; workers learn the limit from `welcome`, and every runner also enforces "
        "500 on its own",
        _VALUES,
    ),
    Bound(
        "Names and ids (task, queue, worker id, host, keys, request ids, cursor): no control "
        "characters (U+0000–U+001F, U+007F–U+009F, U+2028/2029) and no lone surrogates",  # noqa: RUF001
        "always",
        None,
        "`malformed` (a worker's `hello`: refused)",
        _VALUES,
    ),
    Bound(
        "Enqueue `delay` and a task's `Reschedule` delay",
        "0 to 315 360 000 s (ten years)",
        None,
        "`invalid_job`; a task raising `Reschedule(1e12)` fails that job with a clear error",
        _VALUES,
    ),
    Bound(
        "A job's `run_at`",
        "1970-01-01 ≤ `run_at` < 9000-01-01 UTC",
        None,
        "`invalid_job`",
        _VALUES,
    ),
    Bound("`prune`'s `older_than_seconds`", "0 to a hundred years", None, "`malformed`", _VALUES),
    Bound(
        "Stored error text",
        "NUL and lone surrogates escaped; cut at 65 536 characters",
        None,
        "made storable, never refused",
        _VALUES,
    ),
]


# --------------------------------------------------------------------------- wire and payloads
# (names, payload sizes and shapes, read-ahead bytes, worker status: the bounds-wire area)

MAX_NAME_BYTES = 1024
"""The longest name or id, in UTF-8 bytes: task and queue names, worker ids and hosts,
idempotency, concurrency and unique keys, request ids and cursors. The indexed ones must
fit a B-tree entry (about 2.7 KB on PostgreSQL), and every name is a log field, a metric
label, a dashboard cell and a column of every job row: a 40 MiB task name made each
``/metrics`` 600 MiB and knocked its worker off (issue 30)."""

DEFAULT_MAX_PAYLOAD_BYTES = 16 << 20
"""16 MiB, for a job's args and kwargs together, and separately for its result. Values over
the offload threshold (``broker.payload.DEFAULT_OFFLOAD_BYTES``) live apart from the job's
row, so a large one no longer weighs on every claim and settle; it still crosses the wire
and a child pipe whole."""

MAX_PAYLOAD_BYTES_CEILING = 32 << 20
"""The largest payload limit any setting may allow: a job at the limit, plus its message,
must fit in a worker's line bound and in the 64 MiB line buffers of the pipes to and from
a child, with room to spare."""

DEFAULT_MAX_CHECKPOINT_BYTES = 4 << 20
"""4 MiB: the largest checkpoint a task may save, as JSON. A large one lives apart from its
job's row like a large argument, but it is still a position and a little state, not the
data itself: every save crosses the wire (twice from a child) and is written to the store
whole, and every job message carries the last one beside the job's arguments, so the
default line limit grows with it."""

DEFAULT_MAX_LINE_BYTES = DEFAULT_MAX_PAYLOAD_BYTES + DEFAULT_MAX_CHECKPOINT_BYTES + (1 << 20)
"""21 MiB: a job at the default payload limit (16 MiB) with a checkpoint at the default
checkpoint limit (4 MiB), plus ample room for the rest of a message."""

DEFAULT_MAX_PAYLOAD_DEPTH = 64
"""How many lists and objects deep each argument, keyword argument and result may nest."""

MAX_PAYLOAD_DEPTH_CEILING = 500
"""The deepest any setting may allow. Python's recursion limit (1,000 frames) bounds what
``json`` can encode or decode, and a message adds a few levels around its payload and
is handled a few dozen frames down: 500 keeps clear of that in every process."""

DEFAULT_MAX_PAYLOAD_CONTAINERS = 25_000
"""The most lists and objects (``[`` and ``{`` in the JSON text, strings included) one
message from a peer may hold, so one payload too: a job's args and kwargs, a result, a
checkpoint, and an enqueue request with all its jobs.

Why a count and this one: building and checking a value costs per container, not per
byte. ``[]`` is two bytes of JSON and a 56-byte list in Python, so 15.5 MiB of
``[[],[],...]`` (5.4 million lists, under the 16 MiB payload limit) took 0.4 GB and
7 to 21 s of the main's loop to decode and walk for depth (issue 30). Counting the two
bytes in a line (``bytes.count``, about 1 ms a MiB) bounds that before anything is built.
At 25,000 the decode and the depth walk of a message at the bound take about 10 ms on
one core (25 ms on a loaded two-core machine), well under the 50 ms a loop may stall;
and a list of 20,000 records, or a bulk enqueue of 8,000 jobs with arguments, still
goes in one message."""

MESSAGE_CONTAINERS = 8
"""Lists and objects a message adds around its payload (the message, an enqueue's job list
and request, a batch), on top of :data:`DEFAULT_MAX_PAYLOAD_CONTAINERS`: a payload at the
bound still fits in a message."""

MAX_WORKER_STATUS_BYTES = 64 << 10
"""64 KiB: the longest ``worker_status`` line. The main keeps each worker's last status
and puts every one in each ``status`` reply: four 20 MiB statuses took a main from 93 MiB
to 1.7 GB (issue 30). A real one (capacity, busy slots, a start-up error per mode) is a
few hundred bytes."""

MAX_LIST_ITEMS = 1000
"""The most names in one list of a message (a worker's queues, a listing's queue, task and
status filters, a task's parameters and exception names, versions and modes). Lists of
objects (jobs, reports, leases) are bounded by :data:`DEFAULT_MAX_PAYLOAD_CONTAINERS`,
each item being one."""

DEFAULT_MAX_REQUEST_BYTES_PER_CONNECTION = 32 << 20
"""32 MiB of client requests (their lines' bytes) in progress on one connection before the
main stops reading it: with the request count cap (16) alone, 16 requests of 15 MiB could
hold 240 MiB of lines and their decoded values."""

DEFAULT_MAX_REQUEST_BYTES = 128 << 20
"""128 MiB of client requests in progress across all connections before the main stops
reading client connections (workers are still read)."""

BOUNDS += [
    Bound(
        "Names and ids (task, queue, worker id, host, idempotency, concurrency and unique "
        "keys, request ids, cursor), in UTF-8",
        "1024 bytes",
        None,
        "`malformed` on the wire (a worker's `hello`: refused); `InvalidJobError` from "
        "`JobSpec`, so a direct enqueue (`enqueue_in`) stores nothing",
        _VALUES,
    ),
    Bound(
        "Lists and objects in one message from a peer (`[` and `{` in its JSON, strings "
        "included; so in one payload, result or checkpoint too), counted before it is decoded",
        "25 000 (plus 8 for the message itself)",
        "--max-payload-containers",
        "enqueue: `payload_too_large`, nothing built or stored; a result: the job fails "
        "without retry (the worker fails it before sending); a checkpoint: refused "
        "(`payload_too_large`); anything else: `payload_too_large` error, not fatal",
        _VALUES,
    ),
    Bound(
        "Names in one list of a message (a worker's `queues`, a listing's filters, a task "
        "declaration's `parameters`, `retry_on`, `dont_retry_on`, `hello`'s versions and modes)",
        "1000",
        None,
        "`malformed`",
        _VALUES,
    ),
    Bound(
        "A worker's `worker_status` line",
        "64 KiB",
        None,
        "`over_limit` error, not fatal; the status is not kept (workers trim theirs to fit)",
        _VALUES,
    ),
    Bound(
        "Bytes of client requests in progress on one connection",
        "32 MiB",
        "--max-request-bytes-per-connection",
        "the main stops reading that connection until its requests finish (one request is "
        "always read, so one line over it still goes through)",
        _BACK_PRESSURE,
    ),
    Bound(
        "Bytes of client requests in progress in all",
        "128 MiB",
        "--max-request-bytes",
        "the main stops reading client connections (not workers) until requests finish",
        _BACK_PRESSURE,
    ),
]
