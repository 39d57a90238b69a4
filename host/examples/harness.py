"""What both examples share: process group, the two DDP runs (gloo hook, ZeroSum hook), the report.

Each run starts from the same initial model and the same data, so the loss curves are comparable;
ZeroSum's result is also checked to be identical on every rank.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

import zerosum.torch as zt

from . import schemes as S

OPTIMIZERS = {"sgd": torch.optim.SGD, "momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
              "adam": torch.optim.Adam}


def optimizer_for(scheme, name: str) -> str:
    """The optimiser a scheme trains with: momentum SGD's momentum is inside DGC (Scheme.carries_momentum),
    so DGC gets plain SGD where the others get momentum SGD (momentum 0.9 on every row either way)."""
    return "sgd" if name == "momentum" and scheme.carries_momentum else name
MODES = {"both": ["gloo", "zerosum"], "all": ["local", "gloo", "zerosum"],
         "zerosum": ["zerosum"], "gloo": ["gloo"], "local": ["local"]}


def parse_args(description: str, extra=None, argv=None, **defaults) -> argparse.Namespace:
    """The options both examples share; `extra(parser)` adds an example's own; `argv` (default: the
    command line) is what is parsed."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=list(MODES), default="both",
                   help="which allreduce to train with (both: gloo first, then ZeroSum, same data; local: "
                        "no gradient exchange at all, each rank steps on its own gradients -- the step time "
                        "without communication, the floor any allreduce is measured against; all: local, "
                        "gloo and ZeroSum in one run)")
    p.add_argument("--schemes", type=_schemes, metavar="LIST",
                   help="instead of --mode: a comma-separated list of schemes, e.g. "
                        "local,gloo,zerosum,topk:0.01,qsgd:4,localsgd:8:10,delayed (zerosum.examples.schemes)")
    p.add_argument("--steps", type=int, default=defaults.get("steps", 30))
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the timing")
    p.add_argument("--batch", type=int, default=defaults.get("batch", 256))
    p.add_argument("--lr", type=float, default=defaults.get("lr", 0.05))
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd",
                   help="sgd (plain SGD, the default), momentum (SGD with momentum 0.9; DGC, whose momentum "
                        "correction is the momentum, runs plain SGD) or adam; the same for every scheme")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size")
    p.add_argument("--bucket-view", action=argparse.BooleanOptionalAction, default=True,
                   help="DDP's gradient_as_bucket_view: gradients live in the buckets, which saves two "
                        "copies of every gradient per step (for every mode alike)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="rank 0 also writes the per-mode reports to FILE as JSON")
    if extra is not None:
        extra(p)
    return p.parse_args(argv)


def train(model_fn, batch_fn, loss_fn, args) -> list[dict]:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    initial = model_fn()
    schemes = getattr(args, "schemes", None) or [S.parse(m) for m in MODES[args.mode]]
    worker = local = None
    if any(s.uses_zerosum for s in schemes):
        worker, local = zt.worker_from_env(dist.distributed_c10d._get_default_store(), rank, world)
    reports = []
    for scheme in schemes:
        run = scheme.attach(initial, worker, world, rank, args.seed, args.bucket_mb, args.bucket_view)
        model = run.model
        opt = OPTIMIZERS[optimizer_for(scheme, getattr(args, "optimizer", "sgd"))](model.parameters(), lr=args.lr)
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
        losses, clock, t0, before = [], [], None, None
        ring_while_down = []          # hybrid: buckets sent through the ring while the aggregator was gone, so far
        for step in range(args.steps):
            if step == args.warmup:
                dist.barrier()
                t0 = time.perf_counter()
                before = _traffic(worker)
            inputs, target = batch_fn(gen, args.batch)
            opt.zero_grad()
            loss = loss_fn(model(*inputs), target)
            loss.backward()
            opt.step()
            run.after_step(model.parameters())
            losses.append(loss.item())
            clock.append(None if t0 is None else time.perf_counter() - t0)
            if run.failover is not None:
                ring_while_down.append(run.failover.ring_buckets)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        timed = args.steps - args.warmup
        run.close()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        digest = torch.tensor([float(params.double().sum())])
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, digest.double())
        every_rank = [None] * world        # outside the timed steps: every rank's losses, for the mean
        dist.all_gather_object(every_rank, losses)
        if scheme.uses_zerosum:
            sent, received, resent = (now - then for now, then in zip(_traffic(worker), before))
            sent, received = sent / timed, received / timed
        else:   # gloo: the ring allreduce's bytes each way, computed; local: nothing
            ring = 2 * (world - 1) / world * sum(p.numel() * 4 for p in model.parameters())
            sent = received = 0.0 if scheme.kind == "local" else ring
            resent = 0
        reports.append({
            "mode": scheme.text, "step_s": elapsed / timed, "samples_per_s": args.batch * world * timed / elapsed,
            "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
            "mean_losses": [sum(v) / world for v in zip(*every_rank)], "clock_s": clock,
            "warmup_steps": args.warmup, "batch": args.batch,
            "bytes_sent_per_step": sent, "bytes_received_per_step": received, "retransmitted_entries": resent,
            "identical_on_all_ranks": len({float(g) for g in gathered}) == 1,
            **({"paths": run.paths.report()} if run.paths is not None else {}),
            **({"failover": run.failover.report(), "ring_buckets_by_step": ring_while_down}
               if run.failover is not None else {}),
            **({"levels": run.compressor.report()} if hasattr(run.compressor, "report") else {}),
        })
    if rank == 0:
        gap = _loss_curve_gap(reports)
        _print(reports, world, gap)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "reports": reports, "loss_curve_gap": gap}, f, indent=1)
    # Every scheme through ZeroSum applies the same update on every rank, except local SGD between averages.
    differ = [r["mode"] for r, s in zip(reports, schemes)
              if s.uses_zerosum and s.kind != "localsgd" and not r["identical_on_all_ranks"]]
    if differ:
        raise SystemExit(f"ZeroSum left different parameters on different ranks ({', '.join(differ)})")
    if worker is not None:
        worker.close()
    if local is not None:
        local.stop()
    dist.barrier()   # no rank tears gloo down while another still uses it (that aborts the process)
    dist.destroy_process_group()
    return reports


