"""The operator CLI as a user meets it: a --main that names another service, usage
errors (exit 2), short id prefixes, ``prune --dry-run``, durations, the runs column,
a multi-line error, times with their zone."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta

import pytest

from adapters.memory import MemoryAdapter
from broker.jobs import Claim, JobSpec
from broker.main.main import Main
from broker.ops import cli
from broker.wire import framing as wire
from tests.conftest import POSTGRES_URL, require_postgres
from tests.support import running_main


def _run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.broker_entry(list(argv))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


async def _cli(*argv: str) -> tuple[int, str, str]:
    return await asyncio.to_thread(_run_cli, argv)


@contextlib.asynccontextmanager
async def _main() -> AsyncIterator[tuple[MemoryAdapter, Main, tuple[str, str]]]:
    store = MemoryAdapter()
    async with running_main(store) as main:
        yield store, main, ("--main", f"127.0.0.1:{main.port}")


async def _finish(store: MemoryAdapter, spec: JobSpec, *, error: str | None = None) -> uuid.UUID:
    [result] = await store.enqueue_many([spec])
    lease = uuid.uuid4()
    await store.mark_handed_off_many([Claim(result.job.id, lease, "w-1")])
    if error is None:
        assert await store.complete(result.job.id, lease, "ok")
    else:
        assert await store.fail(result.job.id, lease, error, None)
    return result.job.id


# ------------------------------------------------------------------------ not a main


@contextlib.asynccontextmanager
async def _service(greeting: bytes) -> AsyncIterator[int]:
    """A server that sends ``greeting`` (nothing: it waits for the client to speak, as
    PostgreSQL and Redis do) and holds the connection until the client leaves."""
    handlers: list[asyncio.Task[None]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        writer.write(greeting)
        with contextlib.suppress(OSError):
            await writer.drain()
            await reader.read()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()
        await asyncio.gather(*handlers, return_exceptions=True)


SHORT_GREETING = 0.25
"""The greeting wait of the tests below, which outwait it (the default is 2 s): a silent
peer is judged the same way whatever the wait, and the message names the wait used."""


@pytest.fixture
def short_greeting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI runs in this process: it reads ``wire.GREETING_TIMEOUT`` when it connects."""
    monkeypatch.setattr(wire, "GREETING_TIMEOUT", SHORT_GREETING)


@pytest.mark.usefixtures("short_greeting")
async def test_a_silent_service_is_not_a_main() -> None:
    async with _service(b"") as port:
        code, out, err = await _cli("--main", f"127.0.0.1:{port}", "--timeout", "60", "status")
    assert code == 1 and out == ""
    assert f"sent no broker greeting within {SHORT_GREETING:g} s: this is not a broker main" in err
    assert "cannot reach" not in err


@pytest.mark.postgres
@pytest.mark.usefixtures("short_greeting")
async def test_postgresql_is_not_a_main() -> None:
    require_postgres()
    port = int(re.search(r":(\d+)/", POSTGRES_URL).group(1))  # type: ignore[union-attr]
    code, _, err = await _cli("--main", f"127.0.0.1:{port}", "--timeout", "60", "status")
    assert code == 1 and "this is not a broker main" in err


@pytest.mark.usefixtures("short_greeting")
async def test_redis_is_not_a_main() -> None:
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 6379)) != 0:
            pytest.skip("no Redis on 127.0.0.1:6379")
    code, _, err = await _cli("--main", "127.0.0.1:6379", "--timeout", "60", "jobs")
    assert code == 1 and "this is not a broker main" in err


async def test_a_service_that_speaks_first_in_another_protocol_is_not_a_main() -> None:
    async with _service(b"SSH-2.0-OpenSSH_9.2\r\n") as port:
        code, _, err = await _cli("--main", f"127.0.0.1:{port}", "status")
    assert code == 1 and "is not the broker protocol: this is not a broker main" in err


# ------------------------------------------------------------------------ usage errors


@pytest.mark.parametrize(
    "argv",
    [
        ("enqueue", "app.x", "{not json"),
        ("enqueue", "app.x", "{}"),
        ("enqueue", "app.x", "--kwargs", "[]"),
        ("enqueue", "app.x", "--priority", str(2**40)),
        ("enqueue", "app.x", "--queue", ""),
        ("enqueue", "app.x", "--delay", "soon"),
        ("prune", "--older-than", "7 weeks"),
        ("job", "xyz"),
    ],
    ids=lambda a: " ".join(a),
)
async def test_usage_errors_exit_2_before_connecting(argv: tuple[str, ...]) -> None:
    # No main listens on port 9 (discard): a usage error must be found before connecting.
    code, out, err = await _cli("--main", "127.0.0.1:9", *argv)
    assert code == 2, err
    assert out == "" and "usage: broker" in err and "cannot reach" not in err


