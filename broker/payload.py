"""Payload limits: how big a job's arguments and a job's result may be.

Sizes are measured as the store keeps them: compact JSON with non-ASCII escaped
(``json.dumps(value, separators=(",", ":"))``), in bytes. A job's payload is its
``args`` plus its ``kwargs``; a result is measured on its own. Both are checked
before anything is written, so an oversized job is never half-stored: the main
refuses the whole enqueue batch, and an oversized result fails the job instead of
being written (see ``docs/howto/payload-limits.md``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from broker.exceptions import InvalidJobError, PayloadTooLargeError
from broker.jobs import JobSpec, JSONValue

DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20
"""1 MiB, for a job's args and kwargs together, and separately for its result."""

LINE_HEADROOM_BYTES = 64 << 10
"""How much longer than the payload limit a protocol line must be allowed to be, so a
job message (the payload plus ids, task and queue names) always fits in one line."""


def encoded_size(value: JSONValue) -> int:
    """Bytes of ``value`` as compact, ASCII-escaped JSON (the form every store writes)."""
    try:
        return len(json.dumps(value, separators=(",", ":"), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidJobError(f"value is not JSON-serialisable: {exc}") from exc


def args_size(args: Sequence[JSONValue], kwargs: Mapping[str, JSONValue]) -> int:
    """The payload of a job: its positional plus its keyword arguments, as JSON."""
    return encoded_size(list(args)) + encoded_size(dict(kwargs))


def check_args(spec: JobSpec, limit: int | None) -> int:
    """The payload size of ``spec``; raises :class:`PayloadTooLargeError` over ``limit``.

    ``None`` disables the check (the size is then not computed and 0 is returned).
    """
    if limit is None:
        return 0
    size = args_size(spec.args, spec.kwargs)
    if size > limit:
        raise PayloadTooLargeError(
            f"job {spec.id} of task {spec.task[:100]!r}: args and kwargs are {size} bytes as JSON, "
            f"over the payload limit of {limit} bytes; pass a reference (a row id, an object "
            "store key) instead of the data"
        )
    return size


def check_all(specs: Sequence[JobSpec], limit: int | None) -> None:
    """Check every spec before any is stored, so a batch goes in whole or not at all."""
    for spec in specs:
        check_args(spec, limit)


def result_too_large(result: JSONValue, limit: int | None) -> str | None:
    """Why ``result`` may not be stored (it is over ``limit``), or ``None`` if it may."""
    if limit is None or result is None:
        return None
    try:
        size = encoded_size(result)
    except InvalidJobError:
        return None  # not JSON at all: the store's own check reports that
    if size <= limit:
        return None
    return (
        f"the job's result is {size} bytes as JSON, over the payload limit of {limit} bytes; "
        "the result was not stored (store large outputs elsewhere and return a reference)"
    )


__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "LINE_HEADROOM_BYTES",
    "args_size",
    "check_all",
    "check_args",
    "encoded_size",
    "result_too_large",
]
