"""Payload limits: how big and how deeply nested a job's arguments and result may be.

Sizes are measured as the store keeps them: compact JSON with non-ASCII escaped
(``json.dumps(value, separators=(",", ":"))``), in bytes. A job's payload is its
``args`` plus its ``kwargs``; a result is measured on its own. Both are checked
before anything is written, so an oversized job is never half-stored: the main
refuses the whole enqueue batch, and an oversized result fails the job instead of
being written (see ``docs/howto/payload-limits.md``).

Depth is limited as well, and checked first: Python's ``json`` recurses once per level
of nesting, so a value nested about a thousand levels deep raises ``RecursionError``
in whichever process encodes or decodes it next (the worker, a child, the main, the
store). :func:`nesting_depth` measures without recursion, so any value can be judged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

from broker.exceptions import InvalidJobError, PayloadTooLargeError
from broker.jobs import JobSpec, JSONValue, compact_json

DEFAULT_MAX_PAYLOAD_BYTES = 16 << 20
"""16 MiB, for a job's args and kwargs together, and separately for its result. Values over
:data:`DEFAULT_OFFLOAD_BYTES` live apart from the job's row, so a large one no longer
weighs on every claim and settle; it still crosses the wire and a child pipe whole."""

MAX_PAYLOAD_BYTES_CEILING = 32 << 20
"""The largest payload limit any setting may allow: a job at the limit, plus its message,
must fit in a worker's line bound (:data:`MAX_LINE_BYTES_CEILING`) and in the 64 MiB
line buffers of the pipes to and from a child, with room to spare."""

MAX_LINE_BYTES_CEILING = MAX_PAYLOAD_BYTES_CEILING + (1 << 20)
"""The longest line a worker accepts from a main, whatever its welcome says (a memory
bound): a job at the highest payload limit a main may set, and its message. A main's
checkpoint limit in force keeps a job message within it."""

DEFAULT_OFFLOAD_BYTES = 64 << 10
"""64 KiB: a value (args, kwargs, result, checkpoint) larger than this as stored JSON is kept apart
from its job's row, in the store's payload table (see ``docs/howto/payload-limits.md``)."""

DEFAULT_MAX_CHECKPOINT_BYTES = 4 << 20
"""4 MiB. A checkpoint over :data:`DEFAULT_OFFLOAD_BYTES` lives apart from its job's row
like a large argument, so its size no longer weighs on every claim and settle. It is
still a position and a little state, not the data itself: every save crosses the wire
(twice from a child) and is written to the store whole, and every job message carries
the last one beside the job's arguments, so the default line limit grows with it."""

DEFAULT_MAX_PAYLOAD_DEPTH = 64
"""How many lists and objects deep each argument, keyword argument and result may nest."""

MAX_PAYLOAD_DEPTH_CEILING = 500
"""The deepest any setting may allow. Python's recursion limit (1,000 frames) bounds what
``json`` can encode or decode, and a message adds a few levels around its payload and
is handled a few dozen frames down: 500 keeps clear of that in every process."""

LINE_HEADROOM_BYTES = 64 << 10
"""How much longer than the payload limit a protocol line must be allowed to be, so a
job message (the payload plus ids, task and queue names) always fits in one line."""


_CONTAINERS = (list, tuple, dict)
"""What ``json`` encodes as an array or an object."""

_Container: TypeAlias = list[Any] | tuple[Any, ...] | dict[Any, Any]


def nesting_depth(value: object, limit: int) -> int:
    """How many lists and objects deep ``value`` nests (a scalar is 0, ``[]`` is 1).

    Iterative, so no depth can exhaust the stack, and it stops as soon as it is past
    ``limit`` (returning ``limit + 1``), so a value a million levels deep costs no more
    than one just over the limit. A value that contains itself is, in effect, infinitely
    deep and is reported over the limit too.
    """
    deepest = 0
    stack: list[tuple[_Container, int]] = [(value, 1)] if isinstance(value, _CONTAINERS) else []
    while stack:
        item, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, _CONTAINERS))
    return deepest


