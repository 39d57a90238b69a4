"""Which of the worker's rounds go out next, and when its timers fire: compiled, over the allreduce's
state record (zerosum.worker_state).

The worker's data path (zerosum.worker_kernels) asks here, after every batch, which ready columns it
may send (arrival order R-A8, the window R-L6, the pacer R-C7), and when loss recovery next needs a
look; the worker's machine (zerosum.worker_machine) asks which columns' timers expired (R-L1, R-L2)
and which round a tail probe resends (R-L8). The estimates behind those timers (round trips, loss
detection, the window and the pacer) are zerosum.congestion's.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .congestion import drain_timer, pace_timer
from .wire import BOOT, END, JIT
from .worker_state import F_LAST_PROGRESS, F_TIMEOUT, I_REMAINING, TAIL_PROBES


@njit(**JIT)
def take_ready(ready, queue, queued, cols, aggregators, deadline, sent_at, resent, rto, now, round_block,
               admitted, budget, quantum, first, per_agg):
    """The ready columns (queue[:queued], in the order their results arrived), in that order within each
    aggregator's group, the groups from aggregator `first` on (in `cols`), with their timers started.
    Columns from `admitted` on stay ready unless their round is the bootstrap (the worker's window, R-L6),
    and so do those past the first `budget` columns past their bootstrap (the pacer, R-C7); a budget
    under `quantum` columns sends none of them unless it covers them all (the pacer releases a full
    datagram's entries at once, R-C7). Columns that stay keep their place in the queue. Returns (columns
    taken, how many of them are past their bootstrap, the columns the budget must cover before the next
    send (0: none held back), the aggregator after the last one whose column was taken past its
    bootstrap: where to go on, the columns left in the queue). `per_agg` is scratch, one per aggregator.

    Why arrival order (R-A8): every rank receives the results of an aggregator in the same order, so every
    rank then sends its entries in that order, and the aggregator's rounds complete in the order each
    rank sent them. In column order, a rank that read two results in one batch sent them in the order of
    their columns, and another that read them in two batches in the order of their arrival: rounds then
    completed out of a rank's sending order, which loss detection (R-C4) takes for losses."""
    if budget < quantum:
        waiting = 0
        for q in range(queued):
            c = queue[q]
            if c < admitted and round_block[c] != BOOT:
                waiting += 1
                if waiting > budget:
                    budget = 0
                    break
    for a in range(aggregators):
        per_agg[a] = 0
    k = 0
    kept = 0
    paced = 0
    held = 0
    resume = first
    for q in range(queued):
        c = queue[q]
        if round_block[c] != BOOT:
            if c >= admitted:
                queue[kept] = c
                kept += 1
                continue
            if paced >= budget:
                held += 1
                queue[kept] = c
                kept += 1
                continue
            paced += 1
            resume = (c % aggregators + 1) % aggregators
        ready[c] = False
        cols[k] = c
        per_agg[c % aggregators] += 1
        deadline[c] = now + rto[c]
        sent_at[c] = now
        resent[c] = False
        k += 1
    if aggregators > 1 and k > 1:
        # group by aggregator, from `first` on, keeping the order within each group: taken columns go
        # to the end of queue as scratch (queue[kept:kept + k] is free)
        start = 0
        for j in range(aggregators):
            a = (first + j) % aggregators
            n_a = per_agg[a]
            per_agg[a] = start
            start += n_a
        for t in range(k):
            queue[kept + t] = cols[t]
        for t in range(k):
            c = queue[kept + t]
            a = c % aggregators
            cols[per_agg[a]] = c
            per_agg[a] += 1
    return k, paced, min(held, quantum), resume, kept


@njit(**JIT)
def admit(round_block, window):
    """The worker's window (R-L6): the shortest prefix of the columns, in index order (the same on
    every worker), that holds `window` columns which have not reached END, or all of them."""
    S = round_block.shape[0]
    admitted = 0
    open_ = 0
    while admitted < S and open_ < window:
        if round_block[admitted] != END:
            open_ += 1
        admitted += 1
    return admitted


@njit(**JIT)
def take_expired(round_block, cols, aggregators, deadline, sent_at, resent, rto, allow, max_rto, now):
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
                sent_at[c] = now
                resent[c] = True
                k += 1
    return k


@njit(**JIT)
def tail_candidates(st, probe_of):
    """R-L8: per aggregator a, into probe_of[a], the column that its next tail probe would resend (-1:
    none): of its rounds in flight (sent, without a result), with both tail probes left the one sent
    last, with one left the one sent first."""
    probe_of[:] = -1
    A = probe_of.shape[0]
    round_block, deadline, order, armed = st.round_block, st.deadline, st.sent_order, st.tail_armed
    for c in range(round_block.shape[0]):
        if round_block[c] != END and deadline[c] < np.inf:
            a = c % A
            p = probe_of[a]
            if p < 0 or (order[c] > order[p] if armed[a] == TAIL_PROBES else order[c] < order[p]):
                probe_of[a] = c


@njit(**JIT)
def next_timer(st, due_by):
    """When the worker's timers next need a look: per aggregator, the earliest timer of its columns
    still in progress, once the aggregator has been quiet for its base_rto; with a probe out, the probe's
    own timer; after a confirmed loss, the earliest timer (docs/protocol.md, "Loss recovery"); or, with
    a tail probe left, its tail_pto after the aggregator was last heard from or the round that the tail
    probe would resend was sent, whichever came later (R-L8).

    Where that time is after `due_by`, a time after `due_by` and no later than it may come instead: an
    aggregator's term is never before its probe's timer or, without a confirmed loss, before it was last
    heard from + its base_rto (or + its tail_pto, armed), and while those all lie past `due_by` the scan over
    every column is skipped (the driver loop asks after every batch only whether anything is due by now,
    and how long it may wait: waking at the bound costs one more look). due_by = inf: always the time
    itself."""
    probe, loss_confirmed, last_heard, armed = st.probe, st.loss_confirmed, st.last_heard, st.tail_armed
    deadline, round_block = st.deadline, st.round_block
    base_rto, pto = st.base_rto, st.tail_pto
    aggregators = probe.shape[0]
    bound = np.inf
    exact = False
    for a in range(aggregators):
        if probe[a] >= 0:
            bound = min(bound, deadline[probe[a]])
        elif loss_confirmed[a]:
            exact = True
        else:
            bound = min(bound, last_heard[a] + (min(pto[a], base_rto[a]) if armed[a] else base_rto[a]))
    if not exact and bound > due_by:
        return bound
    first = np.full(aggregators, np.inf)
    for c in range(round_block.shape[0]):
        if round_block[c] != END and deadline[c] < first[c % aggregators]:
            first[c % aggregators] = deadline[c]
    probe_of = np.empty(aggregators, np.int64)
    if pto.min() < np.inf:
        tail_candidates(st, probe_of)
    t = np.inf
    for a in range(aggregators):
        if probe[a] >= 0:
            d = deadline[probe[a]]
        elif loss_confirmed[a]:
            d = first[a]
        else:
            d = max(first[a], last_heard[a] + base_rto[a])
            if pto[a] < np.inf and armed[a] and probe_of[a] >= 0:      # (then tail_candidates ran)
                d = min(d, max(last_heard[a], st.sent_at[probe_of[a]]) + pto[a])
        t = min(t, d)
    return t


@njit(inline="always", **JIT)
def recovery_timer(st, due_by=np.inf):
    """When loss recovery next needs poll(): a column's timer expired while its aggregator is quiet, or
    the allreduce timed out (R-L1, R-L2, R-L5); inf when done. With `due_by`: where that is later than
    due_by, possibly an earlier time still after due_by (next_timer)."""
    if st.i[I_REMAINING] == 0:
        return np.inf
    t = next_timer(st, due_by)
    return min(t, st.f[F_LAST_PROGRESS] + st.f[F_TIMEOUT])


@njit(inline="always", **JIT)
def timer(st):
    """When the machine next needs a look: loss recovery's timer (poll), or the pacer's next send (flush,
    R-C7); inf when done."""
    if st.i[I_REMAINING] == 0:
        return np.inf
    return min(recovery_timer(st), pace_timer(st), drain_timer(st))
