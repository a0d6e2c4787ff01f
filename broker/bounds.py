"""Every bound on a value from outside, declared once: the table the code enforces and
the docs show.

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
