"""The worker's timing, compiled: the retransmission timeout (RFC 6298), the congestion window (R-C1..R-C6,
R-C8) and the pacer (R-C7) of docs/protocol.md.

Each function updates the allreduce's state record (zerosum.worker_state) from what the driver loop
(zerosum.worker_kernels) saw: a round trip, rounds delivered, a loss, an ECN mark, the host's own wait. The
driver asks it how many columns the window admits, how many the pacer lets go now and when it next
needs a look; the machine (zerosum.worker_machine) carries its estimates from one allreduce to the next.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .spec import MAX_DATAGRAM
from .wire import BOOT, END, HDR, JIT
from .worker_state import (
    ASKED, F_CAP, F_CWND, F_DRAIN_CWND, F_DRAIN_END, F_DRAIN_PERIOD, F_DRAIN_SLOT,
    F_DRAIN_START, F_EPOCH_START, F_HOST_WAIT, F_HOST_WAIT_AT, F_MAX_RTO, F_MIN_RTO,
    F_NEXT_CUT, F_OTHER_QUEUE, F_PACE_AT, F_PACE_CREDIT, F_PRIOR_CWND, F_PRIOR_SSTHRESH, F_QUEUE, F_RACK_FROM,
    F_SSTHRESH, F_TARGET, F_WALL_CLOCK, I_ADMITTED, I_COMPETITIVE,
    I_CONGESTION, I_DELAY_CUTS, I_DRAINS, I_ENTRY, I_EPOCH_MARKED, I_LOSS_CUTS, I_MARKED, I_MARKS,
    I_MAX_DATAGRAM, I_MAX_ENTRIES, I_PACE_FROM, I_PACE_HELD, I_PACING, I_SPURIOUS,
    I_WINDOW)


@njit(inline="always", **JIT)
def measure(st, a, r):
    """Adapt aggregator a's retransmission timeout to a round-trip sample from it (RFC 6298, section 2;
    one estimate per path: an aggregator further away, or one that waits for a core, answers later than
    another, and one estimate over both had the nearer one's timers expire the further one's rounds)."""
    if math.isnan(st.srtt[a]):
        st.srtt[a] = r
        st.rttvar[a] = r / 2
    else:
        st.rttvar[a] = 0.75 * st.rttvar[a] + 0.25 * abs(st.srtt[a] - r)
        st.srtt[a] = 0.875 * st.srtt[a] + 0.125 * r
    update_rto(st, a)


@njit(inline="always", **JIT)
def update_rto(st, a):
    """Aggregator a's base timeout from its estimate: srtt + 4 rttvar (RFC 6298, 2.3), the variation term at
    least min_rto, the whole at most max_rto. Linux floors the term, not the sum (tcp_rtt_estimator keeps
    rttvar at least tcp_rto_min): on a steady path rttvar decays to nothing, and a floor under the sum
    lets a path longer than it time out at a hiccup of a fraction of a millisecond."""
    f = st.f
    st.base_rto[a] = min(st.srtt[a] + max(4 * st.rttvar[a], f[F_MIN_RTO]), f[F_MAX_RTO])


@njit(inline="always", **JIT)
def longest_srtt(st):
    """The longest smoothed round trip over the aggregators measured (NaN: none yet): the congestion window
    and the drain (R-C3, R-C8) are one for all of them, and see the effect of what they do after that."""
    t = -np.inf
    for a in range(st.srtt.shape[0]):
        if st.srtt[a] > t:          # (false for NaN: not measured)
            t = st.srtt[a]
    return t if t > -np.inf else np.nan


# -- the congestion window (docs/protocol.md, R-C1..R-C6, R-C8) -----------------------------------------

INITIAL_WINDOW = 10     # entries (R-C1; TCP's initial window of ten segments, RFC 6928)
DELAY_GAIN = 0.8        # R-C3: the cut per unit of relative excess delay (Swift, SIGCOMM'20, beta)
MAX_DELAY_CUT = 0.5     # R-C3: at most half the window per round trip
EPOCH_MIN = 0.01        # R-C3: a measurement epoch lasts at least this long: longer than the time a process
#                         that shares its cores may wait for one (a rank that waits delays every rank's round)
LOSS_CUT = 0.5          # R-C4: a loss behind a queue
RANDOM_LOSS_CUT = 0.8   # R-C4: a loss with no queue to speak of (TCP Veno, JSAC 2003, section II.B: 4/5)
ECN_CUT = 0.5           # R-C6: an epoch with an ECN mark (RFC 3168, section 6.1.2: as a loss, by half)
MAX_REORDER_MULT = 16   # R-C4: the reordering window grows to at most 16x (RFC 8985, section 6.2.4)
REORDER_RESET = 16      # R-C4: back to 1x after this many loss detections without a spurious one
DRAIN_PERIOD = 1.0      # R-C8: every worker drains at each multiple of this many seconds of the wall clock
DRAIN_TIME = 0.02       # R-C8: a drain lasts two smoothed round trips in whole multiples of this
DRAIN_MAX = 0.2         # R-C8: and at most this long (BBR's ProbeRTT: 200 ms)
DRAIN_WINDOW = 2        # R-C8: entries in flight while draining (BBR's ProbeRTT: 4 packets)
COMPETITIVE_DRAINS = 3  # R-C8: drains in a row that find the queue empty before the delay target is the
#                         path's again (beside TCP, two in a row came every few seconds, each followed by ~1 s
#                         of yielding)
COMPETITIVE_CUT = 0.5   # R-C8: the loss cut beside a flow that does not yield (Reno's, RFC 5681)
HOST_WAIT_HALF_LIFE = 10.0  # R-C4: the host's longest wait counts half after this many seconds (with
#                             1 s, a 10 % row on veth links still resent 30-99 entries that were not lost)


@njit(**JIT)
def set_window(st):
    """The window in columns from the congestion window in bytes: at least one column (R-C5)."""
    S = st.round_block.shape[0]
    st.i[I_WINDOW] = max(1, min(S, np.int64(st.f[F_CWND] // st.i[I_ENTRY])))


@njit(**JIT)
def cut_window(st, factor, now):
    """Multiply the window by `factor` and leave slow start; at most once per round trip (R-C3, R-C4)."""
    f = st.f
    f[F_CWND] = max(f[F_CWND] * factor, np.float64(st.i[I_ENTRY]))
    f[F_SSTHRESH] = f[F_CWND]
    f[F_PRIOR_CWND] = 0.0           # only a loss cut can be undone (on_spurious)
    rtt = longest_srtt(st)
    f[F_NEXT_CUT] = now + (st.base_rto.max() if math.isnan(rtt) else rtt)
    set_window(st)


@njit(inline="always", **JIT)
def queue_target(st):
    """The queue that the window may build (R-C3): the delay target; beside a flow that keeps a queue of its
    own (R-C8), as much again as that flow kept while ZeroSum drained, plus the target. A FIFO queue serves
    its flows in proportion to the bytes each holds in it, so holding as much as the other flow is an even
    split (the target on top: a round trip here also holds the hosts' waits, which the drain's light load
    did not). Against a flow that fills the buffer until it overflows, that much does not fit, and losses
    decide, as between loss-based flows."""
    return 2.0 * st.f[F_OTHER_QUEUE] + st.f[F_TARGET] if st.i[I_COMPETITIVE] else st.f[F_TARGET]


@njit(inline="always", **JIT)
def largest_queue(st, least):
    """The largest queue over the aggregators' paths, least[a] - min_rtt[a] for each aggregator a with a
    round trip in `least` (inf: none), and that path's round trip: (-inf, inf) where none has one."""
    queue, rtt = -np.inf, np.inf
    for a in range(least.shape[0]):
        if least[a] < np.inf and least[a] - st.min_rtt[a] > queue:
            queue, rtt = least[a] - st.min_rtt[a], least[a]
    return queue, rtt


