"""Sparse inputs against the dense path, with real worker processes and an aggregator on loopback.

- Worker.allreduce_blocks: random sorted block sets per rank equal reference_allreduce of the
  densified inputs on the union of the blocks sent (and return exactly that union); int32 exactly;
  average=True; bad input refused before anything is sent.
- torch sparse COO (nn.Embedding(sparse=True)'s hybrid gradient, fully sparse 1-D and 2-D, int32):
  Worker.allreduce returns a coalesced sparse tensor whose to_dense() is bit for bit the dense path's
  result.
- A loss-free allreduce of a few MB retransmits nothing; and, with the pure machines, two orderings of
  a probe and the RESULT it crosses, neither of which may make a worker retransmit (no loss).

Each test starts its ranks once (processes are expensive); every rank runs a list of cases and
returns what the test asserts on.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from procs import Aggregator, sparse_tensor
from torch_procs import spawn
from zerosum.reference import reference_allreduce


# -- block-sparse input -------------------------------------------------------------------------------------

def block_inputs(seed, world, nblocks, block_size, dtype, density):
    """Per rank: (sorted unique block indices, their rows). Some rows are all zero (or all -0.0), which
    the worker leaves out; with int32 data, ranks 0 and 1 send blocks that cancel to zero; with three
    ranks or more, the last one sends nothing."""
    rng = np.random.default_rng(seed)
    cancel = rng.choice(nblocks, min(nblocks, 2), replace=False) if dtype == np.int32 and world > 1 \
        else np.zeros(0, np.int64)
    cancel_row = rng.integers(-1000, 1000, block_size).astype(dtype)
    out = []
    for r in range(world):
        chosen = np.setdiff1d(np.flatnonzero(rng.random(nblocks) < density), cancel)
        if r < 2:
            chosen = np.union1d(chosen, cancel)
        if dtype == np.int32:
            rows = rng.integers(-2**26, 2**26, (len(chosen), block_size)).astype(np.int32)
            rows[np.isin(chosen, cancel)] = cancel_row if r == 0 else -cancel_row
        else:
            scale = 2.0 ** rng.integers(-30, 31, (len(chosen), 1))
            rows = (rng.standard_normal((len(chosen), block_size)) * scale).astype(np.float32)
            rows[rng.random(rows.shape) < 0.2] = 0
        zero = (rng.random(len(chosen)) < 0.15) & ~np.isin(chosen, cancel)
        rows[zero] = np.float32(-0.0) if dtype == np.float32 and r % 2 else 0
        out.append((chosen.astype(np.int64), rows))
    if world > 2:
        out[-1] = (np.zeros(0, np.int64), np.zeros((0, block_size), dtype))   # a rank with nothing to send
    return out


def densify(blocks, rows, nblocks, block_size):
    dense = np.zeros((nblocks, block_size), rows.dtype)
    dense[blocks] = rows
    return dense.reshape(-1)


def expected_blocks(inputs, nblocks, block_size, average=False):
    """(union of the non-zero input blocks, reference rows there)."""
    dense = [densify(b, r, nblocks, block_size) for b, r in inputs]
    ref = reference_allreduce(dense, block_size).reshape(nblocks, block_size)
    if average:
        ref = ref / np.float32(len(inputs))
    live = [b[(r != 0).any(axis=1)] for b, r in inputs]
    union = np.unique(np.concatenate(live)).astype(np.int64)
    return union, ref[union]


def _blocks_rank(rank, world, address, block_size, cases):
    """Run every case's allreduce_blocks (and the dense allreduce of the same data) on this rank."""
    import zerosum
    results = []
    with zerosum.Worker(rank, world, [address], block_size=block_size, timeout=60.0) as w:
        for case in cases:
            inputs, nblocks, average = case["inputs"], case["nblocks"], case["average"]
            blocks, rows = inputs[rank]
            sent = w.stats.datagrams_sent
            got_blocks, got_rows = w.allreduce_blocks(blocks, rows, nblocks, average=average)
            sent = w.stats.datagrams_sent - sent
            dense = w.allreduce(densify(blocks, rows, nblocks, block_size), average=average)
            results.append((got_blocks, got_rows, dense, sent))
        results.append(_bad_inputs(w, block_size))
    return results


