"""The ZeroSum wire format (docs/protocol.md is the specification; this module is its code).

Pure functions on bytes and numpy arrays: no sockets, no clocks. A datagram is a fixed 20-byte packet
header, `entries` 16-byte entry headers, then one block of `block_size` big-endian int32 values for
every entry whose HAS_DATA flag is set, in entry order. Headers come first and data last so that a
whole datagram parses with two `numpy.frombuffer` calls, and so that a P4 parser sees fixed headers.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple

import numpy as np

from . import spec, wire
from .spec import (AGGREGATOR_RANK, BOOT, CONGESTION, DEFAULT_PORT, END, FEATURE_LEAVE, FEATURE_MULTICAST, HAS_DATA,
                   INT_EXP, JOIN_MAC_SIZE, MAX_DATAGRAM, MAX_WORLD, NO_EXP, REFUSED_CONFLICT, REFUSED_FULL,
                   REFUSED_UNKNOWN_JOB, VERSION)

# Packet types (spec.TYPES): JOIN worker -> aggregator, register (job, rank) at this address; JOIN_ACK
# aggregator -> worker, ranks joined so far and slots granted; DATA worker -> aggregator, one
# contribution per entry; RESULT aggregator -> workers, one completed round per entry; STATUS aggregator
# -> worker, a round still waits (answer to a duplicate); LEAVE worker -> aggregator, this rank's run is
# over (epoch = its JOIN nonce); REFUSED aggregator -> worker, the JOIN cannot be admitted; STATS anyone ->
# aggregator, its counters (the reply carries them as a JSON body).
JOIN, JOIN_ACK, DATA, RESULT, STATUS, LEAVE, REFUSED, STATS = (spec.TYPES[name] for name in (
    "JOIN", "JOIN_ACK", "DATA", "RESULT", "STATUS", "LEAVE", "REFUSED", "STATS"))
TYPE_NAMES = {value: name for name, value in spec.TYPES.items()}
AGGREGATOR_TAKES = frozenset(spec.TYPES[name] for name in spec.AGGREGATOR_TAKES)

MAX_BLOCKS = BOOT   # block indices must be below this

PACKET_HEADER = np.dtype(spec.PACKET_HEADER.numpy_descr())
ENTRY_HEADER = np.dtype(spec.ENTRY_HEADER.numpy_descr())
_NATIVE_ENTRY = np.dtype([(name, np.int64) for name in spec.ENTRY_HEADER.names])
WIRE_VALUE = np.dtype(">i4")
HEADER = struct.Struct(spec.PACKET_HEADER.struct_format())   # the packet header, for parsing without numpy
JOIN_ACK_BODY = struct.Struct(spec.JOIN_ACK_BODY.struct_format())  # slots granted to this job, joined ranks
REFUSED_BODY = struct.Struct(spec.REFUSED_BODY.struct_format())    # reason, jobs, slots in use, slots in all
# Body sizes a control packet may have (R-V4): a JOIN has none, or an HMAC when the aggregator has a key;
# a STATS request none (None: any length, for a STATS reply, which carries JSON).
CONTROL_BODY = {JOIN: (0, JOIN_MAC_SIZE), JOIN_ACK: (JOIN_ACK_BODY.size,), LEAVE: (0,),
                REFUSED: (REFUSED_BODY.size,), STATS: None}
STATS_REQUEST_BODY = (0,)


def join_mac(key: bytes, header: bytes) -> bytes:
    """The HMAC a JOIN carries when workers and aggregator share a key (docs/protocol.md, "Admission")."""
    return hmac.new(key, header[:PACKET_HEADER_SIZE], hashlib.sha256).digest()

PACKET_HEADER_SIZE = spec.PACKET_HEADER.size
ENTRY_SIZE = spec.ENTRY_HEADER.size
assert PACKET_HEADER.itemsize == PACKET_HEADER_SIZE == HEADER.size and ENTRY_HEADER.itemsize == ENTRY_SIZE


class ProtocolError(ValueError):
    """A datagram that does not follow docs/protocol.md; `reason` is a short counter name."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Header(NamedTuple):
    type: int
    job: int
    rank: int
    world: int
    epoch: int = 0
    tensor_blocks: int = 0
    block_size: int = 0
    entries: int = 0


