"""E7: data and parameter placement for sparse logistic regression through ZeroSum (zerosum.placement).

    python3 experiments/partitioning.py                 # w8a + synthetic 10^5 and 10^6 features, 4 and 8 workers
    python3 experiments/partitioning.py --quick         # a smaller run (fewer steps, smaller synthetic sets)
    python3 experiments/partitioning.py --datasets w8a --workers 4

For every data set and worker count, the same logistic regression is trained under six placements:

- random:        samples split at random (balanced), features in their given order
- round_robin:   sample i on worker i mod W, given feature order
- metis:         samples partitioned by METIS on the sample-feature graph, given feature order
- random+freq:   random samples, features sorted by frequency (hot first)
- metis+freq:    METIS samples, features by frequency
- metis+cooc:    METIS samples, features grouped by the worker that uses them most, hot first within a
                 group (the two-step heuristic: data first, then parameters)

The synthetic sets' feature ids are scrambled (as hashed features are), so "given order" is a random
order. Each placement runs W worker processes against one local aggregator process on loopback
(zerosum.Worker, the real protocol). Steps are SGD on global minibatches: step s's samples are drawn
uniformly without replacement from all samples by a generator seeded with (seed, s), the same on every
rank and for every placement (zerosum.placement.minibatch_indices); each worker computes the gradient
of the step's samples it holds (dense vector of d floats, zero outside the features of those samples:
block-sparse), ZeroSum sums them, and every worker applies theta -= lr * sum / batch. The sum is the
same whatever the placement (up to ZeroSum's fixed-point rounding), so the loss curves coincide and
placement changes only who computes what, and what travels.

Measured per placement: non-zero blocks of a worker's gradient per step (mean over workers and steps,
and the busiest worker), union of the workers' blocks, bytes sent and received per worker and step
(zerosum.Worker.stats), the aggregator's rounds per step (its counters), step time (slowest rank),
wall-clock time to a target loss (90 % of the random placement's loss decrease), and partitioning
time (METIS + permutation), with the break-even number of steps (measured step-time saving) and the
one predicted for a 1 Gbit/s link from the measured bytes. The table also shows ZeroSum's predicted
bytes (zerosum.placement.Footprint.wire_bytes) next to the measured ones. A second table predicts
blocks and bytes without the network for several block sizes.

Writes docs/partitioning.json and docs/partitioning.png (--json, --figure).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from zerosum import placement as pl

from libsvm import read_libsvm
from ranks import Ranks, serve
from report import json_safe, steps_text

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data"
RESULT = "partitioning-result "

# name -> how to get it and how to train on it
SYNTHETIC = {  # planted_clusters parameters
    "synth-1e5": dict(samples=100_000, features=100_000, clusters=32, nnz=20, zipf=1.1, noise=0.1, seed=1),
    "synth-1e6": dict(samples=100_000, features=1_000_000, clusters=32, nnz=20, zipf=1.1, noise=0.1, seed=1),
}
QUICK = {"synth-1e5": dict(samples=20_000, features=100_000), "synth-1e6": dict(samples=20_000, features=1_000_000)}
LIBSVM = {"w8a": 300, "a9a": 123}
TRAIN = {  # block size, global batch, learning rate, steps
    "w8a": dict(block=8, batch=512, lr=1.0, steps=150),
    "a9a": dict(block=8, batch=512, lr=1.0, steps=150),
    "synth-1e5": dict(block=256, batch=1024, lr=20.0, steps=120),
    "synth-1e6": dict(block=256, batch=1024, lr=20.0, steps=120),
}
METHODS = [("random", "random", "identity"), ("round_robin", "round_robin", "identity"),
           ("metis", "metis", "identity"), ("random+freq", "random", "frequency"),
           ("metis+freq", "metis", "frequency"), ("metis+cooc", "metis", "cooccurrence")]
WARMUP = 3          # steps left out of the mean step time
LINK = 1e9          # bit/s for the predicted trade-off


# -- data -----------------------------------------------------------------------------------------------

def load_libsvm(path: Path, features: int) -> tuple[sp.csr_matrix, np.ndarray]:
    """A LIBSVM .xz file as (CSR float32 samples x features, labels in {0, 1}: the largest label is 1)."""
    rows, cols, vals, labels = read_libsvm(path)
    X = sp.csr_matrix((vals.astype(np.float32), (rows, cols)), shape=(len(labels), features))
    X.sum_duplicates()
    return X, (labels == labels.max()).astype(np.float32)


def dataset(name: str, data_dir: Path, quick: bool):
    if name in LIBSVM:
        X, y = load_libsvm(data_dir / f"{name}.xz", LIBSVM[name])
        return X, y, {"source": f"LIBSVM {name}"}
    params = {**SYNTHETIC[name], **(QUICK[name] if quick else {})}
    X, y, _ = pl.planted_clusters(**params)
    return X, y, {"source": "planted_clusters", **params}


def logistic_loss(X, y, theta) -> float:
    m = X @ theta
    return float(np.mean(np.logaddexp(0.0, m) - y * m))


# -- one worker rank (a process of its own) ----------------------------------------------------------------

def _serve(rank: int, world: int, datafile: str) -> int:
    """Load the data once, then run one placement per command line on stdin; answer on stdout."""
    import zerosum
    z = np.load(datafile)
    X = sp.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    y = z["y"]
    return serve(RESULT, rank, lambda cfg: _train(zerosum, rank, world, X, y, cfg))


def _train(zerosum, rank, world, X, y, cfg) -> dict:
    p = np.load(cfg["placement"])
    parts = p["parts"]
    perm = pl.Permutation.from_order(p["order"])
    n, d = X.shape
    Xp = perm.apply_columns(X)                 # the data in the model's (permuted) feature order
    mine = np.flatnonzero(parts == rank)
    local = np.full(n, -1, np.int64)
    local[mine] = np.arange(mine.size)
    X_loc, y_loc = Xp[mine], y[mine]
    block, batch, lr, steps = cfg["block"], cfg["batch"], cfg["lr"], cfg["steps"]
    theta = np.zeros(d, np.float64)            # the same on every rank, step after step
    grad = np.zeros(d, np.float32)
    total = np.zeros(d, np.float32)
    step_s, comm_s, blocks, held, snapshots = [], [], [], [], [(0, 0.0, theta.copy())]
    elapsed = 0.0
    with zerosum.Worker(rank, world, [cfg["address"]], job=cfg["job"], block_size=block, timeout=60) as w:
        before = (w.stats.bytes_sent, w.stats.bytes_received, w.stats.datagrams_sent, w.stats.datagrams_received)
        for s in range(steps):
            idx = pl.minibatch_indices(n, batch, s, cfg["seed"])
            t0 = time.perf_counter()
            rows = local[idx]
            rows = rows[rows >= 0]
            Xb = X_loc[rows]
            r = 1.0 / (1.0 + np.exp(-(Xb @ theta))) - y_loc[rows]
            grad[:] = Xb.T @ r
            t1 = time.perf_counter()
            w.allreduce(grad, out=total)
            t2 = time.perf_counter()
            theta -= (lr / batch) * total
            t3 = time.perf_counter()
            step_s.append(t3 - t0)
            comm_s.append(t2 - t1)
            elapsed += t3 - t0
            # measured outside the timers, by every rank at the same point of the step
            nz = np.flatnonzero(grad)
            blocks.append(int(np.unique(nz // block).size))
            held.append(int(rows.size))
            if rank == 0 and ((s + 1) % cfg["eval_every"] == 0 or s + 1 == steps):
                snapshots.append((s + 1, elapsed, theta.copy()))
        after = (w.stats.bytes_sent, w.stats.bytes_received, w.stats.datagrams_sent, w.stats.datagrams_received)
        slots = w.slots
    out = {"rank": rank, "slots": slots, "step_s": float(np.mean(step_s[WARMUP:])),
           "comm_s": float(np.mean(comm_s[WARMUP:])), "blocks": float(np.mean(blocks)),
           "blocks_series": blocks, "samples": float(np.mean(held)),
           "sent": (after[0] - before[0]) / steps, "received": (after[1] - before[1]) / steps,
           "datagrams_sent": (after[2] - before[2]) / steps, "datagrams_received": (after[3] - before[3]) / steps,
           "retransmitted": int(w.stats.retransmitted_entries)}
    if rank == 0:
        # the model back in the original feature order, and the loss on all samples there
        curve = [(s, t, logistic_loss(X, y, perm.unpermute_vector(th))) for s, t, th in snapshots]
        out["curve"] = curve
        np.save(cfg["theta_out"], perm.unpermute_vector(theta))
    return out


# -- the driver -------------------------------------------------------------------------------------------

def _placement(X, world, block, sample_method, feature_method, seed):
    asg = pl.partition_samples(X, world, 1, sample_method, seed=seed)
    perm = pl.feature_permutation(X, block, feature_method, parts=asg.parts, workers=world)
    return asg, perm


def run_dataset(name, X, y, world, args, agg, tmp, job0) -> list[dict]:
    """Every placement on W worker processes, `args.repeats` times in alternating order (the timing
    of a shared 2-core machine drifts); counts are the same in every repeat, times are medians."""
    train = dict(TRAIN[name])
    if args.steps:
        train["steps"] = args.steps
    elif args.quick:
        train["steps"] = max(20, train["steps"] // 3)
    n, d = X.shape
    block, steps = train["block"], train["steps"]
    datafile = os.path.join(tmp, f"{name}.npz")
    if not os.path.exists(datafile):
        np.savez(datafile, data=X.data, indices=X.indices, indptr=X.indptr, shape=np.array(X.shape), y=y)
    batches = [pl.minibatch_indices(n, train["batch"], s, args.seed) for s in range(steps)]
    placements, runs = {}, {label: [] for label, _, _ in METHODS}
    for label, sm, fm in METHODS:
        asg, perm = _placement(X, world, block, sm, fm, args.seed)
        path = os.path.join(tmp, f"{name}-{world}-{label}.npz")
        np.savez(path, parts=asg.parts, order=perm.inverse)
        placements[label] = (asg, perm, path)
    ranks = Ranks(__file__, RESULT, world, datafile)
    job = job0
    try:
        for rep in range(args.repeats):
            for label, _, _ in (METHODS if rep % 2 == 0 else METHODS[::-1]):
                cfg = {"placement": placements[label][2], "address": agg.address, "job": job, "block": block,
                       "batch": train["batch"], "lr": train["lr"], "steps": steps, "seed": args.seed,
                       "eval_every": max(1, steps // 20),
                       "theta_out": os.path.join(tmp, f"{name}-{world}-{label}-theta.npy")}
                job += 1
                c0 = agg.snapshot()
                t0 = time.perf_counter()
                reports = ranks.run(cfg)
                wall = time.perf_counter() - t0
                c1 = agg.snapshot()
                runs[label].append((reports, (c1.get("rounds", 0) - c0.get("rounds", 0)) / steps, wall))
                step = max(r["step_s"] for r in reports)
                print(f"  {name} W={world} {label:<12} run {rep + 1}: step {step * 1e3:6.1f} ms ({wall:.1f} s)",
                      flush=True)
    finally:
        ranks.close()
    rows = []
    for label, sm, fm in METHODS:
        asg, perm, _ = placements[label]
        reports, rounds, _ = runs[label][0]
        # predicted from the placement alone (no network): the same steps' minibatches
        fp = pl.block_footprint(perm.apply_columns(X), asg.parts, block, workers=world, batches=batches)
        pred = fp.wire_bytes(reports[0]["slots"])
        curves = [next(r for r in rep if r["rank"] == 0)["curve"] for rep, _, _ in runs[label]]
        step_times = [max(r["step_s"] for r in rep) for rep, _, _ in runs[label]]
        row = {"dataset": name, "workers": world, "method": label, "samples": sm, "features": fm,
               "block": block, "nblocks": fp.nblocks, "batch": train["batch"], "steps": steps,
               "lr": train["lr"], "slots": reports[0]["slots"], "repeats": args.repeats,
               "partition_s": asg.seconds, "permutation_s": perm.seconds,
               "placement_s": asg.seconds + perm.seconds, "sizes": [int(v) for v in asg.sizes],
               "moved": asg.moved, "edge_cut": asg.edge_cut,
               "blocks": float(np.mean([r["blocks"] for r in reports])),
               "blocks_max": float(np.mean(np.max([r["blocks_series"] for r in reports], axis=0))),
               "union": fp.mean_union, "overlap": fp.overlap,
               "pred_blocks": fp.mean_per_worker, "pred_sent": pred["sent_mean"],
               "pred_received": pred["received"], "pred_rounds": pred["rounds"],
               "sent": float(np.mean([r["sent"] for r in reports])),
               "sent_max": float(np.max([r["sent"] for r in reports])),
               "received": float(np.mean([r["received"] for r in reports])),
               "received_max": float(np.max([r["received"] for r in reports])),
               "datagrams": float(np.mean([r["datagrams_sent"] for r in reports])),
               "rounds": rounds,
               "retransmitted": int(sum(r["retransmitted"] for rep, _, _ in runs[label] for r in rep)),
               "step_s": float(np.median(step_times)), "step_s_runs": step_times,
               "comm_s": float(np.median([max(r["comm_s"] for r in rep) for rep, _, _ in runs[label]])),
               "wall_s": [w for _, _, w in runs[label]], "curve": curves[0], "curves": curves,
               "theta": os.path.join(tmp, f"{name}-{world}-{label}-theta.npy")}
        rows.append(row)
    return rows


def finish(rows: list[dict]) -> None:
    """Ratios against random, time to target, the trade-off, the loss curves' agreement."""
    groups = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["workers"]), []).append(r)
    for (name, world), rs in groups.items():
        base = next(r for r in rs if r["method"] == "random")
        l0, lend = base["curve"][0][2], base["curve"][-1][2]
        target = l0 - 0.9 * (l0 - lend)
        theta0 = np.load(base["theta"])
        for r in rs:
            r["target_loss"] = target
            hits = [next(((s, t) for s, t, loss in curve if loss <= target), (None, None)) for curve in r["curves"]]
            r["steps_to_target"] = hits[0][0]
            r["time_to_target_s"] = None if hits[0][0] is None else float(np.median([t for _, t in hits]))
            r["final_loss"] = r["curve"][-1][2]
            r["loss_diff_vs_random"] = max(abs(a[2] - b[2]) for a, b in zip(r["curve"], base["curve"]))
            r["theta_diff_vs_random"] = float(np.max(np.abs(np.load(r["theta"]) - theta0)))
            for key in ("blocks", "sent", "received", "rounds", "step_s"):
                r[f"{key}_ratio"] = base[key] / r[key] if r[key] else math.inf
            busy_base = max(base["sent_max"], base["received_max"])
            busy = max(r["sent_max"], r["received_max"])
            if r["method"] == "random":
                r["break_even_measured"] = r["break_even_1gbit"] = 0.0
                continue
            m = pl.tradeoff(r["placement_s"], baseline_step_seconds=base["step_s"], placed_step_seconds=r["step_s"])
            p = pl.tradeoff(r["placement_s"], baseline_bytes=busy_base, placed_bytes=busy, link_bits_per_second=LINK)
            r["break_even_measured"] = m.break_even_steps
            r["break_even_1gbit"] = p.break_even_steps
            r["pick_for_run"] = m.pick(r["steps"])


