"""The emulated switch pipeline, packet by packet (crafted with scapy) and under the host runtime."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether

from zerosum import protocol as P, spec
from zerosum.aggregator_machine import AggregatorMachine
from zerosum.emulator.pipeline import Switch
from zerosum.reference import reference_allreduce
from zerosum.switch_p4 import layout
from zerosum.switch_p4.layout import ELEMENTS

import netsim
from switch_sim import (SwitchAggregator, ZeroSum, ZeroSumEntry, configure, frame, ip_of, values)

K = ELEMENTS


def run(sw, f, port):
    return [(p, Ether(b)) for p, b in sw.process(f, port)]


def parsed(out):
    """[(egress port, decoded ZeroSum datagram, IP packet)] of a pipeline's output."""
    return [(p, P.decode(bytes(e[UDP].payload)), e[IP]) for p, e in out]


@pytest.fixture
def sw():
    return configure(Switch(), world=2)


def join(sw, rank, nonce=7, world=2):
    return run(sw, frame(rank, ZeroSum(type=P.JOIN, rank=rank, world=world, epoch=nonce, tensor_blocks=0,
                                       entries=0)), rank + 1)


def boot(sw, rank, first, first_exp=0, epoch=1, slot=0, tensor_blocks=8):
    return run(sw, frame(rank, ZeroSum(rank=rank, epoch=epoch, tensor_blocks=tensor_blocks),
                         ZeroSumEntry(slot=slot, block=P.BOOT, next=first, next_exp=first_exp)), rank + 1)


def data(sw, rank, block, nxt, vals, exp=0, next_exp=P.NO_EXP, epoch=1, slot=0, tensor_blocks=8):
    layers = [ZeroSumEntry(slot=slot, flags=P.HAS_DATA, block=block, next=nxt, exp=exp, next_exp=next_exp)]
    if vals is not None:
        layers.append(values(vals))
    else:
        layers[0].flags = 0
        layers[0].exp = P.NO_EXP
    return run(sw, frame(rank, ZeroSum(rank=rank, epoch=epoch, tensor_blocks=tensor_blocks), *layers), rank + 1)


# -- joining ---------------------------------------------------------------------------------------------
def test_join_is_answered_with_the_bitmap_and_slots(sw):
    (port, ack, ip), = parsed(join(sw, 0))
    assert port == 1 and ip.dst == ip_of(0) and ip.src == "10.0.0.254"
    assert ack.header.type == P.JOIN_ACK and ack.header.rank == P.AGGREGATOR_RANK
    assert P.JOIN_ACK_BODY.unpack(ack.body) == (8, 0b01)
    (_, ack, _), = parsed(join(sw, 1))
    assert P.JOIN_ACK_BODY.unpack(ack.body) == (8, 0b11)
    assert sw.stats == {"joins": 2}


def test_replies_have_valid_ipv4_checksums(sw):
    (_, e), = join(sw, 0)
    raw = bytes(e)
    e[IP].chksum = None
    assert bytes(Ether(bytes(e))) == raw


@pytest.mark.parametrize("rank, world, block_size, counter", [
    (0, 3, K, "drop_join_world"), (0, 2, 32, "drop_join_block_size"), (1, 2, K, "drop_not_member")])
def test_bad_joins_are_refused_or_dropped_and_counted(sw, rank, world, block_size, counter):
    # rank 1 claimed from rank 0's address: not the member registered there (dropped); a member's JOIN
    # with another world or block size is refused with the job's (R-J6, reason 3)
    f = frame(0, ZeroSum(type=P.JOIN, rank=rank, world=world, block_size=block_size, entries=0))
    out = sw.process(f, 1)
    assert sw.stats == {counter: 1}
    if counter == "drop_not_member":
        assert out == []
        return
    (port, reply), = out
    assert port == 1 and Ether(reply)[IP].dst == ip_of(0)
    payload = bytes(Ether(reply)[UDP].payload)
    h = P.parse_header(payload)
    assert (h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]) == (P.REFUSED, 1, P.AGGREGATOR_RANK, 2, 0, 0, K, 0)
    assert P.REFUSED_BODY.unpack_from(payload, P.PACKET_HEADER_SIZE) == (spec.REFUSED_CONFLICT, 0, 0, 0)


