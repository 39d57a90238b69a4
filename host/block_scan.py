"""The block scan: one compiled pass over a tensor's bits finds its non-zero blocks and their exponents
(zerosum.blocks.scan is its Python face). It reads each value from memory once, at a streaming read's
speed for dense and sparse data alike, and rejects NaN and infinity, which fixed point cannot carry.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .wire import INT_EXP, JIT, NO_EXP

_MAGNITUDE = np.int32(0x7FFFFFFF)
_NOT_FINITE = np.int32(0x7F800000)   # magnitudes (as bits) from infinity's up are infinity or NaN


@njit(inline="always", **JIT)
def _largest_magnitude(x):
    """The largest `bits & 0x7FFFFFFF` of the float32 bits x: the bits of the largest magnitude."""
    m = np.int32(0)
    for i in range(x.shape[0]):
        m = max(m, np.int32(x[i] & _MAGNITUDE))
    return m


@njit(inline="always", **JIT)
def _block_exponent(x, is_int):
    """frexp exponent of the largest magnitude in the block x (INT_EXP for non-zero int32 data), NO_EXP
    for a zero block, or INT_EXP + 1 for a block holding NaN or infinity.

    One reduction over the block's int32 bits: a float's magnitude orders like its bits without the
    sign, so the largest `bits & 0x7FFFFFFF` is the block's largest magnitude (0 for a zero block, -0.0
    included), and an int32 block is non-zero where the OR of its values is. Every step is cast back to
    int32: under numba's integer widening the int64 form did not vectorise, and the scan then spent four
    times a streaming read's time on a dense block in the cache (an OR pass to find the block non-zero,
    then this maximum). x is a slice indexed from 0: with `lo + i` numba must allow for negative
    indices, which stops LLVM from vectorising the loops."""
    if is_int:
        o = np.int32(0)
        for i in range(x.shape[0]):
            o = np.int32(o | x[i])
        return INT_EXP if o != 0 else NO_EXP
    return _float_exponent(_largest_magnitude(x))


@njit(**JIT)
def _float_exponent(m):
    """frexp exponent of the float32 magnitude with bits m; NO_EXP for 0, INT_EXP + 1 for NaN/inf."""
    if m == 0:
        return NO_EXP
    if m >= _NOT_FINITE:
        return INT_EXP + 1
    biased = np.int64(m) >> 23
    if biased > 0:
        return biased - 126
    mant = np.int64(m)     # subnormal: frexp's exponent from the mantissa's bit length
    length = 0
    while mant:
        length += 1
        mant >>= 1
    return np.int64(length - 149)


# Blocks of float data that one pass looks at together before looking at them one by one.
SCAN_GROUP = 16


@njit(inline="always", **JIT)
def _scan_one_by_one(bits, first, stop, block_size, is_int, blocks_out, exps_out, count):
    """scan_blocks over blocks first..stop-1, each reduced on its own (the last may be partial), after
    `count` blocks found: (count, the block holding NaN or infinity, or -1)."""
    n = bits.shape[0]
    for blk in range(first, stop):
        lo = blk * block_size
        e = _block_exponent(bits[lo: min(lo + block_size, n)], is_int)
        if e == NO_EXP:
            continue
        if e == INT_EXP + 1:
            return count, blk
        blocks_out[count] = blk
        exps_out[count] = e
        count += 1
    return count, -1


@njit(inline="always", **JIT)
def _scan_float_groups(bits, block_size, blocks_out, exps_out):
    """scan_blocks over the whole groups of SCAN_GROUP full blocks of float data: (count, the block
    holding NaN or infinity or -1, the first block not scanned).
    A group after one with no non-zero block is first reduced as one span, and skipped if that is zero
    (sparse data: one long vectorised loop); the blocks of others are reduced one after another, so that
    memory is read as one stream. Four blocks in one loop over four streams (to pay the per-block
    horizontal maximum once per four) read dense data at a third of a streaming read's speed on this
    machine kind in a later sitting (9.5 ms for 100 MB, numpy's OR reduce 3.3; at 1 % 3.9 against
    3.2), where block by block reads at 3.9 and 3.6 ms."""
    count = 0
    groups = (bits.shape[0] // block_size) // SCAN_GROUP
    dense = False
    for g in range(groups):
        first = g * SCAN_GROUP
        if not dense and _largest_magnitude(bits[first * block_size: (first + SCAN_GROUP) * block_size]) == 0:
            continue
        before = count
        count, bad = _scan_one_by_one(bits, first, first + SCAN_GROUP, block_size, False, blocks_out, exps_out,
                                      count)
        if bad >= 0:
            return count, bad, bad
        dense = count > before
    return count, -1, groups * SCAN_GROUP


@njit(**JIT)
def scan_blocks(bits, block_size, is_int, blocks_out, exps_out):
    """Find the non-zero blocks of a flat float32/int32 tensor seen as int32 `bits`.

    Writes their indices and exponents (frexp of the largest magnitude; INT_EXP for int32 data) and
    returns (count, first block holding NaN or infinity, or -1). Each value comes from memory once (a
    non-zero group of float data behind a zero one is read again from the cache), at a streaming read's
    speed for dense and sparse data alike (float data in groups: _scan_float_groups; the blocks after the
    last whole group, and int32 data, one by one). Asking for the block behind a zero block
    (transport.prefetch), which an earlier two-pass scan needed, made this one a third slower.
    """
    nblocks = (bits.shape[0] + block_size - 1) // block_size
    count = 0
    rest = 0
    if not is_int:
        count, bad, rest = _scan_float_groups(bits, block_size, blocks_out, exps_out)
        if bad >= 0:
            return count, bad
    return _scan_one_by_one(bits, rest, nblocks, block_size, is_int, blocks_out, exps_out, count)
