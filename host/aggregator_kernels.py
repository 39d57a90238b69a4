"""The aggregator's data path in compiled code, over one state record per job (`SlotTable`).

- contribute: R-A1 ... R-A7 for the entries of one DATA datagram (the slot registers' update).
- handle_data / flush_results: what AggregatorMachine does with a member's DATA datagram and with the
  rounds completed since the last flush; their datagrams (RESULT to every member, STATUS and shadow
  results to the sender) are encoded into the table's `wire` buffer and listed in `cuts`.
- serve: the server's driver loop over a received batch, for every job at once: a DATA datagram of a
  job's member that passes the stateless checks goes through handle_data; anything else (JOIN, LEAVE,
  STATS, garbage, strangers) stops the loop at that datagram, so that the Python machines handle it in
  arrival order with the full validation of docs/protocol.md. What the batch completed is flushed and
  sent with sendmmsg (zerosum.transport) before serve returns.

The slot registers carry the P4 program's names (REGISTERS), as columns of one int64 array.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit
from numba.typed import List

from . import spec
from . import transport as T
from .spec import CE, ECN_MASK
from .wire import (AGGREGATOR_RANK, BOOT, DATA, DROP_REASONS, END, ENT, H_BLOCK_SIZE, H_EPOCH,
                   H_ENTRIES, H_JOB, H_RANK, H_TENSOR_BLOCKS, H_TYPE, H_VERSION, H_WORLD, HAS_DATA, HDR,
                   JIT, MAX_DATAGRAM, NO_EXP, OK, RESULT, STATUS, VERSION, CONGESTION, DATA_FLAGS,
                   check_entries, check_slots, copy_swapped, get16, get32, put_entry, put_header, read_entry,
                   store_swapped, swap32)

# Slot registers: columns of the `regs` array (the P4 program's register names).
(SLOT_EPOCH, SLOT_BLOCK, SLOT_EXP, SLOT_TENSOR_BLOCKS, BITMAP, COUNT, MIN_NEXT, MIN_NEXT_EXP, HAS_DATA_REG,
 PREV_EPOCH, PREV_BLOCK, PREV_NEXT, PREV_EXP, PREV_NEXT_EXP, PREV_HAS_DATA, PENDING, CONGESTION_REG,
 PREV_CONGESTION, BANK) = range(19)
REGISTERS = ("slot_epoch", "slot_block", "slot_exp", "slot_tensor_blocks", "bitmap", "count", "min_next",
             "min_next_exp", "has_data", "prev_epoch", "prev_block", "prev_next", "prev_exp", "prev_next_exp",
             "prev_has_data", "pending", "congestion", "prev_congestion", "bank")
# slot_epoch -1: a slot no BOOT of this run has started (no 32-bit epoch equals it), so the run's first
# BOOT starts it whatever its epoch, as a new generation does on the switch (R-A1).
REGISTER_RESET = (-1, spec.END, spec.NO_EXP, 0, 0, 0, spec.END, spec.NO_EXP, 0, 0, spec.END, spec.END,
                  spec.NO_EXP, spec.NO_EXP, 0, 0, 0, 0, 0)

_POOL_AHEAD = 8   # slot banks asked for this many entries ahead: contribute (adds), encode_slots (copies out)

# counters[] indices (spec.COUNTERS order) that the data path counts
_C = spec.COUNTER_INDEX
C_DATAGRAMS, C_ROUNDS, C_DUPLICATES, C_RETRANSMISSIONS = (_C[n] for n in (
    "datagrams", "rounds", "duplicates", "retransmissions_answered"))
C_STALE, C_MISMATCH = _C["drop_stale"], _C["drop_mismatch"]
REASON_COUNTER = np.array([-1] + [_C[name] for name in DROP_REASONS[1:]], np.int64)

# state[] of a SlotTable
STAMP, PENDING_EPOCH, PENDING_TENSOR_BLOCKS, USED, NCUTS, HEARD = range(6)
# counts[] of contribute: completed slots listed in `done`, duplicates, retransmissions, stale,
# mismatched, completed rounds
DONE, DUPS, RETX, STALE, MISMATCH, ROUNDS = range(6)


class SlotTable(NamedTuple):
    """One job's aggregation state, as the kernels see it (AggregatorMachine owns it)."""
    regs: np.ndarray        # int64 [slots, 19]: the slot registers
    # int32 [2 * slots, block_size]: slot s's two banks, rows 2s and 2s + 1. The current round sums into
    # row 2s + bank (its first data is written, later data added); completing it flips `bank`, so the
    # finished row is the previous round's result (R-A3) with nothing copied or cleared, as on the switch.
    pool: np.ndarray
    geometry: np.ndarray    # int64 [5]: job, world, block_size, max_datagram, multicast group (key, -1: none)
    counters: np.ndarray    # int64 [len(spec.COUNTERS)]
    seen: np.ndarray        # int64 [slots]: slots named by the current datagram (R-V10)
    done: np.ndarray        # int64 [slots]: slots completed since the last flush
    replies: np.ndarray     # int64 [2, slots]: this datagram's duplicates and retransmissions
    counts: np.ndarray      # int64 [6]: see DONE ... ROUNDS
    state: np.ndarray       # int64 [6]: see STAMP ... HEARD
    wire: np.ndarray        # uint8: datagrams to send
    cuts: np.ndarray        # int64 [n, 3]: (start, end, to every member 1 / to the sender 0) in wire
    accept: np.ndarray      # int64 [MAX_WORLD]: address key DATA of rank r is taken from, -1: none
    members: np.ndarray     # int64 [MAX_WORLD]: address key results go to, -1: none


