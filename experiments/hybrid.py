"""Each bucket on the faster path, and training that survives its aggregator (the DDP hook with
paths="auto": zerosum.hybrid, zerosum.torch.Failover).

    python3 experiments/hybrid.py paths                      # loopback: MLP, embedding, mixed model
    sudo python3 experiments/hybrid.py paths --rate 1gbit    # every worker on a host of its own, 1 Gbit/s links
    python3 experiments/hybrid.py failover                   # the aggregator SIGKILLed mid-run, back 5 s later

`paths` trains the dense MLP (zerosum.examples.mlp), the embedding model (.embedding) and the mixed model
(.mixed: an embedding table under a dense tower of about the same gradient size) with gloo's DDP, the
ZeroSum hook on every bucket, and the hybrid hook, one after another in the same processes, from the
same initial model on the same batches (--repeats runs; medians), and reports the steady step time of
each and which path the hybrid hook's buckets took.

`failover` trains the embedding model with the hybrid hook against an aggregator of its own process,
twice: undisturbed, and with the aggregator SIGKILLed --kill-after seconds into training and restarted
on the same port --restart-after seconds later. It reports the steps that went through the ring, the
time lost against the undisturbed run and both runs' final loss, and plots both loss curves against the
wall clock.

Writes docs/hybrid_paths_<where>.json, docs/hybrid_failover.json and .png, and the sections of
docs/hybrid.md. The CPU (2 cores here) is shared by every process.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from report import json_safe, update_sections
from shaped_network import LOOPBACK, add_link_options

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MODELS = {
    "mlp": ["--optimizer", "sgd", "--lr", "0.05", "--batch", "128"],
    "embedding": ["--optimizer", "adam", "--lr", "0.01", "--batch", "256"],
    # DDP's buckets of at most the tower's largest layer: no bucket mixes the table and the tower
    "mixed": ["--optimizer", "sgd", "--lr", "0.05", "--batch", "128", "--bucket-mb", "4"],
}
SCHEMES = "gloo,zerosum,hybrid"
PREAMBLE = ("# Hybrid paths and failover\n\nWhat the DDP hook with `paths=\"auto\"` does (zerosum.hybrid, "
            "zerosum.torch.Failover; README \"Never slower than the ring\"), measured by experiments/hybrid.py.")


def launch(example: str, schemes: str, args, extra=(), env_extra=None, during=None) -> dict:
    """One training run (rank 0's report); `during(proc)` runs in a thread while it trains."""
    example_args = ["--schemes", schemes, "--steps", str(args.steps), "--warmup", str(args.warmup),
                    *MODELS[example], *extra]
    if args.rate != LOOPBACK:
        from shaped_network import run
        for attempt in range(3):
            try:
                return run(args.rate, args.workers, 0, example, args.mtu, example_args, args.timeout)
            except SystemExit as e:   # a rank aborted in torch's teardown at exit (seen with gloo alone): again
                if "terminate called without an active exception" not in str(e) or attempt == 2:
                    raise
                print(f"note: {example}: a rank aborted at exit (torch/gloo teardown); running again", flush=True)
    torchrun = shutil.which("torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
            "--standalone", "--nproc-per-node", str(args.workers), "-m", f"zerosum.examples.{example}",
            *example_args, "--json", str(report)]
        env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
        if not env_extra:
            env.pop("ZEROSUM_AGGREGATORS", None)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp, env=env)
        helper = threading.Thread(target=during, args=(proc,), daemon=True) if during else None
        if helper:
            helper.start()
        out, err = proc.communicate(timeout=args.timeout)
        if helper:
            helper.join(60)
        if proc.returncode != 0:
            if not report.exists() or "terminate called without an active exception" not in err:
                raise SystemExit(f"{example} failed:\n{out[-2000:]}\n{err[-3000:]}")
            # every rank finished training and rank 0 wrote the report; a rank aborted in torch's
            # teardown at exit (seen with gloo alone too)
            print(f"note: {example}: a rank aborted at exit, after training (torch/gloo teardown)", flush=True)
        print(out, end="", flush=True)
        return json.loads(report.read_text())


# -- paths ---------------------------------------------------------------------------------------------

