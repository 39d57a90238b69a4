"""zerosum.schedule.PriorityScheduler: chunks in a static priority order, the next forward pass waiting
per layer, and the same parameters whatever the order."""
import copy
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'zerosum[torch]')")

import zerosum  # noqa: E402
from zerosum import ZeroSumError, ZeroSumTimeout  # noqa: E402
from zerosum.schedule import PriorityScheduler  # noqa: E402
from zerosum.worker import WorkerStats  # noqa: E402
from procs import Aggregator  # noqa: E402
from torch_procs import spawn  # noqa: E402
from zerosum.reference import reference_allreduce  # noqa: E402


class FakeWorker:
    """A Worker whose peers contribute what this rank does (the average is the rank's own gradient);
    logs each call, optionally sleeps in it or fails at call number `fail_at`."""

    def __init__(self, world_size=2, block_size=4, delay=0.0, fail_at=None, log=None):
        self.world_size, self.block_size, self.delay, self.fail_at = world_size, block_size, delay, fail_at
        self.stats = WorkerStats()
        self.log = [] if log is None else log
        self.calls = 0

    def allreduce(self, x, out=None, average=False):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise ZeroSumTimeout("no progress for 1.0 s (the aggregator is gone?)")
        time.sleep(self.delay)
        self.log.append(("send", x.numel() if isinstance(x, torch.Tensor) else x.size))
        if average:
            return out
        return x * self.world_size


def _mlp(seed=0, widths=(5, 6, 30, 2)):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _iteration(model, sched, seed, x_dim=5):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, x_dim, generator=g)).pow(2).mean().backward()
    sched.step()


# -- the schedule ----------------------------------------------------------------------------------------

def test_chunks_are_aligned_and_cover_every_parameter_once():
    model = _mlp(widths=(5, 6, 30, 3))
    sched = PriorityScheduler(model, FakeWorker(block_size=4), _sgd, chunk_elems=42)
    _iteration(model, sched, 0)
    assert sched.chunk_elems == 40                       # rounded down to whole blocks
    covered = {name: np.zeros(p.numel(), int) for name, p in model.named_parameters()}
    for c in sched.chunks:
        assert c.numel <= 40
        for i, a, b, off in c.parts:
            covered[sched.names[i]][a:b] += 1
            assert a % 4 == 0 and off % 4 == 0           # every piece starts at a block boundary
        assert (c.buffer is None) == (len(c.parts) == 1)
    assert all((v == 1).all() for v in covered.values())
    # 0.weight (30) and 0.bias (6) are packed; 2.weight (180) is cut into 5 chunks
    assert [c.names for c in sched.chunks[:2]] == [("0.weight", "0.bias"), ("2.weight",)]
    assert [c.numel for c in sched.chunks if c.names == ("2.weight",)] == [40, 40, 40, 40, 20]
    sched.close()


def test_priority_bucket_and_hybrid_orders():
    orders = {}
    for order, k in (("priority", 0), ("bucket", 0), ("priority", 3)):
        model = _mlp()
        sched = PriorityScheduler(model, FakeWorker(), _sgd, chunk_elems=40, order=order, backward_chunks=k)
        for s in range(3):
            _iteration(model, sched, s)
        sched.synchronize()
        assert sched.forward_order == ["", "0", "2", "4"]
        for rec in sched.history:                        # every chunk once per iteration, in schedule order
            assert rec.sent == sched.schedule and rec.chunks == len(sched.chunks)
        orders[(order, k)] = [(c, sched.chunks[c].names) for c in sched.schedule]
        sched.close()
    names = [n for _, n in orders[("priority", 0)]]
    assert names == [("0.weight", "0.bias")] + [("2.weight",)] * 5 + [("2.bias",)] + [("4.weight",)] * 2 + \
        [("4.bias",)]
    # bucket: reverse forward order, the pieces of one parameter still in ascending order
    assert [c for c, _ in orders[("bucket", 0)]] == [9, 7, 8, 6, 1, 2, 3, 4, 5, 0]
    # hybrid: the bucket order's first 3 chunks during the backward pass, then forward order
    assert [c for c, _ in orders[("priority", 3)]] == [9, 7, 8, 0, 1, 2, 3, 4, 5, 6]


