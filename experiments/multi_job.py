"""Several jobs on one aggregator: does a job take about as long as it does alone, while others run,
one job's workers add loss and garbage, and another job has a dead rank?

    python3 experiments/multi_job.py                 # jobs of 2, 3 and 4 workers, blocks of 64, 256, 1024
    sudo python3 experiments/multi_job.py --rate 50mbit   # every worker on a host of its own, links shaped

One aggregator process serves every job (no job declared up front). Each job's workers reduce --rounds
tensors of --size floats at --density and check every sum against the fixed-point reference. First
each of the three jobs runs alone, then all three at once, together with a noisy job (10 % loss in its
workers, plus a process firing garbage datagrams at the aggregator) and a job whose second rank dies
after joining. Prints per job: median allreduce time alone and together, the ratio, and whether every
sum was exact; then the aggregator's counters (jobs started, ended, refused).

Every rank computes its inputs and reference sums and loads the kernels first; the ranks of a phase
then join and run at once, so the timed allreduces of the jobs overlap each other, not start-up work.
A rank process that ends without a report (and was not meant to die) is reported as a crash with its
exit code and stderr.

On loopback every process shares the machine's cores, so "together" also measures CPU contention. With
--rate every worker (and the garbage sender) runs in a network namespace of its own, on a link shaped
to RATE both ways, and the aggregator on a host of its own with a --aggregator-rate link, as on a
cluster where the aggregator is infrastructure: then a job's time is its workers' links, and "together"
measures what the other jobs cost it through the aggregator. The workers then use a window (--window,
by default 40 ms of RATE, within the shapers' 50 ms queues), and the script counts the packets the
shapers and sockets dropped and the datagrams the hosts could not reassemble, per phase.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from shaped_network import _bits, add_link_options, aggregator_on, on_host, sh, shaped_star

JOBS = [(1, 2, 64), (2, 3, 256), (3, 4, 1024)]   # (job id, workers, block size)
RESENT: dict[int, int] = {}                      # job -> entries its ranks retransmitted
CRASHES: list[dict] = []                         # rank processes that ended without a report
CPU: dict[int, list[float]] = {}                 # job -> CPU seconds per allreduce of each rank
SETTLED: dict[int, list[tuple]] = {}             # job -> (window bytes, srtt s) where each rank's settled
DROPS: dict[str, list[int]] = {}                 # phase -> packets dropped by shapers, sockets, reassembly (--rate)
QUEUE_WINDOW = object()    # --window not given: with --rate 40 ms of the link rate (the shapers queue 50 ms)


def _tensor(job, rank, round_, size, density, block):
    rng = np.random.default_rng([job, rank, round_])
    x = rng.standard_normal(size).astype(np.float32)
    nblocks = -(-size // block)
    x[~np.repeat(rng.random(nblocks) < density, block)[:size]] = 0
    return x


def _rank(job, world, rank, block, address, size, density, rounds, loss, die, max_datagram=None, window=None,
          barrier=False) -> dict:
    """One rank: its inputs and the reference sums first, then (with `barrier`) "ready" on stdout and a
    line on stdin to go on, so that the jobs of a phase join and run their timed allreduces at the same
    time, not while other ranks still start up (imports, the kernels' cache, the inputs)."""
    import zerosum
    from zerosum.reference import reference_allreduce
    from zerosum.warmup import warm_up
    try:
        extra = {"window": window}
        if max_datagram is not None:
            extra["max_datagram"] = max_datagram
        xs = [_tensor(job, rank, r, size, density, block) for r in range(rounds)]
        refs = [reference_allreduce([_tensor(job, q, r, size, density, block) for q in range(world)], block)
                for r in range(rounds)]
        warm_up()
        if barrier:
            print("ready", flush=True)
            sys.stdin.readline()
        with zerosum.Worker(rank, world, [address], job=job, block_size=block, loss=loss, timeout=10, **extra) as w:
            if die:
                os._exit(0)      # dead after joining: no LEAVE
            times, exact = [], True
            cpu = time.process_time()
            for x, ref in zip(xs, refs):
                t = time.perf_counter()
                got = w.allreduce(x)
                times.append(time.perf_counter() - t)
                exact &= got.tobytes() == ref.tobytes()
            cpu = (time.process_time() - cpu) / rounds
            return {"job": job, "rank": rank, "status": "ok", "value": statistics.median(times), "exact": exact,
                    "retransmitted": w.stats.retransmitted_entries, "cpu_s": cpu,
                    "window": w.stats.window, "srtt": w.stats.srtt}
    except Exception as e:       # reported, not raised: the run goes on
        return {"job": job, "rank": rank, "status": "error", "value": f"{type(e).__name__}: {e}", "exact": False}


def _garbage(address, seconds):
    host, port = address.rsplit(":", 1)
    rng = np.random.default_rng(7)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.sendto(rng.integers(0, 256, int(rng.integers(1, 2000)), dtype=np.uint8).tobytes(), (host, int(port)))
        time.sleep(0.0005)


def _run(address, specs, args, where=lambda job, rank: []):
    """specs: (job, world, block, loss, dead ranks); each rank is a process of its own, started under
    the command prefix `where(job, rank)` (a network namespace); returns {job: [reports]}. Every rank
    prepares, then all join and run at once (see _rank).

    Every rank process's return code and stderr are kept: a rank that was meant to die reports nothing,
    any other rank that ends without a report (killed, crashed, or its command failed) is reported as a
    "crash" with its return code and the tail of its stderr, never silently taken for a dead rank."""
    procs = []
    for job, world, block, loss, dead in specs:
        for r in range(world):
            one = [job, world, r, block, address, args.size, args.density, args.rounds, loss, r in dead,
                   args.max_datagram, args.window, True]
            # -X faulthandler: a rank killed by a fatal signal leaves its Python traceback on stderr
            cmd = [*where(job, r), sys.executable, "-X", "faulthandler", __file__, "--one-rank", json.dumps(one)]
            err = tempfile.TemporaryFile("w+")
            procs.append((job, r, r in dead, err, subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                                    stderr=err, text=True)))
    first = [p.stdout.readline() for *_, p in procs]   # "ready", or its report or nothing if it ended
    for *_, p in procs:
        try:
            p.stdin.write("go\n")
            p.stdin.close()
        except OSError:              # it ended before the barrier: reported below
            pass
        p.stdin = None               # (communicate would flush it)
    out = {}
    for (job, r, dead, err, p), line in zip(procs, first):
        text = p.communicate(timeout=300)[0]
        if line.strip() != "ready":
            text = line + text
        err.seek(0)
        err_text = err.read()
        err.close()
        lines = text.strip().splitlines()
        if lines and lines[-1].startswith("{"):
            rep = json.loads(lines[-1])
            out.setdefault(rep["job"], []).append((rep["rank"], rep["status"], rep["value"], rep["exact"]))
            RESENT[rep["job"]] = RESENT.get(rep["job"], 0) + rep.get("retransmitted", 0)
            CPU.setdefault(rep["job"], []).append(rep.get("cpu_s", 0.0))
            SETTLED.setdefault(rep["job"], []).append((rep.get("window", 0), rep.get("srtt")))
        elif not dead or p.returncode != 0:
            tail = " | ".join(err_text.strip().splitlines()[-12:]) or "no stderr"
            out.setdefault(job, []).append((r, "crash", f"exited with code {p.returncode} without a report; "
                                                        f"stderr: {tail}", False))
            CRASHES.append({"job": job, "rank": r, "returncode": p.returncode, "stdout": text[-2000:],
                            "stderr": err_text[-4000:]})
    return out