def _plain_text(text: str) -> bool:
    """Whether JSON writes ``text`` as it is, between its quotes."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def encoded_size(value: JSONValue) -> int:
    """Bytes of ``value`` as compact, ASCII-escaped JSON (the form every store writes)."""
    if type(value) is str and _plain_text(value):
        return len(value) + 2  # a name, usually: no character needs escaping
    if type(value) in (list, dict) and not value:
        return 2
    try:
        return len(compact_json(value))
    except (TypeError, ValueError) as exc:
        raise InvalidJobError(f"value is not JSON-serialisable: {exc}") from exc
    except RecursionError:
        raise InvalidJobError("value nests too deeply to be encoded as JSON") from None


def args_size(args: Sequence[JSONValue], kwargs: Mapping[str, JSONValue]) -> int:
    """The payload of a job: its positional plus its keyword arguments, as JSON."""
    return encoded_size(list(args)) + encoded_size(dict(kwargs))


def check_depth(spec: JobSpec, max_depth: int) -> None:
    """Raise :class:`InvalidJobError` if an argument or keyword argument of ``spec`` nests
    more than ``max_depth`` lists and objects deep."""
    for value in [*spec.args, *spec.kwargs.values()]:
        if nesting_depth(value, max_depth) > max_depth:
            raise InvalidJobError(
                f"job {spec.id} of task {spec.task[:100]!r}: an argument nests more than "
                f"{max_depth} levels deep (lists and objects inside one another), over the "
                "payload depth limit; flatten it or pass a reference instead"
            )


def check_args(spec: JobSpec, limit: int | None, max_depth: int = DEFAULT_MAX_PAYLOAD_DEPTH) -> int:
    """The payload size of ``spec``; raises :class:`InvalidJobError` if an argument nests
    deeper than ``max_depth`` and :class:`PayloadTooLargeError` if the payload is over
    ``limit``. Depth goes first: measuring the size of a too-deep value would recurse.

    ``None`` disables the size check (the size is then not computed and 0 is returned).
    """
    check_depth(spec, max_depth)
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


ESCAPE_GROWTH = 3
"""How many times larger a JSON value can get when its non-ASCII characters are escaped
(the stored form) than as UTF-8 (the wire form): a two-byte character becomes six bytes
(``\\u00e9``), a four-byte one twelve (a surrogate pair); everything else is the same."""


def result_too_large_on_wire(result: JSONValue, wire_size: int, limit: int | None) -> str | None:
    """:func:`result_too_large`, without measuring when a line of ``wire_size`` bytes that
    holds ``result`` as UTF-8 JSON proves it fits (:data:`ESCAPE_GROWTH`): a worker then
    encodes a result once, for the line, instead of once more to measure it."""
    if limit is None or wire_size * ESCAPE_GROWTH <= limit:
        return None
    return result_too_large(result, limit)


def result_too_deep(result: JSONValue, max_depth: int) -> str | None:
    """Why ``result`` may not be stored (it nests deeper than ``max_depth``), or ``None``."""
    if nesting_depth(result, max_depth) <= max_depth:
        return None
    return (
        f"the job's result nests more than {max_depth} levels deep (lists and objects inside "
        "one another), over the payload depth limit; the result was not stored (return "
        "flatter data)"
    )


def result_problem(result: JSONValue, limit: int | None, max_depth: int) -> str | None:
    """Why ``result`` may not be stored (too deep, or too large), or ``None`` if it may.

    Depth first: measuring the size of a too-deep value would itself recurse too far.
    """
    return result_too_deep(result, max_depth) or result_too_large(result, limit)


__all__ = [
    "DEFAULT_MAX_CHECKPOINT_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DEFAULT_MAX_PAYLOAD_DEPTH",
    "DEFAULT_OFFLOAD_BYTES",
    "ESCAPE_GROWTH",
    "LINE_HEADROOM_BYTES",
    "MAX_LINE_BYTES_CEILING",
    "MAX_PAYLOAD_BYTES_CEILING",
    "MAX_PAYLOAD_DEPTH_CEILING",
    "args_size",
    "check_all",
    "check_args",
    "check_depth",
    "encoded_size",
    "nesting_depth",
    "result_problem",
    "result_too_deep",
    "result_too_large",
    "result_too_large_on_wire",
]
