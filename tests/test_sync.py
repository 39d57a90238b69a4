"""Synchronisation schemes for torch: periodic model averaging (post-local SGD) through ZeroSum, the
hook's state in checkpoints (a resumed run continues bit for bit) and torch's Join (uneven inputs)."""
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'zerosum[torch]')")

import zerosum.sync as zs  # noqa: E402
import zerosum.torch as zt  # noqa: E402
from zerosum import compression as C  # noqa: E402
from procs import Aggregator  # noqa: E402
from test_worker_api import run_threads  # noqa: E402
from torch_procs import delayed_sgd, join_training, post_local_sgd, resume_training, spawn  # noqa: E402
from zerosum.reference import reference_allreduce  # noqa: E402
from zerosum.udp import free_port  # noqa: E402


def _saved(obj):
    """obj through torch.save and torch.load (weights_only, torch's default): what a checkpoint keeps."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def _same(a, b, where="state"):
    """Equal bit for bit, through nested containers of tensors and arrays."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, (torch.Tensor, np.ndarray)):
        x, y = np.asarray(a), np.asarray(b)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), where
    else:
        assert a == b or (a != a and b != b), where


# -- compressor state in checkpoints -----------------------------------------------------------------

COMPRESSORS = {
    "topk-blocks": lambda: C.TopKBlocks(0.3, block_size=4),
    "topk-elements": lambda: C.TopKElements(0.2),
    "sign-ef": lambda: C.SignEF(block_size=4),
    "random-k": lambda: C.RandomKBlocks(2, block_size=4, rank=1),
    "qsgd": lambda: C.QSGD(levels=2, block_size=4, rank=1),
    "terngrad": lambda: C.TernGrad(rank=1),
    "dgc": lambda: C.DGC(density=0.05, warmup=(0.5, 0.2), world=2, clip_norm=5.0, block_size=4),
    "diana": lambda: C.DIANA(C.RandomKBlocks(2, block_size=4, rank=1), omega=1),
    "diana-qsgd": lambda: C.DIANA(C.QSGD(levels=2, block_size=4, rank=1)),
    "adaptive": lambda: C.AdaptiveTopKBlocks(block_size=4),
    "tracked": lambda: C.TrackedTopKBlocks(block_size=4, segment_steps=0.5, warmup=0),
}


def _steps(compressor, rng, steps, n=4400):
    """Compress/decompress a few gradients under two keys (as if summed over 2 equal ranks)."""
    out = []
    for s in range(steps):
        if hasattr(compressor, "set_lr"):
            compressor.set_lr(0.1 / (1 + s))
        if hasattr(compressor, "set_epoch"):
            compressor.set_epoch(s)
        for key in (("a", "b"), "default"):
            g = rng.standard_normal(n).astype(np.float32)
            sent = compressor.compress(g, key)
            out.append((sent, compressor.decompress(sent * np.float32(2), 2, key)))
    return out


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_compressor_state_round_trip_continues_bit_for_bit(name):
    make = COMPRESSORS[name]
    running = make()
    _steps(running, np.random.default_rng(0), 3)
    saved = _saved(zt.compressor_state_dict(running))
    resumed = make()
    kept = resumed.keyed_state()
    zt.load_compressor_state_dict(resumed, saved)
    for before, after in zip(kept, resumed.keyed_state()):
        assert before is after                      # in place: references to the state stay valid
    a = _steps(running, np.random.default_rng(1), 3)
    b = _steps(resumed, np.random.default_rng(1), 3)
    for (s1, e1), (s2, e2) in zip(a, b):
        assert s1.tobytes() == s2.tobytes() and e1.tobytes() == e2.tobytes()
    _same(zt.compressor_state_dict(running), zt.compressor_state_dict(resumed))


