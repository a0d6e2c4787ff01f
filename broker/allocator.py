"""The C allocator's settings for broker's own long-running processes.

Why: asyncio reads a socket or a pipe into a new ``bytes`` of 256 KiB (its transports'
``max_size``) and shrinks it to what arrived. glibc serves a block that large with
``mmap`` (its threshold starts at 128 KiB), so every read cost an ``mmap``, an
``mremap`` and later a ``munmap``, plus the page faults of fresh pages: about 16 us
of system time a read on this project's benchmark machine, where the read itself costs
1.5 us. glibc raises the threshold by itself once a process frees a large block that
was mapped, but a block shrunk before it is freed never does that, so a worker and its
children paid it on every read for their whole life (``strace -c``: one ``mmap``,
``mremap`` and ``munmap`` per read). With the threshold above the read size, the
worker used 7% less CPU per job and its children 10% less (``bench.drain_ab``, four
alternating pairs).

Only broker's own processes call :func:`tune` (``broker-main``, ``broker-worker`` and
the pooled runners' children); a process that merely imports broker (an application
with a :class:`~broker.Client`) keeps its allocator as it is.
"""

from __future__ import annotations

import ctypes
import platform

MMAP_THRESHOLD = 1 << 20
"""Blocks below this come from the heap: four times asyncio's read size."""
TRIM_THRESHOLD = 2 << 20
"""Free memory at the top of the heap kept for reuse rather than returned at once (what
glibc sets on its own when it raises the mmap threshold): a read's block freed and the
next one taken must not move the heap's end each time."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters, from glibc's ``malloc.h``."""


def tune() -> bool:
    """Set the thresholds on glibc; elsewhere (musl, macOS) do nothing. Whether they
    were set."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