def slot_table(job: int, world: int, slots: int, block_size: int, max_datagram: int,
               counters: np.ndarray, multicast: int = -1) -> SlotTable:
    per_slot = ENT + 4 * block_size + HDR
    return SlotTable(np.tile(np.array(REGISTER_RESET, np.int64), (slots, 1)),
                     np.zeros((2 * slots, block_size), np.int32),
                     np.array([job, world, block_size, max_datagram, multicast], np.int64),
                     counters, np.zeros(slots, np.int64),
                     np.zeros(slots, np.int64), np.zeros((2, slots), np.int64), np.zeros(6, np.int64),
                     np.zeros(6, np.int64),
                     # two halves, each with room for one call's output: a flush of every slot and the
                     # replies to one datagram
                     np.zeros(2 * 3 * slots * per_slot, np.uint8), np.zeros((3 * slots + 3, 3), np.int64),
                     np.full(spec.MAX_WORLD, -1, np.int64), np.full(spec.MAX_WORLD, -1, np.int64))


@njit(**JIT)
def _raw_table(t):
    """t over the same memory, without reference counts (transport.raw)."""
    return SlotTable(T.raw(t.regs), T.raw(t.pool), T.raw(t.geometry), T.raw(t.counters),
                     T.raw(t.seen), T.raw(t.done), T.raw(t.replies), T.raw(t.counts), T.raw(t.state),
                     T.raw(t.wire), T.raw(t.cuts), T.raw(t.accept), T.raw(t.members))


@njit(**JIT)
def _newer(a, b):
    """Serial-number comparison of 32-bit epochs (RFC 1982): a is after b."""
    d = (a - b) & 0xFFFFFFFF
    return d != 0 and d < 0x80000000


@njit(**JIT)
def _add_swapped(words, at, pool, r):
    """pool[r] += the network-order words[at:]. Both are views indexed from 0: with `at + v` numba must
    allow for a negative index, and LLVM turns the loop's loads into gathers (4x slower). The views
    cost no atomic reference count updates because the driver loop passes raw arrays (transport.raw)."""
    w = words[at: at + pool.shape[1]]
    row = pool[r]
    for v in range(row.shape[0]):
        row[v] += np.int32(swap32(w[v]))


@njit(inline="always", **JIT)
def _open_round(regs, s):
    """Slot s starts a round: no rank counted, no next block seen, no data, no mark."""
    regs[s, BITMAP] = 0
    regs[s, COUNT] = 0
    regs[s, MIN_NEXT] = END
    regs[s, MIN_NEXT_EXP] = NO_EXP
    regs[s, HAS_DATA_REG] = 0
    regs[s, CONGESTION_REG] = 0


