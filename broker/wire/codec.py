"""Messages to lines and back: encode and pack for sending, and the strict decoder
with its error explainer for reading (the messages are :mod:`broker.wire.messages`).

Decoding is strict about types because the main is the only writer to the job
store: a ``true`` where a count belongs, or a lease id that is not a UUID, must be
turned away at the edge rather than discovered in the store. It is lenient about
*extra* fields, so a newer peer can add one without breaking an older one.

Two decoders share the one set of message classes. msgspec decodes and checks a line
in one C call (a job or a report in a microsecond or two, where walking the JSON in
Python cost about 70 µs); its constraints (``Int``, ``Float``, ``Name``) are set
stricter than or equal to the rules, never looser. Only a line msgspec refuses goes to
the hand-written walker (:func:`_explain`), which applies the rules exactly as
specified and either accepts the line (a value msgspec is stricter about, such as a
lone surrogate escape or a non-canonical UUID) or refuses it with a message naming
the field (``hello.modes[1] must be one of ...``), which peers log and tests match.
"""

from __future__ import annotations

import enum
import json
import math
import re
import types
import typing
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, TypeVar

import msgspec

from broker.exceptions import ProtocolError
from broker.model.bounds import MAX_WORKER_STATUS_BYTES, MESSAGE_CONTAINERS
from broker.model.values import check_name
from broker.payload import containers_in, too_many_containers
from broker.wire.fields import INT64_MAX, INT64_MIN
from broker.wire.messages import (
    MESSAGE_TYPES,
    AckStatus,
    Batch,
    CheckpointAck,
    CompletedReport,
    Enqueue,
    EnqueueEach,
    ErrorCode,
    FailedReport,
    Jobs,
    Message,
    ReportAcks,
    Reports,
    SaveCheckpoint,
    WorkerStatus,
)

_T = TypeVar("_T")


