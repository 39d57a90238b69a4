"""E8: the order of embedding rows and ZeroSum's block density (zerosum.placement.feature_permutation).

    python3 experiments/embedding_order.py                  # 4 workers, 4 tables of 100k x 32, 30 steps
    python3 experiments/embedding_order.py --rows 1000000 --steps 12
    sudo python3 experiments/embedding_order.py --rate 1gbit --ids zipf    # over shaped links
    sudo python3 experiments/embedding_order.py --rate 1gbit --window 1000000

The model, data and training loop are zerosum.examples.embedding's (4 EmbeddingBag tables of --rows x
32, 2 Zipf-like lookups per table and sample, id = rows * u^3 with u uniform, a small MLP on top, batch
256 per worker, SGD lr 0.5), trained by W worker processes whose flattened gradient (the 4 tables, then
the MLP) is averaged through zerosum.Worker.allreduce (block size 256 = 8 rows of 32) against one local
aggregator process on loopback. With --rate (needs root and iproute2) every worker process runs on a
host of its own and the aggregator on another: network namespaces joined by a bridge, each with one
veth link shaped to RATE both ways by a token bucket (experiments/shaped_network.py's shaped_star;
MTU --mtu, default 9000), the aggregator's link at --aggregator-rate (default: RATE too, one NIC of
the same speed per host); --window BYTES gives the workers a window of results in flight
(zerosum.Worker(window=...)). The CPU is still shared by all processes (and by whatever else runs on the
machine), so the step times are an upper bound on what separate hosts get. The rows of every table
are stored in one of three orders:

- generated:  the example's own numbering, which is already hottest-first (id = rows * u^3)
- random:     a random order per table, as hashed ids would be: the baseline
- frequency:  the random order re-sorted by each row's count in a profile of --profile batches (drawn
              with another seed, so the ids of the timed run are not known in advance); rows the
              profile never saw keep their random order after the counted ones

The permutation is applied once at set-up (the tables' rows and the lookups' ids) and undone at the end
(zerosum.placement.Permutation): every order trains the same model on the same batches, so the losses
agree (up to ZeroSum's fixed-point rounding, which depends on which values share a block) and the
final tables, mapped back, agree too. Measured: non-zero blocks of a worker's table gradient per step
(density = share of the tables' blocks), the aggregator's rounds per step, bytes sent and received per
worker and step, step time (the slowest rank; median of --repeats runs in alternating order), and the
set-up time of the frequency order, the entries the workers retransmitted, the results the aggregator
could not send (its send buffer full: "send_errors", lost before any link), and the machine's 1-minute
load average after each run (the CPU is shared with whatever else runs); with --rate also the packets
the shapers dropped and the UDP datagrams dropped by full socket receive buffers.

Writes docs/embedding_order.json and the figure docs/embedding_order.png. The JSON keeps the rows of
other networks: a run replaces only the rows of its own ("where": "loopback" or "RATE", then
", aggregator RATE2" and ", window BYTES" if given), so the loopback and shaped runs can be made
separately; the figure shows every network in the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from zerosum import placement as pl

from ranks import Ranks, serve
from report import json_safe, steps_text
from shaped_network import (add_link_options, aggregator_ip, aggregator_on, on_host, shaped_star, worker_ip,
                            worker_options)

ROOT = Path(__file__).resolve().parents[1]
RESULT = "embedding-order-result "
ORDERS = ("generated", "random", "frequency")
BLOCK = 256
WARMUP = 3


def batch_fn(ids: str, rows: int, zipf: float):
    """The example's batches (ids "cube": id = rows * u^3), or the same with Zipf ids ("zipf": row r
    drawn with probability proportional to (r+1)^-zipf, hottest first), labelled by the example's
    hidden model."""
    import torch
    from zerosum.examples import embedding as E
    if ids == "cube":
        return lambda gen, size: E.batch(gen, size, rows)
    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -zipf)
    cdf = torch.from_numpy(cdf / cdf[-1])

    def batch(gen, size):
        u = torch.rand(size, E.TABLES, E.LOOKUPS, generator=gen, dtype=torch.float64)
        looked = torch.searchsorted(cdf, u, right=True).clamp(max=rows - 1)
        weights = E._truth(rows)
        score = sum(weights[t][looked[:, t]].sum(1) for t in range(E.TABLES))
        clicks = (score + 0.5 * torch.randn(size, generator=gen) > 0).float()
        return (looked,), clicks
    return batch


def _serve(rank: int, world: int) -> int:
    import torch
    import zerosum
    torch.set_num_threads(1)
    return serve(RESULT, rank, lambda cfg: _train(torch, zerosum, rank, world, cfg))


def _train(torch, zerosum, rank, world, cfg) -> dict:
    from zerosum.examples.embedding import DIM, TABLES, Recommender
    rows, steps, lr, size = cfg["rows"], cfg["steps"], cfg["lr"], cfg["batch"]
    batch = batch_fn(cfg["ids"], rows, cfg["zipf"])
    z = np.load(cfg["orders"])
    perms = [pl.Permutation.from_order(z[f"order{t}"]) for t in range(TABLES)]
    forward = [torch.from_numpy(p.forward) for p in perms]
    torch.manual_seed(cfg["seed"])
    model = Recommender(rows)                       # the same initial weights on every rank and order
    with torch.no_grad():
        for t, table in enumerate(model.tables):    # the tables' rows in the chosen order
            table.weight.copy_(table.weight[torch.from_numpy(perms[t].inverse)])
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    offsets = np.r_[0, np.cumsum(sizes)]
    table_values = TABLES * rows * DIM              # the tables come first in parameters()
    assert offsets[TABLES] == table_values
    flat = np.zeros(offsets[-1], np.float32)
    flat_t = torch.from_numpy(flat)
    views = [flat_t[offsets[i]:offsets[i + 1]].view_as(p) for i, p in enumerate(params)]
    for v, p in zip(views, params):
        p.grad = v                                  # backward accumulates into the flat buffer
    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    losses, step_s, comm_s, blocks = [], [], [], []
    extra = worker_options(cfg)
    with zerosum.Worker(rank, world, [cfg["address"]], job=cfg["job"], block_size=BLOCK, timeout=60, **extra) as w:
        before = (w.stats.bytes_sent, w.stats.bytes_received, w.stats.datagrams_sent)
        for s in range(steps):
            (ids,), clicks = batch(gen, size)
            t0 = time.perf_counter()
            ids = torch.stack([forward[t][ids[:, t]] for t in range(TABLES)], dim=1)
            flat[:] = 0.0
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ids), clicks)
            loss.backward()
            assert all(p.grad.data_ptr() == v.data_ptr() for v, p in zip(views, params))
            t1 = time.perf_counter()
            w.allreduce(flat, out=flat, average=True)
            t2 = time.perf_counter()
            with torch.no_grad():
                for v, p in zip(views, params):
                    p.add_(v, alpha=-lr)
            t3 = time.perf_counter()
            step_s.append(t3 - t0)
            comm_s.append(t2 - t1)
            losses.append(loss.item())
            # non-zero blocks of this rank's table gradient, counted outside the timers from the ids
            # (a looked-up row's gradient is non-zero): rows of DIM values, BLOCK values per block
            looked = np.unique((ids + torch.arange(TABLES)[:, None] * rows).numpy().reshape(-1))
            blocks.append(int(np.unique(looked * DIM // BLOCK).size))
        after = (w.stats.bytes_sent, w.stats.bytes_received, w.stats.datagrams_sent)
        retx = w.stats.retransmitted_entries
    out = {"rank": rank, "losses": losses, "step_s": float(np.mean(step_s[WARMUP:])),
           "comm_s": float(np.mean(comm_s[WARMUP:])), "compute_s": float(np.mean(np.subtract(step_s, comm_s)[WARMUP:])),
           "blocks": float(np.mean(blocks)), "table_blocks": table_values // BLOCK,
           "sent": (after[0] - before[0]) / steps, "received": (after[1] - before[1]) / steps,
           "datagrams": (after[2] - before[2]) / steps, "retransmitted": int(retx)}
    if rank == 0:
        with torch.no_grad():
            tables = [perms[t].unpermute_vector(model.tables[t].weight.numpy()) for t in range(TABLES)]
        np.save(cfg["params_out"], np.concatenate([t.reshape(-1) for t in tables]))
    return out


def orders(batch, rows: int, batch_size: int, profile: int, seed: int) -> dict:
    """The three orders per table, and the frequency order's set-up time (profile + sort)."""
    import torch
    from zerosum.examples.embedding import TABLES
    rng = np.random.default_rng(seed + 77)
    random = [pl.Permutation.from_order(rng.permutation(rows)) for _ in range(TABLES)]
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed + 999_999)       # not the training batches' generator
    ids = torch.cat([batch(gen, batch_size)[0][0] for _ in range(profile)]).numpy()
    t1 = time.perf_counter()
    frequency = []
    for t in range(TABLES):
        hashed = random[t].apply_ids(ids[:, t])               # the ids as they arrive: in random order
        sort = pl.feature_permutation(pl.ids_to_csr(hashed, rows), BLOCK, "frequency")
        frequency.append(pl.Permutation.from_order(random[t].inverse[sort.inverse], "frequency"))
    t2 = time.perf_counter()
    ident = [pl.Permutation.identity(rows) for _ in range(TABLES)]
    return {"generated": (ident, 0.0, 0.0), "random": (random, 0.0, 0.0),
            "frequency": (frequency, t1 - t0, t2 - t1)}


