"""The congestion window on shaped links: does ZeroSum find a link's rate by itself, and share it?

    sudo python3 experiments/congestion.py single --rate 50mbit --rate 1gbit --mtu 1500 --mtu 9000
    sudo python3 experiments/congestion.py share          # 2 and 3 jobs on one bottleneck, 1 s apart
    sudo python3 experiments/congestion.py tcp            # one job beside a long TCP flow (iperf3)
    sudo python3 experiments/congestion.py drop           # the bottleneck's rate halves mid-run
    sudo python3 experiments/congestion.py all --json docs/congestion.json --doc docs/congestion.md

Every worker runs on a host of its own (a network namespace with one veth link, shaped both ways by tc
tbf with a 50 ms queue, zerosum.netns), and so does the one aggregator that serves every job.

- single: one job of 4 workers whose links run at --rate, behind an aggregator link 4x as fast; the
  automatic window (window="auto") against no window and fixed windows of 1/4 to 4 times the path's
  bandwidth-delay product plus 10 ms of queue (the best of them is the best hand-tuned window).
- share: 2 and 3 jobs of 2 workers each, started 1 s apart; the aggregator's link (--rate) is the
  bottleneck that they share, every worker link runs at 4x. Jain's fairness index of the jobs' rates
  while all run.
- tcp: one such job beside a TCP flow into the aggregator's host (iperf3), on the same bottleneck.
- drop: one job; the bottleneck's rate halves 3 s into the run (tc change).

Each job reduces dense tensors of --size floats back to back and checks every sum against the
fixed-point reference. Per allreduce it records when it ended and how long it took: a job's rate is
the tensor's bytes over the allreduce's time, the rate it reduces gradients at. Numbers are medians of
--runs runs. The CPU is shared by every process (2 cores here), so at 10 Gbit/s the CPU, not the link,
decides.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from zerosum import protocol as P
from zerosum.local import CTX, new_key
from zerosum.netns import _bits, aggregator_ip, available, change_rate, rate_type, star, worker_ip

from shaped_network import add_link_options, aggregator_on, on_host

BLOCK = 256                              # the workers' block size (Worker's default)
ENTRY = P.ENTRY_SIZE + 4 * BLOCK         # bytes of one entry with its data on the wire


def tensor(job: int, rank: int, size: int) -> np.ndarray:
    return np.random.default_rng([job, rank]).standard_normal(size).astype(np.float32)


def _counters(w) -> dict:
    """The worker's cumulative counters that a run reports (zerosum.bench.counter_delta takes them apart)."""
    s = w.stats
    return {"retransmitted": s.retransmitted_entries, "sent": s.bytes_sent, "spurious": s.spurious_entries,
            "drains": s.drains, "delay_cuts": s.window_cuts[0], "loss_cuts": s.window_cuts[1]}


