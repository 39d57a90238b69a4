"""The ZeroSum wire format, declared once.

docs/protocol.md is the prose; this module is the only place that defines the headers' fields and sizes,
the packet types, flags, sentinels, and the counter names in their order. Everything else is derived
from it: protocol.py (numpy dtypes and structs for the host), the emulator's header classes, the P4
program's header types and constants (switch_p4/generate.py renders them into zerosum.p4.j2), and the
scapy layers of the packet tests. tests/test_spec.py fails when any of them disagrees.
"""
from __future__ import annotations

from typing import NamedTuple

VERSION = 1
DEFAULT_PORT = 48879   # OmniReduce's ps_port (0xBEEF)


class Field(NamedTuple):
    name: str
    bits: int
    signed: bool = False    # two's complement on the wire (P4 declares it bit<N> and casts to int<N>)
    p4type: str = ""        # the P4 typedef it is declared with, if any


class Layout(NamedTuple):
    """A fixed-size header: its P4 header type name and fields in wire order (big-endian)."""
    p4name: str
    fields: tuple[Field, ...]

    @property
    def size(self) -> int:
        return sum(f.bits for f in self.fields) // 8

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def offset(self, name: str) -> int:
        """The byte offset of field `name` in the header."""
        at = 0
        for f in self.fields:
            if f.name == name:
                return at
            at += f.bits // 8
        raise KeyError(name)

    def struct_format(self) -> str:
        """The `struct` format (fields of 8, 16 and 32 bits)."""
        codes = {(8, False): "B", (16, False): "H", (32, False): "I", (64, False): "Q", (16, True): "h", (32, True): "i",
                 (64, True): "q"}
        return ">" + "".join(codes[f.bits, f.signed] for f in self.fields)

    def numpy_descr(self) -> list[tuple[str, str]]:
        return [(f.name, (">" if f.bits > 8 else "") + ("i" if f.signed else "u") + str(f.bits // 8))
                for f in self.fields]


# P4 typedefs of the protocol's quantities (the widths are the fields').
TYPEDEFS = {"job_id_t": 16, "rank_t": 16, "epoch_t": 32, "block_t": 32, "slot_t": 16, "exp_t": 16}

PACKET_HEADER = Layout("zerosum_t", (
    Field("version", 8), Field("type", 8), Field("job", 16, p4type="job_id_t"),
    Field("rank", 16, p4type="rank_t"), Field("world", 16), Field("epoch", 32, p4type="epoch_t"),
    Field("tensor_blocks", 32, p4type="block_t"), Field("block_size", 16), Field("entries", 16),
))
ENTRY_HEADER = Layout("entry_t", (
    Field("slot", 16, p4type="slot_t"), Field("flags", 16), Field("block", 32, p4type="block_t"),
    Field("next", 32, p4type="block_t"), Field("exp", 16, True, "exp_t"), Field("next_exp", 16, True, "exp_t"),
))
JOIN_ACK_BODY = Layout("join_ack_t", (Field("slots", 32), Field("joined", 32)))
# Why a JOIN was refused, with the aggregator's load (jobs served, slots they hold, slots in all).
REFUSED_BODY = Layout("refused_t", (Field("reason", 32), Field("jobs", 32), Field("in_use", 32),
                                    Field("slots", 32)))
REFUSED_FULL = 1          # no room for another job (software aggregator)
REFUSED_UNKNOWN_JOB = 2   # the job is not configured (a switch: jobs come from its control plane)
REFUSED_CONFLICT = 3      # the job exists with another world or block size (the REFUSED header: the job's)

# Packet types, by value.
TYPES = {"JOIN": 1, "JOIN_ACK": 2, "DATA": 3, "RESULT": 4, "STATUS": 5, "LEAVE": 6, "REFUSED": 7, "STATS": 8}
# What each kind of aggregator takes (R-V3): anything else sent to it is drop_type.
AGGREGATOR_TAKES = ("JOIN", "DATA", "LEAVE", "STATS")
SWITCH_TAKES = ("JOIN", "DATA")

# Entry flags.
HAS_DATA = 0x0001
# RESULT and STATUS only (R-E1): a contribution to the round arrived with an ECN Congestion Experienced
# mark; DATA with it is dropped (drop_flags), as any flag but HAS_DATA.
CONGESTION = 0x0002
DATA_FLAGS = HAS_DATA                  # what DATA entries may carry (R-V4)
REPLY_FLAGS = HAS_DATA | CONGESTION    # what RESULT and STATUS entries may carry

# ECN, the low two bits of the IPv4 TOS byte (RFC 3168, section 5): what workers and aggregators send
# (the DSCP bits zero), and the mark a congested queue sets on ECN-capable packets.
NOT_ECT, ECT0, CE = 0b00, 0b10, 0b11
ECN_MASK = 0b11

# Sentinels.
END = 0xFFFFFFFF        # block index: "no further non-zero block in this column"
BOOT = 0xFFFFFFFE       # block index of a column's bootstrap round (header-only)
NO_EXP = -32768         # exponent of "no data" (int16 minimum)
INT_EXP = 0x7FFF        # exponent of raw int32 data (no scaling)
AGGREGATOR_RANK = 0xFFFF  # `rank` of packets an aggregator sends
FEATURE_LEAVE = 0x1     # JOIN_ACK tensor_blocks bit: the aggregator understands LEAVE (a switch sends 0)
FEATURE_MULTICAST = 0x2  # JOIN_ACK tensor_blocks bit: RESULTs of completed rounds go to a multicast group
JOIN_MAC_SIZE = 32      # HMAC-SHA256 body of a JOIN to an aggregator with a key

MAX_WORLD = 32          # the per-slot contributor bitmap is 32 bits wide
MAX_DATAGRAM = 65507    # the UDP payload limit over IPv4

# Counters, by name, in index order. The switch keeps the first SWITCH_COUNTERS of them (the index order
# of its `zerosum_stats` and `job_stats` counters); the software aggregator keeps them all.
COUNTERS = (
    "datagrams", "joins", "job_restarts", "rounds", "duplicates", "retransmissions_answered",
    "drop_short", "drop_version", "drop_type", "drop_length", "drop_flags", "drop_range",
    "drop_exponent", "drop_foreign_job", "drop_not_member", "drop_geometry", "drop_join_world",
    "drop_join_block_size", "drop_stale", "drop_mismatch", "joins_refused",
    # software aggregator only:
    "send_errors", "leaves", "drop_auth", "drop_replay", "jobs_started", "jobs_ended", "jobs_join_timeout",
)
SWITCH_COUNTERS = COUNTERS.index("joins_refused") + 1
COUNTER_INDEX = {name: i for i, name in enumerate(COUNTERS)}

# docs/protocol.md "Validation": when several reasons apply to one packet, the first in this order is
# counted (R-V1 ... R-V10). Every implementation checks in this order.
VALIDATION_ORDER = (
    ("R-V1", "drop_short"), ("R-V2", "drop_version"), ("R-V3", "drop_type"), ("R-V4", "drop_length"),
    ("R-V4", "drop_flags"), ("R-V5", "drop_flags"), ("R-V5", "drop_exponent"), ("R-V5", "drop_range"),
    ("R-V6", "drop_auth"), ("R-V6", "drop_replay"), ("R-V7", "drop_foreign_job"),
    ("R-V7", "joins_refused"), ("R-V8", "drop_not_member"), ("R-V9", "drop_join_world"),
    ("R-V9", "drop_join_block_size"), ("R-V10", "drop_geometry"), ("R-V10", "drop_range"),
)
