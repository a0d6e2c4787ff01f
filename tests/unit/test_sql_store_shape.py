"""The SQL store's shape (adapters/sql/): the adapter states what to do and never asks which
engine it runs on; errors become the broker's at one door; the enqueue-blocking order is
the one in broker/settlement.py."""

from __future__ import annotations

import ast
import sqlite3
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from adapters.sql.enqueue import match_holders
from adapters.sql.errors import StoreErrors
from adapters.sql.schema import FENCED_SQLSTATE
from broker import settlement
from broker.exceptions import DeposedError, StorageError, StorageRejectedError
from broker.jobs import Job, JobSpec, JobStatus

SQL = Path(__file__).resolve().parents[2] / "adapters" / "sql"
ENGINE_NAMES = {"postgresql", "postgres", "sqlite", "PostgresDialect", "SqliteDialect"}
"""What a branch on the engine would have to name (the dialect classes, or a backend)."""
ENGINE_ATTRIBUTES = {"_pg", "_lite", "_lite_reads", "_hot", "_backend", "_sqlite_file"}
"""The attributes the adapter's methods branched on before the dialect objects."""


@pytest.mark.parametrize("module", ["adapter.py", "queries.py"])
def test_no_method_of_the_adapter_branches_on_the_engine(module: str) -> None:
    tree = ast.parse((SQL / module).read_text())
    found = []
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        for method in cls.body:
            if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(method):
                named = (
                    node.attr
                    if isinstance(node, ast.Attribute)
                    else node.id
                    if isinstance(node, ast.Name)
                    else node.value
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    else None
                )
                if named in ENGINE_ATTRIBUTES or named in ENGINE_NAMES:
                    found.append(f"{cls.name}.{method.name}: {named}")
    assert not found, found


def _errors() -> StoreErrors:
    return StoreErrors.for_sqlite("sqlite:///x")


def test_a_driver_error_comes_out_as_a_storage_error_caused_by_it() -> None:
    cause = sqlite3.OperationalError("database is locked")
    with (
        pytest.raises(StorageError, match="settle failed on sqlite:///x") as raised,
        _errors().translate("settle"),
    ):
        raise cause
    assert type(raised.value) is StorageError
    assert raised.value.__cause__ is cause


def test_a_value_the_driver_refuses_is_rejected_for_good() -> None:
    with pytest.raises(StorageRejectedError), _errors().translate("enqueue"):
        raise sqlite3.IntegrityError("NOT NULL constraint failed")


def test_the_epoch_fence_deposes_and_says_so() -> None:
    class Fenced(Exception):
        sqlstate = FENCED_SQLSTATE

    errors = StoreErrors("pg", (Fenced,), ())
    fenced: list[str] = []
    errors.on_fenced = fenced.append
    with pytest.raises(DeposedError), errors.translate("mark_handed_off"):
        raise Fenced("deposed")
    assert fenced == ["mark_handed_off"]


def test_what_is_no_store_error_passes_the_door_unchanged() -> None:
    with pytest.raises(KeyError), _errors().translate("settle"):
        raise KeyError("a bug, not the store")


NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _job(spec: JobSpec, status: JobStatus = JobStatus.QUEUED) -> Job:
    return replace(Job.from_spec(spec, NOW), status=status)


def test_the_blocking_order_is_key_then_id_then_active_unique_key() -> None:
    spec = JobSpec("t", idempotency_key="k", unique_key="u")
    by_key, by_id, by_unique = _job(JobSpec("t")), _job(JobSpec("t")), _job(JobSpec("t"))

    def holder(key: bool, same_id: bool, unique: bool) -> Job | None:
        return settlement.blocking_holder(
            spec,
            lambda k: by_key if key and k == "k" else None,
            lambda i: by_id if same_id and i == spec.id else None,
            lambda u: by_unique if unique and u == "u" else None,
        )

    assert holder(True, True, True) is by_key
    assert holder(False, True, True) is by_id
    assert holder(False, False, True) is by_unique
    assert holder(False, False, False) is None


def test_the_sql_store_matches_holders_in_the_same_order() -> None:
    """Of the jobs a lookup found, each spec gets its blocker by the settlement order; a
    finished job holding the unique key blocks nothing."""
    keyed = JobSpec("t", idempotency_key="k", unique_key="u")
    same_id = JobSpec("t", id=uuid.uuid4(), unique_key="u")
    unique = JobSpec("t", unique_key="u")
    done = JobSpec("t", unique_key="v")
    key_holder = _job(JobSpec("t", idempotency_key="k"))
    id_holder = _job(JobSpec("t", id=same_id.id))
    unique_holder = _job(JobSpec("t", unique_key="u"), JobStatus.HANDED_OFF)
    finished = _job(JobSpec("t", unique_key="v"), JobStatus.COMPLETED)
    found = [finished, unique_holder, id_holder, key_holder]
    assert match_holders([keyed, same_id, unique, done], found) == [
        key_holder,
        id_holder,
        unique_holder,
        None,
    ]