def table(rows: list[dict]) -> str:
    head = ("| data | W | placement | blocks/worker/step | busiest | union | bytes sent/worker/step | "
            "received | rounds/step | step ms | time to target s | placement s | break-even steps "
            "(measured / 1 Gbit/s) |")
    out = [head, "|" + "---|" * 13]
    for r in rows:
        be = "—" if r["method"] == "random" else \
            f"{steps_text(r['break_even_measured'])} / {steps_text(r['break_even_1gbit'])}"
        ttt = "—" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f}"
        out.append(f"| {r['dataset']} | {r['workers']} | {r['method']} | {r['blocks']:.1f} ({r['blocks_ratio']:.2f}x) | "
                   f"{r['blocks_max']:.1f} | {r['union']:.0f} | {_kb(r['sent'])} ({r['sent_ratio']:.2f}x) | "
                   f"{_kb(r['received'])} ({r['received_ratio']:.2f}x) | {r['rounds']:.0f} | "
                   f"{r['step_s'] * 1e3:.1f} ({r['step_s_ratio']:.2f}x) | {ttt} | {r['placement_s']:.2f} | {be} |")
    return "\n".join(out)


def _kb(v: float) -> str:
    return f"{v / 1e3:.1f} kB"


def check_table(rows: list[dict]) -> str:
    out = ["| data | W | placement | predicted blocks/worker | measured | predicted sent | measured sent | "
           "predicted received | measured received | predicted rounds | measured rounds | "
           "max loss diff vs random | max param diff vs random | retransmitted |", "|" + "---|" * 14]
    for r in rows:
        out.append(f"| {r['dataset']} | {r['workers']} | {r['method']} | {r['pred_blocks']:.1f} | {r['blocks']:.1f} | "
                   f"{_kb(r['pred_sent'])} | {_kb(r['sent'])} | {_kb(r['pred_received'])} | {_kb(r['received'])} | "
                   f"{r['pred_rounds']:.0f} | {r['rounds']:.0f} | {r['loss_diff_vs_random']:.1e} | "
                   f"{r['theta_diff_vs_random']:.1e} | {r['retransmitted']} |")
    return "\n".join(out)


