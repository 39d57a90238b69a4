"""Experiment E6a: time to a target loss with each compressor through a real aggregator, against dense
gloo allreduce, on a small model: L2-regularised logistic regression on a LIBSVM dataset, one shard per
worker, 4 worker processes on this machine (E6 on the torch examples over shaped links is
experiments/training_schemes.py e6). Writes its section of docs/compression.md.

    python experiments/end_to_end.py --data DIR
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from compression import Problem, load_libsvm
from report import spread, update_sections

from zerosum import compression as C
from zerosum.udp import free_port
from zerosum.local import CTX, LocalAggregator

B = 8   # block size: the 124-value model is 16 blocks


def methods(n, m, L, rank, seed):
    """The compressors and their steps; `seed` draws the random ones' choices (QSGD's rounding, DIANA's
    blocks), the same on every rank."""
    tau = -(-m // n)
    omega = m / tau - 1
    slow = 1 / (L * (1 + 2 * omega / n))
    q = C.QSGD(levels=2, seed=9 + 100 * seed, rank=rank, block_size=B)
    return {
        "gloo dense": (None, 1 / L),
        "ZeroSum dense": (C.NoCompression(), 1 / L),
        "ZeroSum top-k blocks + EF (2/16)": (C.TopKBlocks(2 / m, True, block_size=B), 1 / L),
        "ZeroSum DIANA + random-k": (C.DIANA(C.RandomKBlocks(n, seed=4 + 100 * seed, rank=rank, block_size=B),
                                             omega=omega), slow),
        "ZeroSum QSGD (2 levels)": (q, 1 / (L * (1 + q.omega / n))),
    }


def worker(rank, n, X, y, lam, fstar, target, cap, aggregator, port, seeds, out):
    import torch
    import torch.distributed as dist
    import zerosum
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    prob = Problem(X, y, n, lam)
    L = 0.25 * np.linalg.eigvalsh(X.T @ X / len(y)).max() + lam
    m = -(-X.shape[1] // B)
    rows = {}                  # name -> [(steps, seconds, bytes sent) per seed]
    with zerosum.Worker(rank, n, [aggregator], block_size=B) as w:
        for seed, name, (comp, gamma) in ((s, *kv) for s in seeds for kv in methods(n, m, L, rank, s).items()):
            x = np.zeros(X.shape[1])
            dist.barrier()
            sent0, t0, steps = w.stats.bytes_sent, time.perf_counter(), None
            for step in range(1, cap + 1):
                g = prob.grad_i(x, rank).astype(np.float32)
                if comp is None:
                    t = torch.from_numpy(g)
                    dist.all_reduce(t)
                    est = t.numpy() / n
                else:
                    est = C.allreduce(w, g, comp, key=f"{name} {seed}")
                x = x - gamma * est.astype(np.float64)
                if step % 10 == 0 and prob.loss(x) - fstar <= target:   # every rank has the same x
                    steps = step
                    break
            elapsed = time.perf_counter() - t0
            rows.setdefault(name, []).append(
                (steps, elapsed, (w.stats.bytes_sent - sent0) if comp is not None else
                 2 * (n - 1) / n * X.shape[1] * 4 * (steps or cap)))
    dist.destroy_process_group()
    out.put((rank, rows))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--dataset", default="a9a")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--lam", type=float, default=1e-2)
    p.add_argument("--target", type=float, default=1e-4, help="target f − f*")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seeds", type=lambda t: [int(v) for v in t.split(",")], default=[0, 1, 2],
                   help="comma-separated seeds of the random compressors (QSGD, DIANA's random-k); every "
                        "method runs once per seed")
    p.add_argument("--out", default="docs/compression.md")
    args = p.parse_args()
    X, y = load_libsvm(Path(args.data) / f"{args.dataset}.xz")
    X = np.hstack([X, np.ones((len(y), 1))])
    _, fstar = Problem(X, y, 1, args.lam).optimum()
    agg = LocalAggregator(args.workers)
    port = free_port()
    out = CTX.Queue()
    procs = [CTX.Process(target=worker, args=(r, args.workers, X, y, args.lam, fstar, args.target, args.steps,
                                              agg.address, port, args.seeds, out)) for r in range(args.workers)]
    for pr in procs:
        pr.start()
    results = dict(out.get(timeout=3600) for _ in procs)
    for pr in procs:
        pr.join()
    agg.stop()
    # per method and seed: rank 0's steps and bytes, the slowest rank's seconds
    runs = {name: [(steps, max(results[r][name][i][1] for r in results), sent)
                   for i, (steps, _, sent) in enumerate(per_seed)] for name, per_seed in results[0].items()}
    seeds = ", ".join(map(str, args.seeds))
    lines = ["", f"## E6a: time to f − f* ≤ {args.target:g} through a real aggregator ({args.dataset}, "
             f"{args.workers} worker processes, block size {B}, one machine, seeds {seeds})", "",
             "Generated by `python experiments/end_to_end.py --data DIR`. Each method runs once per seed (the "
             "random compressors' draws; the others differ only in timing); a cell is the median over the "
             "seeds and (min-max) where they differ. 'vs gloo' divides gloo dense's time by the method's, "
             "seed by seed. '—': the target was not reached in --steps steps.", "",
             "| method | steps | seconds | ms per step | kB sent per worker | vs gloo |", "|---|--:|--:|--:|--:|--:|"]
    base = runs["gloo dense"]
    for name, per_seed in runs.items():
        steps = [s for s, _, _ in per_seed if s is not None]
        lines.append(
            f"| {name} | {spread(steps, 0) if steps else '—'} | {spread([t for _, t, _ in per_seed], 2)} | "
            f"{spread([t / (s or args.steps) * 1e3 for s, t, _ in per_seed], 2)} | "
            f"{spread([b / 1e3 for _, _, b in per_seed], 0)} | "
            f"{spread([g[1] / t for g, (_, t, _) in zip(base, per_seed)], 2, '×')} |")
    lines += ["", "gloo's bytes are the ring allreduce's (computed). A step here is dominated by local "
              "computation (the shard's gradient, and every 10 steps the loss on the full data to test the "
              "target), not by communicating a 124-value model: time follows the number of steps, and the "
              "methods differ in how many steps and bytes they need."]
    update_sections(Path(args.out), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