def _scenario(address, args, where=lambda job, rank: [], noise=(), drops=None) -> tuple[dict, dict]:
    """drops: with --rate, a function giving the packets dropped so far (shaper queues, socket buffers)
    and the datagrams not reassembled, to count them per phase in DROPS."""
    def measured(phase, *run):
        before = drops() if drops else None
        got = _run(*run)
        if drops:
            DROPS[phase] = [b - a for a, b in zip(before, drops())]
        return got

    alone = {}
    for job, world, block in JOBS:
        alone.update(measured(f"job {job} alone", address, [(job, world, block, 0.0, ())], args, where))
    garbage = subprocess.Popen([*noise, sys.executable, __file__, "--garbage", address, "60"])
    try:
        together = measured("together", address, [(job + 10, world, block, 0.0, ()) for job, world, block in JOBS]
                            + [(20, 2, 256, 0.1, ()), (30, 2, 256, 0.0, (1,))], args, where)
    finally:
        garbage.kill()
        garbage.wait()
    return alone, together


def _reassembly_failures(namespaces) -> int:
    """IP datagrams the hosts' kernels could not reassemble: a fragment was lost (the rest wait ipfrag_time,
    30 s), or the host's reassembly memory (ipfrag_high_thresh, 4 MiB) was full, when every fragment is
    dropped until incomplete datagrams time out."""
    total = 0
    for ns in namespaces:
        lines = [line.split() for line in sh(*on_host(ns), "cat", "/proc/net/snmp").stdout.splitlines()
                 if line.startswith("Ip:")]
        total += int(dict(zip(*lines)).get("ReasmFails", 0)) if len(lines) == 2 else 0
    return total


