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


# --------------------------------------------------------------------------- runner start-up
# (issue 30, finding 9: a child that cannot get ready must not hand its job back for ever)

RUNNER_STARTUP_TIMEOUT = 30.0
"""Seconds a pooled or forked child may take to import the apps, run their start-up
hooks and say ready (the default of ``--runner-startup-timeout``); past it the child is
killed, and that is a start-up failure. A job's own time limit starts only once its child
is ready."""

RUNNER_START_FAILURES_FORGIVEN = 2
"""Start-up failures of its runner process that one job is given back for unharmed (no
attempt counted) on one worker: they are the runner's fault, not the job's. Each later
one fails an attempt of the job, so a job whose children keep failing to start (while
the mode's probe processes start, so the worker keeps taking it) ends, dead once its
attempts are spent, instead of going back to the queue for ever."""

RUNNER_START_FAILURES_TRACKED = 1024
"""Jobs whose start-up failures a worker remembers; past it the oldest count is dropped
(that job starts its count again), so job ids from the main cannot grow the worker."""

BOUNDS += [
    Bound(
        "A runner process's start-up (start, import the apps, run their start-up hooks, say ready)",
        "30 s",
        "--runner-startup-timeout",
        "killed; a start-up failure (next row); the mode advertises no slots until a "
        "probe process starts (tried after 0.5 s, the delay doubling up to 30 s)",
        "Runner start-up",
    ),
    Bound(
        "Start-up failures one job is given back for unharmed, per worker",
        "2",
        None,
        "each later one fails an attempt of the job (`its runner process failed to start "
        "N times for this job …`), retried like any failure, dead (`failed`) once its "
        "attempts are spent",
        "Runner start-up",
    ),
    Bound(
        "Jobs a worker counts start-up failures for",
        "1024",
        None,
        "the oldest job's count is forgotten (its count starts again)",
        "Runner start-up",
    ),
]

# --------------------------------------------------------------------------- the task catalog
# (``broker.core.catalog``: what a worker's ``tasks`` message may hold, and how long the
# catalog keeps the declarations of a worker that has gone.)

MAX_DECLARED_TASKS = 1000
"""Tasks one worker may declare: one ``tasks`` message, which replaces that worker's
earlier declarations, so it is also the worker's share of the catalog."""

MAX_DECLARATION_BYTES = 4096
"""One task declaration as JSON: a name, a few defaults, its parameters and exception
names. A real task's is a few hundred bytes."""

MAX_CATALOG_ENTRIES = 10_000
"""Declarations (task and worker) in the whole catalog: what the main holds in memory and
reads at start-up, whatever number of worker ids declare."""

DEFAULT_TASK_GRACE = 7 * 24 * 3600.0
"""Seconds the catalog keeps the declarations of a worker that is no longer connected:
long enough for a fleet to be down over a long weekend without enqueues by name being
refused, short enough that workers that are gone for good stop vouching for names."""

BOUNDS += [
    Bound(
        limit="Tasks one worker declares (one `tasks` message, which replaces its earlier ones)",
        default="1000",
        flag=None,
        breach="`over_limit` (not fatal); nothing of the message is recorded, the worker's "
        "earlier declarations stay",
        section="Task catalog",
    ),
    Bound(
        limit="One task declaration, as JSON",
        default="4096 bytes",
        flag=None,
        breach="the same",
        section="Task catalog",
    ),
    Bound(
        limit="Declarations (task and worker) in the whole catalog",
        default="10 000",
        flag=None,
        breach="the same, until declarations of gone workers are dropped; a restarted main "
        "reads at most this many (the most recent)",
        section="Task catalog",
    ),
    Bound(
        limit="Fields of a concurrency-key template",
        default="`{name}`, `{name.attr}` or `{name[key]}`: no conversion (`!r`), no format "
        "spec (`:>9`)",
        flag=None,
        breach="`@task` raises `ConfigurationError`; a declaration holding one: `over_limit` "
        "as above",
        section="Task catalog",
    ),
    Bound(
        limit="Grace before the declarations of a worker no longer connected are dropped",
        default="7 days",
        flag="--task-grace",
        breach="dropped from the catalog in memory, the store and `broker tasks`",
        section="Task catalog",
    ),
]

# ---------------------------------------------------------------- metrics and the dashboard
# (broker.main.metrics, broker.ops.web): what one scrape or one page load can cost the main, however
# many queues and tasks the store holds and however long their names are.

_HTTP = "The HTTP port"

MAX_LABEL_SETS = 100
"""Distinct label sets (queue, or queue and task) one metric shows by name; the rest are
counted under ``"_other"``."""

MAX_LABEL_BYTES = 64
"""Longest metric label value, as UTF-8; a longer name is cut and ends in ``…``."""