@njit(**JIT)
def end_epoch(st, now):
    """R-C3: the delay verdict, once per measurement epoch (one round trip: from the epoch's start until a
    round sent after it completes), on the least round trip of the epoch. A round's trip includes waiting
    for every other rank's entry, so one rank's retransmission delays every rank's samples of that round;
    the least over a round trip's worth of rounds is the path's queue, not such a wait (the min filter of
    TCP Vegas and BBR). Each aggregator's path is measured against its own least round trip, and the
    window, one for all of them, answers to the largest queue: against the least over every path, an
    aggregator 10 ms further than another was a standing queue, and the window was cut 49 times in a
    0.34 s allreduce, which then took 1.39 s."""
    f, i = st.f, st.i
    f[F_EPOCH_START] = now
    queue, rtt = largest_queue(st, st.epoch_min)
    st.epoch_min[:] = np.inf
    if not np.isfinite(rtt) or not i[I_CONGESTION]:
        return                      # without the window, epochs only pace R-C4's reordering window
    # R-C6: an ECN mark in the epoch is a verdict above the target, whatever the delay: a queue on the
    # path passed a switch's threshold (ATP, NSDI'21). Judged here, once per epoch, so that a burst of
    # marks costs one cut.
    marked = i[I_EPOCH_MARKED] != 0
    i[I_EPOCH_MARKED] = 0
    i[I_MARKED] = marked
    f[F_QUEUE] = queue
    excess = f[F_QUEUE] - queue_target(st)
    if (marked or excess > -0.5 * f[F_TARGET]) and f[F_CWND] < f[F_SSTHRESH]:
        f[F_SSTHRESH] = f[F_CWND]   # the queue grows: leave slow start before it overshoots (HyStart)
    if (marked or excess > 0.0) and now >= f[F_NEXT_CUT]:
        i[I_DELAY_CUTS] += 1
        factor = max(1.0 - DELAY_GAIN * excess / rtt, 1.0 - MAX_DELAY_CUT) if excess > 0.0 else 1.0
        cut_window(st, min(factor, ECN_CUT) if marked else factor, now)


