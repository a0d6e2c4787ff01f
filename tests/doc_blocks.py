"""The docs' fenced blocks as tests: how a page's blocks are read, and how a shown output
is compared with the real one.

``tests/e2e/test_docs_pages.py`` runs every block of ``docs/tutorial.md`` and
``docs/howto/*.md`` against real processes; this module is its pure half (no processes,
no I/O beyond reading a page), so ``tests/unit/test_doc_blocks.py`` can prove that a
changed output fails. The conventions are the ones ``docs/contributing.md`` documents
("Docs that run"); in short:

* A ```` ```console ```` block is commands (``$ `` lines; a line ending in ``\\``
  continues) each followed by the output it shows, compared with what it prints.
* A ```` ```python ```` block runs as a script in the page's directory and must exit 0;
  one with ``await`` at its top level runs in an event loop, as ``python -m asyncio``
  would run it.
* An HTML comment on the line before a block says what else to do with it:
  ``<!-- docs-test: skip REASON -->``, ``<!-- docs-test: fragment REASON -->`` (a
  Python excerpt that cannot run alone: it is compiled, top-level ``await`` allowed,
  not run), ``<!-- docs-test: given CODE -->`` (run the Python block after the one
  line of Python ``CODE``, which gives it the names an excerpt takes from its
  surroundings: an open client, a user's id), ``<!-- docs-test: file PATH -->``
  (write the block to PATH, for a later command to use),
  ``<!-- docs-test: background TEXT -->`` (start
  the console block's one command and go on once its output shows TEXT), and
  ``<!-- docs-test: log -->`` (the block's lines appear, in order, in the output of the
  page's background commands), ``<!-- docs-test: stop -->`` (Ctrl-C, that is SIGINT to
  the process group, of the newest background command still running; once it exited,
  the block's lines appear in the output as for ``log``).
* Two directives stand alone, for a page that uses a main it does not show starting:
  ``<!-- docs-test: main -->`` starts ``broker-main`` on a SQLite file, and
  ``<!-- docs-test: worker APP -->`` a worker of the modules ``APP``; both are stopped
  at the end of the page.
* Anything else (```` ```sh ````, ```` ```yaml ````, an output block on its own) unmarked is
  an error: a new block is a decision between running it and saying why not.

A command must exit 0, unless its shown output ends with ``[exit N]``: then it must
exit N.

In a shown output ``…`` (or ``...``) stands for any text within a line, a line of only
``…`` for any number of lines, and ids and times are placeholders: a UUID matches any
UUID (the same shown UUID must stay the same real one, and a later command that names it
gets the real one), an ISO time any ISO time.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(?P<kind>[a-z]+)\s*(?P<arg>.*?)\s*-->\s*$")
KINDS = frozenset({"skip", "fragment", "given", "file", "background", "log", "stop"})
STEPS = frozenset({"main", "worker"})
"""Directives that stand alone, not before a block: processes the page does not show."""
RUNNABLE = frozenset({"console", "python"})

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:\d\d|Z)?")
ELLIPSIS = re.compile(r"…|\.\.\.")


class DocBlockError(ValueError):
    """A page's blocks cannot be read: a directive unknown or without its argument, or a
    block neither runnable nor marked. The message names the page and the line."""


@dataclass(frozen=True)
class Command:
    """One ``$ `` command of a console block and the output shown after it."""

    line: int
    text: str
    shown: list[str]


@dataclass(frozen=True)
class Block:
    """A fenced block: where it is (``page:line`` of its opening fence), its language,
    its body, and the directive before it (``kind`` ``run`` when there is none)."""

    page: str
    line: int
    language: str
    body: str
    kind: str = "run"
    arg: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} (```{self.language} block)"

    def commands(self) -> list[Command]:
        """The console block's commands, each with the output lines shown after it."""
        commands: list[Command] = []
        lines = self.body.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("$ "):
                start = i
                text = line[2:]
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1].rstrip() + " " + lines[i].strip()
                commands.append(Command(self.line + 1 + start, text, []))
            elif commands:
                commands[-1].shown.append(line)
            elif line.strip():
                raise DocBlockError(f"{self.where}: output before the first `$ ` command")
            i += 1
        if not commands:
            raise DocBlockError(f"{self.where}: a console block needs `$ ` commands")
        return commands


