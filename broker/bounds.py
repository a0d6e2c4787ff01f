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
