"""Where a pytest run's CPU goes, by kind of process, and how much of it is start-up.

``python -m bench.suite_processes [PYTEST ARGS ...]`` runs ``pytest`` with the arguments
(``-n 2 --dist worksteal tests/e2e`` by default) while it samples ``/proc`` every 20 ms:
each process that runs this environment's Python is put in a kind (``broker-main``,
``broker-worker``, the ``broker`` command, a runner's child, the xdist workers that run
the tests themselves, ...) and its CPU (user + system) is the last sample seen. A
process is missed only if it lives less than one tick; the last tick of each one's life
is lost (at most 20 ms of CPU each).

Start-up is then estimated per kind: the CPU of one start (``--version`` for the three
commands, ``import runners.child`` for a child), measured alone, times the number of
starts. Why: on two cores the suite is CPU-bound, and each real process pays the import
of the broker before it does any work; this says how much of the suite that is.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict

HZ = os.sysconf("SC_CLK_TCK")
TICK = 0.02
KINDS = [
    ("xdist worker (tests in-process)", r"exec\(eval\(sys\.stdin"),
    ("pytest main", r"bin/pytest"),
    ("runner child", r"runners\.child"),
    ("broker-main", r"bin/broker-main|broker\.(ops\.)?cli main"),
    ("broker-worker", r"bin/broker-worker|broker\.(ops\.)?cli worker"),
    ("broker command", r"bin/broker( |$)|broker\.(ops\.)?cli broker"),
    ("pip / build", r"pip|-m build|pyproject_hooks"),
]
STARTS = {
    "broker-main": ["-m", "broker.ops.cli", "main", "--version"],
    "broker-worker": ["-m", "broker.ops.cli", "worker", "--version"],
    "broker command": ["-m", "broker.ops.cli", "broker", "--version"],
    "runner child": ["-P", "-c", "import runners.child"],
}


def kind(cmdline: str) -> str:
    for name, pattern in KINDS:
        if re.search(pattern, cmdline):
            return name
    return "other Python"


def _stat(pid: str) -> tuple[int, float] | None:
    """The process's start time (its identity with its pid) and CPU seconds so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / HZ


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def sample(mark: str, stop: threading.Event) -> dict[tuple[str, int], tuple[str, float]]:
    """Every process whose command line holds ``mark``: its command line and last CPU.
    A fork keeps its parent's command line until it execs, so a young one's is read
    again; one that never holds ``mark`` within a second is left alone."""
    commands: dict[tuple[str, int], str] = {}
    cpu: dict[tuple[str, int], float] = {}
    first: dict[tuple[str, int], float] = {}
    me = str(os.getpid())
    while not stop.is_set():
        now = time.monotonic()
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == me:
                continue
            stat = _stat(pid)
            if stat is None:
                continue
            key = (pid, stat[0])
            born = first.setdefault(key, now)
            if now - born < 1.0:
                cmd = _cmdline(pid)
                if mark in cmd or key in commands:
                    commands[key] = cmd
            if key in commands:
                cpu[key] = stat[1]
        time.sleep(TICK)
    return {key: (cmd, cpu[key]) for key, cmd in commands.items()}


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
"""As ``make test`` runs: byte-code cached, not compiled again by every process."""


def one_start(argv: list[str], runs: int = 5) -> float:
    """CPU seconds of one start of ``argv`` (the median of ``runs``)."""
    cpu = []
    for _ in range(runs):
        proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.DEVNULL, env=ENV)
        _, _, usage = os.wait4(proc.pid, 0)
        cpu.append(usage.ru_utime + usage.ru_stime)
    return statistics.median(cpu)


def main() -> None:
    args = sys.argv[1:] or ["-n", "2", "--dist", "worksteal", "tests/e2e"]
    stop = threading.Event()
    result: dict[tuple[str, int], tuple[str, float]] = {}
    sampler = threading.Thread(target=lambda: result.update(sample(sys.prefix, stop)))
    sampler.start()
    started = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", *args], env=ENV)
    wall = time.monotonic() - started
    stop.set()
    sampler.join()
    by_kind: dict[str, list[float]] = defaultdict(list)
    for cmd, cpu in result.values():
        by_kind[kind(cmd)].append(cpu)
    total = sum(sum(v) for v in by_kind.values())
    print(f"\npytest exited {code} after {wall:.0f} s: {total:.1f} CPU s, {len(result)} processes")
    print(f"{'kind':34} {'starts':>6} {'CPU s':>7} {'share':>6} {'median':>7} {'start-up s':>10}")
    startup_total = 0.0
    for name, cpus in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        startup = ""
        if name in STARTS:  # at most the kind's CPU: one start alone is measured apart
            each = one_start(STARTS[name])
            startup_total += min(each * len(cpus), sum(cpus))
            startup = f"{min(each * len(cpus), sum(cpus)):.1f} ({each * 1000:.0f} ms each)"
        print(
            f"{name:34} {len(cpus):6} {sum(cpus):7.1f} {sum(cpus) / total:6.0%} "
            f"{statistics.median(cpus):7.2f} {startup:>10}"
        )
    print(f"start-up (imports) of the four kinds: {startup_total:.1f} s of {total:.1f} s")
    with open("/proc/loadavg") as f:
        print("load average:", " ".join(f.read().split()[:3]))


if __name__ == "__main__":
    main()
