"""Every default lives once: the command line, the settings objects and the constructors
that take the same settings all read it from one table (``broker.model.setting``).

The parsers are built here from the tables, as the commands build them, and each flag's
default and ``BROKER_*`` variable is compared with the settings dataclass's field; the
keyword defaults of ``Worker`` and of the runners are compared with the same tables, so a
default written a second time anywhere fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any

import pytest

from broker.main.retention import Retention
from broker.main.settings import MainSettings
from broker.model.setting import default_of, flag_of, rows
from broker.ops import cli
from broker.ops.cli.options import env_name
from broker.tasks.runner_options import RunnerOptions
from broker.worker.settings import WorkerSettings
from broker.worker.worker import Worker
from runners.forked import ForkedRunner
from runners.inline import InlineRunner
from runners.pooled import PooledRunner

TABLES: list[tuple[str, type, Any]] = [
    ("broker-main", MainSettings, cli.main_parser),
    ("broker-main", Retention, cli.main_parser),
    ("broker-worker", WorkerSettings, cli.worker_parser),
    ("broker-worker", RunnerOptions, cli.worker_parser),
]


@pytest.fixture(autouse=True)
def _no_broker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("BROKER_"):
            monkeypatch.delenv(name)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize(
    ("command", "table", "build"), TABLES, ids=lambda t: getattr(t, "__name__", t)
)
def test_each_flag_takes_its_default_and_variable_from_the_table(
    command: str, table: type, build: Any
) -> None:
    actions = _actions(build())
    flagged = [(field, row) for field, row in rows(table) if row.help is not None]
    assert flagged, f"{table.__name__} has no flags"
    for field, row in flagged:
        flag = flag_of(field, row)
        action = actions.get(flag)
        assert action is not None, f"{command} lacks {flag} ({table.__name__}.{field.name})"
        expected = None if row.derived else default_of(field)
        assert action.default == expected, f"{flag}: {action.default!r} != {expected!r}"
        assert f"[env {env_name(flag)}" in (action.help or ""), flag
        assert env_name(flag) == "BROKER_" + flag[2:].replace("-", "_").upper()


def test_every_variable_a_command_names_is_its_flags() -> None:
    """No ``BROKER_*`` variable is spelt by hand: each is its flag's name."""
    for build in (cli.main_parser, cli.worker_parser, cli.broker_parser):
        for flag, action in _actions(build()).items():
            if flag.startswith("--") and "[env " in (action.help or ""):
                assert f"[env {env_name(flag)}" in (action.help or ""), flag


def test_a_table_row_makes_one_flag_only() -> None:
    for command in ("broker-main", "broker-worker"):
        flags = [
            flag_of(field, row)
            for name, table, _ in TABLES
            if name == command
            for field, row in rows(table)
            if row.help is not None
        ]
        assert len(flags) == len(set(flags)), command


def _keyword_defaults(callable_: Any) -> dict[str, Any]:
    return {
        name: parameter.default
        for name, parameter in inspect.signature(callable_).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }


def test_the_worker_takes_its_defaults_from_worker_settings() -> None:
    defaults = _keyword_defaults(Worker)
    for field in dataclasses.fields(WorkerSettings):
        assert defaults[field.name] == default_of(field), field.name


@pytest.mark.parametrize(
    ("runner", "names"),
    [
        (InlineRunner, {"concurrency": "inline_concurrency", "default_timeout": "default_timeout"}),
        (
            PooledRunner,
            {
                "concurrency": "pooled_runner_concurrency",
                "max_jobs": "pooled_max_jobs",
                "max_rss_bytes": "pooled_max_rss_bytes",
                "max_lifetime": "pooled_max_lifetime",
                "default_timeout": "default_timeout",
                "kill_grace": "kill_grace",
                "startup_timeout": "startup_timeout",
            },
        ),
        (
            ForkedRunner,
            {
                "concurrency": "forked_concurrency",
                "default_timeout": "default_timeout",
                "kill_grace": "kill_grace",
                "startup_timeout": "startup_timeout",
            },
        ),
    ],
    ids=lambda r: getattr(r, "__name__", "names"),
)
def test_the_runners_take_their_defaults_from_runner_options(
    runner: type, names: dict[str, str]
) -> None:
    defaults = _keyword_defaults(runner)
    table = {field.name: default_of(field) for field in dataclasses.fields(RunnerOptions)}
    for parameter, field in names.items():
        assert defaults[parameter] == table[field], f"{runner.__name__}({parameter}=...)"


def test_the_defaults_pass_their_own_rules() -> None:
    MainSettings().validate()
    Retention()
    WorkerSettings().validate()
    RunnerOptions().validate()


def test_a_bad_flag_and_a_bad_setting_are_refused_in_the_same_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from broker.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError) as refused:
        MainSettings(ping_interval=0.0).validate()
    with pytest.raises(SystemExit):
        cli.main_parser().parse_args(["--ping-interval", "0"])
    assert str(refused.value) in capsys.readouterr().err
