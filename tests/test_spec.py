"""One specification, three aggregators: the wire format comes from zerosum.spec everywhere, and the
software aggregator (machine and service) and the emulated switch count and answer the same packets the
same way (docs/protocol.md, "Validation" and "On a switch"). Runs without bmv2: test_switch_bmv2.py then
holds the emulator to the P4 program frame by frame where bmv2 is installed."""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from zerosum import protocol as P
from zerosum import spec
from zerosum.aggregator_machine import AggregatorMachine
from zerosum.aggregator_service import AggregatorService
from zerosum.emulator import headers as H
from zerosum.emulator.pipeline import Registers, Switch
from zerosum.switch_p4 import generate, layout
from zerosum.switch_p4.control import P4INFO

from switch_sim import SwitchAggregator, ZeroSum, ZeroSumEntry

K = layout.ELEMENTS
WORLD = 3
SLOTS = 8


# -- one source -------------------------------------------------------------------------------------------
def _p4_headers(text: str) -> dict[str, list[tuple[str, str]]]:
    out = {}
    for name, body in re.findall(r"header (\w+) \{(.*?)\}", text, re.S):
        out[name] = re.findall(r"^\s*(\S+) (\w+);", body, re.M)
    return out


def test_every_implementation_takes_the_format_from_the_spec():
    p4 = _p4_headers(generate.P4_FILE.read_text())
    for layout_, dtype, emulated, scapy_layer in (
            (spec.PACKET_HEADER, P.PACKET_HEADER, H.ZeroSum, ZeroSum),
            (spec.ENTRY_HEADER, P.ENTRY_HEADER, H.Entry, ZeroSumEntry),
            (spec.JOIN_ACK_BODY, None, H.JoinAck, None), (spec.REFUSED_BODY, None, H.Refused, None)):
        assert emulated.fields == layout_.names and emulated.size() == layout_.size
        if dtype is not None:
            assert dtype.names == layout_.names and dtype.itemsize == layout_.size
            assert [f.name for f in scapy_layer.fields_desc] == list(layout_.names)
            assert len(scapy_layer()) == layout_.size
        declared = p4[layout_.p4name]
        assert [n for _, n in declared] == list(layout_.names)
        widths = [spec.TYPEDEFS.get(t) or int(t[4:-1]) for t, _ in declared]
        assert widths == [f.bits for f in layout_.fields]
    assert P.HEADER.size == P.PACKET_HEADER_SIZE and P.REFUSED_BODY.size == spec.REFUSED_BODY.size
    text = generate.P4_FILE.read_text()
    consts = dict(re.findall(r"const counter_index_t C_(\w+) = (\d+);", text))
    assert {k.lower(): int(v) for k, v in consts.items()} == layout.COUNTER_INDEX
    for name, value in spec.TYPES.items():
        assert f"const bit<8> T_{name} = {value};" in text
    # the ECN flag and codepoints (R-E1), and the switch's marking threshold (switch_p4/layout.py)
    assert f"const bit<16> CONGESTION = {spec.CONGESTION};" in text
    for name in ("ECN_MASK", "NOT_ECT", "ECT0", "CE"):
        assert f"const bit<8> {name} = {getattr(spec, name)};" in text
    assert f"const bit<19> ECN_THRESHOLD = {layout.ECN_THRESHOLD};" in text


def test_the_compiled_codec_reads_and_writes_what_the_spec_declares():
    """zerosum.wire (the data path's readers and writers) against the struct and numpy codecs built from
    the spec: every field, at the spec's offsets, both ways."""
    from zerosum import wire
    values = dict(version=P.VERSION, type=P.RESULT, job=0xBEEF, rank=0x1234, world=31, epoch=0xDEADBEEF,
                  tensor_blocks=0x01020304, block_size=256, entries=2)
    header = P.HEADER.pack(*(values[n] for n in spec.PACKET_HEADER.names))
    b = np.frombuffer(header, np.uint8)
    getters = {8: lambda at: int(b[at]), 16: lambda at: wire.get16(b, at), 32: lambda at: wire.get32(b, at)}
    for f in spec.PACKET_HEADER.fields:
        assert getters[f.bits](spec.PACKET_HEADER.offset(f.name)) == values[f.name], f.name
    out = np.zeros(len(header), np.uint8)
    wire.put_header(out, 0, values["type"], values["job"], values["rank"], values["world"], values["epoch"],
                    values["tensor_blocks"], values["block_size"], values["entries"])
    assert out.tobytes() == header
    entry = np.zeros(1, P.ENTRY_HEADER)
    entry[0] = (0x0102, P.HAS_DATA, 0x0A0B0C0D, P.END, -1234, P.NO_EXP)
    raw = np.frombuffer(P.HEADER.pack(*(values[n] for n in spec.PACKET_HEADER.names)) + entry.tobytes(),
                        np.uint8)
    assert wire.read_entry(raw, wire.HDR) == (0x0102, True, 0x0A0B0C0D, P.END, -1234, P.NO_EXP)
    written = np.zeros(spec.ENTRY_HEADER.size, np.uint8)
    wire.put_entry(written, 0, 0x0102, P.HAS_DATA, 0x0A0B0C0D, P.END, -1234, P.NO_EXP)
    assert written.tobytes() == entry.tobytes()
    assert (wire.HDR, wire.ENT) == (spec.PACKET_HEADER.size, spec.ENTRY_HEADER.size)


