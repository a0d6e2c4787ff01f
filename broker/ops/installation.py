"""Is the installed ``adapters`` and ``runners`` this distribution's own?

The wheel installs three top-level packages: ``broker``, ``adapters`` and ``runners``.
The last two are generic names, and another distribution may install a package of the
same name into the same environment (AdapterHub's ``adapters`` does): pip then puts both
distributions' files into one directory, one overwriting the other's, and the broker
fails later with an error about some module it never meant to import (``No module named
'torch'``). The entry points check first, without importing either package, and stop with
a message that names the conflict and the fix.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import metadata

from broker.exceptions import ConfigurationError

DISTRIBUTION = "broker-jobs"
"""This project's name on the package index (``pip install broker-jobs``); ``broker`` was
taken. The import packages keep their names."""

OWN_PACKAGES = ("adapters", "runners")
"""The top-level packages with names generic enough for another distribution to use."""


def check_installation() -> None:
    """Raise :class:`ConfigurationError` when another installed distribution provides
    ``adapters`` or ``runners``, or overwrote one of their files; do nothing when this
    distribution is not installed (a source checkout on ``PYTHONPATH``)."""
    try:
        ours = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return
    clashes: dict[str, set[str]] = {}
    for dist in metadata.distributions():
        packages = _top_level(dist)
        if not packages:
            continue  # most distributions: skip before parsing their metadata
        name = dist.metadata["Name"] or "?"
        if _normal(name) == _normal(DISTRIBUTION):
            continue
        for package in packages:
            clashes.setdefault(package, set()).add(f"{name} {dist.version}")
    overwritten = [
        str(path) for path in ours.files or () if _is_init(path) and not _intact(ours, path)
    ]
    if not clashes and not overwritten:
        return
    found = [
        f"the top-level package {package!r} is also installed by {', '.join(sorted(owners))}"
        for package, owners in sorted(clashes.items())
    ]
    found += [f"{path} is not the file {DISTRIBUTION} installed" for path in overwritten]
    raise ConfigurationError(
        f"{DISTRIBUTION} cannot start: "
        + "; ".join(found)
        + ". Both install into the same directory, so one overwrote the other's files. "
        f"Fix: install {DISTRIBUTION} into a virtual environment of its own "
        f"(python -m venv ~/broker-env && ~/broker-env/bin/pip install {DISTRIBUTION}), "
        "or remove the other distribution from this one and reinstall "
        f"{DISTRIBUTION} (pip install --force-reinstall {DISTRIBUTION})."
    )


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_RECORDED_PACKAGE = re.compile(rf"^({'|'.join(OWN_PACKAGES)})/", re.M)


def _top_level(dist: metadata.Distribution) -> set[str]:
    """Which of :data:`OWN_PACKAGES` a distribution installs: from ``top_level.txt`` when
    it has one, else from its RECORD read as text (parsing every file entry of every
    installed distribution would add a quarter of a second to each command's start)."""
    listed = dist.read_text("top_level.txt")
    if listed is not None:
        return {line.strip() for line in listed.splitlines()} & set(OWN_PACKAGES)
    return set(_RECORDED_PACKAGE.findall(dist.read_text("RECORD") or ""))


def _is_init(path: metadata.PackagePath) -> bool:
    return len(path.parts) == 2 and path.parts[0] in OWN_PACKAGES and path.name == "__init__.py"


def _intact(dist: metadata.Distribution, path: metadata.PackagePath) -> bool:
    """Whether the installed file still has the hash the wheel's RECORD gives it."""
    if path.hash is None or path.hash.mode != "sha256":
        return True
    try:
        data = dist.locate_file(path).read_bytes()  # type: ignore[attr-defined]
    except OSError:
        return False
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return bool(digest == path.hash.value)