MAX_METRICS_BYTES = 1 << 20
"""What one ``/metrics`` answer may weigh. Not a cut (a cut exposition would not parse):
the two bounds above keep the worst case (every label at its length and escaped) under
it, and a test renders that worst case."""

PAGE_ROWS = 100
"""Rows on one dashboard page (queues, workers, jobs, recoveries); the rest are on the
next pages."""

CELL_CHARS = 120
"""Characters of a name or value shown in a dashboard cell; a longer one is cut, ending
in ``…``."""

VALUE_BYTES = 64 << 10
"""Bytes of a job's arguments, result, checkpoint or error shown on its page (escaped
HTML); the rest is left out with a note (``broker job ID`` prints it whole)."""

MAX_PAGE_BYTES = 1 << 20
"""What one dashboard page may weigh: the bounds above keep every page's worst case
under it, and a test loads pages built of the longest names."""

DASHBOARD_REQUESTS = 2
"""The dashboard's requests to the request service in progress at once. Its own slots,
never the clients' (``max_requests``): a page load or an id search, which needs no
client credential, cannot hold back a client."""

HISTORY_MINUTES = 180
"""Minutes of history the main keeps for the dashboard's charts (a ring per series:
the oldest minute is reused)."""

HISTORY_SERIES = 20
"""Queues, and as many tasks, the history keeps a series of by name; the rest share one
series, ``"_other"``. With :data:`HISTORY_MINUTES`, at most
``(2 * HISTORY_SERIES + 3) * HISTORY_MINUTES`` one-minute buckets (under 4 MiB at worst)."""

BULK_ACTION_JOBS = 500
"""Jobs one dashboard bulk retry or cancel acts on, at most: the rest wait for the next
(each job is one request to the request service, so a bulk action costs the main what
as many ``broker retry`` or ``broker cancel`` would)."""

BOUNDS += [
    Bound(
        "Label sets per metric (by queue, or queue and task)",
        f"{MAX_LABEL_SETS}",
        None,
        'counted under `queue="_other"` (and `task="_other"`)',
        _HTTP,
    ),
    Bound(
        "A metric label value (a queue or task name)",
        f"{MAX_LABEL_BYTES} bytes",
        None,
        "cut, ending in `…`",
        _HTTP,
    ),
    Bound(
        "One `/metrics` answer",
        "1 MiB",
        None,
        "cannot happen: the two bounds above keep the worst case under it",
        _HTTP,
    ),
    Bound(
        "Rows on one dashboard page",
        f"{PAGE_ROWS}",
        None,
        "the rest on the next pages (`Next page`)",
        _HTTP,
    ),
    Bound(
        "A name or value in a dashboard cell",
        f"{CELL_CHARS} characters",
        None,
        "cut, ending in `…`",
        _HTTP,
    ),
    Bound(
        "A job's arguments, result, checkpoint or error on its page",
        "64 KiB each",
        None,
        "cut, with a note; `broker job ID` prints it whole",
        _HTTP,
    ),
    Bound(
        "One dashboard page",
        "1 MiB",
        None,
        "cannot happen: the bounds above keep the worst case under it",
        _HTTP,
    ),
    Bound(
        "Dashboard requests in progress (its own, never the clients' `--max-requests`)",
        f"{DASHBOARD_REQUESTS}",
        None,
        "page loads and searches wait; clients never do",
        _HTTP,
    ),
    Bound(
        "History the dashboard charts (per minute, kept in the main's memory)",
        f"{HISTORY_MINUTES} minutes, {HISTORY_SERIES} queues and {HISTORY_SERIES} tasks",
        None,
        'the oldest minute is reused; further queues and tasks share `"_other"`',
        _HTTP,
    ),
    Bound(
        "Jobs one dashboard bulk retry or cancel acts on",
        f"{BULK_ACTION_JOBS}",
        None,
        "the rest are left for the next one (the confirmation says so)",
        _HTTP,
    ),
    Bound(
        "`Host` header of a dashboard request (not `/healthz`)",
        "loopback names and the `--http-host` address",
        "--http-allowed-hosts",
        "`421`, nothing read",
        _HTTP,
    ),
]

# ---------------------------------------------------------------- handshake and credentials
# (issue 30, findings 5 and 10)

MAX_UNAUTHENTICATED_PER_ADDRESS = 64
"""Connections from one IP address in a handshake (TLS's or the protocol's) at once: half
of the global ``max_unauthenticated`` (128), so one address holding idle sockets until the
handshake deadline cannot lock every other address out, while a burst of honest
connections from one host (an app server starting 60 processes at once) still gets in, as
it did when 64 was the only limit."""

MIN_TOKEN_CHARACTERS = 16
"""The shortest secret a main listening beyond loopback accepts: a guessable secret there
is as good as none. ``new_token()`` makes 43."""