def sweep(name, X, world, blocks, batch, steps, seed) -> list[dict]:
    """Predicted blocks and bytes per step (no network) for several block sizes."""
    n = X.shape[0]
    batches = [pl.minibatch_indices(n, batch, s, seed) for s in range(steps)]
    placements = {label: _placement(X, world, 1, sm, fm, seed) for label, sm, fm in METHODS}
    out = []
    for block in blocks:
        base = None
        for label, _, _ in METHODS:
            asg, perm = placements[label]
            Xp = perm.apply_columns(X)
            fp = pl.block_footprint(Xp, asg.parts, block, workers=world, batches=batches)
            full = pl.block_footprint(Xp, asg.parts, block, workers=world)
            wb = fp.wire_bytes(min(2048, fp.nblocks))
            row = {"dataset": name, "workers": world, "block": block, "method": label, "nblocks": fp.nblocks,
                   "blocks": fp.mean_per_worker, "union": fp.mean_union, "overlap": fp.overlap,
                   "full_blocks": full.mean_per_worker, "full_union": full.mean_union,
                   "sent": wb["sent_mean"], "received": wb["received"]}
            base = base or row
            for key in ("blocks", "full_blocks", "sent", "received"):
                row[f"{key}_ratio"] = base[key] / row[key] if row[key] else math.inf
            out.append(row)
    return out