@njit(**JIT)
def on_mark(st):
    """R-C6: a RESULT or STATUS came with the CONGESTION flag (a contribution of its round was marked
    on the way to the aggregator, R-E1) or itself arrived marked CE: noted for the epoch's verdict."""
    st.i[I_MARKS] += 1
    st.i[I_EPOCH_MARKED] = 1


@njit(inline="always", **JIT)
def on_rounds(st, a, acked, rtt, now, sent):
    """`acked` rounds past the bootstrap completed at aggregator a, the quickest of those sent once took
    `rtt` seconds and the latest of them was sent at `sent` (both negative: none). R-C2: the window grows
    while the last epoch's queue stayed within the target, by one entry per completed round in slow start
    and by one entry per window's worth of rounds after (Reno's additive increase), and only while the
    window, not the tensor, limits what is in flight. R-C3: the epoch's verdict (end_epoch)."""
    f, i = st.f, st.i
    entry = np.float64(i[I_ENTRY])
    if f[F_DRAIN_END] > -np.inf:    # draining (R-C8): only the round trips count
        if rtt >= 0.0:
            st.min_rtt[a] = min(st.min_rtt[a], rtt)
            if sent >= f[F_DRAIN_START]:
                st.drain_min[a] = min(st.drain_min[a], rtt)
        return
    if rtt >= 0.0:
        st.min_rtt[a] = min(st.min_rtt[a], rtt)
        st.epoch_min[a] = min(st.epoch_min[a], rtt)
        if sent >= f[F_EPOCH_START] and now >= f[F_EPOCH_START] + EPOCH_MIN:
            end_epoch(st, now)
    if not i[I_CONGESTION]:
        return                      # no window: the rounds are only loss detection's samples (R-C4)
    if f[F_QUEUE] > queue_target(st) or st.i[I_MARKED]:
        return                      # above the target: no growth until an epoch says otherwise
    if i[I_ADMITTED] >= st.round_block.shape[0]:
        return                      # every column is admitted: the window is not what limits
    if f[F_CWND] < f[F_SSTHRESH]:
        f[F_CWND] += acked * entry / (st.hdr[2] if i[I_COMPETITIVE] else 1)
    else:
        grow = acked * entry * entry / f[F_CWND]
        if i[I_COMPETITIVE]:
            # R-C8: the W ranks of a job are W flows into the aggregator's link; AIMD's rate goes with
            # the square root of its increase (Floyd, Handley & Padhye, ICSI TR-00-002, 2000, section 2),
            # so W ranks growing by 1/W² of an entry per round trip take together what one Reno flow takes
            grow /= st.hdr[2] * st.hdr[2]
        f[F_CWND] += grow
    f[F_CWND] = min(f[F_CWND], f[F_CAP])
    set_window(st)


