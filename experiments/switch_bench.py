"""How fast is the emulated switch? Two measurements, one table each.

1. Packet rate on veth ports: W veth pairs; the switch (the emulator in ports mode, and bmv2's
   simple_switch_grpc with the same program when it is on PATH) owns one end of each, this script injects
   pre-built ZeroSum frames (JOIN, a BOOT round, then R rounds of DATA over S slots, from W workers) on the
   other ends with AF_PACKET sockets and counts the RESULT frames coming back. Injection is paced by a
   window of frames in flight, so nothing is lost in queues and the rate is the switch's own.
2. Allreduce time for the same tensor through the switch in UDP mode (`zerosum switch --udp`) and
   through the software aggregator (`zerosum aggregator`), W worker processes on loopback running
   experiments/switch_worker.py (which checks every sum), with the switch's settings (64-value blocks,
   one entry per datagram) and, for the software aggregator, also with its own defaults (256-value
   blocks, full 64 KiB datagrams).

    sudo python3 experiments/switch_bench.py                     # defaults: < 2 min on 2 cores
    sudo python3 experiments/switch_bench.py --workers 4 --rounds 80 --size 1048576 --json out.json

Part 1 needs root (veth pairs, raw sockets); without root only part 2 runs.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "switch_worker.py"
from zerosum.spec import DEFAULT_PORT as ZEROSUM_PORT
from zerosum.switch_p4.layout import ELEMENTS
from zerosum import protocol as P
from zerosum.switch_p4.star import SERVICE_IP, WORKER_PORT, host_ip, plan
from zerosum.protocol import BOOT, DATA, END, JOIN, JOIN_ACK, NO_EXP, RESULT
from zerosum.udp import free_port
ETH_P_ALL, SOL_PACKET, PACKET_IGNORE_OUTGOING = 3, 263, 23


def sh(*cmd, check=True):
    return subprocess.run([str(c) for c in cmd], check=check, capture_output=True, text=True)


# -- part 1: packet rate on veth ports --------------------------------------------------------------------
@contextmanager
def veth_pairs(n: int):
    """n veth pairs in this namespace: switch side zb<tag>s<r> (port r+1), injector side zb<tag>h<r>."""
    tag = f"{os.getpid() % 100000:05d}"
    sw = {r + 1: f"zb{tag}s{r}" for r in range(n)}
    host = [f"zb{tag}h{r}" for r in range(n)]
    try:
        for r in range(n):
            sh("ip", "link", "add", sw[r + 1], "type", "veth", "peer", "name", host[r])
            for ifname in (sw[r + 1], host[r]):
                sh("sysctl", "-qw", f"net.ipv6.conf.{ifname}.disable_ipv6=1", check=False)
                if shutil.which("ethtool"):
                    sh("ethtool", "-K", ifname, "tx", "off", "rx", "off", "gro", "off", "gso", "off", "tso", "off",
                       check=False)
                sh("ip", "link", "set", ifname, "up")
        yield sw, host
    finally:
        for ifname in sw.values():
            sh("ip", "link", "del", ifname, check=False)


def frame(payload: bytes, rank: int) -> bytes:
    from zerosum.emulator.udp_frontend import frame_for
    return frame_for(payload, (host_ip(rank), WORKER_PORT + rank), (SERVICE_IP, ZEROSUM_PORT), dst_mac=0xFE)


def _entry(slot, flags, block, nxt, exp, next_exp):
    ent = P.entries_array(1)
    ent[0] = (slot, flags, block, nxt, exp, next_exp)
    return ent


def build_frames(world: int, slots: int, rounds: int, epoch: int = 1):
    """JOIN frames and [round][frame] of (rank, frame): a BOOT round, then `rounds` DATA rounds in which
    every worker has every block non-zero (block b of column s = s + k*slots)."""
    import numpy as np
    tblocks = slots * rounds
    joins = [(r, frame(P.encode(P.Header(JOIN, 1, r, world, 1000 + r, 0, ELEMENTS, 0)), r)) for r in range(world)]
    values = [np.arange(ELEMENTS).reshape(1, -1), np.full((1, ELEMENTS), 3)]
    out = []
    boot = []
    for s in range(slots):
        for r in range(world):
            boot.append((r, frame(P.encode(P.Header(DATA, 1, r, world, epoch, tblocks, ELEMENTS),
                                           _entry(s, 0, BOOT, s, NO_EXP, 0)), r)))
    out.append(boot)
    for k in range(rounds):
        rnd = []
        for s in range(slots):
            b = s + k * slots
            nxt = b + slots if b + slots < tblocks else END
            for r in range(world):
                rnd.append((r, frame(P.encode(P.Header(DATA, 1, r, world, epoch, tblocks, ELEMENTS),
                                              _entry(s, P.HAS_DATA, b, nxt, 0, 0 if nxt != END else NO_EXP),
                                              values[r % 2]), r)))
        out.append(rnd)
    return joins, out


def start_switch(kind: str, ports: dict[int, str], config: dict, loss: float = 0.0):
    """(process, control or None, cleanup) of a switch on `ports`, configured with `config`."""
    if kind == "emulator":
        f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(config, f)
        f.close()
        cmd = [sys.executable, "-m", "zerosum.emulator.cli", "switch", "--config", f.name, "--announce"]
        for p, ifname in ports.items():
            cmd += ["-i", f"{p}@{ifname}"]
        if loss:
            cmd += ["--loss", str(loss)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        os.unlink(f.name)
        if not line.startswith("zerosum-switch-ready"):
            proc.kill()
            raise RuntimeError(f"emulated switch did not start: {proc.communicate()[1][-2000:]}")
        return proc, None
    grpc_port = free_port()
    cmd = ["simple_switch_grpc", "--device-id", "0", "--no-p4", "--thrift-port", str(free_port())]
    for p, ifname in ports.items():
        cmd += ["-i", f"{p}@{ifname}"]
    cmd += ["--", "--grpc-server-addr", f"127.0.0.1:{grpc_port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", grpc_port)) == 0:
                break
        time.sleep(0.2)
    from mininet_star import configure
    return proc, configure(f"127.0.0.1:{grpc_port}", config)


def stop_switch(proc, ctl) -> dict:
    if ctl is not None:
        ctl.close()
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    lines = [line for line in (out or "").splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def packet_rate(kind: str, world: int, slots: int, rounds: int, inflight: int) -> dict:
    joins, rnds = build_frames(world, slots, rounds)
    total_in = len(joins) + sum(len(r) for r in rnds)
    expect = slots * (rounds + 1)                       # RESULT frames per worker port
    with veth_pairs(world) as (sw_ports, host_ifs):
        proc, ctl = start_switch(kind, sw_ports, plan(world, slots))
        socks = []
        try:
            # rank 0's side receives (results are multicast to every port); the others only send
            rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)   # receives once bound below
            rx.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)          # SO_RCVBUFFORCE
            try:
                rx.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
            except OSError:
                pass
            rx.bind((host_ifs[0], ETH_P_ALL))
            socks.append(rx)
            tx = [rx] + [socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0) for _ in host_ifs[1:]]
            for i, s in enumerate(tx[1:], 1):
                s.bind((host_ifs[i], 0))
                socks.append(s)
            buf = bytearray(2048)
            counts = {"results": 0, "acks": 0, "other": 0}

            def drain(timeout: float) -> None:
                r, _, _ = select.select([rx], [], [], timeout)
                while r:
                    try:
                        n, addr = rx.recvfrom_into(buf, len(buf), socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        return
                    if addr[2] == 4:   # PACKET_OUTGOING: our own injection
                        continue
                    if n >= 62 and buf[23] == 17 and buf[34:36] == b"\xbe\xef":
                        t = buf[43]
                        if t == RESULT:
                            counts["results"] += 1
                        elif t == JOIN_ACK:
                            counts["acks"] += 1
                        else:
                            counts["other"] += 1
                    else:
                        counts["other"] += 1

            for r, f in joins:
                tx[r].send(f)
            deadline = time.monotonic() + 10
            while counts["acks"] < 1 and time.monotonic() < deadline:
                drain(0.1)
            time.sleep(0.2)   # the other JOIN_ACKs go to the other ports; give the switch time for them
            frames = [x for rnd in rnds for x in rnd]
            sent = 0
            stalled = False
            t0 = time.perf_counter()
            last_progress = time.monotonic()
            while counts["results"] < expect:
                # frames in flight: sent minus those already answered (world frames per result)
                while sent < len(frames) and sent - counts["results"] * world < inflight:
                    r, f = frames[sent]
                    tx[r].send(f)
                    sent += 1
                before = counts["results"]
                drain(0.05)
                if counts["results"] != before:
                    last_progress = time.monotonic()
                elif time.monotonic() - last_progress > 3:
                    stalled = True
                    break
            elapsed = time.perf_counter() - t0
        finally:
            for s in socks:
                s.close()
            final = stop_switch(proc, ctl)
    results = counts["results"]
    frames_in = sent
    return {"switch": kind, "workers": world, "slots": slots, "rounds": rounds, "frames_in": frames_in,
            "results_per_port": results, "expected_results": expect, "stalled": stalled, "seconds": elapsed,
            "pps_in": frames_in / elapsed, "pps_out": results * world / elapsed,
            "ingress_mbit_s": sum(len(f) for _, f in frames[:frames_in]) * 8 / elapsed / 1e6,
            "aggregated_bytes_s": max(0, results - slots) * world * ELEMENTS * 4 / elapsed,
            "total_frames": total_in, "switch_counters": final.get("switch", {}),
            "send_errors": final.get("send_errors")}


# -- part 2: allreduce through the switch (UDP mode) and through the software aggregator --------------------
def run_workers(address: str, world: int, size: int, density: float, repeat: int, block_size=64,
                max_entries=1, ports=None) -> dict:
    ports = ports or [free_port(socket.SOCK_DGRAM) for _ in range(world)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--world", str(world),
                               "--bind", f"127.0.0.1:{ports[r]}", "--switch", address, "--size", str(size),
                               "--density", str(density), "--repeat", str(repeat), "--timeout", "30",
                               "--block-size", str(block_size), "--max-entries", str(max_entries)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        results.append(json.loads(lines[-1]) if lines else {"ok": False, "error": err[-500:]})
    ok = all(r.get("ok") for r in results)
    errors = [r["error"] for r in results if r.get("error")]
    return {"ok": ok, "median_s": max((r.get("median_s", float("nan")) for r in results), default=float("nan")),
            "datagrams_per_worker": max((r.get("datagrams_sent", 0) for r in results), default=0) / max(repeat, 1),
            "errors": errors}


def allreduce_compare(world: int, size: int, density: float, repeat: int) -> list[dict]:
    rows = []
    # the switch in UDP mode: the service address is its socket's IP with port 48879 (see udp_frontend)
    ports = [free_port(socket.SOCK_DGRAM) for _ in range(world)]
    cfg = plan(world, 256, service_ip="127.0.0.1", service_mac="00:00:00:00:00:00",
               addresses=[("127.0.0.1", p) for p in ports], l2=False)
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(cfg, f)
    f.close()
    proc = subprocess.Popen([sys.executable, "-m", "zerosum.emulator.cli", "switch", "--udp", "127.0.0.1:0",
                             "--config", f.name, "--announce"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline().split()
        if len(line) != 2:
            raise RuntimeError(f"UDP-mode switch did not start: {proc.communicate()[1][-2000:]}")
        r = run_workers(line[1], world, size, density, repeat, ports=ports)
        rows.append({"path": "emulated switch, UDP mode (64-value blocks, 1 entry/datagram)", **r})
    finally:
        stop_switch(proc, None)
        os.unlink(f.name)
    from zerosum.local import LocalAggregator
    for label, bs, me in (("software aggregator, same settings (64, 1 entry/datagram)", 64, 1),
                          ("software aggregator, its defaults (256-value blocks, 64 KiB datagrams)", 256, 0xFFFF)):
        agg = LocalAggregator(world, slots=256 if me == 1 else None)
        try:
            r = run_workers(agg.address, world, size, density, repeat, block_size=bs, max_entries=me)
        finally:
            agg.stop()
        rows.append({"path": label, **r})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--workers", type=int, default=3, help="workers (= switch ports)")
    p.add_argument("--slots", type=int, default=128, help="slots (columns) in the packet-rate run")
    p.add_argument("--rounds", type=int, default=80, help="DATA rounds per slot in the packet-rate run")
    p.add_argument("--inflight", type=int, default=256, help="frames in flight in the packet-rate run")
    p.add_argument("--switch", choices=["auto", "emulator", "bmv2"], default="auto",
                   help="auto: the emulator, and bmv2 too when simple_switch_grpc is on PATH")
    p.add_argument("--size", type=int, default=262144, help="floats per tensor in the allreduce comparison")
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--skip-rate", action="store_true", help="skip part 1")
    p.add_argument("--skip-allreduce", action="store_true", help="skip part 2")
    p.add_argument("--json", metavar="FILE", help="write all numbers here")
    args = p.parse_args(argv)
    from rich.console import Console
    from rich.table import Table
    console = Console(width=None if sys.stdout.isatty() else 140)
    report = {"rate": [], "allreduce": []}
    failed = False

    if not args.skip_rate:
        if os.geteuid() != 0:
            console.print("part 1 skipped: needs root (veth pairs and raw sockets)")
        else:
            kinds = {"auto": ["emulator"] + (["bmv2"] if shutil.which("simple_switch_grpc") else []),
                     "emulator": ["emulator"], "bmv2": ["bmv2"]}[args.switch]
            for kind in kinds:
                try:
                    report["rate"].append(packet_rate(kind, args.workers, args.slots, args.rounds, args.inflight))
                except Exception as e:   # noqa: BLE001 - one switch failing does not hide the others
                    console.print(f"[red]{kind}: {type(e).__name__}: {e}[/red]")
                    failed = True
            t = Table(title=f"Switch packet rate on veth ports: {args.workers} workers, {args.slots} slots, "
                            f"{args.rounds} DATA rounds (+1 BOOT), <= {args.inflight} frames in flight")
            for col in ("switch", "frames in", "results/port", "s", "frames in/s", "frames out/s", "ingress Mbit/s",
                        "aggregated MB/s"):
                t.add_column(col, justify="right")
            for r in report["rate"]:
                t.add_row(r["switch"], str(r["frames_in"]),
                          f"{r['results_per_port']}/{r['expected_results']}" + (" STALLED" if r["stalled"] else ""),
                          f"{r['seconds']:.2f}", f"{r['pps_in']:,.0f}", f"{r['pps_out']:,.0f}",
                          f"{r['ingress_mbit_s']:.1f}", f"{r['aggregated_bytes_s'] / 1e6:.2f}")
                failed |= r["stalled"]
            console.print(t)
            console.print("frames out/s: RESULT frames leaving all ports; aggregated MB/s: worker data summed "
                          "(W x 256 B per completed DATA round) per second")
            if len(report["rate"]) == 2:
                a, b = report["rate"]
                console.print(f"bmv2 / emulator frames in/s: {b['pps_in'] / a['pps_in']:.2f}x")

    if not args.skip_allreduce:
        report["allreduce"] = allreduce_compare(args.workers, args.size, args.density, args.repeat)
        base = report["allreduce"][0]["median_s"]
        t = Table(title=f"Allreduce of {args.size} floats, density {args.density} (64-value blocks), "
                        f"{args.workers} workers on loopback, median of {args.repeat}")
        for col in ("path", "exact", "median s", "datagrams/worker", "time vs switch"):
            t.add_column(col, justify="right")
        for r in report["allreduce"]:
            t.add_row(r["path"], "yes" if r["ok"] else "[red]NO[/red]", f"{r['median_s']:.3f}",
                      f"{r['datagrams_per_worker']:.0f}", f"{r['median_s'] / base:.2f}x")
            failed |= not r["ok"]
            for e in r["errors"]:
                console.print(f"[red]{r['path']}: {e}[/red]")
        console.print(t)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
