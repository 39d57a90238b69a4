"""The `zerosum` command: aggregator (the software aggregator), stats (ask one for its counters), demo
(the main job on loopback), bench (the OmniReduce microbenchmark against gloo), check (one rank of a
multi-host correctness run) and switch (the emulated P4 switch)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import textwrap
from .argtypes import positive_int as _positive_int, rate as _rate, window as _window

from . import protocol as P
from .aggregator_service import MAX_JOB_SLOTS


class _Help(argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default (where it has one worth showing)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" not in text and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """Bad arguments give one line on stderr, not a usage dump or a traceback; --help shows defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


COUNTERS_HELP = textwrap.fill(
    "The answer (and the aggregator counters in bench.json) holds `counters`, the totals including ended "
    "jobs, the slot pool (`slots`, `slots_in_use`) and per job its `world`, `slots`, `members` and "
    "`counters`. The counters, by name: " + ", ".join(P.spec.COUNTERS) + ". What each one counts: "
    "docs/protocol.md, \"Counters\" (drops are named after the rule that dropped the datagram).", 100)


def _densities(text):
    try:
        vals = [float(t) for t in text.split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not 0 <= v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"densities must be in [0, 1], got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zerosum", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    a = sub.add_parser("aggregator", help="run the software aggregator")
    a.add_argument("--workers", type=_positive_int, default=None,
                   help="declare job --job with this many workers (its JOINs must match); jobs are also "
                        "created by their workers' JOINs")
    a.add_argument("--listen", default=f"0.0.0.0:{P.DEFAULT_PORT}",
                   help="HOST:PORT, HOST, :PORT or PORT to listen on (off loopback: needs --key-file)")
    a.add_argument("--job", type=int, default=1, help="the job --workers declares")
    a.add_argument("--jobs", metavar="FILE",
                   help='declare several jobs: a JSON object {"JOB": WORKERS, ...}, e.g. {"1": 4, "7": 2}')
    a.add_argument("--slots", type=_positive_int, default=8192, help="the slot pool shared by all jobs")
    a.add_argument("--max-jobs", type=_positive_int, default=16, help="jobs served at once (more are refused)")
    a.add_argument("--min-job-slots", type=_positive_int, default=64,
                   help="a job is refused when fewer slots than this are free")
    a.add_argument("--max-job-slots", type=_positive_int, default=MAX_JOB_SLOTS, help="most slots one job gets")
    a.add_argument("--job-idle", type=float, default=60.0, metavar="SECONDS",
                   help="a job silent this long ends and frees its slots (0: only when all ranks leave; "
                        "jobs declared with --job/--jobs end only when all their ranks leave)")
    a.add_argument("--join-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a job created by JOINs ends unless all its ranks joined within this long, so that "
                        "a stray JOIN cannot hold a job id (0: never; declared jobs: never)")
    a.add_argument("--key-file", metavar="FILE",
                   help="a secret shared with the workers (Worker(key=...), ZEROSUM_KEY), or a JSON object "
                        "of per-job secrets {\"JOB\": \"secret\"}: only JOINs with its HMAC are admitted")
    a.add_argument("--insecure", action="store_true",
                   help="run without --key-file on an address other than loopback (refused otherwise): "
                        "anyone who can reach it can then join or disturb a job")
    a.add_argument("--multicast", default=None, metavar="GROUP:PORT",
                   help="send the results of completed rounds once to this IP multicast group instead of to "
                        "each worker (workers: Worker(multicast=...), ZEROSUM_MULTICAST); TTL 0 on loopback")
    a.add_argument("--max-datagram", type=_positive_int, default=P.MAX_DATAGRAM, metavar="BYTES",
                   help="largest datagram sent (default 65507); results to a member are also kept within "
                        "the path MTU - 28 to it, so that none is IP-fragmented (lost fragments fill the "
                        "workers' reassembly memory)")
    a.add_argument("--loss", type=_rate, default=0.0, help="simulated loss rate, e.g. 0.01 or 1%%")
    a.add_argument("--seed", type=int, default=None, help="seed of the simulated loss")
    a.add_argument("--stats", "--stats-interval", dest="stats", type=float, default=0.0, metavar="SECONDS",
                   help="log the counters (in total and per job) this often")
    a.add_argument("--idle-exit", type=float, default=0.0, metavar="SECONDS",
                   help="exit once workers have been silent this long after some data arrived (0: never)")
    a.add_argument("--announce", action="store_true",
                   help="print the bound address when ready and the counters as JSON at exit (for scripts)")

    def bench_args(b, *, densities, rounds, workers):
        b.add_argument("--worlds", "--workers", dest="workers", type=_positive_int, nargs="+", default=workers,
                       metavar="N", help="world sizes to run, one after another (worker processes on loopback)")
        b.add_argument("--densities", type=_densities, default=densities,
                       help="comma-separated fractions of non-zero blocks")
        b.add_argument("--size", type=_positive_int, default=26_214_400, help="floats per tensor")
        b.add_argument("--block-size", type=_positive_int, default=256, help="values per block")
        b.add_argument("--aggregators", type=_positive_int, default=1, help="aggregator processes")
        b.add_argument("--slots", type=_positive_int, default=None,
                       help="slots per aggregator (default: on loopback as many as keep the job's blocks in "
                            "flight within a quarter of the last-level cache, at most %d; on veth links %d)"
                       % (MAX_JOB_SLOTS, MAX_JOB_SLOTS))
        b.add_argument("--rounds", type=_positive_int, default=rounds, help="timed allreduces per density")
        b.add_argument("--warmup", type=int, default=1, help="untimed allreduces per density")
        b.add_argument("--no-baseline", action="store_true", help="skip the torch gloo allreduce baseline")
        b.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                       help="check every rank's first result against the fixed-point reference")
        b.add_argument("--loss", type=_rate, default=0.0, help="simulated loss at the workers")
        b.add_argument("--port", type=int, default=0, help="first aggregator port (0: pick free ports)")
        b.add_argument("--max-datagram", type=_positive_int, default=None, metavar="BYTES",
                       help="largest datagram of workers and aggregators (default: the path MTU - 28), "
                            "e.g. 1472 or 8972 for the datagram counts of MTU 1,500 or 9,000 links")
        b.add_argument("--mtu", type=_positive_int, default=None, metavar="BYTES",
                       help="run every worker and aggregator on a host of its own (network namespaces, "
                            "veth links of this MTU, unshaped; needs root), gloo on the same links")
        b.add_argument("--multicast", default="auto", metavar="auto|off|GROUP[:PORT]",
                       help="the aggregator sends results once to an IP multicast group, which the workers "
                            "join, instead of once to each worker: auto, where a probe finds that it works (on "
                            "loopback with TTL 0: nothing leaves the host; with --mtu across the veth "
                            "links); off, to each worker; GROUP, that group (e.g. 239.255.77.1)")
        b.add_argument("--window", type=_window, default="auto", metavar="auto|none|BYTES",
                       help="the workers' window: auto, the congestion window; BYTES, its upper bound (with "
                            "--no-congestion: the fixed window); none, every column at once")
        b.add_argument("--congestion", action=argparse.BooleanOptionalAction, default=True,
                       help="adapt the window to the path (docs/protocol.md, R-C*)")
        b.add_argument("--device", default="cpu", metavar="cpu|cuda|cuda:N",
                       help="where the workers' tensors live: cuda for GPU workers (torch tensors on the "
                            "device, their blocks found there; gloo reduces the same tensors)")
        b.add_argument("--floor", action="store_true",
                       help="also run the sockets-only star (the floor: moving the same datagrams, no "
                            "arithmetic, no loss recovery) and show ZeroSum's time against it")
        b.add_argument("--output", default="results", help="directory for bench.json and bench.png")

    b = sub.add_parser("bench", help="OmniReduce microbenchmark: ZeroSum vs torch gloo allreduce")
    bench_args(b, densities=[1.0, 0.8, 0.4, 0.2, 0.1, 0.04, 0.01], rounds=3, workers=[2, 4, 8])
    c = sub.add_parser("check", help="one rank of a multi-host correctness run (exit 1 on any wrong sum)")
    c.add_argument("--rank", type=int, required=True, help="this process's rank, 0..world-1")
    c.add_argument("--world", type=_positive_int, required=True, help="the number of ranks")
    c.add_argument("--aggregators", nargs="+", default=[f"127.0.0.1:{P.DEFAULT_PORT}"], metavar="HOST:PORT",
                   help="the aggregators (the same list, in the same order, on every rank)")
    c.add_argument("--job", type=int, default=1, help="the job id (the same on every rank)")
    c.add_argument("--size", type=_positive_int, default=1_000_000, help="floats per tensor")
    c.add_argument("--densities", type=_densities, default=[1.0, 0.1, 0.01],
                   help="comma-separated fractions of non-zero blocks, one allreduce each")
    c.add_argument("--block-size", type=_positive_int, default=256, help="values per block")
    c.add_argument("--max-entries", type=_positive_int, default=0xFFFF,
                   help="blocks per datagram (a switch takes 1, with --block-size 64)")
    c.add_argument("--bind", default="0.0.0.0:0", metavar="IP:PORT",
                   help="send from this address (a switch knows its workers by source address)")
    c.add_argument("--seed", type=int, default=0, help="seed of the tensors (the same on every rank)")
    c.add_argument("--loss", type=_rate, default=0.0, help="simulated loss at this worker")
    c.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before failing")
    c.add_argument("--results", default="", help="directory for rank-N.json")
    c.add_argument("--key-file", metavar="FILE",
                   help="the secret shared with the aggregators (their --key-file): JOINs carry its HMAC")
    st = sub.add_parser("stats", help="ask a running aggregator for its counters (JSON on stdout)",
                        epilog=COUNTERS_HELP)
    st.add_argument("address", metavar="HOST:PORT", help="the aggregator's address")
    st.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    d = sub.add_parser("demo", help="the main job: aggregator + 4 workers on loopback, a few densities")
    bench_args(d, densities=[1.0, 0.1, 0.01], rounds=3, workers=[4])
    from .emulator.cli import add_parser as add_switch_parser
    add_switch_parser(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)    # not its font cache's notes
    try:
        if args.command == "aggregator":
            return _aggregator(args)
        if args.command == "check":
            from .check import run_check
            if not 0 <= args.rank < args.world:
                raise ValueError(f"--rank must be 0..{args.world - 1}, got {args.rank}")
            return run_check(args)
        if args.command == "switch":
            return args.handler(args)
        if args.command == "stats":
            return _stats(args)
        from .bench import run_from_args
        return run_from_args(args)
    except (ValueError, OSError) as e:
        print(f"zerosum {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _stats(args) -> int:
    """One STATS request to a running aggregator; print its JSON answer."""
    import json
    from .aggregator import request_stats
    print(json.dumps(request_stats(args.address, args.timeout), indent=1))
    return 0


def _keys(path: str):
    """--key-file: one secret for every job, or a JSON object {"JOB": "secret", ...} of per-job secrets."""
    import json
    with open(path, "rb") as f:
        raw = f.read().strip()
    if not raw:
        raise ValueError(f"--key-file {path} is empty")
    if raw.startswith(b"{"):
        try:
            keys = {int(job): str(secret).encode() for job, secret in json.loads(raw).items()}
        except (ValueError, AttributeError):
            raise ValueError(f'--key-file {path}: expected a secret, or JSON like {{"1": "secret"}}') from None
        if not keys or not all(keys.values()):
            raise ValueError(f"--key-file {path}: every job needs a non-empty secret")
        return keys
    return raw


def _declared_jobs(args) -> dict[int, int]:
    """--workers/--job and --jobs FILE as {job: world size}."""
    import json
    declared = {args.job: args.workers} if args.workers else {}
    if args.jobs:
        with open(args.jobs) as f:
            try:
                text = json.load(f)
                items = {int(job): int(world) for job, world in text.items()}
            except (ValueError, AttributeError, TypeError):
                raise ValueError(f"--jobs {args.jobs}: expected a JSON object of job ids to worker counts, "
                                 f'like {{"1": 4, "7": 2}}') from None
        declared.update(items)
    for job, world in declared.items():
        if not 0 <= job <= 0xFFFF or not 1 <= world <= P.MAX_WORLD:
            raise ValueError(f"job {job} with {world} workers: job ids are 0..65535, worker counts "
                             f"1..{P.MAX_WORLD}")
    return declared


def _aggregator(args) -> int:
    from .aggregator import AggregatorServer
    if not 0 <= args.job <= 0xFFFF:
        raise ValueError(f"--job must be 0..65535, got {args.job}")
    if args.workers is not None and args.workers > P.MAX_WORLD:
        raise ValueError(f"--workers must be at most {P.MAX_WORLD}, got {args.workers}")
    if args.min_job_slots > min(args.max_job_slots, args.slots):
        raise ValueError(f"--min-job-slots {args.min_job_slots} exceeds what one job may get "
                         f"({min(args.max_job_slots, args.slots)})")
    declared = _declared_jobs(args)
    key = _keys(args.key_file) if args.key_file else None
    server = AggregatorServer(args.workers, args.listen, args.job, args.slots, args.loss, args.seed,
                              max_jobs=args.max_jobs, min_job_slots=args.min_job_slots,
                              max_job_slots=args.max_job_slots, job_idle=args.job_idle,
                              join_timeout=args.join_timeout, key=key, insecure=args.insecure,
                              declared=declared, max_datagram=args.max_datagram, multicast=args.multicast)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    host, port = server.address
    snapshots = None
    if args.announce:
        from .local import ANNOUNCE, SnapshotOnSignal
        snapshots = SnapshotOnSignal(server)
        print(ANNOUNCE, f"{host}:{port}", flush=True)
    logging.getLogger("zerosum.aggregator").info(
        "serving up to %d jobs on %s:%d from %d slots (at most %d per job)%s", args.max_jobs, host, port,
        server.service.slots, server.service.max_job_slots,
        f"; job {args.job} declared with {args.workers} workers" if args.workers else "")
    try:
        def stop() -> bool:
            if snapshots is not None:
                snapshots.answer()      # between batches: no job half-ended (SnapshotOnSignal)
            return bool(stopping)
        server.serve(stop=stop, stats_interval=args.stats, idle_exit=args.idle_exit)
    except KeyboardInterrupt:
        pass
    finally:
        logging.getLogger("zerosum.aggregator").info("counters: %s", server.counters_line())
        if args.announce:
            import json
            from .local import peak_rss
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)   # no snapshot line in the middle of this one
            print(json.dumps({**server.machine.counters, "max_rss_bytes": peak_rss()}), flush=True)
        server.close()
    return 0
