"""Training schemes against the wall clock: the torch examples trained with several ways of exchanging
gradients side by side (zerosum.examples.schemes), on loopback or over rate-limited links.

    sudo python3 experiments/training_schemes.py e6              # compressors, 1 Gbit/s links (~25 min a seed)
    sudo python3 experiments/training_schemes.py e6levels        # E6's compressors at other levels
    sudo python3 experiments/training_schemes.py s1              # local SGD periods
    sudo python3 experiments/training_schemes.py s3              # one-step delayed gradients (s1's run
                                                                 # trains them too and writes S3's section)
    sudo python3 experiments/training_schemes.py e6 --example mlp   # one model again; the other's results stay
    python3 experiments/training_schemes.py e6 --rate loopback --example mlp --steps 60 --seeds 0   # a quick look

Each experiment trains the embedding example and the MLP (zerosum.examples.embedding / .mlp) with every
scheme of its list, one after another in the same processes, from the same initial model on the same
batches: W workers (--workers, default 4), each on a host of its own behind a link shaped to --rate both
ways (experiments/shaped_network.py: network namespaces, veth, tbf; one aggregator on every worker's
host, so ZeroSum uses the same hosts and links as gloo), or all on loopback with --rate loopback.

Reported per scheme: bytes sent and received per worker and step (ZeroSum's own counters; gloo's ring
allreduce computed), the step time (steady state), the loss after the fixed number of samples, and the
wall-clock time and samples to a target loss. The loss is the mean over ranks of each step's minibatch
loss, smoothed by a trailing mean over --smooth steps; the target is the smoothed loss that every-step
ZeroSum ("zerosum") reaches at 75 % of its steps, unless --target gives one. Wall-clock time counts the
untimed warm-up steps (numba's and DDP's first-iteration work) at the scheme's steady step time.

Writes docs/<experiment>_<where>.json and docs/<experiment>_<where>_<model>.png (loss against
wall-clock time, one figure per model) and replaces the experiment's section in its document (E6: docs/compression.md; S1, S3:
docs/sync.md). The CPU (2 cores here) is shared by every process, so the step times are upper bounds on
what separate hosts take.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from report import json_safe, spread, update_sections
from shaped_network import LOOPBACK, add_link_options, split_example_args, unwind_on_sigterm

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# The examples' training settings for these runs: Adam, because the embedding example barely moves
# from log 2 with plain SGD in a few hundred steps (its clicks depend on single rows' hidden weights);
# momentum SGD on the MLP, because with plain SGD each rank training alone ('local') reached the loss
# of every-step ZeroSum at 75 % of its steps with the same samples (the target did not test the
# exchange), while with momentum 0.9 the averaged gradient's lower noise reaches losses the ranks alone
# never do. DGC runs plain SGD there: its momentum correction is the momentum (Scheme.carries_momentum).
MODELS = {
    "embedding": ["--optimizer", "adam", "--lr", "0.01", "--batch", "256"],
    "mlp": ["--optimizer", "momentum", "--lr", "0.05", "--batch", "128"],
}


@dataclass(frozen=True)
class Experiment:
    key: str
    title: str
    doc: str
    schemes: str
    steps: int
    about: str
    within: str | None = None     # another experiment whose run also holds this one's schemes


EXPERIMENTS = {
    "e6": Experiment("E6", "compressors in wall-clock time", "compression.md",
                     "local,gloo,zerosum,topk:0.01,dgc:0.01,qsgd:4,terngrad,efsign,diana:1", 300,
                     "each compressor through the real DDP hook (zerosum.torch.register(model, worker, "
                     "compressor)): top-k blocks with error feedback at density 0.01 (`topk:0.01`), DGC to "
                     "density 0.01 with its warm-up (`dgc:0.01`), QSGD with 4 levels, TernGrad, scaled sign "
                     "with error feedback (`efsign`), DIANA over random-k blocks with tau = ceil(m/W) "
                     "(`diana:1`), against uncompressed ZeroSum and gloo's ring allreduce"),
    "e6levels": Experiment("E6 levels", "the best fixed level in hindsight", "compression.md",
                           "zerosum,topk:0.003,topk:0.03,topk:0.1,dgc:0.03,dgc:0.1,qsgd:2,qsgd:16", 300,
                           "each compressor of E6 that has a level at levels around E6's (which were set before "
                           "training: density 0.01 for top-k and DGC, 4 levels for QSGD), through the same DDP "
                           "hook, with uncompressed ZeroSum, whose run sets the target as in E6; a model's "
                           "command names its list where it is not this default"),
    "s1": Experiment("S1", "periodic model averaging (local SGD)", "sync.md",
                     "local,gloo,zerosum,localsgd:2:10,localsgd:4:10,localsgd:8:10,localsgd:16:10,delayed", 300,
                     "post-local SGD (zerosum.sync.PostLocalSGDState + PeriodicModelAverager): 10 warm-up steps "
                     "averaging gradients every step, then the model averaged every H steps (`localsgd:H:10`), "
                     "against every-step ZeroSum (H = 1) and gloo"),
    "s3": Experiment("S3", "one-step delayed gradients", "sync.md", "local,zerosum,delayed", 300,
                     "zerosum.sync.delayed_gradient_hook (step t applies the average of step t-1's gradients, "
                     "so each allreduce overlaps a whole step) against synchronous every-step ZeroSum", within="s1"),
}


def launch(example: str, schemes: str, args, extra: list[str]) -> dict:
    """One training run of `example` with `schemes`; returns the harness's report (rank 0's JSON)."""
    example_args = ["--schemes", schemes, "--steps", str(args.steps), "--warmup", str(args.warmup),
                    *MODELS[example], *extra]
    if args.rate != LOOPBACK:
        from shaped_network import run
        return run(args.rate, args.workers, 0, example, args.mtu, example_args, args.timeout)
    torchrun = shutil.which("torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
            "--standalone", "--nproc-per-node", str(args.workers), "-m", f"zerosum.examples.{example}",
            *example_args, "--json", str(report)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("ZEROSUM_AGGREGATORS", None)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=tmp, env=env)
        if r.returncode != 0:
            raise SystemExit(f"{example} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        print(r.stdout, end="", flush=True)
        return json.loads(report.read_text())


def profile(example: str, world: int, extra: list[str], warm: int = 10, periods=(1, 2, 4, 8, 16)):
    """Block densities for the cost model (zerosum.costmodel.Densities), measured without any exchange:
    every rank's replica of the model trains on its own batches (the harness's model, seeds and
    optimizer) for `warm` steps, then for max(periods) more, recording each step's gradient blocks and
    the blocks the parameters changed in over h steps. Blocks of 256 values over the parameters
    flattened in reverse order (DDP's bucket order, as one bucket). Returns (Densities, numel)."""
    import copy
    import importlib
    import torch
    from zerosum import costmodel as CM
    from zerosum.examples.harness import OPTIMIZERS
    module = importlib.import_module(f"zerosum.examples.{example}")
    o = module.arguments(MODELS[example] + extra)      # the run's own options, parsed as it parses them
    make, batch, loss_fn = module.task(o)
    torch.manual_seed(o.seed)
    initial = make()

    def blocks(tensors):
        flat = torch.cat([t.reshape(-1) for t in reversed(tensors)])
        flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 256))
        return (flat.reshape(-1, 256) != 0).any(1).numpy()

    grads, changes = [], []
    for rank in range(world):
        model = copy.deepcopy(initial)
        opt = OPTIMIZERS[o.optimizer](model.parameters(), lr=o.lr)
        gen = torch.Generator().manual_seed(o.seed * 1000 + rank)
        mine, change = [], {}
        for step in range(warm + max(periods)):
            if step == warm:
                anchor = [q.detach().clone() for q in model.parameters()]
            inputs, target = batch(gen, o.batch)
            opt.zero_grad()
            loss_fn(model(*inputs), target).backward()
            if step >= warm:
                mine.append(blocks([q.grad for q in model.parameters()]))
            opt.step()
            h = step - warm + 1
            if h in periods:
                change[h] = blocks([q.detach() - a for q, a in zip(model.parameters(), anchor)])
        grads.append(mine)
        changes.append(change)
    own = {1: float(np.mean([g.mean() for mine in grads for g in mine]))}
    union = {1: float(np.mean([np.any([grads[r][s] for r in range(world)], axis=0).mean()
                               for s in range(max(periods))]))}
    for h in periods[1:]:
        own[h] = float(np.mean([c[h].mean() for c in changes]))
        union[h] = float(np.any([c[h] for c in changes], axis=0).mean())
    return CM.Densities(own, union), sum(q.numel() for q in initial.parameters())


