"""Compiled per-datagram and per-entry work: the block scan, and both ends of the data path.

Everything that runs once per datagram or per entry is a numba kernel over raw buffers and state
arrays, called by the pure state machines (worker_machine, aggregator_machine), which keep the control
flow per allreduce and stay free of I/O. The kernels read and write the wire format of
docs/protocol.md directly (big-endian fields at the offsets of protocol.PACKET_HEADER and
protocol.ENTRY_HEADER), so a datagram is never turned into Python objects:

- scan_blocks: one pass over a tensor's bits finds the non-zero blocks and their exponents.
- encode_data: the worker's next round for the ready columns, quantised straight from the tensor
  into datagrams (fused by bytes, cut per aggregator).
- apply_datagram: the worker's RESULT/STATUS handling, dequantised straight into the output.
- contribute: the aggregator's validation and slot update for one DATA datagram.
- encode_slots: the aggregator's RESULT and STATUS datagrams for a list of slots.

Fixed point (docs/protocol.md, "Fixed point"): q = round_half_even(x * 2**(p - e)) is computed in
float64, where x * 2**s is exact for every float32 x and every shift a block can need, so it equals the
exact float32 scaling of the rule; the result is float32(float32(sum) * 2**(e - p)), one rounding,
which is what np.ldexp gives. Powers of two are built with math.ldexp (exact on every CPU).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import protocol as P

END = np.int64(P.END)
BOOT = np.int64(P.BOOT)
NO_EXP = np.int64(P.NO_EXP)
INT_EXP = np.int64(P.INT_EXP)
HAS_DATA = np.int64(P.HAS_DATA)
HDR = P.PACKET_HEADER_SIZE
ENT = P.ENTRY_SIZE
VERSION = np.int64(P.VERSION)
AGGREGATOR_RANK = np.int64(P.AGGREGATOR_RANK)

JIT = dict(cache=True, nogil=True)


# -- big-endian fields --------------------------------------------------------------------------------

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
    b[pos] = VERSION
    b[pos + 1] = ptype
    put16(b, pos + 2, job)
    put16(b, pos + 4, rank)
    put16(b, pos + 6, world)
    put32(b, pos + 8, epoch)
    put32(b, pos + 12, tensor_blocks)
    put16(b, pos + 16, block_size)
    put16(b, pos + 18, entries)


@njit(inline="always", **JIT)
def read_entry(b, e):
    """The entry header at offset e: (slot, has data, block, next, exp, next_exp)."""
    return get16(b, e), get16(b, e + 2) != 0, get32(b, e + 4), get32(b, e + 8), get_s16(b, e + 12), \
        get_s16(b, e + 14)


@njit(**JIT)
def put_entry(b, pos, slot, flags, block, nxt, exp, next_exp):
    put16(b, pos, slot)
    put16(b, pos + 2, flags)
    put32(b, pos + 4, block)
    put32(b, pos + 8, nxt)
    put16(b, pos + 12, exp & 0xFFFF)
    put16(b, pos + 14, next_exp & 0xFFFF)


# -- entry validation (docs/protocol.md, "Validation": R-V4, R-V5, R-V10) -------------------------------

# Reasons a datagram is dropped, in the aggregator's counter names (index into DROP_REASONS).
OK = 0
DROP_LENGTH, DROP_FLAGS, DROP_EXPONENT, DROP_RANGE = 1, 2, 3, 4
DROP_REASONS = ("", "drop_length", "drop_flags", "drop_exponent", "drop_range")


@njit(**JIT)
def check_entries(b, n, nent, block_size, tensor_blocks, ranges):
    """The stateless rules of a DATA/RESULT/STATUS datagram's entries; return (reason, data rows).

    R-V4: the entry headers fit, no unknown flag bits, the exact length. R-V5 (with `ranges`: DATA and
    RESULT; in a STATUS `next` is a bitmap), entry by entry: no data on BOOT, an exponent with data, block
    and next in range.
    """
    end_of_headers = HDR + nent * ENT
    if block_size == 0 or n < end_of_headers:
        return DROP_LENGTH, 0
    rows = 0
    for i in range(nent):
        if get16(b, HDR + i * ENT + 2) & 0xFFFE:
            return DROP_FLAGS, 0
        rows += get16(b, HDR + i * ENT + 2)
    if n != end_of_headers + rows * block_size * 4:
        return DROP_LENGTH, 0
    if not ranges:
        return OK, rows
    if tensor_blocks > P.MAX_BLOCKS:
        return DROP_RANGE, rows
    for i in range(nent):
        e = HDR + i * ENT
        has = get16(b, e + 2)
        block = get32(b, e + 4)
        nxt = get32(b, e + 8)
        real = block != BOOT
        if has and not real:
            return DROP_FLAGS, rows
        if has and get_s16(b, e + 12) == NO_EXP:
            return DROP_EXPONENT, rows
        if real and block >= tensor_blocks:
            return DROP_RANGE, rows
        if nxt != END and (nxt >= tensor_blocks or (real and nxt <= block)):
            return DROP_RANGE, rows
    return OK, rows


@njit(**JIT)
def check_slots(b, nent, slot_limit, seen, stamp):
    """R-V10: every slot below the job's `slot_limit`, and named once per datagram (else DROP_RANGE).

    `seen[slot] == stamp` marks slots named earlier in this datagram; the caller passes a fresh stamp per
    datagram, so `seen` never needs clearing.
    """
    for i in range(nent):
        slot = get16(b, HDR + i * ENT)
        if slot >= slot_limit or seen[slot] == stamp:
            return DROP_RANGE
        seen[slot] = stamp
    return OK


# -- the block scan -------------------------------------------------------------------------------------

@njit(**JIT)
def _block_exponent(bits, lo, hi, is_int):
    """frexp exponent of the largest magnitude in bits[lo:hi] (INT_EXP for non-zero int32 data), NO_EXP
    for a zero block, or INT_EXP + 1 for a block holding NaN or infinity."""
    if is_int:
        o = np.int64(0)
        for i in range(lo, hi):
            o |= np.int64(bits[i])
        return INT_EXP if o != 0 else NO_EXP
    m = np.int32(0)
    for i in range(lo, hi):
        v = bits[i] & np.int32(0x7FFFFFFF)
        m = v if v > m else m
    return _float_exponent(m)


@njit(**JIT)
def _float_exponent(m):
    """frexp exponent of the float32 magnitude with bits m; NO_EXP for 0, INT_EXP + 1 for NaN/inf."""
    if m == 0:
        return NO_EXP
    if m >= np.int32(0x7F800000):
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


@njit(**JIT)
def scan_blocks(bits, words, block_size, is_int, blocks_out, exps_out):
    """Find the non-zero blocks of a flat float32/int32 tensor seen as int32 `bits`.

    Writes their indices and exponents (frexp of the largest magnitude; INT_EXP for int32 data) and
    returns (count, first block holding NaN or infinity, or -1). A float's magnitude orders like its
    bits without the sign, so the largest `bits & 0x7FFFFFFF` is the block's largest magnitude, and
    -0.0 counts as zero. `words` is the same memory as uint64 (or empty when the block size is odd or
    the buffer unaligned): an OR over it skips zero blocks at memory speed (an int32 OR loop does not
    vectorise under numba's integer widening); only non-zero blocks are read again for their maximum.
    """
    n = bits.shape[0]
    nblocks = (n + block_size - 1) // block_size
    half = block_size // 2
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) if is_int else np.uint64(0x7FFFFFFF7FFFFFFF)
    fast_blocks = n // block_size if words.shape[0] > 0 else 0
    count = 0
    for blk in range(nblocks):
        # (loops over slices indexed from 0: with `start + i` numba must allow for negative indices,
        # which stops LLVM from vectorising them)
        if blk < fast_blocks:
            w = words[blk * half: blk * half + half]
            o = np.uint64(0)
            for i in range(half):
                o |= w[i]
            if (o & mask) == 0:
                continue
        lo = blk * block_size
        x = bits[lo: min(lo + block_size, n)]
        if is_int:
            e = _block_exponent(x, 0, x.shape[0], is_int)
        else:
            m = np.int32(0)
            for i in range(x.shape[0]):
                v = x[i] & np.int32(0x7FFFFFFF)
                m = v if v > m else m
            e = _float_exponent(m)
        if e == NO_EXP:
            continue
        if e == INT_EXP + 1:
            return count, blk
        blocks_out[count] = blk
        exps_out[count] = e
        count += 1
    return count, -1


# -- the worker's data path -----------------------------------------------------------------------------


# Per-value loops, each on its own so that LLVM vectorises them (no branches inside; the byte swap is
# written out so that it becomes a shuffle). They compute in float32 where that is exact: x * 2**s is
# exact in float32 while the product is a normal number (and a product that is not rounds to 0 either
# way), and float32(sum) * 2**s rounds once, as np.ldexp does; shifts beyond float32's exponent range
# take float64, where the same operations are exact until the final rounding.
_F32_LO, _F32_HI = -126, 127


@njit(inline="always", **JIT)
def _swap(q):
    """A uint32 from native to network byte order or back (inlined, so loops around it vectorise)."""
    return (q << np.uint32(24)) | ((q & np.uint32(0xFF00)) << np.uint32(8)) | \
        ((q >> np.uint32(8)) & np.uint32(0xFF00)) | (q >> np.uint32(24))


@njit(**JIT)
def _quantize_swapped(src, base, count, shift, words):
    # Index slices from 0: with `base + v` numba must allow for negative indices, which stops LLVM
    # from vectorising the loop (5x slower).
    x = src[base: base + count]
    if _F32_LO <= shift <= _F32_HI:
        scale = np.float32(math.ldexp(1.0, shift))
        for v in range(count):
            q = np.uint32(np.int32(np.rint(x[v] * scale)))
            words[v] = _swap(q)
    else:
        scale64 = math.ldexp(1.0, shift)
        for v in range(count):
            q = np.uint32(np.int32(np.rint(np.float64(x[v]) * scale64)))
            words[v] = _swap(q)


@njit(**JIT)
def _copy_swapped(src, base, count, words):
    x = src[base: base + count]
    for v in range(count):
        q = np.uint32(x[v])
        words[v] = _swap(q)


@njit(**JIT)
def _store_ints(words, count, out, dst):
    o = out[dst: dst + count]
    for v in range(count):
        w = words[v]
        o[v] = np.int32(_swap(w))


@njit(**JIT)
def _store_floats(words, count, shift, divisor, out, dst):
    o = out[dst: dst + count]
    if -149 <= shift <= _F32_HI:
        scale = np.float32(math.ldexp(1.0, shift))
        if divisor == 1:
            for v in range(count):
                w = words[v]
                s = np.int32(_swap(w))
                o[v] = np.float32(s) * scale
        else:
            for v in range(count):
                w = words[v]
                s = np.int32(_swap(w))
                o[v] = (np.float32(s) * scale) / divisor
    else:
        scale64 = math.ldexp(1.0, shift)
        for v in range(count):
            w = words[v]
            s = np.int32(_swap(w))
            o[v] = np.float32(np.float64(np.float32(s)) * scale64) / divisor


@njit(**JIT)
def _add_swapped(words, acc):
    for v in range(acc.shape[0]):
        w = words[v]
        acc[v] += np.int32(_swap(w))


@njit(**JIT)
def _mine(seq, mine_pos, col_stop, c, ahead):
    pos = mine_pos[c] + ahead
    return seq[pos] if pos < col_stop[c] else END


@njit(**JIT)
def _mine_exp(seq_exp, mine_pos, col_stop, c, ahead):
    pos = mine_pos[c] + ahead
    return np.int64(seq_exp[pos]) if pos < col_stop[c] else NO_EXP


@njit(**JIT)
def encode_data(out, cuts, cols, ncols, aggregators, hdr, round_block, round_exp, mine_pos, col_stop,
                seq, seq_exp, seq_row, src, src_n, is_int, precision, max_bytes, max_entries):
    """Build the DATA datagrams of one round for `cols[:ncols]` (grouped by aggregator) into `out`.

    hdr = (job, rank, world, epoch, tensor_blocks, block_size). Entry per column: the data of its
    round's block if that is the worker's own next non-zero block, header-only otherwise, and the
    worker's next non-zero block after it (docs/protocol.md, "A round"). Datagrams are cut by bytes
    (and `max_entries`) and per aggregator; cuts[k] = (aggregator, start, end) in `out`.
    Data comes from `src` (flat values, `src_n` of them valid): row `seq_row[pos]` of it for the
    worker's block at `seq[pos]`; rows past src_n are zero padding. Returns the number of datagrams.
    """
    B = hdr[5]
    per_data = B * 4
    budget = min(max_bytes, P.MAX_DATAGRAM) - HDR
    nd = 0
    pos = 0
    i = 0
    while i < ncols:
        agg = cols[i] % aggregators
        # how many of the following columns fit in one datagram
        j = i
        used = 0
        rows = 0
        while j < ncols and cols[j] % aggregators == agg and j - i < max_entries:
            c = cols[j]
            has = _mine(seq, mine_pos, col_stop, c, 0) == round_block[c]
            cost = ENT + (per_data if has else 0)
            if used + cost > budget and j > i:
                break
            used += cost
            rows += 1 if has else 0
            j += 1
        put_header(out, pos, P.DATA, hdr[0], hdr[1], hdr[2], hdr[3], hdr[4], B, j - i)
        e = pos + HDR
        d = e + (j - i) * ENT
        for k in range(i, j):
            c = cols[k]
            block = round_block[c]
            mine = _mine(seq, mine_pos, col_stop, c, 0)
            has = mine == block
            if has:
                nxt = _mine(seq, mine_pos, col_stop, c, 1)
                nexp = _mine_exp(seq_exp, mine_pos, col_stop, c, 1)
            else:
                nxt = mine
                nexp = _mine_exp(seq_exp, mine_pos, col_stop, c, 0)
            put_entry(out, e, c // aggregators, HAS_DATA if has else 0, block, nxt, round_exp[c], nexp)
            e += ENT
            if has:
                base = seq_row[mine_pos[c]] * B
                words = out[d: d + per_data].view(np.uint32)
                valid = max(0, min(B, src_n - base))    # a short last block is zero-padded
                if is_int:
                    _copy_swapped(src, base, valid, words)
                else:
                    _quantize_swapped(src, base, valid, precision - round_exp[c], words)
                words[valid:] = 0
                d += per_data
        cuts[nd, 0] = agg
        cuts[nd, 1] = pos
        cuts[nd, 2] = d
        nd += 1
        pos = d
        i = j
    return nd


# apply_datagram's outcome codes (besides the DROP_* reasons, negated).
APPLIED = 0
VIOLATION_NO_DATA, VIOLATION_EXPONENT, VIOLATION_DTYPE, VIOLATION_SKIP = 1, 2, 3, 4


@njit(**JIT)
def apply_datagram(b, n, ptype, nent, aggregator, aggregators, slots_used, hdr, is_int, precision, divisor,
                   round_block, round_exp, mine_pos, col_stop, seq, ready, deadline, rto, sent_at,
                   waiting_for, status_seen, base_rto, max_rto, now, out_values, out_n, collect,
                   out_blocks, counts, seen, stamp):
    """Apply one RESULT or STATUS datagram from `aggregator` to the worker's column state.

    RESULT entries for a column's current round store their sums (dequantised, divided by `divisor`
    when averaging) in `out_values` (block b at b*B, or, with `collect`, at the next free row, its block
    in out_blocks; counts[1] rows used), advance the column and mark it ready (counts[2] counts columns
    that reached END); other RESULT entries are duplicates (counts[0]). STATUS entries record who the aggregator has heard (docs/protocol.md,
    "Loss recovery"). Returns (code, largest round-trip sample or -1, bad block): code 0, a protocol
    violation (VIOLATION_*, the datagram is not applied further), or -DROP_* when malformed.
    """
    B = hdr[5]
    reason, rows = check_entries(b, n, nent, B, hdr[4], ptype != P.STATUS)
    if reason == OK:
        reason = check_slots(b, nent, slots_used, seen, stamp)
    if reason != OK:
        return -reason, -1.0, 0
    rtt = -1.0
    row = 0
    data0 = HDR + nent * ENT
    for i in range(nent):
        slot, has, block, nxt, exp, nexp = read_entry(b, HDR + i * ENT)
        c = slot * aggregators + aggregator
        at = data0 + row * B * 4
        if has:
            row += 1
        if ptype == P.STATUS:
            if block == round_block[c]:
                waiting_for[c] = nxt
                status_seen[c] = True
                # the aggregator holds our contribution and waits for others: no need to resend soon
                rto[c] = min(rto[c] * 2, max_rto)
                deadline[c] = max(deadline[c], now + rto[c])
            continue
        if block != round_block[c]:
            counts[0] += 1
            continue
        mine = _mine(seq, mine_pos, col_stop, c, 0)
        sent_data = mine == block
        if sent_data and not has:
            return VIOLATION_NO_DATA, rtt, block
        if has and exp != round_exp[c]:
            return VIOLATION_EXPONENT, rtt, block
        if nxt != END and (nexp == INT_EXP) != is_int:
            return VIOLATION_DTYPE, rtt, block
        if has:
            words = b[at: at + B * 4].view(np.uint32)
            if collect:
                dst = counts[1] * B
                out_blocks[counts[1]] = block
                counts[1] += 1
                limit = dst + B
            else:
                dst = block * B
                limit = min(dst + B, out_n)
            if is_int:
                _store_ints(words, limit - dst, out_values, dst)
            else:
                _store_floats(words, limit - dst, exp - precision, divisor, out_values, dst)
        if sent_data:
            mine_pos[c] += 1
        if nxt > _mine(seq, mine_pos, col_stop, c, 0):
            return VIOLATION_SKIP, rtt, block
        round_block[c] = nxt
        round_exp[c] = nexp
        if not math.isnan(sent_at[c]):
            rtt = max(rtt, now - sent_at[c])
        rto[c] = base_rto
        status_seen[c] = False
        deadline[c] = np.inf
        if nxt != END:
            ready[c] = True
        else:
            counts[2] += 1
    return APPLIED, rtt, 0


@njit(**JIT)
def take_ready(ready, cols, aggregators, deadline, sent_at, rto, now, round_block, admitted):
    """The ready columns, grouped by aggregator (in `cols`), with their timers started; returns the count.
    Columns from `admitted` on stay ready unless their round is the bootstrap (the worker's window)."""
    S = ready.shape[0]
    k = 0
    for a in range(aggregators):
        for c in range(a, S, aggregators):
            if ready[c] and (c < admitted or round_block[c] == BOOT):
                ready[c] = False
                cols[k] = c
                deadline[c] = now + rto[c]
                sent_at[c] = now
                k += 1
    return k


@njit(**JIT)
def admit(round_block, admitted, window):
    """The worker's window: columns are admitted in index order, the same on every worker, and stay
    admitted; return the shortest prefix (at least `admitted`) holding `window` columns that have not
    reached END, or all of them."""
    S = round_block.shape[0]
    open_ = 0
    for c in range(admitted):
        if round_block[c] != END:
            open_ += 1
    while admitted < S and open_ < window:
        if round_block[admitted] != END:
            open_ += 1
        admitted += 1
    return admitted


@njit(**JIT)
def take_expired(round_block, cols, aggregators, deadline, sent_at, rto, allow, max_rto, now):
    """The columns whose timer expired, at most allow[a] of aggregator a, grouped by aggregator, with
    doubled timeouts and no round-trip sample from them (Karn's rule); returns the count."""
    S = round_block.shape[0]
    k = 0
    for a in range(aggregators):
        taken = 0
        for c in range(a, S, aggregators):
            if taken >= allow[a]:
                break
            if round_block[c] != END and deadline[c] <= now:
                taken += 1
                rto[c] = min(rto[c] * 2, max_rto)
                cols[k] = c
                deadline[c] = now + rto[c]
                sent_at[c] = np.nan
                k += 1
    return k


@njit(**JIT)
def next_timer(round_block, deadline, aggregators, last_heard, base_rto, probe, loss_confirmed):
    """When the worker's timers next need a look: per aggregator, the earliest timer of its columns
    still in progress, once the aggregator has been quiet for base_rto; with a probe out, the probe's
    own timer; after a confirmed loss, the earliest timer (docs/protocol.md, "Loss recovery")."""
    first = np.full(aggregators, np.inf)
    for c in range(round_block.shape[0]):
        if round_block[c] != END and deadline[c] < first[c % aggregators]:
            first[c % aggregators] = deadline[c]
    t = np.inf
    for a in range(aggregators):
        if probe[a] >= 0:
            d = deadline[probe[a]]
        elif loss_confirmed[a]:
            d = first[a]
        else:
            d = max(first[a], last_heard[a] + base_rto)
        t = min(t, d)
    return t


# -- the aggregator ---------------------------------------------------------------------------------------

# Slot registers: columns of the aggregator's `regs` array (the P4 program's register names).
(SLOT_EPOCH, SLOT_BLOCK, SLOT_EXP, SLOT_TENSOR_BLOCKS, BITMAP, COUNT, MIN_NEXT, MIN_NEXT_EXP, HAS_DATA_REG,
 PREV_EPOCH, PREV_BLOCK, PREV_NEXT, PREV_EXP, PREV_NEXT_EXP, PREV_HAS_DATA, PENDING) = range(16)
REGISTERS = ("slot_epoch", "slot_block", "slot_exp", "slot_tensor_blocks", "bitmap", "count", "min_next",
             "min_next_exp", "has_data", "prev_epoch", "prev_block", "prev_next", "prev_exp", "prev_next_exp",
             "prev_has_data", "pending")
# slot_epoch -1: a slot no BOOT of this run has started (no 32-bit epoch equals it), so the run's first
# BOOT starts it whatever its epoch, as a new generation does on the switch (R-A1).
REGISTER_RESET = (-1, P.END, P.NO_EXP, 0, 0, 0, P.END, P.NO_EXP, 0, 0, P.END, P.END, P.NO_EXP, P.NO_EXP, 0, 0)


@njit(**JIT)
def _newer(a, b):
    """Serial-number comparison of 32-bit epochs (RFC 1982): a is after b."""
    d = (a - b) & 0xFFFFFFFF
    return d != 0 and d < 0x80000000


@njit(**JIT)
def contribute(b, n, nent, epoch, tensor_blocks, rank, world, block_size, regs, acc, shadow, seen, stamp,
               done, counts, replies):
    """One DATA datagram from a member: validate it, then add its entries to their slots.

    Completed rounds become the shadow copy and their slots are appended to `done` (counts[0] of them;
    a slot is listed once until the next flush). Duplicates of the current round (answered with STATUS)
    and retransmissions to the previous round (answered from the shadow copy) are listed in
    replies[0, :counts[1]] and replies[1, :counts[2]]. counts[3..5] count stale, mismatched and
    completed entries. The datagram has passed check_entries (R-V4, R-V5); this checks its slots
    (R-V10). Returns OK or DROP_RANGE (then nothing was changed).
    """
    reason = check_slots(b, nent, regs.shape[0], seen, stamp)
    if reason != OK:
        return reason
    bit = np.int64(1) << rank
    row = 0
    data0 = HDR + nent * ENT
    for i in range(nent):
        s, has, block, nxt, exp, nexp = read_entry(b, HDR + i * ENT)
        at = data0 + row * block_size * 4
        if has:
            row += 1
        r = regs[s]
        # R-A1: a bootstrap entry of a newer epoch starts the slot's next allreduce; the previous round
        # (prev_*, shadow) is kept, so a worker that lost the old epoch's last result still gets it.
        if block == BOOT and (r[SLOT_EPOCH] < 0 or _newer(epoch, r[SLOT_EPOCH])):
            r[SLOT_EPOCH] = epoch
            r[SLOT_BLOCK] = BOOT
            r[SLOT_EXP] = NO_EXP
            r[SLOT_TENSOR_BLOCKS] = tensor_blocks
            r[BITMAP] = 0
            r[COUNT] = 0
            r[MIN_NEXT] = END
            r[MIN_NEXT_EXP] = NO_EXP
            if r[HAS_DATA_REG]:    # an abandoned round left a partial sum behind
                acc[s, :] = 0
            r[HAS_DATA_REG] = 0
        if r[SLOT_EPOCH] == epoch and block == r[SLOT_BLOCK]:
            if r[BITMAP] & bit:                 # R-A2: a duplicate, answered with STATUS
                replies[0, counts[1]] = s
                counts[1] += 1
                continue
            if (has and exp != r[SLOT_EXP]) or r[SLOT_TENSOR_BLOCKS] != tensor_blocks:
                # R-A5: the worker disagrees with the slot about the block's exponent or the tensor: never add
                counts[4] += 1
                continue
            # R-A6: add it, mark the rank, count it, keep the minimum next
            if has:
                words = b[at: at + block_size * 4].view(np.uint32)
                _add_swapped(words, acc[s])
                r[HAS_DATA_REG] = 1
            r[BITMAP] |= bit
            r[COUNT] += 1
            if nxt < r[MIN_NEXT]:
                r[MIN_NEXT] = nxt
                r[MIN_NEXT_EXP] = nexp
            elif nxt == r[MIN_NEXT] and nexp > r[MIN_NEXT_EXP]:
                r[MIN_NEXT_EXP] = nexp
            if r[COUNT] == world:
                # R-A7: complete: the result becomes the shadow copy, the slot moves to the minimum next
                if r[HAS_DATA_REG]:
                    shadow[s, :] = acc[s, :]
                    acc[s, :] = 0
                r[PREV_EPOCH] = r[SLOT_EPOCH]
                r[PREV_BLOCK] = r[SLOT_BLOCK]
                r[PREV_NEXT] = r[MIN_NEXT]
                r[PREV_EXP] = r[SLOT_EXP]
                r[PREV_NEXT_EXP] = r[MIN_NEXT_EXP]
                r[PREV_HAS_DATA] = r[HAS_DATA_REG]
                r[SLOT_BLOCK] = r[MIN_NEXT]
                r[SLOT_EXP] = r[MIN_NEXT_EXP]
                r[BITMAP] = 0
                r[COUNT] = 0
                r[MIN_NEXT] = END
                r[MIN_NEXT_EXP] = NO_EXP
                r[HAS_DATA_REG] = 0
                counts[5] += 1
                if not r[PENDING]:
                    r[PENDING] = 1
                    done[counts[0]] = s
                    counts[0] += 1
        elif r[PREV_EPOCH] == epoch and block == r[PREV_BLOCK]:
            # R-A3: answered from the shadow copy, unless the round's RESULT still waits for the flush,
            # which sends it to every worker (a reply now would overtake it and look like a loss)
            if not r[PENDING]:
                replies[1, counts[2]] = s
                counts[2] += 1
        else:
            counts[3] += 1                      # R-A4: stale
    return OK


@njit(**JIT)
def encode_slots(out, cuts, slots, nslots, status, regs, shadow, hdr, max_bytes):
    """RESULT datagrams of the slots' previous rounds (from the shadow copy), or with `status`, STATUS
    datagrams of their current rounds (`next` = bitmap of the ranks heard), into `out`.

    hdr = (job, world, epoch, tensor_blocks, block_size). Cut by bytes: a result may need more datagrams
    than the contribution that completed it. cuts[k] = (start, end); returns the number of datagrams.
    """
    B = hdr[4]
    per_data = B * 4
    budget = min(max_bytes, P.MAX_DATAGRAM) - HDR
    ptype = P.STATUS if status else P.RESULT
    nd = 0
    pos = 0
    i = 0
    while i < nslots:
        j = i
        used = 0
        while j < nslots and j - i < 0xFFFF:
            has = regs[slots[j], PREV_HAS_DATA] != 0 and not status
            cost = ENT + (per_data if has else 0)
            if used + cost > budget and j > i:
                break
            used += cost
            j += 1
        put_header(out, pos, ptype, hdr[0], AGGREGATOR_RANK, hdr[1], hdr[2], hdr[3], B, j - i)
        e = pos + HDR
        d = e + (j - i) * ENT
        for k in range(i, j):
            s = slots[k]
            r = regs[s]
            if status:
                put_entry(out, e, s, 0, r[SLOT_BLOCK], r[BITMAP], NO_EXP, NO_EXP)
            else:
                has = r[PREV_HAS_DATA] != 0
                put_entry(out, e, s, HAS_DATA if has else 0, r[PREV_BLOCK], r[PREV_NEXT], r[PREV_EXP],
                          r[PREV_NEXT_EXP])
                if has:
                    words = out[d: d + per_data].view(np.uint32)
                    src = shadow[s]
                    _copy_swapped(src.view(np.uint32), 0, B, words)
                    d += per_data
            e += ENT
        cuts[nd, 0] = pos
        cuts[nd, 1] = d
        nd += 1
        pos = d
        i = j
    return nd