def _rank(namespace, job, rank, world, address, key, size, seconds, rounds, window, congestion, start, delay, q):
    """One worker: joins, warms up and says so on `q`, waits until `delay` seconds after the time.time()
    that the parent then puts into `start` (shared), then reduces its tensor back to back for
    `seconds` (at least one allreduce) or `rounds` allreduces; reports every allreduce's end and
    duration, the retransmissions of those allreduces, where its window settled, and whether every sum
    was exact. With `rounds` (one job alone: the steady state) the warm-up is an untimed allreduce of
    the whole tensor, as in `zerosum bench`: a run's first allreduce of that size faults in its result's
    pages and took 1.4-2.3x the time of the next ones, for every window alike, which a median of a few
    rounds does not filter out. With `seconds` (jobs that start one after another) it is a small one: a
    job's start, slow start included, is what those runs measure."""
    try:
        from zerosum import Worker
        from zerosum.bench import counter_delta
        from zerosum.netns import enter
        from zerosum.reference import reference_allreduce
        enter(namespace)
        x = tensor(job, rank, size)
        ref = reference_allreduce([tensor(job, r, size) for r in range(world)], BLOCK) if rank == 0 else None
        with Worker(rank, world, [address], job=job, block_size=BLOCK, key=key, window=window, congestion=congestion,
                    timeout=20) as w:
            w.allreduce(x if rounds else x[: BLOCK * 64])       # joined, kernels warm
            warm = _counters(w)                                 # counts below are the timed allreduces'
            q.put({"ready": (job, rank)})
            while not start.value:
                time.sleep(0.01)
            time.sleep(max(0.0, start.value + delay - time.time()))
            log, exact = [], True
            first = time.time()
            while (len(log) < rounds) if rounds else (time.time() - first < seconds or not log):
                t0 = time.perf_counter()
                y = w.allreduce(x)
                log.append((time.time(), time.perf_counter() - t0))
                if ref is not None:
                    exact &= y.tobytes() == ref.tobytes()
            timed = counter_delta(warm, _counters(w))
            q.put({"job": job, "rank": rank, "log": log, "exact": exact,
                   "retransmitted": timed["retransmitted"], "sent": timed["sent"], "window": w.stats.window,
                   "srtt": w.stats.srtt, "cuts": [timed["delay_cuts"], timed["loss_cuts"]],
                   "spurious": timed["spurious"], "drains": timed["drains"], "competitive": w.stats.competitive})
    except Exception as e:
        q.put({"job": job, "rank": rank, "error": f"{type(e).__name__}: {e}"})


