"""The benchmark harness measures a process tree: a child's CPU counts in the tree once
the child is reaped, never as the root's own. It starts a child, so it lives here, not
beside the benchmark's arithmetic in ``tests/unit/test_bench_figures.py``."""

from __future__ import annotations

import os
import subprocess
import sys

from bench import harness


def test_a_reaped_childs_cpu_counts_in_the_tree_but_not_as_the_roots_own() -> None:
    before = harness.usage([os.getpid()])
    burn = "import time\nwhile time.process_time() < 0.3: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    after = harness.usage([os.getpid()])
    children = (after.tree_cpu - after.own_cpu) - (before.tree_cpu - before.own_cpu)
    assert children >= 0.2  # the child's 0.3 s, in 10 ms ticks
    assert after.own_cpu - before.own_cpu < children
