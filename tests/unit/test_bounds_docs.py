"""The security how-to's limit tables are a checked copy of :data:`broker.bounds.BOUNDS`."""

from __future__ import annotations

import re
from pathlib import Path

from broker.bounds import BOUNDS, Bound

DOC = Path(__file__).resolve().parents[2] / "docs" / "howto" / "security.md"


def _rows() -> dict[str, tuple[str, list[str]]]:
    """Each table row under "Every limit", by its first cell: (its section, its cells)."""
    text = DOC.read_text(encoding="utf-8")
    every = text.split("## Every limit", 1)[1]
    every = re.split(r"\n## ", every, maxsplit=1)[0]
    rows: dict[str, tuple[str, list[str]]] = {}
    section = ""
    for line in every.splitlines():
        if line.startswith("### "):
            section = line[4:].strip()
        elif line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] not in {"Limit", "Protection"}:
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
