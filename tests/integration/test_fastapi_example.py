"""The FastAPI example of docs/howto/transactional-enqueue.md (``docs/examples/fastapi_app.py``),
served over httpx's ASGI transport on a SQLite file that is also the broker's store: an
order placed leaves its job, and a request that fails after the enqueue leaves none."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import sqlalchemy as sa

from adapters.sql import SQLAlchemyAdapter

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "fastapi_app.py"


def _load_example(monkeypatch: pytest.MonkeyPatch, url: str) -> ModuleType:
    monkeypatch.setenv("DATABASE_URL", url)
    spec = importlib.util.spec_from_file_location("fastapi_app", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fastapi_app", module)
    spec.loader.exec_module(module)
    return module


async def test_an_order_commits_with_its_job_and_a_failed_request_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'shop.db'}"
    store = SQLAlchemyAdapter(url)
    await store.setup()  # what broker-main does on its first start
    example = _load_example(monkeypatch, url)
    engine = example.app.state.engine
    try:
        async with engine.begin() as conn:
            await conn.run_sync(example.Base.metadata.create_all)
        transport = httpx.ASGITransport(app=example.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
            placed = await client.post("/orders", json={"number": 7, "address": "1 Main St"})
            assert placed.status_code == 201, placed.text
            again = await client.post("/orders", json={"number": 7, "address": "elsewhere"})
            assert again.status_code == 409, again.text
            other = await client.post("/orders", json={"number": 8, "address": "2 Main St"})
            assert other.status_code == 201, other.text
        page = await store.list_jobs(limit=10)
        # Newest first. The 409 request's job was inserted, then rolled back with its order.
        assert [(job.task, job.args) for job in page.jobs] == [
            ("shop.tasks.ship", (8,)),
            ("shop.tasks.ship", (7,)),
        ]
        assert str(page.jobs[1].id) == placed.json()["job_id"]
        async with engine.connect() as conn:
            orders = await conn.execute(sa.text("SELECT number, address FROM orders"))
            assert sorted(tuple(row) for row in orders) == [(7, "1 Main St"), (8, "2 Main St")]
    finally:
        await engine.dispose()
        await store.close()
