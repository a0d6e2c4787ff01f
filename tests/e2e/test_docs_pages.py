"""Every block of the tutorial and the how-tos runs, and shows what it really prints.

Each page runs in a directory of its own (``tmp_path``), with the checkout's ``broker``,
``broker-main``, ``broker-worker`` and ``python`` first on ``PATH``. Its blocks run in
order, as a reader would (see :mod:`tests.doc_blocks` and docs/contributing.md, "Docs
that run"): console commands through ``bash``, Python blocks as scripts, background
commands (a main, a worker) kept running until the page ends, then stopped with SIGTERM.
The page's port is a free one: ``7390`` in a block (and ``BROKER_PORT``,
``BROKER_MAIN``) becomes it, so pages run side by side with other tests.

A read command (``broker job``, ``jobs``, ``status``, ``tasks``) whose output does not
match yet runs again, for a while: the page shows a job once it settled, and a reader
is slower than the worker. Nothing else is retried.
"""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NoReturn

import pytest

from tests.doc_blocks import (
    Block,
    DocBlockError,
    Ids,
    Mismatch,
    compare,
    expected_exit,
    explain,
    python_script,
    read_blocks,
)
from tests.e2e.test_e2e import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "docs" / "tutorial.md", *(REPO / "docs" / "howto").glob("*.md")])
DOC_PORT = "7390"
SETTLE = 15.0
"""Seconds a read command is retried, or a background process's text or log awaited."""
COMMAND_TIMEOUT = 60.0
READS = {
    ("broker", "job"),
    ("broker", "jobs"),
    ("broker", "status"),
    ("broker", "tasks"),
    ("broker", "workflow"),
}


