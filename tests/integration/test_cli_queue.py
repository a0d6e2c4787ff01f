"""``broker queue`` as an operator meets it: pause, limit and resume a queue on a running
main (its status then shows them), and usage errors before anything connects."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_cli_fixes import _cli, _main


async def test_pause_limit_and_resume_a_queue_on_a_running_main() -> None:
    async with _main() as (store, main, where):
        code, out, _ = await _cli(*where, "queue", "pause", "mail")
        assert code == 0 and out.strip() == "queue mail: paused, no rate limit"
        code, out, _ = await _cli(
            *where, "queue", "limit", "mail", "50/s", "--burst", "5", "--json"
        )
        assert code == 0
        assert json.loads(out) == {
            "queue": "mail",
            "paused": True,
            "rate_limit": "50/s",
            "rate_burst": 5,
        }
        assert main.handoff.flow.governed("mail")
        assert [s.queue for s in await store.queue_settings()] == ["mail"], "kept in the store"
        code, out, _ = await _cli(*where, "status")
        assert code == 0 and "50/s (burst 5)" in out
        await _cli(*where, "queue", "resume", "mail")
        code, out, _ = await _cli(*where, "queue", "limit", "mail", "--clear")
        assert code == 0 and out.strip() == "queue mail: dispatching, no rate limit"
        assert await store.queue_settings() == [] and not main.handoff.flow.governed("mail")


@pytest.mark.parametrize(
    "argv",
    [
        ("queue", "limit", "mail"),
        ("queue", "limit", "mail", "50/s", "--clear"),
        ("queue", "limit", "mail", "50/d"),
        ("queue", "limit", "mail", "50/s", "--burst", "0"),
        ("queue", "pause"),
    ],
)
async def test_queue_usage_errors_exit_2_before_connecting(argv: tuple[str, ...]) -> None:
    code, _, err = await _cli("--main", "127.0.0.1:1", *argv)
    assert code == 2, err
