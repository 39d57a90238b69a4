"""`zerosum check`: one rank of a correctness run across hosts (the docker-compose testbed uses it).

Every rank reduces deterministic sparse tensors, recomputes the expected sum from all ranks' inputs
(they are generated from the rank number, so no data has to travel), and then all ranks reduce their
verdicts: every rank exits non-zero if any rank got a wrong sum.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from .bench import bench_tensor
from .reference import reference_allreduce
from .worker import Worker


def run_check(args) -> int:
    report = {"rank": args.rank, "world": args.world, "aggregators": args.aggregators, "runs": []}
    key = None
    if args.key_file:
        from .cli import _keys
        key = _keys(args.key_file)
        if isinstance(key, dict):
            key = key.get(args.job)
            if key is None:
                raise ValueError(f"--key-file {args.key_file} has no secret for job {args.job}")
    with Worker(args.rank, args.world, args.aggregators, job=args.job, block_size=args.block_size,
                timeout=args.timeout, loss=args.loss, seed=args.rank, max_entries=args.max_entries,
                bind=args.bind, key=key) as w:
        good = True
        for density in args.densities:
            x = bench_tensor(args.rank, density, args.size, args.block_size, args.seed)
            t0 = time.perf_counter()
            y = w.allreduce(x)
            elapsed = time.perf_counter() - t0
            ref = reference_allreduce([bench_tensor(r, density, args.size, args.block_size, args.seed)
                                       for r in range(args.world)], args.block_size)
            exact = y.tobytes() == ref.tobytes()
            good &= exact
            report["runs"].append({"density": density, "seconds": elapsed, "exact": exact,
                                   "max_abs_error": float(np.max(np.abs(y - ref))) if y.size else 0.0})
            print(f"rank {args.rank}: density {density:g}: {'exact' if exact else 'WRONG SUM'} "
                  f"in {elapsed:.3f} s", flush=True)
        verdicts = w.allreduce(np.array([int(good)], np.int32))
        report.update(ranks_exact=int(verdicts[0]), bytes_sent=w.stats.bytes_sent,
                      retransmitted_entries=w.stats.retransmitted_entries)
    ok = int(verdicts[0]) == args.world
    report["ok"] = ok
    if args.results:
        out = Path(args.results)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank-{args.rank}.json").write_text(json.dumps(report, indent=2))
    print(f"rank {args.rank}: {int(verdicts[0])} of {args.world} ranks got exact sums: "
          f"{'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1
