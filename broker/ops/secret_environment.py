"""Taking the broker's secrets out of a worker's own environment once they are read.

A worker runs task code, and its children run as the same user: any of them can read
``/proc/<worker pid>/environ``, which shows the environment the worker was *started*
with, whatever ``os.environ`` holds since. So removing ``BROKER_TOKEN`` from
``os.environ`` is not enough: the bytes in the process's initial environment block are
overwritten too, once the command line has been parsed and before any task module is
imported or any child started. (The children's own environment never had them: see
:func:`runners.process.child_environment`.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterable

SECRET_VARIABLES = (
    "BROKER_TOKEN",
    "BROKER_WORKER_TOKEN",
    "BROKER_CLIENT_TOKEN",
    "BROKER_OPERATOR_TOKEN",
    "BROKER_DATABASE_URL",
)
"""The variables that hold a secret (a role's token, a store URL with its password)."""


def scrub(names: Iterable[str] = SECRET_VARIABLES) -> None:
    """Remove ``names`` from this process's environment: ``os.environ``, the C library's
    and the initial block that ``/proc/<pid>/environ`` shows."""
    present = [name for name in names if name in os.environ]
    if not present:
        return
    _blank_initial_values({name.encode() for name in present})
    for name in present:
        del os.environ[name]  # unsetenv() too


def _blank_initial_values(names: set[bytes]) -> None:
    """Overwrite with NULs the value of each ``NAME=value`` of ``names`` in place: the C
    library's ``environ`` still points into the block the kernel laid out at ``exec``.
    Where there is no such symbol (not a C library this knows), nothing is overwritten."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        entries = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
        index = 0
        while (address := entries[index]) is not None:
            name, equals, value = ctypes.string_at(address).partition(b"=")
            if equals and name in names:
                ctypes.memset(address + len(name) + 1, 0, len(value))
            index += 1