@contextmanager
def network(args):
    """The aggregator and where the ranks run: (aggregator, where(rank) -> command prefix, drops() ->
    (shaper drops, socket buffer drops) so far). Loopback, or with --rate a host (network namespace)
    per worker and one for the aggregator on shaped links."""
    from zerosum.local import LocalAggregator
    if not args.rate:
        agg = LocalAggregator(None)
        try:
            yield agg, lambda rank: [], lambda: (0, 0)
        finally:
            agg.stop()
        return
    hosts = {"agg": aggregator_ip(0), **{f"w{r}": worker_ip(r) for r in range(args.workers)}}
    with shaped_star(hosts, args.rate, args.mtu, {"agg": args.aggregator_rate or args.rate}) as (ns, drops), \
            aggregator_on(ns["agg"], hosts["agg"]) as agg:
        yield agg, lambda rank: on_host(ns[f"w{rank}"]), drops


def where_label(args) -> str:
    """The network's name in the results: "loopback" or RATE, then ", aggregator RATE2" (another rate
    for the aggregator) and ", window BYTES" (the workers' window) if given."""
    label = args.rate or "loopback"
    if args.rate and (args.aggregator_rate or args.rate) != args.rate:
        label += f", aggregator {args.aggregator_rate}"
    return label + (f", window {args.window or 'none'}" if args.window != "auto" else "")


