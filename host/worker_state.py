"""The worker's state record for one allreduce, as its compiled kernels see it.

AllreduceMachine (zerosum.worker_machine) owns the arrays and documents what they hold; the kernels of
zerosum.worker_kernels (the data path and the driver loop), zerosum.worker_rounds (which rounds go next,
the timers) and zerosum.congestion (round trips, loss detection, the congestion window and the pacer) read and write them through this record and its indices, so that a field is
declared once.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class WorkerState(NamedTuple):
    """An allreduce's state as the kernels see it (AllreduceMachine owns it; see its docstring)."""
    hdr: np.ndarray            # int64 [6]: job, rank, world, epoch, tensor_blocks, block_size
    round_block: np.ndarray    # int64 [S]: per column, the block of its current round (BOOT, END)
    round_exp: np.ndarray      # int64 [S]: its agreed exponent
    mine_pos: np.ndarray       # int64 [S]: position in own of the column's own next non-zero block
    col_stop: np.ndarray       # int64 [S]: end of the column's run in own
    own: np.ndarray            # int64 [k + 1, 3]: own non-zero blocks by (column, block), each (block,
    #                            exponent, row in src) side by side (OWN_*), then (END, -, -)
    src: np.ndarray            # float32 or uint32: the input values
    ready: np.ndarray          # bool [S]: the next round's entry is still to send
    queue: np.ndarray          # int64 [S]: the ready columns, i[I_QUEUED] of them, in the order their
    #                            results arrived, which flush_ready keeps (R-A8)
    deadline: np.ndarray       # float64 [S]: retransmission timers (R-L1)
    rto: np.ndarray            # float64 [S]
    sent_at: np.ndarray        # float64 [S]: the round's latest transmission (NaN: not sent yet)
    sent_order: np.ndarray     # int64 [S]: that transmission's place in this worker's sending order (the
    #                            rounds of one flush share sent_at; R-L8 must know which went first)
    resent: np.ndarray         # bool [S]: the round was retransmitted: no round-trip sample from it
    #                            (Karn's rule), and its result does not say what was delivered (R-C4)
    ready_at: np.ndarray       # float64 [S]: when the round could first be sent: its previous result
    #                            arrived (the allreduce's start for the bootstrap; R-C4)
    waiting_for: np.ndarray    # int64 [S]: bitmap of the last STATUS (ranks heard), -1: probe pending,
    #                            ASKED: resent to ask after a round the aggregator had said it holds (R-C4, R-L8)
    status_seen: np.ndarray    # bool [S]
    probe: np.ndarray          # int64 [A]: the column sent alone to test for loss (R-L2), -1: none
    loss_confirmed: np.ndarray  # bool [A]
    tail_armed: np.ndarray     # int64 [A]: the tail probes left until the aggregator's next RESULT (R-L8)
    last_heard: np.ndarray     # float64 [A]
    # per aggregator, the latest first transmission whose RESULT arrived (R-C4: rounds do not overtake
    # each other on a path, but one aggregator's rounds may well overtake another's): when it was sent
    # (0: none yet), when it could first be sent (its ready_at), and its column
    delivered_sent: np.ndarray     # float64 [A]
    delivered_ready: np.ndarray    # float64 [A]
    delivered_column: np.ndarray   # int64 [A]
    # per aggregator, its path's round-trip estimate (RFC 6298 keeps one per path; an aggregator further
    # away, or one that waits for a core, answers later than another): the smoothed round trip (NaN: none
    # measured yet), its variation, the base retransmission timeout (R-L1) and, as of the last flush, how
    # long it may be quiet before a tail probe goes out (R-L8; inf: none)
    srtt: np.ndarray           # float64 [A]
    rttvar: np.ndarray         # float64 [A]
    base_rto: np.ndarray       # float64 [A]
    tail_pto: np.ndarray       # float64 [A]
    # per aggregator, the least round trip of its path (past bootstraps; inf: none yet), of this
    # measurement epoch's rounds (R-C3) and of the rounds sent while draining (R-C8): a queue is a round
    # trip above its own path's least, not above another aggregator's
    min_rtt: np.ndarray        # float64 [A]
    epoch_min: np.ndarray      # float64 [A]
    drain_min: np.ndarray      # float64 [A]
    # per aggregator, R-C4's reordering window's multiple (RFC 8985, section 6.2.4: spurious retransmissions
    # widen it, 16 clean loss detections reset it), the clean detections since it last widened, and the
    # measurement epoch it last widened in (NaN: none; at most once per epoch): one path's late rounds
    # say nothing of another's
    reo_mult: np.ndarray       # int64 [A]
    reo_clean: np.ndarray      # int64 [A]
    reo_epoch: np.ndarray      # float64 [A]
    slots_used: np.ndarray     # int64 [A]
    allow: np.ndarray          # int64 [A]: scratch for take_expired and take_ready
    cols: np.ndarray           # int64 [S]: scratch: columns to send
    order: np.ndarray          # int64 [S]: scratch: their order in datagrams (worker_kernels.pack_entries)
    seen: np.ndarray           # int64: scratch for check_slots
    out: np.ndarray            # uint8: datagrams to send
    cuts: np.ndarray           # int64 [S + A, 3]: (aggregator, start, end) in out
    values: np.ndarray         # float32 or int32: where sums go (DenseResult/CollectedBlocks .flat)
    blocks_out: np.ndarray     # int64: with collect, the block of each row of values
    counts: np.ndarray         # int64 [N_COUNTS]: duplicates, rows used, columns done, union blocks, the
    #                            congestion samples of the last datagram and its STATUS entries (apply_datagram)
    f: np.ndarray              # float64 [F_*]
    i: np.ndarray              # int64 [I_*]
    drops: np.ndarray          # int64 [len(WORKER_DROPS)]


