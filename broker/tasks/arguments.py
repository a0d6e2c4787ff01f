"""Rich argument and result types: their JSON form, and the typed values a task receives.

A job's arguments and result travel and are stored as JSON, and stay JSON everywhere in
between: the main, the stores and any peer that does not know a type see only the
documented JSON form (``docs/reference/arguments.md``). Types are a matter of the two
ends, which hold the task:

* **The producer** (a typed enqueue, ``task.enqueue(...)``, and a child returning a
  result) writes each value in its JSON form with :func:`to_json_form`: an aware
  ``datetime`` as an ISO 8601 string, a ``date`` too, a ``UUID`` and a ``Decimal`` as
  strings, ``bytes`` as base64, an enum by its value, a dataclass or a msgspec ``Struct``
  as an object. A value that is plain JSON already is judged by one C encoding and kept
  as it is; another is converted by ``msgspec.to_builtins``, in C. Values JSON would
  read back differently are refused there, with the argument named: a naive
  ``datetime`` (which instant?) and a set (no order, so no stable unique key).
* **The runner** gives the task real ``datetime``, ``UUID``... objects, converted from the
  JSON form by the function's own annotations (:class:`ArgumentPlan`, one per function,
  built at its first job: one msgspec ``Struct`` of the parameters to convert, so a job
  costs one C conversion). A parameter without an annotation, or annotated with plain
  JSON types only, gets the JSON form as it is, at no cost. A value that cannot be
  converted fails the job without a retry (the same value fails every run), naming the
  parameter.
* **The caller** that has the task reads a result back typed by the return annotation
  (:meth:`ArgumentPlan.decode_result`, through :meth:`broker.tasks.registry.Task.decode_result`);
  a caller by name gets the JSON form.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import re
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from broker.exceptions import InvalidJobError
from broker.jobs import JSONValue, compact_json
from broker.model.bounds import MAX_PAYLOAD_DEPTH_CEILING

_PLAIN_SCALARS = frozenset({str, int, float, bool, type(None)})
"""Types every value of which is its own JSON form (a float may be NaN: the job's own
JSON check refuses that)."""


class _Refused(Exception):
    """A value whose JSON form would not read back as it was (see :func:`to_json_form`)."""


def _refuse_unknown(value: Any) -> Any:
    """``msgspec.to_builtins``'s hook for a type it does not know: refuse it by name."""
    raise _Refused(
        f"a value of type {type(value).__qualname__} has no JSON form "
        "(see docs/reference/arguments.md for the types an argument or result may hold)"
    )


def _check_value(value: Any) -> None:
    """Raise :class:`_Refused` if ``value`` holds a naive ``datetime`` or a set, which
    ``msgspec.to_builtins`` would write without complaint (as an ISO string without an
    offset, as a list) but which would not read back as they were.

    Depth first, one step per list, object, dataclass or Struct met (a list of plain
    scalars is judged in C), and never deeper than
    :data:`~broker.model.bounds.MAX_PAYLOAD_DEPTH_CEILING`, so a value that contains
    itself is refused instead of walked for ever. Only reached for values that are not
    plain JSON already, at the producer (never at the main, which only sees JSON).
    """
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        kind = type(item)
        if kind in _PLAIN_SCALARS:
            continue
        if depth > MAX_PAYLOAD_DEPTH_CEILING:
            raise _Refused(
                f"it nests more than {MAX_PAYLOAD_DEPTH_CEILING} levels deep (or contains itself)"
            )
        below: Iterable[Any] = ()
        if kind is list or kind is tuple or kind is dict:
            items = item.values() if kind is dict else item
            if not _PLAIN_SCALARS.issuperset(map(type, items)):
                below = items
        elif isinstance(item, datetime.datetime):
            if item.utcoffset() is None:
                raise _Refused(
                    f"the datetime {item.isoformat()} is naive: give it a time zone "
                    "(datetime.now(UTC), dt.replace(tzinfo=...)), so it names one instant"
                )
        elif isinstance(item, set | frozenset):
            raise _Refused(
                "a set has no JSON form that keeps it (JSON has no sets, and a list made "
                "of one has no fixed order); pass a sorted list (a parameter annotated "
                "set[...] receives a set again)"
            )
        elif isinstance(item, msgspec.Struct):
            below = [getattr(item, name) for name in item.__struct_fields__]
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            below = [getattr(item, f.name) for f in dataclasses.fields(item)]
        elif isinstance(item, list | tuple):
            below = item
        elif isinstance(item, dict):
            below = item.values()
        pending.extend((child, depth + 1) for child in below)