class Datagram:
    """A parsed datagram: its header, the entry fields as native int64 arrays, and the data rows.

    `data[row[i]]` is the block of entry i when `has[i]` (row is -1 otherwise). `data` and `entries` (the
    raw structured entry headers) are views into the received buffer: copy what must outlive it.
    """
    __slots__ = ("header", "entries", "slot", "flags", "block", "next", "exp", "next_exp", "has", "row",
                 "data", "body")

    def __init__(self, header: Header, entries: np.ndarray, data: np.ndarray, body: bytes = b""):
        self.header, self.entries, self.data, self.body = header, entries, data, body
        native = entries.astype(_NATIVE_ENTRY)   # one conversion; the fields below are views
        self.slot, self.flags, self.block = native["slot"], native["flags"], native["block"]
        self.next, self.exp, self.next_exp = native["next"], native["exp"], native["next_exp"]
        self.has = (self.flags & HAS_DATA).astype(bool)   # valid once decode has checked the flags
        n, rows = len(self.has), int(self.has.sum())
        if rows == n:
            self.row = np.arange(n)
        else:
            self.row = np.cumsum(self.has, dtype=np.int64) - 1
            self.row[~self.has] = -1


def entries_array(n: int) -> np.ndarray:
    return np.zeros(n, dtype=ENTRY_HEADER)


def datagram_size(entries: int, data_rows: int, block_size: int) -> int:
    return PACKET_HEADER_SIZE + entries * ENTRY_SIZE + data_rows * block_size * WIRE_VALUE.itemsize


def max_entries(max_bytes: int, block_size: int, with_data: bool = True) -> int:
    """How many entries fit in a datagram of at most `max_bytes` bytes."""
    per_entry = ENTRY_SIZE + (block_size * WIRE_VALUE.itemsize if with_data else 0)
    n = (min(max_bytes, MAX_DATAGRAM) - PACKET_HEADER_SIZE) // per_entry
    if n < 1:
        raise ValueError(f"a datagram of {max_bytes} bytes cannot carry one block of {block_size} values")
    return min(n, 0xFFFF)


def encode_into(buf: memoryview | bytearray, header: Header, entries: np.ndarray,
                data: np.ndarray | None = None) -> int:
    """Write a datagram into `buf` (reused between sends); return its length.

    `data` holds one row per entry with HAS_DATA, in entry order, in any integer dtype: it is
    converted to big-endian int32 while being copied in.
    """
    n_entries = len(entries)
    rows = 0 if data is None else len(data)
    size = datagram_size(n_entries, rows, header.block_size)
    if size > len(buf):
        raise ValueError(f"datagram of {size} bytes does not fit the {len(buf)}-byte buffer")
    h = np.frombuffer(buf, dtype=PACKET_HEADER, count=1)
    h[0] = (VERSION, header.type, header.job, header.rank, header.world, header.epoch,
            header.tensor_blocks, header.block_size, n_entries)
    np.frombuffer(buf, dtype=ENTRY_HEADER, count=n_entries, offset=PACKET_HEADER_SIZE)[:] = entries
    if rows:
        out = np.frombuffer(buf, dtype=WIRE_VALUE, count=rows * header.block_size,
                            offset=PACKET_HEADER_SIZE + n_entries * ENTRY_SIZE)
        out.reshape(rows, header.block_size)[:] = data
    return size


def encode(header: Header, entries: np.ndarray | None = None, data: np.ndarray | None = None,
           body: bytes = b"") -> bytes:
    """Encode a datagram into new bytes (for control packets and tests; the data path uses encode_into)."""
    if entries is None:
        entries = entries_array(0)
    rows = 0 if data is None else len(data)
    buf = bytearray(datagram_size(len(entries), rows, header.block_size))
    encode_into(buf, header, entries, data)
    return bytes(buf) + body


def refused(job: int, world: int, block_size: int, reason: int, jobs: int = 0, in_use: int = 0,
            slots: int = 0) -> bytes:
    """REFUSED (R-J6): the job, the world and block size its header carries, and the body."""
    header = Header(REFUSED, job, AGGREGATOR_RANK, world, 0, 0, block_size, 0)
    return encode(header, body=REFUSED_BODY.pack(reason, jobs, in_use, slots))


_EMPTY_ROWS = np.zeros((0, 0), WIRE_VALUE)


def parse_header(datagram) -> tuple | None:
    """(type, job, rank, world, epoch, tensor_blocks, block_size, entries) of a datagram of this
    protocol version, or None for one too short or of another version."""
    if len(datagram) < PACKET_HEADER_SIZE:
        return None
    version, *fields = HEADER.unpack_from(datagram)
    return tuple(fields) if version == VERSION else None


