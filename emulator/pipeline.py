"""The switch pipeline of switch_p4/zerosum.p4, in Python: same stages, tables, registers and counters.

`Switch.process(frame, ingress_port)` runs one Ethernet frame through parser, ingress, the traffic
manager (multicast replication), egress, checksum update and deparser, and returns the frames sent as
[(egress_port, bytes)]. The emulator sends every frame as soon as it is processed, so its egress queues
are empty (enq_qdepth 0) unless whoever drives it says otherwise (`Switch.queued`: packets waiting at
each port, e.g. a port driver that knows its backlog, or a test); the egress marks CE by that depth.
The ingress runs the P4 program's stage controls in order, one method each with the same name
(validate, admission, slot_state, accumulate, reply), citing the rules of docs/protocol.md as the P4
source does; read them side by side. Registers are numpy arrays named as the
P4 registers (the per-element `pool_vNN` registers are the columns of one 2-D array, so a block is read,
added and written at once). The protocol's constants come from zerosum.spec, as the P4 program's do.
"""
from __future__ import annotations

import threading

import numpy as np

from .. import spec
from ..switch_p4.layout import (ACCUMULATE, ADMISSION, COUNTER_INDEX, ECN_MARKING, ECN_THRESHOLD, EGRESS, ELEMENTS,
                                INGRESS, JOB_STATS, JOBS,
                                L2_FORWARD, MAX_JOBS, MAX_MEMBERS, MEMBERSHIP, POOL_SLOTS, PORT, SLOT_STATE,
                                SWITCH_COUNTERS, WORKER_ADDRESS, ZEROSUM_SERVICE, ZEROSUM_STATS, element_names,
                                job_stats_base)
from .headers import UDP, Data, Entry, Ethernet, IPv4, JoinAck, Refused, ZeroSum, signed16
from .runtime import ActionSpec, Counter, ReplicationEngine, Table

DROP_PORT = 511          # v1model's drop port (mark_to_drop sets egress_spec to it)

VERSION = spec.VERSION
T_JOIN, T_JOIN_ACK, T_DATA, T_RESULT, T_STATUS, T_REFUSED = (spec.TYPES[t] for t in (
    "JOIN", "JOIN_ACK", "DATA", "RESULT", "STATUS", "REFUSED"))
HAS_DATA, CONGESTION, END, BOOT = spec.HAS_DATA, spec.CONGESTION, spec.END, spec.BOOT
ECN_MASK, NOT_ECT, ECT0, CE = spec.ECN_MASK, spec.NOT_ECT, spec.ECT0, spec.CE
NO_EXP = spec.NO_EXP & 0xFFFF     # bit<16>
AGGREGATOR_RANK = spec.AGGREGATOR_RANK
HEADER_BYTES, ENTRY_BYTES = spec.PACKET_HEADER.size, spec.ENTRY_HEADER.size
JOIN_ACK_BYTES, REFUSED_BYTES = spec.JOIN_ACK_BODY.size, spec.REFUSED_BODY.size
UDP_BYTES, IPV4_BYTES = 8, 20
POOL_SIZE = 2 * POOL_SLOTS
M32 = 0xFFFFFFFF
N_COUNTERS = len(SWITCH_COUNTERS)
C = COUNTER_INDEX    # the P4 program's C_* constants

# What Admission accepted (the P4 program's ACCEPTED_*), and what the Reply stage sends (REPLY_*).
ACCEPTED_NONE, ACCEPTED_JOIN, ACCEPTED_DATA = range(3)
REPLY_NONE, REPLY_JOIN_ACK, REPLY_REFUSED, REPLY_STATUS, REPLY_SHADOW, REPLY_RESULT, REPLY_CONFLICT = range(7)

# The parser's error values (P4 core's `error`), as standard_metadata.parser_error.
NO_ERROR, PACKET_TOO_SHORT = "NoError", "PacketTooShort"


class Headers:
    """headers_t: each member is a header object when valid, None when invalid."""
    __slots__ = ("ethernet", "ipv4", "udp", "zerosum", "join_ack", "refused", "entry", "data")
    ORDER = __slots__

    def __init__(self):
        for name in self.__slots__:
            setattr(self, name, None)

    def copy(self) -> "Headers":
        h = Headers()
        for name in self.__slots__:
            v = getattr(self, name)
            setattr(h, name, None if v is None else v.copy())
        return h


