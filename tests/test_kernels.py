"""The compiled kernels against independent numpy computations.

- the block scan (block_scan.scan_blocks through blocks.scan): non-zero blocks and frexp exponents on
  random geometries, odd block sizes, partial last blocks and unaligned buffers, -0.0, subnormals,
  int32, and NaN/inf refused naming the first bad block;
- the per-value loops: quantising (x * 2**s, rounded half to even) and dequantising
  (float32(sum) * 2**s / divisor) for every power-of-two shift in and beyond float32's exponent range,
  bit for bit against np.ldexp and against exact float64 arithmetic;
- grouping a worker's blocks by column (worker_kernels.sort_by_column) against numpy's stable argsort;
- the whole machine path (netsim) for worlds up to 16 and odd block sizes, against reference_allreduce;
- NaN/inf refused by Worker.allreduce before any DATA datagram leaves the worker;
- the driver loop's order of ready columns (take_ready), the window's prefix (admit), the expired columns
  taken for retransmission (take_expired) and the recovery timer (recovery_timer with due_by).
"""
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from netsim import run
from zerosum import aggregator_kernels as AK
from zerosum import block_scan as BS
from zerosum import worker_kernels as K
from zerosum import worker_rounds as R
from zerosum import protocol as P
from zerosum import transport as T
from zerosum import wire as W
from zerosum import worker_state as WS
from zerosum.aggregator_machine import AggregatorMachine
from zerosum.blocks import BlockSource, DenseResult, scan
from zerosum.fixedpoint import dequantize, precision_bits, quantize, scale_rows
from zerosum.layout import Layout, balanced_column_order
from zerosum.reference import reference_allreduce
from zerosum.worker_machine import AllreduceMachine, WorkerConfig

F32_MAX_BITS = 0x7F7FFFFF
SHIFTS = range(-180, 181)     # every shift a block can need (precision 24..31, exponents -148..128) and more


# -- test data --------------------------------------------------------------------------------------------

def float_values(rng, n):
    """float32 values of every kind: zeros of both signs, subnormals, normals of any exponent (up to the
    largest float32), and ordinary magnitudes, with random signs."""
    kind = rng.integers(0, 6, n)
    bits = np.zeros(n, np.uint32)
    bits[kind == 1] = 0x80000000                                                     # -0.0
    bits[kind == 2] = rng.integers(1, 0x800000, n, dtype=np.uint32)[kind == 2]        # subnormal
    bits[kind == 3] = rng.integers(0x800000, F32_MAX_BITS + 1, n, dtype=np.uint32)[kind == 3]  # any normal
    bits[kind == 4] = F32_MAX_BITS                                                    # max float32
    bits[kind == 5] = np.float32(rng.standard_normal(n)).view(np.uint32)[kind == 5]   # ordinary
    signs = rng.integers(0, 2, n, dtype=np.uint32) << np.uint32(31)
    bits[kind >= 2] |= signs[kind >= 2]
    return bits.view(np.float32)


