"""The documented path for periodic jobs (``broker.tasks.schedule.register``); they live in
:mod:`broker.tasks.schedule`."""

from __future__ import annotations

from broker.tasks.schedule import Schedule as Schedule
from broker.tasks.schedule import default_schedules as default_schedules
from broker.tasks.schedule import register as register

__all__ = ["Schedule", "default_schedules", "register"]
