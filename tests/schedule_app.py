"""Periodic jobs for ``tests/integration/test_schedule.py``, loaded with ``--schedules``."""

from __future__ import annotations

from datetime import timedelta

from broker.tasks.registry import TaskRegistry, task
from broker.tasks.schedule import Schedule

registry = TaskRegistry()


@task(name="schedule_app.heartbeat", every=timedelta(minutes=5), registry=registry)
def heartbeat() -> None:
    """Declared on the task: every five minutes, on the epoch grid."""


schedules = [
    Schedule(
        name="schedule_app.nightly-report",
        task="schedule_app.report",
        cron="30 2 * * *",
        timezone="Europe/Paris",
        kwargs={"kind": "nightly"},
        catch_up=False,
    )
]
