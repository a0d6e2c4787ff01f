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

import uuid
from collections.abc import Mapping, Sequence
from operator import countOf
from typing import Any, TypeAlias

from broker.exceptions import InvalidJobError, PayloadTooLargeError
from broker.jobs import JobSpec, JSONValue, SpecColumns, compact_json
from broker.model.bounds import (
    DEFAULT_MAX_CHECKPOINT_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_MAX_PAYLOAD_CONTAINERS,
    DEFAULT_MAX_PAYLOAD_DEPTH,
    MAX_PAYLOAD_BYTES_CEILING,
    MAX_PAYLOAD_DEPTH_CEILING,
)

MAX_LINE_BYTES_CEILING = MAX_PAYLOAD_BYTES_CEILING + (1 << 20)
"""The longest line a worker accepts from a main, whatever its welcome says (a memory
bound): a job at the highest payload limit a main may set, and its message. A main's
checkpoint limit in force keeps a job message within it."""

DEFAULT_OFFLOAD_BYTES = 64 << 10
"""64 KiB: a value (args, kwargs, result, checkpoint) larger than this as stored JSON is kept apart
from its job's row, in the store's payload table (see ``docs/howto/payload-limits.md``)."""

LINE_HEADROOM_BYTES = 64 << 10
"""How much longer than the payload limit a protocol line must be allowed to be, so a
job message (the payload plus ids, task and queue names) always fits in one line."""


_CONTAINERS = (list, tuple, dict)
"""What ``json`` encodes as an array or an object."""

_SCALAR_TYPE = frozenset({str, int, float, bool, type(None)}).__contains__
"""Whether a type is a JSON scalar's, as a C function: ``map`` applies it to a list's
items without a Python frame per item."""

_Container: TypeAlias = list[Any] | tuple[Any, ...] | dict[Any, Any]

_SMALL = 16
"""Up to this many items, a list or object is walked item by item; a longer one is first
judged in C (all scalars, or how many are not), which costs more than it saves on a few."""


def containers_in(text: bytes) -> int:
    """Lists and objects in a JSON text, counted from above: its ``[`` and ``{`` (those
    inside strings too). Two ``count`` calls in C, about 1 ms a MiB, so a line can be
    judged before anything in it is built."""
    return text.count(b"[") + text.count(b"{")


def nesting_depth(value: object, limit: int) -> int:
    """How many lists and objects deep ``value`` nests (a scalar is 0, ``[]`` is 1).

    Level by level, so no depth can exhaust the stack, and it stops as soon as it is past
    ``limit`` (returning ``limit + 1``), so a value a million levels deep costs no more
    than one just over the limit. A value that contains itself is, in effect, infinitely
    deep and is reported over the limit too. Its cost has no other bound: a value from
    outside goes through :func:`shape_problem`, which also stops at a container count.
    """
    depth = _walk(value, limit, None)
    assert depth is not None  # only a walk with a budget stops short
    return depth


def _walk(value: object, limit: int, budget: int | None) -> int | None:
    """The nesting depth of ``value``, at most ``limit + 1``; ``None`` once more than
    ``budget`` lists and objects were met (the walk stops there).

    One Python step per list or object, and only C per scalar (a list of numbers is judged
    by one ``map``), so a walk within :data:`~broker.model.bounds.DEFAULT_MAX_PAYLOAD_CONTAINERS`
    takes a few milliseconds."""
    level: list[_Container] = [value] if isinstance(value, _CONTAINERS) else []
    met = len(level)
    if budget is not None and met > budget:
        return None
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return depth
        below: list[_Container] = []
        add = below.append
        for item in level:
            children = item.values() if isinstance(item, dict) else item
            if len(children) > _SMALL:
                if all(map(_SCALAR_TYPE, map(type, children))):
                    continue  # judged in C: a long list of numbers costs no Python step
                if budget is not None and (
                    met + len(below) + countOf(map(_SCALAR_TYPE, map(type, children)), False)
                    > budget
                ):
                    return None  # counted in C, before a Python step per child
            for child in children:
                if isinstance(child, _CONTAINERS):
                    add(child)
            if budget is not None and met + len(below) > budget:
                return None
        met += len(below)
        level = below
    return depth


