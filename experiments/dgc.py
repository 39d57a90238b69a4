"""Experiment E5: DGC vs plain top-k (both with error feedback / accumulation) on a small neural
network at 0.1% density: test accuracy per epoch. 4 workers are simulated in one process (their
contributions summed as the aggregator does). Appends a table and writes docs/compression_e5.png.

    python experiments/dgc.py --data DIR

Equal optimisers: DGC's momentum correction is momentum SGD (Lin et al., eq. (7)), so dense SGD and top-k
run with the same momentum (heavy ball on the aggregate, u ← m·u + ĝ, x ← x − η·u), beside the runs
without momentum. Every run over 3 seeds (model initialisation, shards, minibatches); a linear model
(logistic regression, dense, momentum) shows what the data allows without hidden layers, and the workers
training alone on their shards (no exchange, plain and momentum SGD) what communication adds. The bits
tables' target is the highest accuracy that dense SGD reaches in every seed, rounded down to 3 decimals,
and none where a worker training alone reaches it.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch

from compression import load_libsvm
from report import cheapest_level, update_sections

from zerosum import compression as C
from zerosum.compression.base import nonzero_blocks

BLOCK = 256                                     # the compressors' block size (their default), ZeroSum's too


def model(d, seed=0, linear=False):
    torch.manual_seed(seed)
    if linear:
        return torch.nn.Sequential(torch.nn.Linear(d, 2))
    return torch.nn.Sequential(torch.nn.Linear(d, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 2))


def step_bits(contributions, block_size=BLOCK):
    """Bits worker 0 sends in one step: in ZeroSum packets (with the header-only entries for the rounds
    only other workers open), and as its non-zero blocks' values with a block index each."""
    own = contributions[0]
    nblocks = -(-own.size // block_size)
    zerosum = 8 * C.wire_bytes(own, block_size, rounds=C.rounds_of(contributions, block_size))
    sent_blocks = int(nonzero_blocks(own, block_size).sum())
    return np.array([zerosum, sent_blocks * (32 * block_size + (nblocks - 1).bit_length())])


def train(name, make, X, y, Xt, yt, args, seed=0, momentum=0.0, linear=False, local=False):
    """Test accuracy after each epoch, and the bits worker 0 sent by then (ZeroSum packets, values and
    block indices: step_bits); `momentum` is heavy ball on the aggregate estimate (0: plain SGD). With
    local=True there is no exchange: each worker trains its own copy of the model on its own shard alone,
    sends nothing, and the accuracy is the mean over the workers' models."""
    nets = [model(X.shape[1], seed, linear) for _ in range(args.workers if local else 1)]
    comps = [make(r) for r in range(args.workers)]
    shards = np.array_split(np.random.default_rng(2 * seed).permutation(len(y)), args.workers)
    rng = np.random.default_rng(2 * seed + 1)
    velocities = [[torch.zeros_like(p) for p in net.parameters()] for net in nets]
    accs, bits, sent = [], [], np.zeros(2)
    for epoch in range(args.epochs):
        for c in comps:
            if hasattr(c, "set_epoch"):
                c.set_epoch(epoch)
        steps = len(shards[0]) // args.batch
        for _ in range(steps):
            contributions = []
            for r in range(args.workers):
                idx = rng.choice(shards[r], args.batch, replace=False)
                contributions.append(comps[r].compress(gradient(nets[r % len(nets)], X[idx], y[idx]), 0))
            if local:
                for r, net in enumerate(nets):
                    descend(net, velocities[r], comps[r].decompress(contributions[r], 1, 0), args.lr, momentum)
            else:
                sent += step_bits(contributions)
                est = comps[0].decompress(np.sum(contributions, axis=0), args.workers, 0)
                descend(nets[0], velocities[0], est, args.lr, momentum)
        with torch.no_grad():
            accs.append(float(np.mean([float((net(Xt).argmax(1) == yt).float().mean()) for net in nets])))
        bits.append(sent.copy())
        print(f"{name} (seed {seed}): epoch {epoch}: test accuracy {accs[-1]:.4f}", flush=True)
    return accs, bits


def gradient(net, X, y):
    """The minibatch loss's gradient as one flat float32 vector."""
    net.zero_grad()
    torch.nn.functional.cross_entropy(net(X), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()]).numpy()