@njit(inline="always", **JIT)
def host_wait(st, now):
    """R-C4: the longest a datagram waited in this worker's socket before it was read (its arrival stamp
    against the time of reading), halved for every HOST_WAIT_HALF_LIFE since."""
    return st.f[F_HOST_WAIT] * 0.5 ** ((now - st.f[F_HOST_WAIT_AT]) / HOST_WAIT_HALF_LIFE)


@njit(inline="always", **JIT)
def note_host_wait(st, wait, now):
    """R-C4: a datagram read `wait` seconds after it arrived (this worker was behind, or waited for a
    core: so, likely, do the ranks that share its cores, and every round waits for the latest)."""
    if wait > host_wait(st, now):
        st.f[F_HOST_WAIT] = wait
        st.f[F_HOST_WAIT_AT] = now


@njit(inline="always", **JIT)
def reordering_window(st, a, now):
    """R-C4: how much later than a round to aggregator a a delivered one may have been sent before the
    round counts as lost: a quarter of its path's least round trip (RFC 8985, section 6.2), at least the
    delay target and this host's longest recent wait, times the multiple that spurious retransmissions
    to it widen."""
    f = st.f
    return max(0.25 * st.min_rtt[a], f[F_TARGET], host_wait(st, now)) * st.reo_mult[a]


@njit(inline="always", **JIT)
def least_rtt(st):
    """The least round trip over the aggregators' paths (inf: none measured)."""
    return st.min_rtt.min()


@njit(**JIT)
def tail_probe_timeout(st, a, now):
    """R-L8: how long aggregator a may be quiet, while rounds this worker sent to it await their results,
    before a tail probe goes out (RFC 8985, section 7.2: two smoothed round trips of its path), plus the
    reordering window (a round waits for every rank's entry, and ranks on shared cores send theirs that
    far apart). inf before a round trip to it was measured, or where its retransmission timeout (R-L1)
    comes no later."""
    if math.isnan(st.srtt[a]):
        return np.inf
    pto = 2.0 * st.srtt[a] + reordering_window(st, a, now)
    return pto if pto < st.base_rto[a] else np.inf


@njit(**JIT)
def judged_columns(st, delivered_column):
    """How many columns, from column 0, loss detection may judge after a result of `delivered_column`
    (R-C4, R-L8): only columns up to it, which every rank had admitted (R-L6: prefixes of one order),
    while a column past it may be one that a rank with a smaller window has not sent yet; with no window
    at all (every column admitted, none ever held back) a job's ranks admit every column."""
    S = st.round_block.shape[0]
    if not st.i[I_CONGESTION] and st.i[I_WINDOW] >= S:
        return S
    return min(st.i[I_ADMITTED], delivered_column + 1)