def sweep_table(rows) -> str:
    out = ["| data | W | block | placement | blocks/worker/step (minibatch) | union | overlap | "
           "blocks/worker (full batch) | predicted sent | predicted received |", "|" + "---|" * 10]
    for r in rows:
        out.append(f"| {r['dataset']} | {r['workers']} | {r['block']} | {r['method']} | "
                   f"{r['blocks']:.0f} ({r['blocks_ratio']:.1f}x) | {r['union']:.0f} | {r['overlap']:.2f} | "
                   f"{r['full_blocks']:.0f} ({r['full_blocks_ratio']:.1f}x) | {_kb(r['sent'])} ({r['sent_ratio']:.1f}x) | "
                   f"{_kb(r['received'])} ({r['received_ratio']:.1f}x) |")
    return "\n".join(out)


def figure(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = []
    for r in rows:
        if (r["dataset"], r["workers"]) not in groups:
            groups.append((r["dataset"], r["workers"]))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    # loss against wall-clock time, for the largest synthetic set with the most workers
    name, world = max(groups, key=lambda g: (g[0].startswith("synth"), g[0], g[1]))
    for i, r in enumerate(x for x in rows if (x["dataset"], x["workers"]) == (name, world)):
        for k, curve in enumerate(r["curves"]):       # every repeat: the spread is the machine's noise
            axes[0].plot([c[1] for c in curve], [c[2] for c in curve], color=f"C{i}", lw=1.2 if k == 0 else 0.6,
                         marker="." if k == 0 else None, label=r["method"] if k == 0 else None)
    axes[0].axhline(next(r["target_loss"] for r in rows if (r["dataset"], r["workers"]) == (name, world)),
                    color="gray", ls=":", lw=1, label="target")
    axes[0].set(xlabel="wall-clock s (sum of step times, rank 0; thin: other repeats)",
                ylabel="training loss (all samples)", title=f"{name}, {world} workers: loss vs time")
    axes[0].legend(fontsize=7)
    labels = [m for m, _, _ in METHODS]
    width = 0.8 / len(groups)
    for i, (name, world) in enumerate(groups):
        rs = {r["method"]: r for r in rows if (r["dataset"], r["workers"]) == (name, world)}
        x = np.arange(len(labels)) + i * width
        axes[1].bar(x, [rs[m]["blocks_ratio"] for m in labels], width, label=f"{name} W={world}")
        axes[2].bar(x, [(rs["random"]["sent"] + rs["random"]["received"]) / (rs[m]["sent"] + rs[m]["received"])
                        for m in labels], width, label=f"{name} W={world}")
    for ax, what in ((axes[1], "non-zero blocks per worker and step"), (axes[2], "bytes sent + received per worker")):
        ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, rotation=30, fontsize=8)
        ax.axhline(1.0, color="gray", lw=1)
        ax.set(ylabel="random / placement (x fewer)", title=what)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", nargs="+", default=["w8a", "synth-1e5", "synth-1e6"],
                    choices=[*LIBSVM, *SYNTHETIC])
    ap.add_argument("--workers", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory with the LIBSVM .xz files")
    ap.add_argument("--steps", type=int, help="steps per run (default per data set)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="runs of every placement (alternating order)")
    ap.add_argument("--quick", action="store_true", help="smaller synthetic sets, fewer steps")
    ap.add_argument("--no-sweep", action="store_true", help="skip the predicted block-size sweep")
    ap.add_argument("--json", default=str(ROOT / "docs" / "partitioning.json"))
    ap.add_argument("--figure", default=str(ROOT / "docs" / "partitioning.png"))
    ap.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return _serve(int(args.serve[0]), int(args.serve[1]), args.serve[2])
    from zerosum.local import LocalAggregator

    rows, sweeps, sets = [], [], {}
    agg = LocalAggregator(None)
    job = 100
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.datasets:
                if name in LIBSVM and not (args.data / f"{name}.xz").exists():
                    print(f"skipping {name}: {args.data / (name + '.xz')} not found (--data DIR)")
                    continue
                t0 = time.perf_counter()
                X, y, info = dataset(name, args.data, args.quick)
                info.update(samples=X.shape[0], features=X.shape[1], nnz=int(X.nnz),
                            used_features=int((np.bincount(X.indices, minlength=X.shape[1]) > 0).sum()),
                            positive=float(y.mean()), load_s=time.perf_counter() - t0, **TRAIN[name])
                sets[name] = info
                print(f"{name}: {X.shape[0]:,} samples x {X.shape[1]:,} features, {X.nnz / X.shape[0]:.1f} non-zeros "
                      f"per sample, {info['used_features']:,} features used", flush=True)
                for world in args.workers:
                    rows += run_dataset(name, X, y, world, args, agg, tmp, job)
                    job += len(METHODS) * args.repeats
                if name in SYNTHETIC and not args.no_sweep:
                    for world in args.workers:
                        sweeps += sweep(name, X, world, (16, 64, 256), TRAIN[name]["batch"], 20, args.seed)
            finish(rows)
    finally:
        counters = agg.stop()
    for r in rows:
        r.pop("theta", None)
    print()
    print("E7, measured (ZeroSum on loopback; ratios: random / placement, >1 is better)")
    print(table(rows))
    print()
    print("Predicted (zerosum.placement.Footprint) against measured, and agreement of the results")
    print(check_table(rows))
    if sweeps:
        print()
        print("Predicted without the network, 20 minibatch steps and full batch, by block size (bootstrap "
              "columns: min(2048, blocks))")
        print(sweep_table(sweeps))
    verdict(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_safe({"datasets": sets, "link_bits_per_second": LINK, "rows": rows, "sweep": sweeps,
                             "aggregator": {k: v for k, v in counters.items() if not k.startswith("drop")}}),
                      f, indent=1)
        print(f"wrote {args.json}")
    if args.figure and rows:
        figure(rows, args.figure)
        print(f"wrote {args.figure}")
    return 0


def verdict(rows):
    """Say which goals were met, with the numbers."""
    print()
    best = {}
    for r in rows:
        if r["method"] == "random":
            continue
        key = (r["dataset"], r["workers"])
        if key not in best or r["blocks_ratio"] > best[key]["blocks_ratio"]:
            best[key] = r
    for (name, world), r in best.items():
        several = r["blocks_ratio"] >= 3
        print(f"{name} W={world}: best placement {r['method']}: {r['blocks_ratio']:.1f}x fewer non-zero blocks per "
              f"worker, {r['sent_ratio']:.1f}x fewer bytes sent, {r['received_ratio']:.1f}x fewer received, step time "
              f"{r['step_s_ratio']:.2f}x -> {'several-fold: met' if several else 'several-fold: NOT met'}; "
              f"loss curves differ by at most {r['loss_diff_vs_random']:.1e}")


if __name__ == "__main__":
    sys.exit(main())