def paths(args) -> dict:
    rows = []
    for example in args.models:
        runs = [launch(example, SCHEMES, args) for _ in range(args.repeats)]
        step = {s: [next(r for r in run["reports"] if r["mode"] == s)["step_s"] for run in runs]
                for s in SCHEMES.split(",")}
        hybrid = [next(r for r in run["reports"] if r["mode"] == "hybrid") for run in runs]
        used = hybrid[-1]["paths"]["paths"]
        rows.append({"model": example, "step_s": {s: float(np.median(v)) for s, v in step.items()},
                     "step_s_runs": step, "paths": used,
                     "identical_on_all_ranks": all(r["identical_on_all_ranks"] for r in hybrid)})
        print(paths_table(rows[-1:]), flush=True)
    return {"workers": args.workers, "rate": args.rate, "steps": args.steps, "warmup": args.warmup,
            "repeats": args.repeats, "rows": rows}


def paths_table(rows) -> str:
    lines = ["| model | gloo (ms/step) | ZeroSum only | hybrid | hybrid vs gloo | hybrid vs ZeroSum only | "
             "hybrid vs the better | buckets ZeroSum / ring | MB ZeroSum / ring |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        s = r["step_s"]
        g, z, h = s["gloo"], s["zerosum"], s["hybrid"]
        p = r["paths"]
        lines.append(f"| {r['model']} | {g * 1e3:.1f} | {z * 1e3:.1f} | {h * 1e3:.1f} | {g / h:.2f}× | {z / h:.2f}× | "
                     f"{min(g, z) / h:.2f}× | {p['zerosum']['buckets']} / {p['ring']['buckets']} | "
                     f"{p['zerosum']['bytes'] / 1e6:.0f} / {p['ring']['bytes'] / 1e6:.0f} |")
    return "\n".join(lines)


# -- failover ------------------------------------------------------------------------------------------

def failover(args) -> dict:
    from zerosum.local import LocalAggregator
    job = 4343
    runs = {}
    for name in ("undisturbed", "killed"):
        agg = LocalAggregator(args.workers, job=job)
        env = {"ZEROSUM_AGGREGATORS": agg.address, "ZEROSUM_JOB": str(job)}
        events: dict = {}
        done = threading.Event()
        restarted = []

        def disturb(proc, agg=agg, events=events, done=done, restarted=restarted):
            # kill once the ranks train (the aggregator has summed rounds), restart on the same port
            while proc.poll() is None and agg.snapshot().get("rounds", 0) < 1000:
                time.sleep(0.2)
            time.sleep(args.kill_after)
            agg.proc.kill()
            events["killed"] = time.time()
            time.sleep(args.restart_after)
            restarted.append(LocalAggregator(args.workers, job=job, listen=agg.address))
            events["restarted"] = time.time()
            done.wait()              # (an aggregator dies with the thread that started it)
        try:
            report = launch("embedding", "hybrid", args, env_extra=env,
                            during=disturb if name == "killed" else None)
        finally:
            done.set()
            for a in [agg, *restarted]:
                a.stop()
        runs[name] = next(r for r in report["reports"] if r["mode"] == "hybrid")
    return summarize_failover(runs, args)


def summarize_failover(runs: dict, args) -> dict:
    out = {"workers": args.workers, "steps": args.steps, "kill_after_s": args.kill_after,
           "restart_after_s": args.restart_after, "runs": runs}
    tail = max(10, args.steps // 10)
    for name, r in runs.items():
        ring = np.diff([0] + r["ring_buckets_by_step"])
        out[name] = {"elapsed_s": r["clock_s"][-1], "step_s": r["step_s"],
                     "final_loss": float(np.mean(r["mean_losses"][-tail:])),
                     "ring_steps": int(np.count_nonzero(ring)), "failover": r["failover"],
                     "identical_on_all_ranks": r["identical_on_all_ranks"]}
    out["time_lost_s"] = out["killed"]["elapsed_s"] - out["undisturbed"]["elapsed_s"]
    # The failure's own cost, free of the run-to-run drift of a shared machine: the steps from the one the
    # aggregator died in to the first back on ZeroSum, against the same run's median step elsewhere.
    r = runs["killed"]
    clock = np.array([np.nan if c is None else c for c in r["clock_s"]])
    steps = np.diff(clock)                              # steps[i]: step i + 1
    ring = np.flatnonzero(np.diff([0] + r["ring_buckets_by_step"]) > 0)
    if len(ring):
        # durations of steps ring[0] - 1 (the failure may hit a step's last bucket: then the step after it
        # is the first with buckets through the ring) .. ring[-1] + 1 (the first one back); steps[k - 1] is
        # step k's
        window = np.arange(ring[0] - 2, ring[-1] + 1)
        window = window[(window >= 0) & (window < len(steps))]
        rest = np.delete(steps, window)
        median = float(np.nanmedian(rest))
        out["median_step_s"] = median
        out["failure_excess_s"] = float(np.nansum(steps[window] - median))
        out["failed_step_s"] = float(np.nanmax(steps[window[:2]]))
        out["ring_step_s"] = float(np.nanmedian(steps[window[2:]])) if len(window) > 2 else None
    return out


def failover_table(res: dict) -> str:
    lines = ["| run | wall clock (s) | steps through the ring | failures | buckets finished from the pieces | "
             "rejoins | final loss (mean of the last steps) | identical on all ranks |",
             "|---|--:|--:|--:|--:|--:|--:|:-:|"]
    for name in ("undisturbed", "killed"):
        r = res[name]
        f = r["failover"]
        lines.append(f"| {name} | {r['elapsed_s']:.2f} | {r['ring_steps']} | {f['failures']} | "
                     f"{f['recovered_buckets']} | {f['rejoins']} | {r['final_loss']:.4f} | "
                     f"{'yes' if r['identical_on_all_ranks'] else 'NO'} |")
    return "\n".join(lines)


def failover_figure(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, style in (("undisturbed", "-"), ("killed", "-")):
        r = res["runs"][name]
        clock = np.array([np.nan if c is None else c for c in r["clock_s"]])
        ax.plot(clock, r["mean_losses"], style, label=name, lw=1)
        if name == "killed":
            ring = np.diff([0] + r["ring_buckets_by_step"]) > 0
            if ring.any():
                ax.axvspan(np.nanmin(clock[ring]), np.nanmax(clock[ring]), color="orange", alpha=0.2,
                           label="through the ring (aggregator gone)")
    ax.set_xlabel("wall clock since the timed steps began (s)")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(f"embedding model, {res['workers']} workers: aggregator SIGKILLed, restarted "
                 f"{res['restart_after_s']:.0f} s later")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["paths", "failover"])
    ap.add_argument("--workers", type=int, default=4)
    add_link_options(ap, ("rate", "mtu"), rate=LOOPBACK, mtu=1500)
    ap.add_argument("--models", type=lambda s: s.split(","), default=["mlp", "embedding", "mixed"])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (paths: 60, failover: 400)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kill-after", type=float, default=15.0, help="seconds of training before the kill")
    ap.add_argument("--restart-after", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-doc", action="store_true", help="print only; do not write docs/")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 60 if args.what == "paths" else 400
    if args.what == "paths":
        res = paths(args)
        text = paths_table(res["rows"])
        name = f"hybrid_paths_{args.rate}"
        section = (f"Per-step time, {args.workers} workers, {args.rate + ('' if args.rate == LOOPBACK else ' links')}"
                   f", median of {args.repeats} runs of {args.steps} steps ({args.warmup} untimed), "
                   f"`python3 experiments/hybrid.py paths{'' if args.rate == LOOPBACK else ' --rate ' + args.rate}`"
                   f" ([docs/{name}.json]({name}.json)):\n\n{text}\n")
        heading = f"## H1-{args.rate}: each bucket on the faster path ({args.rate})"
    else:
        res = failover(args)
        text = failover_table(res)
        name = "hybrid_failover"
        section = (f"The embedding model, {args.workers} workers, {args.steps} steps with the hybrid hook against "
                   f"an aggregator in a process of its own; in the second run it is SIGKILLed {args.kill_after:.0f} s "
                   f"into training and restarted {args.restart_after:.0f} s later on the same port "
                   f"(`python3 experiments/hybrid.py failover`, [docs/{name}.json]({name}.json), "
                   f"[docs/{name}.png]({name}.png)):\n\n{text}\n\nThe step in which the aggregator died took "
                   f"{res['failed_step_s']:.2f} s against the run's median {res['median_step_s']:.2f} s (the "
                   f"failure's own cost: 1 s of silence, the agreement, the bucket finished from the pieces); "
                   f"the steps through the ring meanwhile took {res['ring_step_s']:.2f} s each (the ring is the "
                   f"slower path for this model), {res['failure_excess_s']:.2f} s more in all than as many median "
                   f"steps. Wall clock against the undisturbed run: {res['time_lost_s']:+.2f} s (steps also "
                   "differ by a few per cent from run to run on this shared machine).\n")
        heading = "## H2: the aggregator SIGKILLed mid-training"
    print(section)
    if not args.no_doc:
        (DOCS / f"{name}.json").write_text(json.dumps(json_safe(res), indent=1))
        if args.what == "failover":
            failover_figure(res, DOCS / f"{name}.png")
        update_sections(DOCS / "hybrid.md", [PREAMBLE, heading, "", section])
    return 0


if __name__ == "__main__":
    sys.exit(main())