@njit(inline="always", **JIT)
def contribute(b, n, nent, epoch, tensor_blocks, rank, world, block_size, regs, pool, seen, stamp,
               done, counts, replies, ce):
    """One DATA datagram from a member: validate it, then add its entries to their slots; `ce`: it
    arrived with an ECN Congestion Experienced mark, which the rounds it adds to echo (R-E1).

    Completed rounds become the shadow copy and their slots are appended to `done` (counts[DONE] of
    them; a slot is listed once until the next flush). Duplicates of the current round (answered with
    STATUS) and retransmissions to the previous round (answered from the shadow copy) are listed in
    replies[0, :counts[DUPS]] and replies[1, :counts[RETX]]. The datagram has passed check_entries
    (R-V4, R-V5); this checks its slots (R-V10). Returns OK or DROP_RANGE (then nothing was changed).
    """
    reason = check_slots(b, nent, regs.shape[0], seen, stamp)
    if reason != OK:
        return reason
    bit = np.int64(1) << rank
    row = 0
    data0 = HDR + nent * ENT
    b32 = b[:n - n % 4].view(np.uint32)    # the data as words (a DATA datagram's length is 4-aligned)
    for i in range(nent):
        s, has, block, nxt, exp, nexp = read_entry(b, HDR + i * ENT)
        at = data0 + row * block_size * 4
        if has:
            row += 1
        # the bank that the entry _POOL_AHEAD on adds to, while this one is added: the banks (4 MiB for
        # 2,048 slots of 256 values) leave the caches under the datagrams' traffic, and the add waited on
        # them even where the slots follow each other (dense data)
        if i + _POOL_AHEAD < nent:
            s1, has1, _, _, _, _ = read_entry(b, HDR + (i + _POOL_AHEAD) * ENT)
            if has1:
                T.prefetch(pool, (2 * s1 + regs[s1, BANK]) * block_size, block_size)
        # R-A1: a bootstrap entry of a newer epoch starts the slot's next allreduce; the previous round
        # (prev_*, the other bank) is kept, so a worker that lost the old epoch's last result still gets
        # it. An abandoned round's partial sum needs no clearing: the next data is written over it.
        if block == BOOT and (regs[s, SLOT_EPOCH] < 0 or _newer(epoch, regs[s, SLOT_EPOCH])):
            regs[s, SLOT_EPOCH] = epoch
            regs[s, SLOT_BLOCK] = BOOT
            regs[s, SLOT_EXP] = NO_EXP
            regs[s, SLOT_TENSOR_BLOCKS] = tensor_blocks
            _open_round(regs, s)
        if regs[s, SLOT_EPOCH] == epoch and block == regs[s, SLOT_BLOCK]:
            if regs[s, BITMAP] & bit:                 # R-A2: a duplicate, answered with STATUS
                replies[0, counts[DUPS]] = s
                counts[DUPS] += 1
                continue
            if (has and exp != regs[s, SLOT_EXP]) or regs[s, SLOT_TENSOR_BLOCKS] != tensor_blocks:
                # R-A5: the worker disagrees with the slot about the block's exponent or the tensor: never add
                counts[MISMATCH] += 1
                continue
            # R-A6: add it, mark the rank, count it, keep the minimum next
            if has:
                if regs[s, HAS_DATA_REG]:
                    _add_swapped(b32, at // 4, pool, 2 * s + regs[s, BANK])
                else:
                    # the round's first data is written: the bank is not cleared
                    store_swapped(b32[at // 4:], block_size, pool[2 * s + regs[s, BANK]], 0)
                    regs[s, HAS_DATA_REG] = 1
            regs[s, BITMAP] |= bit
            regs[s, COUNT] += 1
            if ce:
                regs[s, CONGESTION_REG] = 1           # R-E1: the round's RESULT echoes the mark
            if nxt < regs[s, MIN_NEXT]:
                regs[s, MIN_NEXT] = nxt
                regs[s, MIN_NEXT_EXP] = nexp
            elif nxt == regs[s, MIN_NEXT] and nexp > regs[s, MIN_NEXT_EXP]:
                regs[s, MIN_NEXT_EXP] = nexp
            if regs[s, COUNT] == world:
                # R-A7: complete: its bank becomes the shadow copy, the slot moves to the minimum next
                regs[s, BANK] ^= 1
                regs[s, PREV_EPOCH] = regs[s, SLOT_EPOCH]
                regs[s, PREV_BLOCK] = regs[s, SLOT_BLOCK]
                regs[s, PREV_NEXT] = regs[s, MIN_NEXT]
                regs[s, PREV_EXP] = regs[s, SLOT_EXP]
                regs[s, PREV_NEXT_EXP] = regs[s, MIN_NEXT_EXP]
                regs[s, PREV_HAS_DATA] = regs[s, HAS_DATA_REG]
                regs[s, PREV_CONGESTION] = regs[s, CONGESTION_REG]
                regs[s, SLOT_BLOCK] = regs[s, MIN_NEXT]
                regs[s, SLOT_EXP] = regs[s, MIN_NEXT_EXP]
                _open_round(regs, s)
                counts[ROUNDS] += 1
                if not regs[s, PENDING]:
                    regs[s, PENDING] = 1
                    done[counts[DONE]] = s
                    counts[DONE] += 1
        elif regs[s, PREV_EPOCH] == epoch and block == regs[s, PREV_BLOCK]:
            # R-A3: answered from the shadow bank, unless the round's RESULT still waits for the flush,
            # which sends it to every worker (a reply now would overtake it and look like a loss)
            if not regs[s, PENDING]:
                replies[1, counts[RETX]] = s
                counts[RETX] += 1
        else:
            counts[STALE] += 1                  # R-A4: stale
    return OK


@njit(**JIT)
def encode_slots(t, slots, nslots, status, epoch, tensor_blocks, to_all):
    """RESULT datagrams of the slots' previous rounds (from the shadow bank), or with `status`, STATUS
    datagrams of their current rounds (`next` = bitmap of the ranks heard), appended to t.wire and
    listed in t.cuts; each entry flagged CONGESTION when its round heard a CE mark (R-E1: a resent
    RESULT carries the flag of the first). Cut by bytes (geometry's max_datagram): a result may need
    more datagrams than the contribution that completed it."""
    job, world, B, max_bytes = t.geometry[0], t.geometry[1], t.geometry[2], t.geometry[3]
    out, regs, pool = t.wire, t.regs, t.pool
    out32 = out.view(np.uint32)       # datagrams are 4-aligned in wire: data words written in place
    per_data = B * 4
    budget = min(max_bytes, MAX_DATAGRAM) - HDR
    ptype = STATUS if status else RESULT
    pos = t.state[USED]
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
        put_header(out, pos, ptype, job, AGGREGATOR_RANK, world, epoch, tensor_blocks, B, j - i)
        e = pos + HDR
        d = e + (j - i) * ENT
        for k in range(i, j):
            s = slots[k]
            # the bank of the result _POOL_AHEAD on, while this one is copied: a round's bank was written
            # when its first data arrived, and until the last rank's entry completed it (at density 0.01
            # mostly a header-only entry, a datagram or more later) the other datagrams pushed it out of
            # the caches; the copy waited on it
            if not status and k + _POOL_AHEAD < j:
                s1 = slots[k + _POOL_AHEAD]
                if regs[s1, PREV_HAS_DATA] != 0:
                    T.prefetch(pool, (2 * s1 + (regs[s1, BANK] ^ 1)) * B, B)
            if status:
                put_entry(out, e, s, CONGESTION if regs[s, CONGESTION_REG] else 0, regs[s, SLOT_BLOCK],
                          regs[s, BITMAP], NO_EXP, NO_EXP)
            else:
                has = regs[s, PREV_HAS_DATA] != 0
                flags = (HAS_DATA if has else 0) | (CONGESTION if regs[s, PREV_CONGESTION] else 0)
                put_entry(out, e, s, flags, regs[s, PREV_BLOCK], regs[s, PREV_NEXT], regs[s, PREV_EXP],
                          regs[s, PREV_NEXT_EXP])
                if has:
                    # the bank the round finished in (a view: see _add_swapped)
                    copy_swapped(pool[2 * s + (regs[s, BANK] ^ 1)], 0, B, out32[d // 4: d // 4 + B])
                    d += per_data
            e += ENT
        c = t.state[NCUTS]
        t.cuts[c, 0] = pos
        t.cuts[c, 1] = d
        t.cuts[c, 2] = to_all
        t.state[NCUTS] = c + 1
        pos = d
        i = j
    t.state[USED] = pos


@njit(**JIT)
def flush_results(t):
    """RESULT datagrams, for every member, of the rounds completed since the last flush (R-A7)."""
    n = t.counts[DONE]
    if n == 0:
        return
    for k in range(n):
        t.regs[t.done[k], PENDING] = 0
    t.counts[DONE] = 0
    encode_slots(t, t.done, n, False, t.state[PENDING_EPOCH], t.state[PENDING_TENSOR_BLOCKS], 1)


@njit(inline="always", **JIT)
def handle_data(t, b, n, nent, epoch, tensor_blocks, rank, ce):
    """A member's DATA datagram that passed R-V1 ... R-V10 up to its slots (`ce`: it arrived marked
    Congestion Experienced): R-V10's slot rule, then R-A1 ... R-A7 and R-E1. Its replies (duplicates:
    STATUS; retransmissions: the shadow copy) go to the sender; rounds of another allreduce that
    completed earlier are flushed first. Returns OK or the drop reason."""
    if nent == 0:
        t.counters[C_DATAGRAMS] += 1
        return OK
    counts, state = t.counts, t.state
    if counts[DONE] and (state[PENDING_EPOCH] != epoch or state[PENDING_TENSOR_BLOCKS] != tensor_blocks):
        flush_results(t)     # rounds of another allreduce completed since the last flush: send them first
    for k in range(1, 6):
        counts[k] = 0
    state[STAMP] += 1
    world, B = t.geometry[1], t.geometry[2]
    reason = contribute(b, n, nent, epoch, tensor_blocks, rank, world, B, t.regs, t.pool, t.seen,
                        state[STAMP], t.done, counts, t.replies, ce)
    if reason != OK:
        t.counters[REASON_COUNTER[reason]] += 1
        return reason
    if counts[DONE]:
        state[PENDING_EPOCH] = epoch
        state[PENDING_TENSOR_BLOCKS] = tensor_blocks
    t.counters[C_DATAGRAMS] += 1
    t.counters[C_STALE] += counts[STALE]
    t.counters[C_MISMATCH] += counts[MISMATCH]
    t.counters[C_ROUNDS] += counts[ROUNDS]
    if counts[DUPS]:
        t.counters[C_DUPLICATES] += counts[DUPS]
        encode_slots(t, t.replies[0], counts[DUPS], True, epoch, tensor_blocks, 0)
    if counts[RETX]:
        t.counters[C_RETRANSMISSIONS] += counts[RETX]
        encode_slots(t, t.replies[1], counts[RETX], False, epoch, tensor_blocks, 0)
    return OK


# -- the server's driver loop ----------------------------------------------------------------------------

@njit(**JIT)
def _job_of(b, size, job_ids):
    """The table index of a DATA datagram's job, or -1 (not DATA of a job served: for Python)."""
    if size < HDR or b[H_VERSION] != VERSION or b[H_TYPE] != DATA:
        return -1
    job = get16(b, H_JOB)
    for k in range(job_ids.shape[0]):
        if job_ids[k] == job:
            return k
    return -1


@njit(inline="always", **JIT)
def _fast(t, b, size, source):
    """Whether job t's member sent this DATA datagram, well-formed (R-V4, R-V5) and of the job's geometry:
    the compiled loop takes it; otherwise Python, with the full validation order."""
    rank = get16(b, H_RANK)
    if rank >= t.accept.shape[0] or t.accept[rank] != source or t.accept[rank] < 0:
        return False
    if get16(b, H_WORLD) != t.geometry[1] or get16(b, H_BLOCK_SIZE) != t.geometry[2]:
        return False
    reason, _, _ = check_entries(b, size, get16(b, H_ENTRIES), t.geometry[2], get32(b, H_TENSOR_BLOCKS), True,
                                 DATA_FLAGS)
    return reason == OK


@njit(inline="always", **JIT)
def _room(t, fd, tx):
    """Make room in t.wire for one call's output: send what is queued (all of it points into wires),
    then start the buffer over."""
    half = t.wire.shape[0] // 2
    if t.state[USED] > half:
        T.send(fd, tx)
        t.state[USED] = 0


@njit(inline="always", **JIT)
def _drain(t, fd, tx, source, loss):
    """Queue t's listed datagrams: to every member, or to `source`."""
    n = t.state[NCUTS]
    if n == 0:
        return
    base = t.wire.ctypes.data
    starts = t.cuts[:n, 0]
    ends = t.cuts[:n, 1]
    i = 0
    while i < n:
        j = i
        while j < n and t.cuts[j, 2] == t.cuts[i, 2]:
            j += 1
        # to every member: each, or all at once through the multicast group
        group = t.geometry[4]
        for r in range((1 if group >= 0 else t.members.shape[0]) if t.cuts[i, 2] else 1):
            dest = (group if group >= 0 else t.members[r]) if t.cuts[i, 2] else source
            if dest >= 0:
                T.queue_datagrams(fd, tx, base, starts[i:j], ends[i:j], j - i, dest, loss)
        i = j
    t.state[NCUTS] = 0


@njit(**JIT)
def _finish(tables, fd, tx, loss):
    for k in range(len(tables)):
        _flush_job(_raw_table(tables[k]), fd, tx, loss)
    T.send(fd, tx)
    for k in range(len(tables)):       # everything queued is sent: the wires are free again
        tables[k].state[USED] = 0


@njit(**JIT)
def _flush_job(t, fd, tx, loss):
    _room(t, fd, tx)
    flush_results(t)
    _drain(t, fd, tx, -1, loss)


# Compiled without reference counting (numba's `_nrt=False`): every array it touches is a raw view
# (transport.raw) that the caller keeps alive, and it allocates nothing. With counting on, numba still
# emitted a call to NRT_incref or NRT_decref for each of the ~25 arrays of the slot table and the receive
# batch around every inlined helper, per datagram: calls on null pointers (the views are raw), yet with
# 1,472-byte datagrams dropping them cut the aggregator's CPU for a dense 100 MB allreduce of 4 workers
# from 0.13 to 0.077 s.
@njit(_nrt=False, **JIT)
def _run(t, k, fd, rx, n, i, off, job_ids, tx, loss):
    """The datagrams of job t (index k) from (i, off) on, until one that is not: returns its position.
    (t is an argument, never reassigned: a record held in a loop variable would have the reference counts
    of all its arrays updated, atomically, at every turn.)"""
    while i < n:
        length, seg = rx.length[i], rx.seg[i]
        if length == 0:
            return i, off                   # an empty datagram: Python counts it (drop_short)
        source = rx.source[i]
        row = rx.buf[i]
        while off < length:
            size = min(seg, length - off)
            b = row[off: off + size]
            if _job_of(b, size, job_ids) != k or not _fast(t, b, size, source):
                return i, off               # (Python applies the simulated loss to what it takes)
            if loss > 0.0 and np.random.random() < loss:
                off += seg
                continue
            _room(t, fd, tx)
            handle_data(t, b, size, get16(b, H_ENTRIES), get32(b, H_EPOCH), get32(b, H_TENSOR_BLOCKS),
                        get16(b, H_RANK), (rx.tos[i] & ECN_MASK) == CE)
            t.state[HEARD] = 1
            _drain(t, fd, tx, source, loss)
            off += seg
        i += 1
        off = 0
    return i, off


@njit(**JIT)
def table_list(table):
    """A typed list of SlotTables (for serve and serve_until) holding `table`, built in compiled code:
    numba.typed.List's own methods, called from Python, compile afresh in every process (1.4 s of an
    aggregator's or worker's 3.3 s start here), while inside a cached kernel they come from the cache."""
    tables = List()
    tables.append(table)
    return tables


@njit(**JIT)
def append_table(tables, table):
    tables.append(table)


@njit(**JIT)
def serve_until(fd, rx, job_ids, tables, tx, loss, deadline):
    """serve() batch after batch, waiting on the socket in between, until a datagram needs Python or the
    monotonic clock reaches `deadline`. Returns (n, i, off): the last batch and where Python goes on in
    it (i == n: nothing is left for Python). Python's work per batch (the machines' timers, the stop
    check) is thus paid per deadline, not per batch: at low rates a batch holds one or two datagrams."""
    while True:
        now = T.monotonic(rx.clock)
        if now >= deadline:
            return 0, 0, 0
        n = T.receive(fd, rx, max(1, np.int64(min(200.0, math.ceil((deadline - now) * 1000.0)))))
        if n:
            i, off = serve(fd, rx, n, 0, 0, job_ids, tables, tx, loss)
            if i < n:
                return n, i, off


@njit(**JIT)
def serve(fd, rx, n, i, off, job_ids, tables, tx, loss):
    """Take the received batch from datagram (i, off) on: DATA of the jobs' members through handle_data,
    replies and results queued and sent. Returns (i, off) of the first datagram for Python (JOIN, LEAVE,
    STATS, anything malformed or from a stranger), or (n, 0) when the batch is done. Either way, the
    rounds completed so far have been flushed and everything queued has been sent."""
    rx = T.raw_rx(rx)
    tx = T.raw_tx(tx)
    job_ids = T.raw(job_ids)
    while i < n:
        if rx.length[i] == 0:
            break                           # an empty datagram: for Python (drop_short)
        if off >= rx.length[i]:
            i += 1
            off = 0
            continue
        size = min(rx.seg[i], rx.length[i] - off)
        k = _job_of(rx.buf[i, off: off + size], size, job_ids)
        if k < 0:
            break
        at_i, at_off = i, off
        i, off = _run(_raw_table(tables[k]), k, fd, rx, n, i, off, job_ids, tx, loss)
        if (i, off) == (at_i, at_off):      # not taken by its job's run: for Python
            break
    _finish(tables, fd, tx, loss)
    return (i, off) if i < n else (n, 0)
