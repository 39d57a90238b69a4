"""CUDA tensors end to end: Worker.allreduce on the device path (blocks found and gathered on the GPU), the
DDP hook (plain, compressed, per-bucket paths, surviving the aggregator) and the `zerosum` backend on a
model on the GPU. Each result is compared with the fixed-point reference or with gloo on the same device.
Several ranks share one GPU (gloo, unlike NCCL, allows that), so one card runs every test."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'zerosum[torch]')")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

from procs import Aggregator  # noqa: E402
from test_torch import _inputs  # noqa: E402
from test_worker_api import run_threads  # noqa: E402
from torch_procs import ddp_on_backend, ddp_training, spawn  # noqa: E402
from zerosum.reference import reference_allreduce  # noqa: E402
from zerosum.udp import free_port  # noqa: E402


def _with_aggregator(fn, world, *args):
    """spawn(fn, world, port, aggregator address, *args) beside an aggregator of its own."""
    agg = Aggregator(world)
    try:
        return spawn(fn, world, free_port(), agg.address, *args)
    finally:
        agg.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_device_tensors_match_the_reference(dtype):
    world, n = 3, 9 * 256 + 77                         # a short last block
    xs = _inputs(world, n, dtype)
    ref = reference_allreduce([x.numpy() for x in xs])
    agg = Aggregator(world)
    try:
        def fn(rank, w):
            x = xs[rank].cuda()
            a = w.allreduce(x)
            b = w.allreduce(x.view(1, -1)).reshape(-1)
            c = w.allreduce(torch.stack([x, x], dim=1)[:, 0])           # non-contiguous
            d = torch.full_like(x, 7)
            w.allreduce(x, out=d)                                      # into a dirty tensor
            e = x.clone()
            w.allreduce(e, out=e)                                      # in place
            outs = [a, b, c, d, e]
            if dtype == torch.float32:
                outs.append(w.allreduce(x, average=True) * world)
            assert all(o.device == x.device and o.dtype == dtype for o in outs)
            return [o.cpu().numpy() for o in outs]

        for outs in run_threads(world, agg.address, fn):
            for o in outs[:5]:
                assert o.tobytes() == ref.tobytes()
            if dtype == torch.float32:
                np.testing.assert_allclose(outs[5], ref, rtol=1e-6)
    finally:
        agg.stop()


def test_device_errors_and_sparse_tensors():
    world = 2
    agg = Aggregator(world)
    try:
        def fn(rank, w):
            with pytest.raises(ValueError, match="NaN or infinite"):
                w.allreduce(torch.tensor([1.0, float("nan")], device="cuda"))
            with pytest.raises(ValueError, match="out must be"):
                w.allreduce(torch.zeros(4, device="cuda"), out=torch.zeros(4))   # on another device
            emb = torch.nn.Embedding(1000, 8, sparse=True).cuda()
            torch.manual_seed(rank)
            emb(torch.tensor([3, 500 + rank], device="cuda")).sum().backward()
            s = w.allreduce(emb.weight.grad)
            assert s.is_sparse and s.device.type == "cuda"
            return s.to_dense().cpu().numpy()

        dense = run_threads(world, agg.address, fn)
    finally:
        agg.stop()
    expected = np.zeros((1000, 8), np.float32)
    for row in (3, 3, 500, 501):
        expected[row] += 1.0
    for d in dense:
        assert np.array_equal(d, expected)


@pytest.mark.parametrize("hook", [True, "topk", "hybrid"])
def test_ddp_hook_on_a_gpu_model_trains_like_gloo(hook):
    runs = _with_aggregator(ddp_training, 2, hook, 6, "cuda")
    for a, b in zip(runs[0][0], runs[1][0]):
        assert a.tobytes() == b.tobytes()                 # identical on every rank
    if hook == "topk":          # the compressor runs on the host: the same training as the model's on the CPU
        on_cpu = _with_aggregator(ddp_training, 2, hook, 6, "cpu")
        for a, b in zip(runs[0][0], on_cpu[0][0]):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
        return
    if hook == "hybrid":
        assert runs[0][2] == runs[1][2]                   # the same parameters after every step
    plain = spawn(ddp_training, 2, free_port(), None, False, 6, "cuda")
    for a, b in zip(runs[0][0], plain[0][0]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(runs[0][1], plain[0][1], rtol=1e-4)


@pytest.mark.parametrize("mode", ["plain", "no_sync"])
def test_ddp_on_a_zerosum_process_group_with_a_gpu_model(mode):
    zs = spawn(ddp_on_backend, 2, free_port(), "zerosum", mode, 6, "cuda")
    gloo = spawn(ddp_on_backend, 2, free_port(), "gloo", mode, 6, "cuda")
    for a, b in zip(zs[0][0], zs[1][0]):
        assert a.tobytes() == b.tobytes()
    for a, b in zip(zs[0][0], gloo[0][0]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(zs[0][1], gloo[0][1], rtol=1e-4)
    assert zs[0][2] > 0 and zs[1][2] > 0                 # the buckets went through ZeroSum