# ------------------------------------------------------------------------ id prefixes


async def test_a_job_is_found_by_a_prefix_of_its_id() -> None:
    async with _main() as (store, _, main_opt):
        [made] = await store.enqueue_many([JobSpec(task="app.x")])
        code, out, err = await _cli(*main_opt, "job", str(made.job.id)[:8], "--json")
        assert code == 0, err
        assert json.loads(out)["id"] == str(made.job.id)
        code, out, _ = await _cli(*main_opt, "cancel", str(made.job.id)[:6], "--json")
        assert code == 0 and json.loads(out)["status"] == "cancelled"


async def test_an_ambiguous_prefix_lists_the_matches() -> None:
    ids = [
        uuid.UUID("abcd1234-0000-4000-8000-000000000001"),
        uuid.UUID(f"abcd5678-{'0' * 4}-4000-8000-{'0' * 12}"),
    ]
    async with _main() as (store, _, main_opt):
        await store.enqueue_many([JobSpec(task="app.x", id=i) for i in ids])
        code, out, err = await _cli(*main_opt, "job", "abcd")
        assert code == 1 and out == ""
        assert "matches 2 jobs" in err and all(str(i) in err for i in ids)
        code, _, err = await _cli(*main_opt, "job", "abcd5")
        assert code == 0, err
        code, _, err = await _cli(*main_opt, "job", "ffff")
        assert code == 1 and "no such job" in err


# ------------------------------------------------------------ prune --dry-run, durations


async def test_prune_dry_run_counts_and_deletes_nothing() -> None:
    async with _main() as (store, _, main_opt):
        for _ in range(3):
            await _finish(store, JobSpec(task="app.x"))
        await store.enqueue_many([JobSpec(task="app.x")])  # queued: never pruned
        code, out, err = await _cli(*main_opt, "prune", "--keep-latest", "1", "--dry-run", "--json")
        assert code == 0, err
        assert json.loads(out) == {"dry_run": True, "would_delete": 2}
        code, out, _ = await _cli(*main_opt, "prune", "--older-than", "7d", "--dry-run")
        assert code == 0 and out.strip() == "would delete 0 jobs (dry run: nothing deleted)"
        assert len((await store.list_jobs(limit=10)).jobs) == 4
        code, out, _ = await _cli(*main_opt, "prune", "--keep-latest", "1", "--json")
        assert json.loads(out) == {"deleted": 2}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90.0),
        ("30s", 30.0),
        ("15m", 900.0),
        ("12h", 43200.0),
        ("7d", 604800.0),
        ("1.5h", 5400.0),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    args = cli.parse(cli.broker_parser(), ["prune", "--older-than", text])
    assert args.older_than == seconds


async def test_a_delay_takes_a_duration() -> None:
    async with _main() as (store, _, main_opt):
        before = datetime.now(UTC)
        code, out, err = await _cli(*main_opt, "enqueue", "app.x", "--delay", "15m")
        assert code == 0, err
        job = await store.get_job(uuid.UUID(out.strip()))
        assert job is not None
        assert job.run_at - before >= timedelta(minutes=15) - timedelta(seconds=1)


# ------------------------------------------------------------------------ what the tables show


async def test_runs_times_and_multi_line_errors_read_right() -> None:
    async with _main() as (store, _, main_opt):
        done = await _finish(store, JobSpec(task="app.ok"))
        dead = await _finish(
            store,
            JobSpec(task="app.bad", max_attempts=1),
            error='Traceback (most recent call last):\n  File "x.py", line 1\nValueError: no',
        )
        code, out, _ = await _cli(*main_opt, "jobs")
        assert code == 0
        rows = {line.split()[0]: line for line in out.splitlines()[1:]}
        assert " 1/11 " in rows[str(done)], "a completed job ran once: not 0/11"
        assert " 1/1 " in rows[str(dead)]
        assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", rows[str(done)])

        code, out, _ = await _cli(*main_opt, "job", str(dead))
        lines = out.splitlines()
        [at] = [i for i, line in enumerate(lines) if line.startswith("last_error ")]
        width = lines[at].index("Traceback")
        assert lines[at + 1] == " " * width + '  File "x.py", line 1'
        assert lines[at + 2] == " " * width + "ValueError: no"
        assert any(re.fullmatch(r"updated_at\s+\S+ \S+ UTC", line) for line in lines)
        assert any(re.fullmatch(r"runs\s+1 of at most 1", line) for line in lines)
