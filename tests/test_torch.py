"""torch integration: tensors in Worker.allreduce, the DDP hook and the "zerosum" backend."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'zerosum[torch]')")

import zerosum  # noqa: E402
import zerosum.torch as zt  # noqa: E402
from zerosum import compression as C  # noqa: E402
from procs import Aggregator  # noqa: E402
from test_worker_api import run_threads  # noqa: E402
from torch_procs import (backend_collectives, ddp_rebuilt_buckets, ddp_tracked, ddp_training,  # noqa: E402
                         spawn, versus_gloo)
from zerosum.udp import free_port  # noqa: E402
from zerosum.fixedpoint import block_exponents, max_error  # noqa: E402
from zerosum.reference import reference_allreduce  # noqa: E402


@pytest.fixture(scope="module")
def agg():
    a = Aggregator(3)
    yield a
    a.stop()


def _inputs(world, n, dtype=torch.float32):
    """Per rank: random values (float32 of magnitudes 10^(r-1), or int32), with a third of them zero, from
    another place on each rank (zero blocks that differ between ranks)."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        if dtype == torch.int32:
            x = torch.randint(-1000, 1000, (n,), dtype=torch.int32, generator=g)
        else:
            x = torch.randn(n, generator=g) * 10.0 ** (r - 1)
        start = r * n // (2 * world)
        x[start: start + n // 3] = 0
        out.append(x)
    return out


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_tensors_match_the_reference(agg, on_device, dtype):
    n = 5 * 256 + 77
    xs = _inputs(3, n, dtype)
    ref = reference_allreduce([x.numpy() for x in xs])

    def fn(rank, w):
        x = xs[rank].clone()
        a = w.allreduce(x)
        b = w.allreduce(x.view(3, -1) if n % 3 == 0 else x.view(1, -1)).reshape(-1)
        nc = torch.stack([x, x], dim=1)[:, 0]          # non-contiguous view
        c = w.allreduce(nc)
        d = x.clone()
        w.allreduce(d, out=d)                           # in place
        return [t.numpy() for t in (a, b, c, d)], a.device.type, a.dtype

    for outs, device, out_dtype in run_threads(3, agg.address, fn, gather_on_device=on_device):
        assert device == "cpu" and out_dtype == dtype
        for o in outs:
            assert o.tobytes() == ref.tobytes()


def test_the_device_path_reuses_its_host_memory_across_sizes_and_densities(agg):
    """The device path's Staging is reused: growing and shrinking tensors, dense, sparse and all zero, a
    short last block, results collected in arrival order; every result equals the reference."""
    cases = [(300 * 256 + 5, 1.0), (40 * 256, 0.3), (900 * 256 + 17, 0.05), (900 * 256 + 17, 1.0), (7, 1.0),
             (5000, 0.0)]
    inputs = []
    for k, (n, density) in enumerate(cases):
        xs = []
        for r in range(3):
            g = torch.Generator().manual_seed(10 * k + r)
            x = torch.randn(n, generator=g)
            keep = torch.rand(-(-n // 256), generator=g) < density
            x[~keep.repeat_interleave(256)[:n]] = 0
            xs.append(x)
        inputs.append(xs)

    def fn(rank, w):
        return [w.allreduce(xs[rank]).numpy() for xs in inputs]

    for outs in run_threads(3, agg.address, fn, gather_on_device=True):
        for got, xs in zip(outs, inputs):
            assert got.tobytes() == reference_allreduce([x.numpy() for x in xs]).tobytes()


def test_staging_reuses_its_buffer_and_falls_back_to_pageable_memory(monkeypatch):
    from zerosum.tensors import Staging
    st = Staging()
    a = st.array("in", 1000, np.float32, pinned=False)
    b = st.array("in", 800, np.int32, pinned=False)               # smaller: the same memory, from its start
    assert a.shape == (1000,) and b.shape == (800,) and a.ctypes.data == b.ctypes.data
    assert st.array("out", 0, np.float32, pinned=False).shape == (0,)
    real = torch.empty

    def no_pinned(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("cannot allocate page-locked memory")
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", no_pinned)
    c = st.array("in", 5000, np.float32, pinned=True)              # pageable then, still a working buffer
    c[:] = 1.5
    assert c.shape == (5000,) and float(c.sum()) == 7500.0


def test_the_device_path_leaves_the_sums_received_in_the_output_when_an_aggregator_falls_silent(agg, monkeypatch):
    """R-L7: AggregatorSilent's `received` blocks hold their final sums in the output. The device path
    collects sums away from the tensor; on the failure it still writes those it has into `out`."""
    from zerosum.errors import AggregatorSilent
    w = zerosum.Worker(0, 1, [agg.address], gather_on_device=True)
    x = torch.arange(4 * 256, dtype=torch.float32)

    def reduce_then_fall_silent(source, sink, average=False):
        sink.reserve(2)       # the sums of blocks 3 and 1 arrived, in that order, then nothing
        for i, b in enumerate((3, 1)):
            sink.blocks[i] = b
            sink.flat[i * 256:(i + 1) * 256] = 1000.0 + b
        sink.count[1] = 2
        raise AggregatorSilent("silent", np.array([False, True, False, True]))
    monkeypatch.setattr(w, "_reduce", reduce_then_fall_silent)
    monkeypatch.setattr(w, "sock", object())          # open, as far as the checks go
    t = x.clone()
    with pytest.raises(AggregatorSilent) as e:
        w.allreduce(t, out=t)
    assert e.value.received.tolist() == [False, True, False, True]
    expected = x.clone().view(4, 256)
    expected[1], expected[3] = 1001.0, 1003.0
    assert torch.equal(t.view(4, 256), expected)          # sums where received, the input elsewhere


def test_tensor_errors(agg):
    def fn(rank, w):
        with pytest.raises(TypeError, match="float32 and int32"):
            w.allreduce(torch.zeros(4, dtype=torch.float16))
        with pytest.raises(ValueError, match="NaN or infinite"):
            w.allreduce(torch.tensor([1.0, float("inf")]))
        with pytest.raises(ValueError, match="out must be"):
            w.allreduce(torch.zeros(4), out=torch.zeros(5))
        return w.allreduce(torch.ones(3)).tolist()

    for r in run_threads(3, agg.address, fn, gather_on_device=True):
        assert r == [3.0, 3.0, 3.0]


def test_against_gloo_all_reduce():
    agg = Aggregator(3)
    try:
        n = 7 * 1000
        res = spawn(versus_gloo, 3, free_port(), agg.address, n)
    finally:
        agg.stop()
    zs_f, zs_i, gf, gi, _ = res[0]
    for r in res:
        assert r[0].tobytes() == zs_f.tobytes()                      # identical on every rank
    assert np.array_equal(zs_i, gi)                                   # int32: exact
    # float32: within the fixed-point bound of each block's agreed exponent (here: of the sum's max,
    # which is at most world times larger; use the sum's own exponent + 2 as a safe upper bound)
    e = block_exponents(np.abs(np.pad(gf, (0, (-n) % 256))).reshape(-1, 256).max(axis=1)) + 2
    bound = np.repeat(max_error(e, 3), 256)[:n]
    assert np.all(np.abs(zs_f - gf) <= bound)


def test_ddp_hook_matches_gloo_twin():
    agg = Aggregator(2)
    try:
        with_hook = spawn(ddp_training, 2, free_port(), agg.address, True, 5)
    finally:
        agg.stop()
    plain = spawn(ddp_training, 2, free_port(), None, False, 5)
    (p0, l0), (p1, _) = with_hook
    for a, b in zip(p0, p1):
        assert a.tobytes() == b.tobytes()                 # identical on every rank
    for a, b in zip(p0, plain[0][0]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(l0, plain[0][1], rtol=1e-4)


def test_ddp_hook_state_follows_the_parameters_when_ddp_rebuilds_its_buckets():
    world, steps, density, lr = 2, 4, 0.25, 0.05
    agg = Aggregator(world)
    try:
        res = spawn(ddp_rebuilt_buckets, world, free_port(), agg.address, steps, density, lr)
    finally:
        agg.stop()
    logs = [r[0] for r in res]
    before = res[0][2]
    order = list(before)                                   # the model's order
    sizes = {n: a.size for n, a in before.items()}
    calls = [[(at, index, key) for at, index, key, _, _ in log] for log in logs]
    assert calls[0] == calls[1]                            # the same buckets on every rank
    buckets = {}                                           # step -> {bucket.index(): key}
    for at, index, key in calls[0]:
        buckets.setdefault(at, {})[index] = key
    # DDP did rebuild: one bucket of every parameter, in the model's order, in the first iteration;
    # three from the second on, and index 0 now holds other parameters (the last layers first).
    assert buckets[0] == {0: tuple(order)}
    assert len(buckets[1]) == 3 and buckets[1][0] != buckets[0][0]
    assert sum(sizes[n] for n in buckets[1][0]) < sum(sizes.values())
    assert sorted(n for key in buckets[1].values() for n in key) == sorted(order)
    assert all(buckets[s] == buckets[1] for s in range(2, steps))
    assert [r[4] for r in res] == [3] * world              # each rebuilt bucket took its state over, once

    # By hand: error-feedback top-k over each bucket, its memory kept per parameter.
    select = C.TopKBlocks(density, error_feedback=False)
    memory = [{n: np.zeros(sizes[n], np.float32) for n in order} for _ in range(world)]
    params = {n: torch.from_numpy(a.copy()) for n, a in before.items()}
    per_call = list(zip(*logs))
    for s in range(steps):
        for call in (c for c in per_call if c[0][0] == s):
            key = call[0][2]
            cut = np.cumsum([0] + [sizes[n] for n in key])
            sent = []
            for r, (_, _, _, local, _) in enumerate(call):
                corrected = np.concatenate([memory[r][n] for n in key]) + local
                sent.append(select.compress(corrected))
                rest = corrected - sent[-1]
                memory[r].update((n, rest[cut[i]:cut[i + 1]]) for i, n in enumerate(key))
            estimate = reference_allreduce(sent) / np.float32(world)
            for r in range(world):
                np.testing.assert_array_equal(call[r][4], estimate)       # what the hook gave DDP
            for i, n in enumerate(key):                                    # SGD's step
                step = torch.from_numpy(estimate[cut[i]:cut[i + 1]]).reshape(params[n].shape)
                params[n].add_(step, alpha=-lr)
        for r in range(world):
            state = res[r][1][s]                           # the compressor's memory after step s
            assert set(state) == set(buckets[s].values())  # the first iteration's key is gone
            for key, m in state.items():
                np.testing.assert_array_equal(m, np.concatenate([memory[r][n] for n in key]))
    for n in order:
        assert res[0][3][n].tobytes() == res[1][3][n].tobytes()              # identical on every rank
        np.testing.assert_allclose(res[0][3][n], params[n].numpy(), rtol=1e-6, atol=1e-7)


def test_ddp_hook_with_tracked_levels_every_rank_keeps_the_same_k_from_the_results_alone():
    world, steps = 2, 14
    settings = dict(segment_steps=0.5, warmup=0.0)            # short segments: the levels move within a few steps
    agg = Aggregator(world)
    try:
        res = spawn(ddp_tracked, world, free_port(), agg.address, steps, settings)
    finally:
        agg.stop()
    (report, seen, digests), (report1, _, digests1) = res
    assert report == report1 and digests == digests1          # the same k, the same update, on every rank
    assert {len(b["k"]) for b in report} == {steps - 1}       # the first iteration's key was replaced (rebuild)
    assert all(b["k"][0] == b["blocks"] for b in report)      # dense until a result of its own
    moved = [b for b in report if len(b["levels"]) > 1]
    assert moved and all(min(b["k"]) < b["blocks"] for b in moved)
    # The k of every step follows from the results before it: a compressor that sees only the
    # results (not this rank's gradients) chooses the same k.
    replay = C.TrackedTopKBlocks(**settings)
    for key, summed in seen:
        replay.compress(np.zeros_like(summed), key)
        replay.decompress(summed, world, key)
    assert replay.report() == report


class _Bucket:
    """The parts of DDP's GradBucket the hook uses."""

    def __init__(self, params, grads):
        self._params = list(params)
        self._buffer = torch.cat([g.reshape(-1) for g in grads])

    def index(self):
        return 0

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params


class _SameOnEveryRank:
    """A worker whose peers contribute what it does."""
    world_size = 2

    def allreduce(self, x):
        return x * np.float32(2)


@pytest.mark.parametrize("make", [
    lambda: C.TopKBlocks(0.5, block_size=4), lambda: C.TopKElements(0.3), lambda: C.SignEF(block_size=4),
    lambda: C.DGC(density=0.3, warmup=(), block_size=4),
    lambda: C.DIANA(C.RandomKBlocks(2, block_size=4), omega=1),
    lambda: C.DIANA(C.TopKBlocks(0.5, block_size=4), alpha=0.5),
], ids=["topk-blocks", "topk-elements", "sign-ef", "dgc", "diana", "diana-around-ef"])
def test_hook_state_moves_with_the_parameters_into_new_buckets(make):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    named = dict(module.named_parameters())
    sizes = {n: p.numel() for n, p in named.items()}
    compressor = make()
    state = zt.HookState(_SameOnEveryRank(), compressor, model=module)
    first = tuple(named)
    for _ in range(2):      # the first iteration's bucket, in the model's order
        grads = [torch.randn(p.shape) for p in named.values()]
        zt.allreduce_hook(state, _Bucket(named.values(), grads)).wait()
    dicts = compressor.keyed_state()
    assert dicts and all(set(d) == {first} for d in dicts)
    old = [d[first].copy() for d in dicts]
    at = dict(zip(first, np.cumsum([0] + [sizes[n] for n in first])))

    def expected(i, key):
        return np.concatenate([old[i][at[n]:at[n] + sizes[n]] for n in key])

    a, b = ("1.bias", "1.weight"), ("0.bias", "0.weight")     # the rebuilt buckets, in gradient order
    state.adopt(a, tuple(sizes[n] for n in a))
    for i, d in enumerate(dicts):
        assert set(d) == {first, a}                        # 0.* still live under the first key
        np.testing.assert_array_equal(d[a], expected(i, a))
    state.adopt(b, tuple(sizes[n] for n in b))
    for i, d in enumerate(dicts):
        assert set(d) == {a, b}                            # the first key is gone with its last parameter
        np.testing.assert_array_equal(d[b], expected(i, b))
    assert state.relayouts == 2 and set(state.layouts) == {a, b}
    for key in (a, b):      # and the hook goes on with them
        zt.allreduce_hook(state, _Bucket([named[n] for n in key], [torch.randn(sizes[n]) for n in key])).wait()
        assert all(d[key].shape == (sum(sizes[n] for n in key),) for d in dicts)
    assert state.relayouts == 2 and all(set(d) == {a, b} for d in dicts)
    state.close()


def test_hook_keys_and_guards():
    module = torch.nn.Linear(3, 2)
    w, bias = module.weight, module.bias
    bucket = _Bucket([bias, w], [torch.ones(2), torch.ones(6)])
    assert zt.HookState(_SameOnEveryRank(), model=module).key(bucket) == ("bias", "weight")
    assert zt.HookState(_SameOnEveryRank()).key(bucket) == (id(bias), id(w))   # no model: identities
    state = zt.HookState(_SameOnEveryRank(), C.TopKBlocks(0.5, block_size=4), model=module)
    with pytest.raises(ValueError, match="cannot tell which state"):
        zt.allreduce_hook(state, _Bucket([bias, w], [torch.ones(2), torch.ones(7)]))
    out = zt.allreduce_hook(state, bucket).wait()
    assert out.shape == (8,)
    with pytest.raises(ValueError, match="changed size"):
        state.adopt(("bias", "weight"), (2, 5))
    state.close()


@pytest.mark.parametrize("world", [2, 4])
def test_init_process_group_zerosum(world):
    res = spawn(backend_collectives, world, free_port(), {})
    total = sum(range(1, world + 1))
    for t, ti, td, tm, b, _, (is_sparse, sparse_sum, dense_sum) in res:
        # a sparse tensor is summed through ZeroSum in place and stays sparse; its sum equals the
        # dense path's bit for bit, and rows no rank touched stay zero
        assert is_sparse and sparse_sum.tobytes() == dense_sum.tobytes()
        assert np.count_nonzero(sparse_sum.any(axis=1)) == len({7} | {r * 100 for r in range(world)}
                                                                 | {999 - r for r in range(world)})
        assert np.array_equal(t, np.arange(1000, dtype=np.float32) * total)
        assert np.array_equal(ti, np.full(300, sum(range(world)), np.int32))
        assert np.array_equal(td, np.full(5, float(total)))
        assert np.array_equal(tm, np.full(5, float(world)))
        assert np.array_equal(b, np.full(4, 1.0))


def test_backend_with_an_external_aggregator():
    agg = Aggregator(2, job=7)
    try:
        res = spawn(backend_collectives, 2, free_port(), {"ZEROSUM_AGGREGATORS": agg.address, "ZEROSUM_JOB": "7"})
    finally:
        counters = agg.stop()
    assert np.array_equal(res[0][0], np.arange(1000, dtype=np.float32) * 3)
    assert counters.get("rounds", 0) > 0


def test_worker_from_env_takes_window_pacing_and_max_datagram(monkeypatch):
    agg = Aggregator(1, job=8)
    try:
        monkeypatch.setenv("ZEROSUM_AGGREGATORS", agg.address)
        monkeypatch.setenv("ZEROSUM_JOB", "8")
        monkeypatch.setenv("ZEROSUM_WINDOW", "65536")
        monkeypatch.setenv("ZEROSUM_MAX_DATAGRAM", "8972")
        monkeypatch.setenv("ZEROSUM_PACING", "0")
        worker, local = zt.worker_from_env(None, 0, 1)
        try:
            assert local is None
            assert (worker.config.window, worker.config.max_datagram) == (65536, 8972)
            assert worker.config.congestion and not worker.config.pacing
            assert np.array_equal(worker.allreduce(np.arange(5000, dtype=np.float32)), np.arange(5000))
        finally:
            worker.close()
    finally:
        agg.stop()


def test_window_from_env():
    assert [zt.window_from_env(t) for t in ("auto", "", "none", "OFF", "250000")] == ["auto", None, None, None,
                                                                                   250000]
    with pytest.raises(ValueError, match="ZEROSUM_WINDOW='50k': expected auto, none or a number of bytes, got '50k'"):
        zt.window_from_env("50k")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_device_path():
    a = Aggregator(1)
    try:
        x = torch.randn(10_000, device="cuda")
        x[:5000] = 0
        with zerosum.Worker(0, 1, [a.address]) as w:
            y = w.allreduce(x)
        assert y.device == x.device
        assert torch.equal(y.cpu(), torch.from_numpy(reference_allreduce([x.cpu().numpy()])))
    finally:
        a.stop()


@pytest.mark.parametrize("mode", ["plain", "find_unused_parameters", "static_graph", "no_sync", "join"])
def test_ddp_on_a_zerosum_process_group_trains_like_gloo(mode):
    """DistributedDataParallel(model) on the `zerosum` backend (not the hook): every rank ends with the
    same parameters bit for bit, and they match gloo's within fixed-point rounding."""
    from torch_procs import ddp_on_backend
    zs = spawn(ddp_on_backend, 2, free_port(), "zerosum", mode, 6)
    gloo = spawn(ddp_on_backend, 2, free_port(), "gloo", mode, 6)
    for a, b in zip(zs[0][0], zs[1][0]):
        assert a.tobytes() == b.tobytes()
    for a, b in zip(zs[0][0], gloo[0][0]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(zs[0][1], gloo[0][1], rtol=1e-4)
    assert len(zs[1][1]) == 6 + (1 if mode == "join" else 0)
    assert zs[0][2] > 0 and zs[1][2] > 0


def test_backend_work_objects_coalesced_allreduce_and_subgroups():
    from torch_procs import backend_work_objects
    res = spawn(backend_work_objects, 2, free_port())
    for rank, (t, got, m, parts, alone) in enumerate(res):
        assert np.array_equal(alone, np.full(3, float(rank + 1)))         # its own subgroup of one
        assert np.array_equal(t, np.arange(500, dtype=np.float32) * 3) and np.array_equal(got, t)
        assert np.array_equal(m, np.full(3, 1.0))
        assert np.array_equal(parts[0], np.full(4, 3.0)) and np.array_equal(parts[1], np.full(2, 3.0))


def _embedded_pair(setting, monkeypatch):
    """Two ranks through worker_from_env without ZEROSUM_AGGREGATORS (rank 0 starts the aggregator), with
    ZEROSUM_MULTICAST=setting: one exact allreduce; returns (what the store told the ranks, whether
    each rank receives a group, the datagrams the aggregator sent)."""
    import threading
    import torch.distributed as dist
    monkeypatch.delenv("ZEROSUM_AGGREGATORS", raising=False)
    monkeypatch.setenv("ZEROSUM_MULTICAST", setting)
    store = dist.HashStore()
    x = [np.random.default_rng(r).standard_normal(1_000_000).astype(np.float32) for r in range(2)]
    workers, locals_, out = [None, None], [None, None], [None, None]

    def rank(r):     # open() waits for every rank's JOIN: the ranks start together
        workers[r], locals_[r] = zt.worker_from_env(store, r, 2)
        out[r] = workers[r].allreduce(x[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert all(np.array_equal(o, reference_allreduce(x, 256)) for o in out)
        return (store.get("zerosum/multicast").decode(), [w.multicast is not None for w in workers],
                locals_[0].snapshot()["datagrams_sent"])
    finally:
        for w in workers:
            if w is not None:
                w.close()
        if locals_[0] is not None:
            locals_[0].stop()


def test_an_embedded_aggregator_sends_each_result_once_by_multicast_where_loopback_allows(monkeypatch):
    """Without ZEROSUM_AGGREGATORS, rank 0 starts the aggregator on this host and, by default, has it send
    each result once to a multicast group on loopback (where that works here: local.results_group) that
    every rank joins, told through the store; ZEROSUM_MULTICAST=off sends to each rank. Sums exact both
    ways; by multicast the aggregator sends about half the datagrams for two ranks."""
    from zerosum.local import results_group
    group, joined, by_group = _embedded_pair("auto", monkeypatch)
    none, unjoined, to_each = _embedded_pair("off", monkeypatch)
    assert none == "" and unjoined == [False, False]
    if results_group("auto")[0] is None:
        assert group == "" and joined == [False, False]
        pytest.skip(f"multicast on loopback does not work here: {results_group('auto')[1]}")
    assert group.startswith("239.255.77.1:") and joined == [True, True]
    assert by_group < 0.6 * to_each, (by_group, to_each)