@njit(**JIT)
def detect_loss(st, now):
    """R-C4, without waiting for a timer (RACK, RFC 8985, section 6.2), with or without the congestion
    window: a round last sent more than the reordering window (a quarter of its path's least round trip,
    at least the delay target and this host's longest recent wait) before one whose result has arrived from
    the same aggregator, that could be sent no later than that one, and still without its own result, is
    taken as lost. Rounds do not overtake each other on a path, but a round also waits for every other
    rank's entry, and ranks on shared cores send their entries milliseconds apart: the window must cover
    that skew, or every late rank looks like a loss. Each aggregator is a path of its own: one that waits
    for a core while another runs returns its rounds later than the other's, which says nothing of a
    loss (judged against any aggregator's latest, two aggregator processes on two cores had 94-776
    entries resent in loss-free dense allreduces, all held). A retransmission is judged by when it was
    sent, so one lost again is found the same way (RFC 8985 keeps the latest transmission's time). A round
    the aggregator said it holds (STATUS) is judged too, a smoothed round trip later: it waits for an entry
    another rank lost, or it completed and its RESULT to this worker was lost, which only this worker can
    ask for (resent as ASKED: its STATUS answer is no spurious retransmission, and it cuts no window)."""
    f = st.f
    if f[F_DRAIN_END] > -np.inf:
        return
    # ... and could be sent no later than it: every rank sends a round once its previous result arrived
    # and the column is admitted, in the order the results arrived (R-A8), which is the same on every
    # rank, so every rank sent such a round before the delivered one. A round that became ready later,
    # even by a millisecond, may not have been: when this worker's window admitted the delivered round's
    # column late, ranks with a larger window had sent theirs long before, and it completed at once, while
    # rounds this worker sent before it still wait for a rank that is slow to send them (on veth links,
    # 1,554 entries resent in one episode, all held; and 232-308 when rounds that became ready 1.4-3.2 ms
    # after it still counted, "give or take" a reordering window that a 30 ms stall had widened).
    # R-C8: a round sent before the last drain began, or before a DRAIN_TIME after it ended, may wait for
    # a rank that drained earlier or longer; the retransmission timer (R-L2) still covers it
    since = f[F_RACK_FROM]
    rb, ready, sent_at, ready_at, deadline = st.round_block, st.ready, st.sent_at, st.ready_at, st.deadline
    status_seen, waiting_for = st.status_seen, st.waiting_for
    A = st.probe.shape[0]
    lost = False
    for a in range(A):
        if st.delivered_sent[a] <= 0.0:
            continue
        lost_here = False
        before = st.delivered_sent[a] - reordering_window(st, a, now)
        # a round the aggregator said it holds waits, if for an entry another rank lost, for that rank to
        # find the loss as this worker does and resend it: one round trip more before it is asked after
        held_before = before - st.srtt[a]
        delivered_ready = st.delivered_ready[a]
        for c in range(a, judged_columns(st, st.delivered_column[a]), A):    # column c: aggregator c % A
            if since <= sent_at[c] < (held_before if status_seen[c] else before) \
                    and ready_at[c] <= delivered_ready and rb[c] != END and rb[c] != BOOT and not ready[c]:
                deadline[c] = min(deadline[c], now)     # retransmitted at once (R-L2 without the probe)
                st.loss_confirmed[a] = True
                if status_seen[c]:
                    # the aggregator had said it holds this round: a rank's entry is lost (that rank resends
                    # it, and its window answers for its path), or the round completed and its RESULT to
                    # this worker is: only this worker can ask, and it is no evidence against this worker's
                    # path
                    waiting_for[c] = ASKED
                else:
                    lost_here = True
        if lost_here:       # a clean detection on this path (RFC 8985, section 6.2.4)
            lost = True
            st.reo_clean[a] += 1
            if st.reo_clean[a] >= REORDER_RESET:
                st.reo_mult[a] = 1
                st.reo_clean[a] = 0
    if lost:
        on_loss(st, now)