def test_changing_the_spec_changes_every_implementation(monkeypatch):
    """A header change in zerosum.spec alone reaches the P4 program, the emulator's headers and the
    host's dtypes (and so makes the committed zerosum.p4 stale, which test_switch_bmv2 reports)."""
    wider = spec.Layout("entry_t", tuple(spec.Field("block", 64) if f.name == "block" else f
                                         for f in spec.ENTRY_HEADER.fields))
    monkeypatch.setattr(spec, "ENTRY_HEADER", wider)
    p4 = _p4_headers(generate.render())
    assert ("bit<64>", "block") in p4["entry_t"]
    assert generate.render() != generate.P4_FILE.read_text()
    assert H._from_spec("Entry", wider).size() == spec.ENTRY_HEADER.size == 20
    assert np.dtype(wider.numpy_descr()).itemsize == 20


def test_the_committed_p4info_names_what_the_emulator_has():
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2
    info = text_format.Parse(P4INFO.read_text(), p4info_pb2.P4Info())
    sw = Switch()
    assert {t.preamble.name for t in info.tables} == set(sw.tables)
    for t in info.tables:
        table = sw.tables[t.preamble.name]
        assert [m.name for m in t.match_fields] == [k for k, _ in table.keys]
        assert t.size == table.size
    actions = {a.preamble.name: [(p.name, p.bitwidth) for p in a.params] for a in info.actions}
    emulated = {a.name: list(a.params) for t in sw.tables.values() for a in t.actions.values()}
    assert {n: actions[n] for n in emulated} == emulated
    assert {c.preamble.name: c.size for c in info.counters} == {n: len(c.packets) for n, c in sw.counters.items()}
    registers = Registers().by_name()
    assert {r.preamble.name: (r.size, r.type_spec.bitstring.bit.bitwidth) for r in info.registers} == \
        {n: (len(a), w) for n, (a, w) in registers.items()}


# -- the same packet, the same count and the same answer ----------------------------------------------------
def addr(rank: int):
    return ("10.0.0.%d" % (rank + 1), 48880 + rank)


class Three:
    """The software machine, the service and the emulated switch, each serving job 1 with WORLD workers
    of block size K; every packet goes to all three."""

    def __init__(self):
        self.machine = AggregatorMachine(1, WORLD, slots=SLOTS)
        self.service = AggregatorService(slots=SLOTS, min_job_slots=SLOTS, max_job_slots=SLOTS)
        self.switch = SwitchAggregator(WORLD, job=1, slots=SLOTS)
        for r in range(WORLD):
            self.send(r, P.encode(P.Header(P.JOIN, 1, r, WORLD, 100 + r, 0, K, 0)))

    def counts(self):
        return (dict(self.machine.counters), dict(self.service.counters), dict(self.switch.switch.stats))

    def send(self, rank: int, payload: bytes, ce: bool = False):
        """(counters each aggregator added, replies of each: [(rank or 'all', payload)]); `ce`: the
        datagram arrives marked Congestion Experienced."""
        before = self.counts()
        replies = []
        for agg in (self.machine, self.service):
            agg.receive(payload, addr(rank), 0.0, ce)
            replies.append([(_rank(d), bytes(b)) for d, b in agg.datagrams_to_send(0.0)])
        self.switch.receive(payload, ("w", rank), 0.0, ce)
        out = self.switch.datagrams_to_send(0.0)
        by_payload = {}
        for (dest,), b in out:
            by_payload.setdefault(b, []).append(dest[1])
        replies.append([("all" if len(ranks) > 1 else ranks[0], b) for b, ranks in by_payload.items()])
        after = self.counts()
        deltas = [{k: v - b.get(k, 0) for k, v in a.items() if v != b.get(k, 0)} for a, b in zip(after, before)]
        return deltas, replies