def test_compressor_state_errors():
    with pytest.raises(ValueError, match="holds a .*TopKBlocks"):
        zt.load_compressor_state_dict(C.SignEF(), zt.compressor_state_dict(C.TopKBlocks()))

    class WithFunction(C.Compressor):
        def __init__(self):
            self.score = lambda x: x

    with pytest.raises(TypeError, match=r"WithFunction\.score"):
        zt.compressor_state_dict(WithFunction())

    class Made:          # per-key state made during training, of a class that does not allow it afresh
        pass

    class PerKey(C.Compressor):
        def __init__(self):
            self.made = {}

    running = PerKey()
    running.made["a"] = Made()
    with pytest.raises(ValueError, match=r"PerKey\.made\['a'\]: the checkpoint holds a .*Made, this run has nothing"):
        zt.load_compressor_state_dict(PerKey(), zt.compressor_state_dict(running))


# -- the hook's state in checkpoints (in process, with a stand-in worker) ----------------------------

class _Bucket:
    """The parts of DDP's GradBucket the hooks use."""

    def __init__(self, params, grads, index, count):
        self._params = list(params)
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._index, self._count = index, count

    def index(self):
        return self._index

    def is_last(self):
        return self._index == self._count - 1

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params


class _TwoEqualRanks:
    """A worker whose one peer contributes what it does."""
    world_size = 2

    def allreduce(self, x, out=None, average=False):
        if average:
            result = x.clone() if isinstance(x, torch.Tensor) else np.array(x)
        else:
            result = x * 2 if isinstance(x, torch.Tensor) else x * np.float32(2)
        if out is not None:
            out.copy_(result) if isinstance(out, torch.Tensor) else np.copyto(out, result)
            return out
        return result


def _iteration(state, module, layout, seed, hook=zt.allreduce_hook):
    """Hand the hook one iteration's buckets (lists of parameter names); return the gradient each
    parameter ends up with, by name."""
    named = dict(module.named_parameters())
    g = torch.Generator().manual_seed(seed)
    grads = {n: torch.randn(p.shape, generator=g) for n, p in named.items()}
    buckets = [_Bucket([named[n] for n in names], [grads[n] for n in names], i, len(layout))
               for i, names in enumerate(layout)]
    futures = [hook(state, b) for b in buckets]
    out = {}
    for names, b, f in zip(layout, buckets, futures):
        buffer = f.wait()
        assert buffer is b.buffer()
        at = 0
        for n in names:
            out[n] = buffer[at:at + named[n].numel()].clone()
            at += named[n].numel()
    return out


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3), torch.nn.Linear(3, 2))