def run_jobs(jobs, *, worker_rate, aggregator_rate, mtu, size, seconds=0.0, rounds=0, window="auto",
             congestion=True, starts=None, tcp_seconds=0.0, rate_change=None) -> dict:
    """jobs: workers per job. Returns per job its allreduce log, exactness, retransmissions, windows;
    the shapers' drops; with tcp_seconds, iperf3's report of a TCP flow from its own host into the
    aggregator's; with rate_change = (seconds, rate), the aggregator link's rate is changed then."""
    hosts = {"a0": aggregator_ip(0)}
    for j, world in enumerate(jobs):
        hosts.update({f"j{j}w{r}": worker_ip(10 * j + r) for r in range(world)})
    if tcp_seconds:
        hosts["tcp"] = worker_ip(99)
    rates = {"a0": aggregator_rate}
    key = new_key()
    with star(hosts, mtu, worker_rate, rates) as (ns, drops), \
            aggregator_on(ns["a0"], aggregator_ip(0), key=key) as agg:
        q, start = CTX.Queue(), CTX.Value("d", 0.0)
        starts = starts or [0.0] * len(jobs)
        procs = [CTX.Process(target=_rank, daemon=True,
                             args=(ns[f"j{j}w{r}"], 100 + j, r, world, agg.address, key, size, seconds, rounds,
                                   window, congestion, start, starts[j], q))
                 for j, world in enumerate(jobs) for r in range(world)]
        for p in procs:
            p.start()
        # the clock starts once every rank has joined and warmed up (on a loaded machine that takes seconds),
        # so that the jobs' start offsets hold
        reports = [q.get(timeout=300) for _ in procs]
        failed = [r for r in reports if "ready" not in r]
        t0 = time.time() + 1.5
        start.value = t0
        iperf = None
        if tcp_seconds:
            server = subprocess.Popen([*on_host(ns["a0"]), "iperf3", "-s", "-1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(max(0.5, t0 - time.time() - 1.0))
            iperf = subprocess.Popen([*on_host(ns["tcp"]), "iperf3", "-c", aggregator_ip(0), "-J",
                                      "-t", str(tcp_seconds), "-i", "0.2"], stdout=subprocess.PIPE, text=True)
        if rate_change:
            time.sleep(max(0.0, t0 + rate_change[0] - time.time()))
            change_rate(ns["a0"], rate_change[1])
        reports = failed + [q.get(timeout=600) for _ in range(len(procs) - len(failed))]
        for p in procs:
            p.join(10)
        out = {"jobs": [], "t0": t0, "shaper_drops": drops()[0]}
        if iperf is not None:
            report = json.loads(iperf.communicate(timeout=120)[0])
            server.wait(10)
            out["tcp"] = [(t0 - 1.0 + i["sum"]["end"], i["sum"]["bits_per_second"] / 8)
                          for i in report["intervals"]]
    errors = [r for r in reports if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} ranks failed, e.g. job {errors[0]['job']} rank {errors[0]['rank']}: "
                           f"{errors[0]['error']}")
    for j in range(len(jobs)):
        mine = sorted((r for r in reports if r["job"] == 100 + j), key=lambda r: r["rank"])
        out["jobs"].append({
            "log": mine[0]["log"], "exact": mine[0]["exact"],
            "retransmitted": sum(r["retransmitted"] for r in mine), "sent": sum(r["sent"] for r in mine),
            "spurious": sum(r["spurious"] for r in mine), "windows": [r["window"] for r in mine], "srtt": [r["srtt"] for r in mine],
            "cuts": [r["cuts"] for r in mine], "drains": [r["drains"] for r in mine],
            "competitive": [r["competitive"] for r in mine]})
    return out


def job_rate(job, size, since=-np.inf, until=np.inf) -> float:
    """Bytes of tensor reduced per second by the job's allreduces that ended within [since, until]."""
    done = [(end, dt) for end, dt in job["log"] if since <= end - dt and end <= until]
    return size * 4 * len(done) / sum(dt for _, dt in done) if done else 0.0


def jain(xs) -> float:
    xs = np.asarray(xs, float)
    return float(xs.sum() ** 2 / (len(xs) * (xs ** 2).sum())) if xs.any() else 0.0


def median_time(job) -> float:
    return statistics.median(dt for _, dt in job["log"])


def best_fixed(rows) -> dict:
    """The fixed-window row with the least median time: the best hand-tuned window of a sweep."""
    return min((r for r in rows if r["window"].startswith("fixed")), key=lambda r: r["time_s"])


# -- the four experiments ------------------------------------------------------------------------------

def single(args) -> dict:
    rows, holdout = [], []
    for rate in args.rate:
        for mtu in args.mtu:
            bps = _bits(rate) / 8
            bdp = int(bps * (0.001 + 0.010))        # ~1 ms of path and 10 ms of queue
            variants = [("auto", "auto", True), ("none", None, True)]
            variants += [(f"fixed {f:g}x", max(2000, int(bdp * f)), False) for f in (0.25, 0.5, 1, 2, 4)]

            def one(window, congestion):
                return run_jobs([4], worker_rate=rate, aggregator_rate=f"{4 * _bits(rate)}bit", mtu=mtu,
                                size=args.size, rounds=args.rounds, window=window, congestion=congestion)
            for label, window, congestion in variants:
                runs = [one(window, congestion) for _ in range(args.runs)]
                jobs = [r["jobs"][0] for r in runs]
                row = {"rate": rate, "mtu": mtu, "window": label, "time_s": statistics.median(map(median_time, jobs)),
                       "times_s": [median_time(j) for j in jobs],
                       "retransmitted": statistics.median(j["retransmitted"] for j in jobs),
                       "spurious": statistics.median(j["spurious"] for j in jobs),
                       "retransmitted_share": statistics.median(j["retransmitted"] / max(1, j["sent"] / ENTRY)
                                                                for j in jobs),
                       "shaper_drops": statistics.median(r["shaper_drops"] for r in runs),
                       "exact": all(j["exact"] for j in jobs),
                       "settled_window": statistics.median(w for j in jobs for w in j["windows"]),
                       "srtt_ms": statistics.median(s * 1e3 for j in jobs for s in j["srtt"] if s)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if args.holdout:
                # The best of five noisy medians is biased low (it is chosen for being fast in these runs).
                # A user who tuned by hand would run the window chosen so in new runs: measure that one and
                # auto again, alternating, in runs of their own.
                best = best_fixed(r for r in rows if (r["rate"], r["mtu"]) == (rate, mtu))
                window = dict((label, w) for label, w, _ in variants)[best["window"]]
                times = {"auto": [], "best": []}
                for _ in range(args.holdout):
                    times["auto"].append(median_time(one("auto", True)["jobs"][0]))
                    times["best"].append(median_time(one(window, False)["jobs"][0]))
                held = {"rate": rate, "mtu": mtu, "best": best["window"], "auto_times_s": times["auto"],
                        "best_times_s": times["best"], "auto_s": statistics.median(times["auto"]),
                        "best_s": statistics.median(times["best"])}
                holdout.append(held)
                print(json.dumps(held), flush=True)
    return {"rows": rows, "holdout": holdout}


def share(args) -> dict:
    out = []
    for n in (2, 3):
        runs = []
        for _ in range(args.runs):
            r = run_jobs([2] * n, worker_rate=f"{4 * _bits(args.share_rate)}bit", aggregator_rate=args.share_rate,
                         mtu=args.mtu[0], size=args.size, seconds=args.seconds, starts=[float(i) for i in range(n)])
            since = r["t0"] + (n - 1)                     # all running
            until = min(j["log"][-1][0] for j in r["jobs"])
            rates = [job_rate(j, args.size, since, until) for j in r["jobs"]]
            runs.append({"rates": rates, "jain": jain(rates), "exact": all(j["exact"] for j in r["jobs"]),
                         "retransmitted": sum(j["retransmitted"] for j in r["jobs"]),
                         "series": [[(end - r["t0"], args.size * 4 / dt) for end, dt in j["log"]] for j in r["jobs"]]})
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "series"}), flush=True)
        out.append({"jobs": n, "runs": runs, "jain": statistics.median(x["jain"] for x in runs)})
    return {"rate": args.share_rate, "rows": out}


