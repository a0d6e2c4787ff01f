"""The handoff core alone: microseconds of the main's Python per job, by worker count.

Drives :class:`broker.core.handoff.Handoff` in-process, with no store, socket or event
loop: a steady drain where each pass reads as many jobs as there are free slots (at most
a dispatch batch), plans them, claims them all, and each job's worker reports it done at
once and says ``ready`` again. What it measures is the core's own cost per job and how
it grows with the number of worker connections (issue 35: "no per-job work in the core
walks every worker"), not the broker's throughput.

    python -m bench.handoff_core [JOBS] [REPS] [WORKERS ...]
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime

from broker.core.handoff import Dispatch, Handoff
from broker.jobs import ExecutionMode, Job, JobSpec, JobStatus
from broker.wire import messages as protocol

SLOTS = 4
"""Free slots each worker announces (one mode)."""
BATCH = 64
"""The dispatcher's read batch."""
MODE = ExecutionMode.POOLED
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def drain(workers: int, jobs: int) -> float:
    """Seconds of CPU the core spends handing off and settling ``jobs`` over ``workers``."""
    core = Handoff()
    core.serving(0.0)
    for pid in range(1, workers + 1):
        peer = core.new_peer(pid, 0.0)
        hello = protocol.Hello(
            role=protocol.Role.WORKER,
            protocol=protocol.PROTOCOL_VERSION,
            worker_id=f"w{pid}",
            modes=[MODE],
        )
        core.hello(peer, hello)
        core.ready(pid, {MODE: SLOTS}, 0)
    queued = [Job.from_spec(JobSpec(task="t"), NOW) for _ in range(jobs)]
    done = 0
    started = time.process_time()
    while done < jobs:
        batch = queued[done : done + core.read_limit(BATCH, [MODE])]
        plan = core.plan(batch, 0.0)
        won = [
            replace(p.job, status=JobStatus.HANDED_OFF, handoff_id=p.lease, worker_id=p.worker_id)
            for p in plan
        ]
        seen: dict[int, int] = {}
        for effect in core.claimed(plan, won):
            if not isinstance(effect, Dispatch):
                continue
            lease = effect.job.handoff_id
            assert lease is not None
            report = protocol.CompletedReport(job_id=effect.job.id, handoff_id=lease)
            core.report(effect.peer, report)
            core.settled([(effect.peer, report, protocol.AckStatus.APPLIED)])
            seen[effect.peer] = effect.seq
        for pid, seq in seen.items():
            core.ready(pid, {MODE: SLOTS}, seq)
        done += len(plan)
    return time.process_time() - started


def main(argv: list[str]) -> None:
    jobs = int(argv[0]) if argv else 20_000
    reps = int(argv[1]) if len(argv) > 1 else 5
    counts = [int(n) for n in argv[2:]] or [1, 64]
    uuid.uuid4()  # warm
    for workers in counts:
        runs = [drain(workers, jobs) / jobs * 1e6 for _ in range(reps)]
        print(
            f"{workers:4d} workers: {statistics.median(runs):6.1f} µs/job "
            f"(median of {reps}; min {min(runs):.1f}, max {max(runs):.1f})"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