def predictions(rows: list[dict], densities, numel: int, world: int, rate: str) -> None:
    """Add the cost model's bytes and step time to every row (the rate's link time on top of the
    measured step time without exchange, 'local'; delayed: the larger of the two)."""
    from zerosum import costmodel as CM
    from zerosum.examples.schemes import parse
    from shaped_network import _bits
    local = next((r["step_ms"] for r in rows if r["scheme"] == "local"), None)
    for r in rows:
        s = parse(r["scheme"])
        if s.kind in ("local", "tracked"):     # tracked: its density is chosen during the run
            continue
        extra = {"period": int(s.args[0])} if s.kind == "localsgd" else {"density": s.density(world)}
        cost = CM.scheme_step(s.kind, numel, world, densities, **extra)
        r["predicted_sent_mb"], r["predicted_received_mb"] = cost.sent / 1e6, cost.received / 1e6
        if rate != LOOPBACK and local is not None:
            link = CM.link_seconds(s.kind, cost, world, _bits(rate)) * 1e3
            r["predicted_step_ms"] = max(local, link) if s.kind == "delayed" else local + link


def smoothed(losses, window: int) -> np.ndarray:
    x = np.asarray(losses, float)
    c = np.cumsum(np.concatenate([[0.0], x]))
    lo = np.maximum(np.arange(1, len(x) + 1) - window, 0)
    return (c[1:] - c[lo]) / (np.arange(1, len(x) + 1) - lo)