def tcp(args) -> dict:
    if not shutil.which("iperf3"):
        raise SystemExit("the tcp experiment needs iperf3 (apt-get install iperf3)")
    runs = []
    for _ in range(args.runs):
        r = run_jobs([2], worker_rate=f"{4 * _bits(args.share_rate)}bit", aggregator_rate=args.share_rate,
                     mtu=args.mtu[0], size=args.size, seconds=args.seconds, tcp_seconds=args.seconds + 2)
        job = r["jobs"][0]
        start, end = job["log"][0][0] - job["log"][0][1], job["log"][-1][0]
        link = _bits(args.share_rate) / 8
        zs = job_rate(job, args.size) * 2 * ENTRY / (4 * BLOCK)    # the job's bytes on the link (data, ~)
        tcp_rate = statistics.mean(b for t, b in r["tcp"] if start <= t <= end)
        runs.append({"zerosum_share": zs / link, "tcp_share": tcp_rate / link, "exact": job["exact"],
                     "series": {"zerosum": [(e - r["t0"], args.size * 4 / dt) for e, dt in job["log"]],
                                "tcp": [(t - r["t0"], b) for t, b in r["tcp"]]}})
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "series"}), flush=True)
    return {"rate": args.share_rate, "runs": runs}


def drop(args) -> dict:
    runs = []
    for _ in range(args.runs):
        half = f"{_bits(args.share_rate) // 2}bit"
        r = run_jobs([2], worker_rate=f"{4 * _bits(args.share_rate)}bit", aggregator_rate=args.share_rate,
                     mtu=args.mtu[0], size=args.size, seconds=6.0, rate_change=(3.0, half))
        job = r["jobs"][0]
        change = r["t0"] + 3.0
        before = job_rate(job, args.size, until=change)
        after = job_rate(job, args.size, since=change + 1.0)
        runs.append({"before": before, "after": after, "after_vs_before": after / before if before else None,
                     "exact": job["exact"], "retransmitted": job["retransmitted"],
                     "series": [(e - r["t0"], args.size * 4 / dt) for e, dt in job["log"]]})
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "series"}), flush=True)
    return {"rate": args.share_rate, "runs": runs}


# -- the report -----------------------------------------------------------------------------------------