def shape_problem(
    value: object, max_depth: int, max_containers: int | None, what: str
) -> str | None:
    """Why ``value`` may not be stored, or ``None``: it nests deeper than ``max_depth``, or
    holds more than ``max_containers`` lists and objects (``what`` names it in the
    message: ``"the job's result"``). The walk stops at whichever bound it meets first,
    so judging any value costs at most ``max_containers`` steps."""
    depth = _walk(value, max_depth, max_containers)
    if depth is None:
        return too_many_containers(what, max_containers or 0)
    if depth > max_depth:
        return (
            f"{what} nests more than {max_depth} levels deep (lists and objects inside one "
            "another), over the payload depth limit"
        )
    return None


def too_many_containers(what: str, bound: int) -> str:
    """The refusal of a value (or a message) with more than ``bound`` lists and objects."""
    return (
        f"{what} holds more than {bound} lists and objects, over the payload container limit "
        "(--max-payload-containers: decoding and checking a value costs per list and "
        "object, so the main bounds them); pass flatter data, fewer jobs per request, or a "
        "reference to the data"
    )


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


def check_shape(
    spec: JobSpec, max_depth: int, max_containers: int | None = DEFAULT_MAX_PAYLOAD_CONTAINERS
) -> None:
    """Raise :class:`InvalidJobError` if an argument or keyword argument of ``spec`` nests
    more than ``max_depth`` lists and objects deep, or :class:`PayloadTooLargeError` if its
    args and kwargs together hold more than ``max_containers`` (``None``: no count) lists
    and objects, the args' list and the kwargs' object included (as ``[`` and ``{`` count
    in their JSON). One walk, stopped at either bound, so it costs little whatever the job.
    """
    _check_shape(spec.task, spec.id, spec.args, spec.kwargs, max_depth, max_containers)


def _check_shape(
    task: str,
    job_id: uuid.UUID,
    args: Sequence[JSONValue],
    kwargs: Mapping[str, JSONValue],
    max_depth: int,
    max_containers: int | None,
) -> None:
    """:func:`check_shape` of the job ``job_id`` of ``task`` with these arguments."""
    if (
        not kwargs
        and max_depth >= 1
        and (max_containers is None or max_containers >= 2)
        and all(map(_SCALAR_TYPE, map(type, args)))
    ):
        # The usual job: a flat list of scalars and no keyword arguments, one level deep
        # in two containers (the args' list, the kwargs' object), judged in C; the walk
        # below finds the same, for a third of a bulk enqueue's payload checks.
        return
    # Args and kwargs in one value: two levels above each argument, one list above them.
    both = [list(args), dict(kwargs)]
    depth = _walk(both, max_depth + 2, None if max_containers is None else max_containers + 1)
    if depth is None:
        raise PayloadTooLargeError(
            too_many_containers(
                f"job {job_id} of task {task[:100]!r}: its payload (args and kwargs)",
                max_containers or 0,
            )
        )
    if depth - 2 > max_depth:
        raise InvalidJobError(
            f"job {job_id} of task {task[:100]!r}: an argument nests more than "
            f"{max_depth} levels deep (lists and objects inside one another), over the "
            "payload depth limit; flatten it or pass a reference instead"
        )


def check_args(
    spec: JobSpec,
    limit: int | None,
    max_depth: int = DEFAULT_MAX_PAYLOAD_DEPTH,
    max_containers: int | None = DEFAULT_MAX_PAYLOAD_CONTAINERS,
) -> int:
    """The payload size of ``spec``; raises :class:`InvalidJobError` if an argument nests
    deeper than ``max_depth``, and :class:`PayloadTooLargeError` if its arguments hold more
    than ``max_containers`` lists and objects or are over ``limit`` bytes. Shape goes
    first: measuring the size of a too-deep value would recurse, and the shape's walk is
    bounded where encoding is not.

    ``None`` disables the size check (the size is then not computed and 0 is returned).
    """
    return _check_payload(
        spec.task, spec.id, spec.args, spec.kwargs, limit, max_depth, max_containers
    )


