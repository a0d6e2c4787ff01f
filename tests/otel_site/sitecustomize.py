"""What ``opentelemetry-instrument`` does for a process it starts, for the main of
``tests/e2e/test_tracing.py``: the test puts this directory (and the checkout) first on
the main's ``PYTHONPATH``, so Python imports this module as the process starts and the
SDK's provider is set before the broker runs (``docs/howto/tracing.md``, "Configure the
SDK in the main")."""

from __future__ import annotations

import os

from tests.app_env import SPANS_ENV

if SPANS_ENV in os.environ:
    from tests.otel_export import export_spans_to

    export_spans_to(os.environ[SPANS_ENV])