# -- a round --------------------------------------------------------------------------------------------
def test_a_round_sums_and_multicasts_to_every_worker(sw):
    join(sw, 0), join(sw, 1)
    assert boot(sw, 0, first=3) == [] and boot(sw, 1, first=3) != []
    a = np.arange(K, dtype=np.int64) - 20
    b = np.full(K, 2**31 - 1, np.int64)           # int32 wrap-around, as bit<32> addition
    assert data(sw, 0, 3, P.END, a) == []
    out = parsed(data(sw, 1, 3, 5, b, next_exp=4))
    assert sorted(p for p, _, _ in out) == [1, 2]
    for port, d, ip in out:
        assert ip.dst == ip_of(port - 1) and ip.src == "10.0.0.254"
        assert d.header.type == P.RESULT
        assert (d.block[0], d.next[0], d.exp[0], d.next_exp[0]) == (3, 5, 0, 4)
        np.testing.assert_array_equal(d.data[0], (a + b).astype(np.int32))
    assert sw.stats == {"joins": 2, "datagrams": 4, "rounds": 2}


def test_bootstrap_result_carries_min_next_and_max_exponent_of_equal_minima(sw):
    boot(sw, 0, first=4, first_exp=3)
    (_, d, _), _ = parsed(boot(sw, 1, first=4, first_exp=9))
    assert (d.block[0], d.next[0], d.next_exp[0], d.has[0]) == (P.BOOT, 4, 9, False)
    assert len(d.data) == 0


def test_header_only_worker_completes_a_round_with_the_others_data(sw):
    boot(sw, 0, first=2), boot(sw, 1, first=5)
    v = np.arange(K)
    assert data(sw, 0, 2, P.END, v) == []
    out = parsed(data(sw, 1, 2, 5, None))      # rank 1 has nothing in block 2: header only
    assert len(out) == 2
    for _, d, _ in out:
        assert d.has[0] and d.next[0] == 5
        np.testing.assert_array_equal(d.data[0], v)


def test_duplicate_gets_status_with_the_ranks_heard(sw):
    boot(sw, 0, first=1), boot(sw, 1, first=1)
    data(sw, 0, 1, P.END, np.ones(K))
    (port, d, ip), = parsed(data(sw, 0, 1, P.END, np.ones(K)))
    assert port == 1 and d.header.type == P.STATUS and d.next[0] == 0b01 and d.block[0] == 1
    out = parsed(data(sw, 1, 1, P.END, np.ones(K)))
    assert all((d.data[0] == 2).all() for _, d, _ in out), "the duplicate was added twice"
    assert sw.stats["duplicates"] == 1


def test_retransmission_after_completion_is_answered_from_the_shadow_copy(sw):
    boot(sw, 0, first=1), boot(sw, 1, first=1)
    data(sw, 0, 1, 6, np.full(K, 5), next_exp=2)
    first = parsed(data(sw, 1, 1, P.END, np.full(K, 7)))
    # rank 0 lost the result and sends its contribution again: only rank 0 gets the shadow result
    (port, d, ip), = parsed(data(sw, 0, 1, 6, np.full(K, 5), next_exp=2))
    assert port == 1 and ip.dst == ip_of(0)
    assert (d.header.type, d.block[0], d.next[0], d.next_exp[0]) == (P.RESULT, 1, 6, 2)
    np.testing.assert_array_equal(d.data[0], first[0][1].data[0])
    # the next round writes the other bank: the shadow copy survives it
    data(sw, 0, 6, P.END, np.full(K, 1), exp=2)
    (_, d, _), = parsed(data(sw, 0, 1, 6, np.full(K, 5), next_exp=2))
    np.testing.assert_array_equal(d.data[0], np.full(K, 12))
    assert sw.stats["retransmissions_answered"] == 2


def test_stale_and_mismatched_contributions_are_dropped(sw):
    boot(sw, 0, first=1, first_exp=5), boot(sw, 1, first=1, first_exp=5)
    assert data(sw, 0, 1, P.END, np.ones(K), exp=4) == []           # exponent disagrees with the slot
    assert data(sw, 0, 1, P.END, np.ones(K), exp=5, tensor_blocks=9) == []   # other tensor size
    assert data(sw, 0, 2, P.END, np.ones(K), exp=5) == []           # neither current nor previous round
    assert data(sw, 0, 1, P.END, np.ones(K), exp=5, epoch=9) == []  # another epoch
    assert sw.stats["drop_mismatch"] == 2 and sw.stats["drop_stale"] == 2


