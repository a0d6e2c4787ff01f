"""The command line: environment defaults, refusals with clear errors, enqueue and job."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from broker.exceptions import ConfigurationError
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.ops import cli


def test_every_main_option_names_its_environment_variable() -> None:
    text = cli.main_parser().format_help()
    for var in ("BROKER_DATABASE_URL", "BROKER_HOST", "BROKER_PORT", "BROKER_TOKEN"):
        assert var in text
    assert "BROKER_MAIN" in cli.worker_parser().format_help()
    assert "BROKER_APP" in cli.worker_parser().format_help()


def test_environment_supplies_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BROKER_DATABASE_URL", "sqlite+aiosqlite:///elsewhere.db")
    monkeypatch.setenv("BROKER_PORT", "7444")
    args = cli.main_parser().parse_args([])
    assert args.database_url == "sqlite+aiosqlite:///elsewhere.db"
    assert int(args.port) == 7444
    assert cli.main_parser().parse_args(["--port", "7555"]).port == 7555


def test_main_refuses_a_public_address_without_a_token() -> None:
    with pytest.raises(ConfigurationError, match="without a token"):
        MainSettings(host="0.0.0.0").validate()
    MainSettings(host="0.0.0.0", token="s3cret-long-enough").validate()
    MainSettings(host="0.0.0.0", allow_unauthenticated=True).validate()
    with pytest.raises(ConfigurationError, match="liveness_timeout"):
        MainSettings(ping_interval=5, liveness_timeout=2).validate()


def test_main_entry_reports_a_bad_store_url_and_exits_non_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main_entry(["--database-url", "mysql://nope", "--port", "0"]) == 1
    assert "unsupported store URL" in capsys.readouterr().err


def test_worker_entry_requires_a_task_module(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BROKER_APP", raising=False)
    with pytest.raises(SystemExit) as stopped:
        cli.worker_entry(["--main", "127.0.0.1:1"])
    assert stopped.value.code == 2, "a usage error"
    assert "--app" in capsys.readouterr().err


def test_worker_flags_set_its_side_of_liveness(capsys: pytest.CaptureFixture[str]) -> None:
    """``broker-worker --ping-interval/--liveness-timeout`` reach its settings, under the
    rule the main's follow: a timeout not longer than the interval is refused at start."""
    from broker.ops.cli.options import from_args
    from broker.worker.settings import WorkerSettings

    given = ["--app", "tests.web_app", "--ping-interval", "0.5", "--liveness-timeout", "3"]
    settings = from_args(WorkerSettings, cli.worker_parser().parse_args(given))
    assert (settings.ping_interval, settings.liveness_timeout) == (0.5, 3.0)
    refused = ["--main", "127.0.0.1:1", "--app", "tests.web_app", "--pooled-runner-count", "0"]
    code = cli.worker_entry([*refused, "--ping-interval", "5", "--liveness-timeout", "2"])
    assert code == 1
    assert "liveness_timeout must be longer than ping_interval" in capsys.readouterr().err


def test_broker_enqueue_and_job_against_a_running_main(tmp_path: Path) -> None:
    from adapters.sql import SQLAlchemyAdapter

    async def scenario() -> tuple[str, dict[str, object], int]:
        main = Main(
            SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"),
            MainSettings(port=0),
        )
        await main.start()
        try:
            address = f"127.0.0.1:{main.port}"
            enqueue = await asyncio.to_thread(
                _run_cli,
                [
                    "--main",
                    address,
                    "enqueue",
                    "app.tasks.x",
                    "[1, 2]",
                    "--kwargs",
                    '{"k": 3}',
                    "--queue",
                    "mail",
                    "--priority",
                    "4",
                    "--idempotency-key",
                    "k1",
                ],
            )
            job_id = enqueue[1].strip()
            shown = await asyncio.to_thread(_run_cli, ["--main", address, "job", job_id, "--json"])
            bad = await asyncio.to_thread(
                _run_cli, ["--main", address, "enqueue", "app.tasks.x", "{not json"]
            )
            return job_id, json.loads(shown[1]), bad[0]
        finally:
            await main.stop()

    job_id, job, bad_code = asyncio.run(scenario())
    assert job["id"] == job_id
    assert job["args"] == [1, 2] and job["kwargs"] == {"k": 3}
    assert job["queue"] == "mail" and job["priority"] == 4 and job["status"] == "queued"
    assert bad_code == 2, "invalid ARGS_JSON is a usage error"


def _run_cli(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = cli.broker_entry(argv)
        except SystemExit as exit_:  # a usage error, from argument parsing
            code = int(exit_.code or 0)
    return code, out.getvalue()
