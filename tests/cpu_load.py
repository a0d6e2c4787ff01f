"""Busy CPU-bound processes beside the test suite: ``make test-loaded`` runs ``make test``
under them, the check every change must pass before an issue is resolved.

A test that passes only on a quiet machine hides either a timing assumption in the test or
a real race in the product (the forked-timeout loop of issue 30 hid behind one). Two
processes that spin on this 2-core machine take half of each core from the suite and
stretch every wait, which is what a loaded CI machine does. Each spinner stops by itself
after ``--seconds`` and when its parent dies, so a load run can never outlive its use.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import time


def _spin(deadline: float, parent: int) -> None:
    """Burn one core until ``deadline`` or until the parent is gone."""
    checked = time.monotonic()
    while (now := time.monotonic()) < deadline:
        if now - checked > 1.0:
            checked = now
            if os.getppid() != parent:
                return


def main() -> int:
    parser = argparse.ArgumentParser(description="Run a command beside CPU-bound processes.")
    parser.add_argument("--processes", type=int, default=2, help="spinning processes (2)")
    parser.add_argument("--seconds", type=float, default=1800, help="stop after this long (1800)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="run this under the load")
    args = parser.parse_args()
    deadline = time.monotonic() + args.seconds
    spinners = [
        multiprocessing.Process(target=_spin, args=(deadline, os.getpid()), daemon=True)
        for _ in range(args.processes)
    ]
    for spinner in spinners:
        spinner.start()
    try:
        if args.command:
            return subprocess.call(args.command[1:] if args.command[0] == "--" else args.command)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()


if __name__ == "__main__":
    sys.exit(main())