@pytest.mark.parametrize("mutate, counter", [
    (lambda z, e, d: (z.__setattr__("version", 2), d), "drop_version"),
    (lambda z, e, d: (z.__setattr__("type", 9), d), "drop_type"),
    (lambda z, e, d: (z.__setattr__("type", P.RESULT), d), "drop_type"),
    (lambda z, e, d: (e.__setattr__("flags", 3), d), "drop_flags"),
    (lambda z, e, d: (z.__setattr__("entries", 2), d), "drop_length"),
    (lambda z, e, d: (None, d[:-4]), "drop_length"),             # a block one value short
    (lambda z, e, d: (e.__setattr__("slot", 8), d), "drop_range"),  # the job has slots 0..7
    (lambda z, e, d: (e.__setattr__("block", 8), d), "drop_range"),  # beyond the tensor
    (lambda z, e, d: (e.__setattr__("next", 3), d), "drop_range"),   # next must be after block
    (lambda z, e, d: (e.__setattr__("exp", P.NO_EXP), d), "drop_exponent"),
    (lambda z, e, d: (z.__setattr__("job", 2), d), "drop_foreign_job"),
    (lambda z, e, d: (z.__setattr__("world", 3), d), "drop_geometry"),
])
def test_malformed_packets_are_dropped_and_counted(sw, mutate, counter):
    z, e = ZeroSum(rank=0), ZeroSumEntry(slot=0, flags=P.HAS_DATA, block=3, next=P.END, exp=0)
    _, d = mutate(z, e, np.ones(K, ">i4").tobytes())
    assert sw.process(frame(0, z, e, d), 1) == []
    assert sw.stats == {counter: 1}
    # counted for the job only from R-V7 on (the job known): geometry and the slot (R-V10)
    per_job = counter == "drop_geometry" or (counter == "drop_range" and e.slot >= 8)
    assert sw.job_stats(0) == ({counter: 1} if per_job else {})


def test_short_and_foreign_packets(sw):
    assert sw.process(frame(0, ZeroSum(rank=0))[:50], 1) == []      # ends inside the ZeroSum header
    assert sw.process(frame(0, ZeroSum(rank=0), ZeroSumEntry())[:-4], 1) == []   # inside the entry
    assert sw.process(frame(0, ZeroSum(rank=0), ZeroSumEntry(), sport=1234), 1) == []  # unknown source
    assert sw.stats == {"drop_short": 1, "drop_length": 1, "drop_not_member": 1}


def test_other_traffic_is_switched_not_aggregated(sw):
    arp = bytes(Ether(src="00:00:00:00:00:01", dst="ff:ff:ff:ff:ff:ff") / ARP(pdst="10.0.0.2"))
    assert sorted(p for p, _ in sw.process(arp, 1)) == [2]            # flooded, not back to port 1
    ping = bytes(Ether(src="00:00:00:00:00:01", dst="00:00:00:00:00:02") / IP(src=ip_of(0), dst=ip_of(1)))
    (port, out), = sw.process(ping, 1)
    assert port == 2 and out == ping
    to_peer = bytes(Ether(dst="00:00:00:00:00:02") / IP(dst=ip_of(1)) / UDP(dport=P.DEFAULT_PORT) / ZeroSum())
    assert [p for p, _ in sw.process(to_peer, 1)] == [2]            # ZeroSum to another host: forwarded
    assert sw.stats == {}