def _bad_inputs(w, B):
    """Each bad call: (exception type, message, datagrams sent by the call)."""
    good = np.ones((3, B), np.float32)
    calls = {
        "unsorted": lambda: w.allreduce_blocks([0, 5, 2], good, 10),
        "duplicate": lambda: w.allreduce_blocks([0, 2, 2], good, 10),
        "negative": lambda: w.allreduce_blocks([-1, 2, 3], good, 10),
        "too large": lambda: w.allreduce_blocks([0, 2, 10], good, 10),
        "rows for other blocks": lambda: w.allreduce_blocks([0, 2], good, 10),
        "narrow rows": lambda: w.allreduce_blocks([0, 2, 3], np.ones((3, B - 1), np.float32), 10),
        "wide rows": lambda: w.allreduce_blocks([0, 2, 3], np.ones((3, B + 1), np.float32), 10),
        "flat rows": lambda: w.allreduce_blocks([0, 2, 3], np.ones(3 * B, np.float32), 10),
        "float64": lambda: w.allreduce_blocks([0, 2, 3], np.ones((3, B), np.float64), 10),
        "int64": lambda: w.allreduce_blocks([0, 2, 3], np.ones((3, B), np.int64), 10),
        "int32 average": lambda: w.allreduce_blocks([0, 2, 3], np.ones((3, B), np.int32), 10, average=True),
        "nan": lambda: w.allreduce_blocks([0, 2, 3], np.where(np.arange(3 * B).reshape(3, B) == B + 1, np.nan,
                                                              good), 10),
        "too many blocks": lambda: w.allreduce_blocks([0], good[:1], 2**32),
    }
    out = {}
    for name, call in calls.items():
        sent = w.stats.datagrams_sent
        try:
            call()
            out[name] = (None, "", w.stats.datagrams_sent - sent)
        except Exception as e:
            out[name] = (type(e).__name__, str(e), w.stats.datagrams_sent - sent)
    return out


BAD_EXPECTED = {
    "unsorted": ("ValueError", "sorted, unique"),
    "duplicate": ("ValueError", "sorted, unique"),
    "negative": ("ValueError", "sorted, unique"),
    "too large": ("ValueError", "within 0..9"),
    "rows for other blocks": ("ValueError", "len\\(blocks\\)"),
    "narrow rows": ("ValueError", "rows must be"),
    "wide rows": ("ValueError", "rows must be"),
    "flat rows": ("ValueError", "rows must be"),
    "float64": ("TypeError", "float32 and int32"),
    "int64": ("TypeError", "float32 and int32"),
    "int32 average": ("ValueError", "needs float32"),
    "nan": ("ValueError", "NaN or infinite"),
    "too many blocks": ("ValueError", "not supported"),
}


def run_block_cases(world, block_size, cases):
    agg = Aggregator(world)
    try:
        results = spawn(_blocks_rank, world, agg.address, block_size, cases)
    finally:
        agg.stop()
    for rank, res in enumerate(results):
        *per_case, bad = res
        for i, (case, (got_blocks, got_rows, dense, sent)) in enumerate(zip(cases, per_case)):
            what = f"rank {rank}, case {i} ({case['dtype'].__name__}, average={case['average']})"
            union, rows = case["expected"]
            assert got_blocks.dtype == np.int64 and np.array_equal(got_blocks, union), what
            assert got_rows.dtype == case["dtype"] and got_rows.shape == (len(union), block_size), what
            assert got_rows.tobytes() == rows.tobytes(), what
            # the dense path gives the same sums there and zeros elsewhere
            d = dense.reshape(case["nblocks"], block_size)
            assert d[union].tobytes() == rows.tobytes(), what
            assert not np.delete(d, union, axis=0).any(), what
            if not len(union):
                assert sent == 1, what       # nothing to sum: one datagram of bootstrap entries
        for name, (kind, pattern) in BAD_EXPECTED.items():
            got_kind, message, sent = bad[name]
            assert got_kind == kind, (name, got_kind, message)
            assert sent == 0, name
            assert re.search(pattern, message), (name, message)
    return results


