"""Test helpers for the emulated switch: scapy layers for ZeroSum, a directly configured pipeline with
hosts 10.0.0.r+1 on ports r+1, and an adapter that lets the in-memory network (netsim) drive it."""
from __future__ import annotations

import socket
import struct
from types import SimpleNamespace

from scapy.fields import ByteField, IntField, ShortField, SignedIntField, SignedShortField
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw, bind_layers

from zerosum import protocol as P
from zerosum import spec
from zerosum.emulator.pipeline import Switch
from zerosum.switch_p4.layout import (ADMISSION, EGRESS, INGRESS, JOBS, L2_FORWARD, MEMBERSHIP, WORKER_ADDRESS,
                                      ZEROSUM_SERVICE)
from zerosum.switch_p4.layout import ELEMENTS
from zerosum.switch_p4.star import SERVICE_IP as SWITCH_IP, WORKER_PORT, host_ip as ip_of, host_mac as mac_of

SWITCH_MAC = 0xFE   # star.SERVICE_MAC as the integer the tables hold


def _fields(layout: spec.Layout, **defaults) -> list:
    """scapy fields of a zerosum.spec layout (the test layers are built from the one source too)."""
    kinds = {(8, False): ByteField, (16, False): ShortField, (16, True): SignedShortField,
             (32, False): IntField, (32, True): SignedIntField}
    return [kinds[f.bits, f.signed](f.name, defaults.get(f.name, 0)) for f in layout.fields]


class ZeroSum(Packet):
    name = "ZeroSum"
    fields_desc = _fields(spec.PACKET_HEADER, version=spec.VERSION, type=P.DATA, job=1, world=2, epoch=1,
                          tensor_blocks=8, block_size=ELEMENTS, entries=1)


class ZeroSumEntry(Packet):
    name = "ZeroSumEntry"
    fields_desc = _fields(spec.ENTRY_HEADER, block=P.BOOT, next=P.END, exp=P.NO_EXP, next_exp=P.NO_EXP)


bind_layers(UDP, ZeroSum, dport=P.DEFAULT_PORT)


def frame(rank: int, zs: Packet, *entry_and_data, sport: int | None = None, tos: int = 0) -> bytes:
    """A frame from worker `rank` (10.0.0.rank+1, port WORKER_PORT+rank) to the switch's service address."""
    pkt = (Ether(src=mac_of(rank), dst="00:00:00:00:00:fe") / IP(src=ip_of(rank), dst=SWITCH_IP, tos=tos)
           / UDP(sport=WORKER_PORT + rank if sport is None else sport, dport=P.DEFAULT_PORT, chksum=0) / zs)
    for layer in entry_and_data:
        pkt = pkt / layer
    return bytes(pkt)


def values(v) -> Raw:
    import numpy as np
    return Raw(np.asarray(v, ">i4").tobytes())


def configure(sw: Switch, world: int, job: int = 1, slots: int = 8, job_index: int = 0, slot_base: int = 0,
              first_member: int = 0, group: int = 2, service_ip: str = SWITCH_IP, addresses=None) -> Switch:
    """What SwitchControl.serve_at/add_l2/add_job install for star.plan(world, slots, job, service_ip,
    addresses=...), written straight into the emulator's tables."""
    ip = lambda s: struct.unpack("!I", socket.inet_aton(s))[0]
    addresses = addresses or [(ip_of(r), WORKER_PORT + r) for r in range(world)]
    sw.tables[ZEROSUM_SERVICE].insert((ip(service_ip), P.DEFAULT_PORT), INGRESS + "serve", {"switch_mac": SWITCH_MAC})
    sw.tables[JOBS].insert((job,), ADMISSION + "set_job", dict(job_index=job_index, world=world, mcast_grp=group,
                                                               slot_base=slot_base, slots=slots))
    sw.tables[JOBS].set_default(ADMISSION + "refuse", dict(jobs_configured=job_index + 1, slots_in_use=slot_base + slots))
    replicas = []
    for r, (worker_ip, port) in enumerate(addresses):
        m = first_member + r
        sw.tables[MEMBERSHIP].insert((ip(worker_ip), port), ADMISSION + "set_member",
                                     dict(job=job, member=m, rank=r, rank_bit=1 << r))
        sw.tables[WORKER_ADDRESS].insert((m + 1,), EGRESS + "set_worker", dict(mac=r + 1, ip=ip(worker_ip), port=port))
        sw.tables[L2_FORWARD].insert((r + 1,), INGRESS + "forward", {"port": r + 1})
        replicas.append((r + 1, m + 1))
    sw.pre.write("insert", group, replicas)
    sw.pre.write("insert", 1, [(r + 1, 0) for r in range(world)])
    sw.tables[L2_FORWARD].set_default(INGRESS + "flood", {"group": 1})
    return sw


class SwitchAggregator:
    """The emulated switch behind netsim's AggregatorMachine interface (receive, datagrams_to_send, timer,
    state.job)."""

    def __init__(self, world: int, job: int = 1, slots: int = 8):
        self.switch = configure(Switch(), world, job, slots)
        self.state = SimpleNamespace(job=job)
        self._rank_of_ip = {ip_of(r): r for r in range(world)}
        self._outbox = []

    def receive(self, datagram, source, now: float, ce: bool = False) -> None:
        """`ce`: the frame arrives marked Congestion Experienced (else ECT(0), as workers send)."""
        _, rank = source
        tos = spec.CE if ce else spec.ECT0
        f = bytes(Ether(src=mac_of(rank), dst="00:00:00:00:00:fe") / IP(src=ip_of(rank), dst=SWITCH_IP, tos=tos)
                  / UDP(sport=WORKER_PORT + rank, dport=P.DEFAULT_PORT, chksum=0) / Raw(bytes(datagram)))
        for port, data in self.switch.process(f, rank + 1):
            pkt = Ether(data)
            assert port == self._rank_of_ip[pkt[IP].dst] + 1, "a reply left on the wrong port"
            self._outbox.append(([("w", self._rank_of_ip[pkt[IP].dst])], bytes(pkt[UDP].payload)))

    def datagrams_to_send(self, now: float) -> list:
        out, self._outbox = self._outbox, []    # a switch answers packet by packet: what it emitted
        return out

    def timer(self) -> float:
        return float("inf")