def test_forwarded_frames_keep_their_checksum_and_vlan_frames_are_not_aggregated(sw):
    """Only headers the pipeline rewrites get a new IPv4 checksum (docs/protocol.md, "On a switch")."""
    from scapy.layers.inet import IPOption_Router_Alert
    from scapy.layers.l2 import Dot1Q
    with_options = Ether(dst="00:00:00:00:00:02") / IP(src=ip_of(0), dst=ip_of(1), options=[IPOption_Router_Alert()]) \
        / UDP(sport=5, dport=6) / b"payload"
    bad_checksum = Ether(dst="00:00:00:00:00:02") / IP(src=ip_of(0), dst=ip_of(1), chksum=0x1234) / UDP() / b"x"
    for f in (bytes(with_options), bytes(bad_checksum)):
        assert sw.process(f, 1) == [(2, f)]                         # bit for bit, checksum included
    tagged = bytes(Ether(src="00:00:00:00:00:01", dst="00:00:00:00:00:fe") / Dot1Q(vlan=5)) + \
        frame(0, ZeroSum(type=P.JOIN, rank=0, entries=0, tensor_blocks=0))[14:]
    assert sorted(p for p, _ in sw.process(tagged, 1)) == [2]        # unknown MAC: flooded as L2
    assert sw.stats == {}
    (_, reply), = sw.process(frame(0, ZeroSum(type=P.JOIN, rank=0, entries=0, tensor_blocks=0)), 1)
    ip = Ether(reply)[IP]
    sent, ip.chksum = ip.chksum, None
    assert IP(bytes(ip)).chksum == sent and sw.stats == {"joins": 1}    # a reply's is recomputed


def test_a_round_echoes_ce_in_its_result_and_answers_are_sent_ect0(sw):
    """R-E1: a contribution marked CE flags the round's RESULT to every worker; the switch sends its
    answers ECT(0) (the mark travels in the flag, not in the answer's own ECN bits)."""
    for r in range(2):
        boot(sw, r, 1)
    run(sw, frame(0, ZeroSum(rank=0), ZeroSumEntry(slot=0, block=1, next=P.END), tos=spec.CE), 1)
    out = parsed(run(sw, frame(1, ZeroSum(rank=1), ZeroSumEntry(slot=0, block=1, next=P.END), tos=spec.ECT0), 2))
    assert sorted(p for p, _, _ in out) == [1, 2]
    for _, result, ip in out:
        assert result.header.type == P.RESULT and result.flags[0] == P.CONGESTION and ip.tos == spec.ECT0


@pytest.mark.parametrize("tos,marked", [(spec.ECT0, True), (0b01, True), (spec.NOT_ECT, False), (spec.CE, False)])
def test_the_egress_marks_ecn_capable_packets_ce_over_its_threshold(sw, tos, marked):
    """RFC 3168: a queue at or over the threshold marks CE on ECT(0) and ECT(1), never on Not-ECT; a
    forwarded frame's checksum is updated incrementally, so a header with options stays valid."""
    from scapy.layers.inet import IPOption_Router_Alert
    f = bytes(Ether(dst="00:00:00:00:00:02") / IP(src=ip_of(0), dst=ip_of(1), tos=tos,
                                                 options=[IPOption_Router_Alert()]) / UDP(sport=5, dport=6) / b"x")
    sw.queued[2] = layout.ECN_THRESHOLD - 1
    assert sw.process(f, 1) == [(2, f)]                             # under the threshold: as it came
    sw.queued[2] = layout.ECN_THRESHOLD
    (port, out), = sw.process(f, 1)
    ip = Ether(out)[IP]
    assert port == 2 and ip.tos == (spec.CE if marked else tos)
    sent, ip.chksum = ip.chksum, None
    assert IP(bytes(ip)).chksum == sent                             # the checksum (over the options) is right
    # an answer is marked on its way out too: a JOIN_ACK that leaves a congested port 1
    sw.queued = {1: layout.ECN_THRESHOLD}
    (_, ack, ip), = parsed(join(sw, 0))
    assert ack.header.type == P.JOIN_ACK and ip.tos == spec.CE


def test_a_job_not_configured_is_refused_and_counted_per_job(sw):
    (port, refused, _), = parsed(run(sw, frame(0, ZeroSum(type=P.JOIN, job=5, rank=0, entries=0, tensor_blocks=0)), 1))
    assert port == 1 and refused.header.type == P.REFUSED and refused.header.job == 5
    assert P.REFUSED_BODY.unpack(refused.body) == (P.REFUSED_UNKNOWN_JOB, 1, 8, 4096)
    assert sw.stats == {"joins_refused": 1} and sw.job_stats(0) == {}
    join(sw, 0)
    assert sw.job_stats(0) == {"joins": 1} and sw.stats == {"joins_refused": 1, "joins": 1}


