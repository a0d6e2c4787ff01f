"""broker.allocator: a process of broker's own reads sockets and pipes without mapping
fresh memory for every read."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# A fresh interpreter reads a pipe as asyncio does (a 256 KiB buffer, shrunk to what
# arrived), a thousand times, and prints the minor page faults that cost. A block
# mapped for each read faults in at least the page the data lands in.
_READS = """
import os, resource, sys
from broker import allocator
if sys.argv[1] == "tuned":
    assert allocator.tune()
r, w = os.pipe()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(1000):
    os.write(w, b"x" * 300)
    os.read(r, 256 * 1024)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the thresholds are glibc's",
)


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _READS, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


@glibc_only
def test_a_tuned_process_reads_without_mapping_memory_for_each_read() -> None:
    assert _faults("untuned") >= 1000, "the cost tune() removes is there without it"
    assert _faults("tuned") < 100
