"""Compiled per-datagram and per-entry work: the worker's data path (the block scan that comes before it
is zerosum.block_scan).

Everything that runs once per datagram or per entry is a numba kernel over raw buffers and state
arrays, called by the worker's pure state machine (worker_machine), which keeps the control flow per
allreduce and stays free of I/O. The kernels read and write the wire format of docs/protocol.md
directly (zerosum.wire, at the offsets zerosum.spec declares), so a datagram is never turned into
Python objects. The aggregator's kernels are in zerosum.aggregator_kernels.

- sort_by_column: the worker's own non-zero blocks (from the scan) grouped by column, once per allreduce.
- encode_data: the worker's next round for the ready columns, quantised straight from the tensor
  into datagrams (fused by bytes, cut per aggregator).
- apply_datagram: the worker's RESULT/STATUS handling, dequantised straight into the output (past the
  caches where it is larger than they are: zerosum.stores).
- drive: the worker's driver loop: batches of datagrams received, applied, and the next rounds sent.

They work on the allreduce's state record (zerosum.worker_state); which ready rounds go next and when the
timers fire is zerosum.worker_rounds, the estimates behind them (round trips, loss detection, the
congestion window, the pacer) zerosum.congestion.

Fixed point (docs/protocol.md, "Fixed point"): q = round_half_even(x * 2**(p - e)) is computed in
float64, where x * 2**s is exact for every float32 x and every shift a block can need, so it equals the
exact float32 scaling of the rule; the result is float32(float32(sum) * 2**(e - p)), one rounding,
which is what np.ldexp gives. Powers of two are built with math.ldexp (exact on every CPU).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import transport as T
from .spec import CE, ECN_MASK
from .stores import fence, stream_floats

from .wire import (H_BLOCK_SIZE, H_ENTRIES, H_EPOCH, H_JOB, H_RANK, H_TENSOR_BLOCKS, H_TYPE,
                   H_VERSION, VERSION, AGGREGATOR_RANK, BOOT, CONGESTION, DATA, END, ENT, HAS_DATA, HDR, INT_EXP, JIT,
                   JOIN_ACK, KNOWN_TYPES, MAX_DATAGRAM, RESULT, STATUS, E_SLOT, NO_EXP, OK, REPLY_FLAGS,
                   check_entries, check_slots, copy_swapped as _copy_swapped, get16, get32, put_entry, put_header,
                   read_entry, store_swapped, swap32 as _swap)
from .congestion import (
    detect_loss, drain_step, drain_timer, entries_per_datagram, measure, note_host_wait, on_mark, on_rounds,
    on_spurious, pace_budget, pace_sent, pace_timer, tail_probe_timeout)
from .worker_rounds import admit, recovery_timer, take_ready
from .worker_state import (
    ASKED, D_DUPLICATE, D_EXPONENT, D_FLAGS, D_FOREIGN, D_GEOMETRY, D_LENGTH, D_RANGE, D_SHORT, D_STALE_EPOCH,
    D_TYPE, D_UNKNOWN_SOURCE, D_VERSION, F_DIVISOR, F_LAST_PROGRESS, F_MAX_RTO,
    I_ADMITTED, I_BAD_BLOCK, I_BYTES_RECEIVED, I_BYTES_SENT, I_COLLECT, I_CONGESTION,
    I_DATAGRAMS_RECEIVED, I_DATAGRAMS_SENT, I_EVENT_AGG, I_IS_INT, I_MAX_DATAGRAM, I_MAX_ENTRIES, I_PACE_FROM,
    I_PRECISION, I_QUEUED, I_REMAINING, I_SENT_ENTRIES, I_SOURCE_N, I_STAMP, I_STREAM, I_VIOLATION, I_WINDOW,
    OWN_BLOCK, OWN_EXP, OWN_ROW, TAIL_PROBES, WorkerState)


# -- grouping a worker's blocks by column ---------------------------------------------------------------


@njit(**JIT)
def sort_by_column(blocks, exps, rows, columns, column_order, own, starts):
    """A worker's own non-zero blocks grouped by column (block b in column column_order[b % columns],
    or b % columns where column_order is empty), in one counting sort: column c's blocks are
    own[starts[c]:starts[c + 1], OWN_BLOCK], in the order given (ascending, since the scan gives them
    sorted), with their exponents and rows beside them, and own[len(blocks), OWN_BLOCK] = END. What
    np.argsort(kind="stable") over the columns would give, without its O(n log n) and numpy's three
    gathers per allreduce."""
    n = blocks.shape[0]
    permuted = column_order.shape[0] > 0
    col = np.empty(n, np.int64)
    starts[:] = 0
    prev = logical = 0
    for k in range(n):
        # b % columns stepped from the previous block's (a division per block costs more than the rest
        # of the loop)
        b = blocks[k]
        step = b - prev
        prev = b
        logical = logical + step if 0 <= step < columns else b % columns
        if logical >= columns:
            logical -= columns
        c = column_order[logical] if permuted else logical
        col[k] = c
        starts[c + 1] += 1
    for c in range(columns):
        starts[c + 1] += starts[c]
    fill = starts[:columns].copy()
    for k in range(n):
        p = fill[col[k]]
        fill[col[k]] = p + 1
        own[p, OWN_BLOCK] = blocks[k]
        own[p, OWN_EXP] = exps[k]
        own[p, OWN_ROW] = rows[k]
    own[n, OWN_BLOCK] = END


# -- the worker's data path -----------------------------------------------------------------------------


# Per-value loops, each on its own so that LLVM vectorises them (no branches inside; the byte swap is
# written out so that it becomes a shuffle). They compute in float32 where that is exact: x * 2**s is
# exact in float32 while the product is a normal number (and a product that is not rounds to 0 either
# way), and float32(sum) * 2**s rounds once, as np.ldexp does; shifts beyond float32's exponent range
# take float64, where the same operations are exact until the final rounding.
_F32_LO, _F32_HI = -126, 127
# 2**s as float32 for s in -149..127 (every power of two float32 holds), read by index instead of a libm
# ldexp call per block: _POW2_F32[s + 149]
_POW2_F32 = np.ldexp(np.float32(1.0), np.arange(-149, _F32_HI + 1)).astype(np.float32)


@njit(**JIT)
def _quantize_swapped(src, base, count, shift, words):
    # Index slices from 0: with `base + v` numba must allow for negative indices, which stops LLVM
    # from vectorising the loop (5x slower).
    x = src[base: base + count]
    if _F32_LO <= shift <= _F32_HI:
        scale = _POW2_F32[shift + 149]
        for v in range(count):
            q = np.uint32(np.int32(np.rint(x[v] * scale)))
            words[v] = _swap(q)
    else:
        scale64 = math.ldexp(1.0, shift)
        for v in range(count):
            q = np.uint32(np.int32(np.rint(np.float64(x[v]) * scale64)))
            words[v] = _swap(q)


@njit(**JIT)
def _store_floats(words, count, shift, divisor, out, dst):
    o = out[dst: dst + count]
    if -149 <= shift <= _F32_HI:
        scale = _POW2_F32[shift + 149]
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
def _mine(own, mine_pos, col_stop, c, ahead):
    pos = mine_pos[c] + ahead
    return own[pos, OWN_BLOCK] if pos < col_stop[c] else END


@njit(**JIT)
def _mine_exp(own, mine_pos, col_stop, c, ahead):
    pos = mine_pos[c] + ahead
    return own[pos, OWN_EXP] if pos < col_stop[c] else NO_EXP


_SRC_AHEAD = 8   # encode_data asks for the tensor's block this many entries ahead of the one it quantises


@njit(inline="always", **JIT)
def _sends_data(own, mine_pos, col_stop, round_block, c):
    """Whether column c's entry this round carries data: its round's block is the worker's own next one."""
    return _mine(own, mine_pos, col_stop, c, 0) == round_block[c]