def run_ids(ids, args, net, tmp, job0):
    """Train with every order on one id distribution on the network `net` (see network()); returns the
    rows of the table."""
    from zerosum.examples.embedding import TABLES
    made = orders(batch_fn(ids, args.rows, args.zipf), args.rows, args.batch, args.profile, args.seed)
    paths = {}
    for name, (perms, _, _) in made.items():
        paths[name] = os.path.join(tmp, f"{ids}-{name}.npz")
        np.savez(paths[name], **{f"order{t}": perms[t].inverse for t in range(TABLES)})
    agg, where, drops = net
    runs = {o: [] for o in ORDERS}
    job = job0
    ranks = Ranks(__file__, RESULT, args.workers, where=where)
    try:
        for rep in range(args.repeats):
            for name in (ORDERS if rep % 2 == 0 else ORDERS[::-1]):
                cfg = {"orders": paths[name], "address": agg.address, "job": job, "rows": args.rows,
                       "steps": args.steps, "lr": args.lr, "batch": args.batch, "seed": args.seed,
                       "ids": ids, "zipf": args.zipf, "params_out": os.path.join(tmp, f"{ids}-{name}-params.npy"),
                       "max_datagram": args.max_datagram, "window": args.window}
                job += 1
                c0, d0 = agg.snapshot(), drops()
                t0 = time.perf_counter()
                reports = ranks.run(cfg)
                wall = time.perf_counter() - t0
                c1, d1 = agg.snapshot(), drops()
                # packets the shapers dropped, datagrams full receive buffers dropped, results the aggregator
                # could not send (its send buffer full: lost before any shaper sees them), the machine's load
                lost = (d1[0] - d0[0], d1[1] - d0[1], c1.get("send_errors", 0) - c0.get("send_errors", 0),
                        os.getloadavg()[0])
                runs[name].append((reports, (c1.get("rounds", 0) - c0.get("rounds", 0)) / args.steps, lost))
                print(f"  {where_label(args)}: ids {ids:<5} {name:<10} run {rep + 1}: step "
                      f"{max(r['step_s'] for r in reports) * 1e3:7.1f} ms ({wall:.1f} s), retransmitted "
                      f"{sum(r['retransmitted'] for r in reports)} entries, aggregator send errors {lost[2]}, "
                      f"load {lost[3]:.1f}"
                      + (f", shaper drops {lost[0]}, socket buffer drops {lost[1]}" if args.rate else ""), flush=True)
    finally:
        ranks.close()
    params = {name: np.load(os.path.join(tmp, f"{ids}-{name}-params.npy")) for name in ORDERS}
    rows = []
    for name in ORDERS:
        reports, rounds, _ = runs[name][0]
        losses = np.mean([r["losses"] for r in reports], axis=0)
        steps = [max(r["step_s"] for r in rep) for rep, _, _ in runs[name]]
        blocks = float(np.mean([r["blocks"] for r in reports]))
        rows.append({"where": where_label(args), "rate": args.rate,
                     "aggregator_rate": (args.aggregator_rate or args.rate) if args.rate else None,
                     "mtu": args.mtu if args.rate else None, "ids": ids, "order": name,
                     "setup_profile_s": made[name][1], "setup_sort_s": made[name][2],
                     "blocks": blocks, "table_blocks": reports[0]["table_blocks"],
                     "density": blocks / reports[0]["table_blocks"],
                     "rounds": rounds, "sent": float(np.mean([r["sent"] for r in reports])),
                     "received": float(np.mean([r["received"] for r in reports])),
                     "datagrams": float(np.mean([r["datagrams"] for r in reports])),
                     "step_s": float(np.median(steps)), "step_s_runs": steps,
                     "comm_s": float(np.median([max(r["comm_s"] for r in rep) for rep, _, _ in runs[name]])),
                     "compute_s": float(np.median([max(r["compute_s"] for r in rep) for rep, _, _ in runs[name]])),
                     "retransmitted": int(sum(r["retransmitted"] for rep, _, _ in runs[name] for r in rep)),
                     "shaper_drops": int(sum(lost[0] for _, _, lost in runs[name])),
                     "socket_drops": int(sum(lost[1] for _, _, lost in runs[name])),
                     "send_errors": int(sum(lost[2] for _, _, lost in runs[name])),
                     "load_1min_runs": [lost[3] for _, _, lost in runs[name]],
                     "losses": losses.tolist()})
    base = next(r for r in rows if r["order"] == "random")
    for r in rows:
        for k in ("blocks", "rounds", "sent", "received", "step_s", "comm_s"):
            r[f"{k}_ratio"] = base[k] / r[k] if r[k] else float("inf")
        r["loss_diff_vs_random"] = float(np.max(np.abs(np.subtract(r["losses"], base["losses"]))))
        r["param_diff_vs_random"] = float(np.max(np.abs(params[r["order"]] - params["random"])))
        setup = r["setup_profile_s"] + r["setup_sort_s"]
        r["setup_s"] = setup
        if r["order"] != "random":
            t = pl.tradeoff(setup, baseline_step_seconds=base["step_s"], placed_step_seconds=r["step_s"])
            r["break_even_steps"] = t.break_even_steps
            link = pl.tradeoff(setup, baseline_bytes=max(base["sent"], base["received"]),
                               placed_bytes=max(r["sent"], r["received"]), link_bits_per_second=1e9)
            r["break_even_steps_1gbit"] = link.break_even_steps
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--ids", nargs="+", default=["cube", "zipf"], choices=["cube", "zipf"],
                    help="cube: the example's id = rows * u^3; zipf: P(row r) ~ (r+1)^-ZIPF")
    ap.add_argument("--zipf", type=float, default=1.1, help="the Zipf exponent of --ids zipf")
    ap.add_argument("--profile", type=int, default=100, help="batches drawn to count the rows' frequencies")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    add_link_options(ap)
    ap.add_argument("--json", default=str(ROOT / "docs" / "embedding_order.json"),
                    help="results file; the rows of other networks in it are kept ('' for none)")
    ap.add_argument("--figure", default=str(ROOT / "docs" / "embedding_order.png"))
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return _serve(int(args.serve[0]), int(args.serve[1]))
    if args.aggregator_rate and not args.rate:
        ap.error("--aggregator-rate needs --rate")
    if args.rate and (os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None):
        raise SystemExit("--rate needs root and iproute2 (ip, tc): it creates network namespaces, veth pairs, "
                         "a bridge and tbf qdiscs")
    from zerosum.examples.embedding import TABLES

    rows = []
    try:
        with network(args) as net, tempfile.TemporaryDirectory() as tmp:
            for i, ids in enumerate(args.ids):
                rows += run_ids(ids, args, net, tmp, 300 + 100 * i)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"could not build the network: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}")
    where = where_label(args)
    print()
    print(f"E8 ({describe(args)}): {args.workers} workers, {TABLES} tables of {args.rows:,} x 32, batch {args.batch} "
          f"per worker, {args.steps} steps ({WARMUP} untimed), block {BLOCK} (8 rows), median of {args.repeats} runs; "
          f"ratios: random / order")
    print(table(rows))
    for r in rows:
        if r["order"] == "frequency":
            print(f"{where}, ids {r['ids']}: frequency order set-up {r['setup_s']:.2f} s (profile "
                  f"{r['setup_profile_s']:.2f} s, sort {r['setup_sort_s']:.2f} s); break-even after "
                  f"{steps_text(r['break_even_steps'])} steps (measured step times), "
                  f"{steps_text(r['break_even_steps_1gbit'])} at 1 Gbit/s (bytes)")
    print("retransmitted entries:", {f"{r['ids']}/{r['order']}": r["retransmitted"] for r in rows})
    print(f"1-minute load average after each run ({os.cpu_count()} cores, shared):",
          {f"{r['ids']}/{r['order']}": [round(v, 1) for v in r["load_1min_runs"]] for r in rows})
    print("results the aggregator could not send (send buffer full):",
          {f"{r['ids']}/{r['order']}": r["send_errors"] for r in rows})
    if args.rate:
        print("packets dropped by the shapers / by full socket receive buffers:",
              {f"{r['ids']}/{r['order']}": (r["shaper_drops"], r["socket_drops"]) for r in rows})
    config = {"where": where, "describe": describe(args), "workers": args.workers, "rows": args.rows,
              "tables": TABLES, "steps": args.steps, "batch": args.batch, "lr": args.lr, "block": BLOCK,
              "zipf": args.zipf, "profile_batches": args.profile, "repeats": args.repeats, "rate": args.rate,
              "aggregator_rate": (args.aggregator_rate or args.rate) if args.rate else None,
              "mtu": args.mtu if args.rate else None, "max_datagram": args.max_datagram, "window": args.window}
    configs, everything = {where: config}, rows
    if args.json:
        configs, everything = merge(args.json, config, rows)
        with open(args.json, "w") as f:
            json.dump(json_safe({"configs": configs, "results": everything}), f, indent=1)
        print(f"wrote {args.json} (networks: {', '.join(configs)})")
    if args.figure:
        figure(everything, configs, args.figure)
        print(f"wrote {args.figure}")
    return 0


