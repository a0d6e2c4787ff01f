"""Every import path the docs give users works, and gives the real object.

``broker.__all__`` is the surface most users need, but the docs send adapter authors,
operators and task writers to a few more modules (``broker.storage``, ``broker.retry``,
``broker.main``...). Those paths are promises: the packages underneath may move, and
these modules stay as facades that re-export the real objects (as trio's ``trio.lowlevel``
does). :data:`DOCUMENTED` lists them; a test checks that every ``from broker... import``
in the docs is among them, and another that every dotted ``broker.`` path a page names
still resolves.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import broker

REPO = Path(__file__).resolve().parents[2]

DOCUMENTED: dict[str, list[str]] = {
    "broker": list(broker.__all__),
    "broker.jobs": [
        "CheckpointSave",
        "Claim",
        "Clock",
        "EnqueueResult",
        "ExecutionMode",
        "Job",
        "JobSpec",
        "JobStatus",
        "JSONValue",
        "ProgressUpdate",
        "Settlement",
    ],
    "broker.exceptions": [
        "ConfigurationError",
        "StorageError",
        "StorageRejectedError",
        "UniqueKeyTakenError",
    ],
    "broker.storage": [
        "INTEGRITY_ERROR",
        "SCHEMA_VERSION",
        "Capabilities",
        "JobFilter",
        "JobPage",
        "QueueCount",
        "QueueSettings",
        "StorageAdapter",
        "SupportsEnqueueHandedOff",
        "SupportsLeadership",
        "SupportsNotify",
        "SupportsOffload",
        "SupportsQueueSettings",
        "SupportsSchemaCheck",
        "TaskRecord",
        "check_payload",
        "contract_gaps",
        "payload_digest",
    ],
    "broker.settlement": ["claimable_at_enqueue", "enqueued", "payload_refused"],
    "broker.payload": ["encoded_size", "shape_problem"],
    "broker.retry": ["ExponentialBackoff", "FixedBackoff"],
    "broker.schedule": ["Schedule", "register"],
    "broker.main": ["Main", "new_token"],
    "broker.worker": ["Worker"],
    "broker.client": ["Client", "SyncClient", "configure"],
    "broker.tasks": ["Task", "TaskRegistry", "task"],
    "broker.contrib.django": ["enqueue"],
    "broker.composition": ["open_store"],
    "broker.testing": ["FakeClock"],
    "broker.testing.conformance": [
        "CHECKS",
        "Check",
        "CheckSkipped",
        "StoreHarness",
        "TampersPayloads",
        "run_check",
    ],
    "broker.testing.faults": ["FaultyAdapter"],
}
"""Each documented module and the names the docs import from it."""

NOT_PATHS = frozenset(
    {
        "broker.db",  # the SQLite file of the examples
        "broker.internal",  # a host name in the TLS and settings examples
        "broker.quiet_inserts",  # a PostgreSQL session setting
        "broker.runner",  # logger names, shown in log lines
        "broker.runner.pooled",
        "broker.retention",
        # OpenTelemetry span names and attributes (broker/model/tracing.py)
        "broker.enqueue",
        "broker.run",
        "broker.dispatch",
        "broker.worker.id",
        "broker.job.id",
        "broker.task",
        "broker.queue",
        "broker.attempt",
    }
)
"""Dotted names in the docs that start with ``broker.`` but are not import paths."""


def _pages() -> list[Path]:
    return sorted(
        [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "docs").rglob("*.py")]
    )


def _imports(text: str) -> Iterator[tuple[str, str]]:
    """(module, name) for every ``from broker... import ...`` in ``text``, parenthesised
    lists over several lines included."""
    pattern = r"from (broker(?:\.\w+)*) import (\([^)]*\)|[^\n]*)"
    for module, names in re.findall(pattern, text):
        if not names.startswith("("):
            names = names.split(";")[0]  # the next statement of a one-line program
        for piece in names.strip("()").split(","):
            # The name is the first word: then may come "as x", a comment, or the rest
            # of a one-line ``python -c`` program.
            words = re.findall(r"\w+", piece.split("#")[0])
            if words:
                yield module, words[0]


def _resolves(path: str) -> bool:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_each_documented_name_imports_as_the_real_object(module: str) -> None:
    facade = importlib.import_module(module)
    exported = getattr(facade, "__all__", None)
    for name in DOCUMENTED[module]:
        obj = getattr(facade, name)
        if exported is not None:
            assert name in exported, f"{module}.{name} is documented but not in __all__"
        if inspect.isclass(obj) or inspect.isfunction(obj):
            # The facade hands out the object itself, not a copy or a stand-in: the
            # module that defines it has the same object under the same name.
            home = importlib.import_module(obj.__module__)
            assert getattr(home, obj.__qualname__) is obj, f"{module}.{name}"


def test_every_import_the_docs_show_is_documented() -> None:
    shown = {
        (module, name): page.relative_to(REPO)
        for page in _pages()
        for module, name in _imports(page.read_text())
    }
    assert shown, "the docs show imports; the pattern must find them"
    undocumented = {
        f"{module}.{name} ({page})"
        for (module, name), page in shown.items()
        if name not in DOCUMENTED.get(module, [])
    }
    assert not undocumented, "add them to DOCUMENTED (or use a documented path)"


@pytest.mark.parametrize(
    "page", [pytest.param(page, id=str(page.relative_to(REPO))) for page in _pages()]
)
def test_every_dotted_broker_path_a_page_names_resolves(page: Path) -> None:
    names = set(re.findall(r"\bbroker(?:\.[A-Za-z_]\w*)+", page.read_text())) - NOT_PATHS
    assert not {name for name in names if not _resolves(name)}


@pytest.mark.parametrize(
    "page", [pytest.param(page, id=str(page.relative_to(REPO))) for page in _pages()]
)
def test_every_source_file_a_page_names_exists(page: Path) -> None:
    """The pages send readers to files (`broker/core/handoff.py`, `adapters/sql/rows.py`):
    after a move they must point at where the code is now."""
    named = set(re.findall(r"\b(?:broker|adapters|runners|tests)/[\w/]+\.py\b", page.read_text()))
    assert not {path for path in named if not (REPO / path).exists()}