def test_the_next_forward_waits_per_layer():
    """Priority order: the first layer computes while the last layers' chunks are still on the way;
    bucket order: the forward pass starts after the last chunk."""
    for order in ("priority", "bucket"):
        log = []
        model = _mlp(widths=(5, 64, 64, 64, 2))
        sched = PriorityScheduler(model, FakeWorker(delay=0.02, log=log), _sgd, order=order)
        model[0].register_forward_pre_hook(lambda m, a: log.append(("forward", 0)))
        _iteration(model, sched, 0)
        sched.synchronize()
        del log[:]
        _iteration(model, sched, 1)               # nothing to wait for: its forward is logged first
        model(torch.randn(4, 5))                  # the next forward pass
        assert len(sched.chunks) == 4 and log[0] == ("forward", 0)
        if order == "priority":                   # after the first layer's chunk, before the others
            assert [e[0] for e in log[1:]] == ["send", "forward", "send", "send", "send"]
        else:                                     # after all of them
            assert [e[0] for e in log[1:]] == ["send", "send", "send", "send", "forward"]
        assert sched.history[1].forward_wait_s > 0
        sched.close()


def test_parameters_equal_across_orders_and_chunk_sizes():
    """With the fake worker (average = own gradient) too: the chunking never changes the values."""
    finals = []
    for order, chunk, k in (("priority", 1 << 20, 0), ("bucket", 40, 0), ("priority", 8, 5)):
        model = _mlp()
        sched = PriorityScheduler(model, FakeWorker(), _sgd, chunk_elems=chunk, order=order, backward_chunks=k)
        for s in range(4):
            _iteration(model, sched, s)
        sched.close()
        finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
    plain = _mlp()
    opts = [_sgd(list(m.parameters())) for m in plain if list(m.parameters())]
    for s in range(4):
        g = torch.Generator().manual_seed(s)
        plain(torch.randn(4, 5, generator=g)).pow(2).mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()
    finals.append(torch.cat([p.detach().reshape(-1) for p in plain.parameters()]).numpy())
    assert all(f.tobytes() == finals[0].tobytes() for f in finals)


# -- misuse ------------------------------------------------------------------------------------------------

def test_misuse_is_reported():
    with pytest.raises(ValueError, match="order"):
        PriorityScheduler(_mlp(), FakeWorker(), _sgd, order="random")
    with pytest.raises(ValueError, match="backward_chunks"):
        PriorityScheduler(_mlp(), FakeWorker(), _sgd, order="bucket", backward_chunks=2)
    with pytest.raises(TypeError, match="float32"):
        PriorityScheduler(_mlp().double(), FakeWorker(), _sgd)

    with pytest.raises(ValueError, match="plain module"):
        PriorityScheduler(torch.nn.parallel.DistributedDataParallel.__new__(
            torch.nn.parallel.DistributedDataParallel), FakeWorker(), _sgd)
    x = torch.randn(4, 5)
    model = _mlp()
    sched = PriorityScheduler(model, FakeWorker(), _sgd)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="without step"):
        model(x)
    with pytest.raises(RuntimeError, match="second gradient"):
        model[0].weight.sum().backward()      # a second backward pass in the iteration
    sched.close()

    model = _mlp()
    sched = PriorityScheduler(model, FakeWorker(), _sgd)
    model(x).sum().backward()
    sched.step()
    model.zero_grad()                         # the scheduler's gradients, before their update
    with pytest.raises(RuntimeError, match="zero_grad"):
        model(x)

    model = _mlp()
    sched = PriorityScheduler(model, FakeWorker(), _sgd)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        with sched.no_sync():
            pass
    sched.step()
    # the first layer's weight read without calling the layer: its update is not applied yet
    with pytest.raises(RuntimeError, match="'0.weight' got a gradient before its update"):
        (x @ model[0].weight.T).sum().backward()


