"""``broker top``'s frame: rates from two status snapshots, and what one frame shows."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from broker.ops.admin import format_top, queue_rates


def _status(done: int, failed: int, *, queued: int = 0, workers: Any = None) -> dict[str, Any]:
    counts = {
        "queued": queued,
        "handed_off": 1,
        "completed": done,
        "failed": failed,
        "cancelled": 0,
    }
    return {
        "source": "main",
        "main_id": "main-1",
        "dispatched": 7,
        "queues": [{"queue": "mail", "counts": counts, "oldest_queued_age_seconds": 42.5}],
        "workers": workers,
    }


def test_rates_are_count_differences_per_second() -> None:
    rates = queue_rates(_status(10, 1), _status(30, 2), 4.0)
    assert rates == {"mail": {"completed": 5.0, "failed": 0.25}}


def test_a_count_that_falls_is_no_progress_and_the_first_frame_has_no_rate() -> None:
    assert queue_rates(_status(100, 5), _status(10, 5), 2.0) == {
        "mail": {"completed": 0.0, "failed": 0.0}
    }
    assert queue_rates(None, _status(1, 0), 2.0) == {}


def test_a_frame_shows_queues_rates_and_workers() -> None:
    worker = {
        "worker_id": "host-1",
        "modes": ["inline", "pooled"],
        "in_flight": 1,
        "credits": {"inline": 4, "pooled": 3},
        "draining": False,
        "startup_errors": {},
    }
    frame = format_top(
        _status(30, 2, queued=3, workers=[worker]),
        {"mail": {"completed": 5.0, "failed": 0.25}},
        datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        2.0,
    )
    lines = frame.splitlines()
    assert lines[0].startswith("broker top  2026-01-02 03:04:05 UTC  every 2s  main main-1 up")
    assert lines[2].split() == [
        "QUEUE",
        "QUEUED",
        "RUNNING",
        "OLDEST",
        "QUEUED",
        "DONE/S",
        "FAILED/S",
        "DEAD",
    ]
    assert lines[3].split() == ["mail", "3", "1", "42.5s", "5.0", "0.2", "2"]
    assert lines[6].split() == ["host-1", "inline,pooled", "1", "inline=4", "pooled=3", "no", "-"]
    assert "\x1b" not in frame