@njit(inline="always", **JIT)
def _ask_for_own(own, pos):
    """Ask for own[pos] and own[pos + 1] in the cache: the checks of a result and encode_data read a
    column's record and the next."""
    T.prefetch(own, pos * own.shape[1], 2 * own.shape[1])


@njit(inline="always", **JIT)
def ask_for_records(own, mine_pos, buf, length, seg, aggregators, aggregator):
    """Ask for the records in own of every entry in the datagrams of one received buffer (`length`
    bytes cut at `seg`, from one aggregator) before they are applied (_ask_for_own). own is by column,
    so the entries of a round read records a column's run apart, a constant stride that the hardware
    prefetcher follows only where every run has one length (dense input); where runs differ (density
    0.99), each was a miss that the checks waited for, one per datagram with MTU-sized ones. Nothing
    here is trusted: receive_one checks it all."""
    S = mine_pos.shape[0]
    off = 0
    while off + HDR <= length:
        size = min(seg, length - off)
        nent = min(get16(buf, off + H_ENTRIES), (size - HDR) // ENT) if size >= HDR else 0
        for e in range(nent):
            c = get16(buf, off + HDR + e * ENT + E_SLOT) * aggregators + aggregator
            if c < S:
                _ask_for_own(own, mine_pos[c])
        off += seg


@njit(inline="always", **JIT)
def fills_datagrams(budget, max_entries):
    """Whether pack_entries fills datagrams of `budget` bytes after the packet header (and at most
    `max_entries` entries) out of R-A8's order: only where one GSO message holds two of them and a
    datagram more than one entry (see pack_entries)."""
    return max_entries > 1 and 2 * (HDR + budget) <= T.GSO_MAX_BYTES


@njit(**JIT)
def pack_entries(cols, lo, hi, order, round_block, mine_pos, col_stop, own, per_data, budget, max_entries):
    """Order cols[lo:hi], one aggregator's entries of a round in the order their results arrived (R-A8),
    so that cutting them into datagrams greedily (encode_data) fills each datagram: where the next data
    entry no longer fits, the header-only entries after it fill the room first. Data entries keep their
    order, and so do header-only entries; a header-only entry goes ahead of at most one datagram's data.
    Why: with MTU-sized datagrams a data entry fills most of one, and cut in arrival order the
    datagrams' lengths varied with the number of header-only entries between two data entries, while
    UDP GSO sends only runs of equally long datagrams in one message: at 1,472 bytes and density 0.1,
    1.9 datagrams per sendmmsg message. Full datagrams all have one length, HDR + 16 * (budget // 16),
    since a block's bytes are a multiple of 16. The entries of one call share their send time (take_ready),
    so loss detection (R-C4) cannot tell the orders apart. `order` is scratch of at least hi - lo.

    Datagrams too large for one GSO message to hold two keep the arrival order: they gain nothing, and a
    pulled entry lets its round complete ahead of its place (a round completes with the last rank's
    entry, so the slowest rank's pulled entries reorder the results that every rank receives, and every
    later round follows that order; at density 0.99, 7 % of the results then came back before one of
    a lower column, each a miss in the per-column arrays and the output). With 64 KiB datagrams,
    density 0.99 took 0.140 s instead of 0.157, 0.8 0.128 instead of 0.132."""
    # the columns' records in own (this one and the next, which encode_data reads), asked for at once
    # (as ask_for_records does for results, and for the same reason: apart by a column's run, a miss
    # each where runs differ in length)
    for p in range(lo, hi):
        _ask_for_own(own, mine_pos[cols[p]])
    if not fills_datagrams(budget, max_entries):
        return
    w = 0
    p = lo
    pulled = lo      # header-only entries in (p, pulled) went ahead already
    while p < hi:
        used = 0
        count = 0
        while p < hi and count < max_entries:
            c = cols[p]
            has = _sends_data(own, mine_pos, col_stop, round_block, c)
            if not has and p < pulled:
                p += 1
                continue
            cost = ENT + (per_data if has else 0)
            if used + cost > budget and count > 0:
                break
            order[w] = c
            w += 1
            used += cost
            count += 1
            p += 1
        if p >= hi or count >= max_entries or used + ENT > budget:
            continue
        # cols[p] is a data entry that did not fit: header-only entries after it take the room
        q = max(pulled, p + 1)
        while count < max_entries and used + ENT <= budget:
            while q < hi and _sends_data(own, mine_pos, col_stop, round_block, cols[q]):
                q += 1
            if q >= hi:
                break
            order[w] = cols[q]
            w += 1
            used += ENT
            count += 1
            q += 1
        pulled = q
    cols[lo:hi] = order[:w]


@njit(**JIT)
def encode_data(out, cuts, cols, ncols, order, aggregators, hdr, round_block, round_exp, mine_pos, col_stop,
                own, src, src_n, is_int, precision, max_bytes, max_entries):
    """Build the DATA datagrams of one round for `cols[:ncols]` (grouped by aggregator) into `out`.

    hdr = (job, rank, world, epoch, tensor_blocks, block_size). Entry per column: the data of its
    round's block if that is the worker's own next non-zero block, header-only otherwise, and the
    worker's next non-zero block after it (docs/protocol.md, "A round"). Datagrams are cut by bytes
    (and `max_entries`) and per aggregator, after pack_entries has ordered each aggregator's entries
    (`order` is its scratch); cuts[k] = (aggregator, start, end) in `out`.
    Data comes from `src` (flat values, `src_n` of them valid): row own[pos, OWN_ROW] of it for the
    worker's block own[pos, OWN_BLOCK]; rows past src_n are zero padding. Returns the number of datagrams.
    """
    B = hdr[5]
    per_data = B * 4
    out32 = out[:out.shape[0] // 4 * 4].view(np.uint32)   # offsets are multiples of 4 (HDR, ENT, 4 B)
    budget = min(max_bytes, MAX_DATAGRAM) - HDR
    nd = 0
    pos = 0
    i = 0
    while i < ncols:
        agg = cols[i] % aggregators
        if i == 0 or cols[i - 1] % aggregators != agg:     # an aggregator's run of entries begins
            g = i + 1
            while g < ncols and cols[g] % aggregators == agg:
                g += 1
            pack_entries(cols, i, g, order, round_block, mine_pos, col_stop, own, per_data, budget, max_entries)
        # how many of the following columns fit in one datagram
        j = i
        used = 0
        rows = 0
        while j < ncols and cols[j] % aggregators == agg and j - i < max_entries:
            c = cols[j]
            has = _sends_data(own, mine_pos, col_stop, round_block, c)
            cost = ENT + (per_data if has else 0)
            if used + cost > budget and j > i:
                break
            used += cost
            rows += 1 if has else 0
            j += 1
        put_header(out, pos, DATA, hdr[0], hdr[1], hdr[2], hdr[3], hdr[4], B, j - i)
        e = pos + HDR
        d = e + (j - i) * ENT
        for k in range(i, j):
            c = cols[k]
            block = round_block[c]
            mine = _mine(own, mine_pos, col_stop, c, 0)
            has = mine == block
            if has:
                nxt = _mine(own, mine_pos, col_stop, c, 1)
                nexp = _mine_exp(own, mine_pos, col_stop, c, 1)
            else:
                nxt = mine
                nexp = _mine_exp(own, mine_pos, col_stop, c, 0)
            put_entry(out, e, c // aggregators, HAS_DATA if has else 0, block, nxt, round_exp[c], nexp)
            e += ENT
            # the block _SRC_AHEAD columns on (in this datagram or the next), while this one is quantised;
            # dense data too: its blocks follow each other in memory, but the hardware prefetcher fetched
            # them too late (this loop's loads waited on memory; 100 MB quantised in order in 1 KiB blocks
            # took 5.6 ms alone, 2.6 ms asking 8 blocks ahead), and with MTU-sized datagrams, one data entry
            # each, the datagram's own entries left nothing to ask for
            if k + _SRC_AHEAD < ncols:
                c1 = cols[k + _SRC_AHEAD]
                if _sends_data(own, mine_pos, col_stop, round_block, c1):
                    row1 = own[mine_pos[c1], OWN_ROW]
                    T.prefetch(src, row1 * B, B)
            if has:
                base = own[mine_pos[c], OWN_ROW] * B
                words = out32[d // 4: d // 4 + B]
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
def _violation(own, mine_pos, col_stop, c, agreed_exp, is_int, has, block, nxt, exp, nexp):
    """R-L4: what is wrong with a RESULT for column c's current round `block` (APPLIED: nothing): data
    missing for a block this worker sent, data under another exponent than agreed, the other dtype's
    exponent for the next round, or a next round that skips a block this worker still has."""
    sent_data = _mine(own, mine_pos, col_stop, c, 0) == block
    if sent_data and not has:
        return VIOLATION_NO_DATA
    if has and exp != agreed_exp:
        return VIOLATION_EXPONENT
    if nxt != END and (nexp == INT_EXP) != is_int:
        return VIOLATION_DTYPE
    if nxt > _mine(own, mine_pos, col_stop, c, 1 if sent_data else 0):
        return VIOLATION_SKIP
    return APPLIED


@njit(inline="always", **JIT)
def apply_datagram(st, b, n, ptype, nent, aggregator, now):
    """Apply one RESULT or STATUS datagram from `aggregator` to the worker's column state st.

    (Inlined: numba passes a record by value, which would copy its ~200 words per datagram.)
    RESULT entries for a column's current round store their sums (dequantised, divided by f[F_DIVISOR]
    when averaging) in st.values (block b at b*B, or, with i[I_COLLECT], at the next free row, its block
    in st.blocks_out; counts[1] rows used), advance the column and mark it ready (counts[2] counts columns
    that reached END, counts[3] the blocks of the sum that hold data); other RESULT entries are duplicates
    (counts[0]). STATUS entries record who the aggregator has heard (docs/protocol.md, "Loss recovery").
    Returns (code, largest round-trip sample or -1, bad block, whether an entry carries the CONGESTION
    flag, R-E1): code 0, a protocol violation (VIOLATION_*: then no entry of the datagram was applied), or
    -DROP_* when malformed.
    counts[4] counts the rounds past the bootstrap that this datagram completed, counts[5] holds the
    least round trip among them and counts[6] the latest time one of them was sent, in ns (-1 if none
    was sent once only), counts[8] that round's column and counts[9] when it could first be sent (its
    ready_at, in ns): the congestion controller's samples (a bootstrap round also waits for ranks that
    start later, so it says nothing about the path; the least, because the others may have waited for
    another rank's retransmission). counts[7] counts the STATUS entries for current rounds past the
    bootstrap: the aggregator held what was resent (R-C4).
    """
    hdr, counts, round_block, round_exp = st.hdr, st.counts, st.round_block, st.round_exp
    own, mine_pos, col_stop = st.own, st.mine_pos, st.col_stop
    deadline, rto, sent_at, status_seen = st.deadline, st.rto, st.sent_at, st.status_seen
    aggregators = st.probe.shape[0]
    is_int, precision, divisor = st.i[I_IS_INT] != 0, st.i[I_PRECISION], np.float32(st.f[F_DIVISOR])
    out_values, out_n, collect = st.values, st.values.size, st.i[I_COLLECT] != 0
    stream = st.i[I_STREAM] != 0     # sums into an output larger than the caches (stores.py)
    B = hdr[5]
    reason, rows, flags = check_entries(b, n, nent, B, hdr[4], ptype != STATUS, REPLY_FLAGS)
    if reason == OK:
        reason = check_slots(b, nent, st.slots_used[aggregator], st.seen, st.i[I_STAMP])
    if reason != OK:
        return -reason, -1.0, 0, False
    marked = (flags & CONGESTION) != 0
    if ptype == RESULT:
        # R-L4, for every entry before any is applied: a violating datagram changes nothing
        for i in range(nent):
            slot, has, block, nxt, exp, nexp = read_entry(b, HDR + i * ENT)
            c = slot * aggregators + aggregator
            if block == round_block[c]:
                code = _violation(own, mine_pos, col_stop, c, round_exp[c], is_int, has, block, nxt, exp, nexp)
                if code != APPLIED:
                    return code, -1.0, block, marked
    rtt = -1.0
    row = 0
    data0 = HDR + nent * ENT
    b32 = b[:n - n % 4].view(np.uint32)     # the sums as words, viewed once (not per entry)
    for i in range(nent):
        slot, has, block, nxt, exp, nexp = read_entry(b, HDR + i * ENT)
        c = slot * aggregators + aggregator
        at = data0 + row * B * 4
        if has:
            row += 1
            # where the next sum goes, while this one is stored (unless it follows this one, or the float
            # sums bypass the caches: streamed stores need no line in the cache, and asking for one reads
            # it from memory only for the stores to evict it, the traffic streaming is there to save)
            if not collect and not (stream and not is_int) and i + 1 < nent:
                _, has1, block1, _, _, _ = read_entry(b, HDR + (i + 1) * ENT)
                if has1 and block1 != block + 1:
                    T.prefetch(out_values, block1 * B, B)
        if ptype == STATUS:
            if block == round_block[c]:
                if block != BOOT and st.waiting_for[c] != ASKED:
                    counts[7] += 1      # the aggregator held our entry: what we resent was not lost
                st.waiting_for[c] = nxt
                status_seen[c] = True
                # the aggregator holds our contribution and waits for others: no need to resend soon
                rto[c] = min(rto[c] * 2, st.f[F_MAX_RTO])
                deadline[c] = max(deadline[c], now + rto[c])
            continue
        if block != round_block[c]:
            counts[0] += 1
            continue
        sent_data = _mine(own, mine_pos, col_stop, c, 0) == block
        # a sample only from a round sent once (Karn's rule; R-C4: nor is it a reference for RACK)
        sampled = not st.resent[c] and not math.isnan(sent_at[c])
        if block != BOOT:
            counts[4] += 1
            if sampled:
                sample = np.int64((now - sent_at[c]) * 1e9)
                counts[5] = sample if counts[5] < 0 else min(counts[5], sample)
                sent = np.int64(sent_at[c] * 1e9)
                if sent > counts[6]:
                    counts[6] = sent
                    counts[8] = c
                    counts[9] = np.int64(st.ready_at[c] * 1e9)
        if has:
            words = b32[at // 4: at // 4 + B]
            if collect:
                dst = counts[1] * B
                st.blocks_out[counts[1]] = block
                counts[1] += 1
                limit = dst + B
            else:
                dst = block * B
                limit = min(dst + B, out_n)
            shift = exp - precision
            if is_int:
                store_swapped(words, limit - dst, out_values, dst)
            elif not (stream and -149 <= shift <= _F32_HI
                      and stream_floats(words, limit - dst, _POW2_F32[shift + 149], divisor, out_values, dst)):
                _store_floats(words, limit - dst, shift, divisor, out_values, dst)
            counts[3] += 1
        if sent_data:
            mine_pos[c] += 1
        round_block[c] = nxt
        round_exp[c] = nexp
        if sampled:
            rtt = max(rtt, now - sent_at[c])
        rto[c] = st.base_rto[aggregator]
        status_seen[c] = False
        deadline[c] = np.inf
        if nxt != END:
            if not st.ready[c]:
                st.queue[st.i[I_QUEUED]] = c
                st.i[I_QUEUED] += 1
                st.ready_at[c] = now
            st.ready[c] = True
        else:
            counts[2] += 1
    return APPLIED, rtt, 0, marked




# -- the worker's driver loop ---------------------------------------------------------------------------

_DROP_OF_REASON = np.array([-1, D_LENGTH, D_FLAGS, D_EXPONENT, D_RANGE], np.int64)   # by wire.DROP_*

# receive_one's outcome: APPLIED (0), a VIOLATION_* (> 0), or one of these
DROPPED, PROBE_OUT = -1, -2


@njit(inline="always", **JIT)
def receive_one(st, b, n, aggregator, now, ce):
    """One datagram from aggregator index `aggregator` (`ce`: it arrived marked Congestion Experienced):
    the reply checks (a JOIN_ACK is a late answer to a join, harmless), then apply_datagram, then its
    ECN mark (R-C6). Returns APPLIED, PROBE_OUT (applied, and a probe to that aggregator is outstanding:
    the machine decides what the answer means), DROPPED (counted in drops), or a VIOLATION_* (R-L4; the
    block in i[I_BAD_BLOCK])."""
    hdr = st.hdr
    if n < HDR:
        st.drops[D_SHORT] += 1
        return DROPPED
    if b[H_VERSION] != VERSION:
        st.drops[D_VERSION] += 1
        return DROPPED
    ptype = np.int64(b[H_TYPE])
    known = False
    for t in KNOWN_TYPES:
        known |= t == ptype
    if not known:
        st.drops[D_TYPE] += 1
        return DROPPED
    if get16(b, H_JOB) != hdr[0] or get16(b, H_RANK) != AGGREGATOR_RANK:
        st.drops[D_FOREIGN] += 1
        return DROPPED
    if ptype == JOIN_ACK:
        return DROPPED     # a late answer to a join: harmless, not counted
    if ptype != RESULT and ptype != STATUS:
        st.drops[D_TYPE] += 1
        return DROPPED
    if get32(b, H_EPOCH) != hdr[3]:
        st.drops[D_STALE_EPOCH] += 1
        return DROPPED
    if get32(b, H_TENSOR_BLOCKS) != hdr[4] or get16(b, H_BLOCK_SIZE) != hdr[5]:
        st.drops[D_GEOMETRY] += 1
        return DROPPED
    nent = get16(b, H_ENTRIES)
    if nent == 0:
        return DROPPED
    st.i[I_STAMP] += 1
    S = st.round_block.shape[0]
    code, rtt, block, marked = apply_datagram(st, b, n, ptype, nent, aggregator, now)
    if code < 0:
        st.drops[_DROP_OF_REASON[-code]] += 1
        return DROPPED
    if code > 0:
        st.i[I_BAD_BLOCK] = block
        return code                                   # R-L4
    st.last_heard[aggregator] = now
    if ce or marked:
        on_mark(st)                                   # R-C6 (before on_rounds: this round's verdict sees it)
    if st.counts[7]:
        on_spurious(st, aggregator, st.counts[7], now, True)
        st.counts[7] = 0
    if ptype == RESULT:
        st.f[F_LAST_PROGRESS] = now
        st.tail_armed[aggregator] = TAIL_PROBES       # R-L8: tail probes may follow this result
        st.i[I_REMAINING] = S - st.counts[2]
        if rtt >= 0:
            measure(st, aggregator, rtt)
        if st.counts[4]:
            if st.counts[6] * 1e-9 > st.delivered_sent[aggregator]:
                st.delivered_sent[aggregator] = st.counts[6] * 1e-9
                st.delivered_ready[aggregator] = st.counts[9] * 1e-9
                st.delivered_column[aggregator] = st.counts[8]
            on_rounds(st, aggregator, st.counts[4], st.counts[5] * 1e-9, now, st.counts[6] * 1e-9)
        st.counts[4] = 0
        st.counts[5] = -1
        st.counts[6] = -1
        st.counts[9] = -1
    if st.counts[0]:
        # R-L4; and R-C4: the aggregator answers a resent entry of a finished round with its RESULT again,
        # so a RESULT that arrives twice says what was resent had not been lost either
        on_spurious(st, aggregator, st.counts[0], now, False)
        st.drops[D_DUPLICATE] += st.counts[0]
        st.counts[0] = 0
    return PROBE_OUT if st.probe[aggregator] >= 0 else APPLIED


@njit(inline="always", **JIT)
def encode_columns(st, ncols):
    """Build this round's entries for st.cols[:ncols], fused into datagrams; returns how many."""
    nd = encode_data(st.out, st.cuts, st.cols, ncols, st.order, st.probe.shape[0], st.hdr, st.round_block,
                     st.round_exp, st.mine_pos, st.col_stop, st.own, st.src,
                     st.i[I_SOURCE_N], st.i[I_IS_INT] != 0, st.i[I_PRECISION], st.i[I_MAX_DATAGRAM],
                     st.i[I_MAX_ENTRIES])
    if nd:
        st.i[I_BYTES_SENT] += st.cuts[nd - 1, 2]
    # (after encode_data, which left st.cols[:ncols] in the order the entries went on the wire)
    first = st.i[I_SENT_ENTRIES]
    for t in range(ncols):
        st.sent_order[st.cols[t]] = first + t
    st.i[I_SENT_ENTRIES] = first + ncols
    return nd


@njit(inline="always", **JIT)
def flush_ready(st, now):
    """The next round's entries of every column that got its result since the last flush (R-A8), within
    the window (R-L6) and as far as the pacer lets them go (R-C7); returns the number of datagrams built
    (st.cuts)."""
    S = st.round_block.shape[0]
    detect_loss(st, now)
    for a in range(st.tail_pto.shape[0]):
        st.tail_pto[a] = tail_probe_timeout(st, a, now)
    if st.i[I_CONGESTION]:
        drain_step(st, now)
    if st.i[I_ADMITTED] < S or st.i[I_WINDOW] < S:
        st.i[I_ADMITTED] = admit(st.round_block, st.i[I_WINDOW])
    n, columns, held, resume, kept = take_ready(
        st.ready, st.queue, st.i[I_QUEUED], st.cols, st.probe.shape[0], st.deadline, st.sent_at, st.resent,
        st.rto, now, st.round_block, st.i[I_ADMITTED], pace_budget(st, now), entries_per_datagram(st),
        st.i[I_PACE_FROM], st.allow)
    st.i[I_QUEUED] = kept
    pace_sent(st, columns, held, resume)
    return encode_columns(st, n) if n else 0



@njit(**JIT)
def _raw_state(st):
    """st over the same memory, without reference counts (transport.raw)."""
    return WorkerState(
        T.raw(st.hdr), T.raw(st.round_block), T.raw(st.round_exp), T.raw(st.mine_pos),
        T.raw(st.col_stop), T.raw(st.own), T.raw(st.src),
        T.raw(st.ready), T.raw(st.queue), T.raw(st.deadline), T.raw(st.rto), T.raw(st.sent_at),
        T.raw(st.sent_order), T.raw(st.resent), T.raw(st.ready_at), T.raw(st.waiting_for), T.raw(st.status_seen),
        T.raw(st.probe), T.raw(st.loss_confirmed), T.raw(st.tail_armed), T.raw(st.last_heard),
        T.raw(st.delivered_sent), T.raw(st.delivered_ready), T.raw(st.delivered_column), T.raw(st.srtt),
        T.raw(st.rttvar), T.raw(st.base_rto), T.raw(st.tail_pto), T.raw(st.min_rtt),
        T.raw(st.epoch_min), T.raw(st.drain_min), T.raw(st.reo_mult), T.raw(st.reo_clean), T.raw(st.reo_epoch),
        T.raw(st.slots_used),
        T.raw(st.allow), T.raw(st.cols), T.raw(st.order), T.raw(st.seen), T.raw(st.out), T.raw(st.cuts),
        T.raw(st.values), T.raw(st.blocks_out), T.raw(st.counts), T.raw(st.f), T.raw(st.i), T.raw(st.drops))


# drive's outcomes
DONE, TIMER, PROBE, VIOLATION, NEED_ROWS = range(5)


@njit(inline="always", **JIT)
def queue_cuts(fd, tx, st, nd, keys, loss):
    """Queue the datagrams listed in st.cuts[:nd] to their aggregators (keys: ip << 16 | port)."""
    base = st.out.ctypes.data
    k = 0
    while k < nd:
        a = st.cuts[k, 0]
        j = k
        while j < nd and st.cuts[j, 0] == a:
            j += 1
        st.i[I_DATAGRAMS_SENT] += j - k
        T.queue_datagrams(fd, tx, base, st.cuts[k:j, 1], st.cuts[k:j, 2], j - k, keys[a], loss)
        k = j


@njit(**JIT)
def drive(fd, group, rx, tx, st, keys, loss, room, n, i, off):
    """The worker's driver loop (_drive), then a store fence: Python, or another thread or a device
    copying the output, may read the sums next (stores.py)."""
    outcome = _drive(fd, group, rx, tx, st, keys, loss, room, n, i, off)
    fence()
    return outcome


@njit(**JIT)
def receive(st, b, n, aggregator, now, ce):
    """receive_one for the machine's Python interface, then a store fence (as drive)."""
    code = receive_one(st, b, n, aggregator, now, ce)
    fence()
    return code


@njit(inline="always", **JIT)
def _drive(fd, group, rx, tx, st, keys, loss, room, n, i, off):
    """The worker's driver loop, from datagram (i, off) of the received batch rx[:n] on: apply what
    arrives (on socket fd, and on the multicast group's socket `group` unless it is -1), send the next
    rounds of the columns that are ready (after each batch, so that a worker that fell behind answers
    with fewer, fuller datagrams), wait on the socket until the machine's timer. Returns (outcome, n, i,
    off) where Python must step in: DONE, TIMER (poll: retransmissions or the timeout), PROBE (datagrams
    arrived from an aggregator with a probe out, and everything queued has been read: the machine judges
    the answer, R-L2), VIOLATION (i[I_VIOLATION] from aggregator i[I_EVENT_AGG]), NEED_ROWS (collected
    rows would pass `room`: grow the sink, then go on from (i, off)). The pacer's timer (R-C7) is the
    loop's own: it wakes the loop, whose next flush_ready sends what the pacer held back."""
    A = keys.shape[0]
    st, rx, tx = _raw_state(st), T.raw_rx(rx), T.raw_tx(tx)
    wait = 0
    progress = st.f[F_LAST_PROGRESS]   # as of the batch's start
    probe_answer = False
    while True:
        if i >= n:                     # read what is queued (or wait for it) before judging timers
            n = T.receive2(fd, group, rx, wait)
            i = 0
            off = 0
            progress = st.f[F_LAST_PROGRESS]
        now = T.monotonic(rx.clock)
        while i < n:
            length, seg, source = rx.length[i], rx.seg[i], rx.source[i]
            a = -1
            for k in range(A):
                if keys[k] == source:
                    a = k
            arrived = min(rx.arrived[i], now)
            noted = False
            if off == 0 and a >= 0:
                ask_for_records(st.own, st.mine_pos, rx.buf[i], length, seg, A, a)
            while off < length:
                size = min(seg, length - off)
                if st.i[I_COLLECT] and st.counts[1] + size // (4 * st.hdr[5]) > room:
                    return NEED_ROWS, n, i, off
                off += seg
                st.i[I_DATAGRAMS_RECEIVED] += 1
                st.i[I_BYTES_RECEIVED] += size
                if loss > 0.0 and np.random.random() < loss:
                    continue
                if a < 0:
                    st.drops[D_UNKNOWN_SOURCE] += 1
                    continue
                # the kernel's arrival time: round trips leave out this worker's own wait (R-C3), which
                # sets the reordering window's floor instead (R-C4)
                code = receive_one(st, rx.buf[i, off - seg: off - seg + size], size, a, arrived,
                                   (rx.tos[i] & ECN_MASK) == CE)
                if not noted and (code == APPLIED or code == PROBE_OUT):
                    # once per buffer (its datagrams share the stamp), and only for what this allreduce
                    # applied: a stale datagram may have waited since the last one
                    note_host_wait(st, now - arrived, now)
                    noted = True
                if code > 0:
                    st.i[I_EVENT_AGG] = a
                    st.i[I_VIOLATION] = code
                    return VIOLATION, n, i, off
                if code == PROBE_OUT:
                    probe_answer = True
            i += 1
            off = 0
        # the clock again: applying a batch can take milliseconds on a busy host, and the rounds' send
        # times are what RACK (R-C4) compares; taken at the batch's start, a whole batch's rounds would
        # look sent that much earlier than those of the next batch
        now = T.monotonic(rx.clock)
        nd = flush_ready(st, now)
        if nd:
            queue_cuts(fd, tx, st, nd, keys, loss)
            T.send(fd, tx)
        if st.i[I_REMAINING] == 0:
            return DONE, 0, 0, 0
        now = T.monotonic(rx.clock)
        t = recovery_timer(st, now)
        # R-L1: timers count once everything queued has been read. After a full batch that brought
        # results, more may wait behind it: a worker that waited for a core finds a backlog, and judged
        # in the middle of it, its own late reading looked like losses (340 entries resent in a
        # loss-free run on loopback). (Only after progress: a flood of other datagrams cannot hold
        # the timers, and so the timeout, off.) Answers to probes likewise (R-L2).
        backlog = n == rx.length.shape[0] and st.f[F_LAST_PROGRESS] > progress
        if probe_answer and not backlog:
            return PROBE, 0, 0, 0
        if now >= t and not backlog:
            return TIMER, 0, 0, 0
        t = min(t, pace_timer(st), drain_timer(st))   # the pacer's columns go out in the next flush_ready
        wait = (0 if n == rx.length.shape[0] or t <= now else
                max(1, np.int64(min(1000.0, math.ceil((t - now) * 1000.0)))))
