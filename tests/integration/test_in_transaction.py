"""Jobs inserted inside the application's own transaction commit or roll back with it."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from adapters.sql import SQLAlchemyAdapter
from broker.jobs import JobSpec


async def test_enqueue_in_the_apps_transaction_commits_and_rolls_back_with_it(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    store = SQLAlchemyAdapter(url)
    await store.setup()
    app = create_async_engine(url)
    try:
        async with app.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE orders (id INTEGER PRIMARY KEY)"))
        kept, dropped = JobSpec(task="app.ship", args=[1]), JobSpec(task="app.ship", args=[2])
        async with app.begin() as conn:
            await conn.execute(sa.text("INSERT INTO orders (id) VALUES (1)"))
            [result] = await store.enqueue_in_transaction(conn, [kept])
            assert not result.duplicate
        conn = await app.connect()
        try:
            tx = await conn.begin()
            await conn.execute(sa.text("INSERT INTO orders (id) VALUES (2)"))
            await store.enqueue_in_transaction(conn, [dropped])
            await tx.rollback()
        finally:
            await conn.close()
        assert await store.get_job(kept.id) is not None
        assert await store.get_job(dropped.id) is None
        async with app.connect() as conn:
            orders = (await conn.execute(sa.text("SELECT id FROM orders"))).scalars().all()
        assert list(orders) == [1]
    finally:
        await app.dispose()
        await store.close()
