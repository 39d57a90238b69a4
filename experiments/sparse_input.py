"""Cost of a fixed amount of non-zero data as the tensor grows: dense input against block-sparse input.

    python3 experiments/sparse_input.py                       # 2 workers, 1,024 non-zero blocks, 10 MB .. 1 GB

Every worker holds the same number of non-zero blocks (chosen at random per rank) in tensors of
growing size, and reduces them three ways in the same processes, one local aggregator on loopback:
ZeroSum with the dense array (`Worker.allreduce`, in place: the tensor is scanned), ZeroSum with the
block pairs (`Worker.allreduce_blocks`: only the blocks), and torch gloo's dense allreduce as the
baseline. Results are checked against the fixed-point reference (dense) and against each other
(blocks). Prints a table with times (median over --rounds) and each column's growth from the
smallest tensor, and writes JSON with --output.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

import numpy as np

BLOCK = 256


def _tensor(rank: int, floats: int, blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + rank)
    nblocks = floats // BLOCK
    chosen = np.sort(rng.choice(nblocks, size=blocks, replace=False)).astype(np.int64)
    rows = rng.standard_normal((blocks, BLOCK)).astype(np.float32)
    return chosen, rows, nblocks


def _rank(rank, world, address, group, port, sizes, blocks, rounds, queue):
    import torch
    import torch.distributed as dist
    import zerosum
    from zerosum.reference import reference_allreduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = []
    with zerosum.Worker(rank, world, [address], job=7, block_size=BLOCK, multicast=group) as w:
        for floats in sizes:
            chosen, rows, nblocks = _tensor(rank, floats, blocks)
            dense = np.zeros(floats, np.float32)
            dense.reshape(nblocks, BLOCK)[chosen] = rows
            times = {"dense": [], "blocks": [], "gloo": []}
            for i in range(rounds + 1):      # the first round is a warm-up
                x = dense.copy()
                dist.barrier()
                t = time.perf_counter()
                w.allreduce(x, out=x)
                times["dense"].append(time.perf_counter() - t)
                dist.barrier()     # no rank's time includes waiting for another's dense allreduce
                t = time.perf_counter()
                got_blocks, got_rows = w.allreduce_blocks(chosen, rows, nblocks)
                times["blocks"].append(time.perf_counter() - t)
                g = torch.from_numpy(dense.copy())
                dist.barrier()
                t = time.perf_counter()
                dist.all_reduce(g)
                times["gloo"].append(time.perf_counter() - t)
            if rank == 0:
                others = [_tensor(r, floats, blocks) for r in range(world)]
                arrays = []
                for c, r_, nb in others:
                    a = np.zeros(floats, np.float32)
                    a.reshape(nb, BLOCK)[c] = r_
                    arrays.append(a)
                ref = reference_allreduce(arrays, BLOCK)
                assert np.array_equal(x, ref), "dense result differs from the reference"
                union = np.unique(np.concatenate([c for c, _, _ in others]))
                assert np.array_equal(got_blocks, union), "block result names other blocks"
                assert np.array_equal(got_rows, ref.reshape(nblocks, BLOCK)[union]), "block result differs"
            out.append({"floats": floats, **{k: statistics.median(v[1:]) for k, v in times.items()}})
            del dense, x, g
    # the slowest rank decides
    queue.put((rank, out))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=1024, help="non-zero blocks per worker")
    ap.add_argument("--sizes-mb", default="10,100,1000", help="tensor sizes in MB (float32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", help="write the results as JSON here")
    args = ap.parse_args(argv)
    from zerosum.local import LocalAggregator, results_group
    from zerosum.udp import free_port

    sizes = [int(float(s) * 1e6) // 4 // BLOCK * BLOCK for s in args.sizes_mb.split(",")]
    group, _ = results_group()     # results by multicast where it works on loopback, as zerosum bench
    agg = LocalAggregator(args.workers, job=7, multicast=group)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.workers, agg.address, group, port, sizes, args.blocks,
                                              args.rounds, queue)) for r in range(args.workers)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    agg.stop()
    rows = []
    for i, floats in enumerate(sizes):
        row = {"floats": floats, "MB": floats * 4 / 1e6}
        for k in ("dense", "blocks", "gloo"):
            row[k] = max(r[i][k] for _, r in results)
        rows.append(row)
    print(f"{args.workers} workers, {args.blocks} non-zero blocks of {BLOCK} floats per worker; "
          f"median of {args.rounds}, slowest rank; growth = time / time at the smallest size")
    print(f"{'tensor MB':>10} {'dense s':>9} {'growth':>7} {'blocks s':>9} {'growth':>7} {'gloo s':>9} "
          f"{'blocks vs gloo':>15}")
    for row in rows:
        print(f"{row['MB']:>10.0f} {row['dense']:>9.4f} {row['dense'] / rows[0]['dense']:>6.1f}x "
              f"{row['blocks']:>9.4f} {row['blocks'] / rows[0]['blocks']:>6.1f}x {row['gloo']:>9.4f} "
              f"{row['gloo'] / row['blocks']:>14.1f}x")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"workers": args.workers, "blocks": args.blocks, "block_size": BLOCK, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