def test_module_called_twice_and_parameters_without_gradient():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.shared = torch.nn.Linear(4, 4)
            self.unused = torch.nn.Linear(4, 4)          # never called: zero chunks, updated at the start
            self.scale = torch.nn.Parameter(torch.ones(1))   # the root's own parameter

        def forward(self, x):
            return self.shared(self.shared(x)).sum() * self.scale

    log = []
    net = Net()
    sched = PriorityScheduler(net, FakeWorker(log=log), _sgd)
    for s in range(3):
        net(torch.randn(2, 4)).backward()
        sched.step()
    sched.synchronize()
    assert sched.forward_order == ["", "shared"]
    names = [sched.chunks[c].names for c in sched.schedule]
    # the never called module's parameters are updated at the start of the forward pass: first
    assert names == [("unused.weight", "unused.bias"), ("scale",), ("shared.weight", "shared.bias")]
    assert [r.zero_params for r in sched.history] == [2, 2, 2]
    assert all(r.chunks == len(sched.chunks) for r in sched.history)
    assert all(p.grad is None for p in net.parameters())
    sched.close()


def test_no_sync_accumulates_micro_batches():
    xs = [torch.randn(3, 5, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    model = _mlp()
    sched = PriorityScheduler(model, FakeWorker(), _sgd)
    for step in range(2):
        with sched.no_sync():
            model(xs[2 * step]).sum().backward()
        model(xs[2 * step + 1]).sum().backward()
        sched.step()
    sched.close()
    plain = _mlp()
    opts = [_sgd(list(m.parameters())) for m in plain if list(m.parameters())]
    for step in range(2):
        for x in xs[2 * step:2 * step + 2]:
            plain(x).sum().backward()
        for o in opts:
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_a_failing_comm_thread_raises_in_the_training_thread():
    model = _mlp()
    sched = PriorityScheduler(model, FakeWorker(fail_at=4), _sgd)     # the schedule check, then 2 chunks
    with pytest.raises(ZeroSumTimeout, match=r"communication thread failed \(iteration 0, chunk 2"):
        _iteration(model, sched, 0)       # at step(), or at the next forward pass's wait for chunk 2
        model(torch.randn(4, 5))
    with pytest.raises(ZeroSumTimeout, match="communication thread failed"):
        sched.step()                                      # and at every later wait
    sched.close()


def test_ranks_with_different_schedules_fail_at_once():
    class Disagreeing(FakeWorker):
        def allreduce(self, x, out=None, average=False):
            return super().allreduce(x, out, average) + (0 if average else 1)

    model = _mlp()
    sched = PriorityScheduler(model, Disagreeing(), _sgd)
    with pytest.raises(ZeroSumError, match="do not agree on the schedule"):
        _iteration(model, sched, 0)        # the first backward pass, or the next wait
        sched.synchronize()
    sched.close()


def test_state_dict_round_trip():
    model = _mlp()
    sched = PriorityScheduler(model, FakeWorker(), _sgd)
    for s in range(2):
        _iteration(model, sched, s)
    state = copy.deepcopy(sched.state_dict())         # as a checkpoint keeps it (torch.save)
    assert state["iteration"] == 2 and set(state["optimizers"]) == {"0", "2", "4"}
    twin = _mlp()
    twin.load_state_dict(model.state_dict())
    resumed = PriorityScheduler(twin, FakeWorker(), _sgd)
    resumed.load_state_dict(state)
    for s in (2, 3):
        _iteration(model, sched, s)
        _iteration(twin, resumed, s)
    sched.close()
    resumed.close()
    assert resumed.history[0].iteration == 2
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


# -- ranks in processes, a real aggregator ------------------------------------------------------------------

CONFIGS = [("priority", 1 << 20, 0), ("bucket", 1024, 0), ("priority", 2048, 3)]
WIDTHS = (12, 40, 300, 20, 1)


class _Gated(torch.nn.Module):
    """An MLP with a layer used only in odd steps (zero chunks in the others)."""

    def __init__(self):
        super().__init__()
        self.mlp = _mlp(0, WIDTHS)
        self.extra = torch.nn.Linear(1, 1)
        self.odd = False

    def forward(self, x):
        y = self.mlp(x)
        return self.extra(y) if self.odd else y


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, WIDTHS[0], generator=g), torch.randn(16, 1, generator=g)


def scheduled_training(rank, world, aggregator, steps):
    """Per config: the final parameters, each iteration's chunks as sent, the schedule and, per step,
    the rank's own gradients (before averaging) by name."""
    torch.set_num_threads(1)
    out = []
    with zerosum.Worker(rank, world, [aggregator], block_size=64) as worker:
        for order, chunk, k in CONFIGS:
            model = _Gated()
            local = []
            for name, p in model.named_parameters():   # hooks before the scheduler's: the local gradients
                p.register_post_accumulate_grad_hook(lambda q, name=name: local[-1].__setitem__(name, q.grad.clone()))
            sched = PriorityScheduler(model, worker, _sgd, chunk_elems=chunk, order=order, backward_chunks=k)
            for s in range(steps):
                local.append({})
                model.odd = s % 2 == 1
                x, y = _batch(rank, s)
                torch.nn.functional.mse_loss(model(x), y).backward()
                sched.step()
            sched.synchronize()
            out.append({"params": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
                        "sent": [r.sent for r in sched.history], "zero": [r.zero_params for r in sched.history],
                        "schedule": list(sched.schedule), "nchunks": len(sched.chunks),
                        "bytes": [r.bytes_sent for r in sched.history],
                        "local": [{n: g.numpy() for n, g in d.items()} for d in local]})
            sched.close()
    return out


def test_ranks_train_bit_identically_in_every_order():
    world, steps = 2, 4
    agg = Aggregator(world)
    try:
        ranks = spawn(scheduled_training, world, agg.address, steps)
    finally:
        agg.stop()
    names = list(ranks[0][0]["params"])
    for runs in ranks:
        for run in runs:
            # every chunk exactly once per iteration, in the schedule's static order
            assert len(run["sent"]) == steps
            assert all(sent == run["schedule"] for sent in run["sent"])
            assert sorted(run["schedule"]) == list(range(run["nchunks"]))
            assert run["zero"] == [2, 0, 2, 0] and all(b > 0 for b in run["bytes"])
    first = ranks[0][0]["params"]
    for runs in ranks:       # every order, every chunk size, every rank: the same bits
        for run in runs:
            for n in names:
                assert run["params"][n].tobytes() == first[n].tobytes(), n

    # bit for bit: zerosum.reference's fixed-point average of the ranks' gradients, per parameter
    ref = _Gated()
    modules = [m for m in ref.modules() if list(m.parameters(recurse=False))]
    opts = [_sgd(list(m.parameters(recurse=False))) for m in modules]
    named = dict(ref.named_parameters())
    for s in range(steps):
        for n, p in named.items():
            grads = [runs[0]["local"][s].get(n, np.zeros(p.shape, np.float32)) for runs in ranks]
            p.grad = torch.from_numpy(reference_allreduce(grads, 64) / np.float32(world))
        for o in opts:
            o.step()
    for n in names:
        assert named[n].detach().numpy().tobytes() == first[n].tobytes(), n

    # and close to plain torch on the union of the ranks' batches (fixed-point rounding apart)
    plain = _Gated()
    opts = [_sgd(list(m.parameters(recurse=False))) for m in plain.modules() if list(m.parameters(recurse=False))]
    for s in range(steps):
        plain.odd = s % 2 == 1
        batches = [_batch(r, s) for r in range(world)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        torch.nn.functional.mse_loss(plain(x), y).backward()
        for p in plain.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for o in opts:
            o.step()
            o.zero_grad()
    for n, p in plain.named_parameters():
        np.testing.assert_allclose(first[n], p.detach().numpy(), rtol=1e-4, atol=1e-6)


def test_a_stopped_aggregator_raises_in_the_training_thread():
    agg = Aggregator(1)
    outcome = {}

    def train():
        try:
            with zerosum.Worker(0, 1, [agg.address], timeout=1.0) as worker:
                model = _mlp()
                sched = PriorityScheduler(model, worker, _sgd)
                for s in range(2):
                    _iteration(model, sched, s)
                sched.synchronize()
                agg.stop()
                _iteration(model, sched, 2)
                try:
                    model(torch.randn(4, 5))
                except ZeroSumTimeout as e:
                    outcome["error"] = str(e)
                sched.close()
        except BaseException as e:   # noqa: BLE001 (reported below)
            outcome["unexpected"] = repr(e)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    thread.join(60)
    agg.stop()
    assert not thread.is_alive(), "the training thread hung"
    assert "unexpected" not in outcome, outcome
    assert "communication thread failed (iteration 2" in outcome["error"]
