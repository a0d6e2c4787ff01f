"""How the three commands write their log: ``--log-format text`` or ``json``.

**text** is for a person at a terminal or ``journalctl``: one line per event,
``TIME LEVEL LOGGER MESSAGE key=value ...`` with the time in UTC and its zone, and a traceback
indented under its line, so every line that starts at column 0 is an event and a
multi-line traceback can never pass for one (nor can a newline in a peer's text,
which is escaped).

**json** is for a log shipper: one JSON object per line, with ``time``, ``level``,
``logger``, ``event`` and ``message``, then the record's fields as values of their own
type (a port is a number, a missing worker id is ``null``, a duration is seconds), an
``error`` and a ``traceback`` when the record carries an exception, and ``trace_id`` and
``span_id`` when it was logged inside an OpenTelemetry span (:mod:`broker.model.tracing`).

The fields travel beside the message, never inside it: :func:`log_event` logs a
message with its fields, which the text format shows as ``message key=value ...`` and
the JSON format takes from the record as they are. Nothing is read back out of a
message, so a peer's text (a task name, an error) stays inside its own field whatever
words it holds, and no field, of any name, can replace the record's own time, level,
logger, event or message, nor a field every line carries (a worker's id). The lease is
the protocol's ``handoff_id``, written ``lease`` in JSON.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
import traceback
from collections.abc import Mapping
from datetime import UTC, date, datetime, timedelta
from enum import Enum
from typing import Any, TextIO

from broker.model.tracing import current_ids
from broker.model.untrusted import escape_control

FORMATS = ("text", "json")

OWN_FIELDS = frozenset(
    {"time", "level", "logger", "event", "message", "traceback", "trace_id", "span_id"}
)
"""What a JSON line says of its record itself: no field may take these names."""

_FIELDS = "broker_fields"
"""The record attribute that holds the fields of :func:`log_event` (one attribute, so no
field name can ever clash with a ``LogRecord`` attribute such as ``levelname`` or
``msg``)."""

_STANDARD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
    "event",
    _FIELDS,
}
_RENAMED = {"handoff_id": "lease"}
_INDENT = "    "


def log_event(
    logger: logging.Logger,
    level: int,
    message: str,
    /,
    *,
    exc_info: BaseException | None = None,
    **fields: Any,
) -> None:
    """Log ``message`` (a text of the code's, never a peer's) with ``fields``.

    The text line reads ``message key=value ...`` (a value as ``str`` shows it, its
    control characters escaped); a JSON line has each field as a value of its own. A
    disabled level costs one check: nothing is formatted before the handler writes. A
    field named as one of the record's own (:data:`OWN_FIELDS`) is left out of the JSON
    line rather than raise from a log call.
    """
    if not logger.isEnabledFor(level):
        return
    template = message
    if fields:
        template = message.replace("%", "%%") + "".join(f" {name}=%s" for name in fields)
    logger.log(
        level,
        template,
        *fields.values(),
        exc_info=exc_info,
        stacklevel=2,
        extra={"event": message, _FIELDS: fields},
    )


def _timestamp(record: logging.LogRecord) -> str:
    """``2026-11-30T07:45:07.249+00:00``: UTC, to the millisecond, with its zone."""
    return f"{_second(int(record.created))}.{int(record.msecs):03d}+00:00"


@functools.lru_cache(maxsize=4)
def _second(epoch: int) -> str:
    # Records come many to a second: the date and time are formatted once per second.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch))


def _json_value(value: object) -> object:
    """A field value JSON has no type for, as the nearest one: a duration in seconds (a
    ``timedelta``'s ``str`` would read ``7 days, 0:00:00``), a time in ISO 8601, an
    enum's value, an exception as ``Type: message``, anything else as its ``str``."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    return str(value)


def _event_name(record: logging.LogRecord) -> str:
    """The record's event: the one it was logged with, else its message's template
    (the code's text, before a peer's values are put in)."""
    explicit = getattr(record, "event", None)
    if isinstance(explicit, str) and explicit:
        return explicit
    return record.msg if isinstance(record.msg, str) else str(record.msg)


def _dumps(line: Mapping[str, Any]) -> str:
    return json.dumps(line, default=_json_value, ensure_ascii=False)


def _merge(line: dict[str, Any], fields: Mapping[str, Any], protected: frozenset[str]) -> None:
    for key, value in fields.items():
        key = _RENAMED.get(key, key)
        if key not in protected:
            line[key] = value


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring); ``static`` fields, such as
    a worker's id, go on every line and no record's field can replace them."""

    def __init__(self, static: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.static: dict[str, Any] = {}
        self._protected = OWN_FIELDS
        self.bind(static or {})

    def bind(self, fields: Mapping[str, Any]) -> None:
        self.static.update(fields)
        self._protected = OWN_FIELDS | frozenset(self.static)

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "event": _event_name(record),
            "message": record.getMessage(),
            **self.static,
        }
        span = current_ids()  # the handler runs in the logging call's context
        if span is not None:
            line["trace_id"], line["span_id"] = span
        # A plain ``extra=`` of a call that does not use :func:`log_event` is a field too.
        extras = {
            key: value
            for key, value in vars(record).items()
            if key not in _STANDARD_ATTRIBUTES and not key.startswith("_")
        }
        _merge(line, extras, self._protected)
        _merge(line, getattr(record, _FIELDS, None) or {}, self._protected)
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            line.setdefault("error", f"{type(exc).__name__}: {exc}")
            line["traceback"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.stack_info:
            line["traceback"] = record.stack_info
        return _dumps(line)


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


def announce(
    fmt: str,
    event: str,
    text: str,
    *,
    level: str = "INFO",
    trace: str | None = None,
    **fields: Any,
) -> None:
    """A line a command writes on stderr itself, whatever the log level (that it listens,
    which modes it serves, why it stopped): ``text`` as it is, or under ``json`` one
    object like a log record's, so that every line of a JSON log parses. ``trace`` (a
    traceback ``text`` already shows) is the JSON line's ``traceback``, as a record's is."""
    if fmt == "json":
        line: dict[str, Any] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "level": level,
            "logger": "broker.cli",
            "event": event,
            "message": text,
        }
        if trace is not None:
            line["traceback"] = trace
        _merge(line, fields, OWN_FIELDS)
        print(_dumps(line), file=sys.stderr, flush=True)
    else:
        print(text, file=sys.stderr, flush=True)


def bind(**fields: Any) -> None:
    """Add ``fields`` (a worker's id, say) to every later JSON line of the broker's
    handler; a text line stays as its call wrote it."""
    for handler in logging.getLogger().handlers:
        formatter = handler.formatter
        if getattr(handler, "_broker_handler", False) and isinstance(formatter, JsonFormatter):
            formatter.bind(fields)
