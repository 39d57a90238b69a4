import numpy as np
import pytest
from hypothesis import given, strategies as st, settings

from zerosum import protocol as P
from zerosum.blocks import BlockView, find_nonzero_blocks
from zerosum.fixedpoint import block_exponents, dequantize, max_error, precision_bits, quantize


def test_precision_bits_leave_room_for_the_sum():
    assert precision_bits(1) == 31 and precision_bits(2) == 30 and precision_bits(4) == 29
    assert precision_bits(5) == 28 and precision_bits(32) == 26
    with pytest.raises(ValueError):
        precision_bits(0)


@settings(max_examples=200)
@given(world=st.integers(1, 32), scale=st.integers(-140, 120), seed=st.integers(0, 2**32 - 1))
def test_quantisation_error_bound_and_no_overflow(world, scale, seed):
    rng = np.random.default_rng(seed)
    xs = (rng.standard_normal((world, 4, 64)) * 2.0 ** scale).astype(np.float32)
    xs[:, 1] = 0                      # an all-zero block
    xs[0, 2, 0] = np.float32(2.0 ** scale) * np.float32(1.9999)  # near the top of the exponent
    maxabs = np.abs(xs).max(axis=2)
    exps = block_exponents(maxabs)
    agreed = exps.max(axis=0)
    live = agreed != P.NO_EXP
    q = np.stack([quantize(x[live], agreed[live], world) for x in xs])
    limit = 2 ** precision_bits(world)
    assert np.all(np.abs(q) < limit)          # so the sum of `world` of them fits int32
    total = q.astype(np.int64).sum(axis=0)
    assert np.all(np.abs(total) < 2**31)
    out = dequantize(total.astype(np.int32), agreed[live], world)
    exact = xs[:, live].astype(np.float64).sum(axis=0)
    bound = max_error(agreed[live], world)[:, None]
    assert np.all(np.abs(out - exact) <= bound)


def test_extreme_exponents_are_exact_powers_of_two():
    x = np.array([[np.finfo(np.float32).max, 1.0], [np.float32(1e-45), 0]], np.float32)  # max and a subnormal
    e = block_exponents(np.abs(x).max(axis=1))
    q = quantize(x, e, 1)
    assert q[0, 0] == 2**31 - 2**7 and q[1, 0] == 2**30  # both exactly representable
    expect = x.copy()
    expect[0, 1] = 0          # 1.0 is far below the precision of a block whose maximum is 3.4e38
    assert np.array_equal(dequantize(q, e, 1), expect)


def test_blocks_edge_cases():
    empty = BlockView(np.zeros(0, np.float32), 256)
    assert empty.nblocks == 0 and find_nonzero_blocks(empty).nonzero.size == 0
    x = np.zeros(1000, np.float32)
    x[999] = -3.0
    x[10] = 0.5
    v = BlockView(x, 256)
    assert v.nblocks == 4 and v.nfull == 3
    sb = find_nonzero_blocks(v)
    assert list(sb.nonzero) == [True, False, False, True]
    assert sb.exponents[0] == 0 and sb.exponents[3] == 2        # 0.5 < 2**0, 3 < 2**2
    assert sb.exponents[1] == P.NO_EXP
    rows = v.rows(np.array([3, 0]))
    assert rows[0, 999 - 768] == -3.0 and np.all(rows[0, 1000 - 768:] == 0) and rows[1, 10] == 0.5
    assert not find_nonzero_blocks(BlockView(np.zeros(512, np.float32), 256)).nonzero.any()
    assert find_nonzero_blocks(BlockView(np.ones(512, np.float32), 256)).nonzero.all()
    ints = find_nonzero_blocks(BlockView(np.array([0, 0, -1, 0, 0], np.int32), 2))
    assert list(ints.nonzero) == [False, True, False] and ints.exponents[1] == P.INT_EXP


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_refused(bad):
    x = np.ones(600, np.float32)
    x[300] = bad
    with pytest.raises(ValueError, match="block 1, elements 256..511"):
        find_nonzero_blocks(BlockView(x, 256))


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="float32 and int32"):
        BlockView(np.zeros(4, np.float64), 2)