AUTH_FAILURE_LOG_BURST = 20
AUTH_FAILURE_LOG_PER_SECOND = 1.0
"""Failed authentications the main logs, and refused connections (each kind on its own):
a burst of 20, then one a second; the rest are counted and the count logged with the next
line, so a peer guessing secrets or opening sockets in a loop cannot flood the log."""

BOUNDS += [
    Bound(
        "Connections from one IP address still in the handshake (TLS's or the protocol's)",
        "64",
        "--max-unauthenticated-per-address",
        "the same as over `--max-unauthenticated`; one address at its limit holds up no other",
        "Connections and the handshake",
    ),
    Bound(
        "Length of each secret when the main listens beyond loopback",
        "16 characters",
        None,
        "the main refuses to start, naming the role",
        "Connections and the handshake",
    ),
    Bound(
        "Failed authentications logged, and refused connections (each with the peer's address)",
        "a burst of 20, then 1 a second",
        None,
        "the rest are counted, and the count is logged with the next line",
        "Connections and the handshake",
    ),
]

# --------------------------------------------------------------------------- connections
# (the handshake and framing limits that predate this table; their rows are below)

MAX_CONNECTIONS = 1024
"""Connections a main holds in all (``--max-connections``)."""

MAX_CONNECTIONS_PER_ADDRESS = 64
"""Connections from one IP address (``--max-connections-per-address``)."""

MAX_UNAUTHENTICATED = 128
"""Connections (and TLS handshakes) still in the handshake (``--max-unauthenticated``):
twice the limit per address, so an address holding its whole share leaves as many for
every other."""

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
_LIVENESS = f"{LIVENESS_TIMEOUT:g} s (pings every {PING_INTERVAL:g} s)"
"""The liveness defaults as the bounds table shows them (the main's and the worker's)."""

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
        "Connections still in the handshake (TLS's or the protocol's)",
        "128",
        "--max-unauthenticated",
        "waits in line for a slot (each slot freed goes to the first that fits); refused "
        "(`error` `over_limit`, fatal; for TLS closed) if none comes free within the "
        "handshake deadline, and logged",
        _CONNECTIONS,
    ),
    Bound(
        "Handshake deadline: the TLS handshake must finish this soon after accept, and "
        "`hello` arrive this soon after the challenge",
        "2 s",
        None,
        "TLS: closed, and logged; `hello`: `handshake_timeout` error; closed",
        _CONNECTIONS,
    ),
    Bound(
        "Read-ahead and longest line before `welcome` (at most about 512 KiB buffered per "
        "unauthenticated connection, so 128 of them stay under about 64 MiB)",
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
        _LIVENESS,
        "--liveness-timeout",
        "disconnected; its leases go back to the queue. Time the main itself was stalled is "
        "excused, so a slow moment in the main never returns live workers' leases",
        _BACK_PRESSURE,
    ),
    Bound(
        "A worker's wait for the main: nothing heard from it, or a send stuck, for this long",
        _LIVENESS,
        "broker-worker --liveness-timeout",
        "the worker gives the connection up and reconnects; its jobs keep running and their "
        "leases are listed in its next `hello`",
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
        "A job's `trace_context` (W3C `traceparent`, `tracestate`)",
        "4 entries, 1024 bytes of keys and values together",
        None,
        "`invalid_job`",
        _VALUES,
    ),
    Bound(
        "Stored error text",
        "NUL and lone surrogates escaped; cut at 65 536 characters",
        None,
        "made storable, never refused",
        _VALUES,
    ),
]


MAX_TRACE_CONTEXT_ENTRIES = 4
MAX_TRACE_CONTEXT_BYTES = 1024
"""A job's ``trace_context``: the W3C trace context of the span that enqueued it
(``traceparent``, 55 characters, and ``tracestate``, which W3C lets a vendor cut at 512),
as text keys and values. Every job row, hand-off and child pipe carries it, so it is
held to what a trace context needs (see ``docs/howto/tracing.md``)."""


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

MAX_PARENTS = 1000
"""The most parents one job may name in ``depends_on``: each is an edge row written at its
enqueue and counted down by a settle, and a fan-in's arguments hold one result per parent,
so its assignment must stay within a message's container bound (25,000) for small results."""

MAX_GROUP_MEMBERS = MAX_PARENTS
"""The most members of one group: a group's fan-in depends on every member."""

MAX_CHAIN_STEPS = 100
"""The most steps of one chain (its depth): each step waits on the one before, and a
parent's failure cancels the rest step by step inside one settle."""

MAX_WORKFLOW_MEMBERS = MAX_GROUP_MEMBERS + 1
"""The most members one ``get_workflow`` reads and sends: a fan-in of a full group and
its continuation (a chain is shorter). A workflow made by hand (specs sharing a
``workflow_id``) may hold more: the view then shows the first ones and says it is cut."""

