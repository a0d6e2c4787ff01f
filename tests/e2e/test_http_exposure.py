"""The main's HTTP port as a stranger meets it, against a real ``broker-main`` over real
HTTP: a store of 3,000 queues and of names of a megabyte (written before names had a
bound) gives a ``/metrics`` and dashboard pages under 1 MiB that paginate; a request
naming another host (DNS rebinding) reads nothing; every answer carries the security
headers; a read token guards every read; and serving the dashboard off loopback never
lifts the main port's token requirement."""

from __future__ import annotations

import base64
import sqlite3
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.sql import SQLAlchemyAdapter
from broker.jobs import JobSpec
from broker.model.bounds import MAX_METRICS_BYTES, MAX_PAGE_BYTES, PAGE_ROWS
from tests.e2e.test_e2e import Cluster, free_port, sqlite_url

pytestmark = pytest.mark.slow

TOKEN = "exposure-main-token"
READ_TOKEN = "exposure-read-token"
SECRET = "the-secret-argument"
QUEUES = 3000
LONG = 1 << 20
"""A megabyte: the length of the names written straight into the store."""
LONG_JOBS = 10


async def _fill(tmp_path: Path) -> uuid.UUID:
    """A store of :data:`QUEUES` queues, a job with a secret and 4 MiB of arguments, and
    :data:`LONG_JOBS` jobs whose queue and task names are a megabyte each (written with
    SQL, as a store from before names had a bound holds them). All due in a year, so
    nothing runs; returns the secret job's id."""
    url = sqlite_url(tmp_path)
    store = SQLAlchemyAdapter(url)
    await store.setup()
    later = datetime.now(UTC) + timedelta(days=365)
    try:
        await store.enqueue_many(
            [JobSpec(task="t", queue=f"q{n:05d}", run_at=later) for n in range(QUEUES)]
            + [JobSpec(task="t", queue=f"long{n}", run_at=later) for n in range(LONG_JOBS)]
        )
        [secret] = await store.enqueue_many(
            [JobSpec(task="t", queue="q00000", args=[SECRET, "x" * (4 << 20)], run_at=later)]
        )
    finally:
        await store.close()
    with sqlite3.connect(tmp_path / "broker.db") as db:
        for n in range(LONG_JOBS):
            db.execute(
                "UPDATE broker_jobs SET queue = ?, task = ? WHERE queue = ?",
                (f"long{n}" + '"' * LONG, "t" * LONG + str(n), f"long{n}"),
            )
    return secret.job.id


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path, sqlite_url(tmp_path), token=TOKEN)
    try:
        yield cluster
    finally:
        await cluster.close()


async def _get(
    port: int, path: str, headers: dict[str, str] | None = None
) -> tuple[int, bytes, dict[str, str]]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}{path}", headers=headers or {}) as response,
    ):
        return response.status, await response.read(), dict(response.headers)


async def test_metrics_and_pages_stay_small_and_paginate(cluster: Cluster, tmp_path: Path) -> None:
    secret = await _fill(tmp_path)
    http = free_port()
    await cluster.start_main("--http-port", str(http))

    status, body, _ = await _get(http, "/metrics")
    assert status == 200
    # The review's scrape took 16.5 s building a page of every queue; its cost is now
    # bounded by what it may hold (its time is a bench's business, not this test's).
    assert len(body) < MAX_METRICS_BYTES, len(body)
    samples = [
        sample
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name == "broker_queue_jobs"
    ]
    queues = {sample.labels["queue"] for sample in samples}
    assert "_other" in queues and len(queues) <= 101
    total = sum(sample.value for sample in samples)
    assert total == QUEUES + LONG_JOBS + 1  # every job counted, named or under _other

    status, body, _ = await _get(http, "/")
    assert status == 200 and len(body) < MAX_PAGE_BYTES, len(body)
    page = body.decode()
    assert page.count("<tr>") == PAGE_ROWS + 1  # the header and a page of queues
    assert 'id="next"' in page and f"of {QUEUES + LONG_JOBS}." in page
    assert '<td class="line">long0&quot;&quot;' in page  # a long name, cut, and with no link
    status, body, _ = await _get(http, "/?page=2")
    assert status == 200 and "Rows 101 to 200" in body.decode() and 'id="previous"' in body.decode()
    last = (QUEUES + LONG_JOBS + PAGE_ROWS - 1) // PAGE_ROWS
    status, body, _ = await _get(http, f"/?page={last}")
    assert status == 200 and len(body) < MAX_PAGE_BYTES
    assert f"q{QUEUES - 1:05d}" in body.decode() and 'id="next"' not in body.decode()

    status, body, _ = await _get(http, "/jobs?limit=100&status=queued")
    assert status == 200 and len(body) < MAX_PAGE_BYTES, len(body)
    assert 'id="next"' in body.decode()  # the rest, a page (at most 100 rows) at a time

    status, body, _ = await _get(http, f"/jobs/{secret}")
    assert status == 200 and len(body) < MAX_PAGE_BYTES, len(body)
    assert SECRET in body.decode() and "Cut at 64 KiB" in body.decode()

    with sqlite3.connect(tmp_path / "broker.db") as db:
        [(long_id,)] = db.execute("SELECT id FROM broker_jobs WHERE task = ?", ("t" * LONG + "0",))
    status, body, _ = await _get(http, f"/jobs/{uuid.UUID(hex=str(long_id))}")
    assert status == 200 and len(body) < 64 << 10, len(body)