def block_data(rng, n, block_size, dtype, density):
    """A flat array with about `density` of its blocks non-zero; some "zero" blocks hold only -0.0."""
    if dtype == np.int32:
        x = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
        x[rng.random(n) < 0.5] = 0
        x[rng.random(n) < 0.05] = np.int32(-2**31)
    else:
        x = float_values(rng, n)
    nblocks = -(-n // block_size)
    live = np.repeat(rng.random(nblocks) < density, block_size)[:n]
    negzero = np.repeat(rng.random(nblocks) < 0.5, block_size)[:n]
    if dtype == np.int32:
        x[~live] = 0
    else:
        x[~live] = np.where(negzero[~live], np.float32(-0.0), np.float32(0.0))
    return x


def placed(x, offset):
    """A copy of x starting `offset` elements into a fresh (8-byte aligned) buffer."""
    buf = np.zeros(x.size + offset, x.dtype)
    view = buf[offset:]
    view[...] = x
    return view


def numpy_scan(flat, block_size):
    """(blocks, exponents, first bad block or -1) computed with plain numpy in float64."""
    n = flat.size
    nblocks = -(-n // block_size)
    padded = np.zeros(nblocks * block_size, flat.dtype)
    padded[:n] = flat
    rows = padded.reshape(nblocks, block_size)
    if flat.dtype == np.int32:
        live = np.flatnonzero((rows != 0).any(axis=1))
        return live, np.full(len(live), P.INT_EXP), -1
    with np.errstate(invalid="ignore"):           # signalling NaNs
        maxabs = np.abs(rows.astype(np.float64)).max(axis=1) if nblocks else np.zeros(0)
    bad = np.flatnonzero(~np.isfinite(maxabs))
    first_bad = int(bad[0]) if len(bad) else -1
    stop = first_bad if first_bad >= 0 else nblocks
    live = np.flatnonzero(maxabs[:stop] > 0)
    _, exps = np.frexp(maxabs[live])
    return live, exps, first_bad


def kernel_scan(flat, block_size):
    """block_scan.scan_blocks called directly (what it returns past a NaN block too)."""
    nblocks = -(-flat.size // block_size)
    blocks = np.full(nblocks, -1, np.int64)
    exps = np.full(nblocks, -1, np.int32)
    count, bad = BS.scan_blocks(flat.view(np.int32), block_size, flat.dtype == np.int32, blocks, exps)
    return blocks[:count], exps[:count], bad


# -- the block scan -----------------------------------------------------------------------------------------

BLOCK_SIZES = [1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 64, 255, 256]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 3000), block_size=st.sampled_from(BLOCK_SIZES), offset=st.integers(0, 1),
       int_data=st.booleans(), density=st.sampled_from([0.0, 0.05, 0.5, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_scan_matches_numpy(n, block_size, offset, int_data, density, seed):
    rng = np.random.default_rng(seed)
    x = placed(block_data(rng, n, block_size, np.int32 if int_data else np.float32, density), offset)
    want_blocks, want_exps, bad = numpy_scan(x, block_size)
    assert bad == -1
    event(f"partial last block: {n % block_size != 0}")
    blocks, exps = scan(x, block_size)
    assert blocks.dtype == np.int64 and exps.dtype == np.int32
    assert np.array_equal(blocks, want_blocks) and np.array_equal(exps, want_exps)
    b, e, bad = kernel_scan(x, block_size)
    assert bad == -1 and np.array_equal(b, want_blocks) and np.array_equal(e, want_exps)


@pytest.mark.parametrize("tail", [0, 1])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("block_size", [2, 3, 8, 64])
def test_scan_agrees_at_any_alignment(offset, block_size, tail):
    """The same data 8-byte aligned and one float32 further into its buffer, with and without a
    partial last block (which holds the largest value, so that a scan stopping short shows): numpy's
    answer every time."""
    rng = np.random.default_rng(block_size)
    n = block_size * 50 + tail
    data = block_data(rng, n, block_size, np.float32, 0.3)
    data[-1] = np.float32(1e30)
    x = placed(data, offset)
    assert x.ctypes.data % 8 == 4 * offset
    want_blocks, want_exps, _ = numpy_scan(x, block_size)
    assert want_blocks[-1] == (n - 1) // block_size
    blocks, exps = scan(x, block_size)
    assert np.array_equal(blocks, want_blocks) and np.array_equal(exps, want_exps)


def test_scan_sign_bits_and_single_bits():
    """-0.0 counts as zero wherever it is, the smallest subnormal does not; for int32 data a value with
    only the sign bit set is non-zero."""
    B = 4
    neg0 = np.float32(-0.0)
    tiny = np.uint32(1).view(np.float32)          # 2**-149
    x = np.zeros(6 * B, np.float32)
    x[0:4] = neg0                                 # block 0: -0.0 everywhere
    x[5] = tiny                                   # block 1: smallest subnormal in a high half
    x[8] = -tiny                                  # block 2: in a low half, negative
    x[15] = np.float32(-np.finfo(np.float32).max)  # block 3: the largest magnitude, last element
    x[16:20] = [neg0, 0, neg0, 0]                  # block 4: zeros of both signs
    x[23] = np.float32(2.0 ** -126)                # block 5: the smallest normal
    b, e, bad = kernel_scan(x, B)
    assert bad == -1
    assert list(b) == [1, 2, 3, 5]
    assert list(e) == [-148, -148, 128, -125]
    assert np.array_equal(e, np.frexp(np.abs(x.astype(np.float64)).reshape(-1, B).max(axis=1))[1][b])
    ints = np.zeros(4 * B, np.int32)
    ints[1] = np.int32(-2**31)                    # only the sign bit: non-zero for int32
    ints[14] = 1
    b, e, bad = kernel_scan(ints, B)
    assert list(b) == [0, 3] and list(e) == [P.INT_EXP] * 2 and bad == -1


def test_scan_every_exponent():
    """One block per float32 exponent (subnormal bit lengths included), largest magnitude anywhere."""
    rng = np.random.default_rng(0)
    B = 6
    tops = np.concatenate([np.uint32(1) << np.arange(23, dtype=np.uint32),          # subnormals
                           (np.arange(1, 255, dtype=np.uint32) << np.uint32(23))
                           | rng.integers(0, 1 << 23, 254, dtype=np.uint32)])      # every normal exponent
    x = np.zeros((len(tops), B), np.float32)
    for i, top in enumerate(tops):
        m = top.view(np.float32)
        x[i] = m * rng.random(B).astype(np.float32) * np.float32(0.5)    # smaller values...
        x[i, rng.integers(B)] = -m if i % 2 else m                       # ...and the maximum
    for offset in (0, 1):
        flat = placed(x.reshape(-1), offset)
        blocks, exps = scan(flat, B)
        want_blocks, want_exps, _ = numpy_scan(flat, B)
        assert np.array_equal(blocks, np.arange(len(tops))) and np.array_equal(blocks, want_blocks)
        assert np.array_equal(exps, want_exps)
        assert exps.min() == -148 and exps.max() == 128


NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000]   # NaNs, +inf, -inf


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 2000), block_size=st.sampled_from(BLOCK_SIZES), offset=st.integers(0, 1),
       bad_bits=st.lists(st.sampled_from(NAN_BITS), min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_nan_and_inf_name_the_first_bad_block(n, block_size, offset, bad_bits, seed):
    rng = np.random.default_rng(seed)
    x = block_data(rng, n, block_size, np.float32, 0.3)
    where = rng.integers(0, n, len(bad_bits))
    x.view(np.uint32)[where] = bad_bits
    x = placed(x, offset)
    first = int(where.min()) // block_size
    assert numpy_scan(x, block_size)[2] == first
    lo, hi = first * block_size, (first + 1) * block_size - 1
    with pytest.raises(ValueError, match=rf"NaN or infinite values \(first in block {first}, elements {lo}\.\.{hi}\)"):
        scan(x, block_size)
    assert kernel_scan(x, block_size)[2] == first


@pytest.mark.parametrize("block_size", [1, 4, 256])
def test_scan_finds_a_block_at_every_place_of_its_group(block_size):
    """The float scan looks at blocks in groups of BS.SCAN_GROUP (a zero group as one span), then block
    by block: a lone non-zero block, a NaN between two non-zero blocks, and a zero group behind a dense one
    are found at every place of a group, in whole groups and in the blocks after the last one."""
    G = BS.SCAN_GROUP
    nblocks = 3 * G + 5
    for p in range(nblocks):
        x = np.zeros(nblocks * block_size, np.float32)
        x[p * block_size + block_size - 1] = np.float32(-3.0)
        assert [b.tolist() for b in kernel_scan(x, block_size)[:2]] == [[p], [2]]
        # a dense group first, then only block p (the scan leaves its dense pace behind a zero group)
        x[: G * block_size] = np.float32(0.25)
        x[p * block_size + block_size - 1] = np.float32(-3.0)
        want = sorted(set(range(G)) | {p})
        b, e, bad = kernel_scan(x, block_size)
        assert bad == -1 and b.tolist() == want and e.tolist() == [2 if i == p else -1 for i in want]
        if 0 < p < nblocks - 1:
            y = np.zeros(nblocks * block_size, np.float32)
            y[(p - 1) * block_size] = y[(p + 1) * block_size] = np.float32(1.0)
            y.view(np.uint32)[p * block_size + block_size // 2] = 0x7FC00000
            b, e, bad = kernel_scan(y, block_size)
            assert bad == p and b.tolist() == [p - 1] and e.tolist() == [1]


# -- grouping a worker's blocks by column ----------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(nblocks=st.integers(1, 5000), aggregators=st.integers(1, 3), slots=st.integers(1, 80),
       balanced=st.booleans(), fraction=st.floats(0, 1), seed=st.integers(0, 2**32 - 1))
def test_sort_by_column_is_a_stable_argsort_by_column(nblocks, aggregators, slots, balanced, fraction, seed):
    """worker_kernels.sort_by_column against numpy's stable argsort of Layout.column_of_block: the same order,
    the same column starts, exponents and rows carried along, END after the last block; with plain
    striping and with a balanced column order, blocks far apart (steps of more than a column's width)
    and adjacent."""
    rng = np.random.default_rng(seed)
    order = balanced_column_order(rng.random(nblocks), aggregators, slots) if balanced else None
    layout = Layout(aggregators, slots, nblocks, order)
    S = layout.columns
    blocks = np.flatnonzero(rng.random(nblocks) < fraction).astype(np.int64)
    exps = rng.integers(-149, 128, len(blocks)).astype(np.int32)
    rows = rng.integers(0, 1 << 40, len(blocks))
    by_column = np.argsort(layout.column_of_block(blocks), kind="stable")
    own = np.full((len(blocks) + 1, 3), -7, np.int64)
    starts = np.full(S + 1, -7, np.int64)
    K.sort_by_column(blocks, exps, rows, S, np.zeros(0, np.int64) if order is None else order, own, starts)
    seq, seq_exp, seq_row = own[:, K.OWN_BLOCK], own[:-1, K.OWN_EXP], own[:-1, K.OWN_ROW]
    assert seq[:-1].tolist() == blocks[by_column].tolist() and seq[-1] == K.END
    assert seq_exp.tolist() == exps[by_column].tolist() and seq_row.tolist() == rows[by_column].tolist()
    assert starts.tolist() == np.searchsorted(layout.column_of_block(blocks)[by_column], np.arange(S + 1)).tolist()


# -- quantising and dequantising: every power of two -------------------------------------------------------

def value_pool():
    """float32 values for the scaling tests: specials, halfway cases, every exponent, random bits."""
    rng = np.random.default_rng(1)
    f = np.finfo(np.float32)
    special = np.array([0.0, -0.0, 0.5, 1.5, 2.5, 3.5, -2.5, -0.5, 1.0, -1.0, f.max, -f.max, f.tiny, -f.tiny,
                        np.nextafter(f.tiny, 0), 2.0 ** -149, -(2.0 ** -149), 2.0 ** 127, 2.0 ** -126,
                        np.nextafter(np.float32(1.0), np.float32(2.0)),
                        np.nextafter(np.float32(1.0), np.float32(0.0))], np.float32)
    every_exp = (np.arange(0, 255, dtype=np.uint32) << np.uint32(23)) | rng.integers(0, 1 << 23, 255,
                                                                                       dtype=np.uint32)
    odd = (np.arange(1, 255, dtype=np.uint32) << np.uint32(23)) | np.uint32(1)   # the lowest mantissa bit set
    randbits = rng.integers(0, F32_MAX_BITS + 1, 600, dtype=np.uint32)
    signs = rng.integers(0, 2, 255 + 254 + 600, dtype=np.uint32) << np.uint32(31)
    rest = np.concatenate([every_exp, odd, randbits]) | signs
    return np.concatenate([special, rest.view(np.float32)])


POOL = value_pool()
POOL64 = POOL.astype(np.float64)


def from_wire(words):
    """The kernels' big-endian uint32 words as int32 values."""
    return words.byteswap().view(np.int32)


def to_wire(values):
    """int32 values as the big-endian words a datagram holds, read as native uint32."""
    return np.frombuffer(np.asarray(values, np.int32).astype(">i4").tobytes(), np.uint32).copy()


def test_quantize_loop_every_shift():
    """_quantize_swapped(x, s) == rint(x * 2**s): the exact float64 product, rounded half to even, and
    np.rint(np.ldexp(float32 x, s)) wherever that product is a normal float32 - for every shift, on
    both of the kernel's paths (float32 for -126..127, float64 beyond)."""
    checked = 0
    for s in SHIFTS:
        exact = POOL64 * np.ldexp(1.0, s)         # exact: 24-bit mantissas, far inside float64's range
        x = POOL[np.abs(exact) < 2.0 ** 31]       # what fits int32 (all a quantised block can hold)
        exact = exact[np.abs(exact) < 2.0 ** 31]
        want = np.rint(exact).astype(np.int32)
        base = 3
        src = np.concatenate([np.full(base, np.float32(7.0)), x])
        words = np.full(len(x) + 2, 0xDEADBEEF, np.uint32)
        K._quantize_swapped(src, base, len(x), s, words)
        got = from_wire(words[: len(x)])
        assert np.array_equal(got, want), f"shift {s}: {x[got != want][:5]} -> {got[got != want][:5]}"
        assert (words[len(x):] == 0xDEADBEEF).all()          # nothing written past count
        with np.errstate(over="ignore", under="ignore"):
            f32 = np.ldexp(x, np.int32(s))
        normal = np.abs(exact) >= 2.0 ** -126
        assert np.array_equal(got[normal], np.rint(f32[normal]).astype(np.int32)), f"shift {s}"
        assert (got[~normal] == 0).all()
        checked += len(x)
    assert checked > 100_000


def test_quantize_halfway_cases_round_to_even():
    x = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 1.25, 1.75], np.float32)
    for s in (0, -100, -126, 127, 128, 147):    # both of the kernel's paths
        scale = 2.0 ** s
        src = (x.astype(np.float64) / scale).astype(np.float32)      # the same halves at another exponent
        assert np.array_equal(src.astype(np.float64) * scale, x.astype(np.float64))
        words = np.zeros(len(x), np.uint32)
        K._quantize_swapped(src, 0, len(x), s, words)
        assert list(from_wire(words)) == [0, 2, 2, 4, 0, -2, -2, 1, 2]


SUMS = np.concatenate([
    np.array([0, 1, -1, 2, 3, 2**24, 2**24 + 1, 2**24 + 3, -(2**24 + 1), 2**25 + 3, 2**31 - 1, -2**31,
              -(2**31 - 1), 2**30 + 65, 12345678, -7], np.int64),
    np.random.default_rng(2).integers(-2**31, 2**31, 400),
    (np.random.default_rng(3).integers(-2**20, 2**20, 200) * 2 ** np.random.default_rng(4).integers(0, 11, 200)),
]).astype(np.int32)


@pytest.mark.parametrize("divisor", [1, 3, 16])
def test_store_floats_every_shift(divisor):
    """_store_floats(sum, s, d) == np.ldexp(float32(sum), s) / float32(d) bit for bit, and equals the
    exact float64 product rounded once to float32 (then divided), for every shift."""
    d32 = np.float32(divisor)
    words = to_wire(SUMS)
    s32 = SUMS.astype(np.float32)
    for s in SHIFTS:
        out = np.full(len(SUMS) + 5, np.float32(-9.0))
        K._store_floats(words, len(SUMS), s, d32, out, 2)
        got = out[2: 2 + len(SUMS)]
        with np.errstate(over="ignore", under="ignore"):
            want = np.ldexp(s32, np.int32(s)) / d32
            exact = (s32.astype(np.float64) * np.ldexp(1.0, s)).astype(np.float32) / d32
        assert got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
            f"shift {s}: {SUMS[got != want][:4]} -> {got[got != want][:4]}, want {want[got != want][:4]}"
        assert np.array_equal(got.view(np.uint32), exact.view(np.uint32)), f"shift {s}"
        assert (out[:2] == -9).all() and (out[2 + len(SUMS):] == -9).all()


def test_int_loops_and_copy_are_byte_swaps():
    v = SUMS
    words = np.zeros(len(v), np.uint32)
    K._copy_swapped(v.view(np.uint32), 0, len(v), words)
    assert np.array_equal(words, to_wire(v))
    out = np.zeros(len(v) + 1, np.int32)
    W.store_swapped(words, len(v), out, 1)
    assert np.array_equal(out[1:], v) and out[0] == 0
    acc = np.arange(len(v), dtype=np.int32).reshape(1, -1)
    AK._add_swapped(words, 0, acc, 0)
    assert np.array_equal(acc[0], (np.arange(len(v)) + v.astype(np.int64)).astype(np.int32))   # wraps as int32


def test_scale_rows_is_exact_ldexp():
    """fixedpoint.scale_rows == np.ldexp == the exact product rounded once, for every shift."""
    shifts = np.array(list(SHIFTS))
    rows = np.tile(POOL, (len(shifts), 1))
    with np.errstate(over="ignore", under="ignore"):
        got = scale_rows(rows, shifts)
        want = np.ldexp(rows, shifts.astype(np.int32)[:, None])
        exact = (rows.astype(np.float64) * np.ldexp(1.0, shifts)[:, None]).astype(np.float32)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(got.view(np.uint32), exact.view(np.uint32))


def test_quantize_at_two_to_the_127():
    """Scaling by exactly 2**127 (the largest power of two a float32 holds, the one np.exp2 gets wrong on
    some CPUs) and just beyond it: quantize gives the exact integers."""
    for world in (1, 2, 3):
        p = precision_bits(world)
        for shift in (126, 127, 128, 150, p + 148):      # p + 148: a block whose maximum is 2**-149
            e = p - shift
            mags = np.array([2.0 ** (e - 1), 1.5 * 2.0 ** (e - 1), (1 - 2.0 ** -24) * 2.0 ** e,
                             2.0 ** (e - 24) * 3, 2.0 ** -149], np.float64)
            x = mags.astype(np.float32)
            x = x[(x.astype(np.float64) < 2.0 ** e) & (x > 0)]
            rows = np.stack([x, -x])
            q = quantize(rows, np.array([e, e]), world)
            want = np.rint(rows.astype(np.float64) * 2.0 ** shift).astype(np.int32)
            assert np.array_equal(q, want), (world, shift)
            assert np.all(np.abs(q) < 2 ** p)
            words = np.zeros(len(x), np.uint32)
            K._quantize_swapped(x, 0, len(x), np.int64(shift), words)
            assert np.array_equal(from_wire(words), q[0])
    x = np.array([[2.0 ** -97 * 1.5, (1 - 2.0 ** -24) * 2.0 ** -96]], np.float32)
    assert list(quantize(x, np.array([-96]), 1)[0]) == [3 * 2**29, 2**31 - 2**7]


@pytest.mark.parametrize("world", [1, 2, 3, 16, 32])
def test_kernels_follow_fixedpoint_for_every_exponent(world):
    """For every exponent a float32 block can have, the kernels quantise as fixedpoint.quantize and
    dequantise as fixedpoint.dequantize (the reference rule), bit for bit."""
    p = precision_bits(world)
    rng = np.random.default_rng(world)
    for e in range(-148, 129):
        x = POOL[(np.abs(POOL64) < 2.0 ** e)]
        x = x[rng.permutation(len(x))[:64]]
        q = quantize(x[None], np.array([e]), world)[0]
        words = np.zeros(len(x), np.uint32)
        K._quantize_swapped(x, 0, len(x), np.int64(p - e), words)
        assert np.array_equal(from_wire(words), q), e
        sums = (q.astype(np.int64) * world).clip(-2**31, 2**31 - 1).astype(np.int32)
        with np.errstate(over="ignore"):
            want = dequantize(sums[None], np.array([e]), world)[0]
        out = np.zeros(len(x), np.float32)
        K._store_floats(to_wire(sums), len(x), np.int64(e - p), np.float32(1), out, 0)
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), e