@dataclass
class Page:
    """A page being run: its directory, environment, ids and background processes."""

    dir: Path
    port: str
    env: dict[str, str]
    ids: Ids = field(default_factory=Ids)
    background: list[tuple[Block, subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def text(self, text: str) -> str:
        return self.ids.substitute(text.replace(DOC_PORT, self.port))

    def run(self, command: str) -> tuple[str, int]:
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=self.dir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
        return done.stdout.decode(errors="replace"), done.returncode

    def logs(self) -> str:
        return "\n".join(log.read_text(errors="replace") for _, _, log in self.background)


def _env(tmp: Path, port: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{tmp}{os.pathsep}{REPO}"
    env["PYTHONUNBUFFERED"] = "1"
    env["BROKER_PORT"] = port
    env["BROKER_MAIN"] = f"127.0.0.1:{port}"
    env["HOME"] = str(tmp)
    return env


@contextlib.contextmanager
def _page(tmp: Path) -> Iterator[Page]:
    port = str(free_port())
    page = Page(tmp, port, _env(tmp, port))
    try:
        yield page
    finally:
        for _, process, _ in reversed(page.background):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _fail(message: str) -> NoReturn:
    """Fail with ``message`` alone: it names the page, the line and both outputs, and a
    traceback through the runner would only bury it."""
    pytest.fail(message, pytrace=False)


def _further(a: Mismatch, b: Mismatch) -> bool:
    """Whether mismatch ``a`` got further down the shown lines than ``b``: of the tries of
    a read command, the closest is the one worth showing."""
    return (a.shown_line is None) > (b.shown_line is None) or (a.shown_line or 0) > (
        b.shown_line or 0
    )


def _console(page: Page, block: Block) -> None:
    for command in block.commands():
        text = page.text(command.text)
        shown = [page.text(line) for line in command.shown]
        where = f"{block.page}:{command.line}"
        words = tuple(text.split()[:2])
        reads = words in READS and text.split()[2:3] != ["retry"]  # workflow retry writes
        deadline = time.monotonic() + (SETTLE if reads else 0.0)
        closest: tuple[Mismatch, str] | None = None
        shown, exit_status = expected_exit(shown)
        while True:
            actual, status = page.run(text)
            if status != exit_status:
                mismatch = Mismatch(None, f"it exited {status}, the page shows {exit_status}")
            else:
                mismatch = compare(shown, actual.splitlines(), page.ids)
            if mismatch is None:
                break
            if closest is None or _further(mismatch, closest[0]):
                closest = (mismatch, actual)
            if time.monotonic() > deadline:
                _fail(explain(where, f"`{command.text}`", shown, closest[1], closest[0]))
            time.sleep(0.2)


def _background(page: Page, block: Block) -> None:
    [command] = block.commands()
    log = page.dir / f"background-{block.line}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", f"exec {page.text(command.text)}"],
            cwd=page.dir,
            env=page.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    page.background.append((block, process, log))
    wanted = page.text(block.arg)
    deadline = time.monotonic() + SETTLE
    while wanted not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            state = "exited" if process.poll() is not None else "is still waiting"
            _fail(
                f"{block.page}:{command.line}: `{command.text}` {state} before printing "
                f"{block.arg!r}\n--- its output ---\n{log.read_text(errors='replace')}"
            )
        time.sleep(0.05)
    if command.shown:
        _log(page, block, command.shown)


STEP_COMMANDS = {
    "main": ("broker-main --database-url sqlite+aiosqlite:///./broker.db", "listening on"),
    "worker": (
        "broker-worker --app {arg} --worker-id docs-worker --pooled-runner-count 1",
        "connected to main",
    ),
}
"""What ``docs-test: main`` and ``docs-test: worker APP`` start, and the line they wait for
(the main's port and the worker's main come from the page's environment)."""


def _step(page: Page, block: Block) -> None:
    command, wanted = STEP_COMMANDS[block.kind]
    step = Block(block.page, block.line, "console", f"$ {command.format(arg=block.arg)}")
    _background(page, replace(step, kind="background", arg=wanted))


def _log(page: Page, block: Block, lines: list[str]) -> None:
    shown = [page.text(line) for line in lines]
    deadline = time.monotonic() + SETTLE
    while (
        mismatch := compare(shown, page.logs().splitlines(), page.ids, anywhere=True)
    ) is not None:
        if time.monotonic() > deadline:
            what = "the page's background commands"
            _fail(explain(block.where, what, shown, page.logs(), mismatch))
        time.sleep(0.1)


def _stop(page: Page, block: Block) -> None:
    running = [(b, p) for b, p, _ in page.background if p.poll() is None]
    if not running:
        _fail(f"{block.where}: `docs-test: stop` with no background command running")
    started, process = running[-1]
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        _fail(f"{block.where}: {started.where} still running 30 s after Ctrl-C")
    _log(page, block, block.body.splitlines())


def _compile(block: Block) -> None:
    try:
        compile(block.body, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        _fail(f"{block.where}: the Python fragment does not compile: {exc}")


AWAIT_RUNNER = (
    "import ast, asyncio, sys; path = sys.argv[1]; "
    "code = compile(open(path).read(), path, 'exec', flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT); "
    "asyncio.run(eval(code, {'__name__': '__main__', '__file__': path}))"
)
"""How a block with ``await`` at its top level runs: as one coroutine in an event loop,
the way ``python -m asyncio`` runs what is typed at its prompt."""


def _python(page: Page, block: Block) -> None:
    try:
        source, awaits = python_script(block)
    except SyntaxError as exc:
        _fail(f"{block.where}: the Python block does not compile: {exc}")
    script = page.dir / f"block_{block.line}.py"
    script.write_text(page.text(source) + "\n")
    if awaits:
        output, status = page.run(f'python -c "{AWAIT_RUNNER}" {script.name}')
    else:
        output, status = page.run(f"python {script.name}")
    if status != 0:
        _fail(f"{block.where}: the Python block failed\n--- its output ---\n{output}")


def run_page(path: Path, tmp: Path) -> None:
    """Run every block of the page at ``path`` in ``tmp``, failing at the first that does
    not do what the page says."""
    try:
        blocks = read_blocks(path, str(path.relative_to(REPO)))
    except DocBlockError as exc:
        _fail(str(exc))
    with _page(tmp) as page:
        for block in blocks:
            if block.kind == "skip":
                continue
            if block.kind == "fragment":
                _compile(block)
                continue
            if block.kind == "file":
                target = page.dir / block.arg
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(page.text(block.body) + "\n")
            elif block.kind == "background":
                _background(page, block)
            elif block.kind in {"main", "worker"}:
                _step(page, block)
            elif block.kind == "stop":
                _stop(page, block)
            elif block.kind == "log":
                _log(page, block, block.body.splitlines())
            elif block.language == "console":
                _console(page, block)
            else:
                _python(page, block)


SOAK_PAGES = frozenset(
    {"enqueue.md", "scheduled-jobs.md", "transactional-enqueue.md", "unique-jobs.md"}
)
"""Pages left to ``make test-slow`` (and so to ``.ci/run``): each starts a main of its
own (and a worker) for a few enqueues and reads that the tutorial's sections 5 to 9
also check, and costs 9 to 14 s on a loaded 2-core machine; ``make test`` runs the
others."""


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, id=p.name, marks=[pytest.mark.soak] if p.name in SOAK_PAGES else [])
        for p in PAGES
    ],
)
def test_every_block_of_the_page_runs_as_shown(path: Path, tmp_path: Path) -> None:
    run_page(path, tmp_path)
