"""Several jobs on one aggregator: does a job take about as long as it does alone, while others run,
one job's workers add loss and garbage, and another job has a dead rank?

    python3 experiments/multi_job.py                 # jobs of 2, 3 and 4 workers, blocks of 64, 256, 1024

One aggregator process on loopback serves every job (no job declared up front). Each job's workers
reduce --rounds tensors of --size floats at --density and check every sum against the fixed-point
reference. First each of the three jobs runs alone, then all three at once, together with a noisy
job (10 % loss in its workers, plus a process firing garbage datagrams at the aggregator) and a job
whose second rank dies after joining. Prints per job: median allreduce time alone and together, the
ratio, and whether every sum was exact; then the aggregator's counters (jobs started, ended, refused).
The machine's cores are shared by every process, so "together" also measures CPU contention.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

import numpy as np

JOBS = [(1, 2, 64), (2, 3, 256), (3, 4, 1024)]   # (job id, workers, block size)


def _tensor(job, rank, round_, size, density, block):
    rng = np.random.default_rng([job, rank, round_])
    x = rng.standard_normal(size).astype(np.float32)
    nblocks = -(-size // block)
    x[~np.repeat(rng.random(nblocks) < density, block)[:size]] = 0
    return x


def _rank(job, world, rank, block, address, size, density, rounds, loss, die, queue):
    import zerosum
    from zerosum.reference import reference_allreduce
    try:
        with zerosum.Worker(rank, world, [address], job=job, block_size=block, loss=loss, timeout=10) as w:
            if die:
                os._exit(0)      # dead after joining: no LEAVE
            times, exact = [], True
            for r in range(rounds):
                x = _tensor(job, rank, r, size, density, block)
                t = time.perf_counter()
                got = w.allreduce(x)
                times.append(time.perf_counter() - t)
                ref = reference_allreduce([_tensor(job, q, r, size, density, block) for q in range(world)], block)
                exact &= got.tobytes() == ref.tobytes()
            queue.put((job, rank, "ok", statistics.median(times), exact))
    except Exception as e:       # reported, not raised: the run goes on
        queue.put((job, rank, "error", f"{type(e).__name__}: {e}", False))


def _garbage(address, seconds):
    host, port = address.rsplit(":", 1)
    rng = np.random.default_rng(7)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.sendto(rng.integers(0, 256, int(rng.integers(1, 2000)), dtype=np.uint8).tobytes(), (host, int(port)))
        time.sleep(0.0005)


def _run(ctx, address, specs, args):
    """specs: (job, world, block, loss, dead ranks); returns {job: [reports]}."""
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(job, world, r, block, address, args.size, args.density,
                                              args.rounds, loss, r in dead, queue))
             for job, world, block, loss, dead in specs for r in range(world)]
    for p in procs:
        p.start()
    expected = sum(world - len(dead) for _, world, _, _, dead in specs)
    reports = [queue.get(timeout=120) for _ in range(expected)]
    for p in procs:
        p.join(30)
    out = {}
    for job, rank, status, value, exact in reports:
        out.setdefault(job, []).append((rank, status, value, exact))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1_000_000, help="floats per tensor")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from zerosum.local import LocalAggregator
    ctx = mp.get_context("spawn")
    agg = LocalAggregator(None, max_job_slots=1024, job_idle=5.0)   # 5 jobs fit the default pool of 8192
    rows = []
    try:
        alone = {}
        for job, world, block in JOBS:
            alone.update(_run(ctx, agg.address, [(job, world, block, 0.0, ())], args))
        noise = ctx.Process(target=_garbage, args=(agg.address, 60.0), daemon=True)
        noise.start()
        together = _run(ctx, agg.address, [(job + 10, world, block, 0.0, ()) for job, world, block in JOBS]
                        + [(20, 2, 256, 0.1, ()), (30, 2, 256, 0.0, (1,))], args)
        noise.terminate()
    finally:
        counters = agg.stop()
    print(f"{args.size:,} floats at density {args.density}, median of {args.rounds} allreduces, slowest rank")
    print(f"{'job':>4} {'workers':>7} {'block':>6} {'alone s':>8} {'together s':>10} {'ratio':>6} exact")
    for job, world, block in JOBS:
        a = alone[job]
        t = together[job + 10]
        ok = all(s == "ok" and e for _, s, _, e in a + t)
        ta = max(v for _, s, v, _ in a if s == "ok") if all(s == "ok" for _, s, _, _ in a) else float("nan")
        tt = max(v for _, s, v, _ in t if s == "ok") if all(s == "ok" for _, s, _, _ in t) else float("nan")
        rows.append({"job": job, "workers": world, "block": block, "alone_s": ta, "together_s": tt, "exact": ok})
        print(f"{job:>4} {world:>7} {block:>6} {ta:>8.4f} {tt:>10.4f} {tt / ta:>5.2f}x {'yes' if ok else 'NO'}")
    noisy = together.get(20, [])
    dead = together.get(30, [])
    print("noisy job (10 % loss, garbage alongside):",
          "exact" if noisy and all(s == "ok" and e for _, s, _, e in noisy) else noisy)
    print("job with a dead rank:", "; ".join(str(v) for _, _, v, _ in dead))
    print("aggregator:", json.dumps({k: v for k, v in counters.items() if k.startswith(("jobs", "joins", "drop"))}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "counters": counters}, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