@pytest.mark.parametrize("world, block_size", [(2, 7), (3, 64), (4, 256)])
def test_allreduce_blocks_equals_dense_reference(world, block_size):
    cases = []
    for i, (dtype, nblocks, density, average) in enumerate([
            (np.float32, 300, 0.1, False), (np.float32, 4000, 0.02, False), (np.int32, 500, 0.3, False),
            (np.float32, 1, 1.0, False), (np.float32, 250, 0.2, True), (np.int32, 50, 1.0, False),
            (np.float32, 100, 0.0, False)]):
        inputs = block_inputs(1000 * world + i, world, nblocks, block_size, dtype, density)
        cases.append(dict(inputs=inputs, nblocks=nblocks, average=average, dtype=dtype,
                          expected=expected_blocks(inputs, nblocks, block_size, average)))
    # the int32 sums are exact (not just equal to the reference)
    case = cases[2]
    exact = sum(densify(b, r, case["nblocks"], block_size).astype(np.int64) for b, r in case["inputs"])
    union, rows = case["expected"]
    assert np.array_equal(rows, exact.reshape(-1, block_size)[union].astype(np.int32))
    run_block_cases(world, block_size, cases)


def test_block_sums_are_collected_in_kept_memory_and_returned_as_copies():
    """allreduce_blocks collects the sums in buffers the worker keeps between allreduces (fresh memory
    for each cost a page fault per 4 KiB written): a second allreduce of the same size allocates none, a
    larger one grows them, and every result is a copy of its own that later allreduces leave intact."""
    from test_worker_api import run_threads
    B, world = 16, 3
    sizes = [(3000, 0.2), (3000, 0.2), (200, 0.5), (40000, 0.6)]     # the last outgrows the first's room
    cases = [block_inputs(77 + k, world, n, B, np.float32, d) for k, (n, d) in enumerate(sizes)]
    agg = Aggregator(world)
    try:
        def fn(rank, w):
            got, kept = [], []
            for (n, _), inputs in zip(sizes, cases):
                got.append(w.allreduce_blocks(*inputs[rank], n))
                kept.append(w._scratch.kept.buffers["rows"])
            return got, kept
        runs = run_threads(world, agg.address, fn, block_size=B)
    finally:
        agg.stop()
    for got, kept in runs:
        assert kept[1] is kept[0] and kept[2] is kept[0]       # no new buffer for the same or a smaller size
        assert kept[3] is not kept[0] and kept[3].size > kept[0].size
        for (n, _), inputs, (blocks, rows) in zip(sizes, cases, got):
            union, expected = expected_blocks(inputs, n, B)
            assert np.array_equal(blocks, union) and rows.tobytes() == expected.tobytes()
            assert not any(np.shares_memory(rows, k) or np.shares_memory(blocks, k) for k in kept)


def test_nan_in_block_sparse_input_is_refused():
    from zerosum.blocks import BlockSource
    rows = np.ones((3, 16), np.float32)
    rows[1, 3] = np.inf
    with pytest.raises(ValueError, match="NaN or infinite"):
        BlockSource.compact(np.array([2, 9, 11]), rows, 40)


def test_nan_in_block_sparse_input_names_the_tensor_block():
    from zerosum.blocks import BlockSource
    rows = np.ones((3, 16), np.float32)
    rows[1, 3] = np.inf
    with pytest.raises(ValueError, match=r"first in block 9, elements 144\.\.159"):
        BlockSource.compact(np.array([2, 9, 11]), rows, 40)


def test_non_integer_block_indices_are_refused():
    import zerosum
    from test_kernels import RecordingAggregator
    agg = RecordingAggregator(1)
    try:
        with zerosum.Worker(0, 1, [agg.address], block_size=4, timeout=10.0) as w:
            sent = w.stats.datagrams_sent
            with pytest.raises((TypeError, ValueError)):
                w.allreduce_blocks([0.5, 1.7], np.ones((2, 4), np.float32), 10)
            assert w.stats.datagrams_sent == sent
    finally:
        agg.close()


# -- torch sparse COO ---------------------------------------------------------------------------------------