def check(datagram, takes=AGGREGATOR_TAKES) -> tuple[str, tuple | None]:
    """The stateless rules R-V1..R-V5 (docs/protocol.md, "Validation"), in their order, for a datagram
    sent to an aggregator that takes the packet types `takes`: ("", header fields) when it passes, else
    (the counter of the first rule it breaks, the header fields or None).

    The fields are HEADER's: (version, type, job, rank, world, epoch, tensor_blocks, block_size, entries).
    """
    n = len(datagram)
    if n < PACKET_HEADER_SIZE:
        return "drop_short", None                                   # R-V1
    fields = HEADER.unpack_from(datagram)
    version, ptype, _, _, _, _, tensor_blocks, block_size, nent = fields
    if version != VERSION:
        return "drop_version", fields                               # R-V2
    if ptype not in takes:
        return "drop_type", fields                                  # R-V3
    if ptype == DATA:                                               # R-V4, R-V5
        reason, _, _ = wire.check_entries(np.frombuffer(datagram, np.uint8), n, nent, block_size,
                                          tensor_blocks, True, wire.DATA_FLAGS)
        return wire.DROP_REASONS[reason], fields
    allowed = STATS_REQUEST_BODY if ptype == STATS else CONTROL_BODY[ptype]
    if nent or n - PACKET_HEADER_SIZE not in allowed:
        return "drop_length", fields                                # R-V4
    return "", fields


def decode(buf, length: int | None = None) -> Datagram:
    """Parse and validate a datagram; raise ProtocolError (with a counter name) if it is malformed.

    Checks everything that can be checked without state: length against the header's counts, version,
    type, block size, flags, exponents and sentinels. The arrays returned are views into `buf`.
    """
    mv = memoryview(buf)[: len(buf) if length is None else length]
    n = len(mv)
    if n < PACKET_HEADER_SIZE:
        raise ProtocolError("short", f"{n} bytes is shorter than the {PACKET_HEADER_SIZE}-byte header")
    version, ptype, job, rank, world, epoch, tblocks, bsize, nent = HEADER.unpack_from(mv)
    if version != VERSION:
        raise ProtocolError("version", f"unknown protocol version {version}")
    if ptype not in TYPE_NAMES:
        raise ProtocolError("type", f"unknown packet type {ptype}")
    header = Header(ptype, job, rank, world, epoch, tblocks, bsize, nent)
    if ptype in CONTROL_BODY:
        body = bytes(mv[PACKET_HEADER_SIZE:])
        expect = CONTROL_BODY[ptype]
        if nent or (expect is not None and len(body) not in expect):
            raise ProtocolError("length", f"{TYPE_NAMES[ptype]} must have no entries and a body of "
                                          f"{' or '.join(map(str, expect))} bytes, got {nent} entries, "
                                          f"{len(body)} bytes")
        return Datagram(header, entries_array(0), _EMPTY_ROWS, body)
    if bsize == 0:
        raise ProtocolError("length", "block_size is 0")
    end_of_headers = PACKET_HEADER_SIZE + nent * ENTRY_SIZE
    if n < end_of_headers:
        raise ProtocolError("length", f"{nent} entries need {end_of_headers} bytes, got {n}")
    # The entry rules are checked by the same compiled code the aggregators run on every datagram.
    raw = np.frombuffer(mv, np.uint8)
    reason, rows, _ = wire.check_entries(raw, n, nent, bsize, tblocks, ptype in (DATA, RESULT),
                                         wire.DATA_FLAGS if ptype == DATA else wire.REPLY_FLAGS)
    if not reason:
        reason = wire.check_slots(raw, nent, 0x10000, np.zeros(0x10000, np.int64), 1)
    if reason:
        raise ProtocolError(wire.DROP_REASONS[reason].removeprefix("drop_"),
                            _REASON_TEXT[wire.DROP_REASONS[reason]])
    entries = np.frombuffer(mv, dtype=ENTRY_HEADER, count=nent, offset=PACKET_HEADER_SIZE)
    d = Datagram(header, entries, _EMPTY_ROWS)
    d.data = np.frombuffer(mv, dtype=WIRE_VALUE, count=rows * bsize, offset=end_of_headers).reshape(rows, bsize)
    return d


_REASON_TEXT = {
    "drop_length": "the length disagrees with the header's entry count, data blocks and block size",
    "drop_flags": "unknown entry flags, or data on a bootstrap entry",
    "drop_exponent": "a data entry needs an exponent",
    "drop_range": "a block, next index or slot out of range (next must be a later block or END; "
                  "a slot may appear once per datagram)",
}
