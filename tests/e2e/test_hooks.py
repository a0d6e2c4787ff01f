"""Worker hooks with real processes: a main and a worker on a SQLite file, the worker's
pooled and forked children, and ``tests.hooks_app`` declaring a start-up hook, a shutdown
hook and two around-job middlewares (see ``docs/howto/hooks.md``).

The hooks are the workers' and their children's: the module's tests share one main
(:class:`~tests.e2e.test_e2e.SharedMain`), each with its own workers, which serve only
the test's own queue (a job one test leaves queued never reaches another's worker)."""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from broker.client.client import Client
from tests.app_env import EVENTS_ENV, FAIL_ENV, HANG_ENV, SLOW_ENV
from tests.e2e.test_e2e import Cluster, Proc, SharedMain, sqlite_url

pytestmark = pytest.mark.slow

APP = "tests.hooks_app"
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
ONE_CHILD = ("--pooled-runner-count", "1", "--forked-concurrency", "1")


@pytest.fixture(scope="module")
def shared_main(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedMain]:
    directory = tmp_path_factory.mktemp("hooks-main")
    main = SharedMain(directory, sqlite_url(directory))
    try:
        yield main
    finally:
        main.close()


@pytest.fixture
async def cluster(tmp_path: Path, shared_main: SharedMain) -> AsyncIterator[Cluster]:
    """This test's workers (killed after it) on the module's main."""
    cluster = Cluster(tmp_path, sqlite_url(tmp_path), main=shared_main)
    try:
        yield cluster
    finally:
        await cluster.close()


def queue(cluster: Cluster) -> str:
    """The test's own queue (its directory's name is unique in the session)."""
    return cluster.dir.name


