"""`zerosum switch`: run the emulated P4 switch.

    zerosum switch --udp 127.0.0.1:48879 --grpc 127.0.0.1:9559      # mode (a): a UDP aggregator
    zerosum switch -i 1@veth1 -i 2@veth2 --grpc 127.0.0.1:9559       # mode (b): on interfaces

The control plane configures it over P4Runtime (`--grpc`, then zerosum.switch_p4.control.SwitchControl),
or `--config FILE.json` has the control plane install a configuration at start (the format of
zerosum.switch_p4.control.apply_plan), through the same P4Runtime endpoint. In UDP mode,
`--members IP:PORT ...` (with --job, --slots) does that for one job of workers at those source addresses,
which bind those ports (Worker(..., block_size=64, max_entries=1, bind="IP:PORT")):

    zerosum switch --udp 10.1.0.2:48879 --members 10.1.0.10:48880 10.1.0.11:48880

Also runnable as `python -m zerosum.emulator.cli switch ...`.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from ..argtypes import positive_int, rate as _rate

ANNOUNCE = "zerosum-switch-ready"


def _address(text):
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _port_at_interface(text):
    port, sep, ifname = text.partition("@")
    if not sep or not port.isdigit() or not ifname:
        raise argparse.ArgumentTypeError(f"expected PORT@INTERFACE such as 1@veth1, got {text!r}")
    if not 0 <= int(port) <= 510:
        raise argparse.ArgumentTypeError(f"switch ports are 0..510, got {port}")
    return int(port), ifname


def _seconds(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def configure_arguments(s: argparse.ArgumentParser) -> argparse.ArgumentParser:
    mode = s.add_mutually_exclusive_group(required=True)
    mode.add_argument("--udp", type=_address, metavar="HOST:PORT",
                      help="mode (a): be a UDP aggregator on this address (workers send to it)")
    mode.add_argument("-i", "--interface", type=_port_at_interface, action="append", metavar="PORT@IFNAME",
                      dest="interfaces", help="mode (b): switch port PORT is interface IFNAME (repeat per port)")
    s.add_argument("--grpc", type=_address, metavar="HOST:PORT",
                   help="serve P4Runtime here for the control plane (e.g. 127.0.0.1:9559)")
    s.add_argument("--config", metavar="FILE.json",
                   help="configure the switch at start through its P4Runtime endpoint (apply_plan's format)")
    s.add_argument("--members", type=_address, nargs="+", metavar="IP:PORT",
                   help="UDP mode: serve one job of workers sending from these addresses, in rank order")
    s.add_argument("--job", type=int, default=1, help="the job id of --members (default 1)")
    s.add_argument("--slots", type=positive_int, default=256, help="aggregation slots of the --members job")
    s.add_argument("--duration", type=_seconds, metavar="SECONDS", help="stop after this long")
    s.add_argument("--idle-exit", type=_seconds, metavar="SECONDS",
                   help="stop once no frame has arrived for this long (after the first one)")
    s.add_argument("--loss", type=_rate, default=0.0,
                   help="drop this fraction of incoming frames (simulated link loss), e.g. 0.02 or 2%%")
    s.add_argument("--seed", type=int, default=None, help="seed of the simulated loss")
    s.add_argument("--announce", action="store_true",
                   help=f"print '{ANNOUNCE} ...' when ready and the counters as JSON at exit (for scripts)")
    s.set_defaults(handler=run)
    return s


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `switch` subcommand to the `zerosum` parser; its handler is args.handler(args) -> exit code."""
    s = subparsers.add_parser("switch", help="run the emulated P4 switch (UDP mode or on interfaces)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return configure_arguments(s)


# -- configuration at start ------------------------------------------------------------------------------
def read_plan(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the switch configuration {path}: {e}") from None


def members_plan(args) -> dict:
    """`--members`: one job whose workers send from these addresses to the UDP front end's address."""
    from ..switch_p4.star import plan
    if not args.udp:
        raise ValueError("--members needs --udp (on interfaces, configure L2 and jobs with --config)")
    if len(set(args.members)) != len(args.members):
        raise ValueError("a member address is given twice")
    return plan(len(args.members), slots=args.slots, job=args.job, service_ip=args.udp[0],
                addresses=args.members, l2=False)


def configure(grpc_address: str, plan: dict) -> None:
    """The control plane (SwitchControl, apply_plan) installs a configuration through this switch's own
    P4Runtime endpoint, exactly as it would configure bmv2."""
    from ..switch_p4.control import SwitchControl, apply_plan
    with SwitchControl(grpc_address) as ctl:
        apply_plan(ctl, plan)


# -- running -----------------------------------------------------------------------------------------------
def run(args) -> int:
    """Handler of `zerosum switch`: returns the exit code."""
    from .pipeline import Switch
    log = logging.getLogger("zerosum.switch")
    sw = Switch()
    server = None
    grpc_address = f"{args.grpc[0]}:{args.grpc[1]}" if args.grpc else None
    if args.config and args.members:
        raise ValueError("give either --config or --members")
    plan = read_plan(args.config) if args.config else members_plan(args) if args.members else None
    if args.grpc or plan:
        try:
            from .p4runtime_server import serve_p4runtime
            from ..udp import free_port
        except ImportError as e:
            print(f"zerosum switch: error: the P4Runtime server is not available ({e}); "
                  "install the switch extra: pip install 'zerosum[switch]'", file=sys.stderr)
            return 1
        if grpc_address is None:   # a configuration alone: a private endpoint for the control plane
            grpc_address = f"127.0.0.1:{free_port()}"
        server = serve_p4runtime(sw, grpc_address)
    if plan:
        try:
            configure(grpc_address, plan)
        except BaseException:
            server.stop(0)
            raise

    stopping = []
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        if args.udp:
            from .udp_frontend import UdpFrontend
            engine = UdpFrontend(sw, args.udp, loss=args.loss, seed=args.seed)
            where = "%s:%d" % engine.address[:2]
        else:
            from .ports import Ports
            ports = dict(args.interfaces)
            if len(ports) != len(args.interfaces):
                raise ValueError("a switch port is given twice")
            engine = Ports(ports, sw, loss=args.loss, seed=args.seed)
            where = " ".join(f"{p}@{i}" for p, i in sorted(ports.items()))
        log.info("emulated switch on %s%s%s", where,
                 f", P4Runtime on {args.grpc[0]}:{args.grpc[1]}" if args.grpc else "",
                 f", ingress loss {args.loss:.2%}" if args.loss else "")
        if args.announce:
            print(ANNOUNCE, where, flush=True)
        start = time.monotonic()
        try:
            engine.serve(duration=args.duration, idle_exit=args.idle_exit, stop=lambda: bool(stopping))
        except KeyboardInterrupt:
            pass
        finally:
            counters = {"seconds": round(time.monotonic() - start, 3)}
            if args.udp:
                counters.update(frames_in=engine.frames_in, frames_out=engine.frames_out,
                                send_errors=engine.send_errors, lost=engine.loss.dropped)
            else:
                counters.update(engine.counters())
            counters["switch"] = sw.stats
            log.info("counters: %s", counters)
            if args.announce:
                print(json.dumps(counters), flush=True)
            engine.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if server is not None:
            server.stop(0)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerosum.emulator.cli")
    add_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.handler(args)
    except (ValueError, OSError) as e:
        print(f"zerosum switch: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
