"""``--log-format``: JSON lines that parse one by one with the ids, the error and the
traceback as fields; text lines that stay one per event, the traceback indented."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from broker import logs
from broker.worker_state import log_job


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
    except ValueError:
        logger.exception("runner failed job_id=%s handoff_id=%s", "j-1", "h-1")


def test_json_lines_parse_one_by_one_with_their_fields(stream: io.StringIO) -> None:
    logs.configure("INFO", "json", stream=stream)
    logs.bind(worker_id="w-7")
    logger = logging.getLogger("broker.test")
    log_job(logger, logging.WARNING, "job failed", ("j-2", "h-2"), error="x\ny", retry=True)  # type: ignore[arg-type]
    _boom(logger)
    logger.info("request failed session=%d type=%s", 3, "enqueue")

    lines = stream.getvalue().splitlines()
    assert len(lines) == 3, "one line per record, tracebacks included"
    first, second, third = (json.loads(line) for line in lines)

    assert first["event"] == "job failed" and first["level"] == "WARNING"
    assert first["job_id"] == "j-2" and first["lease"] == "h-2" and first["worker_id"] == "w-7"
    assert first["error"] == "x\ny" and first["retry"] is True
    assert first["time"].endswith("+00:00")

    assert second["event"] == "runner failed" and second["level"] == "ERROR"
    assert second["job_id"] == "j-1" and second["lease"] == "h-1"
    assert second["error"] == "ValueError: bad value\nsecond line of the message"
    assert second["traceback"].startswith("Traceback (most recent call last):")
    assert second["traceback"].endswith("second line of the message")

    assert third["event"] == "request failed"
    assert third["session"] == "3" and third["type"] == "enqueue"


def test_text_lines_keep_one_line_per_event_with_the_traceback_indented(
    stream: io.StringIO,
) -> None:
    logs.configure("INFO", "text", stream=stream)
    logger = logging.getLogger("broker.test")
    _boom(logger)
    logger.warning("task named %s", "evil\n2030-01-01 INFO forged line")

    lines = stream.getvalue().splitlines()
    events = [line for line in lines if not line.startswith(" ")]
    assert len(events) == 2, lines
    assert events[0].endswith("ERROR broker.test runner failed job_id=j-1 handoff_id=h-1")
    assert events[0][:29].endswith("+00:00"), "the time carries its zone"
    body = lines[1 : lines.index(events[1])]
    assert body[0] == "    Traceback (most recent call last):"
    assert body[-1] == "    second line of the message", "every line of it is indented"
    assert events[1].endswith("task named evil\\n2030-01-01 INFO forged line")


def test_a_level_below_the_threshold_is_not_written(stream: io.StringIO) -> None:
    logs.configure("WARNING", "json", stream=stream)
    logging.getLogger("broker.test").info("quiet")
    assert stream.getvalue() == ""


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="text, json"):
        logs.configure("INFO", "xml")