def _rank(destinations) -> int | str:
    if len(destinations) > 1:
        return "all"
    return int(destinations[0][0].rsplit(".", 1)[1]) - 1


SOFTWARE_ONLY = {"jobs_started", "jobs_ended", "leaves", "send_errors", "drop_auth", "drop_replay"}


def agree(three: Three, rank: int, payload: bytes, ce: bool = False) -> dict:
    deltas, replies = three.send(rank, payload, ce)
    machine, service, switch = ({k: v for k, v in d.items() if k not in SOFTWARE_ONLY} for d in deltas)
    assert machine == service == switch, (payload.hex(), deltas)
    header = P.parse_header(payload)
    if header is not None and header[0] == P.JOIN:
        # JOIN_ACK: a software aggregator advertises FEATURE_LEAVE in tensor_blocks, a switch does not
        replies = [[(r, b[:12] + bytes(4) + b[16:]) for r, b in rs] for rs in replies]
    if machine.keys() & {"drop_join_world", "drop_join_block_size"}:
        # R-J6: every aggregator refuses a JOIN that conflicts with its job, naming the job's world and
        # block size (below: the switch's answer is the same, byte for byte)
        (rank_to, refused), = replies[0]
        h = P.parse_header(refused)
        assert (rank_to, h[0], h[3], h[6]) == (rank, P.REFUSED, WORLD, K)
        assert P.REFUSED_BODY.unpack_from(refused, P.PACKET_HEADER_SIZE) == (spec.REFUSED_CONFLICT, 0, 0, 0)
    assert replies[0] == replies[1] == replies[2], (payload.hex(), replies)
    return machine


def data(rank, block=P.BOOT, nxt=P.END, flags=0, exp=P.NO_EXP, next_exp=P.NO_EXP, values=None, slot=0,
         epoch=1, tensor_blocks=16, **header) -> bytes:
    h = dict(type=P.DATA, job=1, rank=rank, world=WORLD, epoch=epoch, tensor_blocks=tensor_blocks,
             block_size=K, entries=1) | header
    entry = P.entries_array(1)
    entry[0] = (slot, flags, block, nxt, exp, next_exp)
    rows = None if values is None else np.asarray(values, np.int64).reshape(1, -1)
    return P.encode(P.Header(**h), entry, rows)


def test_a_scenario_of_rounds_losses_and_drops_is_counted_and_answered_alike():
    t = Three()
    rng = np.random.default_rng(5)
    seen = {}
    for r in range(WORLD):
        seen |= agree(t, r, data(r, slot=1, nxt=2, next_exp=r))
    vals = [rng.integers(-2**28, 2**28, K) for _ in range(WORLD)]
    for r in range(WORLD):
        seen |= agree(t, r, data(r, 2, 5 + r, P.HAS_DATA, 2, r, vals[r], slot=1))
        if r == 0:
            seen |= agree(t, r, data(r, 2, 5 + r, P.HAS_DATA, 2, r, vals[r], slot=1))    # duplicate: STATUS
    seen |= agree(t, 2, data(2, 2, 7, P.HAS_DATA, 2, 2, vals[2], slot=1))                 # lost result: shadow
    seen |= agree(t, 0, data(0, 3, P.END, slot=1))                                        # stale
    seen |= agree(t, 1, data(1, 5, P.END, P.HAS_DATA, 1, values=np.ones(K), slot=1))      # mismatch (exp 2 agreed)
    seen |= agree(t, 0, data(0, P.BOOT, P.END, slot=1, epoch=2, tensor_blocks=9))
    seen |= agree(t, 1, data(1, P.BOOT, P.END, slot=1, epoch=2))                         # mismatch: tensor size
    seen |= agree(t, 0, P.encode(P.Header(P.JOIN, 1, 0, WORLD, 100, 0, K, 0)))           # a JOIN again: JOIN_ACK
    seen |= agree(t, 2, P.encode(P.Header(P.JOIN, 1, 2, WORLD, 555, 0, K, 0)))           # new nonce: restart
    assert {"rounds", "duplicates", "retransmissions_answered", "drop_stale", "drop_mismatch", "joins",
            "job_restarts", "datagrams"} <= set(seen)


