"""The installed commands (``broker-main``, ``broker-worker``, ``broker``).

Each checks the installation before :mod:`broker.ops.cli` is imported, since that import
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
    from broker.ops import cli

    return cli.main_entry()


def worker_entry() -> int:
    _checked()
    allocator.tune()
    from broker.ops import cli

    return cli.worker_entry()


def broker_entry() -> int:
    _checked()
    from broker.ops import cli

    return cli.broker_entry()