async def test_another_host_is_refused_and_every_answer_carries_the_headers(
    cluster: Cluster, tmp_path: Path
) -> None:
    secret = await _fill_small(tmp_path)
    http = free_port()
    await cluster.start_main("--http-port", str(http), "--http-allowed-hosts", "broker.internal")
    for path in (f"/jobs/{secret}", "/", "/metrics", "/jobs"):
        status, body, _ = await _get(http, path, {"Host": f"attacker.example:{http}"})
        assert status == 421, path
        assert SECRET.encode() not in body
    status, body, headers = await _get(http, f"/jobs/{secret}", {"Host": f"broker.internal:{http}"})
    assert status == 200 and SECRET.encode() in body
    for host in (f"localhost:{http}", f"[::1]:{http}", "127.0.0.1"):
        status, _, _ = await _get(http, "/", {"Host": host})
        assert status == 200, host
    status, _, _ = await _get(http, "/healthz", {"Host": "anything.example"})
    assert status == 200

    csp = headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp
    assert "unsafe-inline" not in csp
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Referrer-Policy"] == "no-referrer"
    assert headers["Cache-Control"] == "no-store"
    assert headers["X-Frame-Options"] == "DENY"
    _, _, refused = await _get(http, "/", {"Host": "attacker.example"})
    assert refused["Cache-Control"] == "no-store" and "Content-Security-Policy" in refused


async def _fill_small(tmp_path: Path) -> uuid.UUID:
    store = SQLAlchemyAdapter(sqlite_url(tmp_path))
    await store.setup()
    try:
        later = datetime.now(UTC) + timedelta(days=365)
        [result] = await store.enqueue_many([JobSpec(task="t", args=[SECRET], run_at=later)])
    finally:
        await store.close()
    return result.job.id


async def test_with_a_read_token_every_read_needs_it(cluster: Cluster, tmp_path: Path) -> None:
    secret = await _fill_small(tmp_path)
    http = free_port()
    await cluster.start_main(
        "--http-port", str(http), "--http-host", "0.0.0.0", "--http-read-token", READ_TOKEN
    )
    for path in (f"/jobs/{secret}", "/", "/metrics", "/workers"):
        status, body, headers = await _get(http, path)
        assert status == 401, path
        assert SECRET.encode() not in body
        assert headers["WWW-Authenticate"].startswith("Basic")
        status, _, _ = await _get(http, path, {"Authorization": "Bearer wrong"})
        assert status == 401, path
    basic = "Basic " + base64.b64encode(f"anyone:{READ_TOKEN}".encode()).decode()
    for credential in (f"Bearer {READ_TOKEN}", basic, f"Bearer {TOKEN}"):
        status, body, _ = await _get(http, f"/jobs/{secret}", {"Authorization": credential})
        assert status == 200 and SECRET.encode() in body, credential
    status, _, _ = await _get(http, "/healthz")
    assert status == 200


async def test_the_dashboard_off_loopback_never_lifts_the_main_ports_token(
    cluster: Cluster,
) -> None:
    (cluster.dir / "bare").mkdir()
    bare = Cluster(cluster.dir / "bare", cluster.url)
    http = str(free_port())
    try:
        # The dashboard's own opt-out, and no token: the main's port still needs one.
        main = await bare.spawn(
            "main-open",
            *("main", "--database-url", bare.url, "--port", str(bare.port), "--host", "0.0.0.0"),
            *("--http-host", "0.0.0.0", "--http-port", http, "--http-allow-unauthenticated"),
        )
        assert await main.exit_code() != 0
        assert "refusing to listen on '0.0.0.0'" in main.output(), main.output()
        # The main port's opt-out is not the dashboard's.
        main = await bare.spawn(
            "main-http",
            *("main", "--database-url", bare.url, "--port", str(bare.port)),
            *("--allow-unauthenticated", "--http-host", "0.0.0.0", "--http-port", http),
        )
        assert await main.exit_code() != 0
        assert "--http-allow-unauthenticated" in main.output(), main.output()
    finally:
        await bare.close()
    # With a token on the main's port, the dashboard may be served off loopback openly.
    await cluster.start_main(
        *("--host", "0.0.0.0", "--http-host", "0.0.0.0", "--http-port", http),
        "--http-allow-unauthenticated",
    )
    status, _, _ = await _get(int(http), "/")
    assert status == 200
    async with cluster.client() as client:
        assert (await client.status())["main_id"]


@pytest.mark.parametrize("path", ["/?page=0", "/workers?page=x"])
async def test_a_bad_page_is_a_clear_400(cluster: Cluster, path: str) -> None:
    http = free_port()
    await cluster.start_main("--http-port", str(http))
    status, body, _ = await _get(http, path)
    assert status == 400 and b'id="error-notice">bad page' in body  # in the page,
    assert b'<a id="back" href="/">Back</a>' in body  # with a way back
