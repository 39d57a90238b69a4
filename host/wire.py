"""The wire format in compiled code: big-endian field readers and writers, and the stateless checks.

Field offsets come from zerosum.spec (tests/test_spec.py checks them like every other copy), so the
data path reads the headers docs/protocol.md declares. Imports go one way: spec <- wire <- the worker's
and the aggregator's kernels <- their machines.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import spec

JIT = dict(cache=True, nogil=True)

HDR = spec.PACKET_HEADER.size
ENT = spec.ENTRY_HEADER.size
# The kernels read and write a datagram's values as 32-bit words of one view of it: every value then
# starts at a multiple of 4 bytes.
if HDR % 4 or ENT % 4:
    raise ImportError(f"the packet header ({HDR} bytes) and entry header ({ENT}) must be multiples of 4 bytes")
_H, _E = spec.PACKET_HEADER.offset, spec.ENTRY_HEADER.offset
# packet header
H_VERSION, H_TYPE, H_JOB, H_RANK, H_WORLD = _H("version"), _H("type"), _H("job"), _H("rank"), _H("world")
H_EPOCH, H_TENSOR_BLOCKS = _H("epoch"), _H("tensor_blocks")
H_BLOCK_SIZE, H_ENTRIES = _H("block_size"), _H("entries")
# entry header
E_SLOT, E_FLAGS, E_BLOCK, E_NEXT, E_EXP, E_NEXT_EXP = (_E(n) for n in spec.ENTRY_HEADER.names)

VERSION = np.int64(spec.VERSION)
DATA, RESULT, STATUS, JOIN_ACK = (np.int64(spec.TYPES[t]) for t in ("DATA", "RESULT", "STATUS", "JOIN_ACK"))
KNOWN_TYPES = np.array(sorted(spec.TYPES.values()), np.int64)
END = np.int64(spec.END)
BOOT = np.int64(spec.BOOT)
NO_EXP = np.int64(spec.NO_EXP)
INT_EXP = np.int64(spec.INT_EXP)
HAS_DATA = np.int64(spec.HAS_DATA)
CONGESTION = np.int64(spec.CONGESTION)
DATA_FLAGS, REPLY_FLAGS = np.int64(spec.DATA_FLAGS), np.int64(spec.REPLY_FLAGS)
AGGREGATOR_RANK = np.int64(spec.AGGREGATOR_RANK)
MAX_DATAGRAM = spec.MAX_DATAGRAM
MAX_BLOCKS = np.int64(spec.BOOT)     # block indices must be below BOOT


@njit(**JIT)
def get16(b, i):
    return (np.int64(b[i]) << 8) | np.int64(b[i + 1])


@njit(**JIT)
def get32(b, i):
    return (np.int64(b[i]) << 24) | (np.int64(b[i + 1]) << 16) | (np.int64(b[i + 2]) << 8) | np.int64(b[i + 3])


@njit(**JIT)
def get_s16(b, i):
    v = get16(b, i)
    return v - 65536 if v >= 32768 else v


@njit(**JIT)
def put16(b, i, v):
    b[i] = (v >> 8) & 0xFF
    b[i + 1] = v & 0xFF


@njit(**JIT)
def put32(b, i, v):
    b[i] = (v >> 24) & 0xFF
    b[i + 1] = (v >> 16) & 0xFF
    b[i + 2] = (v >> 8) & 0xFF
    b[i + 3] = v & 0xFF


@njit(**JIT)
def put_header(b, pos, ptype, job, rank, world, epoch, tensor_blocks, block_size, entries):
    b[pos + H_VERSION] = VERSION
    b[pos + H_TYPE] = ptype
    put16(b, pos + H_JOB, job)
    put16(b, pos + H_RANK, rank)
    put16(b, pos + H_WORLD, world)
    put32(b, pos + H_EPOCH, epoch)
    put32(b, pos + H_TENSOR_BLOCKS, tensor_blocks)
    put16(b, pos + H_BLOCK_SIZE, block_size)
    put16(b, pos + H_ENTRIES, entries)


@njit(inline="always", **JIT)
def read_entry(b, e):
    """The entry header at offset e: (slot, has data, block, next, exp, next_exp)."""
    return get16(b, e + E_SLOT), (get16(b, e + E_FLAGS) & HAS_DATA) != 0, get32(b, e + E_BLOCK), \
        get32(b, e + E_NEXT), get_s16(b, e + E_EXP), get_s16(b, e + E_NEXT_EXP)


@njit(**JIT)
def put_entry(b, pos, slot, flags, block, nxt, exp, next_exp):
    put16(b, pos + E_SLOT, slot)
    put16(b, pos + E_FLAGS, flags)
    put32(b, pos + E_BLOCK, block)
    put32(b, pos + E_NEXT, nxt)
    put16(b, pos + E_EXP, exp & 0xFFFF)
    put16(b, pos + E_NEXT_EXP, next_exp & 0xFFFF)


# -- entry validation (docs/protocol.md, "Validation": R-V4, R-V5, R-V10) -------------------------------

# Reasons a datagram is dropped, in the aggregator's counter names (index into DROP_REASONS).
OK = 0
DROP_LENGTH, DROP_FLAGS, DROP_EXPONENT, DROP_RANGE = 1, 2, 3, 4
DROP_REASONS = ("", "drop_length", "drop_flags", "drop_exponent", "drop_range")


@njit(**JIT)
def check_entries(b, n, nent, block_size, tensor_blocks, ranges, allowed):
    """The stateless rules of a DATA/RESULT/STATUS datagram's entries; return (reason, data rows, the
    entries' flags ORed together).

    R-V4: the entry headers fit, no flag bits but the `allowed` ones (DATA_FLAGS in DATA, REPLY_FLAGS in
    RESULT and STATUS), the exact length. R-V5 (with `ranges`: DATA and
    RESULT; in a STATUS `next` is a bitmap), entry by entry: no data on BOOT, an exponent with data, block
    and next in range. The flags come from the same pass, so a worker learns whether a reply carries
    CONGESTION (R-E1) without reading the entries again.
    """
    end_of_headers = HDR + nent * ENT
    if block_size == 0 or n < end_of_headers:
        return DROP_LENGTH, 0, 0
    rows = 0
    any_flags = 0
    for i in range(nent):
        flags = get16(b, HDR + i * ENT + E_FLAGS)
        if flags & ~allowed:
            return DROP_FLAGS, 0, 0
        rows += flags & HAS_DATA
        any_flags |= flags
    if n != end_of_headers + rows * block_size * 4:
        return DROP_LENGTH, 0, any_flags
    if not ranges:
        return OK, rows, any_flags
    if tensor_blocks > MAX_BLOCKS:
        return DROP_RANGE, rows, any_flags
    for i in range(nent):
        _, has, block, nxt, exp, _ = read_entry(b, HDR + i * ENT)
        real = block != BOOT
        if has and not real:
            return DROP_FLAGS, rows, any_flags
        if has and exp == NO_EXP:
            return DROP_EXPONENT, rows, any_flags
        if real and block >= tensor_blocks:
            return DROP_RANGE, rows, any_flags
        if nxt != END and (nxt >= tensor_blocks or (real and nxt <= block)):
            return DROP_RANGE, rows, any_flags
    return OK, rows, any_flags


@njit(**JIT)
def check_slots(b, nent, slot_limit, seen, stamp):
    """R-V10: every slot below the job's `slot_limit`, and named once per datagram (else DROP_RANGE).

    `seen[slot] == stamp` marks slots named earlier in this datagram; the caller passes a fresh stamp per
    datagram, so `seen` never needs clearing.
    """
    for i in range(nent):
        slot = get16(b, HDR + i * ENT + E_SLOT)
        if slot >= slot_limit or seen[slot] == stamp:
            return DROP_RANGE
        seen[slot] = stamp
    return OK


@njit(inline="always", **JIT)
def swap32(q):
    """A uint32 from native to network byte order or back (inlined, so loops around it vectorise)."""
    return (q << np.uint32(24)) | ((q & np.uint32(0xFF00)) << np.uint32(8)) | \
        ((q >> np.uint32(8)) & np.uint32(0xFF00)) | (q >> np.uint32(24))


@njit(**JIT)
def copy_swapped(src, base, count, words):
    """int32/uint32 values src[base:base+count] into network-order words."""
    x = src[base: base + count]
    for v in range(count):
        q = np.uint32(x[v])
        words[v] = swap32(q)


@njit(**JIT)
def store_swapped(words, count, out, dst):
    """Network-order words[:count] into int32 values out[dst:dst+count] (copy_swapped's inverse: a
    worker storing an int32 sum, an aggregator writing a round's first data)."""
    o = out[dst: dst + count]
    for v in range(count):
        o[v] = np.int32(swap32(words[v]))
