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
"""Seconds a pooled or forked child may take to import the apps and say ready (the
default of ``--runner-startup-timeout``); past it the child is killed, and that is a
start-up failure. A job's own time limit starts only once its child is ready."""

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
        "A runner process's start-up (start, import the apps, say ready)",
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
# (``broker.catalog``: what a worker's ``tasks`` message may hold, and how long the
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
# (broker.metrics, broker.web): what one scrape or one page load can cost the main, however
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
        "`Host` header of a dashboard request (not `/healthz`)",
        "loopback names and the `--http-host` address",
        "--http-allowed-hosts",
        "`421`, nothing read",
        _HTTP,
    ),
]

# ---------------------------------------------------------------- handshake and credentials
# (issue 30, findings 5 and 10)

MAX_UNAUTHENTICATED_PER_ADDRESS = 32
"""Connections from one IP address in a handshake (TLS's or the protocol's) at once: half
of the global ``max_unauthenticated`` (64), so one address holding idle sockets until the
handshake deadline cannot lock every other address out, while a burst of honest
connections from one host (an app server starting its processes) still gets in."""

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
        "32",
        "--max-unauthenticated-per-address",
        "the same as over `--max-unauthenticated` (an `error` line, or for TLS closed at "
        "once), and logged",
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