@njit(**JIT)
def on_loss(st, now):
    """R-C4: a confirmed loss (R-L2) cuts the window, once per round trip: by half when the last epoch saw a
    queue of at least half the delay target (the loss is the queue overflowing), by a fifth when it did
    not (the loss is more likely noise than congestion: TCP Veno's rule; a lossy path without a queue
    would otherwise hold the window at a few entries)."""
    if st.i[I_CONGESTION] and now >= st.f[F_NEXT_CUT]:
        st.i[I_LOSS_CUTS] += 1
        queued = st.f[F_QUEUE] >= 0.5 * st.f[F_TARGET] or st.i[I_MARKED] != 0
        prior_cwnd, prior_ssthresh = st.f[F_CWND], st.f[F_SSTHRESH]
        cut_window(st, COMPETITIVE_CUT if st.i[I_COMPETITIVE] else LOSS_CUT if queued else RANDOM_LOSS_CUT, now)
        if not st.i[I_COMPETITIVE]:     # beside a flow that fills the queue, losses are real
            st.f[F_PRIOR_CWND], st.f[F_PRIOR_SSTHRESH] = prior_cwnd, prior_ssthresh


@njit(**JIT)
def on_spurious(st, a, entries, now, held):
    """R-C4: aggregator a answered `entries` resent entries with STATUS (`held`: it held them already)
    or with a second RESULT of their round (it had finished it), so they were not lost (a retransmission
    or probe that another rank's lateness set off; either answer is to ZeroSum what a DSACK is to TCP).
    Undo the last loss cut, if no cut came after it (RFC 3522's response, Linux's DSACK undo), and widen
    that aggregator's reordering window by one step, at most once per epoch (RFC 8985, section 6.2.4; per
    path, as its least round trip is: another aggregator's rounds were not the late ones). Without the
    congestion window a STATUS widens nothing: every rank then sends every round as soon as its previous
    result arrived, in the order the results arrived, so a round still open behind a later one that
    completed lacks an entry that was lost at another rank (which resends it), not one still on its way;
    widening for it had grown the window to 16 times at 2 % loss, and every loss then waited for a timer."""
    f, i = st.f, st.i
    i[I_SPURIOUS] += entries
    if held and not i[I_CONGESTION]:
        return
    if i[I_CONGESTION] and f[F_PRIOR_CWND] > 0.0:
        f[F_CWND] = max(f[F_CWND], f[F_PRIOR_CWND])
        f[F_SSTHRESH] = max(f[F_SSTHRESH], f[F_PRIOR_SSTHRESH])
        f[F_PRIOR_CWND] = 0.0
        i[I_LOSS_CUTS] -= 1
        set_window(st)
    st.reo_clean[a] = 0
    if st.reo_epoch[a] != f[F_EPOCH_START]:
        st.reo_epoch[a] = f[F_EPOCH_START]
        st.reo_mult[a] = min(st.reo_mult[a] + 1, MAX_REORDER_MULT)


@njit(**JIT)
def drain_step(st, now):
    """R-C8, once per flush: start a drain when the wall clock passes a multiple of the drain period, end
    it when its time is up. Every worker of every job sharing a queue drains at the same moments (the
    period is counted on the wall clock, which the hosts of a cluster share within milliseconds), so
    the queue that they alone make empties, and each of them sees the path's least round trip: one
    that started behind another's queue took that queue for the path (the latecomer's advantage of
    delay-based control), and would hold it ever after. BBR's ProbeRTT drains for the same reason,
    synchronised by the drained queue rather than by a clock (Cardwell et al., ACM Queue 14(5), 2016)."""
    f, i = st.f, st.i
    rtt = longest_srtt(st)
    if not i[I_CONGESTION] or math.isnan(rtt):
        return
    if f[F_DRAIN_END] > -np.inf:
        if now >= f[F_DRAIN_END]:
            end_drain(st, now)
        return
    slot = math.floor((now + f[F_WALL_CLOCK]) / f[F_DRAIN_PERIOD])
    if f[F_DRAIN_SLOT] == -np.inf:
        f[F_DRAIN_SLOT] = slot          # the first period is not drained: the estimate is fresh
    if slot <= f[F_DRAIN_SLOT]:
        return
    f[F_DRAIN_SLOT] = slot
    # two smoothed round trips, in whole DRAIN_TIMEs from the period's start: the ranks of a job (whose
    # round trips are alike) end their drains together, as they began them; a rank that resumed alone
    # would send rounds that wait for the others' entries, which its loss detection takes for losses
    length = min(math.ceil(max(DRAIN_TIME, 2.0 * rtt) / DRAIN_TIME) * DRAIN_TIME, DRAIN_MAX)
    end = slot * f[F_DRAIN_PERIOD] - f[F_WALL_CLOCK] + length
    if now >= end:
        return
    i[I_DRAINS] += 1
    f[F_DRAIN_CWND] = f[F_CWND]
    f[F_DRAIN_START] = now
    f[F_DRAIN_END] = end
    f[F_RACK_FROM] = np.inf
    st.drain_min[:] = np.inf
    f[F_CWND] = min(f[F_CWND], np.float64(DRAIN_WINDOW * i[I_ENTRY]))
    set_window(st)