class Metadata:
    """metadata_t (zero at the start of a packet, as in bmv2) and the v1model standard_metadata fields
    the program uses."""
    USER = ("drop_reason", "accepted", "outcome", "job_stats_base", "rewritten", "switch_mac",
            "job_index", "world", "mcast_grp", "slot_base", "slots", "jobs_configured", "slots_in_use",
            "member_job", "member", "rank", "rank_bit", "generation", "joined",
            "slot", "add", "first_write", "pool_index", "read_result", "result_index", "reply",
            "r_block", "r_next", "r_exp", "r_next_exp", "r_congestion", "ecn_threshold")
    STANDARD = ("ingress_port", "egress_spec", "egress_port", "egress_rid", "standard_mcast_grp",
                "parser_error", "packet_length", "enq_qdepth")
    __slots__ = USER + STANDARD

    def __init__(self, ingress_port: int, packet_length: int):
        for name in self.USER:
            setattr(self, name, 0)
        self.ingress_port, self.packet_length = ingress_port, packet_length
        self.egress_spec = self.egress_port = self.egress_rid = self.standard_mcast_grp = self.enq_qdepth = 0
        self.parser_error = NO_ERROR

    def copy(self) -> "Metadata":
        m = object.__new__(Metadata)
        for name in self.__slots__:
            setattr(m, name, getattr(self, name))
        return m


class Registers:
    """The ingress registers, zero at start as in bmv2, by the stage control that holds them."""

    ADMISSION = {"joined": (MAX_JOBS, np.uint32), "generation": (MAX_JOBS, np.uint32),
                 "member_nonce": (MAX_MEMBERS, np.uint32)}
    SLOT_STATE = {
        "slot_generation": (POOL_SLOTS, np.uint32), "slot_epoch": (POOL_SLOTS, np.uint32),
        "slot_block": (POOL_SLOTS, np.uint32), "slot_exp": (POOL_SLOTS, np.uint16),
        "slot_tensor_blocks": (POOL_SLOTS, np.uint32), "bitmap": (POOL_SLOTS, np.uint32),
        "count": (POOL_SLOTS, np.uint32), "min_next": (POOL_SLOTS, np.uint32),
        "min_next_exp": (POOL_SLOTS, np.uint16), "has_data": (POOL_SLOTS, np.uint8),
        "bank": (POOL_SLOTS, np.uint8), "prev_epoch": (POOL_SLOTS, np.uint32),
        "prev_block": (POOL_SLOTS, np.uint32), "prev_next": (POOL_SLOTS, np.uint32),
        "prev_exp": (POOL_SLOTS, np.uint16), "prev_next_exp": (POOL_SLOTS, np.uint16),
        "prev_has_data": (POOL_SLOTS, np.uint8), "congestion": (POOL_SLOTS, np.uint8),
        "prev_congestion": (POOL_SLOTS, np.uint8),
    }
    WIDTHS = {np.uint32: 32, np.uint16: 16, np.uint8: 1}

    def __init__(self):
        for name, (size, dtype) in (*self.ADMISSION.items(), *self.SLOT_STATE.items()):
            setattr(self, name, np.zeros(size, dtype))
        self.pool = np.zeros((POOL_SIZE, ELEMENTS), np.uint32)   # Accumulate's pool_v00 ... as columns

    def by_name(self) -> dict[str, tuple[np.ndarray, int]]:
        """P4 name -> (array, bit width): what P4Runtime register reads and writes address."""
        out = {}
        for prefix, group in ((ADMISSION, self.ADMISSION), (SLOT_STATE, self.SLOT_STATE)):
            out.update({prefix + name: (getattr(self, name), self.WIDTHS[dtype]) for name, (_, dtype) in group.items()})
        for i, v in enumerate(element_names()):
            out[ACCUMULATE + "pool_" + v] = (self.pool[:, i], 32)
        return out