def main(arguments, task) -> None:
    """An example's command: its arguments parsed, trained on the task they describe, then exit_now."""
    args = arguments()
    train(*task(args), args)
    exit_now()


def exit_now() -> None:
    """End the rank's process once training is done and torch.distributed is torn down: flush, then
    exit without the interpreter's teardown, where torch's gloo threads sometimes abort the process
    ("terminate called without an active exception", seen with gloo alone, in --mode local) after
    everything has been computed and reported."""
    import os
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _schemes(text: str):
    try:
        return S.parse_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _traffic(worker) -> tuple[int, int, int]:
    """The worker's bytes sent, bytes received and retransmitted entries so far (zeros without one)."""
    if worker is None:
        return 0, 0, 0
    return worker.stats.bytes_sent, worker.stats.bytes_received, worker.stats.retransmitted_entries


def _loss_curve_gap(reports) -> float | None:
    """The largest difference between gloo's and ZeroSum's losses, step by step (None without both)."""
    by = {r["mode"]: r["losses"] for r in reports}
    if "gloo" not in by or "zerosum" not in by:
        return None
    return max(abs(a - b) for a, b in zip(by["gloo"], by["zerosum"]))


def _print(reports, world, gap) -> None:
    print(f"{'scheme':14} {'step (ms)':>10} {'samples/s':>10} {'loss first':>11} {'loss last':>10} "
          f"{'MB sent/step/worker':>20} {'MB received':>12} {'identical':>9}")
    for r in reports:
        print(f"{r['mode']:14} {r['step_s'] * 1e3:10.1f} {r['samples_per_s']:10.0f} {r['loss_first']:11.4f} "
              f"{r['loss_last']:10.4f} {r['bytes_sent_per_step'] / 1e6:20.2f} {r['bytes_received_per_step'] / 1e6:12.2f} {'n/a' if r['mode'] == 'local' else str(r['identical_on_all_ranks']):>9}")
    by = {r["mode"]: r for r in reports}
    if gap is not None:
        print(f"Loss curves, gloo vs ZeroSum: largest difference over {len(by['gloo']['losses'])} steps {gap:.2e}")
        print(f"ZeroSum speedup over gloo per step: {by['gloo']['step_s'] / by['zerosum']['step_s']:.2f}x "
              f"({world} workers; gloo MB/step is the ring allreduce's, computed)")
