"""Showing untrusted text safely: in the log, on the operator's terminal, in error messages.

Task names, worker ids, error texts and a child's output come from peers and user code.
Written out raw, a newline forges a log line and an ANSI escape rewrites the operator's
terminal; a store URL echoed in an error hands its password to whoever reads the log.
Everything the broker shows goes through the helpers here, so there is one rule for each.
"""

from __future__ import annotations

import re

CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f\u2028\u2029"
"""C0 and C1 controls, DEL, and the two Unicode line separators some viewers honour, as a
regular-expression character range: what is escaped when shown, and refused in names."""

_CONTROL = re.compile(f"[{CONTROL_CHARACTERS}]")

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def escape_control(text: str) -> str:
    """``text`` with every control character written as a Python-style escape.

    The result holds no control character, so escaping twice changes nothing; a
    backslash is left alone, which keeps paths and ordinary text as they were.
    """
    return _CONTROL.sub(_escaped, text)


_QUERY_SECRET = re.compile(r"(?i)\b(password|passwd|pwd)=[^&;\s]*")


def redact_url(url: str) -> str:
    """``url`` with its password hidden, whether or not it parses as a URL.

    Whatever stands between the first ``:`` of the user part and the last ``@`` is
    replaced, so an unusual (even malformed) password is hidden too, at worst with
    more of the URL than needed; so is a ``password=`` query parameter.
    """
    head, at, tail = url.rpartition("@")
    if at:
        scheme, sep, userinfo = head.partition("://")
        if not sep:
            scheme, userinfo = "", head
        user, colon, _ = userinfo.partition(":")
        if colon:
            head = f"{scheme}{sep}{user}:***"
        url = f"{head}@{tail}"
    return _QUERY_SECRET.sub(r"\1=***", url)
