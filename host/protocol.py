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

VERSION = 1
DEFAULT_PORT = 48879  # OmniReduce's ps_port (0xBEEF)

# Packet types.
JOIN = 1       # worker -> aggregator: register (job, rank) at this address
JOIN_ACK = 2   # aggregator -> worker: bitmap of ranks joined so far, slots granted
DATA = 3       # worker -> aggregator: one contribution per entry
RESULT = 4     # aggregator -> workers: one completed round per entry
STATUS = 5     # aggregator -> worker: a round is still waiting (answer to a duplicate contribution)
LEAVE = 6      # worker -> aggregator: this rank's run of the job is over (epoch = its JOIN nonce)
REFUSED = 7    # aggregator -> worker: the JOIN cannot be admitted (aggregator full)
STATS = 8      # anyone -> aggregator: ask for its counters; aggregator -> asker: them, as a JSON body

TYPE_NAMES = {JOIN: "JOIN", JOIN_ACK: "JOIN_ACK", DATA: "DATA", RESULT: "RESULT", STATUS: "STATUS",
              LEAVE: "LEAVE", REFUSED: "REFUSED", STATS: "STATS"}

# Entry flags.
HAS_DATA = 0x0001

# Block-index sentinels (uint32).
END = 0xFFFFFFFF    # "no further non-zero block in this column"
BOOT = 0xFFFFFFFE   # the bootstrap round of a column: header-only, carries only next indices
MAX_BLOCKS = BOOT   # block indices must be below this

NO_EXP = -32768     # exponent of a zero block / of "no block" (int16 minimum)
INT_EXP = 0x7FFF    # exponent field of raw int32 data (no scaling)

MAX_WORLD = 32      # the per-slot contributor bitmap is 32 bits wide
MAX_DATAGRAM = 65507  # the UDP payload limit over IPv4

PACKET_HEADER = np.dtype([
    ("version", "u1"), ("type", "u1"), ("job", ">u2"), ("rank", ">u2"), ("world", ">u2"),
    ("epoch", ">u4"), ("tensor_blocks", ">u4"), ("block_size", ">u2"), ("entries", ">u2"),
])
_NATIVE_ENTRY = np.dtype([(name, np.int64) for name in
                          ("slot", "flags", "block", "next", "exp", "next_exp")])
ENTRY_HEADER = np.dtype([
    ("slot", ">u2"), ("flags", ">u2"), ("block", ">u4"), ("next", ">u4"),
    ("exp", ">i2"), ("next_exp", ">i2"),
])
WIRE_VALUE = np.dtype(">i4")
JOIN_ACK_BODY = struct.Struct(">II")  # slots granted to this job, bitmap of joined ranks
REFUSED_BODY = struct.Struct(">III")  # jobs served, slots in use, slots in all (why the JOIN was refused)
# JOIN_ACK's tensor_blocks field (unused otherwise) carries what the aggregator understands beyond the
# switch's subset: a switch leaves it 0, so workers send LEAVE only where it is understood.
FEATURE_LEAVE = 0x1
JOIN_MAC_SIZE = 32    # a JOIN to an aggregator with a key carries HMAC-SHA256(key, its 20-byte header)
CONTROL_BODY = {JOIN: (0, JOIN_MAC_SIZE), JOIN_ACK: (JOIN_ACK_BODY.size,), LEAVE: (0,),
                REFUSED: (REFUSED_BODY.size,), STATS: None}   # None: any length (a reply is UTF-8 JSON)


def join_mac(key: bytes, header: bytes) -> bytes:
    """The HMAC a JOIN carries when workers and aggregator share a key (docs/protocol.md, "Admission")."""
    return hmac.new(key, header[:PACKET_HEADER_SIZE], hashlib.sha256).digest()

assert PACKET_HEADER.itemsize == 20 and ENTRY_HEADER.itemsize == 16
PACKET_HEADER_SIZE = PACKET_HEADER.itemsize
ENTRY_SIZE = ENTRY_HEADER.itemsize
AGGREGATOR_RANK = 0xFFFF  # `rank` of packets the aggregator sends


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
        self.has = self.flags.astype(bool)      # valid once decode has checked flags <= HAS_DATA
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


HEADER = struct.Struct(">BBHHHIIHH")   # the packet header's fields, for parsing without numpy
_EMPTY_ROWS = np.zeros((0, 0), WIRE_VALUE)


def parse_header(datagram) -> tuple | None:
    """(type, job, rank, world, epoch, tensor_blocks, block_size, entries) of a datagram of this
    protocol version, or None for one too short or of another version."""
    if len(datagram) < PACKET_HEADER_SIZE:
        return None
    version, *fields = HEADER.unpack_from(datagram)
    return tuple(fields) if version == VERSION else None


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
    # The entry rules are checked by the same compiled code the machines run on every datagram.
    from . import kernels
    raw = np.frombuffer(mv, np.uint8)
    reason, rows = kernels.check_entries(raw, n, nent, bsize, tblocks, 0x10000, np.zeros(0x10000, np.int64), 1,
                                         ptype in (DATA, RESULT))
    if reason:
        raise ProtocolError(kernels.DROP_REASONS[reason].removeprefix("drop_"),
                            _REASON_TEXT[kernels.DROP_REASONS[reason]])
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