def _shaped(args) -> tuple[dict, dict, dict]:
    """The scenario with every worker on a host of its own (network namespaces, shaped links)."""
    # a host per rank; a job alone and its run together with the others (job + 10) use the same hosts
    host_of = lambda job, rank: f"j{job % 10 if job < 20 else job}r{rank}"
    ranks = [(job, r) for job, world, _ in JOBS for r in range(world)] + [(20, 0), (20, 1), (30, 0), (30, 1)]
    hosts = {"agg": "10.78.0.200", "noise": "10.78.0.201"}
    hosts.update({host_of(job, r): f"10.78.0.{i + 1}" for i, (job, r) in enumerate(ranks)})
    with shaped_star(hosts, args.rate, args.mtu, {"agg": args.aggregator_rate}) as (ns, drops), \
            aggregator_on(ns["agg"], hosts["agg"], max_job_slots=1024, job_idle=5.0,
                          max_datagram=args.max_datagram) as agg:   # the results too: else they stay fragmented
        alone, together = _scenario(agg.address, args, lambda job, r: on_host(ns[host_of(job, r)]),
                                    on_host(ns["noise"]), lambda: (*drops(), _reassembly_failures(ns.values())))
        counters = agg.stop()
    return alone, together, counters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1_000_000, help="floats per tensor")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    add_link_options(ap, aggregator_rate="10gbit", window=QUEUE_WINDOW,
                     notes={"max-datagram": "default 64 KiB; with --rate the aggregator's too",
                            "window": "default: with --rate 40 ms of the link rate, within the shapers' queues of "
                                      "50 ms; none on loopback"})
    ap.add_argument("--one-rank", help=argparse.SUPPRESS)
    ap.add_argument("--garbage", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one_rank:
        print(json.dumps(_rank(*json.loads(args.one_rank))), flush=True)
        return 0
    if args.garbage:
        _garbage(args.garbage[0], float(args.garbage[1]))
        return 0
    load = [os.getloadavg()[0]]   # this machine's other work (the timings share its cores)
    if args.window is QUEUE_WINDOW:
        args.window = _bits(args.rate) // 8 * 40 // 1000 if args.rate else None
    if args.rate:
        if os.geteuid() != 0:
            raise SystemExit("--rate needs root: it creates network namespaces, veth pairs, a bridge and tbf qdiscs")
        alone, together, counters = _shaped(args)
    else:
        from zerosum.local import LocalAggregator
        agg = LocalAggregator(None, max_job_slots=1024, job_idle=5.0)   # 5 jobs fit the default pool of 8192
        try:
            alone, together = _scenario(agg.address, args)
        finally:
            counters = agg.stop()
    load.append(os.getloadavg()[0])
    rows = []
    where = f"links of {args.rate} (aggregator {args.aggregator_rate})" if args.rate else "loopback"
    where += "".join(f", {name} {v}{' B' if isinstance(v, int) else ''}"
                     for name, v in (("window", args.window), ("datagrams of at most", args.max_datagram)) if v)
    print(f"{where}: ", end="")
    print(f"{args.size:,} floats at density {args.density}, median of {args.rounds} allreduces, slowest rank")
    print(f"{'job':>4} {'workers':>7} {'block':>6} {'alone s':>8} {'together s':>10} {'ratio':>6} exact")
    for job, world, block in JOBS:
        a = alone[job]
        t = together[job + 10]
        ok = all(s == "ok" and e for _, s, _, e in a + t)
        ta = max(v for _, s, v, _ in a if s == "ok") if all(s == "ok" for _, s, _, _ in a) else float("nan")
        tt = max(v for _, s, v, _ in t if s == "ok") if all(s == "ok" for _, s, _, _ in t) else float("nan")
        ok &= len(a) == len(t) == world
        rows.append({"job": job, "workers": world, "block": block, "alone_s": ta, "together_s": tt, "exact": ok,
                     "retransmitted_alone": RESENT.get(job, 0), "retransmitted_together": RESENT.get(job + 10, 0),
                     "cpu_alone_s": max(CPU.get(job, [0.0])), "cpu_together_s": max(CPU.get(job + 10, [0.0])),
                     "settled_together": SETTLED.get(job + 10, []),
                     "failures": [f"{phase}, rank {rank}: {value}" for phase, runs in (("alone", a), ("together", t))
                                  for rank, status, value, _ in runs if status != "ok"]})
        print(f"{job:>4} {world:>7} {block:>6} {ta:>8.4f} {tt:>10.4f} {tt / ta:>5.2f}x {'yes' if ok else 'NO'}")
    for job, _, _ in JOBS:
        for phase, runs in (("alone", alone.get(job, [])), ("together", together.get(job + 10, []))):
            for rank, status, value, _ in runs:
                if status != "ok":
                    print(f"job {job} {phase}, rank {rank}: {value}")
    print("entries retransmitted, alone / together:",
          ", ".join(f"job {job}: {RESENT.get(job, 0)} / {RESENT.get(job + 10, 0)}" for job, _, _ in JOBS))
    print("CPU seconds per allreduce (busiest rank), alone / together:",
          ", ".join(f"job {r['job']}: {r['cpu_alone_s']:.3f} / {r['cpu_together_s']:.3f}" for r in rows))
    print("windows (kB) and smoothed round trips (ms) the ranks settled on, together:",
          "; ".join(f"job {job}: " + ", ".join(f"{w / 1e3:.0f} kB {'-' if t is None else f'{t * 1e3:.1f} ms'}"
                                               for w, t in SETTLED.get(job + 10, [])) for job, _, _ in JOBS))
    noisy = together.get(20, [])
    dead = together.get(30, [])
    print("noisy job (10 % loss, garbage alongside):",
          "exact" if noisy and all(s == "ok" and e for _, s, _, e in noisy) else noisy)
    print("job with a dead rank:", "; ".join(str(v) for _, _, v, _ in dead))
    for c in CRASHES:
        print(f"CRASH: job {c['job']} rank {c['rank']} exited with code {c['returncode']} without a report; "
              f"stderr:\n{c['stderr'].rstrip() or '(empty)'}")
    if DROPS:
        print("dropped (shaper queues, socket buffers, datagrams not reassembled):",
              "; ".join(f"{phase}: {', '.join(map(str, d))}" for phase, d in DROPS.items()))
    print(f"load average (1 min) of this machine at the start and the end: {load[0]:.1f}, {load[1]:.1f}")
    print("aggregator:", json.dumps({k: v for k, v in counters.items() if k.startswith(("jobs", "joins", "drop"))}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"where": where, "max_datagram": args.max_datagram, "window": args.window, "rows": rows,
                       "counters": counters, "drops": DROPS, "crashes": CRASHES, "load_average_1min": load}, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
