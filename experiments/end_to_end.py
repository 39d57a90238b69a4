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
from report import cheapest_level, spread, update_sections

from zerosum import compression as C
from zerosum.udp import free_port
from zerosum.local import CTX, LocalAggregator

B = 8   # block size: the 124-value model is 16 blocks


TAUS = (1, 2, 4, 8)          # blocks per worker of the sparsifiers' sweep (of m = 16)
QSGD_LEVELS = (2, 4, 16)


def stated_tau(n, m):
    """The level set before training, as in E1-E3: τ = ⌈m/n⌉ blocks per worker (the "99%" paper's m/n)."""
    return -(-m // n)


def families(n, m):
    """Each compressor with a level: its rows' names by level, and the level set before training."""
    tau = stated_tau(n, m)
    return {"top-k blocks + EF": ({t: f"ZeroSum top-k blocks + EF ({t}/{m})" for t in TAUS}, tau),
            "DIANA + random-k": ({t: f"ZeroSum DIANA + random-k ({t}/{m})" for t in TAUS}, tau),
            "QSGD": ({s: f"ZeroSum QSGD ({s} levels)" for s in QSGD_LEVELS}, None)}


def methods(n, m, L, rank, seed):
    """The compressors and their steps; `seed` draws the random ones' choices (QSGD's rounding, DIANA's
    blocks), the same on every rank."""
    rows = {"gloo dense": (None, 1 / L), "ZeroSum dense": (C.NoCompression(), 1 / L)}
    names = families(n, m)
    for t, name in names["top-k blocks + EF"][0].items():
        rows[name] = (C.TopKBlocks(t / m, True, block_size=B), 1 / L)
    for t, name in names["DIANA + random-k"][0].items():
        omega = m / t - 1
        rows[name] = (C.DIANA(C.RandomKBlocks(n, tau=t, seed=4 + 100 * seed, rank=rank, block_size=B), omega=omega),
                      1 / (L * (1 + 2 * omega / n)))
    for levels, name in names["QSGD"][0].items():
        q = C.QSGD(levels=levels, seed=9 + 100 * seed, rank=rank, block_size=B)
        rows[name] = (q, 1 / (L * (1 + q.omega / n)))
    return rows


def levels_table(runs, n, m) -> list[str]:
    """Per compressor: the level set before training and the best level in hindsight (the fewest seconds to
    the target on average over the seeds, among levels that reach it in every seed), against gloo."""
    base = [t for _, t, _ in runs["gloo dense"]]
    out = ["", f"Against the level a user would pick: the level set before training (τ = ⌈m/n⌉ = {stated_tau(n, m)} "
           "blocks per worker, as in E1-E3; QSGD has no such rule here) and the best level in hindsight over the "
           "sweep above (the fewest seconds to the target on average over the seeds, among levels that reach "
           "it in every seed); seconds and kB per worker as above, 'vs gloo' seed by seed.", "",
           "| compressor | set before training | its seconds | its kB | its vs gloo | best in hindsight | its seconds | "
           "its kB | its vs gloo | before / best (seconds) |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]

    def cells(per_seed):
        return (spread([t for _, t, _ in per_seed], 2), spread([b / 1e3 for _, _, b in per_seed], 0),
                spread([g / t for g, (_, t, _) in zip(base, per_seed)], 2, "×"))
    for family, (names, stated) in families(n, m).items():
        best, _ = cheapest_level({lv: [(s, t) for s, t, _ in runs[name]] for lv, name in names.items()})
        before = cells(runs[names[stated]]) if stated else ("—",) * 3
        after = cells(runs[names[best]]) if best is not None else ("—",) * 3
        ratio = (spread([a / b for (_, a, _), (_, b, _) in zip(runs[names[stated]], runs[names[best]])], 2, "×")
                 if stated and best is not None and all(s is not None for s, _, _ in runs[names[stated]]) else "—")
        out.append(f"| {family} | {stated if stated else '—'} | {' | '.join(before)} | "
                   f"{'—' if best is None else best} | {' | '.join(after)} | {ratio} |")
    return out


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
    m = -(-X.shape[1] // B)
    lines += levels_table(runs, args.workers, m)
    lines += ["", "gloo's bytes are the ring allreduce's (computed). A step here is dominated by local "
              "computation (the shard's gradient, and every 10 steps the loss on the full data to test the "
              "target), not by communicating a 124-value model: time follows the number of steps, and the "
              "methods differ in how many steps and bytes they need."]
    update_sections(Path(args.out), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