def descend(net, velocity, est, lr, momentum):
    """One heavy-ball step on the flat estimate `est`: u ← momentum·u + est, x ← x − lr·u."""
    with torch.no_grad():
        off = 0
        for p, u in zip(net.parameters(), velocity):
            u.mul_(momentum).add_(torch.from_numpy(est[off: off + p.numel()].reshape(p.shape)))
            p -= lr * u
            off += p.numel()


def reading(results, names) -> list[str]:
    """Each compressed row against the dense row with the same optimiser, after the first and the last
    epoch (means over the seeds), the MLP against the linear model, and the workers training alone."""
    dense, topk, dense_m, topk_m, dgc, linear, local, local_m = names
    acc = {name: np.array(v) for name, v in results.items()}
    at = lambda name, e: acc[name][:, e].mean()
    lo = lambda name, e: acc[name][:, e].min()
    last = acc[dense].shape[1] - 1
    both = lambda a, b: (f"after epoch 1 {at(a, 0):.4f} against {at(b, 0):.4f}, after epoch {last + 1} "
                         f"{at(a, last):.4f} (lowest seed {lo(a, last):.4f}) against {at(b, last):.4f}")
    return ["Reading (means over the seeds; each compressed row against the dense row with the same optimiser):", "",
            f"- Top-k blocks + EF without momentum against dense SGD: {both(topk, dense)}.",
            f"- DGC (momentum inside) against dense momentum SGD: {both(dgc, dense_m)}. After one epoch DGC is "
            f"{at(dgc, 0) - at(dense_m, 0):+.4f} from dense momentum SGD while top-k + EF is "
            f"{at(topk, 0) - at(dense, 0):+.4f} from dense SGD; which of DGC's parts (momentum correction, "
            "masking, clipping, warm-up, sampled threshold) removes that first-epoch gap is not isolated.",
            f"- Top-k blocks + EF with heavy-ball momentum on the aggregate (the naive combination DGC's momentum "
            f"correction replaces, Lin et al. §3.2) against dense momentum SGD: {both(topk_m, dense_m)}.",
            f"- The linear model reaches {at(linear, 0):.4f} after one epoch and {acc[linear].max(axis=1).mean():.4f} "
            f"at its best epoch, the MLP with dense SGD {acc[dense].max(axis=1).mean():.4f}: on a9a the hidden "
            "layers add almost nothing, so this task separates the methods only by how fast and how stably "
            "they reach what a linear model reaches.",
            f"- Without exchange (each worker alone on its own shard; the mean over the workers' models) the "
            f"model reaches {at(local, last):.4f} after epoch {last + 1} without momentum (at most {acc[local].max():.4f} "
            f"after any epoch in any seed) and {at(local_m, last):.4f} with it (at most {acc[local_m].max():.4f}), "
            f"against {at(dense, last):.4f} and {at(dense_m, last):.4f} with exchange."]


def target_accuracy(results, dense_names, local_names):
    """The target of the bits tables, set from the dense and local rows before the compressed rows are
    read: the highest test accuracy that every dense row reaches in every seed within the epochs, rounded
    down to 3 decimals; None where a local row (no exchange) reaches it in some seed, as then no target
    tests communication."""
    target = math.floor(1000 * min(max(accs) for name in dense_names for accs in results[name])) / 1000
    return None if best_accuracy(results, local_names) >= target else target


def best_accuracy(results, names):
    """The highest test accuracy any of these rows reaches after any epoch in any seed."""
    return max(max(accs) for name in names for accs in results[name])


def topk_ef(density):
    return lambda r: C.TopKBlocks(density, True, block_size=BLOCK)


def dgc(density, momentum, workers):
    return lambda r: C.DGC(density, momentum=momentum, world=workers, seed=r, block_size=BLOCK)


def to_target(per_seed, counting, target):
    """(epochs until the test accuracy first reaches `target` or None, bits sent by then) per seed;
    counting: 0 for ZeroSum packets, 1 for values and block indices (step_bits)."""
    out = []
    for accs, bits in per_seed:
        hit = next((e for e, acc in enumerate(accs) if acc >= target), None)
        out.append((None, None) if hit is None else (hit + 1, bits[hit][counting]))
    return out


