"""Tail probes (docs/protocol.md, R-L8) and loss detection of rounds the aggregator said it holds (R-C4),
on the sans-IO machines: two ranks, one aggregator, every datagram delivered at once unless a test drops
it, time advanced to the next timer when nothing moves."""
import numpy as np
import pytest

from zerosum import protocol as P
from zerosum.aggregator_machine import AggregatorMachine
from zerosum.blocks import BlockSource, DenseResult
from zerosum.layout import Layout
from zerosum.reference import reference_allreduce
from zerosum.worker_machine import AllreduceMachine, PathEstimate, WorkerConfig

from netsim import join_all

B = 4
# what an earlier allreduce measured: a 2 ms round trip, so the tail probe's timeout (2 srtt + the
# reordering window, at least the delay target) is under 10 ms, against R-L1's 50 ms at least
PATH = PathEstimate(srtt=0.002, rttvar=0.0005, cwnd=np.inf, ssthresh=np.inf, min_rtt=0.001)


def _machines(world=2, n=64, path=PATH, max_entries=0xFFFF, xs_of=None, windows=None, max_datagram=P.MAX_DATAGRAM):
    """An aggregator with 8 slots and the ranks' machines, starting from `path`; each rank's input is
    xs_of(rank) (default: 1..n times rank + 1); `windows`: each rank's fixed window in columns (default:
    none)."""
    agg = AggregatorMachine(1, world, slots=8)
    slots = join_all([agg], world, B)
    xs = [xs_of(r) if xs_of else np.arange(1, n + 1, dtype=np.float32) * (r + 1) for r in range(world)]
    ms = []
    for r, x in enumerate(xs):
        src = BlockSource.dense(x, B)
        window = None if windows is None else windows[r] * (P.ENTRY_SIZE + 4 * B)
        cfg = WorkerConfig(r, world, 1, block_size=B, timeout=100.0, max_entries=max_entries, window=window,
                           congestion=windows is None, max_datagram=max_datagram)
        ms.append(AllreduceMachine(cfg, 1, src, Layout(1, slots, src.nblocks), DenseResult(np.zeros(n, np.float32)),
                                   path=path))
    return agg, ms, xs


def _ends_a_column(d) -> bool:
    """Whether decoded datagram d is a RESULT that ends a column."""
    return d.header.type == P.RESULT and (d.next == P.END).any()


def _lose_the_first_result_that_ends_a_column(to_rank):
    """A `drop` for _run that loses the first RESULT to `to_rank` that ends a column; and the list
    that receives what it lost."""
    dropped = []

    def drop(rank, datagram):
        if rank == to_rank and not dropped and _ends_a_column(P.decode(datagram)):
            dropped.append(datagram)
            return True
        return False
    return drop, dropped


def _run(agg, ms, now=0.0, drop=lambda rank, datagram: False, until=10.0):
    """Run the machines until every one is done; `drop(rank, datagram)` says whether a datagram the
    aggregator sends to `rank` is lost. Returns the time reached."""
    for m in ms:
        if m.last_progress is None:
            m.begin(now)
    while not all(m.done for m in ms):
        moved = False
        for r, m in enumerate(ms):
            for _, d in m.datagrams_to_send(now):
                moved = True
                agg.receive(bytes(d), ("w", r), now)
            for dests, x in agg.datagrams_to_send(now):
                for _, rank in dests:
                    if not drop(rank, x):
                        ms[rank].receive(0, x, now)
        if not moved:
            now = max(now + 1e-4, min(m.timer() for m in ms if not m.done))
            assert now < until, "the machines did not finish"
    return now


def _exact(ms, xs):
    ref = reference_allreduce(xs, B).tobytes()
    return all(m.output.flat.tobytes() == ref for m in ms)


def test_a_lost_last_result_is_asked_for_after_the_tail_probes_timeout_not_the_retransmission_timer():
    """The RESULT that ends rank 0's eight columns is lost: no later round can reveal it (R-C4). Rank 0
    asks for its round sent last once the aggregator has been quiet for two round trips and the
    reordering window, not after R-L1's 50 ms; the aggregator answers from the shadow copy, and the seven
    rounds sent with it, overdue as well, are asked for at once (one by one, each after another quiet
    spell, the allreduce took 8 tail probes' timeouts)."""
    agg, ms, xs = _machines()
    drop, dropped = _lose_the_first_result_that_ends_a_column(0)
    end = _run(agg, ms, drop=drop)
    assert dropped and _exact(ms, xs)
    # everything else happened at 0.0; two round trips (of under 2 ms: srtt fell with the zero round
    # trips of this run) and the reordering window (5 ms) later the probe went out and was answered,
    # where R-L1's timer would have waited a round trip and 50 ms
    assert (ms[0].base_rto > 0.05).all() and 0.005 < end < 0.01
    assert ms[0].tail_probes == 1 and ms[0].retransmitted == 7 and ms[1].tail_probes == 0


