"""Rich argument and result types through real worker processes, in each execution mode:
a typed enqueue writes the JSON form, the task receives real ``datetime``, ``UUID``,
dataclass... objects (by its annotations), its result is stored as JSON and read back
typed by a caller holding the task; a caller by name sees the JSON form, and an argument
that does not fit its annotation fails the job once, naming the parameter."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from broker.jobs import ExecutionMode
from tests.argtypes_app import Color, Price, Report, Window, report
from tests.e2e.test_e2e import Cluster, sqlite_url

WHEN = datetime(2026, 3, 1, 8, 0, 0, 5, tzinfo=timezone(timedelta(hours=-5)))
DAY = date(2026, 2, 28)
IDENT = uuid.UUID("6f1d3c3e-6c3b-4c4e-9d63-2b2a4e1b9c10")
WINDOW = Window(datetime(2026, 3, 1, tzinfo=UTC), [date(2026, 3, 2), date(2026, 3, 3)])
PRICE = Price(Decimal("19.90"), "EUR")


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(ExecutionMode))
async def test_argument_and_result_types_round_trip_through_a_real_worker(
    tmp_path: Path, mode: ExecutionMode
) -> None:
    cluster = Cluster(tmp_path, sqlite_url(tmp_path))
    try:
        await cluster.start_main()
        argv = ["worker", "--main", f"127.0.0.1:{cluster.port}", "--app", "tests.argtypes_app"]
        argv += ["--worker-id", f"w-{mode}", "--inline-concurrency", "2"]
        argv += ["--pooled-runner-count", "1", "--forked-concurrency", "1"]
        worker = await cluster.spawn("worker", *argv)
        await worker.wait_for_output("connected to main")
        async with cluster.client() as client:
            call = report.options(client=client, mode=mode)
            typed = await call.enqueue(
                WHEN, DAY, IDENT, Decimal("1.10"), b"\x00\x01\xff", Color.BLUE, WINDOW, price=PRICE
            )
            bad = await call.enqueue(
                WHEN, DAY, IDENT, Decimal("1"), b"", Color.RED, WINDOW, price=PRICE
            )
            # The same job by name, as a peer without the task writes it: JSON forms.
            forms = [
                "2026-03-01T13:00:00.000005Z",
                "2026-02-28",
                str(IDENT),
                "1.10",
                "AAH/",
                "blue",
                {"start": "2026-03-01T00:00:00Z", "days": ["2026-03-02", "2026-03-03"]},
            ]
            by_name = await client.enqueue(
                "argtypes.report",
                forms,
                {"price": {"amount": "19.90", "currency": "EUR"}},
                execution_mode=mode,
            )
            wrong = await client.enqueue(
                "argtypes.report",
                ["not a time", *forms[1:]],
                {"price": {"amount": "19.90", "currency": "EUR"}},
                execution_mode=mode,
                max_attempts=3,
            )
            done: dict[str, dict[str, Any]] = {}
            for name, made in [("typed", typed), ("bad", bad), ("by_name", by_name)]:
                done[name] = await client.wait(made.job_id, timeout=30)
            failed = await client.wait(wrong.job_id, timeout=30)
        expected = Report(
            seen=["datetime", "date", "UUID", "Decimal", "bytes", "Color", "Window", "Price"],
            later=WHEN + timedelta(hours=1),
            next_day=date(2026, 3, 1),
            ident=IDENT,
            doubled=Decimal("2.20"),
            reversed_blob=b"\xff\x01\x00",
            color=Color.BLUE,
            window=WINDOW,
            price=PRICE,
        )
        assert done["typed"]["status"] == "completed", done["typed"]
        result = report.decode_result(done["typed"]["result"])
        assert result == expected, "typed for a caller holding the task"
        assert result.later.utcoffset() == timedelta(hours=-5), "aware, its offset kept"
        assert done["by_name"]["status"] == "completed", done["by_name"]
        plain = done["by_name"]["result"]
        assert plain["later"] == "2026-03-01T14:00:00.000005Z", "by name: the JSON form"
        assert plain["doubled"] == "2.20" and plain["reversed_blob"] == "/wEA"
        assert report.decode_result(plain) == expected
        assert done["bad"]["status"] == "completed"
        assert failed["status"] == "failed", failed
        assert failed["attempts"] == 1, "not retried: the same value fails every run"
        assert "argument 'when' of task 'argtypes.report'" in str(failed["last_error"])
        assert worker.process.returncode is None
    finally:
        await cluster.close()