FIRST = [["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]]          # DDP's first iteration
REBUILT = [["3.bias", "3.weight", "2.bias"], ["2.weight", "0.bias"], ["0.weight"]]    # after its rebuild
SPLIT = [["0.weight", "2.weight"], ["0.bias", "3.weight", "3.bias", "2.bias"]]        # groups spread over both


@pytest.mark.parametrize("first", [FIRST, SPLIT], ids=["one-bucket", "groups-over-two-buckets"])
@pytest.mark.parametrize("make", [lambda: C.TopKBlocks(0.3, block_size=4),
                                  lambda: C.DIANA(C.RandomKBlocks(2, block_size=4, rank=1), alpha=0.5)],
                         ids=["topk", "diana"])
def test_resumed_hook_reduces_in_the_checkpoints_groups(first, make):
    module = _module()
    running = zt.HookState(_TwoEqualRanks(), make(), model=module)
    _iteration(running, module, FIRST, 0)
    for s in (1, 2):
        _iteration(running, module, REBUILT, s)
    assert [k for k, _ in running.sequence] == [tuple(names) for names in REBUILT]
    checkpoint = _saved(running.state_dict())

    resumed = zt.HookState(_TwoEqualRanks(), make(), model=module)
    resumed.load_state_dict(checkpoint)
    # the resumed DDP model starts with other buckets; the hook still reduces in the rebuilt groups
    expected, got = _iteration(running, module, REBUILT, 3), _iteration(resumed, module, first, 3)
    for n in expected:
        assert expected[n].numpy().tobytes() == got[n].numpy().tobytes(), n
    assert resumed.sequence == running.sequence and resumed._replay is None
    for s in (4, 5):     # and from now on DDP's buckets are the rebuilt ones again
        expected, got = _iteration(running, module, REBUILT, s), _iteration(resumed, module, REBUILT, s)
        for n in expected:
            assert expected[n].numpy().tobytes() == got[n].numpy().tobytes(), n
    a, b = running.state_dict(), resumed.state_dict()
    assert a["relayouts"] == b["relayouts"]
    for k in ("layouts", "owner", "sequence", "compressor"):
        _same(a[k], b[k], k)
    running.close()
    resumed.close()


def test_hook_state_dict_errors():
    module = _module()
    state = zt.HookState(_TwoEqualRanks(), C.TopKBlocks(0.3, block_size=4))       # no model: ids
    _iteration(state, module, REBUILT, 0)
    with pytest.raises(ValueError, match="model="):
        state.state_dict()
    named = zt.HookState(_TwoEqualRanks(), C.TopKBlocks(0.3, block_size=4), model=module)
    _iteration(named, module, REBUILT, 0)
    checkpoint = _saved(named.state_dict())
    with pytest.raises(ValueError, match="saved with a compressor"):
        zt.HookState(_TwoEqualRanks(), model=module).load_state_dict(checkpoint)
    with pytest.raises(ValueError, match="does not have"):
        zt.HookState(_TwoEqualRanks(), C.TopKBlocks(0.3, block_size=4),
                     model=torch.nn.Linear(2, 2)).load_state_dict(checkpoint)
    # a bucket with parameters the checkpoint has no group for fails at once
    other = torch.nn.Linear(2, 2)
    loaded = zt.HookState(_TwoEqualRanks(), C.TopKBlocks(0.3, block_size=4), model=module)
    loaded.load_state_dict(checkpoint)
    with pytest.raises(ValueError, match="no group"):
        zt.allreduce_hook(loaded, _Bucket([other.weight], [torch.ones(4)], 0, 1))
    for s in (state, named, loaded):
        s.close()


def test_post_local_sgd_hook_counts_iterations_and_returns_local_gradients_after():
    module = _module()
    state = zs.PostLocalSGDState(_TwoEqualRanks(), start_localSGD_iter=2,
                                 compressor=C.TopKBlocks(0.3, block_size=4), model=module)
    for s in range(2):
        _iteration(state, module, REBUILT, s, hook=zs.post_localSGD_hook)
        assert state.iter == s + 1
    memory = {k: v.copy() for k, v in state.compressor.ef.memory.items()}
    named = dict(module.named_parameters())
    g = torch.Generator().manual_seed(7)
    grads = {n: torch.randn(p.shape, generator=g) for n, p in named.items()}
    bucket = _Bucket([named[n] for n in REBUILT[0]], [grads[n] for n in REBUILT[0]], 0, 3)
    local = bucket.buffer().clone()
    assert torch.equal(zs.post_localSGD_hook(state, bucket).wait(), local)      # after warm-up: local
    assert state.iter == 2 and state.compressor.ef.memory.keys() == memory.keys()
    saved = _saved(state.state_dict())
    assert saved["iter"] == 2
    again = zs.PostLocalSGDState(_TwoEqualRanks(), start_localSGD_iter=2,
                                 compressor=C.TopKBlocks(0.3, block_size=4), model=module)
    again.load_state_dict(saved)
    assert again.iter == 2 and all(np.array_equal(again.compressor.ef.memory[k], v) for k, v in memory.items())
    state.close()
    again.close()


# -- periodic averaging with real workers (threads of this process) -----------------------------------

@pytest.fixture(scope="module")
def agg3():
    a = Aggregator(3)
    yield a
    a.stop()


def _local_sgd(rank, w, steps, period, warmup, rows=5000, touched=4, seed=0):
    """Local SGD on an embedding model, one rank; per step: the flat parameters after the optimizer's
    step and after the averager's call, the bytes the worker sent for the average, and its step."""
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(rows, 16, mode="sum"), torch.nn.Linear(16, 1))
    init = torch.Generator().manual_seed(seed)          # the same model on every rank (thread)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = zs.PeriodicModelAverager(period, warmup, worker=w)
    g = torch.Generator().manual_seed(1000 + rank)

    def flat():
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()

    log = []
    for _ in range(steps):
        idx = torch.randint(0, rows, (touched, 1), generator=g)
        opt.zero_grad()
        model(idx).pow(2).mean().backward()
        opt.step()
        stepped, sent = flat(), w.stats.bytes_sent
        due = averager.due()
        averager.average_parameters(model.parameters())
        log.append((stepped, flat(), w.stats.bytes_sent - sent, due))
    return log


def test_period_one_is_every_step_averaging_bit_for_bit(agg3):
    world, steps = 3, 5
    logs = run_threads(world, agg3.address, lambda r, w: _local_sgd(r, w, steps, period=1, warmup=0))
    anchor = None
    for s in range(steps):
        stepped = [log[s][0] for log in logs]
        if anchor is None:       # the first average: the parameters themselves
            expected = reference_allreduce(stepped) / np.float32(world)
        else:                    # then: the anchor plus the mean change since the last average
            expected = anchor + reference_allreduce([x - anchor for x in stepped]) / np.float32(world)
        for log in logs:
            assert log[s][3] and log[s][1].tobytes() == expected.tobytes()      # every rank, every step
        anchor = expected


def test_periodic_averaging_sends_only_the_changed_blocks(agg3):
    world, steps, period, warmup, rows = 3, 8, 3, 1, 20000
    logs = run_threads(world, agg3.address,
                       lambda r, w: _local_sgd(r, w, steps, period, warmup, rows=rows, touched=4))
    dense = (rows * 16 + 17) * 4
    due = [s >= warmup and (s - warmup) % period == 0 for s in range(steps)]
    assert due == [False, True, False, False, True, False, False, True]
    for s in range(steps):
        after = [log[s][1] for log in logs]
        assert all(log[s][3] == due[s] for log in logs)
        if not due[s]:
            assert all(log[s][2] == 0 for log in logs)                       # nothing sent
            assert all(np.array_equal(log[s][0], log[s][1]) for log in logs)  # nothing changed
            if s:
                assert not np.array_equal(after[0], after[1])               # the ranks drift apart
        else:
            assert all(a.tobytes() == after[0].tobytes() for a in after)    # bit-identical after an average
    first, later = logs[0][1][2], [logs[0][s][2] for s in (4, 7)]
    assert first > dense                  # the first average sends the whole model (with its entries)
    # later ones only the changes: 3 steps x 3 ranks x 4 rows of 16 values, and the linear layer
    assert all(b < dense / 20 for b in later), (later, dense)


def test_averager_checks(agg3):
    with pytest.raises(ValueError, match="period"):
        zs.PeriodicModelAverager(0)
    with pytest.raises(ValueError, match="warmup"):
        zs.PeriodicModelAverager(2, -1)
    with pytest.raises(ValueError, match="no worker"):
        zs.PeriodicModelAverager(1).average_parameters(torch.nn.Linear(2, 2).parameters())

    def fn(rank, w):
        averager = zs.PeriodicModelAverager(1, worker=w)
        with pytest.raises(TypeError, match="float32"):
            averager.average_parameters(torch.nn.Linear(2, 2).double().parameters())
        model = torch.nn.Linear(2, 2)
        averager.average_parameters(model.parameters())
        with pytest.raises(ValueError, match="changed"):
            averager.average_parameters(torch.nn.Linear(3, 2).parameters())
        state = _saved(averager.state_dict())
        again = zs.PeriodicModelAverager(1, worker=w)
        again.load_state_dict(state)
        assert again.step == 1 and torch.equal(again.anchor, averager.anchor)
        return True

    assert run_threads(3, agg3.address, fn) == [True] * 3


def test_averager_over_another_process_group():
    """Not a `zerosum` group (here a gloo group of one): a SUM all_reduce of the changes, divided."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 2)
        averager = zs.PeriodicModelAverager(2)
        with torch.no_grad():
            for s in range(4):
                for p in model.parameters():
                    p.add_(1.0)
                before = [p.clone() for p in model.parameters()]
                averager.average_parameters(model.parameters())
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert averager.worker is None and averager.averages == 2 and averager.step == 4
    finally:
        dist.destroy_process_group()


# -- in DDP training processes -----------------------------------------------------------------------

def test_post_local_sgd_under_the_zerosum_backend():
    steps, warmup, period = 9, 2, 3
    (log0, twins0, refused0), (log1, twins1, refused1) = spawn(post_local_sgd, 2, free_port(), steps, warmup, period)
    assert "find_unused_parameters=True" in refused0 and "find_unused_parameters=True" in refused1
    for s in range(steps):
        (stepped0, after0, sent0, it0), (stepped1, after1, sent1, it1) = log0[s], log1[s]
        assert it0 == it1 == min(s + 1, warmup)                  # the hook's iteration counter
        if s < warmup:       # every-step gradient averaging: the same step on every rank, no average
            assert stepped0.tobytes() == stepped1.tobytes() and sent0 == sent1 == 0
            assert np.array_equal(after0, stepped0)
        elif (s - warmup) % period == 0:                         # an average: bit-identical after it
            assert stepped0.tobytes() != stepped1.tobytes() and after0.tobytes() == after1.tobytes()
            assert sent0 > 0 and sent1 > 0
        else:                                                    # local steps
            assert stepped0.tobytes() != stepped1.tobytes() and sent0 == sent1 == 0
    # with a warm-up longer than the run, the post-local hook is the plain ZeroSum hook, bit for bit
    for twins in (twins0, twins1):
        assert twins[0].tobytes() == twins[1].tobytes() == twins0[0].tobytes()
        # averaging the model's change every step instead of the gradients: the same steps up to
        # float rounding (p - lr*g is rounded before its change is averaged), identical on every rank
        assert twins[2].tobytes() == twins0[2].tobytes()
        np.testing.assert_allclose(twins[2], twins[0], rtol=1e-5, atol=1e-6)


def test_resumed_training_continues_bit_for_bit():
    """Train 5 steps, checkpoint (model, optimizer, hook state; post-local SGD: the averager too,
    in the middle of a period), train 4 more; a fresh pair of processes loads the checkpoints and
    trains the same 4 steps: the same parameters and hook state, bit for bit. DDP's first
    iteration in the fresh processes has other buckets than the checkpointed run had reached."""
    configs, n, m = ["plain", "topk", "tracked", "diana", "dgc", "local"], 5, 4
    agg = Aggregator(2)
    try:
        full = spawn(resume_training, 2, free_port(), agg.address, configs, n, m)
    finally:
        agg.stop()
    checkpoints = {c: [full[r][c][0] for r in range(2)] for c in configs}
    agg = Aggregator(2)
    try:
        resumed = spawn(resume_training, 2, free_port(), agg.address, configs, n, m, checkpoints)
    finally:
        agg.stop()
    for c in configs:
        for r in range(2):
            a, b = full[r][c][1], resumed[r][c][1]
            for name in a:
                assert a[name].tobytes() == b[name].tobytes(), (c, r, name)
            sa = torch.load(io.BytesIO(full[r][c][2]))
            sb = torch.load(io.BytesIO(resumed[r][c][2]))
            for k in ("layouts", "owner", "sequence", "compressor", "relayouts") + (("iter",) if c == "local" else ()):
                _same(sa[k], sb[k], f"{c}: {k}")
        for name in full[0][c][1]:     # identical on every rank (post-local SGD: step 8 averaged)
            assert full[0][c][1][name].tobytes() == full[1][c][1][name].tobytes(), (c, name)
    assert len(full[0]["plain"][2]) > 0 and len(full[0]["topk"][2]) > len(full[0]["plain"][2])


def test_join_uneven_inputs_under_the_zerosum_backend():
    """Rank 0 has 3 batches, rank 1 has 5, under torch's Join: DDP's own allreduce through the
    zerosum backend, the ZeroSum hook (plain and top-k), post-local SGD with the averager joined
    too: every rank finishes, with the parameters of gloo's run (where comparable); a joined rank
    sends no gradient blocks; divide_by_initial_world_size=False fails at once on every rank."""
    batches = [3, 5]
    modes = ["gloo", "plain", "hook", "topk", "local", "divide"]
    res = spawn(join_training, 2, free_port(), batches, modes)
    for mode in modes[:-1]:
        (p0, joined0, per_step0), (p1, joined1, _) = res[0][mode], res[1][mode]
        for name in p0:
            assert p0[name].tobytes() == p1[name].tobytes(), (mode, name)
            assert np.all(np.isfinite(p0[name]))
        if mode in ("plain", "hook"):
            for name in p0:
                np.testing.assert_allclose(p0[name], res[0]["gloo"][0][name], rtol=1e-4, atol=1e-6)
        if mode in ("plain", "hook", "local"):
            # rank 0 shadowed 2 iterations: entries without blocks, a small part of one real step
            assert 0 < joined0 < per_step0 / 4, (mode, joined0, per_step0)
        assert joined1 <= 1000, (mode, joined1)     # rank 1 joined last: Join's last counting allreduce
    for r in range(2):
        assert res[r]["divide"].startswith("error: ValueError") and \
            "divide_by_initial_world_size=True" in res[r]["divide"]


# -- delayed gradients -------------------------------------------------------------------------------

def test_the_delayed_hook_applies_the_previous_iterations_average_across_a_bucket_rebuild():
    module = _module()
    state = zs.DelayedGradientState(_TwoEqualRanks(), model=module)
    named = dict(module.named_parameters())
    seen = []
    for seed, layout in enumerate((FIRST, REBUILT, REBUILT)):
        g = torch.Generator().manual_seed(seed)
        grads = {n: torch.randn(p.shape, generator=g) for n, p in named.items()}
        applied = {}
        for i, names in enumerate(layout):
            b = _Bucket([named[n] for n in names], [grads[n] for n in names], i, len(layout))
            out = zs.delayed_gradient_hook(state, b).wait()
            at = 0
            for n in names:
                applied[n] = out[at:at + named[n].numel()].reshape(named[n].shape)
                at += named[n].numel()
        seen.append((grads, applied))
    for n in named:
        assert torch.equal(seen[0][1][n], torch.zeros_like(seen[0][0][n]))   # the first iteration: nothing
        assert torch.equal(seen[1][1][n], seen[0][0][n])       # then the previous one's (the average of equals)
        assert torch.equal(seen[2][1][n], seen[1][0][n])
    left = state.flush()
    assert all(torch.equal(left[n].reshape(named[n].shape), seen[2][0][n]) for n in named)
    state.close()


def test_delayed_sgd_matches_the_hand_computed_two_step_example():
    """Three iterations with lr: w1 = w0 (nothing to apply yet), w2 = w1 - lr*m(w0), w3 = w2 - lr*m(w1)
    with m(w) the ranks' mean gradient at w; so w3 = w0 - 2*lr*m(w0), and m(w2) is left over."""
    lr = 0.1
    results = spawn(delayed_sgd, 2, free_port(), 3, lr)
    w0 = results[0][0].astype(np.float64)

    def mean_grad(w):
        gs = [2.0 / len(x) * (x.T @ (x @ w.T - y)).T for _, x, y, _, _ in results]
        return sum(gs) / len(gs)

    m0 = mean_grad(w0)
    expected = w0 - 2 * lr * m0
    for _, _, _, w3, left in results:
        np.testing.assert_allclose(w3, expected, rtol=1e-5, atol=1e-6)
        assert w3.tobytes() == results[0][3].tobytes()          # identical on every rank
        np.testing.assert_allclose(next(iter(left.values())).reshape(w0.shape), mean_grad(w0 - lr * m0),
                                   rtol=1e-5, atol=1e-6)
