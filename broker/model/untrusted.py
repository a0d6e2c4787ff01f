"""Showing untrusted text safely: in the log, on the operator's terminal, in error messages.

Task names, worker ids, error texts and a child's output come from peers and user code.
Written out raw, a newline forges a log line, an ANSI escape rewrites the operator's
terminal, and a bidi override (U+202E) shows ``gpj.exe`` as ``exe.jpg``; a store URL echoed
in an error hands its password to whoever reads the log. Everything the broker shows goes
through the helpers here, so there is one rule for each.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f\u2028\u2029"
"""C0 and C1 controls, DEL, and the two Unicode line separators some viewers honour, as a
regular-expression character range: what is escaped when shown, and refused in names."""

BIDI_CONTROLS = r"\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
"""Unicode's bidirectional controls (the Arabic letter mark, the left-to-right and
right-to-left marks, embeddings, overrides and isolates): shown raw, they reorder the text
around them, so what a reader sees is not what is there. Escaped wherever text is shown."""

_CONTROL = re.compile(f"[{CONTROL_CHARACTERS}{BIDI_CONTROLS}]")
_BIDI = re.compile(f"[{BIDI_CONTROLS}]")

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def escape_control(text: str) -> str:
    """``text`` with every control character and bidi control written as a Python-style
    escape, for a log line or a terminal.

    The result holds no such character, so escaping twice changes nothing; a backslash
    is left alone, which keeps paths and ordinary text as they were.
    """
    return _CONTROL.sub(_escaped, text)


def escape_bidi(text: str) -> str:
    """``text`` with every bidi control written as ``\\u202e``, for HTML, where line
    breaks are safe (and wanted in a traceback) but a bidi control still reorders what
    the reader sees."""
    return _BIDI.sub(_escaped, text)


class RateLimit:
    """A token bucket for what is logged on a peer's doing: ``burst`` at once, then
    ``rate`` a second. What is over is not shown but counted (:attr:`suppressed`), so a
    flood costs the log one line per refill and the count still tells its size."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.suppressed = 0
        self._burst = float(burst)
        self._tokens = float(burst)
        self._clock = clock
        self._refilled = clock()

    def allow(self) -> bool:
        """Whether one more may be shown now; if not, it is counted in :attr:`suppressed`."""
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._refilled) * self.rate)
        self._refilled = now
        if self._tokens < 1:
            self.suppressed += 1
            return False
        self._tokens -= 1
        return True

    def take_suppressed(self) -> int:
        """How many were suppressed since the last call (the count starts again at 0)."""
        count, self.suppressed = self.suppressed, 0
        return count


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
