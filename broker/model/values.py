"""Which values may enter the broker: names, delays, times and free texts.

Every value a peer sends may end up in the job store, in a log line and on an
operator's terminal, so each is checked where it arrives (the protocol decoder, a
:class:`~broker.jobs.JobSpec`, a task raising ``Reschedule``) instead of failing later
inside a store write, where one bad value would stop every report batched with it:

* **Names and ids** (task and queue names, worker ids and hosts, idempotency, unique
  and concurrency keys, request ids, cursors) are refused when they hold a control
  character (C0, DEL, C1, the Unicode line and paragraph separators) or a lone
  surrogate. PostgreSQL cannot store NUL, no store can encode a lone surrogate, and a
  newline or an ANSI escape in a name forges log lines and reaches an operator's
  terminal. Each is also at most :data:`~broker.model.bounds.MAX_NAME_BYTES` (1024) long
  in UTF-8: indexed ones must fit a B-tree entry, and every name ends up in log lines,
  metric labels, dashboard cells and every job row.
* **Delays** are finite and from 0 to :data:`MAX_DELAY_SECONDS` (ten years); **run
  times** lie between :data:`EARLIEST_RUN_AT` and :data:`LATEST_RUN_AT`, so adding a
  delay or a retry backoff to them can never leave what ``datetime`` and the stores'
  microsecond columns hold.
* **Free texts** (a job's error) are never refused, because an exception message is
  whatever the task raised: :func:`storable_text` escapes what a store cannot hold and
  caps the length.

The checks raise ``ValueError`` naming the field; the protocol decoder turns that into
a ``DecodeError`` and a job spec into an ``InvalidJobError``.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime

from broker.model.bounds import MAX_DELAY_SECONDS, MAX_NAME_BYTES, MAX_TEXT_CHARS
from broker.model.untrusted import CONTROL_CHARACTERS

EARLIEST_RUN_AT = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_RUN_AT = datetime(9000, 1, 1, tzinfo=UTC)
"""A job's ``run_at`` lies in [EARLIEST_RUN_AT, LATEST_RUN_AT): far inside ``datetime``'s
range (years 1-9999) even after a time-zone offset or a ten-year delay is applied."""

_FORBIDDEN = re.compile(f"[{CONTROL_CHARACTERS}\\ud800-\\udfff]")
"""Control characters, and lone surrogates (which no store can encode)."""


def check_name(field: str, value: object, max_bytes: int = MAX_NAME_BYTES) -> None:
    """Refuse a name or id that is not a string, is longer than ``max_bytes`` (UTF-8), or
    holds a control character or a lone surrogate; the message shows the offending
    character escaped, never raw.

    The length goes first and costs nothing for a long value: a character is one to four
    bytes, so only a name between ``max_bytes / 4`` and ``max_bytes`` characters is
    encoded to be measured, and a 40 MiB name is refused without a scan."""
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string")
    if len(value) > max_bytes or (
        len(value) * 4 > max_bytes and len(value.encode("utf-8", "surrogatepass")) > max_bytes
    ):
        raise ValueError(
            f"{field} must be at most {max_bytes} bytes (UTF-8), got a string of "
            f"{len(value)} characters"
        )
    if value.isascii() and value.isprintable():
        # The usual name, checked in C: printable ASCII holds no control character (nor a
        # surrogate). Every enqueued job has several names.
        return
    bad = _FORBIDDEN.search(value)
    if bad is not None:
        raise ValueError(
            f"{field} must not contain control characters or lone surrogates "
            f"(found {bad.group()!r} at position {bad.start()})"
        )


def check_delay(field: str, value: object) -> None:
    """Refuse a delay that is not a number of seconds from 0 to :data:`MAX_DELAY_SECONDS`."""
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0 <= value <= MAX_DELAY_SECONDS
    ):
        raise ValueError(
            f"{field} must be a number of seconds from 0 to {MAX_DELAY_SECONDS} (ten years), "
            f"got {value!r}"[:200]
        )


def check_run_at(field: str, value: datetime) -> None:
    """Refuse a time outside [:data:`EARLIEST_RUN_AT`, :data:`LATEST_RUN_AT`)."""
    if not EARLIEST_RUN_AT <= value < LATEST_RUN_AT:
        raise ValueError(
            f"{field} must lie between {EARLIEST_RUN_AT.date()} and {LATEST_RUN_AT.date()} "
            f"UTC (got {value.isoformat()})"
        )


def storable_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` as every store can hold it: NUL written as ``\\x00``, a lone surrogate as
    its ``\\udXXX`` escape, and at most ``limit`` characters plus a note of what was cut.

    The one place error texts are made storable (see :class:`~broker.jobs.Settlement`),
    so no store ever receives a text it would refuse.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > limit:
        text = f"{text[:limit]} [... {len(text) - limit} more characters cut]"
    return text
