"""Shared fixtures: where the test PostgreSQL is, and stores to run tests against."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import uuid

import pytest

POSTGRES_URL = os.environ.get(
    "BROKER_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)


def _postgres_unreachable_reason() -> str | None:
    async def probe() -> None:
        import asyncpg

        dsn = POSTGRES_URL.replace("postgresql+asyncpg://", "postgresql://", 1)
        conn = await asyncio.wait_for(asyncpg.connect(dsn), timeout=5)
        await conn.close()

    try:
        # A thread of its own: callers may already be inside a running event loop.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, probe()).result()
    except Exception as exc:
        return f"PostgreSQL at {POSTGRES_URL} is unreachable: {exc!r}"
    return None


_reason: list[str | None] = []


def require_postgres() -> str:
    """The test PostgreSQL URL; skips the test if it is down (fails under CI=true)."""
    if not _reason:
        _reason.append(_postgres_unreachable_reason())
    reason = _reason[0]
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true: PostgreSQL tests must run, not skip)")
        pytest.skip(reason)
    return POSTGRES_URL


def fresh_schema_name() -> str:
    return f"broker_test_{uuid.uuid4().hex[:12]}"


async def drop_schema(schema: str) -> None:
    import asyncpg

    dsn = POSTGRES_URL.replace("postgresql+asyncpg://", "postgresql://", 1)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


@pytest.fixture(autouse=True)
def no_hooks_in_the_test_process() -> None:
    """No test leaves hooks in the process-wide registry: every in-process worker of a
    later test would run them (an app module imported for a constant once stopped them
    all, see ``tests/app_env.py``)."""
    from broker.tasks.registry import default_registry

    hooks = default_registry.hooks
    assert not (hooks.startup or hooks.shutdown or hooks.middleware), (
        "hooks were declared in the test process's default registry before this test"
    )
