"""The environment variables through which e2e tests steer the app modules their real
worker processes load (``tests.hooks_app``, ``tests.otel_app``).

They live here, not in those modules, because importing an app module declares its hooks
in the process-wide registry: a test process that imported one for a constant ran its
start-up hooks in every in-process worker of later tests (an OpenTelemetry start-up
hook without its variable stopped them all).
"""

from __future__ import annotations

EVENTS_ENV = "HOOKS_APP_EVENTS"
"""``tests.hooks_app``: the file each process appends what its hooks did to."""
FAIL_ENV = "HOOKS_APP_FAIL_STARTUP"
"""``tests.hooks_app``: set, the start-up hook raises."""
SLOW_ENV = "HOOKS_APP_STARTUP_SECONDS"
"""``tests.hooks_app``: the start-up hook takes this long, like an app warming a cache."""
HANG_ENV = "HOOKS_APP_HANG_SHUTDOWN"
"""``tests.hooks_app``: set, the shutdown hook never returns."""
SPANS_ENV = "OTEL_APP_SPANS"
"""``tests.otel_app``: the file each process writes its spans to, one JSON line each."""