def write_doc(results: dict, path: Path, command: str) -> None:
    """docs/congestion.md: a table per experiment that ran, and a plot of the rates over time."""
    results = {k: v for k, v in results.items() if k != "command"}
    lines = ["# The congestion window on shaped links", "",
             "What `Worker(window=\"auto\")` does on links shaped with tc tbf (50 ms queues), measured by "
             f"`{command}` (experiments/congestion.py; hosts in network namespaces on one 2-core machine, so "
             "fast links are CPU-bound). Every sum was checked against the fixed-point reference.", ""]
    if "single" in results:
        lines += ["## One job, 4 workers, worker links at the rate, aggregator link 4x", "",
                  "| rate | MTU | window | allreduce (s, median) | runs | retransmitted entries (share; of them held already) | "
                  "shaper drops | settled window (kB) | srtt (ms) | exact |", "|---|--:|---|--:|---|--:|--:|--:|--:|:-:|"]
        for r in results["single"]["rows"]:
            lines.append(f"| {r['rate']} | {r['mtu']} | {r['window']} | {r['time_s']:.3f} | "
                         f"{', '.join(f'{t:.3f}' for t in r['times_s'])} | {r['retransmitted']:.0f} "
                         f"({100 * r['retransmitted_share']:.3f} %; {r.get('spurious', 0):.0f}) | {r['shaper_drops']:.0f} | "
                         f"{r['settled_window'] / 1e3:,.0f} | {r['srtt_ms']:.1f} | {'yes' if r['exact'] else 'NO'} |")
        for rate, mtu in sorted({(r["rate"], r["mtu"]) for r in results["single"]["rows"]}):
            rows = [r for r in results["single"]["rows"] if (r["rate"], r["mtu"]) == (rate, mtu)]
            auto = next(r for r in rows if r["window"] == "auto")
            best = best_fixed(rows)
            settled = [r["settled_window"] for r in rows if r["window"].startswith("fixed")]
            same = len(settled) > 1 and len(set(settled)) == 1     # windows past every column: all alike
            lines.append(f"\n{rate}, MTU {mtu}: the automatic window takes {auto['time_s'] / best['time_s']:.2f}x "
                         f"the time of the best fixed window ({best['window']})."
                         + (f" Every fixed window of this sweep holds every column, so they are one setting run "
                            f"{len(settled)} times, and the best of them is the least of {len(settled)} noisy medians "
                            "of it." if same else ""))
        held = results["single"].get("holdout") or []
        if held:
            lines += ["", "Held out: the best fixed window of the sweep above is the one that was fastest in those "
                      "runs, so its median is biased low. In runs of their own, alternating, the window chosen so and "
                      "auto (what a user who tuned by hand would get):", "",
                      "| rate | MTU | chosen window | auto (s, median) | runs | chosen window (s, median) | runs | "
                      "auto / chosen |", "|---|--:|---|--:|---|--:|---|--:|"]
            for h in held:
                lines.append(f"| {h['rate']} | {h['mtu']} | {h['best']} | {h['auto_s']:.4f} | "
                             f"{', '.join(f'{t:.4f}' for t in h['auto_times_s'])} | {h['best_s']:.4f} | "
                             f"{', '.join(f'{t:.4f}' for t in h['best_times_s'])} | {h['auto_s'] / h['best_s']:.2f}x |")
        lines.append("")
    if "share" in results:
        lines += [f"## Jobs sharing a {results['share']['rate']} bottleneck (2 workers each, started 1 s apart)", "",
                  "| jobs | Jain's index (median) | per run | rates while all run (MB/s) | exact |",
                  "|--:|--:|---|---|:-:|"]
        for row in results["share"]["rows"]:
            jains = ", ".join(f"{x['jain']:.3f}" for x in row["runs"])
            lines.append(f"| {row['jobs']} | {row['jain']:.3f} | {jains} | "
                         + "; ".join(", ".join(f"{v / 1e6:.1f}" for v in x["rates"]) for x in row["runs"])
                         + f" | {'yes' if all(x['exact'] for x in row['runs']) else 'NO'} |")
        lines.append("")
    if "tcp" in results:
        lines += [f"## One job beside a TCP flow (iperf3) on a {results['tcp']['rate']} bottleneck", "",
                  "| run | ZeroSum's share of the link | TCP's share | exact |", "|--:|--:|--:|:-:|"]
        for i, x in enumerate(results["tcp"]["runs"]):
            lines.append(f"| {i + 1} | {100 * x['zerosum_share']:.0f} % | {100 * x['tcp_share']:.0f} % | "
                         f"{'yes' if x['exact'] else 'NO'} |")
        lines.append("")
    if "drop" in results:
        lines += [f"## The bottleneck ({results['drop']['rate']}) halves 3 s into the run", "",
                  "| run | rate before (MB/s) | from 1 s after the change | after / before | retransmitted | exact |",
                  "|--:|--:|--:|--:|--:|:-:|"]
        for i, x in enumerate(results["drop"]["runs"]):
            lines.append(f"| {i + 1} | {x['before'] / 1e6:.1f} | {x['after'] / 1e6:.1f} | {x['after_vs_before']:.2f} | "
                         f"{x['retransmitted']} | {'yes' if x['exact'] else 'NO'} |")
        lines.append("")
    series = []
    if "share" in results:
        for row in results["share"]["rows"]:
            series += [(f"{row['jobs']} jobs: job {j + 1}", s) for j, s in enumerate(row["runs"][0]["series"])]
    if "tcp" in results and results["tcp"]["runs"]:
        series += [(f"beside TCP: {k}", v) for k, v in results["tcp"]["runs"][0]["series"].items()]
    if "drop" in results and results["drop"]["runs"]:
        series.append(("rate halved at 3 s", results["drop"]["runs"][0]["series"]))
    if series:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for label, points in series:
            if points:
                t, v = zip(*points)
                ax.plot(t, np.asarray(v) / 1e6, ".-", label=label, linewidth=0.8, markersize=3)
        ax.set_xlabel("seconds since the first job started")
        ax.set_ylabel("rate (MB/s of tensor, or of TCP payload)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
        lines += [f"![each flow's rate over time]({path.with_suffix('.png').name})", ""]
    path.write_text("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("what", choices=["single", "share", "tcp", "drop", "all"])
    add_link_options(ap, ("rate", "mtu"), rate=["50mbit", "1gbit"], mtu=None, runs=("rate", "mtu"),
                     notes={"rate": "single: the workers' links, the aggregator's 4x as fast; default 50mbit, 1gbit",
                            "mtu": "default 1500; single: 1500 and 9000"})
    ap.add_argument("--share-rate", type=rate_type, default="200mbit", help="share/tcp/drop: the bottleneck's rate")
    ap.add_argument("--size", type=int, default=1_048_576, help="floats per tensor")
    ap.add_argument("--rounds", type=int, default=5, help="single: allreduces per run")
    ap.add_argument("--seconds", type=float, default=6.0, help="share/tcp: seconds each job runs")
    ap.add_argument("--runs", type=int, default=3, help="runs per configuration (medians are reported)")
    ap.add_argument("--holdout", type=int, default=0,
                    help="single: then this many runs each of auto and of the sweep's best fixed window, alternating")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--doc", default=None, help="write the tables (and a plot beside it) into this markdown file")
    ap.add_argument("--from-json", default=None, help="only write --doc from an earlier --json")
    args = ap.parse_args(argv)
    command = "sudo python3 experiments/congestion.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        write_doc(results, Path(args.doc or "docs/congestion.md"), results.pop("command", command))
        return
    if available():
        raise SystemExit(f"this experiment {available()}")
    args.mtu = args.mtu or ([1500, 9000] if args.what in ("single", "all") else [1500])
    todo = ["single", "share", "tcp", "drop"] if args.what == "all" else [args.what]
    results = {w: globals()[w](args) for w in todo}
    if args.json:
        Path(args.json).write_text(json.dumps(dict(results, command=command), indent=1))
    if args.doc:
        write_doc(results, Path(args.doc), command)


if __name__ == "__main__":
    main()