def to_json_form(value: Any, what: str) -> JSONValue:
    """``value`` in its documented JSON form (``docs/reference/arguments.md``): plain JSON
    data, which any peer can read without knowing a type.

    :raises InvalidJobError: ``value`` holds a naive ``datetime``, a set, or a type with
        no JSON form; ``what`` names it (``"argument 'when'"``).
    """
    if type(value) in _PLAIN_SCALARS:
        return value
    try:
        compact_json(value)
        return value  # plain JSON already, as judged in C: nothing to convert or walk
    except (TypeError, ValueError, RecursionError):
        pass  # a type JSON does not know (or NaN, which the job's own check refuses)
    try:
        _check_value(value)
        return msgspec.to_builtins(value, enc_hook=_refuse_unknown)
    except (_Refused, TypeError, ValueError) as exc:
        raise InvalidJobError(f"{what} is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise InvalidJobError(f"{what} nests too deeply to be encoded as JSON") from None


def encode_arguments(
    task: str, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[Sequence[JSONValue], Mapping[str, JSONValue]]:
    """A typed enqueue's arguments of ``func`` (task ``task``) in their JSON form
    (:func:`to_json_form`), each refusal naming the parameter. Arguments that are plain
    scalars already (the usual case) are returned as they are, judged in C without a
    Python step per argument."""
    if _PLAIN_SCALARS.issuperset(map(type, args)) and _PLAIN_SCALARS.issuperset(
        map(type, kwargs.values())
    ):
        return args, kwargs
    names = plan_for(func).names
    return (
        tuple(
            to_json_form(
                value,
                f"argument {names[i] if i < len(names) else i!r} of task {task!r}",
            )
            for i, value in enumerate(args)
        ),
        {
            name: to_json_form(value, f"argument {name!r} of task {task!r}")
            for name, value in kwargs.items()
        },
    )


# --------------------------------------------------------------------------- decode


Converter = Callable[[Any], Any]


def _types_in(info: msgspec.inspect.Type) -> Iterator[msgspec.inspect.Type]:
    """Every type ``info`` is made of, itself included, each once (a recursive type
    refers to itself)."""
    seen: set[int] = set()
    pending = [info]
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        for attribute in ("item_type", "key_type", "value_type"):
            below = getattr(node, attribute, None)
            if below is not None:
                pending.append(below)
        pending.extend(getattr(node, "types", ()))
        pending.extend(getattr(node, "item_types", ()))
        pending.extend(field.type for field in getattr(node, "fields", ()))


_PLAIN_INFO = (
    msgspec.inspect.AnyType,
    msgspec.inspect.NoneType,
    msgspec.inspect.BoolType,
    msgspec.inspect.IntType,
    msgspec.inspect.FloatType,
    msgspec.inspect.StrType,
    msgspec.inspect.LiteralType,
    msgspec.inspect.UnionType,
    msgspec.inspect.ListType,
)
"""What JSON values satisfy as they are: a parameter made of these alone needs no
conversion (a dict too, when its keys are strings), so it costs nothing per job."""


def _needs_conversion(info: msgspec.inspect.Type) -> bool | None:
    """Whether a JSON value may have to change to satisfy the type ``info`` describes (a
    ``datetime`` arrives as a string); ``None`` when msgspec cannot make it (a class of
    the app's own, anywhere inside), whose parameter then gets the JSON form."""
    converts = False
    for node in _types_in(info):
        if isinstance(node, msgspec.inspect.CustomType):
            return None
        if isinstance(node, msgspec.inspect.DictType):
            converts = converts or not isinstance(
                node.key_type, msgspec.inspect.StrType | msgspec.inspect.AnyType
            )
        elif not isinstance(node, _PLAIN_INFO):
            converts = True
    return converts


def _converter(annotation: Any) -> Converter | None:
    """Converts a JSON value to ``annotation`` with msgspec (``None``: the JSON value is
    passed as it is, because it needs no conversion or msgspec cannot make the type)."""
    try:
        if not _needs_conversion(msgspec.inspect.type_info(annotation)):
            return None
        # Raises TypeError for a type msgspec cannot leave unset, as a field of a plan's
        # ``arguments`` struct.
        msgspec.json.Decoder(annotation | msgspec.UnsetType)
    except (TypeError, ValueError):
        return None
    return functools.partial(msgspec.convert, type=annotation, strict=False)


@dataclass(frozen=True, slots=True)
class ArgumentPlan:
    """How one function's arguments and result are converted from their JSON form,
    planned once per function: its named parameters that need a conversion are the
    fields of one msgspec ``Struct`` (``arguments``), so a job's arguments are converted
    in one C call, with type information msgspec keeps on that class."""

    names: tuple[str, ...]
    """The parameters that take positional arguments, in order (to name an argument)."""
    positional: tuple[str | None, ...]
    """Per parameter that takes a positional argument, in order: its name if it needs a
    conversion, else ``None``."""
    keyword: Mapping[str, bool]
    """Every parameter that may be given by keyword: whether it needs a conversion."""
    arguments: type[msgspec.Struct] | None
    """One field per parameter that needs a conversion (left unset when a job does not
    give it), named after the parameter through ``rename``."""
    attributes: Mapping[str, str]
    """The ``arguments`` attribute that holds each parameter."""
    var_positional: tuple[str, Converter] | None
    """``*args``, when its annotation needs a conversion."""
    var_keyword: tuple[str, Converter] | None
    """``**kwargs``, when its annotation needs a conversion."""
    result: Converter | None
    converts: bool
    """Whether any argument may need a conversion: without one, a job's arguments are
    passed on as they came, at the cost of reading this flag."""

    def decode(
        self, task: str, args: tuple[JSONValue, ...], kwargs: dict[str, JSONValue]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments the task receives, converted by its annotations.

        :raises InvalidJobError: an argument does not fit its annotation; the message
            names the parameter.
        """
        if not self.converts:
            return args, kwargs
        positional, keyword = self.positional, self.keyword
        given = min(len(args), len(positional))
        values = {name: args[i] for i in range(given) if (name := positional[i]) is not None}
        values.update((name, value) for name, value in kwargs.items() if keyword.get(name))
        converted, named = list(args), dict(kwargs)
        if values and self.arguments is not None:
            typed = self._convert_named(task, values)
            attributes = self.attributes
            for i in range(given):
                if (name := positional[i]) is not None:
                    converted[i] = getattr(typed, attributes[name])
            for name in kwargs:
                if keyword.get(name):
                    named[name] = getattr(typed, attributes[name])
        if self.var_positional is not None:
            star, convert = self.var_positional
            for i in range(len(positional), len(args)):
                converted[i] = _convert(convert, args[i], f"argument {star!r} of task {task!r}")
        if self.var_keyword is not None:
            convert = self.var_keyword[1]
            for name, value in kwargs.items():
                if name not in keyword:
                    named[name] = _convert(convert, value, f"argument {name!r} of task {task!r}")
        return tuple(converted), named

    def _convert_named(self, task: str, values: dict[str, JSONValue]) -> msgspec.Struct:
        try:
            return msgspec.convert(values, type=self.arguments, strict=False)
        except msgspec.ValidationError as exc:
            found = _PATH.search(str(exc))
            name = found.group(1) if found else "?"
            raise InvalidJobError(
                f"argument {name!r} of task {task!r} cannot be converted to its annotation: "
                f"{exc} (got {values.get(name)!r:.200}; not retried: the same value fails "
                "every run)"
            ) from None

    def decode_result(self, task: str, value: JSONValue) -> Any:
        """A job's result as its task's return annotation says (the JSON form, when it
        has none that needs a conversion)."""
        if self.result is None or value is None:
            return value
        return _convert(self.result, value, f"the result of task {task!r}")


_PATH = re.compile(r"- at `\$\.([^.`\[]+)")
"""The parameter a msgspec validation error of an ``arguments`` struct is about."""


def _convert(convert: Converter, value: JSONValue, what: str) -> Any:
    try:
        return convert(value)
    except msgspec.ValidationError as exc:
        raise InvalidJobError(
            f"{what} cannot be converted to its annotation: {exc} (got {value!r:.200}; "
            "not retried: the same value fails every run)"
        ) from None


_NO_PLAN = ArgumentPlan((), (), {}, None, {}, None, None, None, converts=False)


def _hints(func: Callable[..., Any]) -> dict[str, Any]:
    """``func``'s annotations, resolved. When one cannot be (a name imported only under
    ``TYPE_CHECKING``), each other is resolved on its own, so that one parameter alone
    gets the JSON form instead of every parameter of the function."""
    try:
        return typing.get_type_hints(func, include_extras=True)
    except Exception:
        pass
    hints: dict[str, Any] = {}
    namespace = getattr(func, "__globals__", {})
    for name, annotation in getattr(func, "__annotations__", {}).items():
        try:
            # What get_type_hints does per annotation: the app's own source, in its module.
            hints[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
        except Exception:
            continue
    return hints


_plans: dict[Callable[..., Any], ArgumentPlan] = {}
"""Plans by function: built at a function's first job (or typed result), kept for the
process's life (the functions are registered tasks, a fixed set)."""


def plan_for(func: Callable[..., Any]) -> ArgumentPlan:
    """The argument plan of ``func``, built once."""
    plan = _plans.get(func)
    if plan is None:
        plan = _plans[func] = _build_plan(func)
    return plan


def _build_plan(func: Callable[..., Any]) -> ArgumentPlan:
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return _NO_PLAN
    hints = _hints(func)
    kind = inspect.Parameter
    names: list[str] = []
    positional: list[str | None] = []
    keyword: dict[str, bool] = {}
    fields: list[tuple[str, Any, Any]] = []
    attributes: dict[str, str] = {}
    var_positional: tuple[str, Converter] | None = None
    var_keyword: tuple[str, Converter] | None = None
    for parameter in parameters:
        name = parameter.name
        convert = _converter(hints[name]) if name in hints else None
        if parameter.kind is kind.VAR_POSITIONAL:
            var_positional = None if convert is None else (name, convert)
            continue
        if parameter.kind is kind.VAR_KEYWORD:
            var_keyword = None if convert is None else (name, convert)
            continue
        if convert is not None:
            attributes[name] = f"p{len(fields)}"
            fields.append((attributes[name], hints[name] | msgspec.UnsetType, msgspec.UNSET))
        if parameter.kind is not kind.KEYWORD_ONLY:
            names.append(name)
            positional.append(name if convert is not None else None)
        if parameter.kind is not kind.POSITIONAL_ONLY:
            keyword[name] = convert is not None
    arguments = None
    if fields:
        rename = {attribute: name for name, attribute in attributes.items()}
        arguments = msgspec.defstruct(
            f"{getattr(func, '__qualname__', 'task')}.arguments", fields, rename=rename
        )
    result = _converter(hints["return"]) if "return" in hints else None
    return ArgumentPlan(
        tuple(names),
        tuple(positional),
        keyword,
        arguments,
        attributes,
        var_positional,
        var_keyword,
        result,
        converts=bool(fields) or var_positional is not None or var_keyword is not None,
    )