@njit(**JIT)
def end_drain(st, now):
    """R-C8: the drain is over: the window it saved comes back, and a new measurement epoch begins. The
    verdict: when the least round trip of the rounds sent while draining stayed more than half the delay
    target above the least seen on the same aggregator's path, the queue did not drain although every
    ZeroSum worker drained: a flow that does not yield to delay (TCP) keeps it. Until COMPETITIVE_DRAINS
    drains in a row find the queue empty, the window then grows from slow start, may build as much queue
    again as that flow keeps (queue_target) and is halved on loss, as loss-based flows are (Copa's
    competitive mode, Arun & Balakrishnan, NSDI'18, section 5: a delay target alone hands the link to such
    a flow)."""
    f, i = st.f, st.i
    f[F_CWND] = max(f[F_CWND], f[F_DRAIN_CWND])
    f[F_RACK_FROM] = f[F_DRAIN_END] + DRAIN_TIME   # ranks whose drains differ by one DRAIN_TIME
    f[F_DRAIN_END] = -np.inf
    f[F_EPOCH_START] = now
    st.epoch_min[:] = np.inf
    queue, _ = largest_queue(st, st.drain_min)      # the largest that the drain left on a path
    if queue > -np.inf:
        if queue > 0.5 * f[F_TARGET]:
            if not i[I_COMPETITIVE]:
                f[F_SSTHRESH] = np.inf
            i[I_COMPETITIVE] = COMPETITIVE_DRAINS
            f[F_OTHER_QUEUE] = queue
        elif i[I_COMPETITIVE]:
            i[I_COMPETITIVE] -= 1       # back to delay after COMPETITIVE_DRAINS drains that found no queue
    set_window(st)


@njit(inline="always", **JIT)
def drain_timer(st):
    """R-C8: when the drain under way ends (inf: none)."""
    return st.f[F_DRAIN_END] if st.f[F_DRAIN_END] > -np.inf else np.inf


# -- the pacer (docs/protocol.md, R-C7) ------------------------------------------------------------------

PACING_GAIN_SLOW_START = 2.0   # R-C7: Linux's sk_pacing_rate in slow start (tcp_pacing_ss_ratio, 200 %)
PACING_GAIN = 1.2              # R-C7: and in congestion avoidance (tcp_pacing_ca_ratio, 120 %)
PACING_QUANTUM = 0.001         # R-C7: the bucket holds 1 ms at the pacing rate (Linux's tcp_tso_autosize,
#                                sk_pacing_shift 10), the driver loop's wait being whole milliseconds (poll)
PACING_MIN_DATAGRAMS = 2       # R-C7: and at least two full datagrams (Linux's tcp_min_tso_segs)
_PACE_SLACK = 1e-3             # of a column: what float rounding may leave short at the pacer's own time


