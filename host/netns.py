"""Hosts in network namespaces joined by veth links through a bridge: the star that the shaped-link
experiments and `zerosum bench --mtu` run on (root and iproute2 needed; tc for shaping).

`star(hosts, mtu, rate)` builds one namespace per host with one veth link of the given MTU, shaped to
`rate` both ways by a token bucket (tc tbf) or unshaped (rate None), and removes everything again on
exit; `enter(namespace)` moves the calling process into one (setns), so that a process started by
multiprocessing runs on that host; `multicast_problem` tries a multicast group across the star.
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import re
import select
import shutil
import socket
import subprocess
import threading
import time
from contextlib import contextmanager

SUBNET = "10.77.0"
_NETWORKS = itertools.count()


def sh(*cmd, check=True):
    return subprocess.run([str(c) for c in cmd], check=check, capture_output=True, text=True)


def worker_ip(rank: int) -> str:
    return f"{SUBNET}.{rank + 1}"


def aggregator_ip(index: int) -> str:
    return f"{SUBNET}.{200 + index}"


@contextmanager
def star(hosts: dict[str, str], mtu: int, rate: str | None = None, rates: dict[str, str] | None = None):
    """A bridge and one namespace per host (name -> IP); each veth link limited to `rate` both ways
    (`rates` gives some hosts another; None: unshaped). Yields the namespaces by host name, and a
    function that counts the packets dropped so far."""
    # unique per call: a second network in the same process must not meet the first's veths, whose
    # removal with their namespaces the kernel may not have finished
    tag = f"{os.getpid() % 100000:05d}{chr(ord('a') + next(_NETWORKS) % 26)}"
    bridge, made = f"zsb{tag}", []
    namespaces = {name: f"zs{tag}{name}" for name in hosts}

    def shape(dev: str, rate: str) -> list:
        return ["tc", "qdisc", "add", "dev", dev, "root", *_tbf(rate)]

    def drops() -> tuple[int, int]:
        return shaper_drops(made, f"zs{tag}o"), socket_drops(made)

    try:
        sh("ip", "link", "add", bridge, "type", "bridge")
        sh("ip", "link", "set", bridge, "up")
        # With br_netfilter loaded, bridged frames traverse iptables' FORWARD chain, whose policy Docker
        # sets to DROP: let this bridge's own traffic through (removed again below).
        sh(*_forward_rule("-I", bridge), check=False)
        for i, (name, ip) in enumerate(hosts.items()):
            ns, outside, inside = namespaces[name], f"zs{tag}o{i}", f"zs{tag}i{i}"
            link_rate = (rates or {}).get(name, rate)
            sh("ip", "netns", "add", ns)
            made.append(ns)
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            sh("ip", "link", "set", inside, "netns", ns)
            sh("ip", "link", "set", outside, "mtu", mtu, "master", bridge, "up")
            if link_rate:
                sh(*shape(outside, link_rate))
            for cmd in (["ip", "link", "set", inside, "name", "eth0"],
                        ["ip", "link", "set", "eth0", "mtu", mtu, "up"], ["ip", "link", "set", "lo", "up"],
                        ["ip", "addr", "add", f"{ip}/24", "dev", "eth0"], *([shape("eth0", link_rate)] if link_rate else [])):
                sh("ip", "netns", "exec", ns, *cmd)
        yield namespaces, drops
    finally:
        for ns in made:
            sh("ip", "netns", "del", ns, check=False)   # takes its veth pair with it
        sh("ip", "link", "del", bridge, check=False)
        sh(*_forward_rule("-D", bridge), check=False)


def change_rate(namespace: str, rate: str) -> None:
    """Change the shaping of a host's link (both ways) to `rate`, while traffic flows (tc change)."""
    inside = sh("ip", "-n", namespace, "-o", "link", "show", "eth0").stdout
    peer = int(re.search(r"eth0@if(\d+)", inside).group(1))
    outside = next(line.split(":")[1].strip().split("@")[0] for line in sh("ip", "-o", "link").stdout.splitlines()
                   if int(line.split(":")[0]) == peer)
    sh("ip", "netns", "exec", namespace, "tc", "qdisc", "change", "dev", "eth0", "root", *_tbf(rate))
    sh("tc", "qdisc", "change", "dev", outside, "root", *_tbf(rate))


