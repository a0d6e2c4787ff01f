"""Every bound on a value from outside, declared once: the table the code enforces and the docs show.

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