@njit(inline="always", **JIT)
def pacing_rate(st):
    """R-C7: the pacer's rate in bytes per second, gain x cwnd / rtt (RFC 9002, section 7.7; the gains
    are Linux's tcp_update_pacing_rate: twice the window per round trip while the window is under half
    of ssthresh, as slow start doubles it, 1.2 times after), where rtt is the nearest aggregator's least
    round trip plus the last epoch's queue (R-C3), not srtt, which rounds that waited for a rank with a
    smaller window raise; inf when there is no pacer (no congestion window), no round-trip sample yet, or
    a round trip under the bucket's time."""
    f = st.f
    rtt = least_rtt(st) + max(0.0, f[F_QUEUE])
    if not st.i[I_PACING] or not np.isfinite(rtt) or rtt <= 0.0:
        return np.inf
    gain = PACING_GAIN_SLOW_START if f[F_CWND] < 0.5 * f[F_SSTHRESH] else PACING_GAIN
    if gain * PACING_QUANTUM >= rtt:
        return np.inf   # the bucket would hold the whole window: a burst of it is what the pacer allows
    return gain * f[F_CWND] / rtt


@njit(inline="always", **JIT)
def entries_per_datagram(st):
    """The entries that fill one datagram (max_datagram, max_entries): the pacer's unit of release (R-C7)."""
    i = st.i
    return max(1, min(i[I_MAX_ENTRIES], (min(i[I_MAX_DATAGRAM], MAX_DATAGRAM) - HDR) // i[I_ENTRY]))


@njit(inline="always", **JIT)
def pacing_burst(st, rate):
    """R-C7: the bucket's size in bytes: 1 ms at `rate`, and at least two full datagrams of entries."""
    least = PACING_MIN_DATAGRAMS * entries_per_datagram(st) * st.i[I_ENTRY]
    return max(rate * PACING_QUANTUM, np.float64(least))


@njit(inline="always", **JIT)
def pace_budget(st, now):
    """R-C7: how many columns past their bootstrap may be sent now: the bucket, filled at the pacing rate
    since the last look and at most pacing_burst, holds one column's entry (the window's unit, R-C5) per
    column; the round-trip share of the window, spread out (RFC 9002's leaky bucket). Without a pacer,
    every column."""
    S = st.round_block.shape[0]
    rate = pacing_rate(st)
    if not np.isfinite(rate):
        return S
    f = st.f
    elapsed = max(0.0, now - f[F_PACE_AT])
    f[F_PACE_CREDIT] = min(pacing_burst(st, rate), f[F_PACE_CREDIT] + rate * elapsed)
    f[F_PACE_AT] = max(f[F_PACE_AT], now)
    return min(S, np.int64(f[F_PACE_CREDIT] / st.i[I_ENTRY] + _PACE_SLACK))


@njit(inline="always", **JIT)
def pace_sent(st, columns, held, resume):
    """R-C7: `columns` past their bootstrap were sent (their entries leave the bucket); `held` > 0: columns
    stayed ready for want of credit, and the next send waits until the bucket holds `held` columns' entries
    (the pacer's timer), and takes the columns in the order their results arrived (R-A8), grouped by
    aggregator from aggregator `resume` on."""
    i = st.i
    if i[I_PACING]:
        st.f[F_PACE_CREDIT] = max(0.0, st.f[F_PACE_CREDIT] - columns * i[I_ENTRY])
    i[I_PACE_HELD] = held
    i[I_PACE_FROM] = resume if held else 0


@njit(inline="always", **JIT)
def pace_timer(st):
    """R-C7: when the bucket holds the entries the last flush held back (at most a datagram's), if it held
    any; else inf."""
    if not st.i[I_PACE_HELD]:
        return np.inf
    f = st.f
    rate = pacing_rate(st)
    if not np.isfinite(rate):
        return f[F_PACE_AT]     # (cannot happen once a round trip was measured)
    return f[F_PACE_AT] + max(0.0, st.i[I_PACE_HELD] * st.i[I_ENTRY] - f[F_PACE_CREDIT]) / rate