def _sparse_rank(rank, world, address, block_size):
    """Sparse COO tensors of several layouts: allreduce them, and their to_dense(), on this rank."""
    import torch
    import zerosum
    torch.manual_seed(100 + rank)
    tensors = {}
    # nn.Embedding(sparse=True)'s gradient: indices of rows (with repeats: uncoalesced), values rows x dim
    emb = torch.nn.Embedding(1000, 24, sparse=True)
    ids = torch.randint(0, 1000, (60,)) if rank != 1 else torch.randint(0, 40, (30,))
    (emb(ids) * torch.randn(len(ids), 24)).sum().backward()
    tensors["embedding"] = emb.weight.grad
    # the same layout, coalesced by hand, its dimension not a divisor of the block size
    idx = torch.unique(torch.randint(0, 5000, (80,)))
    tensors["hybrid"] = torch.sparse_coo_tensor(idx[None], torch.randn(len(idx), 13) * 1e-3, (5000, 13))
    # fully sparse 1-D, with an explicit zero and -0.0 among its values
    i1 = torch.unique(torch.randint(0, 100_003, (500,)))
    v1 = torch.randn(len(i1)) * 10.0 ** torch.randint(-5, 6, (len(i1),))
    v1[:3] = torch.tensor([0.0, -0.0, 1e-40])
    tensors["vector"] = torch.sparse_coo_tensor(i1[None], v1, (100_003,)).coalesce()
    # fully sparse 2-D, uncoalesced
    i2 = torch.stack([torch.randint(0, 300, (400,)), torch.randint(0, 77, (400,))])
    tensors["matrix"] = torch.sparse_coo_tensor(i2, torch.randn(400), (300, 77))
    # int32, and a rank with no values at all
    i3 = torch.randint(0, 20_000, (1, 300))
    tensors["int32"] = torch.sparse_coo_tensor(i3, torch.randint(-2**20, 2**20, (300,), dtype=torch.int32),
                                               (20_000,))
    tensors["empty on rank 0"] = tensors["vector"] if rank else torch.sparse_coo_tensor(
        torch.zeros((1, 0), dtype=torch.int64), torch.zeros(0), (100_003,))
    # a 3-D hybrid: sparse over the first dimension, dense 5 x 3 below it
    i4 = torch.unique(torch.randint(0, 64, (10,)))
    tensors["3-D hybrid"] = torch.sparse_coo_tensor(i4[None], torch.randn(len(i4), 5, 3), (64, 5, 3))
    out = {}
    with zerosum.Worker(rank, world, [address], block_size=block_size, timeout=60.0) as w:
        for name, t in tensors.items():
            for average in ((False, True) if t.dtype == torch.float32 else (False,)):
                s = w.allreduce(t, average=average)
                d = w.allreduce(t.to_dense(), average=average)
                dc = w.allreduce(t.coalesce().to_dense(), average=average)
                out[name, average] = dict(
                    layout=str(s.layout), shape=tuple(s.shape), sparse_dim=s.sparse_dim(), dense_dim=s.dense_dim(),
                    want=(tuple(t.shape), t.sparse_dim(), t.dense_dim()), coalesced=s.is_coalesced(),
                    dtype=str(s.dtype), indices=s._indices().numpy().copy(), values=s._values().numpy().copy(),
                    sparse_dense=s.to_dense().numpy(), dense=d.numpy(), dense_coalesced=dc.numpy(),
                    input=t.coalesce().to_dense().numpy())
    return out


def test_torch_sparse_coo_equals_the_dense_path():
    pytest.importorskip("torch")
    world, block_size = 3, 64
    agg = Aggregator(world)
    try:
        results = spawn(_sparse_rank, world, agg.address, block_size)
    finally:
        agg.stop()
    for key in results[0]:
        ref = reference_allreduce([r[key]["input"] for r in results], block_size)
        if key[1]:
            ref = ref / np.float32(world)
        for rank, res in enumerate(results):
            o = res[key]
            what = f"{key} on rank {rank}"
            assert o["layout"] == "torch.sparse_coo" and o["coalesced"], what
            assert (o["shape"], o["sparse_dim"], o["dense_dim"]) == o["want"], what
            assert o["sparse_dense"].dtype == o["dense"].dtype == ref.dtype, what
            assert o["sparse_dense"].tobytes() == o["dense_coalesced"].tobytes() == ref.tobytes(), what
            assert o["sparse_dense"].tobytes() == o["dense"].tobytes(), what
            # indices: sorted and unique (coalesced), exactly the sparse positions with a non-zero sum
            idx = o["indices"]
            flat = np.ravel_multi_index(tuple(idx), o["shape"][: o["sparse_dim"]]) if idx.size else idx.reshape(-1)
            assert (np.diff(flat) > 0).all(), what
            per_position = ref.reshape(int(np.prod(o["shape"][: o["sparse_dim"]])), -1)
            assert np.array_equal(flat, np.flatnonzero(per_position.any(axis=1))), what
            assert o["values"].tobytes() == per_position[flat].reshape(o["values"].shape).tobytes(), what


# -- a loss-free run retransmits nothing ---------------------------------------------------------------------