def read_blocks(path: Path, page: str) -> list[Block]:
    """Every fenced block of the page at ``path`` (``page``: its name in messages), with
    the directive on the line before it (blank lines between are allowed)."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    directive: tuple[str, str] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        found = DIRECTIVE.match(line.strip())
        if found:
            kind, arg = found["kind"], found["arg"]
            if kind in STEPS:
                blocks.append(Block(page, i + 1, "", "", kind, arg))
                i += 1
                continue
            if kind not in KINDS:
                raise DocBlockError(f"{page}:{i + 1}: unknown docs-test directive {kind!r}")
            if not arg and kind in {"skip", "fragment", "given", "file", "background"}:
                raise DocBlockError(f"{page}:{i + 1}: `docs-test: {kind}` needs its argument")
            directive = (kind, arg)
        elif line.startswith("```"):
            language = line[3:].strip()
            end = i + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            body = "\n".join(lines[i + 1 : end])
            kind, arg = directive or ("run", "")
            blocks.append(Block(page, i + 1, language, body, kind, arg))
            directive = None
            i = end
        elif line.strip() and directive is not None:
            raise DocBlockError(f"{page}:{i}: a docs-test directive must come right before a block")
        i += 1
    problems = [
        f"{block.where} is not run"
        for block in blocks
        if block.kind == "run" and block.language not in RUNNABLE
    ]
    if problems:
        raise DocBlockError(
            "\n".join(problems)
            + "\nmake each a ```console block (`$ ` commands and their output) or ```python, "
            "or mark it `<!-- docs-test: skip REASON -->` (docs/contributing.md, Docs that run)"
        )
    for block in blocks:
        if block.kind == "given" and block.language != "python":
            raise DocBlockError(f"{block.where}: `docs-test: given` goes before a ```python block")
        if block.kind == "background" and len(block.commands()) != 1:
            raise DocBlockError(f"{block.where}: a background block has one command")
        if block.language == "console" and block.kind != "skip":
            block.commands()  # its own errors, before anything runs
    return blocks


def python_script(block: Block) -> tuple[str, bool]:
    """The script a Python block runs as (a ``given`` block's line of Python first), and
    whether it has ``await`` at its top level, so runs as one coroutine in an event loop.

    :raises SyntaxError: the block does not compile, with or without top-level ``await``.
    """
    source = f"{block.arg}\n{block.body}" if block.kind == "given" else block.body
    try:
        compile(source, block.where, "exec")
    except SyntaxError:
        code = compile(source, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        return source, bool(code.co_flags & inspect.CO_COROUTINE)
    return source, False


@dataclass
class Ids:
    """The UUIDs a page showed, bound to the real ones: the first time a shown UUID is
    matched it binds; after that it must be the same, and commands naming it get it."""

    bound: dict[str, str] = field(default_factory=dict)

    def substitute(self, text: str) -> str:
        return UUID.sub(lambda m: self.bound.get(m[0], m[0]), text)


def _line_pattern(shown: str) -> tuple[re.Pattern[str], list[str]]:
    """The regex for one shown line and the shown UUIDs its groups capture, in order."""
    pieces: list[str] = []
    uuids: list[str] = []
    pos = 0
    token = re.compile(f"{UUID.pattern}|{ISO_TIME.pattern}|{ELLIPSIS.pattern}")
    for m in token.finditer(shown):
        pieces.append(re.escape(shown[pos : m.start()]))
        if UUID.fullmatch(m[0]):
            pieces.append(f"({UUID.pattern})")
            uuids.append(m[0])
        elif ISO_TIME.fullmatch(m[0]):
            pieces.append(ISO_TIME.pattern)
        else:
            pieces.append(".*?")
        pos = m.end()
    pieces.append(re.escape(shown[pos:]))
    return re.compile("".join(pieces)), uuids


EXIT = re.compile(r"\[exit (\d+)\]")


def expected_exit(shown: Sequence[str]) -> tuple[list[str], int]:
    """The shown output without its ``[exit N]`` line, and the exit status it shows
    (0 when it shows none)."""
    lines = _clean(shown)
    if lines and (found := EXIT.fullmatch(lines[-1].strip())):
        return lines[:-1], int(found[1])
    return lines, 0


def _is_gap(shown: str) -> bool:
    return ELLIPSIS.fullmatch(shown.strip()) is not None


def _clean(lines: Sequence[str]) -> list[str]:
    out = [line.rstrip() for line in lines]
    while out and not out[-1]:
        out.pop()
    while out and not out[0]:
        out.pop(0)
    return out


@dataclass(frozen=True)
class Mismatch:
    """Why a shown output does not match: the first shown line that could not be placed
    (``None``: the real output has lines the shown one does not)."""

    shown_line: int | None
    detail: str


def compare(
    shown: Sequence[str], actual: Sequence[str], ids: Ids, *, anywhere: bool = False
) -> Mismatch | None:
    """Whether the ``actual`` lines are what ``shown`` shows (``None``) or why not.

    Every shown line must match one actual line, in order; between them only a gap line
    (``…`` alone) lets actual lines go unshown, unless ``anywhere`` (a log: the shown
    lines are a few of many). A match binds the shown UUIDs in ``ids`` (only when the
    whole output matches)."""
    want = _clean(shown)
    got = _clean(actual)
    if anywhere:
        want = [w for w in want if not _is_gap(w)]
    patterns = [None if _is_gap(w) else _line_pattern(w) for w in want]
    best = [0]

    def match(i: int, j: int, bound: Mapping[str, str]) -> dict[str, str] | None:
        best[0] = max(best[0], i)
        if i == len(want):
            return dict(bound) if (anywhere or j == len(got)) else None
        pattern = patterns[i]
        if pattern is None:
            for k in range(j, len(got) + 1):
                result = match(i + 1, k, bound)
                if result is not None:
                    return result
            return None
        regex, uuids = pattern
        for k in range(j, len(got)) if anywhere else range(j, min(j + 1, len(got))):
            found = regex.fullmatch(got[k])
            if found is None:
                continue
            now = dict(bound)
            if all(
                now.setdefault(doc, real) == real
                for doc, real in zip(uuids, found.groups(), strict=True)
            ):
                result = match(i + 1, k + 1, now)
                if result is not None:
                    return result
        return None

    result = match(0, 0, ids.bound)
    if result is not None:
        ids.bound.update(result)
        return None
    if best[0] < len(want):
        return Mismatch(best[0], f"no real line matches shown line {want[best[0]]!r}")
    return Mismatch(None, "the real output has lines the block does not show")


def explain(where: str, what: str, shown: Sequence[str], actual: str, mismatch: Mismatch) -> str:
    """The failure message for a shown output that does not match."""
    return (
        f"{where}: the output of {what} is not what the page shows: {mismatch.detail}\n"
        "--- shown ---\n" + "\n".join(shown) + "\n--- real ---\n" + actual
    )