def _tables() -> dict[str, Table]:
    def spec_(name, *params):
        return ActionSpec(name, tuple(params))
    no_action = {"NoAction": spec_("NoAction")}
    return {t.name: t for t in (
        Table(L2_FORWARD, (("hdr.ethernet.dstAddr", 48),),
              {INGRESS + "forward": spec_(INGRESS + "forward", ("port", 9)),
               INGRESS + "flood": spec_(INGRESS + "flood", ("group", 16)),
               INGRESS + "drop": spec_(INGRESS + "drop")},
              (INGRESS + "drop", {}), 1024),
        Table(ZEROSUM_SERVICE, (("hdr.ipv4.dstAddr", 32), ("hdr.udp.dstPort", 16)),
              {INGRESS + "serve": spec_(INGRESS + "serve", ("switch_mac", 48)), **no_action},
              ("NoAction", {}), 16),
        Table(JOBS, (("hdr.zerosum.job", 16),),
              {ADMISSION + "set_job": spec_(ADMISSION + "set_job", ("job_index", 16), ("world", 16),
                                             ("mcast_grp", 16), ("slot_base", 32), ("slots", 32)),
               ADMISSION + "refuse": spec_(ADMISSION + "refuse", ("jobs_configured", 32), ("slots_in_use", 32))},
              (ADMISSION + "refuse", {"jobs_configured": 0, "slots_in_use": 0}), MAX_JOBS),
        Table(MEMBERSHIP, (("hdr.ipv4.srcAddr", 32), ("hdr.udp.srcPort", 16)),
              {ADMISSION + "set_member": spec_(ADMISSION + "set_member", ("job", 16), ("member", 16), ("rank", 16),
                                                ("rank_bit", 32)),
               **no_action},
              ("NoAction", {}), MAX_MEMBERS),
        Table(WORKER_ADDRESS, (("standard_metadata.egress_rid", 16),),
              {EGRESS + "set_worker": spec_(EGRESS + "set_worker", ("mac", 48), ("ip", 32), ("port", 16)),
               **no_action},
              ("NoAction", {}), MAX_MEMBERS),
        Table(ECN_MARKING, (), {EGRESS + "mark_above": spec_(EGRESS + "mark_above", ("depth", 19))},
              (EGRESS + "mark_above", {"depth": ECN_THRESHOLD}), 1024),
    )}