# A probe (AllreduceMachine.poll) that crosses the RESULT of the round it probes is no loss: neither
# when the aggregator sees the probe before it flushed the round's RESULT (it must not answer it from
# the shadow copy ahead of the flush), nor when probe and RESULT cross on the way (the worker must not
# keep a "loss confirmed" state that later retransmits without probing). Both orderings happen in a
# loss-free run whenever ranks start more than one retransmission timeout apart.


def _machines(world, block_size=4, n=64, timeout=100.0, max_entries=0xFFFF):
    """An AggregatorMachine with `world` joined ranks and their AllreduceMachines (epoch 1)."""
    from netsim import join_all
    from zerosum.aggregator_machine import AggregatorMachine
    from zerosum.blocks import BlockSource, DenseResult
    from zerosum.layout import Layout
    from zerosum.worker_machine import AllreduceMachine, WorkerConfig
    agg = AggregatorMachine(1, world, slots=8)
    slots = join_all([agg], world, block_size)
    xs = [np.arange(1, n + 1, dtype=np.float32) * (r + 1) for r in range(world)]
    ms = []
    for r, x in enumerate(xs):
        src = BlockSource.dense(x, block_size)
        cfg = WorkerConfig(r, world, 1, block_size=block_size, timeout=timeout, max_entries=max_entries)
        ms.append(AllreduceMachine(cfg, 1, src, Layout(1, slots, src.nblocks), DenseResult(np.zeros(n, np.float32))))
    return agg, ms, xs


def _to_agg(agg, rank, datagrams, now=0.0):
    """Deliver a worker's datagrams to the aggregator; return its immediate replies (the completed
    rounds wait for _results)."""
    for _, d in datagrams:
        agg.receive(bytes(d), ("w", rank), now)
    return agg.datagrams_to_send(now, results=False)


def _results(agg, now=0.0):
    return agg.datagrams_to_send(now)


def _deliver(ms, replies, now):
    for dests, x in replies:
        for _, r in dests:
            ms[r].receive(0, x, now)


def _finish(agg, ms, now, active=None, until=np.inf):
    """Run the machines (or the `active` ranks) without loss until they are done or time reaches
    `until`: every datagram delivered at once, the aggregator flushed after each worker's batch, time
    advanced to the next timer when nothing moves. Returns the time reached."""
    for _ in range(10_000):
        if all(m.done for m in ms):
            return now
        moved = False
        for r, m in enumerate(ms):
            if m.done or (active is not None and r not in active):
                continue
            out = m.datagrams_to_send(now)
            if out:
                moved = True
                _deliver(ms, _to_agg(agg, r, out), now)
                _deliver(ms, _results(agg), now)
        if not moved:
            timers = [m.timer() for r, m in enumerate(ms)
                      if not m.done and (active is None or r in active)]
            if not timers or min(timers) >= until:
                return now
            now = max(now + 1e-3, min(timers))
    raise AssertionError("the machines did not finish")


def test_probe_answered_before_the_flush_is_not_a_loss():
    """Rank 1 starts after rank 0's timer expired: its bootstrap completes every round, and rank 0's
    probe reaches the aggregator before the aggregator flushes those rounds. Nothing was lost."""
    agg, (m0, m1), xs = _machines(2)
    assert _to_agg(agg, 0, m0.start(0.0)) == []              # rank 0 waits for rank 1
    assert m0.timer() <= 0.25
    late = _to_agg(agg, 1, m1.start(0.25))                   # completes every round; not flushed yet
    probe = m0.datagrams_to_send(0.25)
    _deliver([m0, m1], late + _to_agg(agg, 0, probe), 0.251)
    sent = m0.datagrams_to_send(0.252)                       # the probe's column goes on...
    _deliver([m0, m1], _to_agg(agg, 0, sent), 0.252)
    _deliver([m0, m1], _to_agg(agg, 0, m0.datagrams_to_send(0.253)), 0.253)    # ...nothing else is due
    _deliver([m0, m1], _results(agg), 0.254)
    _finish(agg, [m0, m1], 0.255)
    ref = reference_allreduce(xs, 4)
    assert all(m.output.flat.tobytes() == ref.tobytes() for m in (m0, m1))
    assert (m0.retransmitted, m1.retransmitted) == (0, 0)