# -- the machine path, worlds up to 16 and odd block sizes ---------------------------------------------------

def machine_arrays(rng, world, n, block_size, density, dtype):
    out = []
    nblocks = -(-n // block_size)
    for _ in range(world):
        if dtype == np.int32:
            x = rng.integers(-2**26, 2**26, n).astype(np.int32)
        else:
            # magnitudes spread over many exponents, a few blocks tiny (subnormal) or huge
            scale = np.repeat(2.0 ** rng.integers(-20, 21, nblocks), block_size)[:n]
            x = (rng.standard_normal(n) * scale).astype(np.float32)
            x[rng.random(n) < 0.02] = np.float32(2.0 ** -140)
            x[rng.random(n) < 0.01] = np.float32(3e37)
        x[~np.repeat(rng.random(nblocks) < density, block_size)[:n]] = 0
        out.append(x)
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=st.integers(1, 16), n=st.integers(0, 1500), block_size=st.sampled_from([1, 3, 5, 7, 13, 33, 255]),
       density=st.sampled_from([0.05, 0.3, 1.0]), naggs=st.integers(1, 3), slots=st.integers(1, 9),
       loss=st.sampled_from([0.0, 0.1]), int_data=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_machines_match_reference_up_to_world_16(world, n, block_size, density, naggs, slots, loss, int_data,
                                                 seed):
    rng = np.random.default_rng(seed)
    dtype = np.int32 if int_data else np.float32
    arrays = machine_arrays(rng, world, n, block_size, density, dtype)
    aggs = [AggregatorMachine(1, world, slots=slots) for _ in range(naggs)]
    outs, _ = run(arrays, aggs, block_size=block_size, loss=loss, dup=loss, reorder=0.3, seed=seed)
    ref = reference_allreduce(arrays, block_size)
    for o in outs:
        assert o.dtype == dtype and o.shape == ref.shape
        assert o.tobytes() == ref.tobytes()


# -- NaN/inf never leave the worker ------------------------------------------------------------------------

class RecordingAggregator:
    """A real AggregatorServer on loopback in a thread; data_datagrams() counts the DATA it took."""

    def __init__(self, workers):
        from zerosum.aggregator import AggregatorServer
        self.server = AggregatorServer(workers, listen="127.0.0.1:0", slots=64)
        self.stopping = False
        self.thread = threading.Thread(target=self.server.serve, kwargs=dict(stop=lambda: self.stopping),
                                       daemon=True)
        self.thread.start()
        host, port = self.server.address
        self.address = f"{host}:{port}"

    def data_datagrams(self):
        return self.server.service.counters.get("datagrams", 0)

    def close(self):
        self.stopping = True
        self.thread.join(5)
        self.server.close()


def test_nan_and_inf_are_refused_before_anything_is_sent():
    import torch
    import zerosum
    agg = RecordingAggregator(1)
    try:
        with zerosum.Worker(0, 1, [agg.address], block_size=16, timeout=10.0) as w:
            x = np.linspace(-1, 1, 16 * 40 + 5, dtype=np.float32)
            bad = x.copy()
            bad[16 * 39 + 3] = np.nan           # only the last full block is bad
            bad_inf = x.copy()
            bad_inf[16 * 40 + 1] = -np.inf      # in the short last block
            sparse_bad = torch.sparse_coo_tensor(torch.tensor([[1, 7, 500]]), torch.tensor([1.0, np.inf, 2.0]),
                                                 (600,), check_invariants=True)
            attempts = [
                ("block 39", lambda: w.allreduce(bad)),
                ("block 40", lambda: w.allreduce(bad_inf)),
                ("block 39", lambda: w.allreduce(bad, out=bad)),
                ("block 39", lambda: w.allreduce(torch.from_numpy(bad.copy()))),
                ("block 39", lambda: w.allreduce(torch.from_numpy(bad.reshape(5, 129)), average=True)),
                (None, lambda: w.allreduce(sparse_bad)),
                (None, lambda: w.allreduce_blocks([2, 9], np.stack([x[:16], bad[16 * 39: 16 * 40]]), 40)),
            ]
            joined = w.stats.datagrams_sent             # the JOINs
            for where, attempt in attempts:
                sent = w.stats.datagrams_sent
                with pytest.raises(ValueError, match="NaN or infinite") as info:
                    attempt()
                if where:
                    assert where in str(info.value)
                assert w.stats.datagrams_sent == sent
            w.gather_on_device = True       # torch's own detection on the tensor's device
            with pytest.raises(ValueError, match="NaN or infinite values \\(first in block 39"):
                w.allreduce(torch.from_numpy(bad.copy()))
            w.gather_on_device = None
            assert agg.data_datagrams() == 0
            assert w.stats.allreduces == 0 and w.stats.datagrams_sent == joined
            # the worker and the aggregator still work, and DATA would have been seen
            got = w.allreduce(x)
            assert got.tobytes() == reference_allreduce([x], 16).tobytes()
            assert agg.data_datagrams() > 0
    finally:
        agg.close()


def _take_ready(queue, S, A, admitted, budget, quantum=1, first=0, boot=()):
    """R.take_ready over the ready columns `queue` (in arrival order) of S columns and A aggregators, every
    column past its bootstrap except those in `boot`. Returns (columns taken, queue left, paced, held)."""
    ready = np.zeros(S, bool)
    ready[queue] = True
    q = np.zeros(S, np.int64)
    q[:len(queue)] = queue
    round_block = np.full(S, 7, np.int64)
    round_block[list(boot)] = P.BOOT
    cols = np.zeros(S, np.int64)
    deadline, sent_at, rto = np.full(S, np.inf), np.full(S, np.nan), np.full(S, 0.2)
    resent = np.ones(S, bool)
    k, paced, held, _, kept = R.take_ready(ready, q, len(queue), cols, A, deadline, sent_at, resent, rto, 1.0,
                                           round_block, admitted, budget, quantum, first, np.zeros(A, np.int64))
    taken = cols[:k].tolist()
    assert not ready[taken].any() and ready[q[:kept]].all()
    assert (deadline[taken] == 1.2).all() and (sent_at[taken] == 1.0).all() and not resent[taken].any()
    return taken, q[:kept].tolist(), paced, held


def test_take_ready_keeps_the_arrival_order_within_each_aggregator():
    """R-A8: columns leave in the order their results arrived, grouped by aggregator from `first` on."""
    assert _take_ready([5, 2, 7, 0, 3], 8, 1, 8, 100)[:2] == ([5, 2, 7, 0, 3], [])
    assert _take_ready([5, 2, 7, 0, 3], 8, 2, 8, 100)[:2] == ([2, 0, 5, 7, 3], [])
    assert _take_ready([5, 2, 7, 0, 3], 8, 2, 8, 100, first=1)[:2] == ([5, 7, 3, 2, 0], [])


def test_take_ready_leaves_what_the_window_and_the_pacer_hold_in_its_place():
    """R-L6 and R-C7: columns past the window stay queued, bootstraps go regardless; past the pacer's
    budget the rest stays, in arrival order, ahead of results that arrive later."""
    taken, left, paced, held = _take_ready([6, 1, 4, 0], 8, 1, 3, 100, boot=[6])
    assert (taken, left, paced, held) == ([6, 1, 0], [4], 2, 0)
    taken, left, paced, held = _take_ready([5, 2, 7, 0, 3], 8, 1, 8, 2)
    assert (taken, left, paced, held) == ([5, 2], [7, 0, 3], 2, 1)


@settings(max_examples=300, deadline=None)
@given(done=st.lists(st.booleans(), max_size=60), window=st.integers(0, 70))
def test_admit_is_the_shortest_prefix_holding_the_window(done, window):
    """R-L6: the window admits the shortest prefix of the columns (in index order) that holds `window`
    columns not yet at END, or every column where fewer are open."""
    round_block = np.where(np.array(done, bool), P.END, 3).astype(np.int64)
    admitted, open_ = 0, 0
    for b in round_block:                      # the rule, one column at a time
        if open_ == window:
            break
        admitted += 1
        open_ += b != P.END
    assert R.admit(round_block, window) == admitted


@settings(max_examples=300, deadline=None)
@given(data=st.data(), S=st.integers(1, 40), A=st.integers(1, 4))
def test_take_expired_takes_each_aggregators_expired_columns_within_its_allowance(data, S, A):
    """R-L1/R-L2: per aggregator in turn, its columns (c mod A) not at END whose timer expired, in index
    order, at most allow[a] of them; each gets a doubled timeout capped at max_rto (Karn: marked resent,
    so no round-trip sample comes from it) and a new deadline from now. Nothing else changes."""
    now, max_rto = 5.0, 1.0
    end = np.array(data.draw(st.lists(st.booleans(), min_size=S, max_size=S)))
    round_block = np.where(end, P.END, 9).astype(np.int64)
    deadline = np.array(data.draw(st.lists(st.sampled_from([1.0, 5.0, 6.0, np.inf]), min_size=S, max_size=S)))
    rto = np.array(data.draw(st.lists(st.sampled_from([0.2, 0.4, 0.75]), min_size=S, max_size=S)))
    allow = np.array(data.draw(st.lists(st.integers(0, S), min_size=A, max_size=A)), np.int64)
    sent_at, resent, cols = np.zeros(S), np.zeros(S, bool), np.full(S, -1, np.int64)
    before = dict(deadline=deadline.copy(), rto=rto.copy(), sent_at=sent_at.copy())

    expect = []
    for a in range(A):
        due = [c for c in range(a, S, A) if not end[c] and deadline[c] <= now]
        expect += due[:allow[a]]
    k = R.take_expired(round_block, cols, A, deadline, sent_at, resent, rto, allow, max_rto, now)
    assert cols[:k].tolist() == expect
    others = np.setdiff1d(np.arange(S), expect)
    assert np.array_equal(rto[expect], np.minimum(before["rto"][expect] * 2, max_rto))
    assert np.array_equal(deadline[expect], now + rto[expect]) and (sent_at[expect] == now).all()
    assert resent[expect].all() and not resent[others].any()
    for name, array in (("deadline", deadline), ("rto", rto), ("sent_at", sent_at)):
        assert np.array_equal(array[others], before[name][others]), name


def _greedy_cuts(costs, budget, max_entries):
    """encode_data's cut: entries in order while they fit (by bytes, and max_entries); at least one."""
    cuts, start, used = [], 0, 0
    for k, cost in enumerate(costs):
        if k > start and (used + cost > budget or k - start >= max_entries):
            cuts.append((start, k, used))
            start, used = k, 0
        used += cost
    if costs:
        cuts.append((start, len(costs), used))
    return cuts


@settings(max_examples=400, deadline=None)
@given(has=st.lists(st.booleans(), max_size=120), block_size=st.sampled_from([1, 4, 64, 256]),
       budget=st.integers(16, 3000), max_entries=st.sampled_from([1, 2, 3, 7, 0xFFFF]),
       lo=st.integers(0, 3), seed=st.integers(0, 2**32 - 1))
def test_pack_entries_fills_datagrams_and_keeps_each_kinds_order(has, block_size, budget, max_entries, lo, seed):
    """worker_kernels.pack_entries: a permutation of the round's entries in which data entries keep their order
    and header-only entries theirs; cut as encode_data cuts, every datagram that still had room for a
    header-only entry (by bytes and by count) is followed by no header-only entry; never more datagrams
    than the arrival order; cols outside [lo, hi) untouched."""
    rng = np.random.default_rng(seed)
    n = len(has)
    S = lo + n + 2
    cols = np.arange(S, dtype=np.int64)
    cols[lo:lo + n] = lo + rng.permutation(n)
    round_block = np.full(S, 5, np.int64)
    # a column holds data when its own next block is its round's block: own[mine_pos[c]] is block 5
    own = np.array([[5, 0, 0], [9, 0, 1], [P.END, 0, 0]], np.int64)
    mine_pos = np.full(S, 1, np.int64)
    col_stop = np.full(S, 2, np.int64)
    data_cols = {int(c) for c, h in zip(cols[lo:lo + n], has) if h}
    mine_pos[list(data_cols)] = 0
    per_data = 4 * block_size
    before = cols.copy()
    K.pack_entries(cols, lo, lo + n, np.zeros(S, np.int64), round_block, mine_pos, col_stop, own, per_data,
                   budget, max_entries)
    assert cols[:lo].tolist() == before[:lo].tolist() and cols[lo + n:].tolist() == before[lo + n:].tolist()
    got = cols[lo:lo + n].tolist()
    assert sorted(got) == sorted(before[lo:lo + n].tolist())
    kind = lambda seq_, data: [c for c in seq_ if (c in data_cols) == data]   # noqa: E731
    assert kind(got, True) == kind(before[lo:lo + n].tolist(), True)
    assert kind(got, False) == kind(before[lo:lo + n].tolist(), False)
    costs = [W.ENT + (per_data if c in data_cols else 0) for c in got]
    cuts = _greedy_cuts(costs, budget, max_entries)
    for start, end, used in cuts:
        if used + W.ENT <= budget and end - start < max_entries:
            assert all(c in data_cols for c in got[end:]), (start, end, used, got)
    arrival = [W.ENT + (per_data if c in data_cols else 0) for c in before[lo:lo + n].tolist()]
    assert len(cuts) <= len(_greedy_cuts(arrival, budget, max_entries))


@pytest.mark.parametrize("max_bytes", [T.GSO_MAX_BYTES // 2 + 1, P.MAX_DATAGRAM])
def test_pack_entries_keeps_the_arrival_order_of_datagrams_a_gso_message_holds_one_of(max_bytes):
    """Datagrams of which one GSO message cannot hold two gain nothing from packing: the entries keep the
    order their results arrived in, header-only entries behind data entries that fill a datagram
    included (so rounds complete in their places, not ahead of them)."""
    S = 300
    cols = np.random.default_rng(1).permutation(S).astype(np.int64)
    round_block = np.full(S, 5, np.int64)
    own = np.array([[5, 0, 0], [9, 0, 1], [P.END, 0, 0]], np.int64)
    mine_pos = np.zeros(S, np.int64)
    mine_pos[cols[::7]] = 1            # every 7th column in arrival order is header-only
    col_stop = np.full(S, 2, np.int64)
    before = cols.copy()
    budget = max_bytes - W.HDR
    K.pack_entries(cols, 0, S, np.zeros(S, np.int64), round_block, mine_pos, col_stop, own, 4 * 256, budget,
                   0xFFFF)
    assert cols.tolist() == before.tolist()
    # the same round in MTU-sized datagrams is packed: a header-only entry goes ahead of a data entry
    K.pack_entries(cols, 0, S, np.zeros(S, np.int64), round_block, mine_pos, col_stop, own, 4 * 256, 1452,
                   0xFFFF)
    assert cols.tolist() != before.tolist() and sorted(cols.tolist()) == sorted(before.tolist())


def test_mtu_sized_datagrams_of_a_sparse_round_have_one_length(monkeypatch):
    """At 1,472 bytes a data entry of 256 values fills most of a datagram. What a worker sends after a
    batch of results still goes in at most 3 GSO messages: full datagrams, the one where the header-only
    entries ran out, and data entries alone (up to 64 datagrams each); and the sums stay exact."""
    sizes = []
    flush = AllreduceMachine.flush

    def recording_flush(self, now):
        out = flush(self, now)
        sizes.append([len(d) for _, d in out])
        return out

    monkeypatch.setattr(AllreduceMachine, "flush", recording_flush)
    rng = np.random.default_rng(3)
    B, nblocks = 256, 3000
    arrays = []
    for _ in range(3):
        x = np.zeros(nblocks * B, np.float32)
        for b in rng.choice(nblocks, nblocks // 5, replace=False):
            x[b * B:(b + 1) * B] = rng.standard_normal(B)
        arrays.append(x)
    outs, _ = run(arrays, [AggregatorMachine(1, 3, slots=300)], block_size=B, max_datagram=1472, batch=0.9)
    ref = reference_allreduce(arrays, B)
    assert all(o.tobytes() == ref.tobytes() for o in outs)
    mixed = [s for s in sizes if len(s) > 2 and min(s) < 20 + 16 + 4 * B < max(s)]
    assert mixed and all(_gso_messages(s) <= 3 for s in sizes), sizes


def _gso_messages(sizes, most=64):
    """How many GSO messages transport.queue_datagrams makes of back-to-back datagrams of these lengths:
    a run of equally long ones (at most `most`), which one shorter datagram may end."""
    messages = i = 0
    while i < len(sizes):
        j = i + 1
        while j < len(sizes) and j - i < most and sizes[j] <= sizes[i]:
            j += 1
            if sizes[j - 1] < sizes[i]:
                break
        messages += 1
        i = j
    return messages


@settings(max_examples=300, deadline=None)
@given(columns=st.integers(1, 40), aggregators=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_the_driver_loops_recovery_timer_is_never_late_and_exact_when_due(columns, aggregators, seed):
    """worker_rounds.recovery_timer(st, now), which spares the driver loop a scan of every column after every
    batch: where recovery_timer(st) is due by `now` it returns it exactly; otherwise a time after `now` and
    no later than it (waking early costs a look, waking late would delay a retransmission or the
    timeout), over random rounds, deadlines, probes, confirmed losses and last-heard times."""
    rng = np.random.default_rng(seed)
    B = 4
    x = np.ones(columns * aggregators * B, np.float32)
    source = BlockSource.dense(x, B)
    m = AllreduceMachine(WorkerConfig(rank=0, world=2, job=1, block_size=B), 1, source,
                         Layout(aggregators, columns, source.nblocks), DenseResult(np.zeros_like(x)))
    st = m.st
    S = st.round_block.shape[0]
    for _ in range(20):
        st.round_block[:] = np.where(rng.random(S) < 0.2, P.END, rng.integers(0, source.nblocks, S))
        st.deadline[:] = np.where(rng.random(S) < 0.3, np.inf, rng.uniform(0, 2, S))
        st.last_heard[:] = rng.uniform(0, 2, aggregators)
        st.probe[:] = np.where(rng.random(aggregators) < 0.3, rng.integers(0, S, aggregators), -1)
        st.loss_confirmed[:] = rng.random(aggregators) < 0.2
        st.base_rto[:] = rng.uniform(0.01, 0.5, aggregators)
        st.f[WS.F_LAST_PROGRESS] = rng.uniform(0, 2)
        st.i[WS.I_REMAINING] = 0 if rng.random() < 0.05 else S
        now = rng.uniform(0, 2.5)
        exact, after = R.recovery_timer(st), R.recovery_timer(st, now)
        if exact <= now:
            assert after == exact
        else:
            assert now < after <= exact


def test_the_driver_s_raw_state_record_is_every_field_over_the_same_memory():
    """The driver loop works on a copy of the state record without reference counts (worker_kernels._raw_state,
    which numba makes build the record field by field, in order): each field must be the same memory as
    the machine's, or the loop would keep its timers, estimates or sums where nothing reads them."""
    B = 4
    x = np.ones(64 * B, np.float32)
    source = BlockSource.dense(x, B)
    m = AllreduceMachine(WorkerConfig(rank=0, world=2, job=1, block_size=B), 1, source,
                         Layout(2, 32, source.nblocks), DenseResult(np.zeros_like(x)))
    raw = K._raw_state(m.st)
    for name in WS.WorkerState._fields:
        mine, theirs = getattr(m.st, name), getattr(raw, name)
        assert (theirs.ctypes.data, theirs.shape, theirs.dtype) == (mine.ctypes.data, mine.shape, mine.dtype), name