def _tbf(rate: str) -> list[str]:
    """A token bucket at `rate` with a 50 ms queue. It needs a bucket of at least one MTU-sized burst per
    timer tick; 1 ms worth of the rate is ample."""
    burst = f"{max(64 * 1024, _bits(rate) // 8 // 1000)}"
    return ["tbf", "rate", rate, "burst", burst, "latency", "50ms"]


def shaper_drops(namespaces: list[str], outside_prefix: str) -> int:
    """Packets the token buckets dropped so far (queue full), over both ends of every link."""
    texts = [sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", "eth0").stdout for ns in namespaces]
    texts += [block for block in sh("tc", "-s", "qdisc", "show").stdout.split("qdisc ")
              if f"dev {outside_prefix}" in block]
    return sum(int(m) for text in texts for m in re.findall(r"dropped (\d+)", text))


def socket_drops(namespaces: list[str]) -> int:
    """UDP datagrams the hosts' kernels dropped because a socket's receive buffer was full."""
    total = 0
    for ns in namespaces:
        lines = [line.split() for line in sh("ip", "netns", "exec", ns, "cat", "/proc/net/snmp").stdout.splitlines()
                 if line.startswith("Udp:")]
        if len(lines) == 2:
            total += int(dict(zip(*lines)).get("RcvbufErrors", 0))
    return total


def _forward_rule(action: str, bridge: str) -> list[str]:
    if shutil.which("iptables") is None:     # no iptables, no FORWARD chain to open
        return ["true"]
    return ["iptables", action, "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]


def _bits(rate: str) -> int:
    units = {"kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9, "bit": 1}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise argparse.ArgumentTypeError(f"rate {rate!r}: give it as tc does, e.g. 1gbit, 500mbit")


def rate_type(text: str) -> str:
    _bits(text)
    return text


CLONE_NEWNET = 0x40000000


def enter(namespace: str) -> None:
    """Move this process into the named network namespace (`ip netns add NAME` made it)."""
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter network namespace {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_namespace(namespace: str, make):
    """make() run on a thread of its own that entered the namespace (setns moves only the calling
    thread): what it returns, a socket included, belongs to that host."""
    out: dict = {}

    def run():
        try:
            enter(namespace)
            out["value"] = make()
        except BaseException as e:     # handed to the caller's thread
            out["error"] = e
    thread = threading.Thread(target=run, name=f"in {namespace}")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def multicast_problem(group: str, port: int, senders: dict[str, tuple[str, str]],
                      receivers: dict[str, tuple[str, str]], wait: float = 0.5) -> str | None:
    """Whether one datagram that each sending host sends to the multicast group:port reaches every
    receiving host joined to it across the star, as an aggregator's results would reach its workers
    (hosts: name -> (namespace, address)). None when all arrived, else why not."""
    from . import transport as T
    joined: dict[str, socket.socket] = {}
    try:
        for name, (ns, ip) in receivers.items():
            joined[name] = in_namespace(ns, lambda ip=ip: T.multicast_receiver((group, port), ip, 1 << 16))
        for name, (ns, ip) in senders.items():
            def send(ip=ip, name=name):
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    T.multicast_sender(s, ip)
                    s.sendto(b"zerosum multicast probe from " + name.encode(), (group, port))
            in_namespace(ns, send)
        deadline = time.monotonic() + wait
        for name, sock in joined.items():
            missing = set(senders)
            while missing:
                if not select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    return (f"a datagram that {', '.join(sorted(missing))} sent to {group}:{port} did not reach "
                            f"{name} within {wait} s")
                missing.discard(sock.recv(128).decode(errors="replace").rpartition(" from ")[2])
        return None
    except OSError as e:
        return str(e)
    finally:
        for sock in joined.values():
            sock.close()


def available() -> str:
    """Why namespaces cannot be built here ("" if they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, bridge)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return ""
