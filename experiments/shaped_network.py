"""Training over a real, rate-limited network: gloo vs ZeroSum when the link, not the CPU, is scarce.

On loopback every process shares two cores and no link limits anyone, so the allreduce's CPU cost decides
(README, "torch"). Clusters without special NICs have the opposite problem: 1-10 Gbit/s per host. This
script builds that network on one machine and trains the torch example over it:

- one network namespace per worker and one for the aggregator, each with one veth link to a bridge;
- every link is shaped in both directions with a token bucket (tc tbf) at --rate, like a host's NIC;
- the workers run the example (`zerosum.examples.embedding` by default) with `--mode all`: local
  (no exchange), gloo's ring allreduce and ZeroSum through the aggregator's namespace, same data, same
  run; gloo uses the same shaped links (GLOO_SOCKET_IFNAME=eth0).

    sudo python3 experiments/shaped_network.py                         # 1 Gbit/s, 4 workers, embedding model
    sudo python3 experiments/shaped_network.py --rate 1gbit --rate 10gbit --json shaped.json -- --rows 200000

Arguments after `--` go to the example. Needs root and iproute2 (namespaces, veth, bridge, tbf).
The CPU is still shared by all processes, so the numbers are a lower bound on what separate hosts get.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

from zerosum.argtypes import positive_int, window as window_type
from zerosum.local import LocalAggregator
from zerosum.spec import DEFAULT_PORT as AGGREGATOR_PORT

from zerosum.netns import (SUBNET, _bits, aggregator_ip, rate_type, sh, shaper_drops, socket_drops,  # noqa: F401
                           worker_ip)
from zerosum.netns import star

MASTER_PORT = 29500
LOOPBACK = "loopback"
LINK_OPTIONS = ("rate", "aggregator-rate", "mtu", "max-datagram", "window")
LINK_HELP = {
    "rate": "links shaped to RATE both ways, as tc writes it (e.g. 50mbit, 1gbit), every host a network "
            "namespace of its own (needs root and iproute2)",
    "aggregator-rate": "the aggregator's link with --rate",
    "mtu": "link MTU with --rate",
    "max-datagram": "the workers' largest datagram in bytes (zerosum.Worker(max_datagram=...)); with --rate, "
                    "MTU - 28 avoids IP fragments, whose loss costs the whole datagram",
    "window": "the workers' window (zerosum.Worker(window=...), docs/protocol.md R-L6): auto (a congestion "
              "window), none (every column at once) or the bytes in flight",
}
# what a default of None means, in the help
UNSET = {"rate": "none, all on loopback", "aggregator-rate": "RATE", "max-datagram": "64 KiB"}


def worker_options(cfg: dict) -> dict:
    """The zerosum.Worker options of a run's config: its window always (None is none, not the default),
    its datagram limit where one was set."""
    return {"window": cfg["window"], **({"max_datagram": cfg["max_datagram"]} if cfg.get("max_datagram") else {})}


def link_rate(text: str) -> str:
    """--rate's type where the script also runs without links: a rate as tc writes it, or "loopback"."""
    return text if text == LOOPBACK else rate_type(text)


class _Runs(argparse.Action):
    """Like action="append" (a run per value), but given values replace the default instead of joining it."""

    def __call__(self, parser, namespace, value, option_string=None):
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, ([] if given is self.default or given is None else given) + [value])


def add_link_options(parser: argparse.ArgumentParser, options=LINK_OPTIONS, *, rate=None, aggregator_rate=None,
                     mtu=9000, max_datagram=None, window="auto", loopback=False, runs=(), notes=None) -> None:
    """Add the shaped-link options named in `options` to `parser`, with these defaults: rate None, no
    shaped links unless --rate is given; aggregator_rate None, RATE; max_datagram None and window
    "auto", zerosum.Worker's (64 KiB, the congestion window; --window none: None, every column at once,
    which the scripts pass on as given). With `loopback` (implied by rate LOOPBACK) --rate also takes
    "loopback": the scripts that name the run without links so. The options named in `runs` may be
    repeated, a run per value (a list, or their default). `notes` (option -> text) replaces an option's
    "default ..." in its help where the script does more than take the default."""
    defaults = {"rate": rate, "aggregator-rate": aggregator_rate, "mtu": mtu, "max-datagram": max_datagram,
                "window": window}
    types = {"rate": link_rate if loopback or rate == LOOPBACK else rate_type, "aggregator-rate": rate_type,
             "mtu": positive_int, "max-datagram": positive_int, "window": window_type}
    for name in options:
        several = name in runs
        default = list(defaults[name]) if several and defaults[name] is not None else defaults[name]
        parser.add_argument(f"--{name}", type=types[name], default=default, action=_Runs if several else "store",
                            help=_link_help(name, defaults[name], (notes or {}).get(name), several,
                                            types[name] is link_rate))


def _link_help(name: str, default, note: str | None, several: bool, loopback: bool) -> str:
    if default is None:
        shown = UNSET.get(name, "none")
    else:
        shown = ", ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
    return (LINK_HELP[name] + ("; or loopback" if loopback else "") + f" ({note or f'default {shown}'})"
            + ("; repeat for several runs" if several else ""))


