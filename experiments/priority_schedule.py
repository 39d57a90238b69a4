"""S2: priority scheduling with tensor partitioning (zerosum.schedule) against DDP's bucket order.

    python3 experiments/priority_schedule.py                        # 2 workers on loopback, MLP 8 x 1024
    python3 experiments/priority_schedule.py --workers 3 --width 2048 --depth 6 --json s2.json
    sudo python3 experiments/priority_schedule.py --rate 1gbit     # every rank and the aggregator on a host of its own

The model is an MLP of --depth Linear layers of --width x --width (ReLU between them, one output),
trained with SGD (momentum 0.9) on random data (--batch rows per rank and step), on the CPU with
torch.set_num_threads(1): with the defaults a forward and backward pass takes some 150-250 ms per rank
(a third of it forward), long enough for communication to overlap it, and each layer's weight gradient
(1M floats, dense: 4 MB) is one chunk, its bias another.
W worker processes (--workers) share one ZeroSum aggregator. Every rank runs, one after the other, with
a barrier between them and the same data:

- local:    no communication (each rank steps on its own gradient): the compute-only step time;
- ddp:      DistributedDataParallel with `zerosum.torch.register` (DDP's buckets, in the order their
            gradients become ready; the optimizer waits for the whole allreduce);
- bucket:   PriorityScheduler(order="bucket"): chunks in backward-ready order, updates per layer;
- priority: PriorityScheduler(order="priority"): chunks in forward order, the next forward pass
            waiting per layer;
- hybrid:   PriorityScheduler(order="priority", backward_chunks=K): the chunks of the output layer and
            of the last --backward-layers hidden layers (default: half of them) go during the backward
            pass, the rest in forward order.

The variants run --repeats times, interleaved (local, ddp, ..., local, ddp, ...), so that a change
in the machine's load hits them alike; each measurement is the median of a rank's repeats. Measured per
variant, over --steps steps after --warmup (mean over ranks; step time of the slowest rank):

- step:     wall-clock time per step (the timed steps and the final synchronize(), divided by steps);
- +local:   step time minus the local variant's: what communicating costs in all (exposed
            communication, and compute slowed down by the communication competing for the cores);
- exposed:  exposed communication time per step, the time the training thread is blocked on
            communication: for the schedulers the forward pass's waits for averaged gradients (their
            counters); for DDP the time from the backward pass's last gradient to the return of
            backward(), where DDP waits for every bucket;
- busy:     time per step the communication thread spent in allreduces (the schedulers' counters;
            for DDP the time in the hook's allreduces);
- hidden:   share of the communication hidden behind compute = 1 - exposed / busy (1: all of it
            overlapped with compute; 0: the training waited for all of it);
- bytes:    bytes the worker sent per step (zerosum.Worker.stats);
- same:     whether the final parameters are bit-identical over the ranks, and to the priority run's
            (every chunk is the same allreduce whatever the order; DDP's buckets put parameters at
            offsets that need not be multiples of the block size, and then its blocks, and the last
            bits of its parameters, differ from the schedulers'; with this MLP they are multiples).

On loopback all processes share the machine's cores: the aggregator, every rank's compute and every
rank's communication thread compete, so overlap buys little and the numbers are indicative only. With
--rate every rank runs in a network namespace of its own and the aggregator in another, each on a
veth link shaped to RATE (experiments/shaped_network.py's shaped_star; needs root; datagrams of at
most MTU - 28 bytes unless --max-datagram says otherwise), so communication waits for the link more
than for the CPU (which all processes still share).

Priority order pays off when communication takes about as long as the compute: its sending starts
only at the end of the backward pass (the first layer's gradient comes last), and only the forward
pass can hide it; bucket order hides communication behind the backward pass instead, and the hybrid
behind both. Each chunk is one synchronous allreduce of the Worker, so a chunk's last round trip is not
overlapped with the next chunk's first: more chunks, more of these tails.

The core is `compare()`, which a wrapper can call with its own aggregator address and command prefix
per rank (`--rate` does so with shaped_star).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import update_sections
from shaped_network import _bits, add_link_options, aggregator_on, on_host, shaped_star, worker_options

VARIANTS = ("local", "ddp", "bucket", "priority", "hybrid")
MARKER = "S2-RESULT "


# -- one rank ---------------------------------------------------------------------------------------------

def _model(cfg):
    import torch
    torch.manual_seed(cfg["seed"])
    layers = []
    for _ in range(cfg["depth"]):
        layers += [torch.nn.Linear(cfg["width"], cfg["width"]), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(cfg["width"], 1))
    return torch.nn.Sequential(*layers)


def _sgd(params):
    import torch
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def _batch(cfg, rank, step):
    import torch
    g = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)
    return torch.randn(cfg["batch"], cfg["width"], generator=g), torch.randn(cfg["batch"], 1, generator=g)


def _hybrid_chunks(cfg) -> int:
    """How many chunks the output layer and the last `backward_layers` hidden layers make (the block
    size is the Worker's default, 256): the K of the hybrid order."""
    block = 256
    cap = max(block, cfg["chunk_elems"] // block * block)
    pad = lambda n: -(-n // block) * block            # noqa: E731
    w, b = cfg["width"] * cfg["width"], cfg["width"]
    if pad(w) >= cap:
        per_layer = -(-w // cap) + 1                  # the weight's pieces, then the bias alone
    else:
        per_layer = 1 if pad(w) + pad(b) <= cap else 2
    return 1 + per_layer * min(cfg["backward_layers"], cfg["depth"])


def _digest(module) -> str:
    h = hashlib.blake2b(digest_size=12)
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _variant(name, cfg, rank, worker):
    """Train one variant (warm-up, then the timed steps); returns its measurements on this rank."""
    import torch.distributed as dist
    import torch.nn.functional as F
    module = _model(cfg)

    def loss_of(model, step):
        x, y = _batch(cfg, rank, step)
        return F.mse_loss(model(x), y)
    steps, warm = cfg["steps"], cfg["warmup"]
    out = {"variant": name}
    if name in ("local", "ddp"):
        model, state, busy, last = module, None, [0.0], [0.0]
        for p in module.parameters():   # the end of the backward pass's compute: its last gradient
            p.register_post_accumulate_grad_hook(lambda _: last.__setitem__(0, time.perf_counter()))
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            import zerosum.torch as zt
            model = DDP(module)
            state = zt.register(model, worker)
            reduce = state.reduce

            def timed(*args):
                start = time.perf_counter()
                try:
                    return reduce(*args)
                finally:
                    busy[0] += time.perf_counter() - start
            state.reduce = timed
        opt = _sgd(model.parameters())
        for s in range(warm + steps):
            if s == warm:
                dist.barrier()
                busy[0], blocked, sent, start = 0.0, 0.0, worker.stats.bytes_sent, time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_of(model, s).backward()
            if s >= warm:        # DDP waits for every bucket at the end of backward()
                blocked += time.perf_counter() - last[0]
            opt.step()
        out["step_s"] = (time.perf_counter() - start) / steps
        out["busy_s"] = busy[0] / steps if state is not None else 0.0
        out["wait_s"] = blocked / steps if state is not None else None
        out["bytes"] = (worker.stats.bytes_sent - sent) / steps
        if state is not None:
            state.close()
    else:
        from zerosum.schedule import PriorityScheduler
        order = "bucket" if name == "bucket" else "priority"
        k = _hybrid_chunks(cfg) if name == "hybrid" else 0
        sched = PriorityScheduler(module, worker, _sgd, chunk_elems=cfg["chunk_elems"], order=order,
                                  backward_chunks=k)
        for s in range(warm + steps):
            if s == warm:
                sched.synchronize()
                dist.barrier()
                sent, start = worker.stats.bytes_sent, time.perf_counter()
            loss_of(module, s).backward()
            sched.step()
        sched.synchronize()
        out["step_s"] = (time.perf_counter() - start) / steps
        timed = [r for r in sched.history if r.iteration >= warm]
        out["busy_s"] = sum(r.comm_busy_s for r in timed) / steps
        out["wait_s"] = sum(r.forward_wait_s for r in timed) / steps
        out["bytes"] = (worker.stats.bytes_sent - sent) / steps
        out["chunks"] = len(sched.chunks)
        out["backward_chunks"] = k
        out["schedule"] = [", ".join(sched.chunks[c].names) for c in sched.schedule]
        sched.close()
    out["digest"] = _digest(module)
    return out


def _median(runs: list) -> dict:
    """One variant's repeats on one rank: the median of each measurement; the digests must agree."""
    out = dict(runs[0])
    for key in ("step_s", "busy_s", "wait_s", "bytes"):
        if runs[0][key] is not None:
            out[key] = statistics.median(r[key] for r in runs)
    if len({r["digest"] for r in runs}) > 1:
        out["digest"] = "repeats differ"
    return out


def one_rank(rank: int, cfg: dict) -> dict:
    """A rank's process: join the job (and a gloo group for DDP and the barriers), run every variant."""
    import torch
    import torch.distributed as dist
    import zerosum
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}", rank=rank, world_size=cfg["world"])
    extra = worker_options(cfg)
    try:
        with zerosum.Worker(rank, cfg["world"], [cfg["aggregator"]], job=cfg["job"], timeout=cfg["timeout"],
                            **extra) as worker:
            runs = [[_variant(v, cfg, rank, worker) for v in cfg["variants"]] for _ in range(cfg["repeats"])]
            return {"rank": rank, "variants": [_median(list(rs)) for rs in zip(*runs)], "runs": runs,
                    "retransmitted": worker.stats.retransmitted_entries}
    finally:
        dist.destroy_process_group()


# -- the comparison ------------------------------------------------------------------------------------------

def compare(world: int, aggregator: str, cfg: dict, where=lambda rank: [], master: str = "127.0.0.1:29631",
            env: dict | None = None) -> dict:
    """Run `world` rank processes (each started under the command prefix `where(rank)`, e.g. `ip netns
    exec NS`) against the aggregator at `aggregator`, the gloo rendezvous at `master` (rank 0's
    address); returns {"ranks": [per-rank results], "rows": [per-variant summary]}."""
    cfg = {**cfg, "world": world, "aggregator": aggregator, "master": master}
    procs = [subprocess.Popen([*where(r), sys.executable, os.path.abspath(__file__), "--one-rank", str(r),
                               json.dumps(cfg)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **(env or {})})
             for r in range(world)]
    ranks = []
    for p in procs:
        text = p.communicate(timeout=cfg.get("deadline", 1800))[0]
        lines = [line for line in text.splitlines() if line.startswith(MARKER)]
        if p.returncode or not lines:
            raise RuntimeError(f"a rank failed (exit code {p.returncode}): {text[-2000:]}")
        ranks.append(json.loads(lines[-1][len(MARKER):]))
    ranks.sort(key=lambda r: r["rank"])
    return {"config": cfg, "ranks": ranks, "rows": summarize(ranks)}


def summarize(ranks: list) -> list:
    names = [v["variant"] for v in ranks[0]["variants"]]
    local = {r["rank"]: v["step_s"] for r in ranks for v in r["variants"] if v["variant"] == "local"}
    reference = {r["rank"]: v["digest"] for r in ranks for v in r["variants"] if v["variant"] == "priority"}
    rows = []
    for i, name in enumerate(names):
        runs = [r["variants"][i] for r in ranks]
        mean = lambda key: statistics.fmean(v[key] for v in runs)     # noqa: E731
        row = {"variant": name, "step_s": max(v["step_s"] for v in runs), "busy_s": mean("busy_s"),
               "wait_s": None if runs[0]["wait_s"] is None else mean("wait_s"), "bytes": mean("bytes"),
               "chunks": runs[0].get("chunks")}
        row["hidden"] = 1 - row["wait_s"] / row["busy_s"] if row["wait_s"] is not None and row["busy_s"] > 0 \
            else None
        row["over_local_s"] = statistics.fmean(v["step_s"] - local[r["rank"]] for v, r in zip(runs, ranks)) \
            if local and name != "local" else None
        row["ranks_identical"] = len({v["digest"] for v in runs}) == 1 if name != "local" else None
        row["same_as_priority"] = (all(v["digest"] == reference[r["rank"]] for v, r in zip(runs, ranks))
                                   if reference and name != "local" else None)
        rows.append(row)
    return rows


def print_table(rows: list, where: str, cfg: dict) -> None:
    print(f"{where}: {cfg['world']} workers, MLP {cfg['depth']} x {cfg['width']} (+1 output), batch {cfg['batch']}, "
          f"chunks of {cfg['chunk_elems']:,} elements, {cfg['steps']} steps after {cfg['warmup']}, "
          f"median of {cfg['repeats']}")
    print(f"{'variant':>9} {'step ms':>8} {'+local ms':>9} {'exposed ms':>10} {'busy ms':>8} {'hidden':>7} "
          f"{'MB/step':>8} {'chunks':>6}  identical (ranks / priority)")

    def f(x, scale=1e3, fmt="8.1f"):
        return "-".rjust(int(fmt.split(".")[0])) if x is None else format(x * scale, fmt)
    for r in rows:
        yn = lambda b: "-" if b is None else ("yes" if b else "no")   # noqa: E731
        print(f"{r['variant']:>9} {f(r['step_s'])} {f(r['over_local_s'], fmt='9.1f')} {f(r['wait_s'], fmt='10.1f')} "
              f"{f(r['busy_s'])} "
              f"{f(r['hidden'], 100, '6.0f') + ('%' if r['hidden'] is not None else ' ')} "
              f"{r['bytes'] / 1e6:8.1f} {r['chunks'] if r['chunks'] else '-':>6}  "
              f"{yn(r['ranks_identical'])} / {yn(r['same_as_priority'])}")


def _shaped(args, cfg) -> dict:
    """Every rank on a host of its own and the aggregator on another, links shaped to --rate."""
    hosts = {"agg": "10.79.0.200", **{f"r{r}": f"10.79.0.{r + 1}" for r in range(args.workers)}}
    with shaped_star(hosts, args.rate, args.mtu, {"agg": args.aggregator_rate}) as (ns, drops), \
            aggregator_on(ns["agg"], hosts["agg"], args.workers, job=cfg["job"]) as agg:
        out = compare(args.workers, agg.address, cfg, lambda r: on_host(ns[f"r{r}"]),
                      master=f"{hosts['r0']}:29631", env={"GLOO_SOCKET_IFNAME": "eth0"})
        out["drops"] = dict(zip(("shaper", "socket"), drops()))
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="runs of every variant, interleaved; medians are reported")
    ap.add_argument("--chunk-elems", type=int, default=1 << 20)
    ap.add_argument("--backward-layers", type=int, help="hidden layers whose chunks the hybrid variant sends "
                    "during the backward pass (default: half of --depth)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--timeout", type=float, default=30.0, help="the workers' allreduce timeout")
    ap.add_argument("--json", help="write the results here")
    add_link_options(ap, aggregator_rate="10gbit", runs=("rate",),
                     notes={"max-datagram": "default 64 KiB; with --rate MTU - 28"})
    ap.add_argument("--doc", action="store_true", help="write the tables as section S2 of docs/sync.md "
                    "(and the results to docs/s2.json)")
    ap.add_argument("--one-rank", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one_rank:
        print(MARKER + json.dumps(one_rank(int(args.one_rank[0]), json.loads(args.one_rank[1]))), flush=True)
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}: choose from {', '.join(VARIANTS)}")
    cfg = {"width": args.width, "depth": args.depth, "batch": args.batch, "steps": args.steps,
           "warmup": args.warmup, "repeats": args.repeats, "chunk_elems": args.chunk_elems,
           "backward_layers": args.depth // 2 if args.backward_layers is None else args.backward_layers,
           "variants": variants, "seed": 0, "job": 7,
           "timeout": args.timeout, "max_datagram": args.max_datagram, "window": args.window}
    if args.rate and os.geteuid() != 0:
        raise SystemExit("--rate needs root: it creates network namespaces, veth pairs, a bridge and tbf qdiscs")
    results, ok = [], True
    for rate in args.rate or [None]:
        out = run_once(args, dict(cfg), rate)
        results.append(out)
        ok &= all(r["ranks_identical"] is not False for r in out["rows"]) and \
            all(r["same_as_priority"] is not False for r in out["rows"] if r["variant"] in ("bucket", "hybrid"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=1)
    if args.doc:
        root = Path(__file__).resolve().parents[1]
        (root / "docs" / "s2.json").write_text(json.dumps(results, indent=1))
        update_sections(root / "docs" / "sync.md", section(results, " ".join(sys.argv[1:]) if argv is None
                                                           else " ".join(argv)))
    return 0 if ok else 1


def run_once(args, cfg: dict, rate: str | None) -> dict:
    if rate:
        args.rate = rate
        if not args.max_datagram:
            cfg["max_datagram"] = args.mtu - 28
        out = _shaped(args, cfg)
        where = f"links of {rate} (aggregator {args.aggregator_rate})"
    else:
        from zerosum.local import LocalAggregator
        from zerosum.udp import free_port
        agg = LocalAggregator(args.workers, job=cfg["job"])
        try:
            out = compare(args.workers, agg.address, cfg, master=f"127.0.0.1:{free_port()}")
        finally:
            out_counters = agg.stop()
        out["aggregator"] = out_counters
        where = "loopback"
    out["where"] = where
    print_table(out["rows"], where, out["config"])
    hybrid = next((v for v in out["ranks"][0]["variants"] if v["variant"] == "hybrid"), None)
    if hybrid:
        k = hybrid["backward_chunks"]
        print(f"hybrid: {k} chunks during the backward pass ({'; '.join(hybrid['schedule'][:k])}), then forward order")
    print("retransmitted entries per rank:", [r["retransmitted"] for r in out["ranks"]],
          f"; packets dropped: {out['drops']}" if "drops" in out else "")
    return out


def predicted(out: dict) -> str:
    """The cost model's bytes and link time for one run (zerosum.costmodel): the dense gradient in one
    allreduce per step, a worker's link and the aggregator's (which carries every worker's results)."""
    from zerosum import costmodel as CM
    cfg = out["config"]
    numel = cfg["depth"] * (cfg["width"] ** 2 + cfg["width"]) + cfg["width"] + 1
    cost = CM.zerosum_allreduce(numel, 1.0, 1.0, cfg["world"], max_datagram=cfg.get("max_datagram") or 65507)
    measured = next(r["bytes"] for r in out["rows"] if r["variant"] == "ddp")
    text = (f"Cost model: {cost.sent / 1e6:.1f} MB sent per step and worker (measured / predicted "
            f"{measured / cost.sent:.2f}x)")
    rates = re.findall(r"of (\S+) \(aggregator (\S+)\)", out["where"])
    if rates:
        worker_ms = max(cost.sent, cost.received) * 8 / _bits(rates[0][0]) * 1e3
        agg_ms = cfg["world"] * max(cost.sent, cost.received) * 8 / _bits(rates[0][1]) * 1e3
        text += (f"; the links need at least {max(worker_ms, agg_ms):.0f} ms per step (a worker's "
                 f"{worker_ms:.0f} ms, the aggregator's {agg_ms:.0f} ms)")
    return text + "."


def section(results: list, command: str) -> list[str]:
    """Section S2 of docs/sync.md: one table per run."""
    cfg = results[0]["config"]
    lines = ["## S2: priority scheduling vs bucket order", "",
             f"`python3 experiments/priority_schedule.py {command}` (its output): {cfg['world']} workers, an MLP of "
             f"{cfg['depth']} Linear layers of {cfg['width']} x {cfg['width']} (ReLU, one output), SGD with momentum "
             f"0.9, batch {cfg['batch']} per rank, chunks of {cfg['chunk_elems']:,} values, {cfg['steps']} steps after "
             f"{cfg['warmup']}, median of {cfg['repeats']} interleaved repeats. Variants and columns as the "
             "script's docstring defines them (exposed: time the training thread waited for communication; busy: "
             "the communication thread's time in allreduces; hidden = 1 - exposed / busy). The CPU (2 cores) is "
             "shared by all processes.", ""]
    for out in results:
        lines += [f"**{out['where']}**", "", predicted(out), "",
                  "| variant | step ms | + over local ms | exposed ms | busy ms | hidden | MB sent / step | chunks "
                  "| identical (ranks / priority) |", "|---|--:|--:|--:|--:|--:|--:|--:|---|"]
        for r in out["rows"]:
            ms = lambda x: "-" if x is None else f"{x * 1e3:.0f}"    # noqa: E731
            yn = lambda b: "-" if b is None else ("yes" if b else "no")   # noqa: E731
            hidden = "-" if r["hidden"] is None else f"{r['hidden'] * 100:.0f} %"
            lines.append(f"| {r['variant']} | {ms(r['step_s'])} | {ms(r['over_local_s'])} | {ms(r['wait_s'])} | "
                         f"{ms(r['busy_s'])} | {hidden} | {r['bytes'] / 1e6:.1f} | {r['chunks'] or '-'} | "
                         f"{yn(r['ranks_identical'])} / {yn(r['same_as_priority'])} |")
        lines.append("")
    return lines


if __name__ == "__main__":
    sys.exit(main())
