"""``--log-format``: JSON lines that parse one by one with the ids, the error and the
traceback as fields; text lines that stay one per event, the traceback indented."""

from __future__ import annotations

import io
import json
import logging
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from broker.core.job_log import log_job
from broker.jobs import JobStatus
from broker.model import logs


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    level = root.level
    out = io.StringIO()
    yield out
    for handler in [h for h in root.handlers if getattr(h, "_broker_handler", False)]:
        root.removeHandler(handler)
    root.setLevel(level)


def _boom(logger: logging.Logger) -> None:
    try:
        raise ValueError("bad value\nsecond line of the message")
    except ValueError as exc:
        logs.log_event(
            logger, logging.ERROR, "runner failed", exc_info=exc, job_id="j-1", handoff_id="h-1"
        )


class _Job:
    task = "app.send"
    queue = "mail"
    attempt = 2


def test_json_lines_parse_one_by_one_with_their_fields(stream: io.StringIO) -> None:
    logs.configure("INFO", "json", stream=stream)
    logs.bind(worker_id="w-7")
    logger = logging.getLogger("broker.test")
    log_job(logger, logging.WARNING, "job failed", ("j-2", "h-2"), _Job(), error="x\ny", retry=True)  # type: ignore[arg-type]
    _boom(logger)
    logs.log_event(logger, logging.INFO, "request failed", session=3, type="enqueue")

    lines = stream.getvalue().splitlines()
    assert len(lines) == 3, "one line per record, tracebacks included"
    first, second, third = (json.loads(line) for line in lines)

    assert first["event"] == "job failed" and first["level"] == "WARNING"
    assert first["job_id"] == "j-2" and first["lease"] == "h-2" and first["worker_id"] == "w-7"
    assert (first["task"], first["queue"], first["attempt"]) == ("app.send", "mail", 2)
    assert first["error"] == "x\ny" and first["retry"] is True
    assert first["time"].endswith("+00:00")

    assert second["event"] == "runner failed" and second["level"] == "ERROR"
    assert second["job_id"] == "j-1" and second["lease"] == "h-1"
    assert second["error"] == "ValueError: bad value\nsecond line of the message"
    assert second["traceback"].startswith("Traceback (most recent call last):")
    assert second["traceback"].endswith("second line of the message")

    assert third["event"] == "request failed"
    assert third["session"] == 3 and third["type"] == "enqueue", "a number stays a number"


def test_values_keep_their_type_in_json(stream: io.StringIO) -> None:
    logs.configure("INFO", "json", stream=stream)
    job = uuid.UUID(int=7)
    logs.log_event(
        logging.getLogger("broker.test"),
        logging.INFO,
        "retention on",
        port=18540,
        worker_id=None,
        completed_ttl=timedelta(days=7),
        interval=timedelta(seconds=0.5),
        job_id=job,
        tick=datetime(2030, 1, 1, 6, tzinfo=UTC),
        status=JobStatus.QUEUED,
        share=0.25,
        ok=False,
    )
    [line] = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert line["port"] == 18540 and line["worker_id"] is None
    assert line["completed_ttl"] == 604800.0, "a duration is seconds, not its str cut short"
    assert line["interval"] == 0.5
    assert line["job_id"] == str(job) and line["tick"] == "2030-01-01T06:00:00+00:00"
    assert line["status"] == "queued" and line["share"] == 0.25 and line["ok"] is False


def test_peer_text_stays_inside_its_own_field(stream: io.StringIO) -> None:
    """A task name full of ``key=value`` words (legal: spaces and ``=``) is one field's
    value; the record's level, time, logger and the worker's id are its own."""
    logs.configure("DEBUG", "json", stream=stream)
    logs.bind(worker_id="w-7")
    forged = "x level=DEBUG time=0 logger=x worker_id=y event=e message=m lease=l"
    logger = logging.getLogger("broker.worker")
    log_job(logger, logging.WARNING, "job failed", ("j-3", "h-3"), None, task=forged)  # type: ignore[arg-type]
    [line] = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert line["level"] == "WARNING" and line["logger"] == "broker.worker"
    assert line["time"].startswith("20") and line["worker_id"] == "w-7"
    assert line["event"] == "job failed" and line["lease"] == "h-3"
    assert line["task"] == forged
    assert line["message"] == f"job failed job_id=j-3 handoff_id=h-3 task={forged}"


def test_no_field_can_replace_the_records_own(stream: io.StringIO) -> None:
    logs.configure("INFO", "json", stream=stream, static={"worker_id": "w-1"})
    logger = logging.getLogger("broker.test")
    logs.log_event(
        logger,
        logging.WARNING,
        "something",
        level="DEBUG",
        time=0,
        logger="x",
        event="forged",
        message="forged",
        traceback="forged",
        worker_id="forged",
    )
    logger.warning("plain", extra={"level": "DEBUG", "time": 0, "logger": "x"})
    records = [json.loads(text) for text in stream.getvalue().splitlines()]
    for line in records:
        assert line["level"] == "WARNING" and line["logger"] == "broker.test", line
        assert line["time"] != 0 and line["worker_id"] == "w-1" and "traceback" not in line
    assert [r["event"] for r in records] == ["something", "plain"]
    assert records[0]["message"].startswith("something level=DEBUG")


def test_an_announced_line_keeps_its_own_fields(capsys: pytest.CaptureFixture[str]) -> None:
    logs.announce("json", "listening", "broker-main listening", time=0, logger="x", port=7390)
    line = json.loads(capsys.readouterr().err)
    assert line["logger"] == "broker.cli" and line["time"] != 0
    assert line["event"] == "listening" and line["port"] == 7390


def test_a_disabled_level_formats_nothing(stream: io.StringIO) -> None:
    class Loud:
        def __str__(self) -> str:
            raise AssertionError("formatted although the level is off")

    logs.configure("INFO", "json", stream=stream)
    logs.log_event(logging.getLogger("broker.test"), logging.DEBUG, "quiet", value=Loud())
    log_job(logging.getLogger("broker.test"), logging.DEBUG, "job completed", (Loud(), Loud()))  # type: ignore[arg-type]
    assert stream.getvalue() == ""


def test_text_lines_keep_one_line_per_event_with_the_traceback_indented(
    stream: io.StringIO,
) -> None:
    logs.configure("INFO", "text", stream=stream)
    logger = logging.getLogger("broker.test")
    _boom(logger)
    logs.log_event(logger, logging.WARNING, "task named", task="evil\n2030-01-01 INFO forged line")

    lines = stream.getvalue().splitlines()
    events = [line for line in lines if not line.startswith(" ")]
    assert len(events) == 2, lines
    assert events[0].endswith("ERROR broker.test runner failed job_id=j-1 handoff_id=h-1")
    assert events[0][:29].endswith("+00:00"), "the time carries its zone"
    body = lines[1 : lines.index(events[1])]
    assert body[0] == "    Traceback (most recent call last):"
    assert body[-1] == "    second line of the message", "every line of it is indented"
    assert events[1].endswith("task named task=evil\\n2030-01-01 INFO forged line")


def test_a_level_below_the_threshold_is_not_written(stream: io.StringIO) -> None:
    logs.configure("WARNING", "json", stream=stream)
    logging.getLogger("broker.test").info("quiet")
    assert stream.getvalue() == ""


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="text, json"):
        logs.configure("INFO", "xml")
