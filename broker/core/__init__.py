"""Every rule of the broker that is a decision rather than I/O.

Modules here take events and return effects (h11's shape): no event loop, socket, TLS,
thread, process or database driver is imported here, and ``pyproject.toml`` enforces it with
an import-linter contract. The shells in :mod:`broker.main` and :mod:`broker.worker` do the
waiting and the writing; when a new decision is needed, it goes here, with a unit test.
"""
