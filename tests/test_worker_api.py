"""The public Worker API, with workers as threads of one process and a real aggregator process."""
import threading

import numpy as np
import pytest

from procs import Aggregator, sparse_tensor
import zerosum
from zerosum.reference import reference_allreduce


@pytest.fixture(scope="module")
def agg3():
    a = Aggregator(3)
    yield a
    a.stop()


def run_threads(world, address, fn, **kwargs):
    results, errors = [None] * world, []

    def body(rank):
        try:
            with zerosum.Worker(rank, world, [address], **kwargs) as w:
                results[rank] = fn(rank, w)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def test_shapes_in_place_and_out(agg3):
    xs = [sparse_tensor(r, 3, 7 * 301, 0.5).reshape(7, 301) for r in range(3)]
    ref = reference_allreduce(xs)

    def fn(rank, w):
        x = xs[rank].copy()
        a = w.allreduce(x)                       # a new array, x untouched
        assert np.array_equal(x, xs[rank])
        out = np.full_like(x, 7.0)
        b = w.allreduce(x, out=out)              # into a given (dirty) array
        assert b is out
        c = w.allreduce(x, out=x)                # in place
        assert c is x
        t = np.asfortranarray(xs[rank])          # non-contiguous input
        d = w.allreduce(t)
        e = w.allreduce(xs[rank][:, :0])         # empty
        return a, b, c, d, e

    for a, b, c, d, e in run_threads(3, agg3.address, fn):
        for r in (a, b, c, d):
            assert r.shape == (7, 301) and r.dtype == np.float32 and r.tobytes() == ref.tobytes()
        assert e.shape == (7, 0)


def test_allreduces_of_other_sizes_after_each_other_reuse_the_datagram_buffer(agg3):
    """A worker builds every allreduce's datagrams in one buffer it keeps (worker_machine.Scratch): a
    small allreduce after a large one, and a large one after it, each with other data and int32 too,
    still equal the reference; the bytes a larger one left behind reach no datagram of a smaller one."""
    sizes = [(50_000, 0.9, np.float32), (700, 0.5, np.float32), (30_000, 0.3, np.int32), (50_000, 0.05, np.float32)]
    inputs = [[sparse_tensor(r + 10 * k, 3, n, d, dtype=t) for r in range(3)] for k, (n, d, t) in enumerate(sizes)]

    def fn(rank, w):
        return [w.allreduce(xs[rank]) for xs in inputs]

    for results in run_threads(3, agg3.address, fn):
        for got, xs in zip(results, inputs):
            assert got.tobytes() == reference_allreduce(xs).tobytes()


def test_stats_stamp_each_allreduces_exchange_after_its_blocks_are_found(agg3, monkeypatch):
    """Worker.stats.exchange: (from the bootstrap round, to the last result) of the last allreduce in
    time.monotonic(), inside the call and after its scan; a failed exchange is stamped up to its failure."""
    import time
    xs = [sparse_tensor(r, 4, 200_000, 0.2) for r in range(3)]
    scans = []
    real_dense = zerosum.worker.BlockSource.dense

    def dense(flat, block_size):
        source = real_dense(flat, block_size)
        scans.append(time.monotonic())
        return source
    monkeypatch.setattr(zerosum.worker.BlockSource, "dense", staticmethod(dense))

    def fn(rank, w):
        before = time.monotonic()
        got = w.allreduce(xs[rank])
        return before, w.stats.exchange, time.monotonic(), got

    for before, (start, end), after, got in run_threads(3, agg3.address, fn):
        assert before < start <= end <= after and start > min(scans)
        assert got.tobytes() == reference_allreduce(xs).tobytes()

    def fail_after(m):
        time.sleep(0.05)
        raise zerosum.ZeroSumTimeout("no progress")
    with zerosum.Worker(0, 1, [agg3.address], job=99) as w:     # a job of its own on the same aggregator
        monkeypatch.setattr(w, "_run", fail_after)
        with pytest.raises(zerosum.ZeroSumTimeout):
            w.allreduce(np.ones(1000, np.float32))
        start, end = w.stats.exchange
        assert end - start >= 0.05


