"""How the three commands write their log: ``--log-format text`` or ``json``.

**text** is for a person at a terminal or ``journalctl``: one line per event,
``TIME LEVEL LOGGER MESSAGE`` with the time in UTC and its zone, and a traceback
indented under its line, so every line that starts at column 0 is an event and a
multi-line traceback can never pass for one (nor can a newline in a peer's text,
which is escaped).

**json** is for a log shipper: one JSON object per line, with ``time``, ``level``,
``logger``, ``event``, ``message`` and, when the record has them, ``job_id``,
``lease``, ``worker_id``, ``error`` and ``traceback`` as fields of their own, plus any
other structured extra. Many log calls write their details as ``key=value`` words in
the message (``request failed session=3 type=enqueue``); those words become fields
too (a structured extra of the same name wins), and the words before the first of
them are the ``event`` when the call named none. The lease is the protocol's
``handoff_id``.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
import time
import traceback
from datetime import UTC, datetime
from typing import Any, TextIO

from broker.untrusted import escape_control

FORMATS = ("text", "json")

_STANDARD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}
_KEY_VALUE = re.compile(r"(?:^|\s)([a-z_][a-z0-9_]*)=(\S*)")
_RENAMED = {"handoff_id": "lease"}
_INDENT = "    "


def _timestamp(record: logging.LogRecord) -> str:
    """``2026-11-30T07:45:07.249+00:00``: UTC, to the millisecond, with its zone."""
    return f"{_second(int(record.created))}.{int(record.msecs):03d}+00:00"


@functools.lru_cache(maxsize=4)
def _second(epoch: int) -> str:
    # Records come many to a second: the date and time are formatted once per second.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch))


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's ``key=value`` words, then its structured extras (which win)."""
    fields: dict[str, Any] = {}
    for key, value in _KEY_VALUE.findall(record.getMessage()):
        fields[_RENAMED.get(key, key)] = value
    for key, value in vars(record).items():
        if key not in _STANDARD_ATTRIBUTES and not key.startswith("_"):
            fields[_RENAMED.get(key, key)] = value
    return fields


def _event(record: logging.LogRecord) -> str:
    explicit = getattr(record, "event", None)
    if isinstance(explicit, str) and explicit:
        return explicit
    message = record.getMessage()
    first = _KEY_VALUE.search(message)
    return (message[: first.start()] if first else message).strip()


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring); ``static`` fields, such as
    a worker's id, go on every line."""

    def __init__(self, static: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "event": _event(record),
            "message": record.getMessage(),
            **self.static,
            **_fields(record),
        }
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            line.setdefault("error", f"{type(exc).__name__}: {exc}")
            line["traceback"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.stack_info:
            line["traceback"] = record.stack_info
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER MESSAGE`` with the traceback's lines indented below it.

    Task names, worker ids, errors and a child's output reach the message: its control
    characters are escaped, so a record is one line and an ANSI escape is shown, not
    obeyed. The traceback is escaped line by line and indented, so it stays readable
    and can never pass for a record of its own.
    """

    def format(self, record: logging.LogRecord) -> str:
        message = escape_control(record.getMessage())
        head = f"{_timestamp(record)} {record.levelname} {record.name} {message}"
        extra = ""
        if record.exc_info and record.exc_info[1] is not None:
            extra = "".join(traceback.format_exception(*record.exc_info))
        elif record.stack_info:
            extra = record.stack_info
        lines = [_INDENT + escape_control(line) for line in extra.rstrip().splitlines()]
        return "\n".join([head, *lines])


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record comes, not when it was made
    (a test harness, or a daemon manager, may swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure(
    level: str = "INFO",
    fmt: str = "text",
    *,
    stream: TextIO | None = None,
    static: dict[str, Any] | None = None,
) -> None:
    """Send the root logger's records to ``stream`` (stderr) in ``fmt``; replaces any
    handler an earlier call installed."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    handler: logging.Handler = logging.StreamHandler(stream) if stream is not None else _Stderr()
    handler.setFormatter(JsonFormatter(static) if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_broker_handler", False):
            root.removeHandler(old)
    setattr(handler, "_broker_handler", True)  # noqa: B010 - marks the handler as ours
    threshold = getattr(logging, level.upper(), logging.INFO)
    handler.setLevel(threshold)
    root.addHandler(handler)
    # Lowered only: a process that already logs more (a test's log capture) keeps it.
    if root.level == logging.NOTSET or root.level > threshold:
        root.setLevel(threshold)


def announce(fmt: str, event: str, text: str, *, level: str = "INFO", **fields: Any) -> None:
    """A line a command writes on stderr itself, whatever the log level (that it listens,
    which modes it serves, why it stopped): ``text`` as it is, or under ``json`` one
    object like a log record's, so that every line of a JSON log parses."""
    if fmt == "json":
        line = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "level": level,
            "logger": "broker.cli",
            "event": event,
            "message": text,
            **fields,
        }
        print(json.dumps(line, default=str, ensure_ascii=False), file=sys.stderr, flush=True)
    else:
        print(text, file=sys.stderr, flush=True)


def bind(**fields: Any) -> None:
    """Add ``fields`` (a worker's id, say) to every later JSON line of the broker's
    handler; a text line stays as its call wrote it."""
    for handler in logging.getLogger().handlers:
        formatter = handler.formatter
        if getattr(handler, "_broker_handler", False) and isinstance(formatter, JsonFormatter):
            formatter.static.update(fields)
