"""What every message is built from: the field types the decoders check, and the two
struct bases.

A field's type is its rule: ``Name`` refuses a control character, ``Int`` a number
beyond 64 bits, in msgspec's fast decode and in the walker alike
(:mod:`broker.wire.codec`), so each message class in :mod:`broker.wire.messages` and
:mod:`broker.wire.requests` states its rules by the types of its fields.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, TypeAlias

import msgspec

from broker.model.bounds import MAX_LIST_ITEMS, MAX_NAME_BYTES
from broker.model.untrusted import CONTROL_CHARACTERS
from broker.model.values import check_name

_NAME_PATTERN = f"\\A[^{CONTROL_CHARACTERS}]*\\Z"
"""msgspec's form of :func:`broker.model.values.check_name` (msgspec already refuses lone
surrogates in any string), so names are checked inside the fast decode."""

Name: TypeAlias = Annotated[
    str, msgspec.Meta(pattern=_NAME_PATTERN, max_length=MAX_NAME_BYTES // 4), check_name
]
"""A name or id (task, queue, worker id, host, key, request id, cursor): a string the
decoder refuses when it holds a control character or a lone surrogate, or is over
:data:`~broker.model.bounds.MAX_NAME_BYTES` in UTF-8 (:mod:`broker.model.values`). The fast decoder
counts characters (a quarter of the byte cap, so never over it); a longer name goes to
the walker, which counts its UTF-8 bytes. Free texts (an error message, a reason) stay
plain ``str``, bounded by the line."""

Names: TypeAlias = Annotated[list[Name], msgspec.Meta(max_length=MAX_LIST_ITEMS)]
"""A list of names, at most :data:`~broker.model.bounds.MAX_LIST_ITEMS` long: a list of strings
costs a check and an object per item, and no other bound (the container count) sees it."""

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Int: TypeAlias = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
"""Integers must fit a signed 64-bit column in any store and any peer's language."""

Float: TypeAlias = Annotated[float, msgspec.Meta(ge=-(2.0**62), le=2.0**62)]
"""A number. The bound only keeps an integer too big for 64 bits out of the fast decode
(the walker refuses it, and accepts a genuine float beyond the bound); it sits well
inside 2**63 because msgspec compares after rounding to a float, where 2**63 and
2**63 - 1 are the same number."""


class Nested(msgspec.Struct, frozen=True):
    """A value nested in messages (a lease, a job request)."""


class Tagged(msgspec.Struct, frozen=True, tag_field="type"):
    """A message: one JSON object tagged by its ``type``, set per class by ``tag=``."""

    type: ClassVar[str]
    """The tag (``job``, ``ready``...), also readable on the class; set from ``tag=`` by
    :mod:`broker.wire.messages`."""


def require(ok: bool, message: str) -> None:
    """The check in a message's ``__post_init__``."""
    # ValueError, not ProtocolError: a local caller building a bad message has a bug;
    # codec.decode() re-raises it as DecodeError because there the peer is at fault.
    if not ok:
        raise ValueError(message)