def test_a_new_run_of_the_job_restarts_the_slots(sw):
    join(sw, 0, nonce=1), join(sw, 1, nonce=1)
    boot(sw, 0, first=1), boot(sw, 1, first=1)
    data(sw, 0, 1, P.END, np.ones(K))            # rank 1 dies before sending: the round is left open
    join(sw, 0, nonce=2), join(sw, 1, nonce=2)   # a new run, starting again at epoch 1
    assert sw.stats["job_restarts"] == 1
    boot(sw, 0, first=1), boot(sw, 1, first=1)
    data(sw, 0, 1, P.END, np.full(K, 3))
    out = parsed(data(sw, 1, 1, P.END, np.full(K, 4)))
    assert [list(d.data[0][:2]) for _, d, _ in out] == [[7, 7], [7, 7]]


# -- the whole protocol, under loss, duplication and reordering ----------------------------------------------
@settings(max_examples=15, deadline=None)
@given(world=st.integers(1, 4), nblocks=st.integers(1, 40), density=st.floats(0.0, 1.0),
       loss=st.sampled_from([0.0, 0.05, 0.2]), dup=st.sampled_from([0.0, 0.1]),
       reorder=st.sampled_from([0.0, 0.3]), seed=st.integers(0, 2**16), ints=st.booleans())
def test_emulator_gives_the_software_aggregators_sums(world, nblocks, density, loss, dup, reorder, seed, ints):
    rng = np.random.default_rng(seed)
    n = nblocks * K - int(rng.integers(0, K))
    arrays = []
    for _ in range(world):
        keep = np.repeat(rng.random(nblocks) < density, K)[:n]
        x = (rng.integers(-1000, 1000, n).astype(np.int32) if ints
             else (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3)).astype(np.float32))
        arrays.append(np.where(keep, x, 0).astype(x.dtype))
    kw = dict(block_size=K, loss=loss, dup=dup, reorder=reorder, seed=seed, max_entries=1)
    via_switch, _ = netsim.run(arrays, [SwitchAggregator(world, slots=6)], **kw)
    via_software, _ = netsim.run(arrays, [AggregatorMachine(1, world, slots=6)], **kw)
    expect = reference_allreduce(arrays, block_size=K)
    for a, b in zip(via_switch, via_software):
        np.testing.assert_array_equal(a, expect)
        np.testing.assert_array_equal(b, expect)


# -- through sockets: the UDP front end -------------------------------------------------------------------
def _udp_switch(world, base_port):
    """The emulator in UDP mode on loopback, configured for workers at 127.0.0.1:base_port+rank."""
    import threading
    from zerosum.emulator.udp_frontend import UdpFrontend
    sw = configure(Switch(), world, slots=16, service_ip="127.0.0.1",
                   addresses=[("127.0.0.1", base_port + r) for r in range(world)])
    fe = UdpFrontend(sw, ("127.0.0.1", 0))
    stop = threading.Event()
    thread = threading.Thread(target=fe.serve, kwargs=dict(stop=stop.is_set), daemon=True)
    thread.start()
    return sw, fe, lambda: (stop.set(), thread.join(), fe.close())


def test_a_dead_worker_is_named_not_waited_for_forever():
    import socket
    import zerosum
    from zerosum.udp import free_port
    base = free_port(socket.SOCK_DGRAM)
    sw, fe, stop = _udp_switch(2, base)
    try:
        with pytest.raises(zerosum.ZeroSumTimeout, match="ranks 1 did not join"):
            with zerosum.Worker(0, 2, [f"127.0.0.1:{fe.address[1]}"], block_size=K, max_entries=1,
                                bind=f"127.0.0.1:{base}", timeout=1.0):
                pass
    finally:
        stop()
    assert sw.stats["joins"] >= 1


def test_a_worker_with_the_wrong_block_size_gets_a_clear_error():
    import socket
    import zerosum
    from zerosum.udp import free_port
    base = free_port(socket.SOCK_DGRAM)
    sw, fe, stop = _udp_switch(1, base)
    try:
        with pytest.raises(zerosum.ZeroSumRefused, match="refused the JOIN: job 1 exists there with world 1 and "
                           "block size 64, this rank has world 1 and block size 256"):
            with zerosum.Worker(0, 1, [f"127.0.0.1:{fe.address[1]}"], block_size=256,
                                bind=f"127.0.0.1:{base}", timeout=1.0):
                pass
    finally:
        stop()
    assert sw.stats["drop_join_block_size"] >= 1
