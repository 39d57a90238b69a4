"""Sums stored past the caches (zerosum.stores): bit for bit what the plain stores write, declined where a
run is not whole aligned vectors, and used for outputs larger than the caches, end to end."""
import numpy as np
import pytest

from netsim import run
from procs import Aggregator, sparse_tensor
from test_worker_api import run_threads
from zerosum import worker_kernels as K
from zerosum import stores
from zerosum import worker_machine
from zerosum import worker_state as WS
from zerosum.aggregator_machine import AggregatorMachine
from zerosum.reference import reference_allreduce

B = 256


def wire_words(rng, count):
    """Big-endian int32 sums as a worker reads them from a datagram, the extremes included."""
    sums = rng.integers(-2**31, 2**31, count, dtype=np.int64).astype(np.int32)
    sums[:4] = [np.iinfo(np.int32).min, np.iinfo(np.int32).max, 0, -1]
    return sums.astype(">i4").view(np.uint32)


def aligned(count):
    """A float32 array whose element 0 is on a 64-byte boundary."""
    raw = np.empty(count + 16, np.float32)
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip: skip + count]


@pytest.mark.parametrize("divisor", [1, 3, 16])
def test_streamed_sums_equal_the_plain_stores_bit_for_bit(divisor):
    rng = np.random.default_rng(divisor)
    words = wire_words(rng, B)
    d32 = np.float32(divisor)
    for shift in range(-149, K._F32_HI + 1, 7):
        scale = K._POW2_F32[shift + 149]
        plain, streamed = aligned(3 * B), aligned(3 * B)
        plain[:], streamed[:] = -9.0, -9.0
        K._store_floats(words, B, shift, d32, plain, B)
        assert stores.stream_floats(words, B, scale, d32, streamed, B)
        assert np.array_equal(streamed.view(np.uint32), plain.view(np.uint32)), f"shift {shift}"
        assert (streamed[:B] == -9).all() and (streamed[2 * B:] == -9).all()


def test_streaming_declines_what_is_not_whole_aligned_vectors():
    words = wire_words(np.random.default_rng(0), B)
    out = aligned(2 * B)
    out[:] = -9.0
    one = np.float32(1.0)
    assert not stores.stream_floats(words, B - 1, one, one, out, 0)     # a partial last block
    assert not stores.stream_floats(words, B, one, one, out, 1)         # 4 bytes past a 16-byte boundary
    assert not stores.stream_floats(words, B, one, one, out, 2 * B - 16)  # past the end of the output
    assert not stores.stream_floats(words[:B // 2], B, one, one, out, 0)  # past the end of the sums
    assert (out == -9).all()
    assert stores.stream_floats(words, 16, one, one, out, 4)            # 16-byte aligned is enough


def test_only_outputs_larger_than_the_caches_stream():
    assert stores.STREAM_MIN_BYTES > 0
    assert not stores.streams(stores.STREAM_MIN_BYTES - 1)
    assert stores.streams(stores.STREAM_MIN_BYTES) == stores.X86


def test_machines_streaming_their_sums_match_the_reference_under_loss(monkeypatch):
    """Every output streams (the threshold forced down): through loss, duplication and reordering the
    sums are the reference's, bit for bit, the partial last block stored the plain way."""
    monkeypatch.setattr(worker_machine, "streams", lambda nbytes: True)
    arrays = [sparse_tensor(r, 7, 40 * B + 100, 0.4) for r in range(3)]
    flags = []
    outs, _ = run(arrays, [AggregatorMachine(1, 3, slots=8)], block_size=B, loss=0.1, dup=0.1, reorder=0.3,
                  seed=3, check=lambda ms: flags.extend(int(m.st.i[WS.I_STREAM]) for m in ms))
    assert flags and all(flags)
    ref = reference_allreduce(arrays, B)
    for o in outs:
        assert o.tobytes() == ref.tobytes()


def test_a_tensor_larger_than_the_caches_is_summed_exactly_by_workers_on_sockets(monkeypatch):
    """Real workers (threads) and an aggregator process: a float32 tensor past STREAM_MIN_BYTES (and not
    a whole number of blocks), into a new output, in place, and averaged; each worker's thread writes its
    output, the test's thread reads it after the fence. (The threshold is capped at 24 MiB, the size it
    has on a 32 MiB cache, so that the test's tensor stays that size on hosts with larger caches.)"""
    monkeypatch.setattr(stores, "STREAM_MIN_BYTES", min(stores.STREAM_MIN_BYTES, 24 << 20))
    n = stores.STREAM_MIN_BYTES // 4 + 1000
    xs = [sparse_tensor(r, 2, n, 0.02) for r in range(2)]
    ref = reference_allreduce(xs)
    agg = Aggregator(2)
    try:
        def fn(rank, w):
            a = w.allreduce(xs[rank])
            b = xs[rank].copy()
            w.allreduce(b, out=b)
            c = w.allreduce(xs[rank], average=True)
            return a, b, c
        for a, b, c in run_threads(2, agg.address, fn):
            assert a.tobytes() == ref.tobytes() and b.tobytes() == ref.tobytes()
            assert c.tobytes() == (ref / np.float32(2)).tobytes()
    finally:
        agg.stop()
