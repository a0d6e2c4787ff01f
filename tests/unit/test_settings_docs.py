"""Every flag of the three commands is in the docs' settings tables, and only those.

``docs/howto/deploy.md`` says it lists every setting, and ``docs/reference/cli.md`` is the
reference: both tables are compared with the parsers the commands build (from the
settings tables of :mod:`broker.model.setting`), so a new flag without a row, or a row
for a flag that went, fails here, naming the page and the flag.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.ops import cli

DOCS = Path(__file__).resolve().parents[2] / "docs"
FIRST_CELL = re.compile(r"^\|([^|\n]*)\|", re.MULTILINE)
FLAG = re.compile(r"`(--[a-z0-9-]+)")

SECTIONS: list[tuple[str, str, Callable[[], argparse.ArgumentParser]]] = [
    ("howto/deploy.md", "### broker-main", cli.main_parser),
    ("howto/deploy.md", "### broker-worker", cli.worker_parser),
    ("howto/deploy.md", "### broker (operator", cli.broker_parser),
    ("reference/cli.md", "## broker-main", cli.main_parser),
    ("reference/cli.md", "## broker-worker", cli.worker_parser),
    ("reference/cli.md", "## broker\n", cli.broker_parser),
]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {
        flag
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag not in {"--help", "--version"}
    }


def _section(page: str, heading: str) -> str:
    """The text from ``heading`` to the next heading (any level)."""
    text = (DOCS / page).read_text()
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start : end if end != -1 else len(text)]


@pytest.mark.parametrize(
    ("page", "heading", "build"), SECTIONS, ids=[f"{p}:{h.strip()}" for p, h, _ in SECTIONS]
)
def test_the_settings_table_lists_every_flag_and_no_other(
    page: str, heading: str, build: Callable[[], argparse.ArgumentParser]
) -> None:
    shown = {
        flag for cell in FIRST_CELL.findall(_section(page, heading)) for flag in FLAG.findall(cell)
    }
    flags = _flags(build())
    assert not flags - shown, f"docs/{page} {heading.strip()!r} lacks rows for these flags"
    assert not shown - flags, f"docs/{page} {heading.strip()!r} has rows for flags that are gone"