def unwind_on_sigterm() -> None:
    """Killed (SIGTERM), unwind, so that shaped_star removes its namespaces, bridge and firewall rule."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def split_example_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """The script's own arguments, and those after `--`, which go to the example."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def on_host(namespace: str) -> list[str]:
    """The command prefix that runs a command on a host of the star (in its network namespace)."""
    return ["ip", "netns", "exec", namespace]


@contextmanager
def aggregator_on(namespace: str, ip: str, workers: int | None = None, *, key: str | None = None, **options):
    """A software aggregator process on the host `namespace`, listening on ip at zerosum's port
    (zerosum.local.LocalAggregator: `options` are its own); stopped on exit. Without a key it runs in
    protected mode (--insecure): the hosts are private network namespaces of the script."""
    agg = LocalAggregator(workers, listen=f"{ip}:{AGGREGATOR_PORT}", prefix=on_host(namespace), key=key,
                          insecure=key is None, **options)
    try:
        yield agg
    finally:
        agg.stop()


@contextmanager
def shaped_star(hosts: dict[str, str], rate: str, mtu: int, rates: dict[str, str] | None = None):
    """zerosum.netns.star with every link shaped (the experiments' name for it)."""
    with star(hosts, mtu, rate, rates) as built:
        yield built


def run(rate: str, workers: int, aggregators: int, example: str, mtu: int, example_args: list[str],
        timeout: float) -> dict:
    """One training run; aggregators = 0 puts one aggregator on every worker's host (colocated)."""
    hosts = {f"w{r}": worker_ip(r) for r in range(workers)}
    hosts.update({f"a{a}": aggregator_ip(a) for a in range(aggregators)})
    where = [(f"a{a}", aggregator_ip(a)) for a in range(aggregators)] or [(f"w{r}", worker_ip(r)) for r in range(workers)]
    job = 4242
    with shaped_star(hosts, rate, mtu) as (ns, drops), tempfile.TemporaryDirectory() as tmp, ExitStack() as aggs:
        for name, ip in where:
            aggs.enter_context(aggregator_on(ns[name], ip, workers, job=job))
        report = Path(tmp) / "report.json"
        env = dict(os.environ, WORLD_SIZE=str(workers), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=worker_ip(0), MASTER_PORT=str(MASTER_PORT), GLOO_SOCKET_IFNAME="eth0",
                   ZEROSUM_AGGREGATORS=",".join(f"{ip}:{AGGREGATOR_PORT}" for _, ip in where),
                   ZEROSUM_JOB=str(job), OMP_NUM_THREADS="1")
        procs = []
        try:
            chosen = [] if {"--mode", "--schemes"} & set(example_args) else ["--mode", "all"]
            for r in range(workers):
                cmd = [*on_host(ns[f"w{r}"]), sys.executable, "-m", f"zerosum.examples.{example}",
                       *chosen, *example_args] + (["--json", str(report)] if r == 0 else [])
                procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
            outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise SystemExit(f"worker(s) failed at {rate}: {failed}\n" + "\n".join(outputs))
        print(outputs[0], end="", flush=True)
        shaper, sockets = drops()
        return {**json.loads(report.read_text()), "shaper_drops": shaper, "socket_buffer_drops": sockets}


def main(argv=None):
    unwind_on_sigterm()
    argv, example_args = split_example_args(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_link_options(p, ("rate", "mtu"), rate=["1gbit"], runs=("rate",))
    p.add_argument("--workers", type=positive_int, default=4)
    p.add_argument("--aggregators", type=int, default=0,
                   help="aggregators on hosts of their own, each with its own link (default 0: one aggregator "
                        "on every worker's host, so ZeroSum uses the same hosts and links as gloo)")
    p.add_argument("--example", choices=["embedding", "mlp"], default="embedding")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--json", metavar="FILE", help="write all runs' reports here")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("needs root: it creates network namespaces, veth pairs, a bridge and tbf qdiscs")
    runs = []
    for rate in args.rate:
        print(f"== {args.workers} workers, {args.example}, links shaped to {rate} (MTU {args.mtu})", flush=True)
        try:
            runs.append({"rate": rate, "mtu": args.mtu, **run(rate, args.workers, args.aggregators, args.example,
                                                                 args.mtu, example_args, args.timeout)})
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"could not build the network: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}")
        except subprocess.TimeoutExpired:
            raise SystemExit(f"a run at {rate} took longer than --timeout {args.timeout:g} s")
    print(f"\n{'rate':>8} {'scheme':>14} {'step ms':>8} {'vs gloo':>8} {'MB sent/step/worker':>20} {'received':>9} "
          f"{'resent (rank 0)':>16} {'shaper drops':>13} {'socket drops':>13}")
    for r in runs:
        by = {m["mode"]: m for m in r["reports"]}
        for mode, m in by.items():
            vs = f"{by['gloo']['step_s'] / m['step_s']:7.2f}x" if "gloo" in by else f"{'':>8}"
            print(f"{r['rate']:>8} {mode:>14} {m['step_s'] * 1e3:8.0f} {vs} {m['bytes_sent_per_step'] / 1e6:20.2f} "
                  f"{m['bytes_received_per_step'] / 1e6:9.2f} {m['retransmitted_entries']:16d} "
                  f"{r['shaper_drops']:13d} {r['socket_buffer_drops']:13d}")
        if r.get("loss_curve_gap") is not None:
            print(f"{r['rate']:>8}: loss curves of gloo and ZeroSum differ by at most {r['loss_curve_gap']:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