def test_probe_crossing_its_result_leaves_no_confirmed_loss():
    """Rank 0's probe and the RESULT of the round it probes cross on the wire (the aggregator answers
    the probe from its shadow copy, as it should). Later rank 1 is slow for a while: rank 0 must
    probe again, not retransmit everything."""
    agg, (m0, m1), xs = _machines(2)
    assert _to_agg(agg, 0, m0.start(0.0)) == []
    assert _to_agg(agg, 1, m1.start(0.25)) == []
    results = _results(agg)       # in flight to both ranks...
    probe = m0.datagrams_to_send(0.25)                       # ...while rank 0 probes
    assert sum(len(d) for _, d in probe) < 100               # one entry
    shadow = _to_agg(agg, 0, probe)
    _deliver([m0, m1], results, 0.251)
    _deliver([m0, m1], shadow, 0.252)
    # rank 0 goes on; rank 1 is busy for 0.8 s (CPU load) before it sends its next round
    now = _finish(agg, [m0, m1], 0.253, active={0}, until=1.05)
    assert now < 1.05 and not m0.done
    _finish(agg, [m0, m1], 1.05)
    ref = reference_allreduce(xs, 4)
    assert all(m.output.flat.tobytes() == ref.tobytes() for m in (m0, m1))
    assert m0.probes >= 1
    assert (m0.retransmitted, m1.retransmitted) == (0, 0)



def test_an_aggregator_that_stalls_past_the_probes_timeout_is_probed_again_not_taken_for_a_loss():
    """Both ranks' bootstraps reach the aggregator, which then waits for a core (here: its results and
    everything sent to it are held) for longer than the ranks' timers and their probes' timers together.
    The ranks probe again instead of resending every column; once the aggregator runs, nothing was lost
    and nothing is resent."""
    agg, (m0, m1), xs = _machines(2)
    held_replies = _to_agg(agg, 0, m0.start(0.0)) + _to_agg(agg, 1, m1.start(0.0))
    held_results = _results(agg)            # completed, but not yet sent: the aggregator is stalled
    held_probes = {0: [], 1: []}
    now = 0.0
    while now < 1.5:                        # the stall: the ranks' timers run, nothing comes back
        now = max(now + 1e-3, min(m0.timer(), m1.timer()))
        for rank, m in enumerate((m0, m1)):
            sent = m.datagrams_to_send(now)
            assert sum(len(d) for _, d in sent) < 100, "only a probe may go out while the aggregator is silent"
            held_probes[rank] += sent
    assert m0.probes >= 3 and m1.probes >= 3
    assert (m0.retransmitted, m1.retransmitted) == (0, 0)
    # the aggregator runs again: it sends what it held, then answers the probes
    _deliver([m0, m1], held_replies + held_results, now)
    for rank in (0, 1):
        _deliver([m0, m1], _to_agg(agg, rank, held_probes[rank], now), now)
    _finish(agg, [m0, m1], now)
    ref = reference_allreduce(xs, 4)
    assert all(m.output.flat.tobytes() == ref.tobytes() for m in (m0, m1))
    assert (m0.retransmitted, m1.retransmitted) == (0, 0)


def _column_of(datagram) -> int:
    """The column (the slot, with one aggregator) of a one-entry DATA datagram."""
    from zerosum.wire import HDR, read_entry
    return int(read_entry(np.frombuffer(bytes(datagram), np.uint8), HDR)[0])