def test_no_tail_probe_before_a_round_trip_was_measured():
    """Without a round-trip estimate there is no tail probe's timeout (RFC 8985 would wait a second):
    a first allreduce of one round per column after the bootstrap (which gives no sample) whose RESULT
    is lost waits for R-L1's first timeout and R-L2's probe, as before."""
    agg, ms, xs = _machines(path=None, n=32)
    drop, dropped = _lose_the_first_result_that_ends_a_column(0)
    end = _run(agg, ms, drop=drop)
    assert dropped and _exact(ms, xs)
    assert ms[0].tail_probes == 0 and ms[0].probes == 1 and end >= 0.2


def _sparse_machines(max_datagram=P.MAX_DATAGRAM):
    """Both ranks hold data in columns 0, 1 and 2 only (blocks 0-2 and 8-10 of 16; 8 columns), one
    entry per datagram; the bootstrap round is exchanged at 0.0, so those three columns' first rounds
    are ready to send, and the other columns have ended."""
    agg, ms, xs = _machines(max_entries=1, max_datagram=max_datagram, xs_of=lambda r: np.where(
        np.isin(np.arange(64) // B, [0, 1, 2, 8, 9, 10]), np.arange(1, 65, dtype=np.float32) * (r + 1), 0))
    for m in ms:
        m.begin(0.0)
    for r, m in enumerate(ms):
        for _, d in m.datagrams_to_send(0.0):
            agg.receive(bytes(d), ("w", r), 0.0)
    for dests, x in agg.datagrams_to_send(0.0):
        for _, rank in dests:
            ms[rank].receive(0, x, 0.0)
    assert all(m.remaining == 3 for m in ms)
    return agg, ms, xs


def _columns(datagrams) -> list[int]:
    return [int(s) for _, d in datagrams for s in P.decode(bytes(d)).slot]


def test_the_rounds_sent_before_a_tail_probes_round_are_resent_at_once_when_it_gets_a_result():
    """Rank 0's entries of its three columns' rounds are lost, sent 11-12 ms apart, and the aggregator
    goes quiet. The tail probe resends the round sent last; its RESULT says the aggregator is there, and
    the two rounds sent before it are resent at once, without another probe or timer."""
    agg, (m0, m1), xs = _sparse_machines()
    lost = m0.datagrams_to_send(0.001)
    assert _columns(lost) == [0, 1, 2]
    m0.st.sent_at[1], m0.st.sent_at[2] = 0.012, 0.024         # as if sent one by one, 11-12 ms apart
    for _, d in m1.datagrams_to_send(0.001):                  # rank 1's arrive, and wait for rank 0's
        agg.receive(bytes(d), ("w", 1), 0.001)
    assert agg.datagrams_to_send(0.001) == []
    pto = m0.st.tail_pto[0]
    assert 0.005 < pto < 0.01 and m0.timer() == pytest.approx(0.024 + pto)
    end = _run(agg, [m0, m1], 0.024, until=0.05)              # before any R-L1 timer (0.051)
    assert _exact([m0, m1], xs)
    assert m0.tail_probes == 1 and m0.probes == 1 and m0.retransmitted == 2
    assert end < 0.034


@pytest.mark.parametrize("max_datagram", [P.MAX_DATAGRAM, 1472])
def test_one_entry_per_datagram_keeps_the_order_a_tail_probes_result_judges_by(max_datagram):
    """One entry per datagram (a switch's size), of any length, keeps R-A8's order: rank 0's entry of
    column 2 is lost, and of rank 1's only column 2's arrives (rank 1 stalled after it, so it had sent
    columns 0 and 1 before it). The tail probe resends column 2's round, which completes, and the two
    rounds sent before it are overdue: resent at once (the aggregator held them)."""
    agg, (m0, m1), xs = _sparse_machines(max_datagram)
    sent = m0.datagrams_to_send(0.001)
    assert _columns(sent) == [0, 1, 2]
    for _, d in sent[:2]:                                     # column 2's is lost
        agg.receive(bytes(d), ("w", 0), 0.001)
    rank1 = m1.datagrams_to_send(0.001)
    agg.receive(bytes(rank1[2][1]), ("w", 1), 0.001)
    at = m0.timer()
    probe = m0.datagrams_to_send(at)
    assert _columns(probe) == [2] and m0.tail_probes == 1
    agg.receive(bytes(probe[0][1]), ("w", 0), at)
    later = []                                                # what reaches rank 1 once it is back
    for dests, x in agg.datagrams_to_send(at):
        for _, rank in dests:
            m0.receive(0, x, at) if rank == 0 else later.append(x)
    resent = [(a, bytes(d)) for a, d in m0.datagrams_to_send(at)]  # column 2's next round,
    resent += [(a, bytes(d)) for a, d in m0.datagrams_to_send(at)]  # then what is overdue
    assert sorted(_columns(resent)) == [0, 1, 2] and m0.retransmitted == 2
    for _, d in resent:
        agg.receive(bytes(d), ("w", 0), at)
    for dests, x in agg.datagrams_to_send(at):
        for _, rank in dests:
            m0.receive(0, x, at) if rank == 0 else later.append(x)
    m0.datagrams_to_send(at)
    assert m0.spurious_entries == 2                           # the aggregator held both
    for x in later:                                           # rank 1 is back
        m1.receive(0, x, at)
    for _, d in rank1[:2]:
        agg.receive(bytes(d), ("w", 1), at)
    _run(agg, [m0, m1], at, until=at + 0.5)
    assert _exact([m0, m1], xs)


def test_where_datagrams_are_filled_a_tail_probes_result_says_nothing_of_its_own_flush():
    """Datagrams of 68 bytes hold a data entry (32 bytes with 4-value blocks) and a header-only one,
    and rank 1, without data in column 2, fills its first datagram with column 2's header-only entry
    (Fusion): [0, 2], [1]. Rank 0 sends [0], [1], [2], and its entries of columns 0 and 2 are lost;
    rank 1 stalls after its first datagram. The tail probe resends column 2's round, which completes:
    that says nothing of the other rounds of the same flush. Column 1's waits for rank 1 and is not
    resent; column 0's, lost, is found once column 2's next round completes (R-C4)."""
    nonzero = {0: [0, 1, 2, 8, 9, 10], 1: [0, 1, 8, 9, 10]}
    agg, (m0, m1), xs = _machines(max_datagram=P.PACKET_HEADER_SIZE + 3 * P.ENTRY_SIZE, xs_of=lambda r: np.where(
        np.isin(np.arange(64) // B, nonzero[r]), np.arange(1, 65, dtype=np.float32) * (r + 1), 0))
    for m in (m0, m1):
        m.begin(0.0)
    for r, m in enumerate((m0, m1)):                          # the bootstrap round
        for _, d in m.datagrams_to_send(0.0):
            agg.receive(bytes(d), ("w", r), 0.0)
    for dests, x in agg.datagrams_to_send(0.0):
        for _, rank in dests:
            (m0, m1)[rank].receive(0, x, 0.0)
    sent = [bytes(d) for _, d in m0.datagrams_to_send(0.001)]
    rank1 = [bytes(d) for _, d in m1.datagrams_to_send(0.001)]
    assert [P.decode(d).slot.tolist() for d in sent] == [[0], [1], [2]]
    assert [P.decode(d).slot.tolist() for d in rank1] == [[0, 2], [1]]       # filled
    agg.receive(sent[1], ("w", 0), 0.001)                     # rank 0's columns 0 and 2 are lost
    agg.receive(rank1[0], ("w", 1), 0.001)                    # rank 1 stalls after its first datagram
    at = m0.timer()
    probe = [bytes(d) for _, d in m0.datagrams_to_send(at)]
    assert [P.decode(d).slot.tolist() for d in probe] == [[2]] and m0.tail_probes == 1
    agg.receive(probe[0], ("w", 0), at)
    later = []
    for dests, x in agg.datagrams_to_send(at):
        for _, rank in dests:
            m0.receive(0, x, at) if rank == 0 else later.append(x)
    assert m0.round_block[2] == 10                            # column 2's round completed
    nxt = [bytes(d) for _, d in m0.datagrams_to_send(at)] + [bytes(d) for _, d in m0.datagrams_to_send(at)]
    assert [P.decode(d).slot.tolist() for d in nxt] == [[2]] and m0.retransmitted == 0   # its next round only
    for d in nxt:
        agg.receive(d, ("w", 0), at)
    for x in later:                                           # rank 1 is back
        m1.receive(0, x, at)
    agg.receive(rank1[1], ("w", 1), at)
    end = _run(agg, [m0, m1], at, until=at + 0.5)
    assert _exact([m0, m1], xs)
    assert m0.retransmitted == 1 and m0.spurious_entries == 0      # column 0's, the lost one, only
    assert m0.tail_probes == 1 and end == at                   # no timer waited for


def test_after_a_status_the_second_tail_probe_asks_for_the_round_sent_first():
    """Rank 0 has two rounds in flight: column 0's, sent first, which a STATUS said the aggregator holds
    and which completed since, its RESULT to rank 0 lost; and column 1's, sent last, which waits for
    rank 1, busy elsewhere. The first tail probe (the round sent last) gets a STATUS, not counted as a
    spurious retransmission; the second asks after the round sent first, which no other rank can ask
    for, and its RESULT comes from the shadow copy."""
    agg, (m0, m1), xs = _sparse_machines()
    sent = m0.datagrams_to_send(0.001)
    assert _columns(sent) == [0, 1, 2]
    m0.st.sent_at[1:3] = 0.002
    for _, d in sent + sent[:1]:                              # column 0's twice: the aggregator holds it
        agg.receive(bytes(d), ("w", 0), 0.002)
    for _, x in agg.datagrams_to_send(0.002):
        m0.receive(0, x, 0.002)
    assert m0.st.status_seen[0] and m0.spurious_entries == 1
    rank1 = m1.datagrams_to_send(0.003)                       # rank 1: only column 0's arrives now
    agg.receive(bytes(rank1[0][1]), ("w", 1), 0.003)
    for dests, x in agg.datagrams_to_send(0.003):
        for _, rank in dests:
            if rank == 1:                                     # the RESULT to rank 0 is lost
                m1.receive(0, x, 0.003)
    first_at = m0.timer()
    pto = m0.st.tail_pto[0]
    assert 0.005 < pto < 0.01 and first_at == pytest.approx(0.002 + pto)
    first = m0.datagrams_to_send(first_at)
    assert _columns(first) in ([1], [2])                      # a round sent last
    agg.receive(bytes(first[0][1]), ("w", 0), first_at)
    answer = agg.datagrams_to_send(first_at)
    assert [P.decode(x).header.type for _, x in answer] == [P.STATUS]
    m0.receive(0, answer[0][1], first_at)
    assert m0.datagrams_to_send(first_at) == []               # (judges the answer)
    assert m0.spurious_entries == 1                           # a tail probe's STATUS is no spurious resend
    second_at = m0.timer()
    assert second_at == pytest.approx(first_at + pto)
    second = m0.datagrams_to_send(second_at)
    assert _columns(second) == [0]                            # the round sent first
    agg.receive(bytes(second[0][1]), ("w", 0), second_at)
    answer = agg.datagrams_to_send(second_at)
    assert [P.decode(x).header.type for _, x in answer] == [P.RESULT]   # from the shadow copy
    m0.receive(0, answer[0][1], second_at)
    assert m0.tail_probes == 2 and m0.retransmitted == 0
    for _, d in rank1[1:]:                                    # rank 1 is back
        agg.receive(bytes(d), ("w", 1), second_at)
    _run(agg, [m0, m1], second_at, until=second_at + 0.2)
    assert _exact([m0, m1], xs)


def test_a_tail_probe_asks_for_the_last_round_of_a_flush_and_the_rounds_sent_after_it_are_not_overdue():
    """Rank 0 sends its three columns' rounds in one flush (one send time), rank 1 waits for a core.
    The tail probe asks for the round that went out last, column 2's, whose STATUS says the aggregator
    waits for rank 1. Before, the tie went to column 0, sent first: rank 1, back, delivered column 0's
    entry just before the probe, whose RESULT then made columns 1 and 2, sent "no later", overdue, and
    both were resent although the aggregator held them (the dense bench resent 1,924 entries on each of
    three ranks so)."""
    agg, (m0, m1), xs = _sparse_machines()
    sent = m0.datagrams_to_send(0.001)
    assert _columns(sent) == [0, 1, 2] and len(set(m0.st.sent_at[:3])) == 1
    for _, d in sent:
        agg.receive(bytes(d), ("w", 0), 0.001)
    rank1 = m1.datagrams_to_send(0.001)                       # rank 1's entries wait in its host
    assert _columns(rank1) == [0, 1, 2]
    at = m0.timer()
    probe = m0.datagrams_to_send(at)
    assert _columns(probe) == [2] and m0.tail_probes == 1
    agg.receive(bytes(rank1[0][1]), ("w", 1), at)             # rank 1 is back: column 0's arrives first
    agg.receive(bytes(probe[0][1]), ("w", 0), at)
    for dests, x in agg.datagrams_to_send(at):
        for _, rank in dests:
            (m0 if rank == 0 else m1).receive(0, x, at)
    assert m0.round_block[0] == 8 and m0.st.status_seen[2]   # column 0 is past its round
    nxt = m0.datagrams_to_send(at)
    assert _columns(nxt) == [0] and m0.retransmitted == 0     # its next round; nothing overdue
    for _, d in nxt:
        agg.receive(bytes(d), ("w", 0), at)
    for _, d in rank1[1:]:
        agg.receive(bytes(d), ("w", 1), at)
    _run(agg, [m0, m1], at, until=at + 0.2)
    assert _exact([m0, m1], xs)
    assert m0.retransmitted == 0 and m0.spurious_entries == 0 and m1.retransmitted == 0


def test_after_a_tail_probe_columns_past_the_probed_one_are_not_overdue_where_windows_differ():
    """Fixed windows of 7 columns (rank 0) and 2 (rank 1). Rank 0 sends the first rounds of columns 0-6,
    then the second rounds of columns 0 and 1; rank 1 only ever sends columns 0 and 1, the prefix its window
    admits. The RESULT that ends columns 0 and 1 is lost to rank 0, and rank 1 waits for a core. Rank 0's
    tail probe asks for column 1's round, sent last, and the shadow copy answers. Column 0 is overdue (sent
    before it); columns 2-6, sent before it too, are not: rank 1's window has not admitted them (R-C4 judges
    only columns up to the delivered one's, which every rank has admitted), and resent they would only be
    held."""
    agg, ms, xs = _machines(windows=(7, 2))
    m0, m1 = ms

    def exchange(now, senders, lose_to_0=lambda d: False, to_1=True):
        held1 = []
        for r in senders:
            for _, d in ms[r].datagrams_to_send(now):
                agg.receive(bytes(d), ("w", r), now)
        for dests, x in agg.datagrams_to_send(now):
            for _, rank in dests:
                if rank == 0 and not lose_to_0(P.decode(x)):
                    m0.receive(0, x, now)
                elif rank == 1:
                    (m1.receive(0, x, now) if to_1 else held1.append(x))
        return held1

    for m in ms:
        m.begin(0.0)
    exchange(0.0, [0, 1])                                     # the bootstrap round
    exchange(0.001, [0, 1])                                   # first rounds: 0-6 and 0-1; 0 and 1 complete
    assert list(m0.round_block[:7]) == [8, 9, 2, 3, 4, 5, 6] and m0.st.ready[:2].all()
    # the second rounds of columns 0 and 1, which end them
    held = exchange(0.002, [0, 1], lose_to_0=_ends_a_column, to_1=False)
    assert held and list(m0.round_block[:2]) == [8, 9]        # rank 0 has not heard
    assert m0.st.sent_order[1] > m0.st.sent_order[2:7].max()
    at = m0.timer()
    probe = m0.datagrams_to_send(at)
    assert _columns(probe) == [1] and m0.tail_probes == 1
    agg.receive(bytes(probe[0][1]), ("w", 0), at)
    for _, x in agg.datagrams_to_send(at):
        assert P.decode(x).header.type == P.RESULT            # from the shadow copy
        m0.receive(0, x, at)
    # (the machine's datagrams are views into its buffer, valid until its next call)
    admitted = [(a, bytes(d)) for a, d in m0.datagrams_to_send(at)]   # column 1 ended: the window takes 7
    resent = [(a, bytes(d)) for a, d in m0.datagrams_to_send(at)]
    assert _columns(admitted) == [7] and m0.retransmitted == len(_columns(resent))
    assert _columns(resent) == [0]                            # column 0 only, asked after
    for _, d in admitted + resent:
        agg.receive(bytes(d), ("w", 0), at)
    for _, x in agg.datagrams_to_send(at):
        m0.receive(0, x, at)
    for x in held:                                            # rank 1 is back
        m1.receive(0, x, at)
    _run(agg, ms, at, until=at + 1.0)
    assert _exact(ms, xs) and m0.retransmitted == 1 and m0.spurious_entries == 0