def wall_clock(report: dict) -> np.ndarray:
    """Seconds at the end of every step: the timed steps' clock, plus the warm-up steps at the steady
    step time."""
    w, step = report["warmup_steps"], report["step_s"]
    head = [(i + 1) * step for i in range(w)]
    return np.array(head + [w * step + c for c in report["clock_s"][w:]])


def summarize(report: dict, world: int, target: float, window: int) -> dict:
    loss = smoothed(report["mean_losses"], window)
    clock = wall_clock(report)
    reached = np.flatnonzero(loss <= target)
    hit = int(reached[0]) if reached.size else None
    samples = report["batch"] * world
    return {"scheme": report["mode"], "step_ms": report["step_s"] * 1e3,
            "sent_mb": report["bytes_sent_per_step"] / 1e6, "received_mb": report["bytes_received_per_step"] / 1e6,
            "resent_entries": report["retransmitted_entries"], "final_loss": float(loss[-1]),
            "samples": len(loss) * samples,
            "time_to_target_s": None if hit is None else float(clock[hit]),
            "samples_to_target": None if hit is None else (hit + 1) * samples,
            "curve": {"seconds": clock.tolist(), "loss": loss.tolist()},
            **({"levels": levels_summary(report["levels"])} if "levels" in report else {})}


def levels_summary(levels: list[dict]) -> list[dict]:
    """Per bucket of a tracked scheme (TrackedTopKBlocks.report, rank 0's): its blocks, the share of
    its steps at the dense level (every block: uncompressed), the mean share of blocks kept in the
    others, the last k, and the levels of its finished segments in order."""
    out = []
    for b in (b for b in levels if b["k"]):
        k = np.asarray(b["k"])
        sparse = k[k < b["blocks"]]
        out.append({"blocks": b["blocks"], "steps": len(k), "dense_share": float(np.mean(k == b["blocks"])),
                    "sparse_density": float(sparse.mean() / b["blocks"]) if sparse.size else None,
                    "last_k": int(k[-1]), "segments": [level for level, _ in b["segments"]]})
    return out


