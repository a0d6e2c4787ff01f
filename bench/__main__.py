"""``make bench``: the broker and its peers, the same workloads, side by side.

    .venv/bin/python -m bench [--systems a,b] [--quick] [--reps 3] [--out bench/results]

1. Checks Redis (127.0.0.1:6379) and PostgreSQL (127.0.0.1:5432) and says what is
   missing; a system whose service is missing gets a row saying so.
2. Installs each peer, pinned, into its own virtual environment under ``.venv-peers/``
   on first use (their Redis clients conflict), and matplotlib into one for the chart.
3. Runs ``bench.harness`` once per system, in that system's environment, with a time
   limit; a system that fails or runs out of time keeps the runs it finished and a
   line saying what went wrong.
4. Writes ``results.json`` (every measurement), ``results.md`` and ``chart.png``.

Everything in the report is computed from ``results.json``; the peer baseline it is
compared with is read from ``peer-baseline.md`` when that file is present.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import jobs, report
from bench.harness import ROOT, Config, service_pids, tree_usage
from bench.systems import (
    BY_NAME,
    CHART_PYTHON,
    DATABASE_SUFFIX,
    PEERS_VENV,
    PINS,
    POSTGRES_ADMIN_DB,
    POSTGRES_HOST,
    POSTGRES_PORT,
    REDIS_HOST,
    REDIS_PORT,
    SYSTEMS,
    System,
    postgres_dsn,
    venv_python,
)

DEFAULT_OUT = ROOT / "bench" / "results"
SYSTEM_LIMIT = 300.0
"""Seconds one repetition of one system may take before it is stopped."""
DEFAULT_SYSTEMS = [s.name for s in SYSTEMS if s.name != "broker-postgres-inline"]


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- services


def _redis_command(sock: socket.socket, *words: str) -> Any:
    """One RESP command and its reply (strings, integers, arrays of bulk strings)."""
    payload = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
    sock.sendall(payload.encode())
    reader = sock.makefile("rb")
    return _resp(reader)


def _resp(reader: Any) -> Any:
    line = reader.readline().rstrip(b"\r\n")
    kind, rest = line[:1], line[1:].decode()
    if kind == b"+":
        return rest
    if kind == b"-":
        raise OSError(rest)
    if kind == b":":
        return int(rest)
    if kind == b"$":
        return None if rest == "-1" else reader.read(int(rest) + 2)[:-2].decode()
    if kind == b"*":
        return [_resp(reader) for _ in range(int(rest))]
    raise OSError(f"unexpected Redis reply {line!r}")


def check_redis() -> dict[str, Any]:
    where = f"{REDIS_HOST}:{REDIS_PORT}"
    try:
        with socket.create_connection((REDIS_HOST, REDIS_PORT), timeout=3) as sock:
            if _redis_command(sock, "PING") != "PONG":
                raise OSError("no PONG")
            info = _redis_command(sock, "INFO", "server")
            version = next(
                (ln.split(":", 1)[1].strip() for ln in info.splitlines() if "redis_version" in ln),
                "?",
            )
            save = _redis_command(sock, "CONFIG", "GET", "save")
            aof = _redis_command(sock, "CONFIG", "GET", "appendonly")
    except OSError as exc:
        return {"ok": False, "where": where, "error": f"Redis not reachable at {where}: {exc}"}
    save_text, aof_text = (save[1] if len(save) > 1 else "?"), (aof[1] if len(aof) > 1 else "?")
    persistence = (
        "no persistence (save '', appendonly no)"
        if not save_text and aof_text == "no"
        else f"save {save_text!r}, appendonly {aof_text}"
    )
    return {"ok": True, "where": where, "version": version, "persistence": persistence}


def check_postgres() -> dict[str, Any]:
    where = f"{POSTGRES_HOST}:{POSTGRES_PORT}"

    async def probe() -> dict[str, Any]:
        import asyncpg

        conn = await asyncpg.connect(postgres_dsn(POSTGRES_ADMIN_DB), timeout=5)
        try:
            settings = {
                name: await conn.fetchval(f"SHOW {name}")
                for name in ("server_version", "fsync", "synchronous_commit", "full_page_writes")
            }
        finally:
            await conn.close()
        return settings

    try:
        settings = asyncio.run(probe())
    except Exception as exc:
        return {
            "ok": False,
            "where": where,
            "error": f"PostgreSQL not reachable at {where} (user postgres, database "
            f"{POSTGRES_ADMIN_DB}): {exc!r}",
        }
    return {"ok": True, "where": where, **settings}


def checkpoint_postgres() -> str | None:
    """Write out PostgreSQL's dirty buffers before a system runs (``CHECKPOINT``); returns
    an error text or ``None``.

    Why: a checkpoint still spreading out the writes of what ran before (another system,
    or a test suite) competes with every commit for the disk. Measured here right after
    ``make test``, every PostgreSQL system ran 25-60% slower than after a ``CHECKPOINT``
    (one pair of runs; PgQueuer's one-at-a-time enqueue 2,442/s, then 3,873/s), so each
    system starts from the same clean state instead of from its predecessor's leftovers.
    """

    async def run() -> None:
        import asyncpg

        conn = await asyncpg.connect(postgres_dsn(POSTGRES_ADMIN_DB), timeout=5)
        try:
            await conn.execute("CHECKPOINT")
        finally:
            await conn.close()

    try:
        asyncio.run(run())
    except Exception as exc:
        return f"CHECKPOINT failed: {exc!r}"
    return None


# ----------------------------------------------------------------------------- venvs


def ensure_venv(name: str, workdir: Path) -> str | None:
    """Creates or updates ``.venv-peers/NAME``; returns an error text or ``None``."""
    target = PEERS_VENV / name
    stamp = target / ".bench-pins"
    wanted = "\n".join(PINS[name])
    if stamp.exists() and stamp.read_text() == wanted:
        return None
    base = getattr(sys, "_base_executable", sys.executable)
    logfile = workdir / f"install-{name}.log"
    pip = [str(target / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    steps = [
        [base, "-m", "venv", "--clear", str(target)],
        [*pip, "--disable-pip-version-check", *PINS[name]],
    ]
    with open(logfile, "wb") as out:
        for step in steps:
            try:
                done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, timeout=600)
            except subprocess.TimeoutExpired:
                return f"installing {name} took over 600 s (log: {logfile})"
            if done.returncode != 0:
                tail = logfile.read_text(errors="replace").strip().splitlines()[-3:]
                return f"installing {' '.join(PINS[name])} failed: {' | '.join(tail)}"
    stamp.write_text(wanted)
    return None


def ensure_venvs(names: set[str], workdir: Path) -> dict[str, str]:
    PEERS_VENV.mkdir(exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {n: pool.submit(ensure_venv, n, workdir) for n in sorted(names)}
        return {n: err for n, f in futures.items() if (err := f.result()) is not None}


# ----------------------------------------------------------------------------- runs


def _busy_seconds() -> float:
    """CPU time all processes spent since boot, in seconds (from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _ours_seconds() -> float:
    """CPU of this process tree plus the Redis and PostgreSQL servers the runs drive."""
    servers = service_pids("redis-server") + service_pids("postgres")
    return tree_usage([os.getpid()])[0] + tree_usage(servers)[0]


def _run_floor(what: str, module_args: list[str], timeout: float) -> None:
    """One of the floor probes (``python -m module_args...``), in a process of its own; a
    failure is logged, and the report then reads the probe's last output."""
    done = subprocess.run(
        [sys.executable, "-m", *module_args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        log(f"{what} failed: {done.stderr.strip()[-400:]}")


def run_system(
    system: System, cfg: Config, workdir: Path, limit: float, *, checkpoint: bool = False
) -> dict[str, Any]:
    """One system's harness, after a PostgreSQL ``CHECKPOINT`` if ``checkpoint``."""
    if checkpoint and (error := checkpoint_postgres()):
        log(f"{system.name}: {error}")
    out = workdir / f"{system.name}.json"
    config = workdir / "config.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [str(venv_python(system)), "-m", "bench.harness", system.name, str(config), str(out)]
    busy0, ours0, started = _busy_seconds(), _ours_seconds(), time.monotonic()
    load0 = os.getloadavg()[0]
    with open(workdir / f"{system.name}.harness.log", "wb") as logfile:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=logfile, stderr=subprocess.STDOUT
        )
        note = None
        try:
            proc.wait(limit)
        except subprocess.TimeoutExpired:
            note = f"stopped at the {limit:.0f} s limit for one system"
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    elapsed = time.monotonic() - started
    result: dict[str, Any]
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        tail = (workdir / f"{system.name}.harness.log").read_text(errors="replace")
        result = {"system": system.name, "errors": [f"harness failed: {tail.strip()[-600:]}"]}
    if note:
        result.setdefault("errors", []).append(note)
    other = (_busy_seconds() - busy0) - (_ours_seconds() - ours0)
    result["wall_s"] = elapsed
    result["other_cpu_pct"] = max(0.0, 100 * other / elapsed) if elapsed > 0 else 0.0
    result["loadavg_at_start"] = load0
    return result


def run_in_turns(
    names: list[str], skipped: dict[str, str], cfg: Config, workdir: Path, *, checkpoint: bool
) -> list[dict[str, Any]]:
    """Every system's repetitions, the systems taking turns: the first repetition of
    each, then the second of each, and so on.

    Run one system's repetitions back to back, as before, and a slow spell of this
    shared machine (a minute of a neighbour's load) fell on one system's every run:
    two whole runs of the same code ten minutes apart disagreed on the latency ratios
    by 30%. In turns, such a spell costs each system at most one repetition of its
    median. Each harness run is one repetition; their lists of runs are joined.
    """
    merged: dict[str, dict[str, Any]] = {}
    for rep in range(cfg.reps):
        for name in names:
            if name in skipped:
                continue
            result = run_system(BY_NAME[name], cfg, workdir, SYSTEM_LIMIT, checkpoint=checkpoint)
            log(f"{name} ({rep + 1}/{cfg.reps}): {report.one_line(result)}")
            merged[name] = _joined(merged[name], result) if name in merged else result
    return [
        {"system": name, "skipped": skipped[name], "errors": []}
        if name in skipped
        else merged[name]
        for name in names
    ]


def _joined(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """Two harness results of one system as one: their runs (and errors) joined, their
    wall times added, the larger share of other processes' CPU kept."""
    joined = dict(earlier)
    for key, value in later.items():
        if isinstance(value, list):
            joined[key] = [*earlier.get(key, []), *value]
        elif key not in joined:
            joined[key] = value
    joined["wall_s"] = earlier["wall_s"] + later["wall_s"]
    joined["other_cpu_pct"] = max(earlier["other_cpu_pct"], later["other_cpu_pct"])
    return joined


def environment(redis: dict[str, Any], postgres: dict[str, Any], hash_rounds: int) -> dict:
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    rounds_time = min(jobs._timed(hash_rounds) for _ in range(20))
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "memory_gib": round(mem_kb / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "redis": redis,
        "postgres": postgres,
        "hash_rounds": hash_rounds,
        "hash_job_ms": 1000 * rounds_time,
        "pythondontwritebytecode": os.environ.get("PYTHONDONTWRITEBYTECODE", ""),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated, from: {', '.join(BY_NAME)} (default: all but "
        "broker-postgres-inline)",
    )
    p.add_argument("--reps", type=int, default=3, help="repetitions of every workload")
    p.add_argument(
        "--quick", action="store_true", help="one repetition of small runs (a smoke test)"
    )
    p.add_argument(
        "--producers",
        type=int,
        default=Config.producers,
        help="producers in the producers workload (0: skip that workload)",
    )
    p.add_argument(
        "--producer-rate",
        type=float,
        default=Config.producer_rate,
        help="jobs per second each producer offers, one at a time (0: as fast as it can)",
    )
    p.add_argument(
        "--no-floor",
        action="store_true",
        help="skip measuring the floors (bench/floor.py and bench/enqueue_floor.py; the "
        "report then reads the last floor.json and enqueue-floor.json in --out, if any)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the results go")
    p.add_argument("--keep-workdir", action="store_true", help="keep logs and stores of the runs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    os.environ.setdefault(DATABASE_SUFFIX, f"_{os.getpid()}")
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        log(f"unknown systems: {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="broker-bench-"))
    args.out.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()

    redis, postgres = check_redis(), check_postgres()
    services = {"redis": redis, "postgres": postgres}
    for name, state in services.items():
        if state["ok"]:
            log(f"{name}: ok at {state['where']}")
        else:
            log(f"MISSING {name}: {state['error']}; the systems that need it are skipped")

    skipped: dict[str, str] = {}
    for name in names:
        missing = [services[s]["error"] for s in BY_NAME[name].needs if not services[s]["ok"]]
        if missing:
            skipped[name] = "skipped: " + "; ".join(missing)
    venvs = {BY_NAME[n].venv for n in names if n not in skipped} - {None}
    log(f"peer environments in {PEERS_VENV} (installed on first use): {', '.join(sorted(venvs))}")
    install_errors = ensure_venvs({v for v in venvs if v} | {"chart"}, workdir)
    for name in names:
        venv = BY_NAME[name].venv
        if venv in install_errors and name not in skipped:
            skipped[name] = f"not run: {install_errors[venv]}"
    # Bytecode for the sources every run imports: this machine sets PYTHONDONTWRITEBYTECODE,
    # so without it each fresh child process (RQ's work horses, the broker's recycled pool
    # children) would compile them again.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "bench", "broker", "adapters", "runners"],
        cwd=ROOT,
        check=False,
    )
    hash_rounds = jobs.calibrate()
    cfg = Config(
        workdir=str(workdir),
        hash_rounds=hash_rounds,
        reps=args.reps,
        producers=args.producers,
        producer_rate=args.producer_rate,
    )
    if args.quick:
        cfg = Config(
            workdir=str(workdir),
            hash_rounds=hash_rounds,
            reps=1,
            drain_jobs=1000,
            one_by_one=200,
            cpu_jobs=200,
            latency_jobs=50,
            drain_limit=15.0,
            producers=args.producers,
            producer_jobs=1000,
            producer_rate=args.producer_rate,
        )
    # The harness runs one repetition at a time: the systems take turns, repetition by
    # repetition (see run_in_turns).
    (workdir / "config.json").write_text(json.dumps(cfg.__dict__ | {"reps": 1}))
    env = environment(redis, postgres, hash_rounds)
    log(
        f"{len(names)} systems; 5 ms CPU job = {hash_rounds} SHA-256 rounds "
        f"({env['hash_job_ms']:.2f} ms here); load average {load_at_start[0]:.2f}"
    )

    results = run_in_turns(names, skipped, cfg, workdir, checkpoint=postgres["ok"])

    if not args.no_floor and postgres["ok"]:
        log("floor: measuring the hot-path primitives (bench/floor.py)")
        _run_floor("floor", ["bench.floor", "--out", str(args.out)], timeout=300)
        log("enqueue floor: one at a time through a relay, PgQueuer and broker-main in turns")
        enqueue_floor = args.out / "enqueue-floor.json"
        _run_floor("enqueue floor", ["bench.enqueue_floor", "--json", str(enqueue_floor)], 600)
    finished = datetime.now(UTC)
    data = {
        "generated": finished.isoformat(timespec="seconds"),
        "wall_s": time.monotonic() - started,
        "loadavg_start": load_at_start,
        "loadavg_end": os.getloadavg(),
        "environment": env,
        "config": cfg.__dict__ | {"workdir": None},
        "systems": results,
    }
    data["baseline"] = report.read_baseline()
    data["floor"] = report.read_json(args.out / "floor.json")
    data["enqueue_floor"] = report.read_json(args.out / "enqueue-floor.json")
    data["rss_soak"] = report.read_soak(args.out / "rss-soak.json")
    (args.out / "results.json").write_text(json.dumps(data, indent=1))
    chart_error = render_chart(args.out)
    data["wall_s"] = time.monotonic() - started
    (args.out / "results.md").write_text(report.markdown(data, chart_error))
    (args.out / "results.json").write_text(json.dumps(data, indent=1))
    log(f"wrote {args.out / 'results.md'}, results.json and chart.png in {data['wall_s']:.0f} s")
    if not args.keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        log(f"logs and stores kept in {workdir}")
    return 0


def render_chart(out: Path) -> str | None:
    python = CHART_PYTHON
    if not python.exists():
        return "matplotlib is not installed (see the install errors above)"
    done = subprocess.run(
        [str(python), "-m", "bench.chart", str(out / "results.json"), str(out / "chart.png")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        return f"chart failed: {done.stderr.strip()[-400:]}"
    return None


if __name__ == "__main__":
    sys.exit(main())
