"""The pure worker and aggregator state machines, driven through an in-memory network."""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from netsim import join_all, run
from zerosum import protocol as P
from zerosum import worker_state as WS
from zerosum.aggregator_machine import AggregatorMachine
from zerosum.reference import reference_allreduce


def sparse_arrays(rng, world, n, block_size, density, dtype=np.float32):
    nblocks = -(-n // block_size)
    out = []
    for _ in range(world):
        if dtype == np.int32:
            x = rng.integers(-1000, 1000, n).astype(np.int32)
        else:
            x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
        keep = np.repeat(rng.random(nblocks) < density, block_size)[:n]
        x[~keep] = 0
        out.append(x)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=st.integers(1, 8), n=st.integers(0, 3000), block_size=st.sampled_from([1, 4, 16, 64]),
       density=st.sampled_from([0.0, 0.05, 0.3, 1.0]), naggs=st.integers(1, 3), slots=st.integers(1, 12),
       loss=st.sampled_from([0.0, 0.05, 0.3]), dup=st.sampled_from([0.0, 0.2]),
       reorder=st.sampled_from([0.0, 0.5]), int_data=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_streaming_matches_reference(world, n, block_size, density, naggs, slots, loss, dup, reorder,
                                     int_data, seed):
    rng = np.random.default_rng(seed)
    dtype = np.int32 if int_data else np.float32
    arrays = sparse_arrays(rng, world, n, block_size, density, dtype)
    aggs = [AggregatorMachine(1, world, slots=slots) for _ in range(naggs)]
    max_datagram = int(rng.choice([P.MAX_DATAGRAM, P.datagram_size(3, 3, block_size)]))
    outs, _ = run(arrays, aggs, block_size=block_size, loss=loss, dup=dup, reorder=reorder, seed=seed,
                  max_datagram=max_datagram)
    ref = reference_allreduce(arrays, block_size)
    for o in outs:
        assert o.dtype == dtype
        assert np.array_equal(o, ref)


def test_repeated_results_in_one_batch_count_once():
    """Every datagram arrives twice and workers take their queue in batches: a result repeated within
    a batch is applied once and counted as a duplicate, as it would be arriving later on its own."""
    rng = np.random.default_rng(11)
    arrays = sparse_arrays(rng, 3, 16 * 300, 16, 0.4)
    outs, machines = run(arrays, [AggregatorMachine(1, 3, slots=8)], block_size=16, dup=1.0, batch=1.0)
    ref = reference_allreduce(arrays, 16)
    for o, m in zip(outs, machines):
        assert np.array_equal(o, ref)
        assert m.drops.get("duplicate_result", 0) > 0


def test_only_nonzero_blocks_carry_data():
    rng = np.random.default_rng(3)
    arrays = sparse_arrays(rng, 4, 256 * 400, 256, 0.02)
    aggs = [AggregatorMachine(1, 4, slots=64)]
    outs, machines = run(arrays, aggs)
    for x, m in zip(arrays, machines):
        nz_blocks = int(np.count_nonzero(np.abs(x.reshape(-1, 256)).max(axis=1)))
        data_bytes = nz_blocks * 256 * 4
        # every non-zero block once, plus 16-byte entries and 20-byte headers; far below the dense 400 KB
        assert data_bytes <= m.bytes_sent < data_bytes + 40_000
    assert np.array_equal(outs[0], reference_allreduce(arrays))


def test_consecutive_allreduces_reuse_slots_and_survive_loss():
    rng = np.random.default_rng(5)
    aggs = [AggregatorMachine(1, 3, slots=8), AggregatorMachine(1, 3, slots=8)]
    granted = join_all(aggs, 3, 16)
    for epoch in range(1, 6):
        arrays = sparse_arrays(rng, 3, int(rng.integers(1, 2000)), 16, 0.3)
        outs, _ = run(arrays, aggs, block_size=16, epoch=epoch, loss=0.2, dup=0.2, reorder=0.3,
                      seed=epoch, slots=granted)
        ref = reference_allreduce(arrays, 16)
        assert all(np.array_equal(o, ref) for o in outs)


@pytest.mark.parametrize("seed", range(4))
def test_window_bounds_the_entries_in_flight(seed):
    """R-L6: with a fixed window, a worker has at most window / (16 + 4 * block_size) columns past their
    bootstrap in flight (the bound on what its link must queue), the ranks may use different windows
    without stalling each other, and the sums stay exact under loss, duplicates and reordering."""
    rng = np.random.default_rng(seed)
    B = 16
    entry = P.ENTRY_SIZE + 4 * B
    arrays = sparse_arrays(rng, 3, 4000, B, 0.4)
    aggs = [AggregatorMachine(1, 3, slots=40), AggregatorMachine(1, 3, slots=40)]
    windows = [3 * entry, 7 * entry + 5, 1]       # 3, 7 and 1 columns
    peak = [0, 0, 0]

    def in_flight(machines):
        for r, m in enumerate(machines):
            sent = (m.round_block != P.END) & (m.round_block != P.BOOT) & np.isfinite(m.deadline)
            n = int(np.count_nonzero(sent))
            assert n <= m.window_columns
            assert not sent[m.admitted:].any()
            peak[r] = max(peak[r], n)

    outs, machines = run(arrays, aggs, block_size=B, loss=0.1 * (seed % 2), dup=0.1, reorder=0.3, seed=seed,
                         window=windows, congestion=False, check=in_flight)
    assert [m.window_columns for m in machines] == [3, 7, 1]
    assert peak == [3, 7, 1]              # the window is used, not just respected
    ref = reference_allreduce(arrays, B)
    assert all(np.array_equal(o, ref) for o in outs)


def test_no_window_sends_every_column():
    rng = np.random.default_rng(1)
    arrays = sparse_arrays(rng, 2, 3000, 16, 0.5)
    for window in (None, 10 ** 9):
        _, machines = run(arrays, [AggregatorMachine(1, 2, slots=64)], block_size=16, window=window,
                          congestion=False)
        assert all(m.window_columns == m.admitted == m.layout.columns == 64 for m in machines)


def test_result_is_bit_identical_on_every_worker_and_run():
    rng = np.random.default_rng(9)
    arrays = sparse_arrays(rng, 5, 10_000, 64, 0.5)
    results = []
    for seed in range(3):
        outs, _ = run(arrays, [AggregatorMachine(1, 5, slots=7)], block_size=64, loss=0.1, reorder=0.5,
                      seed=seed)
        results += outs
    assert all(r.tobytes() == results[0].tobytes() for r in results)


def test_two_aggregators_equal_one():
    rng = np.random.default_rng(11)
    arrays = sparse_arrays(rng, 4, 50_000, 256, 0.2)
    one, _ = run(arrays, [AggregatorMachine(1, 4, slots=16)])
    two, _ = run(arrays, [AggregatorMachine(1, 4, slots=16) for _ in range(2)])
    assert one[0].tobytes() == two[0].tobytes()


# -- the aggregator against bad input ---------------------------------------------------------------

def replies(agg, datagram, source):
    """What the aggregator answers to `datagram` at once (the rounds it completes wait)."""
    agg.receive(datagram, source, 0.0)
    return agg.datagrams_to_send(0.0, results=False)


def sent(agg, datagram, source):
    """Everything the aggregator sends after `datagram`: replies, then completed rounds."""
    agg.receive(datagram, source, 0.0)
    return agg.datagrams_to_send(0.0)


def _member_agg(world=2, B=4):
    agg = AggregatorMachine(7, world, slots=4)
    join_all([agg], world, B)
    return agg


def _data(rank, entries, data=None, job=7, world=2, B=4, epoch=1, blocks=10):
    return P.encode(P.Header(P.DATA, job, rank, world, epoch, blocks, B, len(entries)), entries, data)


def _entry(slot, block, nxt, exp=P.NO_EXP, next_exp=P.NO_EXP, data=False):
    e = P.entries_array(1)
    e[0] = (slot, P.HAS_DATA if data else 0, block, nxt, exp, next_exp)
    return e


def test_aggregator_counts_and_drops_bad_input():
    agg = _member_agg()
    assert replies(agg, b"\x00" * 7, ("w", 0)) == []
    assert replies(agg, _data(0, _entry(0, P.BOOT, 2, next_exp=1), job=8), ("w", 0)) == []
    assert replies(agg, _data(0, _entry(0, P.BOOT, 2, next_exp=1)), ("x", 9)) == []     # wrong address
    assert replies(agg, _data(5, _entry(0, P.BOOT, 2, next_exp=1)), ("w", 5)) == []     # not a member
    assert replies(agg, _data(0, _entry(9, P.BOOT, 2, next_exp=1)), ("w", 0)) == []     # slot out of range
    assert replies(agg, _data(0, _entry(0, P.BOOT, 2, next_exp=1), world=3), ("w", 0)) == []
    c = agg.counters
    assert (c["drop_short"], c["drop_foreign_job"], c["drop_not_member"], c["drop_range"],
            c["drop_geometry"]) == (1, 1, 2, 1, 1)
    assert (agg.state.bitmap == 0).all()


def test_aggregator_round_duplicate_and_shadow():
    agg = _member_agg()
    # bootstrap: rank 0 has block 2 next (exp 1), rank 1 has block 6 (exp 3)
    assert replies(agg, _data(0, _entry(0, P.BOOT, 2, next_exp=1)), ("w", 0)) == []
    (dest, status), = replies(agg, _data(0, _entry(0, P.BOOT, 2, next_exp=1)), ("w", 0))  # duplicate
    st_ = P.decode(status)
    assert dest == [("w", 0)] and st_.header.type == P.STATUS and st_.entries["next"][0] == 0b01
    assert replies(agg, _data(1, _entry(0, P.BOOT, 6, next_exp=3)), ("w", 1)) == []
    (dest, res), = agg.datagrams_to_send(0.0)
    r = P.decode(res)
    assert dest == [("w", 0), ("w", 1)]
    assert (r.entries["block"][0], r.entries["next"][0], r.entries["next_exp"][0]) == (P.BOOT, 2, 1)
    # round for block 2: only rank 0 has data, wrong exponent first -> dropped, not added
    row = np.array([[1, -2, 3, 4]], np.int32)
    assert replies(agg, _data(0, _entry(0, 2, 6, exp=5, next_exp=2, data=True), row), ("w", 0)) == []
    assert agg.counters["drop_mismatch"] == 1
    assert replies(agg, _data(0, _entry(0, 2, 6, exp=1, next_exp=2, data=True), row), ("w", 0)) == []
    assert replies(agg, _data(1, _entry(0, 2, 6, exp=1, next_exp=3)), ("w", 1)) == []
    (dest, res), = agg.datagrams_to_send(0.0)
    assert agg.datagrams_to_send(0.0) == []
    r = P.decode(res)
    assert np.array_equal(r.data, row) and r.entries["next"][0] == 6 and r.entries["next_exp"][0] == 3
    # a late retransmission of the completed round gets the shadow copy, to the sender alone
    (dest, res2), = replies(agg, _data(1, _entry(0, 2, 6, exp=1, next_exp=3)), ("w", 1))
    assert dest == [("w", 1)] and res2 == res
    # an entry for a block that is neither current nor previous is stale
    assert replies(agg, _data(1, _entry(0, 4, 6, exp=1)), ("w", 1)) == []
    assert agg.counters["drop_stale"] == 1


def test_banks_keep_the_shadow_and_an_abandoned_round_leaves_nothing_behind():
    """A round sums into one of its slot's two banks and its completion flips them (as on the switch):
    the finished bank answers retransmissions while the next round writes its first data into the
    other; a round abandoned by a job that restarts (a newer epoch's BOOT, R-A1) leaves its partial sum
    in a bank, which the next round's first data overwrites: it never reaches a later sum."""
    agg = _member_agg()
    a, b, c, d = (np.array([[v, -v, 2 * v, 7]], np.int32) for v in (1, 10, 100, 1000))

    def boot(epoch):
        for rank in (0, 1):
            assert replies(agg, _data(rank, _entry(0, P.BOOT, 2, next_exp=1), epoch=epoch), ("w", rank)) == []
        (_, res), = agg.datagrams_to_send(0.0)
        assert P.decode(res).entries["next"][0] == 2

    boot(1)
    for rank, row in ((0, a), (1, b)):     # block 2: both have data; then block 5 for both
        replies(agg, _data(rank, _entry(0, 2, 5, exp=1, next_exp=1, data=True), row), ("w", rank))
    (_, res), = agg.datagrams_to_send(0.0)
    assert np.array_equal(P.decode(res).data, a + b)
    # the next round's first data goes to the other bank: a retransmission still gets a + b
    replies(agg, _data(0, _entry(0, 5, P.END, exp=1, data=True), c), ("w", 0))
    (dest, again), = replies(agg, _data(1, _entry(0, 2, 5, exp=1, next_exp=1, data=True), b), ("w", 1))
    assert dest == [("w", 1)] and again == res
    # rank 1 never sends block 5: the job restarts (epoch 2), leaving c in a bank
    boot(2)
    for rank, row in ((0, d), (1, a)):
        replies(agg, _data(rank, _entry(0, 2, P.END, exp=1, data=True), row, epoch=2), ("w", rank))
    (_, res), = agg.datagrams_to_send(0.0)
    assert np.array_equal(P.decode(res).data, d + a)


def test_join_rules():
    agg = AggregatorMachine(7, 2, slots=4)
    j = lambda rank, nonce, world=2, B=4: P.encode(P.Header(P.JOIN, 7, rank, world, nonce, 0, B))
    (dest, no), = replies(agg, j(0, 1, world=3), "a")           # wrong world size: refused (R-J6)
    assert dest == ["a"] and P.parse_header(no)[0] == P.REFUSED and P.parse_header(no)[3] == 2
    assert P.REFUSED_BODY.unpack(P.decode(no).body) == (P.REFUSED_CONFLICT, 0, 0, 0)
    assert replies(agg, j(2, 1), "a") == []                     # rank out of range
    (_, ack), = replies(agg, j(0, 1), "a")
    assert P.JOIN_ACK_BODY.unpack(P.decode(ack).body) == (4, 0b01)
    (_, no), = replies(agg, j(1, 2, B=8), "b")                  # block size differs from the job's
    assert P.parse_header(no)[0] == P.REFUSED and P.parse_header(no)[6] == 4
    (_, ack), = replies(agg, j(1, 2), "b")
    assert P.JOIN_ACK_BODY.unpack(P.decode(ack).body) == (4, 0b11)
    (_, ack), = replies(agg, j(0, 3), "c")                      # rank 0 restarted: a new run
    assert P.JOIN_ACK_BODY.unpack(P.decode(ack).body) == (4, 0b01)
    assert agg.counters["job_restarts"] == 1


def test_worker_times_out_naming_the_missing_rank():
    from zerosum.blocks import BlockSource, DenseResult
    from zerosum.errors import ZeroSumTimeout
    from zerosum.layout import Layout
    from zerosum.worker_machine import AllreduceMachine, WorkerConfig
    agg = AggregatorMachine(1, 3, slots=4)
    join_all([agg], 3, 4)
    x = np.ones(16, np.float32)
    source = BlockSource.dense(x, 4)
    m = AllreduceMachine(WorkerConfig(0, 3, 1, timeout=1.0, block_size=4), 1, source,
                         Layout(1, 4, source.nblocks), DenseResult(np.zeros(16, np.float32)))
    for _, d in m.start(0.0):
        agg.receive(d, ("w", 0), 0.0)
    # rank 1 contributes, rank 2 never does
    agg.receive(_data(1, P.entries_array(0), job=1, world=3, epoch=1, blocks=4), ("w", 1), 0.0)
    t = 0.0
    with pytest.raises(ZeroSumTimeout, match="waiting for ranks 1, 2"):
        while True:
            t = m.timer()
            for _, d in m.datagrams_to_send(t):
                for dest, reply in sent(agg, d, ("w", 0)):
                    m.receive(0, bytes(reply), t)
    assert t >= 1.0


def test_a_violating_result_changes_nothing_and_fails_the_allreduce():
    """R-L4: a RESULT whose second entry breaks a rule (its data under another exponent than agreed) is
    not applied at all, not even its valid first entry, and the machine stays failed."""
    from zerosum import protocol as P
    from zerosum.blocks import BlockSource, DenseResult
    from zerosum.errors import ProtocolViolation
    from zerosum.layout import Layout
    from zerosum.worker_machine import AllreduceMachine, JoinMachine, WorkerConfig
    agg = AggregatorMachine(1, 1, slots=2)
    cfg = WorkerConfig(rank=0, world=1, job=1, block_size=4)
    join = JoinMachine(cfg, 1, 1, 0.0)
    for _, d in join.datagrams_to_send(0.0):
        for _, ack in sent(agg, d, "w"):
            join.receive(0, bytes(ack), 0.0)
    x = np.arange(1, 17, dtype=np.float32)            # 4 blocks over 2 columns, all non-zero
    out = np.zeros(16, np.float32)
    m = AllreduceMachine(cfg, 1, BlockSource.dense(x, 4), Layout(1, join.slots, 4), DenseResult(out))
    for _, d in m.start(0.0):                           # the bootstrap round, answered
        for _, r in sent(agg, bytes(d), "w"):
            m.receive(0, bytes(r), 0.0)
    assert list(m.round_block) == [0, 1]
    before = [m.st.round_block.copy(), m.st.mine_pos.copy(), m.st.ready.copy()]
    e = P.entries_array(2)
    e[0] = (0, P.HAS_DATA, 0, 2, m.st.round_exp[0], m.st.own[2, WS.OWN_EXP])       # right
    e[1] = (1, P.HAS_DATA, 1, 3, m.st.round_exp[1] + 1, m.st.own[3, WS.OWN_EXP])   # wrong exponent
    bad = P.encode(P.Header(P.RESULT, 1, P.AGGREGATOR_RANK, 1, 1, 4, 4, 2), e, np.ones((2, 4), np.int32))
    with pytest.raises(ProtocolViolation, match="exponent"):
        m.receive(0, bad, 0.1)
    assert all(np.array_equal(a, b) for a, b in zip(before, [m.st.round_block, m.st.mine_pos, m.st.ready]))
    assert not out.any()                                # entry 0's sum was not stored either
    with pytest.raises(ProtocolViolation, match="failed earlier"):
        m.datagrams_to_send(0.2)
    with pytest.raises(ProtocolViolation, match="failed earlier"):
        m.receive(0, bad, 0.2)


_LOSSY_AFTER_WARM_UP = """
import sys

import numpy as np
from numba.core.dispatcher import Dispatcher
from netsim import run
from zerosum.aggregator_machine import AggregatorMachine
from zerosum.reference import reference_allreduce
from zerosum.warmup import warm_up


def signatures():
    # every kernel's compiled (or loaded) signatures: a first call adds one, from numba's cache or not
    return {(name, attr): set(f.overloads) for name, module in list(sys.modules.items())
            if name.startswith("zerosum") for attr, f in vars(module).items() if isinstance(f, Dispatcher)}


warm_up()
before = signatures()
for dtype in (np.float32, np.int32):
    rng = np.random.default_rng(5)
    arrays = [(rng.standard_normal(40) * 100).astype(dtype) for _ in range(2)]
    outs, _ = run(arrays, [AggregatorMachine(1, 2, slots=4)], block_size=4, loss=0.3, seed=2)
    for out in outs:
        assert np.array_equal(out, reference_allreduce(arrays, 4)), dtype
after = signatures()
print("compiled after warm-up:", sorted(f"{m}.{a}" for (m, a), sigs in after.items()
                                        if sigs - before.get((m, a), set())))
"""


def test_after_warm_up_loss_recovery_compiles_nothing():
    """warmup.warm_up runs every kernel the machines call, loss recovery's too (the timers, probes and
    retransmissions that Python calls from poll): otherwise a process's first loss compiled them
    mid-allreduce (~1 s of one rank's CPU, its peers probing meanwhile). In a process of its own: the
    suite's earlier tests would have compiled them here already."""
    r = subprocess.run([sys.executable, "-c", _LOSSY_AFTER_WARM_UP], capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    assert r.returncode == 0, r.stderr
    assert "compiled after warm-up: []" in r.stdout, r.stdout
