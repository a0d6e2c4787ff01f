"""The security how-to's limit tables are a checked copy of :data:`broker.model.bounds.BOUNDS`."""

from __future__ import annotations

import re
from pathlib import Path

from broker.model.bounds import BOUNDS, Bound

DOC = Path(__file__).resolve().parents[2] / "docs" / "howto" / "security.md"


LIMIT_HEADER = ["Limit", "Default", "Flag", "On breach"]
"""The header of a limit table; the other tables of the section ("Protection") list
protections that are not bounds."""


def _rows(limit_tables_only: bool = False) -> dict[str, tuple[str, list[str]]]:
    """Each table row under "Every limit", by its first cell: (its section, its cells);
    with ``limit_tables_only``, only the rows of tables headed :data:`LIMIT_HEADER`."""
    text = DOC.read_text(encoding="utf-8")
    every = text.split("## Every limit", 1)[1]
    every = re.split(r"\n## ", every, maxsplit=1)[0]
    rows: dict[str, tuple[str, list[str]]] = {}
    section = ""
    header: list[str] = []
    for line in every.splitlines():
        if not line.startswith("|"):  # a table ends at its first other line
            header = []
            if line.startswith("### "):
                section = line[4:].strip()
        elif not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] in {"Limit", "Protection"}:
                header = cells
            elif not limit_tables_only or header == LIMIT_HEADER:
                rows[cells[0]] = (section, cells)
    return rows


def _flag_cell(bound: Bound) -> str:
    return f"`{bound.flag}`" if bound.flag else "—"


def test_every_bound_has_its_row_in_the_security_howto() -> None:
    rows = _rows()
    for bound in BOUNDS:
        assert bound.limit in rows, f"docs/howto/security.md has no row for {bound.limit!r}"
        section, cells = rows[bound.limit]
        assert section == bound.section, bound.limit
        assert cells[1] == bound.default, bound.limit
        assert cells[2].startswith(_flag_cell(bound)) or (
            bound.flag is None and cells[2].startswith(("—", "(setting"))
        ), bound.limit
        assert cells[3] == bound.breach, bound.limit


def test_bounds_are_declared_once() -> None:
    limits = [bound.limit for bound in BOUNDS]
    assert len(limits) == len(set(limits))


def test_every_row_of_the_limit_tables_is_a_bound() -> None:
    """The other direction: the docs list no limit the code does not declare."""
    declared = {bound.limit for bound in BOUNDS}
    rows = _rows(limit_tables_only=True)
    assert rows, "docs/howto/security.md has no limit table"
    undeclared = [limit for limit in rows if limit not in declared]
    assert not undeclared, (
        f"rows of the security how-to that are not in broker.model.bounds: {undeclared}"
    )
