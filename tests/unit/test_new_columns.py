"""A bulk enqueue's rows by column (:func:`broker.jobs.new_jobs_columns`,
:func:`adapters.sql.rows.new_columns`) are the rows the row by row way writes
(:func:`broker.jobs.new_job_fields`, :func:`adapters.sql.rows.new_row`), job by job, and
the values a one-job insert binds (:func:`adapters.sql.rows.new_values`).

Hypothesis builds batches whose jobs share some values as the same object (one column
encoded once) and not others, with equal values of different types side by side (``1``,
``True`` and ``1.0`` in an argument list encode apart), and with every optional field
set or left out.
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.sql.enqueue import EnqueueRule
from adapters.sql.rows import (
    ARGS_IN_VALUES,
    INSERT_VALUES,
    KWARGS_IN_VALUES,
    NULL_ROW,
    new_columns,
    new_row,
    new_values,
)
from adapters.sql.schema import INSERT_COLUMNS
from broker.exceptions import InvalidJobError
from broker.jobs import (
    EnqueueResult,
    ExecutionMode,
    Job,
    JobSpec,
    JSONValue,
    SpecColumns,
    compact_json,
    new_job_fields,
    new_jobs_columns,
)
from broker.payload import args_size

NOW = datetime(2030, 1, 1, tzinfo=UTC)
LATER = NOW + timedelta(seconds=90)
SHARED_ARGS: list[tuple[JSONValue, ...]] = [(1,), (True,), (1.0,), ("x",), ()]
"""Argument tuples a batch's jobs share as the same objects: equal, some of them, but
encoded apart."""


@st.composite
def specs(draw: st.DrawFn) -> JobSpec:
    def maybe(strategy: st.SearchStrategy[Any]) -> Any:
        return draw(st.none() | strategy)

    keyed = draw(st.booleans())
    waits = draw(st.booleans())  # a job with parents has no unique key
    return JobSpec(
        task=draw(st.sampled_from(["t", "other.task"])),
        args=draw(st.sampled_from(SHARED_ARGS) | st.lists(st.integers() | st.booleans())),
        kwargs=draw(st.dictionaries(st.sampled_from("ab"), st.integers() | st.booleans())),
        queue=draw(st.sampled_from(["default", "q2"])),
        priority=draw(st.integers(-5, 5)),
        run_at=draw(st.sampled_from([None, LATER])),
        max_attempts=draw(st.integers(1, 3)),
        idempotency_key=maybe(st.sampled_from(["i1", "i2"])),
        concurrency_key="k" if keyed else None,
        concurrency_limit=draw(st.integers(1, 3)) if keyed else None,
        timeout=maybe(st.sampled_from([1.0, 2.5])),
        execution_mode=draw(st.sampled_from(list(ExecutionMode))),
        unique_key=None if waits else maybe(st.sampled_from(["u1", "u2"])),
        max_recoveries=maybe(st.integers(0, 2)),
        local_state=draw(st.booleans()),
        depends_on=(uuid.UUID(int=7),) if waits else (),
        trace_context=maybe(st.just({"traceparent": "00-1-2-01"})),
        rate_key=maybe(st.sampled_from(["r1", "r2"])),
    )


@given(st.lists(specs(), min_size=1, max_size=6))
def test_columns_hold_each_jobs_row(batch: list[JobSpec]) -> None:
    columns = new_columns(new_jobs_columns(batch, NOW), len(batch))
    assert all(len(values) == len(batch) for values in columns.values())
    for i, spec in enumerate(batch):
        by_column = {c: values[i] for c, values in columns.items() if values[i] is not None}
        assert by_column == new_row(new_job_fields(spec, NOW))


@given(
    specs(),
    st.lists(st.sampled_from(SHARED_ARGS) | st.lists(st.integers() | st.booleans()), min_size=1),
    st.booleans(),
)
def test_jobs_by_column_are_their_specs_new_jobs(
    template: JobSpec, args: list[Any], with_kwargs: bool
) -> None:
    """:class:`SpecColumns` (a template and argument sets) holds the fields, and so the
    rows, that its specs one by one make; a template with a key that names one job, or
    with parents, is refused."""
    if template.idempotency_key or template.unique_key or template.depends_on:
        with pytest.raises(InvalidJobError):
            SpecColumns.of(template, args)
        return
    kwargs = [{"n": i} for i in range(len(args))] if with_kwargs else None
    jobs = SpecColumns.of(template, args, kwargs)
    one_by_one = jobs.specs()
    assert [s.id for s in one_by_one] == jobs.ids and len(set(jobs.ids)) == len(args)
    assert jobs.fields(NOW) == new_jobs_columns(one_by_one, NOW)
    rule = EnqueueRule(lambda: 0, None, "here")
    assert rule.columns_to_write(jobs, NOW) == rule.columns_to_write(one_by_one, NOW)
    half = len(args) // 2
    assert jobs.chunk(0, half).specs() + jobs.chunk(half, len(args)).specs() == one_by_one


def test_argument_sets_are_checked_as_a_spec_checks_them() -> None:
    template = JobSpec("t")
    with pytest.raises(InvalidJobError, match="args must be a list"):
        SpecColumns.of(template, [[1], "ab"])
    with pytest.raises(InvalidJobError, match="kwargs must be an object"):
        SpecColumns.of(template, [[1]], [{1: 2}])  # type: ignore[dict-item]
    with pytest.raises(InvalidJobError, match="not JSON-serialisable"):
        SpecColumns.of(template, [[float("nan")]])
    with pytest.raises(InvalidJobError, match="2 keyword argument sets for 1"):
        SpecColumns.of(template, [[1]], [{}, {}])


def test_a_payload_over_the_threshold_leaves_the_batch_to_the_row_by_row_way() -> None:
    rule = EnqueueRule(lambda: 0, 10, "here")
    small = [JobSpec("t", args=[1]), JobSpec("t", kwargs={"k": "v"})]
    assert rule.columns_to_write(small, NOW) is not None
    assert rule.columns_to_write([*small, JobSpec("t", args=["x" * 20])], NOW) is None
    assert rule.columns_to_write([JobSpec("t", kwargs={"k": "x" * 20})], NOW) is None
    assert EnqueueRule(lambda: 0, None, "here").columns_to_write(small, NOW) is not None


def test_a_result_written_by_column_reads_as_the_job_its_fields_make() -> None:
    spec = JobSpec("t", args=[1], queue="q")
    result = EnqueueResult.inserted_new(spec, NOW)
    assert result.job_id == spec.id
    assert not result.duplicate
    assert result.field("queue") == "q"
    assert result.job == Job(**new_job_fields(spec, NOW))
    assert result.field("created_at") == NOW
    later = JobSpec("t", run_at=LATER, kwargs={"a": 1}, concurrency_key="c", concurrency_limit=1)
    job = Job(**new_job_fields(later, NOW))
    for field in dataclasses.fields(Job):  # each read first, before anything is built
        unread = EnqueueResult.inserted_new(later, NOW)
        assert unread.field(field.name) == getattr(job, field.name), field.name


@given(st.lists(specs(), min_size=1, max_size=4))
def test_one_jobs_values_are_its_row(batch: list[JobSpec]) -> None:
    """A one-job insert's values (:func:`adapters.sql.rows.new_values`, made from the
    spec in one pass) are the full row :func:`new_row` makes of the job's fields, and the
    job's row in the bulk columns of any batch it is in: one definition of a new job's
    row, three ways of writing it."""
    columns = new_columns(new_jobs_columns(batch, NOW), len(batch))
    for i, spec in enumerate(batch):
        values = new_values(spec, NOW)
        assert values == list(INSERT_VALUES({**NULL_ROW, **new_row(new_job_fields(spec, NOW))}))
        by_column = {c: v[i] for c, v in columns.items()}
        assert values == [by_column.get(c) for c in INSERT_COLUMNS]
        payload = values[ARGS_IN_VALUES], values[KWARGS_IN_VALUES]
        assert payload == (compact_json(list(spec.args)), compact_json(dict(spec.kwargs)))
        assert len(payload[0]) + len(payload[1]) == args_size(spec.args, spec.kwargs)