class DecodeError(ProtocolError):
    """The peer sent a line that is not a valid broker message."""

    code: str = ErrorCode.MALFORMED

    def __init__(
        self, message: str, *, msg_type: str | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.msg_type = msg_type
        """The message's ``type`` when it could be read, so the reply can be specific."""
        self.request_id = request_id
        """The request's id when it could be read, so the main can answer with
        ``request_error`` and keep a client's connection instead of dropping it."""


class UnknownTypeError(DecodeError):
    """The peer sent a message type this version does not know."""

    code = ErrorCode.UNKNOWN_TYPE


class OverBoundError(DecodeError):
    """A line over a bound that is checked before (or instead of) keeping its message:
    too many lists and objects (``payload_too_large``), or a ``worker_status`` too long
    (``over_limit``). Never fatal: the line was read whole, so the stream is intact.

    ``instead`` is a message the main handles in the line's place (a worker's oversized
    ``completed`` becomes a failure of that job, so the job ends cleanly and the worker's
    report is answered), ``reply`` one it answers with (a ``checkpoint`` refused)."""

    def __init__(
        self,
        message: str,
        *,
        code: str,
        msg_type: str | None = None,
        request_id: str | None = None,
        instead: Message | None = None,
        reply: Message | None = None,
    ) -> None:
        super().__init__(message, msg_type=msg_type, request_id=request_id)
        self.code = code
        self.instead = instead
        self.reply = reply


# --------------------------------------------------------------------------- encode

_ENCODER = msgspec.json.Encoder()

_SCALAR_TYPES = frozenset({str, int, bool, type(None)})


def _check_json(value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is plain JSON as :func:`json.dumps` would take
    it: msgspec would quietly write NaN as ``null`` and a set, a datetime or a UUID as a
    list or a string, and a result must never change on its way to the store. A value
    that nests past the recursion limit (or contains itself) raises ``RecursionError``."""
    kind = type(value)
    if kind in _SCALAR_TYPES:
        return
    if kind is list or kind is tuple:
        for item in typing.cast(Sequence[object], value):
            if type(item) not in _SCALAR_TYPES:
                _check_json(item)
    elif kind is dict:
        for key, item in typing.cast(dict[object, object], value).items():
            if type(key) is not str and (type(key) is not int):
                raise ValueError(f"keys must be strings, not {type(key).__name__}")
            if type(item) not in _SCALAR_TYPES:
                _check_json(item)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not valid JSON")
    elif isinstance(value, str | int):
        return
    elif isinstance(value, dict):
        _check_json(dict(value))  # a subclass: check it as a plain one
    elif isinstance(value, list | tuple):
        _check_json(list(value))
    else:
        raise ValueError(f"Object of type {kind.__name__} is not JSON serializable")


def _payload_fields(cls: type) -> tuple[tuple[str, bool], ...]:
    """``(field, nested)`` for each field of ``cls`` that holds a payload (``nested``:
    messages or structs that may hold payloads themselves), resolved once per class."""
    if cls not in _PAYLOADS:
        found: list[tuple[str, bool]] = []
        for name, tp, _ in _fields(cls):
            if _mentions(tp, lambda t: t is Any):
                found.append((name, False))
            elif _mentions(tp, lambda t: _is_struct(t) and bool(_payload_fields(t))):
                found.append((name, True))
        _PAYLOADS[cls] = tuple(found)
    return _PAYLOADS[cls]


_PAYLOADS: dict[type, tuple[tuple[str, bool], ...]] = {}


def _mentions(tp: Any, test: Callable[[Any], bool]) -> bool:
    return test(tp) or any(_mentions(arg, test) for arg in typing.get_args(tp))


def _check_payloads(value: object) -> None:
    for name, nested in _payload_fields(type(value)):
        field_value = getattr(value, name)
        if not nested:
            _check_json(field_value)
        elif isinstance(field_value, list):
            for item in field_value:
                _check_payloads(item)
        elif field_value is not None:
            _check_payloads(field_value)


def encode_item(msg: Message) -> bytes:
    """One message as compact JSON, without the newline: the unit :func:`pack` joins.

    Raises ``ValueError`` if a payload (``args``, ``result``...) is not plain JSON, so
    the caller can report that instead of sending something the peer would reject.
    """
    try:
        _check_payloads(msg)
        return _ENCODER.encode(msg)
    except UnicodeEncodeError:
        # A lone surrogate (from an exception text, say) has no UTF-8 form; json writes
        # it as its \\udXXX escape, which the peer's walker reads back unchanged.
        return json.dumps(msgspec.to_builtins(msg), separators=(",", ":")).encode("ascii")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot encode {msg.type} message: {exc}") from exc
    except RecursionError:
        # A payload nested ~1,000 deep: the caller's ValueError path (fail that job, skip
        # that field) must handle it, not let it escape and take down its loop.
        raise ValueError(f"cannot encode {msg.type} message: it nests too deeply") from None


def encode(msg: Message) -> bytes:
    """One compact JSON line ending in ``\\n`` (raises ``ValueError`` as :func:`encode_item`)."""
    return encode_item(msg) + b"\n"


def pack(
    kind: type[Batch],
    items: Sequence[bytes],
    max_line_bytes: int,
    max_containers: int | None = None,
) -> list[bytes]:
    """Lines that carry ``items`` (from :func:`encode_item`, of the messages ``kind``
    holds) in order: one item alone as its own message, several as ``kind`` batches,
    none longer than ``max_line_bytes`` before its newline and, with ``max_containers``
    (the main's, from ``welcome``), none holding more lists and objects than the main
    reads (:func:`decode_from_peer`). An item too long on its own goes alone (its sender
    checks single messages against the limits: a ``job`` always fits, a report too long
    or too full is replaced by a failure before it gets here)."""
    (name,) = kind.__struct_fields__
    head = b'{"type":"%s","%s":[' % (kind.type.encode(), name.encode())
    room = max_line_bytes - len(head) - 2  # 2: the closing "]}"
    # The batch's own object and list count against the main's bound too.
    shelves = None if max_containers is None else max_containers + MESSAGE_CONTAINERS - 2
    lines: list[bytes] = []
    start, size, held = 0, 0, 0
    for end, item in enumerate(items):
        grown = size + len(item) + (1 if end > start else 0)
        fuller = held + (0 if shelves is None else containers_in(item))
        if end > start and (grown > room or (shelves is not None and fuller > shelves)):
            lines.append(_line(head, items[start:end]))
            start, grown, fuller = end, len(item), fuller - held
        size, held = grown, fuller
    if start < len(items):
        lines.append(_line(head, items[start:]))
    return lines


def _line(head: bytes, items: Sequence[bytes]) -> bytes:
    if len(items) == 1:
        return items[0] + b"\n"
    return head + b",".join(items) + b"]}\n"


def unbatch(msg: Message) -> Iterable[Message]:
    """The messages a line carried: a batch's items, or the message itself."""
    match msg:
        case Jobs(jobs=items):
            return items
        case Reports(reports=reports):
            return reports
        case ReportAcks(acks=acks):
            return acks
        case _:
            return (msg,)


# --------------------------------------------------------------------------- decode

_DECODER = msgspec.json.Decoder(Message)


HEAD_BYTES = 8 << 10
"""How far into a refused line :func:`container_refusal` looks for the fields that say
whose it is: every sender of this package writes the tag, ``request_id``, ``job_id``,
``handoff_id`` and ``seq`` before any payload (msgspec keeps the declared field order)."""

_HEAD_FIELDS = re.compile(
    rb'"(type|request_id|job_id|handoff_id)"\s*:\s*"([^"\\]{1,1024})"'
    rb'|"(seq)"\s*:\s*(\d{1,18})\s*[,}]'
)
"""A top-level field of the head, as JSON writes it: inside a string every quote is
escaped, so this never matches a string's content."""


def _lease_in(head: Mapping[str, str]) -> tuple[uuid.UUID, uuid.UUID] | None:
    try:
        return uuid.UUID(head["job_id"]), uuid.UUID(head["handoff_id"])
    except (KeyError, ValueError):
        return None


def _name_or_none(text: str | None) -> str | None:
    """``text`` if it is a name a reply may carry back (JSON escapes aside), else ``None``."""
    try:
        check_name("request_id", text)
    except ValueError:
        return None
    return text


def decode_from_peer(line: bytes) -> Message:
    """:func:`decode` for the main's reading of an authenticated peer (whose lines its
    reader already held to the container bound): a ``worker_status`` over
    :data:`~broker.model.bounds.MAX_WORKER_STATUS_BYTES` is refused rather than kept, and echoed
    in every ``status`` reply. Raises :class:`OverBoundError`, or :class:`DecodeError` as
    :func:`decode` does."""
    msg = decode(line)
    if type(msg) is WorkerStatus and len(line) > MAX_WORKER_STATUS_BYTES:
        raise OverBoundError(
            f"worker_status is {len(line)} bytes, over the limit of {MAX_WORKER_STATUS_BYTES} "
            "bytes; it was not kept (a status is capacity and start-up errors, a few hundred "
            "bytes)",
            code=ErrorCode.OVER_LIMIT,
            msg_type=WorkerStatus.type,
        )
    return msg


def container_refusal(line: bytes, max_containers: int) -> OverBoundError:
    """The refusal of a line over the container bound (``line``: its start, the rest was
    dropped as it was read, see :class:`broker.wire.framing.TooManyContainersError`), as specific
    as its head allows: an
    enqueue's is answered as its request (``payload_too_large``), a ``completed`` report
    fails its job (:attr:`OverBoundError.instead`), a ``checkpoint`` is answered
    ``refused`` (:attr:`OverBoundError.reply`). The head is read from the line's first
    :data:`HEAD_BYTES` (microseconds, where even msgspec, skipping the rest unbuilt, took
    50 ms on 15 MiB); a sender that puts it later gets a plain ``error`` instead."""
    head: dict[str, str] = {}
    for match in _HEAD_FIELDS.finditer(line, 0, HEAD_BYTES):
        name = (match.group(1) or match.group(3)).decode()
        head.setdefault(name, (match.group(2) or match.group(4)).decode(errors="replace"))
    kind = head.get("type") if head.get("type") in MESSAGE_TYPES else None
    what = {
        CompletedReport.type: "the job's result",
        SaveCheckpoint.type: "the checkpoint",
        Enqueue.type: "the enqueue request (its jobs' args and kwargs together)",
        EnqueueEach.type: "the enqueue_each request (its argument sets together)",
    }.get(kind or "", f"the {kind or 'message'}")
    message = too_many_containers(what, max_containers)
    instead: Message | None = None
    reply: Message | None = None
    lease = _lease_in(head)
    if lease is not None and kind == CompletedReport.type:
        instead = FailedReport(
            *lease, error=f"{message}; the result was not stored (return flatter data)", retry=False
        )
    elif lease is not None and kind == SaveCheckpoint.type and int(head.get("seq", 0)) >= 1:
        reply = CheckpointAck(
            *lease,
            int(head["seq"]),
            AckStatus.REFUSED,
            code=ErrorCode.PAYLOAD_TOO_LARGE,
            message=message,
        )
    return OverBoundError(
        message,
        code=ErrorCode.PAYLOAD_TOO_LARGE,
        msg_type=kind,
        request_id=_name_or_none(head.get("request_id")),
        instead=instead,
        reply=reply,
    )


def decode(line: bytes | str) -> Message:
    """Parse one line (with or without its newline) into a message.

    Raises :class:`DecodeError` (``code`` says which error code to reply with);
    ``msg_type`` and ``request_id`` are filled in when they could be read.
    """
    try:
        return _DECODER.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return _explain(line)


def _explain(line: bytes | str) -> Message:
    """The rules applied field by field: a line msgspec refused is either accepted after
    all (msgspec is stricter in places) or refused with the field that is wrong."""
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except ValueError as exc:
        raise DecodeError(f"invalid JSON: {exc}") from None
    except RecursionError:
        # A few KiB of "[[[[" must not take the connection handler down.
        raise DecodeError("invalid JSON: it nests too deeply to decode") from None
    match data:
        case {"type": str(tag)} if tag in MESSAGE_TYPES:
            request_id = data.get("request_id")
            try:
                return _build(MESSAGE_TYPES[tag], data, tag)
            except DecodeError as exc:
                exc.msg_type = tag
                exc.request_id = request_id if isinstance(request_id, str) else None
                raise
        case {"type": str(tag)}:
            raise UnknownTypeError(f"unknown message type {tag[:40]!r}", msg_type=tag[:40])
        case {"type": other}:
            raise DecodeError(f"type must be a string, got {_describe(other)}")
        case dict():
            raise DecodeError("message has no type")
        case _:
            raise DecodeError(f"message must be a JSON object, got {_describe(data)}")


_INT_RANGE = range(INT64_MIN, INT64_MAX + 1)

_SCALARS: dict[Any, tuple[str, Callable[[object], bool]]] = {
    bool: ("a boolean", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: type(v) is int and v in _INT_RANGE),
    # An int beyond 64 bits would overflow float(); a float from JSON is already finite.
    float: ("a number", lambda v: type(v) is float or (type(v) is int and v in _INT_RANGE)),
    str: ("a string", lambda v: isinstance(v, str)),
}


_FIELDS: dict[type, tuple[tuple[str, Any, bool], ...]] = {}


def _fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, resolved type, required on the wire) for each field, resolved once per class."""
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls, include_extras=True)
        _FIELDS[cls] = tuple(
            (f.name, hints[f.name], f.required) for f in msgspec.structs.fields(cls)
        )
    return _FIELDS[cls]


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _describe(value: object) -> str:
    kind = {
        type(None): "null",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)
    shown = repr(value)
    # Never echo a peer's large payload back into logs or error replies.
    return kind if len(shown) > 40 or isinstance(value, list | dict) else f"{kind} ({shown})"


def _load(value: object, tp: Any, where: str, nullable: bool = False) -> Any:
    """Check one JSON value against a field's annotation and convert it (UUIDs, enums)."""
    if tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        loaded = _load(value, args[0], where, nullable)
        for check in args[1:]:
            if isinstance(check, msgspec.Meta):
                if isinstance(loaded, list) and len(loaded) > (check.max_length or len(loaded)):
                    raise DecodeError(f"{where} must hold at most {check.max_length} items")
                continue  # else the fast decoder's form of the same rule, or a looser one
            try:
                check(where, loaded)
            except ValueError as exc:
                raise DecodeError(str(exc)) from None
        return loaded
    if origin is types.UnionType or origin is typing.Union:
        if value is None and type(None) in args:
            return None
        choices = [a for a in args if a is not type(None)]
        if len(choices) > 1:  # messages told apart by their tag (a batch's reports)
            return _load_tagged(value, choices, where)
        return _load(value, choices[0], where, nullable=type(None) in args)
    if origin is list and isinstance(value, list):
        return [_load(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict and isinstance(value, dict):
        return {
            _load(k, args[0], f"{where} key"): _load(v, args[1], f"{where}.{k}")
            for k, v in value.items()
        }
    if _is_struct(tp) and isinstance(value, dict):
        return _build(typing.cast(type[Any], tp), value, where)
    try:
        return _load_leaf(value, tp)
    except (TypeError, ValueError, AttributeError) as exc:
        null = " or null" if nullable else ""
        raise DecodeError(f"{where} must be {exc}{null}, got {_describe(value)}") from None


def _load_tagged(value: object, choices: list[Any], where: str) -> Any:
    by_tag = {cls.type: cls for cls in choices}
    tag = value.get("type") if isinstance(value, dict) else None
    if not isinstance(value, dict) or tag not in by_tag:
        raise DecodeError(
            f"{where} must be an object whose type is one of "
            + ", ".join(repr(t) for t in by_tag)
            + f", got {_describe(tag if isinstance(value, dict) else value)}"
        )
    return _build(by_tag[tag], value, where)


def _load_leaf(value: object, tp: Any) -> Any:
    """Convert a scalar, or raise with what was expected as the message."""
    if tp in _SCALARS:
        expected, ok = _SCALARS[tp]
        if not ok(value):
            raise ValueError(expected)
        return float(typing.cast(float, value)) if tp is float else value
    if tp is uuid.UUID:
        if not isinstance(value, str):
            raise ValueError("a UUID string")
        try:
            return uuid.UUID(value)
        except ValueError:
            raise ValueError("a UUID string") from None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ValueError("one of " + ", ".join(repr(m.value) for m in tp)) from None
    origin = typing.get_origin(tp)
    if origin is list:
        raise ValueError("a list")
    if origin is dict or _is_struct(tp):
        raise ValueError("an object")
    raise RuntimeError(f"no wire form for {tp!r}")  # a bug in this module, not the peer's


def _build(cls: type[_T], data: Mapping[str, object], where: str) -> _T:
    values: dict[str, Any] = {}
    for name, tp, required in _fields(cls):
        if name in data:
            values[name] = _load(data[name], tp, f"{where}.{name}")
        elif required:
            raise DecodeError(f"{where}.{name} is required")
    try:
        return cls(**values)
    except ValueError as exc:
        raise DecodeError(f"{where}: {exc}") from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text} is out of range")
    return number