def levels_lines(rows: list[dict]) -> str:
    return "\n".join(f"{r['scheme']}: bucket of {b['blocks']} blocks, {b['steps']} steps, "
                     f"{b['dense_share']:.0%} of them dense, the others keeping "
                     f"{'-' if b['sparse_density'] is None else format(b['sparse_density'], '.4f')} of the blocks "
                     f"on average; last k {b['last_k']}; segments {b['segments']}"
                     for r in rows for b in r.get("levels", []))


def target_of(reports: list[dict], window: int) -> float:
    base = next((r for r in reports if r["mode"] == "zerosum"), reports[0])
    loss = smoothed(base["mean_losses"], window)
    return float(loss[int(0.75 * (len(loss) - 1))])


def run_experiment(exp: Experiment, args, extra: list[str]) -> dict:
    """Every example with every seed (--seeds): one training run each, its own target (every-step
    ZeroSum's loss at 75 % of its steps in that run), its rows."""
    out = {"experiment": exp.key, "rate": args.rate, "workers": args.workers, "steps": args.steps,
           "warmup": args.warmup, "smooth": args.smooth, "models": {}}
    for example in args.example:
        densities, numel = profile(example, args.workers, extra)
        model = {"seeds": args.seeds, "targets": [], "runs": [], "numel": numel,
                 "densities": {"own": densities.own, "union": densities.union},
                 "settings": MODELS[example] + extra, "shaper_drops": 0, "socket_buffer_drops": 0}
        for seed in args.seeds:
            print(f"== {exp.key}: {example}, {args.workers} workers, {args.rate}, seed {seed}", flush=True)
            rep = launch(example, args.schemes or exp.schemes, args, extra + ["--seed", str(seed)])
            target = args.target if args.target is not None else target_of(rep["reports"], args.smooth)
            rows = [summarize(r, rep["world"], target, args.smooth) for r in rep["reports"]]
            predictions(rows, densities, numel, rep["world"], args.rate)
            model["targets"].append(target)
            model["runs"].append(rows)
            for k in ("shaper_drops", "socket_buffer_drops"):
                model[k] = None if rep.get(k) is None else (model[k] or 0) + rep[k]
            print(table(model["runs"][-1:], [target]))
            if any("levels" in r for r in rows):
                print(levels_lines(rows))
        if len(args.seeds) > 1:
            print(f"== {exp.key}: {example}, over seeds {', '.join(map(str, args.seeds))}")
            print(table(model["runs"], model["targets"]))
        out["models"][example] = model
    return out


def with_earlier_models(result: dict, path: Path) -> dict:
    """`result` with what the earlier run written at `path` holds, when that run had the same settings
    (rate, workers, steps, warm-up, smoothing): the models this run did not train are kept, so one model
    can be rerun (--example); and a model trained again with the same options and schemes but other
    seeds gets this run's seeds added to its earlier ones. Files written before runs had seeds are read
    as one run of seed 0."""
    if not path.exists():
        return result
    earlier = json.loads(path.read_text())
    if any(earlier.get(k) != result[k] for k in ("experiment", "rate", "workers", "steps", "warmup", "smooth")):
        return result
    models = {}
    for name, m in earlier["models"].items():
        if "runs" not in m:
            m = {**{k: v for k, v in m.items() if k not in ("rows", "target")},
                 "seeds": [0], "targets": [m["target"]], "runs": [m["rows"]]}
        new = result["models"].get(name)
        if new is None:
            models[name] = m
        elif (set(m["seeds"]).isdisjoint(new["seeds"]) and m.get("settings") == new.get("settings")
              and _schemes(m) == _schemes(new)):
            models[name] = {**new, **{k: m[k] + new[k] for k in ("seeds", "targets", "runs")},
                            # drops over every run: each run's counters start at zero
                            **{k: m[k] + new[k] for k in ("shaper_drops", "socket_buffer_drops")
                               if m.get(k) is not None and new.get(k) is not None}}
    return {**result, "models": {**result["models"], **models}}