MAX_WORKFLOW_EDGES = 2 * MAX_PARENTS
"""The most edges one ``get_workflow`` sends (a full fan-in has ``MAX_PARENTS``); more
are left out, the view saying it is cut, so a reply stays within a line."""

WORKFLOW_ERROR_CHARS = 200
"""How much of each member's ``last_error`` a workflow view carries (its first line, cut):
a summary; ``get_job`` has the whole error."""

BOUNDS += [
    Bound(
        "Parents of one job (`depends_on`), members of one group, and so the results a "
        "fan-in receives",
        "1000",
        None,
        "`invalid_job` (`InvalidJobError` from `JobSpec`, `chain` or `group`)",
        _VALUES,
    ),
    Bound(
        "Steps of one chain",
        "100",
        None,
        "`InvalidJobError` from `chain`",
        _VALUES,
    ),
    Bound(
        "Members and edges one workflow view carries (`get_workflow`)",
        "1001 members, 2000 edges",
        None,
        "the first ones are shown, with `truncated: true`",
        _VALUES,
    ),
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


# --------------------------------------------------------------------------- flow control
# (``broker.core.flow``: queue pause and rate limits, set by an operator, held by the main.)

MAX_RATE_PER_SECOND = 100_000.0
"""The fastest rate limit, in dispatches a second: a faster one limits nothing a main can
reach, and a rate's interval (its inverse, in nanoseconds) stays a whole number."""

MAX_RATE_BURST = 10_000
"""The largest burst a rate limit may allow: dispatches let through at once after a quiet
spell. It is a bucket's size, so a burst at the bound is at most one dispatch read's worth
of jobs many times over; more would defeat the limit."""

MAX_QUEUE_SETTINGS = 1000
"""Queues with settings (paused, or rate limited) at once: the main keeps a bucket for each
and reads them all at start-up, and each limited queue adds a name to every dispatch read."""

MAX_RATE_KEY_BYTES = 200
"""A job's rate key (``@task(rate_key="{tenant}")`` filled from its arguments), in UTF-8
bytes: computed once at enqueue, stored with the job, and named in dispatch reads while
its bucket has no token. A tenant id, an account, a host name fits many times over."""

MAX_RATE_KEYS = 10_000
"""Live per-key buckets the main keeps (:class:`broker.core.flow.KeyBuckets`). A bucket
that has filled up again (idle) is dropped first: it holds nothing a fresh one would
not. At the bound, with no idle bucket, a job of a key without a bucket waits, queued,
until the first bucket fills; no limit is ever exceeded. It also bounds the keys a
dispatch read leaves out."""

_FLOW = "Flow control"

BOUNDS += [
    Bound("A rate limit", "1/h to 100000/s", None, "`malformed`", _FLOW),
    Bound("A rate limit's burst", "1 to 10000 (default 1)", None, "`malformed`", _FLOW),
    Bound(
        "Queues with settings (paused or rate limited)",
        "1000",
        None,
        "`malformed`: the new setting is refused; clearing one frees a place",
        _FLOW,
    ),
    Bound(
        "A job's rate key (`@task(rate_key=...)` filled from its arguments)",
        "200 bytes",
        None,
        "`invalid_job` at enqueue, nothing stored",
        _FLOW,
    ),
    Bound(
        "Live per-key rate buckets at the main",
        "10 000",
        None,
        "idle (full) buckets are dropped first; with none idle, jobs of a new key stay "
        "queued until a bucket fills up; no limit is exceeded",
        _FLOW,
    ),
]

# --------------------------------------------------------------------------- pushed results
# (issue 32, item 5: a client waits for a job's end without polling)

MAX_WAITERS_PER_CONNECTION = 10_000
"""``wait_job`` requests one connection may have waiting at once. A waiter costs the main
a few hundred bytes and a timer until its job ends or its time is up; the bound keeps a
client that waits on everything at once from growing the main without end, and is high
enough that a web app waiting on each of its requests' jobs never meets it."""

MAX_WAIT_SECONDS = 3600.0
"""The longest one ``wait_job`` waits at the main before it is answered ``wait_pending``
(the client asks again for a longer wait): so a forgotten waiter holds its slot an hour
at most."""

BOUNDS += [
    Bound(
        "Jobs one connection waits for at once (`wait_job`)",
        "10 000",
        None,
        "`request_error` `over_limit` (`OverLimitError`); the connection's other waits go on",
        _BACK_PRESSURE,
    ),
    Bound(
        "One `wait_job`'s `timeout`",
        "1 hour",
        None,
        "`malformed` (a longer wait is several `wait_job` in turn; `Client.wait` does that)",
        _VALUES,
    ),
]
