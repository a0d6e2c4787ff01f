"""The installed commands (``broker-main``, ``broker-worker``, ``broker``).

Each checks the installation before its command's module is imported, since that import
loads ``adapters`` and ``runners``: a shadowed package would fail there, with an error
about another project's modules instead of the conflict.
"""

from __future__ import annotations

import sys

from broker import allocator
from broker.exceptions import ConfigurationError
from broker.ops.installation import check_installation


def _checked() -> None:
    try:
        check_installation()
    except ConfigurationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def main_entry() -> int:
    _checked()
    allocator.tune()
    from broker.ops.cli.main import main_entry as command

    return command()


def worker_entry() -> int:
    _checked()
    allocator.tune()
    from broker.ops.cli.worker import worker_entry as command

    return command()


def broker_entry() -> int:
    _checked()
    from broker.ops.cli.broker import broker_entry as command

    return command()