def density_table(trained, swept, names, args, d, steps_per_epoch, target):
    """Bits per worker to `target`: top-k + EF and DGC at the density set before training and at the best
    density in hindsight, against dense SGD with the same optimiser sent as plain floats."""
    dense, _, dense_m, *_, local, local_m = names
    results = {name: [accs for accs, _ in per_seed] for name, per_seed in trained.items()}
    alone = f"the workers training alone reach at most {best_accuracy(results, (local, local_m)):.4f} in any seed"
    if target is None:
        return ["", f"No bits to a target: {alone}, at least what dense SGD with and without momentum reaches in "
                f"every seed within {args.epochs} epochs, so no target tests communication."]
    densities = sorted({density for _, density in swept})
    values = sum(p.numel() for p in model(d).parameters())
    blocks = -(-values // BLOCK)
    dense_bits = lambda name: [(s, s and s * steps_per_epoch * 32 * values) for s, _ in to_target(trained[name], 0, target)]
    if any(s is None for name in (dense, dense_m) for s, _ in dense_bits(name)):
        return ["", f"Dense SGD does not reach {target:.3f} in every seed within {args.epochs} epochs: no bits to it."]
    plain = {name: np.mean([b for _, b in dense_bits(name)]) for name in (dense, dense_m)}
    countings = ((0, f"ZeroSum packets ({BLOCK}-value blocks, as run)"),
                 (1, f"values and block indices ({BLOCK} float32 + {(blocks - 1).bit_length()} bits a block)"))

    def cell(runs, baseline, level=None):
        if any(s is None for s, _ in runs):
            return "—"
        text = f"{ratio_text([b / baseline for _, b in runs])} [{np.mean([s for s, _ in runs]):.1f}]"
        return text if level is None else f"{level:g}: {text}"

    lines = ["", f"Bits per worker to a test accuracy of {target:.3f} (the highest accuracy that dense SGD with and "
             f"without momentum reaches in every seed within {args.epochs} epochs, rounded down to 3 decimals, a rule "
             f"set before the compressed rows were read; {alone}), as a multiple of the bits of dense SGD with the same optimiser sent as "
             f"plain float32 values without indices ({plain[dense] / 1e6:.1f} Mbit without momentum, "
             f"{plain[dense_m] / 1e6:.1f} Mbit with it; means over the seeds); the accuracy is measured after each "
             f"epoch, so epochs to the target (mean, in brackets) are whole; seeds {', '.join(map(str, args.seeds.split(',')))}: "
             f"mean (min–max); '—': not reached in every seed within {args.epochs} epochs. 'before training': "
             f"density {args.density:g}, the DGC paper's 99.9 % sparsity; 'best density in hindsight': the density of "
             f"the sweep {', '.join(f'{v:g}' for v in densities)} with the fewest bits to the target on average, "
             f"counted as in the row, named in the cell; on ties (densities that keep the same blocks run the same) the "
             f"smallest. Both keep whole {BLOCK}-value blocks and at least one of the model's {blocks}: top-k "
             f"round(density·{blocks}), so every density below {1.5 / blocks:.4f} is one block, DGC "
             f"ceil(density·{blocks}), its density being max(w, the final density) with w = 0.25, 0.0625, 0.0156, "
             "0.004, 0.001 in epochs 1–5 (its warm-up), the final density after).", "",
             "| method | bits counted | to the target, × dense plain floats |", "|---|---|--:|"]
    for method, base in (("top-k blocks + EF", dense), ("DGC", dense_m)):
        lines += [f"| {base} | plain float32, no indices | {cell(dense_bits(base), plain[base])} |",
                  f"| {base} | {countings[0][1]} | {cell(to_target(trained[base], 0, target), plain[base])} |"]
        for counting, how in countings:
            level, best = cheapest_level({v: to_target(swept[method, v], counting, target) for v in densities})
            lines += [f"| {method}, density {args.density:g} (before training) | {how} | "
                      f"{cell(to_target(swept[method, args.density], counting, target), plain[base])} |",
                      f"| {method}, best density in hindsight | {how} | "
                      f"{'—' if best is None else cell(best, plain[base], level)} |"]
    readings = [f"- {method}, {how}: {against_best_density(swept, method, args.density, densities, counting, target, plain[base], base)}."
                for method, base in (("top-k blocks + EF", dense), ("DGC", dense_m)) for counting, how in countings]
    return lines + ["", "Top-k + EF runs with plain SGD and is against dense SGD; DGC (momentum inside) against dense "
                    "momentum SGD. The sweep:", "", density_sweep_table(swept, densities, args, plain, names, target), "",
                    "Against the best density in hindsight (ratios of the mean bits over the seeds):", ""] + readings


def against_best_density(swept, method, stated, densities, counting, target, plain, base):
    """The density set before training against the best density in hindsight and against dense SGD's
    plain floats (`plain` bits), counted one way."""
    level, best = cheapest_level({v: to_target(swept[method, v], counting, target) for v in densities})
    mine = to_target(swept[method, stated], counting, target)
    best_text = ("no density of the sweep reaches the target in every seed" if best is None else
                 f"the best density in hindsight, {level:g}, needs {ratio_text([np.mean([b for _, b in best]) / plain])} "
                 f"the bits of {base} sent as plain floats")
    if any(s is None for s, _ in mine):
        reached = sum(s is not None for s, _ in mine)
        return f"density {stated:g} reaches the target in {reached} of {len(mine)} seeds; {best_text}"
    return (f"density {stated:g} needs {np.mean([b for _, b in mine]) / np.mean([b for _, b in best]):.2f}× the bits "
            f"of the best density in hindsight ({level:g}) and {ratio_text([np.mean([b for _, b in mine]) / plain])} "
            f"those of {base} sent as plain floats")


def density_sweep_table(swept, densities, args, plain, names, target):
    """Each density of the sweep: accuracy after the first and last epoch, and bits to `target`."""
    dense, _, dense_m, *_ = names
    rows = [f"| method | density | epoch 1 | epoch {args.epochs} | ZeroSum packets to {target:.3f}, × dense plain | "
            "values and block indices, × dense plain |", "|---|--:|--:|--:|--:|--:|"]
    for method, base in (("top-k blocks + EF", dense), ("DGC", dense_m)):
        for v in densities:
            accs = np.array([a for a, _ in swept[method, v]])
            cells = []
            for counting in (0, 1):
                runs = to_target(swept[method, v], counting, target)
                cells.append("—" if any(s is None for s, _ in runs) else
                             f"{ratio_text([b / plain[base] for _, b in runs])} [{np.mean([s for s, _ in runs]):.1f}]")
            rows.append(f"| {method} | {v:g} | {accs[:, 0].mean():.4f} | {accs[:, -1].mean():.4f} | "
                        f"{cells[0]} | {cells[1]} |")
    return "\n".join(rows)


def ratio_text(values):
    """A ratio over the seeds: mean (min–max), two decimals, or two significant digits below 0.1."""
    fmt = lambda v: f"{v:.2f}" if v >= 0.095 else f"{v:#.2g}"
    low, mean, high = fmt(min(values)), fmt(np.mean(values)), fmt(max(values))
    return f"{mean}×" if low == high else f"{mean}× ({low}–{high})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--sweep", default="0.0003,0.001,0.003,0.01,0.03,0.1",
                   help="densities of top-k + EF and DGC for the best fixed density in hindsight")
    p.add_argument("--out", default="docs")
    args = p.parse_args()
    torch.set_num_threads(1)
    X, y = load_libsvm(Path(args.data) / "a9a.xz")
    Xt, yt = load_libsvm(Path(args.data) / "a9a.t.xz")
    Xt = np.hstack([Xt, np.zeros((len(yt), X.shape[1] - Xt.shape[1]))])   # a9a.t lacks feature 123
    to = lambda a: torch.from_numpy(a.astype(np.float32))
    X, Xt = to(X), to(Xt)
    y, yt = torch.from_numpy((y > 0).astype(np.int64)), torch.from_numpy((yt > 0).astype(np.int64))
    m = args.momentum
    topk = topk_ef(args.density)
    dense = lambda r: C.NoCompression()
    runs = {     # name: (compressor per rank, momentum outside the compressor, linear model, no exchange)
        "dense SGD": (dense, 0.0, False, False),
        f"top-k blocks + EF ({args.density:g})": (topk, 0.0, False, False),
        f"dense SGD, momentum {m:g}": (dense, m, False, False),
        f"top-k blocks + EF ({args.density:g}), momentum {m:g}": (topk, m, False, False),
        f"DGC ({args.density:g}, warm-up, momentum {m:g} inside)":
            (dgc(args.density, m, args.workers), 0.0, False, False),
        f"linear model (logistic regression), dense, momentum {m:g}": (dense, m, True, False),
        "local (no exchange)": (dense, 0.0, False, True),
        f"local (no exchange), momentum {m:g}": (dense, m, False, True),
    }
    seeds = [int(v) for v in args.seeds.split(",")]
    trained = {name: [train(name, make, X, y, Xt, yt, args, seed, mom, linear, local) for seed in seeds]
               for name, (make, mom, linear, local) in runs.items()}
    results = {name: [accs for accs, _ in per_seed] for name, per_seed in trained.items()}
    names = list(runs)
    target = target_accuracy(results, (names[0], names[2]), names[6:])
    stated = {"top-k blocks + EF": trained[names[1]], "DGC": trained[names[4]]}
    swept = {}                                  # (method, density): [(accuracies, bits)] per seed
    for density in sorted({float(v) for v in args.sweep.split(",")} | {args.density}):
        for method, make in (("top-k blocks + EF", topk_ef(density)), ("DGC", dgc(density, m, args.workers))):
            swept[method, density] = stated[method] if density == args.density else \
                [train(f"{method} ({density:g})", make, X, y, Xt, yt, args, seed) for seed in seeds]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, per_seed in results.items():
        acc = np.array(per_seed)
        epochs = range(1, acc.shape[1] + 1)
        ax.plot(epochs, acc.mean(axis=0), "o-", label=name, markersize=3)
        ax.fill_between(epochs, acc.min(axis=0), acc.max(axis=0), alpha=0.15)
    ax.set_xlabel("epoch"); ax.set_ylabel("test accuracy (a9a.t)"); ax.legend(fontsize=7)
    ax.set_title(f"E5: DGC vs top-k, MLP on a9a, {args.workers} workers, {len(seeds)} seeds")
    fig.tight_layout(); fig.savefig(Path(args.out) / "compression_e5.png", dpi=110); plt.close(fig)
    shown = sorted({0, 1, 3, args.epochs - 1} & set(range(args.epochs)))
    lines = ["", f"## E5: DGC vs top-k at density {args.density:g} (MLP 124-256-256-2 on a9a, {args.workers} "
             f"simulated workers, batch {args.batch} each, lr {args.lr}, {args.epochs} epochs, seeds "
             f"{', '.join(map(str, seeds))})", "",
             "Generated by `python experiments/dgc.py --data DIR`. Test accuracy on a9a.t after the epoch: mean "
             "(min–max) over the seeds (model initialisation, shards and minibatches). DGC's momentum "
             "correction makes it momentum SGD, so dense SGD and top-k run with the same momentum too (heavy "
             "ball on the aggregate) beside the rows without momentum. DGC also clips locally, masks the "
             "momentum where sent, samples its threshold and warms its density up; no row isolates one of "
             "these. The linear model shows what the data allows without hidden layers. The local rows send "
             "nothing: each worker trains its own copy of the model (the same initialisation) alone on its own "
             "shard with the dense rows' optimiser (plain SGD, or momentum where named), batch and step size; "
             "their accuracy is the mean of the workers' models' accuracies, what a user gets from one "
             "worker's model on average.", "",
             "| method | " + " | ".join(f"epoch {e + 1}" for e in shown) + " | best epoch, mean |",
             "|---|" + "--:|" * (len(shown) + 1)]
    for name, per_seed in results.items():
        acc = np.array(per_seed)
        cells = [f"{acc[:, e].mean():.4f} ({acc[:, e].min():.4f}–{acc[:, e].max():.4f})" for e in shown]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {acc.max(axis=1).mean():.4f} |")
    lines += [""] + reading(results, list(runs))
    steps_per_epoch = len(np.array_split(np.arange(len(y)), args.workers)[0]) // args.batch
    lines += density_table(trained, swept, names, args, X.shape[1], steps_per_epoch, target)
    update_sections(Path(args.out) / "compression.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