def describe(args) -> str:
    window = (f", window {args.window or 'none'}{' bytes' if isinstance(args.window, int) else ''}"
              if args.window != "auto" else "")
    datagrams = f", datagrams <= {args.max_datagram} bytes" if args.max_datagram else ""
    if not args.rate:
        return "loopback, one local aggregator" + window + datagrams
    agg = args.aggregator_rate or args.rate
    return (f"a host per worker and one for the aggregator, links of {args.rate} both ways"
            f"{'' if agg == args.rate else f' (aggregator {agg})'}, MTU {args.mtu}{window}{datagrams}")


def merge(path, config, rows) -> tuple[dict, list]:
    """The configurations and rows already in the results file `path`, those of this run's network
    replaced by this run's. (A file written before --rate existed holds loopback rows only.)"""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = {}
    if "configs" in old:
        configs = old["configs"]
    elif old.get("results"):
        configs = {"loopback": {"where": "loopback", "describe": "loopback, one local aggregator",
                                **{k: v for k, v in old.items() if k != "results"}}}
    else:
        configs = {}
    kept = [{"where": "loopback", **r} for r in old.get("results", []) if r.get("where", "loopback") != config["where"]]
    configs = {k: v for k, v in configs.items() if k != config["where"]}
    configs[config["where"]] = config
    return configs, kept + rows