def _flags(three: Three, rank: int, payload: bytes, ce: bool = False) -> list[int]:
    """The entry flags of the answers (all three aggregators answer alike, byte for byte)."""
    _, replies = three.send(rank, payload, ce)
    assert replies[0] == replies[1] == replies[2], (payload.hex(), replies)
    return [P.decode(b).flags[0] for _, b in replies[0]]


def test_the_congestion_flag_echoes_a_ce_mark_alike_everywhere():
    """R-E1: a contribution that arrived marked CE flags its round's RESULT to every worker, the STATUS
    of a duplicate while the round waits, and the shadow copy's RESULT to a retransmission; the next
    round starts unflagged."""
    t = Three()
    for r in range(WORLD):
        agree(t, r, data(r, slot=1, nxt=2, next_exp=0))
    vals = np.ones(K)
    assert _flags(t, 0, data(0, 2, 4, P.HAS_DATA, 0, 0, vals, slot=1)) == []
    assert _flags(t, 1, data(1, 2, 4, P.HAS_DATA, 0, 0, vals, slot=1), ce=True) == []
    assert _flags(t, 1, data(1, 2, 4, P.HAS_DATA, 0, 0, vals, slot=1)) == [P.CONGESTION]   # STATUS
    assert _flags(t, 2, data(2, 2, 4, P.HAS_DATA, 0, 0, vals, slot=1)) == [P.HAS_DATA | P.CONGESTION]
    assert _flags(t, 2, data(2, 2, 4, P.HAS_DATA, 0, 0, vals, slot=1)) == [P.HAS_DATA | P.CONGESTION]
    for r in range(WORLD):
        flags = _flags(t, r, data(r, 4, P.END, slot=1))
    assert flags == [0]
    assert agree(t, 0, data(0, 4, P.END, slot=1), ce=True) == {"datagrams": 1, "retransmissions_answered": 1}


def test_the_congestion_flag_in_data_is_dropped_alike_everywhere():
    """DATA may carry HAS_DATA only (R-V4): a worker's entry with CONGESTION is drop_flags everywhere."""
    t = Three()
    assert agree(t, 0, data(0, flags=P.CONGESTION)) == {"drop_flags": 1}


def test_a_runs_first_boot_starts_a_slot_whatever_its_epoch():
    """(Found by the mutation test below: the software aggregator compared a BOOT's epoch 0x80000001
    with its reset slot's 0 and called it older, while the switch starts every slot anew per run.)"""
    t = Three()
    for r in range(WORLD):
        counted = agree(t, r, data(r, slot=2, nxt=3, epoch=0x80000001))
    assert counted == {"datagrams": 1, "rounds": 1}


