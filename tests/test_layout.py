"""Columns placed by measured load (layout.balanced_column_order, Worker.balance_columns)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from zerosum.aggregator_machine import AggregatorMachine
from zerosum.layout import Layout, balanced_column_order
from zerosum.reference import reference_allreduce

import netsim


def first_layer_load(rows: int, blocks_per_row: int, rng) -> np.ndarray:
    """How often each block of a [rows, blocks_per_row * 256] row-major gradient is non-zero when the
    input features are Zipf-distributed (hot features first): the first block of every row is hot."""
    p = 1.0 / np.arange(1, blocks_per_row + 1) ** 2
    return np.tile(rng.binomial(100, p / p[0]), rows).astype(np.float64)


@pytest.mark.parametrize("aggregators", [2, 4])
def test_a_skewed_load_is_balanced_to_about_one_share_each(aggregators):
    load = first_layer_load(512, 4, np.random.default_rng(0))
    plain = Layout(aggregators, 256, len(load)).aggregator_load(load)
    order = balanced_column_order(load, aggregators, 256)
    assert sorted(order) == list(range(Layout(aggregators, 256, len(load)).columns))
    balanced = Layout(aggregators, 256, len(load), order).aggregator_load(load)
    share = load.sum() / aggregators
    assert plain.max() > 1.5 * share                # striping puts the hot first blocks together
    assert balanced.max() <= share * 1.02 + load.max()   # LPT: within one column's load of the share
    assert balanced.sum() == pytest.approx(load.sum())
    np.testing.assert_array_equal(order, balanced_column_order(load.copy(), aggregators, 256))   # deterministic


def test_bad_loads_and_orders_are_refused():
    with pytest.raises(ValueError, match="non-negative"):
        balanced_column_order(np.array([1.0, -1.0]), 2, 4)
    with pytest.raises(ValueError, match="permutation"):
        Layout(2, 4, 8, np.array([0, 1, 2, 3, 4, 5, 6, 6]))


@settings(max_examples=25, deadline=None)
@given(world=st.integers(2, 4), aggregators=st.integers(1, 3), nblocks=st.integers(1, 40),
       density=st.floats(0.05, 1.0), loss=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 2**16))
def test_any_column_order_gives_the_sums_of_striping(world, aggregators, nblocks, density, loss, seed):
    rng = np.random.default_rng(seed)
    arrays = []
    for _ in range(world):
        x = rng.standard_normal(nblocks * 16).astype(np.float32)
        x[np.repeat(rng.random(nblocks) >= density, 16)] = 0
        arrays.append(x)
    perm = lambda a, p, n: np.random.default_rng(seed).permutation(Layout(a, p, n).columns)   # the same on every rank
    striped, _ = netsim.run(arrays, [AggregatorMachine(1, world, slots=5) for _ in range(aggregators)],
                            block_size=16, loss=loss, seed=seed)
    placed, _ = netsim.run(arrays, [AggregatorMachine(1, world, slots=5) for _ in range(aggregators)],
                           block_size=16, loss=loss, seed=seed, column_order=perm)
    ref = reference_allreduce(arrays, 16)
    for a, b in zip(striped, placed):
        assert a.tobytes() == b.tobytes() == ref.tobytes()


def _balancing_rank(out, rank, world, addresses):
    import zerosum
    from zerosum.blocks import BlockSource
    with zerosum.Worker(rank, world, addresses, block_size=64) as w:
        x = _skewed(rank)
        first = w.allreduce(x)
        counts = np.zeros(len(x) // 64, np.int64)
        counts[BlockSource.dense(x, 64).blocks] = 1
        shares = w.balance_columns(counts)
        balanced = w.allreduce(x)
        w.stripe_columns()
        out.put((rank, first, balanced, shares, w.allreduce(x), not w._column_orders))


def _skewed(rank):
    """A [64, 4 blocks] gradient whose rows' first blocks are non-zero (and a few others)."""
    rng = np.random.default_rng(rank)
    x = np.zeros((64, 4, 64), np.float32)
    x[:, 0] = rng.standard_normal((64, 64))
    x[rng.random(64) < 0.2, 1 + rank % 3] = 1.5
    return x.reshape(-1)


def test_workers_balance_their_columns_collectively_and_sums_stay_exact():
    from procs import Aggregator, CTX, collect
    aggs = [Aggregator(2) for _ in range(2)]
    try:
        out = CTX.Queue()
        procs = [CTX.Process(target=_balancing_rank, args=(out, r, 2, [a.address for a in aggs]), daemon=True)
                 for r in range(2)]
        reports = collect(procs, out, 2, 120)
    finally:
        for a in aggs:
            a.stop()
    ref = reference_allreduce([_skewed(r) for r in range(2)], 64)
    (_, first0, second0, (before0, after0), third0, striped0), \
        (_, first1, second1, (before1, after1), third1, striped1) = sorted(reports, key=lambda r: r[0])
    for got in (first0, second0, first1, second1, third0, third1):   # third: striped again (stripe_columns)
        assert got.tobytes() == ref.tobytes()
    assert striped0 and striped1
    np.testing.assert_array_equal(after0, after1)          # the same order on every rank
    assert before0.max() > 0.7 and after0.max() < 0.55      # striping put the first blocks on one aggregator