def test_a_probe_answered_while_other_expired_columns_complete_unresent_is_no_loss():
    """Rank 1 waits for a core after the bootstrap, and rank 0's timers expire; rank 0 probes one column.
    Rank 1 then sends the entries of two columns, the probed one among them, and rank 0 reads the probe's
    answer (from the shadow copy) before those two rounds' results, which lie behind it in the same batch
    (on loopback they come through the multicast group's socket). A column that had expired with the
    probe completed without being resent: the aggregator held rank 0's entries and waited for rank 1, so
    nothing was lost, and nothing of the other expired columns may be resent (F-RTO's test). Judged at
    the probe's answer, or without that test, every other expired column was resent."""
    agg, (m0, m1), xs = _machines(2, max_entries=1)
    ms = [m0, m1]
    _deliver(ms, _to_agg(agg, 0, m0.start(0.0)) + _to_agg(agg, 1, m1.start(0.0)), 0.0)
    _deliver(ms, _results(agg), 0.0)                          # every bootstrap round completed
    assert _to_agg(agg, 0, m0.datagrams_to_send(0.001), 0.001) == []
    held = m1.datagrams_to_send(0.001)                        # rank 1 waits for a core
    assert len(held) == 8
    now = m0.timer()
    probe = m0.datagrams_to_send(now)
    assert len(probe) == 1 and m0.probes == 1
    p = _column_of(probe[0][1])
    q = next(_column_of(d) for _, d in held if _column_of(d) != p)
    first = [(a, d) for a, d in held if _column_of(d) in (p, q)]
    rest = [(a, d) for a, d in held if _column_of(d) not in (p, q)]
    assert _to_agg(agg, 1, first, now) == []                  # rounds p and q complete...
    results = _results(agg, now)
    shadow = _to_agg(agg, 0, probe, now)                      # ...before the probe arrives: the shadow copy
    assert len(shadow) == 1
    _deliver(ms, shadow + results, now + 0.001)               # the answer read first, in one batch
    for t in (now + 0.002, now + 0.003):                      # rank 0 goes on while rank 1 still waits
        _deliver(ms, _to_agg(agg, 0, m0.datagrams_to_send(t), t), t)
        _deliver(ms, _results(agg, t), t)
    assert m0.retransmitted == 0
    later = now + 0.004
    assert _to_agg(agg, 1, rest, later) == []                 # rank 1 runs again
    _deliver(ms, _results(agg, later), later)
    _finish(agg, ms, later)
    ref = reference_allreduce(xs, 4)
    assert all(m.output.flat.tobytes() == ref.tobytes() for m in ms)
    assert (m0.retransmitted, m1.retransmitted) == (0, 0)


def test_next_rounds_leave_in_the_order_their_results_arrived():
    """R-A8: rank 1's bootstrap entries reach the aggregator in a shuffled order, so the rounds complete,
    and their results arrive at rank 0 (in one batch), in that order; rank 0 sends its next rounds in the
    same order, as every rank does, and not in column order (a rank that read the results in several
    batches would send them in their arrival order: the two orders would differ)."""
    agg, (m0, m1), xs = _machines(2, max_entries=1)
    ms = [m0, m1]
    assert _to_agg(agg, 0, m0.start(0.0)) == []
    boot = m1.start(0.0)
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    by_column = {_column_of(d): (a, d) for a, d in boot}
    assert sorted(by_column) == list(range(8))
    assert _to_agg(agg, 1, [by_column[c] for c in order]) == []
    _deliver(ms, _results(agg), 0.001)
    sent = m0.datagrams_to_send(0.002)
    assert [_column_of(d) for _, d in sent] == order
    _deliver(ms, _to_agg(agg, 0, sent, 0.002), 0.002)
    _finish(agg, ms, 0.003)
    ref = reference_allreduce(xs, 4)
    assert all(m.output.flat.tobytes() == ref.tobytes() for m in ms)


N_LARGE = 2 << 20 >> 2     # 2 MB of float32


def _large_rank(rank, world, address):
    import zerosum
    out = []
    with zerosum.Worker(rank, world, [address]) as w:
        for density in (1.0, 0.1):
            x = sparse_tensor(rank, 77, N_LARGE + 3, density)
            before = w.stats.retransmitted_entries, getattr(w.stats, "probes", 0)
            y = w.allreduce(x)
            out.append((y, w.stats.retransmitted_entries - before[0], getattr(w.stats, "probes", 0) - before[1],
                        dict(w.stats.drops)))
    return out


def test_loss_free_run_of_a_few_megabytes_retransmits_nothing():
    """4 ranks x 2 MB, dense and at 10 % density, one aggregator on loopback, no loss: every sum is
    exact and no worker retransmits a single entry (probes, single entries that tell a slow peer from
    a loss, are counted apart)."""
    world = 4
    agg = Aggregator(world)
    try:
        results = spawn(_large_rank, world, agg.address)
    finally:
        counters = agg.stop()
    probes = 0
    for i, density in enumerate((1.0, 0.1)):
        ref = reference_allreduce([sparse_tensor(r, 77, N_LARGE + 3, density) for r in range(world)])
        for rank in range(world):
            y, retransmitted, probed, drops = results[rank][i]
            probes += probed
            assert y.tobytes() == ref.tobytes(), (rank, density)
            assert retransmitted == 0, f"rank {rank} retransmitted {retransmitted} entries at density " \
                f"{density} without loss (probes {probed}, drops {drops}, aggregator {counters})"
    # whatever the aggregator saw twice was a probe
    assert counters.get("duplicates", 0) + counters.get("retransmissions_answered", 0) <= probes, counters