def table(rows) -> str:
    out = ["| where | ids | order | non-zero table blocks/worker/step | density | rounds/step | sent/worker/step | "
           "received/worker/step | step ms | allreduce ms | set-up s | max loss diff vs random | "
           "max table diff vs random | entries retransmitted | aggregator send errors | shaper drops |",
           "|" + "---|" * 16]
    for r in rows:
        drops = r.get("shaper_drops") if r.get("rate") else None
        out.append(f"| {r.get('where', 'loopback')} | {r['ids']} | {r['order']} | "
                   f"{r['blocks']:.0f} ({r['blocks_ratio']:.2f}x) | "
                   f"{100 * r['density']:.2f} % | {r['rounds']:.0f} ({r['rounds_ratio']:.2f}x) | "
                   f"{r['sent'] / 1e6:.3f} MB ({r['sent_ratio']:.2f}x) | {r['received'] / 1e6:.3f} MB "
                   f"({r['received_ratio']:.2f}x) | {r['step_s'] * 1e3:.1f} ({r['step_s_ratio']:.2f}x) | "
                   f"{r['comm_s'] * 1e3:.1f} ({r['comm_s_ratio']:.2f}x) | {r['setup_s']:.2f} | "
                   f"{r['loss_diff_vs_random']:.1e} | {r['param_diff_vs_random']:.1e} | {r['retransmitted']} | "
                   f"{r.get('send_errors', '-')} | "
                   f"{'-' if drops is None else drops} |")
    return "\n".join(out)