def _check_payload(
    task: str,
    job_id: uuid.UUID,
    args: Sequence[JSONValue],
    kwargs: Mapping[str, JSONValue],
    limit: int | None,
    max_depth: int,
    max_containers: int | None,
) -> int:
    """:func:`check_args` of the job ``job_id`` of ``task`` with these arguments."""
    _check_shape(task, job_id, args, kwargs, max_depth, max_containers)
    if limit is None:
        return 0
    size = args_size(args, kwargs)
    _check_size(task, job_id, size, limit)
    return size


def _check_size(task: str, job_id: uuid.UUID, size: int, limit: int | None) -> None:
    """Refuse the job ``job_id`` of ``task`` whose payload is ``size`` bytes if over ``limit``."""
    if limit is not None and size > limit:
        raise PayloadTooLargeError(
            f"job {job_id} of task {task[:100]!r}: args and kwargs are {size} bytes as JSON, "
            f"over the payload limit of {limit} bytes; pass a reference (a row id, an object "
            "store key) instead of the data"
        )


def check_encoded(spec: JobSpec, args_json: str, kwargs_json: str, limit: int | None) -> None:
    """:func:`check_all` of ``spec`` alone, its args and kwargs given as the JSON its row
    holds (:func:`compact_json`): their size is measured on that text, not encoded again
    (a one-job enqueue on its caller's connection encodes them once, for its row)."""
    _check_shape(
        spec.task,
        spec.id,
        spec.args,
        spec.kwargs,
        DEFAULT_MAX_PAYLOAD_DEPTH,
        DEFAULT_MAX_PAYLOAD_CONTAINERS,
    )
    _check_size(spec.task, spec.id, len(args_json) + len(kwargs_json), limit)


def check_all(specs: Sequence[JobSpec], limit: int | None) -> None:
    """Check every spec before any is stored, so a batch goes in whole or not at all: the
    direct enqueue's check (``enqueue_in``), with the main's default depth and container
    bounds, so a job the main would refuse never reaches its store by another door (the
    main decodes every job it claims)."""
    for spec in specs:
        check_args(spec, limit)


def check_columns(
    jobs: SpecColumns,
    limit: int | None,
    max_depth: int = DEFAULT_MAX_PAYLOAD_DEPTH,
    max_containers: int | None = DEFAULT_MAX_PAYLOAD_CONTAINERS,
) -> None:
    """:func:`check_all` of ``jobs``' specs, read from their columns (no spec per job);
    the main gives its own depth and container bounds, as :func:`check_args` takes them."""
    task = jobs.template.task
    for args, kwargs, job_id in zip(jobs.args, jobs.kwargs, jobs.ids, strict=True):
        _check_payload(task, job_id, args, kwargs, limit, max_depth, max_containers)


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


def result_too_deep(
    result: JSONValue, max_depth: int, max_containers: int | None = None
) -> str | None:
    """Why ``result`` may not be stored (it nests deeper than ``max_depth``, or holds more
    than ``max_containers`` lists and objects), or ``None``; the walk stops at either."""
    problem = shape_problem(result, max_depth, max_containers, "the job's result")
    if problem is None:
        return None
    return f"{problem}; the result was not stored (return flatter data)"


def result_problem(
    result: JSONValue,
    limit: int | None,
    max_depth: int,
    max_containers: int | None = DEFAULT_MAX_PAYLOAD_CONTAINERS,
) -> str | None:
    """Why ``result`` may not be stored (too deep, too many lists and objects, or too
    large), or ``None`` if it may.

    Shape first: measuring the size of a too-deep value would itself recurse too far.
    """
    return result_too_deep(result, max_depth, max_containers) or result_too_large(result, limit)


__all__ = [
    "DEFAULT_MAX_CHECKPOINT_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DEFAULT_MAX_PAYLOAD_CONTAINERS",
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
    "check_columns",
    "check_shape",
    "containers_in",
    "encoded_size",
    "nesting_depth",
    "result_problem",
    "result_too_deep",
    "result_too_large",
    "result_too_large_on_wire",
    "shape_problem",
    "too_many_containers",
]