class Switch:
    """One emulated switch: the pipeline plus its control-plane state."""

    def __init__(self):
        self.tables = _tables()
        self.registers = Registers()
        self.counters = {ZEROSUM_STATS: Counter(ZEROSUM_STATS, N_COUNTERS),
                         JOB_STATS: Counter(JOB_STATS, (MAX_JOBS + 1) * N_COUNTERS)}
        self.pre = ReplicationEngine()
        self.queued: dict[int, int] = {}   # packets waiting at each egress port (none: frames leave at once)
        self.lock = threading.Lock()   # packets and control-plane writes never interleave mid-packet

    @property
    def stats(self) -> dict[str, int]:
        """The zerosum_stats counter as {name: packets}, non-zero entries only."""
        c = self.counters[ZEROSUM_STATS]
        return {name: int(c.packets[i]) for i, name in enumerate(SWITCH_COUNTERS) if c.packets[i]}

    def job_stats(self, job_index: int) -> dict[str, int]:
        """A job's part of job_stats as {name: packets}, non-zero entries only."""
        first = job_stats_base(job_index)
        p = self.counters[JOB_STATS].packets[first: first + N_COUNTERS]
        return {name: int(p[i]) for i, name in enumerate(SWITCH_COUNTERS) if p[i]}

    # -- the whole pipeline ---------------------------------------------------------------------------
    def process(self, frame: bytes, ingress_port: int) -> list[tuple[int, bytes]]:
        with self.lock:
            meta = Metadata(ingress_port, len(frame))
            hdr, offset = self.parser(frame, meta)
            payload = bytes(frame[offset:])
            self.ingress(hdr, meta)
            out = []
            for egress_port, rid, h in self.traffic_manager(hdr, meta):
                m = meta.copy()    # v1model copies the user metadata to every replica
                m.egress_port, m.egress_rid, m.egress_spec = egress_port, rid, egress_port
                m.enq_qdepth = self.queued.get(egress_port, 0)
                if self.egress(h, m):
                    self.compute_checksum(h, m)
                    out.append((egress_port, self.deparser(h) + payload))
            return out

    # -- parser ---------------------------------------------------------------------------------------
    def parser(self, frame: bytes, meta: Metadata) -> tuple[Headers, int]:
        hdr, offset = Headers(), 0

        def extract(cls):
            nonlocal offset
            if offset + cls.size() > len(frame):
                meta.parser_error = PACKET_TOO_SHORT
                return None
            h = cls.extract(frame, offset)
            offset += cls.size()
            return h

        # state start
        hdr.ethernet = extract(Ethernet)
        if hdr.ethernet is None or hdr.ethernet.etherType != 0x0800:
            return hdr, offset
        # state parse_ipv4
        hdr.ipv4 = extract(IPv4)
        if hdr.ipv4 is None or (hdr.ipv4.ihl, hdr.ipv4.fragOffset, hdr.ipv4.protocol) != (5, 0, 17):
            return hdr, offset
        # state parse_udp
        hdr.udp = extract(UDP)
        if hdr.udp is None or hdr.udp.dstPort != PORT:
            return hdr, offset
        # state parse_zerosum: the switch is compiled for one entry per packet and ELEMENTS values
        hdr.zerosum = extract(ZeroSum)
        if hdr.zerosum is None or hdr.zerosum.entries != 1:
            return hdr, offset
        # state parse_entry
        hdr.entry = extract(Entry)
        if hdr.entry is None or (hdr.entry.flags, hdr.zerosum.block_size) != (HAS_DATA, ELEMENTS):
            return hdr, offset
        # state parse_data
        hdr.data = extract(Data)
        return hdr, offset

    # -- ZeroSumIngress -------------------------------------------------------------------------------
    def apply_table(self, name: str, key: tuple, hdr: Headers, meta: Metadata) -> bool:
        hit, action, params = self.tables[name].lookup(key)
        getattr(self, "action_" + action.rsplit(".", 1)[-1])(hdr, meta, **params)
        return hit

    def action_NoAction(self, hdr, meta):
        pass

    def action_drop(self, hdr, meta):
        meta.egress_spec = DROP_PORT

    def action_forward(self, hdr, meta, port):
        meta.egress_spec = port

    def action_flood(self, hdr, meta, group):
        meta.standard_mcast_grp = group

    def action_serve(self, hdr, meta, switch_mac):
        meta.switch_mac = switch_mac

    def count_event(self, c: int, meta: Metadata) -> None:
        self.counters[ZEROSUM_STATS].count(c, meta.packet_length)
        self.counters[JOB_STATS].count(meta.job_stats_base + c, meta.packet_length)

    def ingress(self, hdr: Headers, meta: Metadata) -> None:
        is_zerosum = False
        if hdr.udp is not None and hdr.udp.dstPort == PORT:
            is_zerosum = self.apply_table(ZEROSUM_SERVICE, (hdr.ipv4.dstAddr, hdr.udp.dstPort), hdr, meta)
        if not is_zerosum:
            self.apply_table(L2_FORWARD, (hdr.ethernet.dstAddr,) if hdr.ethernet else (0,), hdr, meta)
            return
        # From here on every packet is either answered or dropped, and counted.
        meta.egress_spec = DROP_PORT
        meta.job_stats_base = MAX_JOBS * N_COUNTERS
        self.validate(hdr, meta)
        if meta.drop_reason == 0:
            self.admission(hdr, meta)
        if meta.accepted == ACCEPTED_DATA:
            self.slot_state(hdr, meta)
            self.accumulate(hdr, meta)
        if meta.drop_reason == 0:
            self.reply(hdr, meta)
        if meta.drop_reason != 0:
            self.count_event(meta.drop_reason, meta)
        if meta.accepted == ACCEPTED_JOIN:
            self.count_event(C["joins"], meta)
        elif meta.accepted == ACCEPTED_DATA:
            self.count_event(C["datagrams"], meta)
        if meta.outcome != 0:
            self.count_event(meta.outcome, meta)

    # == Validate: the stateless rules, in their order (docs/protocol.md, "Validation") ===============
    def validate(self, hdr: Headers, meta: Metadata) -> None:
        z, ent = hdr.zerosum, hdr.entry
        udp_payload = (hdr.udp.length - UDP_BYTES) & 0xFFFF
        if z is None or hdr.udp.length < UDP_BYTES + HEADER_BYTES:
            meta.drop_reason = C["drop_short"]                      # R-V1
            return
        if z.version != VERSION:
            meta.drop_reason = C["drop_version"]                    # R-V2
            return
        if z.type != T_JOIN and z.type != T_DATA:
            meta.drop_reason = C["drop_type"]                       # R-V3: a switch takes JOIN and DATA
            return
        if meta.parser_error != NO_ERROR:
            meta.drop_reason = C["drop_length"]                     # R-V4: it ends inside a header it announces
            return
        if z.type == T_JOIN:
            if z.entries != 0 or udp_payload != HEADER_BYTES:
                meta.drop_reason = C["drop_length"]                 # R-V4 (a switch takes no JOIN key)
            return
        if z.block_size == 0 or z.entries != 1 or ent is None:
            meta.drop_reason = C["drop_length"]                     # R-V4; one entry per packet
            return
        if ent.flags > HAS_DATA:
            meta.drop_reason = C["drop_flags"]                      # R-V4
            return
        expect = HEADER_BYTES + ENTRY_BYTES
        if ent.flags == HAS_DATA:
            expect += z.block_size << 2
        if udp_payload != expect:
            meta.drop_reason = C["drop_length"]                     # R-V4
            return
        real = ent.block != BOOT
        limit = z.tensor_blocks
        if limit > BOOT:
            meta.drop_reason = C["drop_range"]                      # R-V5
        elif ent.flags == HAS_DATA and not real:
            meta.drop_reason = C["drop_flags"]                      # R-V5
        elif ent.flags == HAS_DATA and ent.exp == NO_EXP:
            meta.drop_reason = C["drop_exponent"]                   # R-V5
        elif (real and ent.block >= limit) or (
                ent.next != END and (ent.next >= limit or (real and ent.next <= ent.block))):
            meta.drop_reason = C["drop_range"]                      # R-V5

    # == Admission: the packet's job and member; joining ==============================================
    def action_set_job(self, hdr, meta, job_index, world, mcast_grp, slot_base, slots):
        meta.job_index, meta.world, meta.mcast_grp, meta.slot_base, meta.slots = (
            job_index, world, mcast_grp, slot_base, slots)
        meta.job_stats_base = job_index * N_COUNTERS

    def action_refuse(self, hdr, meta, jobs_configured, slots_in_use):
        meta.jobs_configured, meta.slots_in_use = jobs_configured, slots_in_use

    def action_set_member(self, hdr, meta, job, member, rank, rank_bit):
        meta.member_job, meta.member, meta.rank, meta.rank_bit = job, member, rank, rank_bit

    def admission(self, hdr: Headers, meta: Metadata) -> None:
        z, r = hdr.zerosum, self.registers
        if not self.apply_table(JOBS, (z.job,), hdr, meta):
            if z.type == T_JOIN:
                meta.outcome, meta.reply = C["joins_refused"], REPLY_REFUSED   # R-V7, R-J6
            else:
                meta.drop_reason = C["drop_foreign_job"]            # R-V7
            return
        known = self.apply_table(MEMBERSHIP, (hdr.ipv4.srcAddr, hdr.udp.srcPort), hdr, meta)
        if not known or meta.member_job != z.job or meta.rank != z.rank:
            meta.drop_reason = C["drop_not_member"]                 # R-V8: membership is configured
            return
        if z.type == T_JOIN:
            # R-V9, R-J6: refused, naming the job's world and block size (counted as the drop it is)
            if z.world != meta.world:
                meta.outcome, meta.reply = C["drop_join_world"], REPLY_CONFLICT
                return
            if z.block_size != ELEMENTS:
                meta.outcome, meta.reply = C["drop_join_block_size"], REPLY_CONFLICT
                return
            members = int(r.joined[meta.job_index])
            nonce = int(r.member_nonce[meta.member])
            if (members & meta.rank_bit) != 0 and nonce != z.epoch:
                meta.outcome = C["job_restarts"]                    # R-J3: a new run of the job starts
                members = 0
            if members == 0:
                # R-J3: the first member of a run; slots of older generations restart at their next BOOT.
                r.generation[meta.job_index] += np.uint32(1)
            members |= meta.rank_bit                                # R-J1
            r.joined[meta.job_index] = members
            r.member_nonce[meta.member] = z.epoch
            meta.joined = members
            meta.accepted = ACCEPTED_JOIN
            meta.reply = REPLY_JOIN_ACK                             # R-J2
            return
        if z.world != meta.world or z.block_size != ELEMENTS:
            meta.drop_reason = C["drop_geometry"]                   # R-V10
            return
        if hdr.entry.slot >= meta.slots:
            meta.drop_reason = C["drop_range"]                      # R-V10
            return
        meta.accepted = ACCEPTED_DATA
        meta.generation = int(r.generation[meta.job_index])

    # == SlotState: the round a DATA entry belongs to ==================================================
    def start_allreduce(self, hdr: Headers, s: int) -> None:
        """R-A1: a slot's next allreduce starts empty (an abandoned partial sum is overwritten by the
        next first write)."""
        r = self.registers
        r.slot_epoch[s], r.slot_block[s], r.slot_exp[s] = hdr.zerosum.epoch, BOOT, NO_EXP
        r.slot_tensor_blocks[s] = hdr.zerosum.tensor_blocks
        r.bitmap[s] = r.count[s] = 0
        r.min_next[s], r.min_next_exp[s] = END, NO_EXP
        r.has_data[s] = 0
        r.congestion[s] = 0

    def slot_state(self, hdr: Headers, meta: Metadata) -> None:
        z, ent, r = hdr.zerosum, hdr.entry, self.registers
        s = (meta.slot_base + ent.slot) & M32
        epoch, block, gen = z.epoch, ent.block, meta.generation
        s_gen, s_epoch, s_block = int(r.slot_generation[s]), int(r.slot_epoch[s]), int(r.slot_block[s])

        # R-A1: a bootstrap entry of a newer epoch (or of a new run) starts the slot's next allreduce.
        age = (epoch - s_epoch) & M32
        newer = age != 0 and age < 0x80000000
        if block == BOOT and (s_gen != gen or newer):
            if s_gen != gen:
                r.prev_block[s] = END
                r.slot_generation[s] = gen
                s_gen = gen
            self.start_allreduce(hdr, s)
            s_epoch, s_block = epoch, BOOT

        heard = int(r.bitmap[s])
        b = int(r.bank[s])
        s_cong = int(r.congestion[s])
        current = s_gen == gen and s_epoch == epoch and block == s_block
        if current and (heard & meta.rank_bit) != 0:
            # R-A2: a duplicate is not added again; the sender learns which ranks the round has heard.
            meta.outcome, meta.reply = C["duplicates"], REPLY_STATUS
            meta.r_block, meta.r_next, meta.r_exp, meta.r_next_exp = s_block, heard, NO_EXP, NO_EXP
            if s_cong == 1:
                meta.r_congestion = CONGESTION
            return
        if not current:
            if s_gen != gen or int(r.prev_epoch[s]) != epoch or int(r.prev_block[s]) != block:
                meta.outcome = C["drop_stale"]                      # R-A4
                return
            # R-A3: a retransmission to the previous round: its result from the shadow bank, to the sender.
            meta.outcome, meta.reply = C["retransmissions_answered"], REPLY_SHADOW
            meta.r_block, meta.r_next = block, int(r.prev_next[s])
            meta.r_exp, meta.r_next_exp = int(r.prev_exp[s]), int(r.prev_next_exp[s])
            meta.read_result = int(r.prev_has_data[s])
            if r.prev_congestion[s] == 1:
                meta.r_congestion = CONGESTION                      # R-E1: as the round's first RESULT
            meta.result_index = 2 * s + (b ^ 1)
            return

        # R-A5: a contribution must agree with the slot, or it is never added.
        s_exp, s_tblocks = int(r.slot_exp[s]), int(r.slot_tensor_blocks[s])
        if (ent.flags == HAS_DATA and ent.exp != s_exp) or s_tblocks != z.tensor_blocks:
            meta.outcome = C["drop_mismatch"]
            return
        # R-A6: add it. HAS_DATA with ELEMENTS values (validated) is when the parser extracted hdr.data.
        s_has = int(r.has_data[s])
        if hdr.data is not None:
            meta.add, meta.first_write, meta.pool_index = 1, s_has ^ 1, 2 * s + b
            s_has = 1
            r.has_data[s] = 1
        heard |= meta.rank_bit
        r.bitmap[s] = heard
        if (hdr.ipv4.diffserv & ECN_MASK) == CE:
            s_cong = 1                                              # R-E1: the round's RESULT echoes the mark
            r.congestion[s] = 1
        n = int(r.count[s]) + 1
        r.count[s] = n
        m, m_exp = int(r.min_next[s]), int(r.min_next_exp[s])
        if ent.next < m:
            m, m_exp = ent.next, ent.next_exp
        elif ent.next == m and signed16(ent.next_exp) > signed16(m_exp):
            m_exp = ent.next_exp
        r.min_next[s], r.min_next_exp[s] = m, m_exp
        if n != meta.world:
            return   # waiting for more workers: nothing to send

        # R-A7: the round is complete: its bank becomes the shadow copy, the slot moves to the minimum.
        meta.outcome = C["rounds"]
        r.prev_epoch[s], r.prev_block[s], r.prev_next[s] = s_epoch, s_block, m
        r.prev_exp[s], r.prev_next_exp[s], r.prev_has_data[s] = s_exp, m_exp, s_has
        r.prev_congestion[s] = s_cong
        r.congestion[s] = 0
        r.bank[s] = b ^ 1
        r.slot_block[s], r.slot_exp[s] = m, m_exp
        r.bitmap[s] = r.count[s] = 0
        r.min_next[s], r.min_next_exp[s] = END, NO_EXP
        r.has_data[s] = 0
        meta.reply = REPLY_RESULT
        meta.r_block, meta.r_next, meta.r_exp, meta.r_next_exp = s_block, m, s_exp, m_exp
        meta.read_result, meta.result_index = s_has, 2 * s + b
        if s_cong == 1:
            meta.r_congestion = CONGESTION

    # == Accumulate: the value registers ===============================================================
    def accumulate(self, hdr: Headers, meta: Metadata) -> None:
        pool = self.registers.pool
        if meta.add == 1:
            if meta.first_write == 1:
                pool[meta.pool_index] = hdr.data.values            # write_block
            else:
                pool[meta.pool_index] += hdr.data.values           # add_block (uint32 wraps as bit<32>)
        if meta.read_result == 1:
            hdr.data = Data(pool[meta.result_index].copy())       # read_block: the result or the shadow copy

    # == Reply: what goes back, and to whom ============================================================
    def answer(self, hdr: Headers, ptype: int) -> None:
        hdr.zerosum.type, hdr.zerosum.rank = ptype, AGGREGATOR_RANK

    def to_sender(self, hdr: Headers, meta: Metadata) -> None:
        e, ip, udp = hdr.ethernet, hdr.ipv4, hdr.udp
        e.srcAddr, e.dstAddr = meta.switch_mac, e.srcAddr
        ip.srcAddr, ip.dstAddr = ip.dstAddr, ip.srcAddr
        udp.dstPort, udp.srcPort = udp.srcPort, PORT
        meta.egress_spec = meta.ingress_port

    def to_job(self, hdr: Headers, meta: Metadata) -> None:
        hdr.ethernet.srcAddr = meta.switch_mac
        hdr.ipv4.srcAddr = hdr.ipv4.dstAddr
        hdr.udp.srcPort = PORT
        meta.standard_mcast_grp = meta.mcast_grp

    def set_lengths(self, hdr: Headers, meta: Metadata, payload: int) -> None:
        """Sizes of the answer; sent ECT(0), as a software aggregator's (a CE mark is in the flag)."""
        hdr.ipv4.diffserv = (hdr.ipv4.diffserv & ~ECN_MASK & 0xFF) | ECT0
        hdr.udp.length = UDP_BYTES + payload
        hdr.udp.checksum = 0
        hdr.ipv4.totalLen = IPV4_BYTES + UDP_BYTES + payload
        hdr.ipv4.ttl = 64
        meta.rewritten = 1

    def reply(self, hdr: Headers, meta: Metadata) -> None:
        z = hdr.zerosum
        if meta.reply == REPLY_JOIN_ACK:
            self.answer(hdr, T_JOIN_ACK)                            # R-J2
            z.tensor_blocks = 0                                     # no FEATURE_LEAVE: a switch takes no LEAVE
            hdr.join_ack = JoinAck(meta.slots, meta.joined)
            self.to_sender(hdr, meta)
            self.set_lengths(hdr, meta, HEADER_BYTES + JOIN_ACK_BYTES)
        elif meta.reply == REPLY_REFUSED:
            self.answer(hdr, T_REFUSED)                             # R-J6
            z.epoch = z.tensor_blocks = 0
            hdr.refused = Refused(spec.REFUSED_UNKNOWN_JOB, meta.jobs_configured, meta.slots_in_use, POOL_SLOTS)
            self.to_sender(hdr, meta)
            self.set_lengths(hdr, meta, HEADER_BYTES + REFUSED_BYTES)
        elif meta.reply == REPLY_CONFLICT:
            self.answer(hdr, T_REFUSED)                             # R-J6, reason 3
            z.epoch = z.tensor_blocks = 0
            z.world, z.block_size = meta.world, ELEMENTS
            hdr.refused = Refused(spec.REFUSED_CONFLICT, 0, 0, 0)
            self.to_sender(hdr, meta)
            self.set_lengths(hdr, meta, HEADER_BYTES + REFUSED_BYTES)
        elif meta.reply != REPLY_NONE:
            self.answer(hdr, T_STATUS if meta.reply == REPLY_STATUS else T_RESULT)   # R-A2; R-A3, R-A7
            ent = hdr.entry
            ent.block, ent.next, ent.exp, ent.next_exp = meta.r_block, meta.r_next, meta.r_exp, meta.r_next_exp
            if meta.reply == REPLY_RESULT:
                self.to_job(hdr, meta)
            else:
                self.to_sender(hdr, meta)
            if meta.read_result == 1:
                ent.flags = HAS_DATA | meta.r_congestion
                self.set_lengths(hdr, meta, HEADER_BYTES + ENTRY_BYTES + (ELEMENTS << 2))
            else:
                ent.flags = meta.r_congestion
                hdr.data = None
                self.set_lengths(hdr, meta, HEADER_BYTES + ENTRY_BYTES)

    # -- traffic manager, egress, checksum, deparser ----------------------------------------------------
    def traffic_manager(self, hdr: Headers, meta: Metadata):
        """simple_switch's queueing step: multicast replicas (port, rid) or the one unicast copy."""
        if meta.standard_mcast_grp != 0:
            replicas = self.pre.groups.get(meta.standard_mcast_grp, [])
            return [(port, rid, hdr.copy() if i + 1 < len(replicas) else hdr)
                    for i, (port, rid) in enumerate(replicas)]
        if meta.egress_spec == DROP_PORT:
            return []
        return [(meta.egress_spec, 0, hdr)]

    def egress(self, hdr: Headers, meta: Metadata) -> bool:
        """ZeroSumEgress; False when the copy is dropped."""
        if meta.egress_rid != 0:
            self.apply_table(WORKER_ADDRESS, (meta.egress_rid,), hdr, meta)
        elif meta.standard_mcast_grp != 0 and meta.egress_port == meta.ingress_port:
            return False   # a flooded frame does not go back where it came from
        self.apply_table(ECN_MARKING, (), hdr, meta)
        ecn = hdr.ipv4.diffserv & ECN_MASK if hdr.ipv4 is not None else NOT_ECT
        if ecn != NOT_ECT and ecn != CE and meta.enq_qdepth >= meta.ecn_threshold:
            self.mark_ce(hdr)
        return True

    def action_mark_above(self, hdr, meta, depth):
        meta.ecn_threshold = depth

    def mark_ce(self, hdr: Headers) -> None:
        """CE on an ECN-capable packet (RFC 3168, section 5), the checksum updated incrementally (RFC 1624,
        eqn. 3): a forwarded header with options stays right, a bad one stays bad."""
        ip = hdr.ipv4
        before = (ip.version << 12) | (ip.ihl << 8) | ip.diffserv
        ip.diffserv |= CE
        after = before | CE
        total = (~ip.hdrChecksum & 0xFFFF) + (~before & 0xFFFF) + after
        total = (total & 0xFFFF) + (total >> 16)
        total = (total & 0xFFFF) + (total >> 16)
        ip.hdrChecksum = ~total & 0xFFFF

    def action_set_worker(self, hdr, meta, mac, ip, port):
        hdr.ethernet.dstAddr, hdr.ipv4.dstAddr, hdr.udp.dstPort = mac, ip, port

    def compute_checksum(self, hdr: Headers, meta: Metadata) -> None:
        """Only headers the pipeline rewrote get a new checksum: a forwarded frame leaves as it came."""
        if hdr.ipv4 is not None and meta.rewritten == 1:
            hdr.ipv4.hdrChecksum = hdr.ipv4.checksum()

    def deparser(self, hdr: Headers) -> bytes:
        return b"".join(h.emit() for h in (getattr(hdr, n) for n in Headers.ORDER) if h is not None)