def figure(rows, configs, path):
    """Density, step time and loss curves of every network (where) and id distribution in `rows`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = list(dict.fromkeys((r.get("where", "loopback"), r["ids"]) for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    width = 0.8 / len(groups)
    x = np.arange(len(ORDERS))
    for i, (where, ids) in enumerate(groups):
        rs = {r["order"]: r for r in rows if r.get("where", "loopback") == where and r["ids"] == ids}
        label = f"{where}, ids {ids}"
        axes[0].bar(x + i * width, [100 * rs[o]["density"] for o in ORDERS], width, label=label)
        bars = axes[1].bar(x + i * width, [rs[o]["step_s"] * 1e3 for o in ORDERS], width, label=f"{label}: step")
        axes[1].bar(x + i * width, [rs[o]["comm_s"] * 1e3 for o in ORDERS], width * 0.5, color="k", alpha=0.35,
                    label="of which allreduce" if i == 0 else None)
        for b, o in zip(bars, ORDERS):
            axes[1].annotate(f"{rs[o]['step_s'] * 1e3:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                             ha="center", va="bottom", fontsize=6)
        first = all(g[1] != ids for g in groups[:i])     # the curves are the same on every network
        for o in ORDERS:
            axes[2].plot(rs[o]["losses"], lw=1, ls="-" if o == "random" else "--",
                         label=f"ids {ids}: every order and network" if o == "random" and first else None)
    for ax in axes[:2]:
        ax.set_xticks(x + 0.4 - width / 2, ORDERS)
        ax.legend(fontsize=6)
    workers = sorted({c["workers"] for c in configs.values()})
    axes[0].set(ylabel="% of the tables' blocks", title="non-zero table blocks per worker and step")
    axes[0].set_ylim(0, axes[0].get_ylim()[1] * (1 + 0.07 * len(groups)))   # room for the legend
    axes[1].set_yscale("log")                             # lost results can make a step 10x longer
    low, high = min(r["comm_s"] for r in rows) * 1e3, max(r["step_s"] for r in rows) * 1e3
    axes[1].set_ylim(low / 2, high * (high / low) ** (0.1 * len(groups)))   # the upper part for the legend
    axes[1].set(ylabel="ms (log scale)",
                title=f"step time (slowest rank), {'/'.join(map(str, workers))} workers, CPU shared")
    axes[2].set(xlabel="step", ylabel="loss (mean over ranks)",
                title="loss curves (random: solid, other orders: dashed)")
    axes[2].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