def _schemes(model: dict) -> list[str]:
    return [r["scheme"] for r in model["runs"][0]]


def table(runs: list[list[dict]], targets: list[float]) -> str:
    """One row per scheme over the runs (seeds): medians, with (min-max) where the runs differ; times
    and samples over the runs that reached their target ('k of n' when not all did)."""
    n = len(runs)
    target = spread(targets, 4)
    lines = [f"| scheme | MB sent / step | MB received / step | step (ms) | loss after {runs[0][0]['samples']:,} samples "
             f"| wall-clock to loss {target} (s) | samples to it | time vs every-step ZeroSum "
             "| MB sent: predicted (measured / predicted) | step ms: predicted (measured / predicted) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, first in enumerate(runs[0]):
        rows = [run[i] for run in runs]
        base = [next((r for r in run if r["scheme"] == "zerosum"), None) for run in runs]
        hit = [r for r in rows if r["time_to_target_s"] is not None]
        ratios = [r["time_to_target_s"] / b["time_to_target_s"] for r, b in zip(rows, base)
                  if r["time_to_target_s"] is not None and b and b["time_to_target_s"] and r["scheme"] != "local"]
        some = "" if len(hit) == n else f" ({len(hit)} of {n} runs)"
        reached = "never" if not hit else spread([r["time_to_target_s"] for r in hit], 1) + some
        samples = "never" if not hit else f"{int(np.median([r['samples_to_target'] for r in hit])):,}"
        lines.append(f"| {first['scheme']} | {spread([r['sent_mb'] for r in rows], 2)} | "
                     f"{spread([r['received_mb'] for r in rows], 2)} | {spread([r['step_ms'] for r in rows], 0)} | "
                     f"{spread([r['final_loss'] for r in rows], 4)} | {reached} | {samples} | "
                     f"{spread(ratios, 2, 'x') if ratios else '-'} | {_predicted(first, 'sent_mb', 2)} | "
                     f"{_predicted(first, 'step_ms', 0)} |")
    return "\n".join(lines)


def _predicted(row: dict, what: str, digits: int) -> str:
    p = row.get(f"predicted_{what}")
    if p is None:
        return "-"
    return f"{p:.{digits}f} ({row[what] / p:.2f}x)" if p > 0 else f"{p:.{digits}f}"


def figure(result: dict, example: str, path: Path) -> None:
    """Loss against wall-clock time, one line per scheme, for one model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m = result["models"][example]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in m["runs"][0]:
        ax.plot(r["curve"]["seconds"], r["curve"]["loss"], label=r["scheme"], lw=1.3)
    ax.axhline(m["targets"][0], color="grey", ls=":", lw=1, label="target")
    ax.set_title(f"{result['experiment']}, {example}: {result['workers']} workers, {result['rate']}, "
                 f"seed {m['seeds'][0]}")
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel(f"training loss (mean over ranks, {result['smooth']}-step mean)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(exp: Experiment, result: dict, name: str) -> list[str]:
    where = ("loopback (every process on this machine's cores, no link limit)" if result["rate"] == LOOPBACK
             else f"links shaped to {result['rate']} both ways (experiments/shaped_network.py: a network "
                  "namespace per worker, veth, tbf; one aggregator on every worker's host)")
    key = exp.key + (" (loopback)" if result["rate"] == LOOPBACK else "")
    lines = [f"## {key}: {exp.title}", "",
             "`python3 experiments/training_schemes.py` (numbers below are its output; each model's command "
             f"is given with it): {result['workers']} workers on {where}; {result['steps']} steps ({result['warmup']} untimed), "
             f"{exp.about}. Loss: the mean over ranks of each step's minibatch loss, {result['smooth']}-step "
             "trailing mean; target: the loss every-step ZeroSum reaches at 75 % of its steps, per run. Each model "
             "is trained once per seed (model initialisation and batches; seeds listed with it); a cell gives "
             "the median over the seeds and (min-max) where they differ. Wall-clock time "
             "counts the warm-up steps at the steady step time. 'local' trains without any exchange (each rank "
             "alone): the step time's floor, not a training scheme. Predictions: zerosum.costmodel from "
             "block densities measured on the model (docs/sync.md). The CPU (2 cores) is shared by all processes. "
             "Figures (loss against wall-clock time, the first seed): " +
             ", ".join(f"[{name}_{e}.png]({name}_{e}.png)" for e in result["models"]) +
             f"; data: [{name}.json]({name}.json).", ""]
    for example, m in result["models"].items():
        drops = "" if m["shaper_drops"] is None else \
            f" Packets the shapers dropped over the runs: {m['shaper_drops']}; socket-buffer drops: {m['socket_buffer_drops']}."
        seeds = ", ".join(str(x) for x in m["seeds"])
        command = f"`python3 experiments/training_schemes.py {m['command']}`: " if m.get("command") else ""
        lines += [f"**{example}** ({command}`{' '.join(m['settings'])}`; seeds {seeds}).{drops}", "",
                  table(m["runs"], m["targets"]), ""]
    return lines


def main(argv=None) -> int:
    argv_given = list(sys.argv[1:] if argv is None else argv)
    unwind_on_sigterm()
    argv, extra = split_example_args(argv_given)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=list(EXPERIMENTS))
    add_link_options(p, ("rate", "mtu"), rate="1gbit", loopback=True)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--example", action="append", choices=list(MODELS), help="default: both")
    p.add_argument("--schemes", help="override the experiment's scheme list (zerosum.examples.schemes)")
    p.add_argument("--steps", type=int, help="default: the experiment's")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--smooth", type=int, default=20, help="steps in the loss's trailing mean")
    p.add_argument("--target", type=float, help="target loss (default: see above)")
    p.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], default=[0, 1, 2],
                   help="comma-separated seeds: one training run of each model per seed")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", metavar="NAME", help="write docs/NAME.json, docs/NAME.png and the doc section "
                   "(default: the experiment's name; 'none' writes nothing)")
    p.add_argument("--render", action="store_true",
                   help="train nothing: rewrite the figures and the doc section from docs/NAME.json")
    args = p.parse_args(argv)
    exp = EXPERIMENTS[args.experiment]
    args.steps = args.steps or exp.steps
    args.example = args.example or list(MODELS)
    if args.rate != LOOPBACK and os.geteuid() != 0 and not args.render:
        raise SystemExit("shaped links need root (network namespaces, veth, tbf); or use --rate loopback")
    name = args.out or f"{args.experiment}_{'loopback' if args.rate == LOOPBACK else 'shaped'}"
    if args.render:
        result = json.loads((DOCS / f"{name}.json").read_text())
    else:
        result = run_experiment(exp, args, extra)
        for m in result["models"].values():
            m["command"] = " ".join(argv_given)
        if name == "none":
            return 0
        result = with_earlier_models(result, DOCS / f"{name}.json")
        (DOCS / f"{name}.json").write_text(json.dumps(json_safe(result), indent=1))
    for example in result["models"]:
        figure(result, example, DOCS / f"{name}_{example}.png")
    update_sections(DOCS / exp.doc, section(exp, result, name))
    # An experiment whose schemes this run also trained (S3's within S1's) gets its section from it.
    for other in (e for e in EXPERIMENTS.values() if e.within == args.experiment and not args.schemes):
        wanted = other.schemes.split(",")
        subset = {**result, "models": {k: {**m, "runs": [[r for r in run if r["scheme"] in wanted]
                                                         for run in m["runs"]]}
                                      for k, m in result["models"].items()}}
        update_sections(DOCS / other.doc, section(other, subset, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