# f[]: timing and the congestion window
(F_MIN_RTO, F_MAX_RTO, F_LAST_PROGRESS, F_TIMEOUT, F_DIVISOR,
 F_CWND, F_SSTHRESH, F_NEXT_CUT, F_TARGET, F_CAP, F_EPOCH_START,
 F_QUEUE, F_PRIOR_CWND, F_PRIOR_SSTHRESH, F_PACE_CREDIT, F_PACE_AT, F_WALL_CLOCK, F_DRAIN_PERIOD,
 F_DRAIN_SLOT, F_DRAIN_START, F_DRAIN_END, F_DRAIN_CWND, F_RACK_FROM, F_HOST_WAIT,
 F_HOST_WAIT_AT, F_OTHER_QUEUE) = range(26)
N_F = F_OTHER_QUEUE + 1
# i[]: everything else
(I_STAMP, I_ADMITTED, I_WINDOW, I_REMAINING, I_IS_INT, I_PRECISION, I_COLLECT, I_MAX_DATAGRAM, I_MAX_ENTRIES,
 I_BAD_BLOCK, I_EVENT_AGG, I_BYTES_SENT, I_DATAGRAMS_SENT, I_BYTES_RECEIVED,
 I_DATAGRAMS_RECEIVED, I_SOURCE_N, I_VIOLATION, I_CONGESTION, I_ENTRY, I_DELAY_CUTS, I_LOSS_CUTS,
 I_SPURIOUS, I_MARKS, I_EPOCH_MARKED, I_MARKED, I_PACING, I_PACE_HELD, I_PACE_FROM,
 I_COMPETITIVE, I_DRAINS, I_QUEUED, I_SENT_ENTRIES, I_STREAM) = range(33)
N_I = I_STREAM + 1
N_COUNTS = 10   # WorkerState.counts (apply_datagram says what each holds)
# WorkerState.own's fields, side by side because every entry of a round reads them together: in three
# arrays, each read was a cache miss of its own wherever the columns' runs differ in length
OWN_BLOCK, OWN_EXP, OWN_ROW = range(3)
# WorkerState.waiting_for of a round resent although a STATUS had said that the aggregator holds it: its
# RESULT may have been lost (R-C4, R-L8); a STATUS that answers it is no spurious retransmission
ASKED = -2
TAIL_PROBES = 2     # R-L8: per quiet spell of an aggregator: the round sent last, then the first
# F_QUEUE: the last epoch's verdict, the largest queue over the aggregators' paths (R-C3).
# I_MARKS: datagrams that came with an ECN mark, echoed or their own; I_EPOCH_MARKED: one came in this
# measurement epoch; I_MARKED: the last epoch's verdict was a mark (R-C6). F_PACE_CREDIT: the pacer's
# bucket in bytes, as of F_PACE_AT; I_PACING: the pacer is on; I_PACE_HELD: the last flush left columns
# ready for want of credit (the columns the bucket must hold before the next send); I_PACE_FROM: the
# aggregator whose columns the next flush takes first (R-C7).
# F_WALL_CLOCK: wall-clock time minus the driver's clock (drains start on the wall clock's period, R-C8);
# F_DRAIN_SLOT: the last period drained (or, -inf, none seen yet); F_DRAIN_START/END: the drain under way
# (END -inf: none; its least round trips: drain_min); F_DRAIN_CWND: the window it will restore;
# F_RACK_FROM: loss detection judges only rounds sent since (R-C8); F_HOST_WAIT: the longest a datagram
# waited in this worker's socket before it was read, fading by half every HOST_WAIT_HALF_LIFE, as of
# F_HOST_WAIT_AT (R-C4); F_OTHER_QUEUE: the queue that the last drain which found one saw: another
# flow's (R-C8);
# I_COMPETITIVE: drains that must find the queue empty before the path's delay target counts again (0: it
# does; R-C8);
# I_DRAINS: drains so far; I_SENT_ENTRIES: entries sent so far (sent_order's counter)
# I_STREAM: sums go into the output with non-temporal stores (an output larger than the caches; zerosum.stores)
# what a worker drops, by name (AllreduceMachine.drops)
WORKER_DROPS = ("short", "version", "type", "foreign", "stale_epoch", "geometry", "length", "flags", "exponent",
                "range", "duplicate_result", "unknown_source")
(D_SHORT, D_VERSION, D_TYPE, D_FOREIGN, D_STALE_EPOCH, D_GEOMETRY, D_LENGTH, D_FLAGS, D_EXPONENT, D_RANGE,
 D_DUPLICATE, D_UNKNOWN_SOURCE) = range(12)