def test_average_equals_the_sum_divided_by_the_world(agg3):
    """average=True divides each block as it arrives: bit for bit the sum / 3, in every path."""
    import torch
    xs = [sparse_tensor(r, 3, 5 * 257, 0.3) for r in range(3)]
    expect = reference_allreduce(xs) / np.float32(3)

    def fn(rank, w):
        a = w.allreduce(xs[rank], average=True)
        b = xs[rank].copy()
        w.allreduce(b, out=b, average=True)
        w.gather_on_device = True            # the device path (gather, collect, scatter), on the CPU
        c = w.allreduce(torch.from_numpy(xs[rank].copy()), average=True).numpy()
        with pytest.raises(ValueError, match="needs float32"):
            w.allreduce(np.ones(4, np.int32), average=True)
        with pytest.raises(ValueError, match="needs float32"):
            w.allreduce(torch.ones(4, dtype=torch.int32), average=True)
        return a, b, c

    for results in run_threads(3, agg3.address, fn):
        for r in results:
            assert r.dtype == np.float32 and r.tobytes() == expect.tobytes()


def test_window_and_small_datagrams_end_to_end():
    """A window (R-L6) and an aggregator whose datagrams fit a 1500-byte MTU (--max-datagram): exact sums,
    no result datagram above the limit (a worker's max_datagram alone leaves the results IP-fragmented,
    and lost fragments can fill a host's reassembly memory, after which it drops every fragment)."""
    from zerosum.aggregator import AggregatorServer
    server = AggregatorServer(3, listen="127.0.0.1:0", slots=64, max_datagram=1472)
    sizes = []
    send = server._send

    def recording(out):
        out = list(out)
        sizes.extend(len(data) for _, data in out)
        send(out)

    server._send = recording
    stopping = []
    thread = threading.Thread(target=server.serve, kwargs=dict(stop=lambda: bool(stopping)), daemon=True)
    thread.start()
    try:
        address = "%s:%d" % server.address
        xs = [sparse_tensor(r, 4, 64 * 900, 0.3, 64) for r in range(3)]
        windows = [4096, 20000, None]

        def fn(rank, w):
            assert w.config.window == windows[rank]
            return [w.allreduce(xs[rank]) for _ in range(2)]

        results = []
        errors = []

        def body(rank):
            try:
                with zerosum.Worker(rank, 3, [address], block_size=64, max_datagram=1472, window=windows[rank],
                                    timeout=20) as w:
                    results.append(fn(rank, w))
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        ref = reference_allreduce(xs, 64)
        assert len(results) == 3 and all(np.array_equal(o, ref) for r in results for o in r)
        assert sizes and max(sizes) <= 1472
    finally:
        stopping.append(1)
        thread.join(5)
        server.close()


def test_bad_arguments(agg3):
    with pytest.raises(ValueError, match="rank must be"):
        zerosum.Worker(3, 3, [agg3.address])
    with pytest.raises(ValueError, match="world_size"):
        zerosum.Worker(0, 99, [agg3.address])
    with pytest.raises(ValueError, match="bad port"):
        zerosum.Worker(0, 3, ["127.0.0.1:99999"])
    with pytest.raises(ValueError, match="cannot carry one block"):
        zerosum.Worker(0, 3, [agg3.address], block_size=256, max_datagram=600)
    for window in (0, -5, 1.5, True, "64k"):
        with pytest.raises(ValueError, match="window must be"):
            zerosum.Worker(0, 3, [agg3.address], window=window)
    w = zerosum.Worker(0, 3, [agg3.address])
    with pytest.raises(zerosum.ZeroSumError, match="not open"):
        w.allreduce(np.zeros(4, np.float32))

    def fn(rank, w):
        with pytest.raises(TypeError, match="float32 and int32"):
            w.allreduce(np.zeros(4, np.float64))
        with pytest.raises(ValueError, match="out must be"):
            w.allreduce(np.zeros(4, np.float32), out=np.zeros(5, np.float32))
        x = np.zeros(8, np.float32)
        with pytest.raises(ValueError, match="overlaps"):
            w.allreduce(x[:4], out=x[2:6])
        with pytest.raises(ValueError, match="NaN or infinite"):
            w.allreduce(np.array([1, np.nan], np.float32))
        return w.allreduce(np.full(5, rank, np.int32))    # still usable after refused calls

    for r in run_threads(3, agg3.address, fn):
        assert list(r) == [3] * 5
