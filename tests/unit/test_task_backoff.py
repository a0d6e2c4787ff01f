"""A task's own backoff: the wait it computes is checked like any delay, in the worker
(:func:`broker.retry.backoff_seconds`) and again where the main decodes the report."""

from __future__ import annotations

import math
import uuid
from datetime import timedelta

import pytest

from broker.model.values import MAX_DELAY_SECONDS
from broker.retry import ExponentialBackoff, FixedBackoff, backoff_seconds
from broker.wire import codec
from broker.wire import messages as protocol


def test_a_backoff_may_return_seconds_or_a_timedelta() -> None:
    assert backoff_seconds(lambda n: 2.5 * n, 2) == 5.0
    assert backoff_seconds(lambda n: timedelta(minutes=n), 3) == 180.0
    assert backoff_seconds(FixedBackoff(7), 9) == 7.0
    assert 5.0 <= backoff_seconds(ExponentialBackoff(base=10), 1) <= 10.0


@pytest.mark.parametrize(
    ("backoff", "message"),
    [
        (lambda n: -1, "must be a number of seconds from 0"),
        (lambda n: math.inf, "must be a number of seconds from 0"),
        (lambda n: math.nan, "must be a number of seconds from 0"),
        (lambda n: MAX_DELAY_SECONDS + 1, "must be a number of seconds from 0"),
        (lambda n: timedelta(days=-1), "must be a number of seconds from 0"),
        (lambda n: "soon", "must return a timedelta or seconds"),
        (lambda n: True, "must return a timedelta or seconds"),
        (lambda n: 1 / 0, "raised ZeroDivisionError"),
    ],
)
def test_a_bad_wait_is_refused_with_a_reason(backoff: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        backoff_seconds(backoff, 1)  # type: ignore[arg-type]


def _failed(extra: str) -> bytes:
    ids = f'"job_id":"{uuid.uuid4()}","handoff_id":"{uuid.uuid4()}"'
    return f'{{"type":"failed",{ids},"error":"boom"{extra}}}\n'.encode()


def test_the_main_decodes_a_wait_in_range_and_refuses_one_outside() -> None:
    plain = codec.decode(_failed(""))
    assert isinstance(plain, protocol.FailedReport) and plain.retry_delay is None
    waited = codec.decode(_failed(f',"retry_delay":{MAX_DELAY_SECONDS}'))
    assert isinstance(waited, protocol.FailedReport)
    assert waited.retry_delay == MAX_DELAY_SECONDS
    for bad in ("-1", "1e300", '"60"', "true"):
        with pytest.raises(codec.DecodeError, match="retry_delay"):
            codec.decode(_failed(f',"retry_delay":{bad}'))
