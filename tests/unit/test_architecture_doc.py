"""docs/architecture.md draws the package order that pyproject.toml enforces: the page's
Layers table and the import-linter `layers` contract must name the same packages in the
same order, with the same `|` (independent) and `:` (may import each other) siblings."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _contract_layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers" and c["containers"] == ["broker"]]
    return [" ".join(layer.split()) for layer in layers["layers"]]


def _doc_layers() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    cells = [row.split(" | ")[1] for row in rows]
    return [" ".join(re.sub(r"[`\\]", "", cell).split()) for cell in cells]


def test_the_layers_table_is_the_layers_contract() -> None:
    assert _doc_layers() == _contract_layers()


def test_every_package_of_broker_is_in_a_layer() -> None:
    """A new package (or top-level module) must be placed in the order, not left unconstrained;
    the facades re-export one name each and stay outside it."""
    facades = {"__init__", "schedule", "composition", "cli"}
    placed = {name for layer in _contract_layers() for name in re.split(r"[|:]", layer)}
    present = {
        path.stem if path.is_file() else path.name
        for path in (ROOT / "broker").iterdir()
        if (path.suffix == ".py" or (path / "__init__.py").exists())
    }
    assert present - facades == {name.strip() for name in placed}
