"""requirements-dev.lock, which ``make install`` installs and ``make audit`` audits, pins
every dependency that pyproject.toml names: a dependency added without ``make lock``
would be missing from every fresh environment, and never audited."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    """The canonical name of a requirement (PEP 503: lower case, runs of -_. as -)."""
    bare = re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", bare).lower()


def test_the_lock_file_pins_every_dependency_with_hashes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    wanted |= {_name(r) for extra in project["optional-dependencies"].values() for r in extra}
    lock = (ROOT / "requirements-dev.lock").read_text()
    pinned = {_name(m) for m in re.findall(r"^([A-Za-z0-9][\w.-]*)==", lock, re.MULTILINE)}
    assert sorted(wanted - pinned) == [], "run make lock"
    entries = re.findall(r"^[A-Za-z0-9][\w.-]*==\S+((?:\s*\\\n\s+--hash=sha256:\w+)+)", lock, re.M)
    assert len(entries) == len(pinned), "every pin carries its hashes"