def events(path: Path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    return [(e, int(pid)) for e, pid in (line.split() for line in path.read_text().splitlines())]


def start(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where this test's workers and children record their hooks' events."""
    path = cluster.dir / "hook-events"
    monkeypatch.setenv(EVENTS_ENV, str(path))
    return path


async def worker(cluster: Cluster, *extra: str, inline: int = 2) -> Proc:
    argv = ("--app", APP, "--queues", queue(cluster), *ONE_CHILD, *extra)
    return await cluster.start_worker(f"hooks-{queue(cluster)}", *argv, concurrency=inline)


async def run(client: Client, cluster: Cluster, name: str, **options: object) -> dict[str, object]:
    enqueued = await client.enqueue(f"{APP}.{name}", queue=queue(cluster), **options)  # type: ignore[arg-type]
    return await client.wait(enqueued.job_id, timeout=60)


async def test_start_up_state_and_middleware_reach_jobs_in_every_mode_and_shutdown_runs(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = start(cluster, monkeypatch)
    w = await worker(cluster)
    async with cluster.client() as client:
        results = {}
        for mode in ("inline", "pooled", "forked"):
            for name in (f"seen_{mode}", f"seen_{mode}_sync"):
                job = await run(client, cluster, name)
                assert job["status"] == "completed", job["last_error"]
                results[name] = job
    for name, job in results.items():
        seen = job["result"]
        assert isinstance(seen, dict), seen
        # The start-up hook ran in the very process that ran the job, before it.
        assert seen["resource"] == seen["pid"], (name, seen)
        assert ("startup", seen["pid"]) in events(path), name
        # The middleware's before set a contextvar in the job's own context.
        assert seen["request"] == f"request-{job['id']}", (name, seen)
        assert seen["job"] == job["id"]
    pids = {name: job["result"]["pid"] for name, job in results.items()}  # type: ignore[index]
    assert pids["seen_inline"] == pids["seen_inline_sync"] == w.pid, "inline: the worker"
    assert pids["seen_pooled"] == pids["seen_pooled_sync"] != w.pid, "one warm child"
    assert len({pids["seen_forked"], pids["seen_forked_sync"], w.pid}) == 3, "a child each"
    after = Counter(e for e, _ in events(path) if e.startswith("after:"))
    assert after == Counter({f"after:{name}": 1 for name in results}), "each job once"

    pooled_child = pids["seen_pooled"]
    assert await w.terminate() == 0
    shutdowns = {pid for e, pid in events(path) if e == "shutdown"}
    # Forked children end after their job, the pooled one when the worker stops, the
    # worker itself (its inline jobs' hooks) at its exit: each ran its shutdown hook.
    assert shutdowns == {w.pid, pooled_child, pids["seen_forked"], pids["seen_forked_sync"]}
    startups = Counter(pid for e, pid in events(path) if e == "startup")
    assert all(n == 1 for n in startups.values()), "once per process"


async def test_a_start_up_hook_longer_than_a_forked_jobs_timeout_is_not_charged_to_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    start(cluster, monkeypatch)
    monkeypatch.setenv(SLOW_ENV, "1.5")
    await worker(cluster, "--pooled-runner-count", "0", inline=0)
    async with cluster.client() as client:
        job = await run(client, cluster, "seen_forked", timeout=1.0, max_attempts=1)
    assert job["status"] == "completed", job["last_error"]


async def test_a_shutdown_hook_that_hangs_is_cut_off_after_the_kill_grace(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = start(cluster, monkeypatch)
    monkeypatch.setenv(HANG_ENV, "1")
    extra = ("--pooled-runner-count", "0", "--kill-grace", "0.5")
    await worker(cluster, *extra, inline=0)
    async with cluster.client() as client:
        first = await run(client, cluster, "seen_forked")
        # One forked slot: the second job runs only once the first child is gone.
        second = await run(client, cluster, "seen_forked")
    assert first["status"] == second["status"] == "completed", (first, second)
    first_child = first["result"]["pid"]  # type: ignore[index]
    assert ("shutdown", first_child) in events(path), "its shutdown hook did start"


async def test_a_raising_start_up_hook_keeps_children_out_of_service_and_says_which(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = start(cluster, monkeypatch)
    monkeypatch.setenv(FAIL_ENV, "1")
    # No prefetch: a job the worker cannot run now stays with the main, visibly queued.
    w = await worker(cluster, "--forked-concurrency", "0", "--prefetch", "0", inline=0)
    failure = (
        "start-up hook tests.hooks_app.open_resource raised RuntimeError: the resource is down"
    )
    await w.wait_for_output("runner process failed to start; slots revoked", count=2)
    assert failure in w.output()
    async with cluster.client() as client:
        enqueued = await client.enqueue(f"{APP}.seen_pooled", queue=queue(cluster))
        # Two more failed starts after the enqueue: the pool had no slot to offer meanwhile.
        await w.wait_for_output("runner process failed to start; slots revoked", count=4)
        job = await client.get_job(enqueued.job_id)
    assert job is not None and job["status"] == "queued", job
    assert events(path) == [], "no start-up completed, so no job and no shutdown hook ran"


async def test_a_raising_start_up_hook_stops_a_worker_serving_inline_jobs(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    start(cluster, monkeypatch)
    monkeypatch.setenv(FAIL_ENV, "1")
    argv = [
        "worker",
        "--main",
        f"127.0.0.1:{cluster.port}",
        "--app",
        APP,
        "--queues",
        queue(cluster),
    ]
    argv += ONE_CHILD
    w = await cluster.spawn("failing-worker", *argv)
    assert await w.exit_code() == 1
    assert "start-up hook tests.hooks_app.open_resource raised RuntimeError" in w.output()


async def test_a_raising_around_job_hook_fails_the_job_naming_the_hook(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = start(cluster, monkeypatch)
    await worker(cluster)
    async with cluster.client() as client:
        job = await run(client, cluster, "refused")
    assert job["status"] == "failed", job
    error = str(job["last_error"])
    assert error.startswith("PermissionError: this middleware refuses the job"), error
    assert "(raised by around-job hook tests.hooks_app.Tagging.before)" in error
    # Judged as the task's own exception would be: its retry policy excludes it.
    assert job["attempts"] == 1 and job["max_attempts"] == 4, job
    assert "not retried: the task's retry policy excludes PermissionError" in error
    assert [e for e, _ in events(path) if e.startswith(("after:", "failure:"))] == [], (
        "a middleware whose before raised is not entered: no after, no on_failure"
    )


async def test_the_docs_sqlalchemy_example_commits_each_jobs_session_or_rolls_it_back(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    app_db = cluster.dir / "app.db"
    monkeypatch.setenv("APP_DATABASE_URL", f"sqlite:///{app_db}")
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))
    argv = ("--app", "sqlalchemy_session", "--queues", queue(cluster), *ONE_CHILD)
    await cluster.start_worker(f"sqla-{queue(cluster)}", *argv)
    name = "sqlalchemy_session.record_visit"
    async with cluster.client() as client:
        outcomes = []
        for page, fail in (("home", False), ("oops", True), ("about", False)):
            enqueued = await client.enqueue(
                name, [page], {"fail": fail}, max_attempts=1, queue=queue(cluster)
            )
            outcomes.append(await client.wait(enqueued.job_id, timeout=60))
    home, oops, about = outcomes
    assert home["status"] == "completed" and home["result"] == 1, home["last_error"]
    assert oops["status"] == "failed" and "ValueError" in str(oops["last_error"])
    assert about["status"] == "completed" and about["result"] == 2, "the failed one rolled back"
    with sqlite3.connect(app_db) as conn:
        pages = [page for (page,) in conn.execute("SELECT page FROM visits ORDER BY id")]
    assert pages == ["home", "about"]