def rule_packets() -> list[tuple[str, int, bytes]]:
    """(the counter spec.VALIDATION_ORDER says wins, sender rank, packet), one per rule and several
    packets that break more than one."""
    good = data(0)
    j = lambda **kw: P.encode(P.Header(**(dict(type=P.JOIN, job=1, rank=0, world=WORLD, epoch=100, block_size=K) | kw)))
    bad_version = b"\x02" + good[1:]
    return [
        ("drop_short", 0, good[:19]),
        ("drop_version", 0, bad_version),
        ("drop_version", 0, bad_version[:25]),                                   # and too long/short
        ("drop_type", 0, data(0, type=P.RESULT)),
        ("drop_type", 0, data(0, type=P.STATUS, job=9)[:30]),                      # and foreign, short
        ("drop_type", 0, data(0, type=42)),
        ("drop_length", 0, good[:-1]),
        ("drop_length", 0, data(0, block_size=0)),
        ("drop_length", 0, j()[:18] + b"\0\1"),                                  # a JOIN with an entry
        ("drop_length", 0, j() + b"\0\0\0\0"),
        ("drop_flags", 0, data(0, flags=4)),
        ("drop_flags", 0, data(0, flags=4, job=9, world=7)),                       # and foreign, geometry
        ("drop_length", 0, data(0, 3, flags=P.HAS_DATA, exp=0)),                   # data announced, absent
        ("drop_flags", 0, data(0, P.BOOT, flags=P.HAS_DATA, exp=0, values=np.ones(K))),
        ("drop_exponent", 0, data(0, 3, flags=P.HAS_DATA, values=np.ones(K))),
        ("drop_exponent", 0, data(0, 3, 2, flags=P.HAS_DATA, values=np.ones(K), slot=99)),   # and ranges
        ("drop_range", 0, data(0, 16)),
        ("drop_range", 0, data(0, 3, 3)),
        ("drop_range", 0, data(0, tensor_blocks=0xFFFFFFFF, slot=99, job=9)),      # before job, slot
        ("drop_foreign_job", 0, data(0, job=9)),
        ("drop_foreign_job", 0, data(2, job=9, world=9, slot=99)),                 # and member, geometry, slot
        ("joins_refused", 0, j(job=9)),
        ("drop_not_member", 0, data(1)),                                          # rank 1's packet from rank 0
        ("drop_not_member", 0, data(1, world=9, slot=99)),                        # and geometry, slot
        ("drop_join_world", 0, j(world=WORLD + 1)),
        ("drop_join_block_size", 0, j(block_size=K + 1)),
        ("drop_geometry", 0, data(0, world=WORLD + 1)),
        ("drop_geometry", 0, data(0, block_size=K // 2, slot=99)),                # and slot
        ("drop_range", 0, data(0, slot=SLOTS)),
    ]


@pytest.mark.parametrize("expected,rank,packet", rule_packets(),
                         ids=[f"{i}-{e}" for i, (e, _, _) in enumerate(rule_packets())])
def test_each_rule_wins_in_the_documented_order_everywhere(expected, rank, packet):
    t = Three()
    if expected == "joins_refused":
        # the software aggregator refuses only when full: fill it first (the switch refuses job 9: not configured)
        t.service = AggregatorService(slots=SLOTS, max_jobs=1, min_job_slots=SLOTS, max_job_slots=SLOTS)
        for r in range(WORLD):
            t.service.receive(P.encode(P.Header(P.JOIN, 1, r, WORLD, 100 + r, 0, K, 0)), addr(r), 0.0)
        t.service.datagrams_to_send(0.0)
        deltas, replies = t.send(rank, packet)
        assert deltas[1] == deltas[2] == {"joins_refused": 1}
        service_reply, switch_reply = replies[1][0][1], replies[2][0][1]
        assert P.parse_header(service_reply) == P.parse_header(switch_reply)
        assert P.REFUSED_BODY.unpack_from(switch_reply, 20) == (spec.REFUSED_UNKNOWN_JOB, 1, SLOTS, layout.POOL_SLOTS)
        assert P.REFUSED_BODY.unpack_from(service_reply, 20)[0] == spec.REFUSED_FULL
        return
    order = [name for _, name in spec.VALIDATION_ORDER]
    assert expected in order
    counted = agree(t, rank, packet)
    assert counted == {expected: 1}


@settings(max_examples=150, deadline=None, derandomize=True)   # (1,200 random examples passed as well)
@given(st.data())
def test_mutated_packets_are_counted_and_answered_alike(draw):
    """Random byte changes to valid packets (so that several rules break at once): the three agree,
    where docs/protocol.md says a switch and a software aggregator must (not LEAVE or STATS, which a
    switch does not take, nor other entry counts)."""
    t = Three()
    base = draw.draw(st.sampled_from([data(0, slot=2, nxt=3, next_exp=1), data(1, slot=2, nxt=5),
                                      data(0, 3, 7, P.HAS_DATA, 0, values=np.arange(K)),
                                      P.encode(P.Header(P.JOIN, 1, 2, WORLD, 102, 0, K, 0))]))
    raw = bytearray(base)
    for _ in range(draw.draw(st.integers(1, 4))):
        at = draw.draw(st.integers(0, min(len(raw), 36) - 1))
        raw[at] = draw.draw(st.integers(0, 255))
    cut = draw.draw(st.sampled_from([len(raw), len(raw), len(raw) - 1, 36, 20, 19]))
    packet = bytes(raw[:cut])
    fields = P.parse_header(packet + bytes(20))
    if len(packet) >= 20 and fields is not None:
        ptype, entries, rank = fields[0], fields[7], fields[2]
        if ptype in (P.LEAVE, P.STATS) or (ptype == P.DATA and entries != 1) or (ptype == P.JOIN and (
                rank != 2 or fields[1] != 1 or fields[6] != K)):
            return   # where a switch legitimately differs (docs/protocol.md, "On a switch"; REFUSED: above)
    agree(t, struct.unpack_from(">H", base, 4)[0], packet)    # from the base packet's rank
