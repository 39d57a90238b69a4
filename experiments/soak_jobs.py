"""Soak: jobs starting and ending in a loop on one aggregation service; memory and slots must stay flat.

    python3 experiments/soak_jobs.py --seconds 180          # 10 jobs at a time, a few minutes

Each cycle admits 10 jobs (world sizes 1..4, block sizes 16..256) on one AggregatorService, runs one
allreduce per job through the pure machines (in memory, with loss and reordering), checks every sum
against the reference, then ends the jobs: most by LEAVE from every rank, some by going idle past
the job-idle time. After every cycle no slot may still be in use and the process's resident memory
is sampled. Exit code 1 on a wrong sum, a leaked slot or job, or memory that grew by more than
--max-growth after the first cycles (allocators settle first).
"""
from __future__ import annotations

import argparse
import importlib.util
import resource
import sys
import time
from pathlib import Path

import numpy as np

from zerosum import protocol as P
from zerosum.aggregator_service import AggregatorService
from zerosum.local import memory
from zerosum.reference import reference_allreduce


def from_test_suite(name: str):
    """A helper module of the test suite (tests/NAME.py), loaded from its file: tests/ is no package and
    not on a script's path."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "tests" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


netsim = from_test_suite("netsim")      # the in-memory lossy network of the test suite
ServiceJob, run = netsim.ServiceJob, netsim.run


def rss_mib() -> float:
    rss = memory("VmRSS")
    return rss / 2**20 if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cycle(service, rng, first_job, now) -> bool:
    exact = True
    for k in range(10):
        job = first_job + k
        world, block = int(rng.integers(1, 5)), int(rng.choice([16, 64, 256]))
        n = int(rng.integers(1, 40)) * block + int(rng.integers(0, block))
        arrays = [(rng.standard_normal(n) * (rng.random(n) < 0.3)).astype(np.float32) for _ in range(world)]
        view = ServiceJob(service, job, start=now)
        outs, machines = run(arrays, [view], block_size=block, loss=0.05, reorder=0.2, seed=job)
        ref = reference_allreduce(arrays, block)
        exact &= all(o.tobytes() == ref.tobytes() for o in outs)
        if k % 3 == 2:
            continue                       # this job goes idle instead of leaving
        members = service.jobs[job].machine.state.members
        for rank in sorted(members):
            leave = P.encode(P.Header(P.LEAVE, job, rank, world, members[rank].nonce, 0, block))
            service.receive(leave, (job, rank), now)
    while service.timer() < float("inf"):      # the clock moves on until every idle job has expired
        service.datagrams_to_send(service.timer())
    return exact


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--max-growth", type=float, default=0.2, help="allowed RSS growth after warm-up (0.2 = 20 %%)")
    args = ap.parse_args(argv)
    service = AggregatorService(slots=4096, min_job_slots=16, max_job_slots=256, job_idle=30.0)
    rng = np.random.default_rng(0)
    start, cycles, samples, ok = time.monotonic(), 0, [], True
    while time.monotonic() - start < args.seconds or cycles < 4:
        ok &= cycle(service, rng, (cycles * 10) % 60000, now=cycles * 100.0)
        cycles += 1
        if service.jobs or service.slots_in_use:
            print(f"cycle {cycles}: {len(service.jobs)} jobs and {service.slots_in_use} slots still held")
            ok = False
            break
        samples.append(rss_mib())
    c = service.counters
    base = samples[min(2, len(samples) - 1)]
    growth = samples[-1] / base - 1
    print(f"{cycles} cycles in {time.monotonic() - start:.0f} s: jobs started {c.get('jobs_started', 0)}, "
          f"ended {c.get('jobs_ended', 0)}, refused {c.get('joins_refused', 0)}; slots in use "
          f"{service.slots_in_use}; RSS {base:.1f} -> {samples[-1]:.1f} MiB ({growth:+.1%}); sums "
          f"{'exact' if ok else 'WRONG or leaked'}")
    ok &= c.get("jobs_started", 0) == c.get("jobs_ended", 0) == cycles * 10
    ok &= growth <= args.max_growth
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
