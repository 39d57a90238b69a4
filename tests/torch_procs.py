"""Process bodies for the torch tests (module level, so spawned processes can import them)."""
from __future__ import annotations

import hashlib
import os
import traceback

import numpy as np

from procs import collect
from zerosum.local import CTX


def spawn(fn, world: int, *args, hang_after: float = 180):
    """Run fn(rank, world, *args) in `world` processes; return their results by rank (or raise)."""
    out = CTX.Queue()
    procs = [CTX.Process(target=_main, args=(out, fn, r, world, args), daemon=True) for r in range(world)]
    results = {}
    for rank, ok, value in collect(procs, out, world, hang_after):
        if not ok:
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results[rank] = value
    return [results[r] for r in range(world)]


def _main(out, fn, rank, world, args):
    try:
        out.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def _init_gloo(rank, world, port):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def versus_gloo(rank, world, port, aggregator, n):
    """allreduce the same tensors with ZeroSum and with gloo."""
    import torch
    import torch.distributed as dist
    import zerosum
    _init_gloo(rank, world, port)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=g)
    x[: n // 2] = 0                                   # half of the blocks are zero
    xi = torch.randint(-2**20, 2**20, (n,), dtype=torch.int32, generator=g)
    with zerosum.Worker(rank, world, [aggregator]) as w:
        zs_f = w.allreduce(x)
        zs_i = w.allreduce(xi)
    gf, gi = x.clone(), xi.clone()
    dist.all_reduce(gf)
    dist.all_reduce(gi)
    dist.destroy_process_group()
    return zs_f.numpy(), zs_i.numpy(), gf.numpy(), gi.numpy(), None


def _model(seed):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.EmbeddingBag(5000, 16, mode="sum"), torch.nn.Linear(16, 8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 1))


def ddp_training(rank, world, port, aggregator, use_hook, steps, device="cpu"):
    """A few DDP steps of a small embedding model on `device`; returns the final parameters."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import zerosum
    import zerosum.torch as zt
    _init_gloo(rank, world, port)
    torch.set_num_threads(1)
    hybrid = isinstance(use_hook, str) and use_hook.startswith("hybrid")
    model = DDP(_model(0).to(device), bucket_cap_mb=0.05)
    worker = state = None
    if use_hook:
        worker = zerosum.Worker(rank, world, [aggregator])
        worker.open()
        compressor = None
        if use_hook in ("topk", "hybrid-topk"):
            from zerosum.compression import TopKBlocks
            compressor = TopKBlocks(density=0.2)
        state = zt.register(model, worker, compressor=compressor,
                            paths="auto" if hybrid else "zerosum")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses, digests = [], []
    for _ in range(steps):
        idx = torch.randint(0, 5000, (32, 4), generator=g).to(device)
        y = torch.randn(32, 1, generator=g).to(device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(idx), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        digests.append(_digest(model))
    params = _params(model)
    report = None
    if state is not None:
        state.close()
        report = state.paths.report() if state.paths is not None else None
        worker.close()
    dist.destroy_process_group()
    if hybrid:
        return params, losses, digests, report
    return params, losses


def _params(model):
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def _digest(model):
    return hashlib.sha256(b"".join(p.tobytes() for p in _params(model))).hexdigest()


def backend_collectives(rank, world, port, env):
    """init_process_group("zerosum"): allreduce (ZeroSum and delegated), broadcast, barrier."""
    import torch
    import torch.distributed as dist
    os.environ.update(env)
    import zerosum.torch  # noqa: F401  (registers the backend)
    dist.init_process_group("zerosum", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pg = dist.distributed_c10d._get_default_group()
    t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    ti = torch.full((300,), rank, dtype=torch.int32)
    dist.all_reduce(ti)
    td = torch.full((5,), float(rank + 1), dtype=torch.float64)      # delegated: dtype
    dist.all_reduce(td)
    tm = torch.full((5,), float(rank + 1))                            # delegated: op
    dist.all_reduce(tm, op=dist.ReduceOp.MAX)
    b = torch.full((4,), float(rank))
    dist.broadcast(b, src=1)
    # sparse COO through ZeroSum, in place like gloo: an embedding gradient whose rows differ per rank
    emb = torch.nn.Embedding(1000, 16, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.arange(16000, dtype=torch.float32).reshape(1000, 16) / 1000)
    emb(torch.tensor([rank * 100, 7, 999 - rank])).pow(2).sum().backward()
    sparse = emb.weight.grad
    dense_sum = sparse.to_dense()
    dist.all_reduce(dense_sum)
    dist.all_reduce(sparse)
    dist.barrier()
    name = pg.name() if hasattr(pg, "name") else ""
    dist.destroy_process_group()
    return t.numpy(), ti.numpy(), td.numpy(), tm.numpy(), b.numpy(), name, \
        (sparse.is_sparse, sparse.to_dense().numpy(), dense_sum.numpy())


def _mlp(seed):
    """Four Linear layers: with bucket_cap_mb=0.01 DDP rebuilds its one bucket of the first iteration
    into three (the last two layers, the second, the first) in the order the gradients got ready."""
    import torch
    torch.manual_seed(seed)
    L = torch.nn.Linear
    relu = torch.nn.ReLU
    return torch.nn.Sequential(L(32, 64), relu(), L(64, 64), relu(), L(64, 64), relu(), L(64, 1))


def ddp_rebuilt_buckets(rank, world, port, aggregator, steps, density, lr):
    """DDP steps through the ZeroSum hook with an error-feedback top-k compressor, across DDP's bucket
    rebuild. Returns, per bucket the hook got: (step, bucket.index(), the state's key, the local
    gradient, the averaged estimate); per step the compressor's memory {key: array}; the parameters
    before and after (by name) and the hook state's relayout count."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import zerosum
    import zerosum.torch as zt
    from zerosum.compression import TopKBlocks
    _init_gloo(rank, world, port)
    torch.set_num_threads(1)
    module = _mlp(0)
    before = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    model = DDP(module, bucket_cap_mb=0.01)
    worker = zerosum.Worker(rank, world, [aggregator])
    worker.open()
    state = zt.HookState(worker, TopKBlocks(density=density), model=model)
    log, step = [], [0]

    def logged(state, bucket):
        at, index, key = step[0], bucket.index(), state.key(bucket)
        local = bucket.buffer().detach().numpy().copy()

        def done(fut):
            out = fut.value()
            log.append((at, index, key, local, out.detach().numpy().copy()))
            return out
        return zt.allreduce_hook(state, bucket).then(done)

    model.register_comm_hook(state, logged)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(100 + rank)
    memory = []
    try:
        for i in range(steps):
            step[0] = i
            x = torch.randn(16, 32, generator=g)
            y = torch.randn(16, 1, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            memory.append({k: v.copy() for k, v in state.compressor.ef.memory.items()})
    finally:
        state.close()
        worker.close()
        dist.destroy_process_group()
    after = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    return log, memory, before, after, state.relayouts


def ddp_tracked(rank, world, port, aggregator, steps, settings):
    """DDP steps of _model(0) through the ZeroSum hook with TrackedTopKBlocks(**settings). Returns the
    compressor's report, every result it observed as (key, result) in order, and the parameters' digest
    after every step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import zerosum
    import zerosum.torch as zt
    from zerosum.compression import TrackedTopKBlocks
    _init_gloo(rank, world, port)
    torch.set_num_threads(1)
    model = DDP(_model(0), bucket_cap_mb=0.05)
    worker = zerosum.Worker(rank, world, [aggregator])
    worker.open()
    compressor = TrackedTopKBlocks(**settings)
    seen, decompress = [], compressor.decompress

    def recorded(summed, world, key="default"):
        seen.append((key, np.array(summed, copy=True)))
        return decompress(summed, world, key)
    compressor.decompress = recorded
    state = zt.register(model, worker, compressor)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    digests = []
    try:
        for _ in range(steps):
            idx = torch.randint(0, 5000, (32, 4), generator=g)
            y = torch.randn(32, 1, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(idx), y).backward()
            opt.step()
            digests.append(_digest(model))
    finally:
        state.close()
        worker.close()
        dist.destroy_process_group()
    return compressor.report(), seen, digests


# -- synchronisation schemes (tests/test_sync.py) --------------------------------------------------

def _batch(rank, step):
    """The batch of `rank` at `step`, the same whether a run resumed from a checkpoint or not."""
    import torch
    g = torch.Generator().manual_seed(100003 * (rank + 1) + step)
    return torch.randint(0, 5000, (32, 4), generator=g), torch.randn(32, 1, generator=g)


def _sync_setup(config, rank, world, worker):
    """A DDP model of _model(0) with the hook, optimizer and averager of `config`."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    import zerosum.sync as zs
    import zerosum.torch as zt
    from zerosum import compression as C
    model = DDP(_model(0), bucket_cap_mb=0.05)
    if config == "local":               # post-local SGD: 2 warm-up steps, then an average every 3 steps
        state = zs.PostLocalSGDState(worker, start_localSGD_iter=2, model=model)
        model.register_comm_hook(state, zs.post_localSGD_hook)
        averager = zs.PeriodicModelAverager(period=3, warmup_steps=2, worker=worker)
        opt = zs.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), averager)
        return model, state, opt
    compressor = {"plain": lambda: None,
                  "topk": lambda: C.TopKBlocks(density=0.2),
                  "tracked": lambda: C.TrackedTopKBlocks(segment_steps=0.5, warmup=0),
                  "diana": lambda: C.DIANA(C.RandomKBlocks(world, seed=3, rank=rank), alpha=0.5),
                  "dgc": lambda: C.DGC(density=0.05, warmup=(0.5,), world=world, seed=rank)}[config]()
    state = zt.register(model, worker, compressor=compressor)
    return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(model, opt, rank, steps):
    import torch
    for s in steps:
        idx, y = _batch(rank, s)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(idx), y).backward()
        opt.step()


def resume_training(rank, world, port, aggregator, configs, n, m, checkpoints=None):
    """Per config: without `checkpoints`, train n steps, checkpoint (model, optimizer, hook state:
    torch.save bytes), train m more; with them (a fresh process), load this rank's checkpoint and
    train the m steps. Returns {config: (checkpoint bytes or None, parameters, the hook's final state
    dict as torch.save bytes)}."""
    import io
    import torch
    import torch.distributed as dist
    import zerosum
    _init_gloo(rank, world, port)
    torch.set_num_threads(1)
    worker = zerosum.Worker(rank, world, [aggregator])
    worker.open()
    out = {}
    try:
        for config in configs:
            model, state, opt = _sync_setup(config, rank, world, worker)
            ckpt = None
            if checkpoints is None:
                _train(model, opt, rank, range(n))
                buf = io.BytesIO()
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "hook": state.state_dict()}, buf)
                ckpt = buf.getvalue()
            else:
                saved = torch.load(io.BytesIO(checkpoints[config][rank]))     # weights_only
                model.module.load_state_dict(saved["model"])
                opt.load_state_dict(saved["optimizer"])
                state.load_state_dict(saved["hook"])
            _train(model, opt, rank, range(n, n + m))
            params = {k: p.detach().numpy().copy() for k, p in model.module.named_parameters()}
            buf = io.BytesIO()
            torch.save(state.state_dict(), buf)        # bytes: tensors cannot leave a finished process
            out[config] = (ckpt, params, buf.getvalue())
            state.close()
    finally:
        worker.close()
        dist.destroy_process_group()
    return out


def post_local_sgd(rank, world, port, steps, warmup, period):
    """Under init_process_group("zerosum") (no Worker given anywhere): per step, the parameters after
    the step and after the averager; the plain ZeroSum hook, PostLocalSGDState with a warm-up longer
    than the run (every-step gradient averaging both) and local SGD with period 1 (every-step model
    averaging); and the error of registering the
    hook on the group's worker for a DDP model with find_unused_parameters=True."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import zerosum.sync as zs
    import zerosum.torch as zt
    dist.init_process_group("zerosum", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    worker = zt.default_worker()

    def flat(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()

    try:
        model = DDP(_model(0), bucket_cap_mb=0.05)
        state = zs.PostLocalSGDState(start_localSGD_iter=warmup, model=model)
        model.register_comm_hook(state, zs.post_localSGD_hook)
        averager = zs.PeriodicModelAverager(period, warmup)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        log = []
        for s in range(steps):
            idx, y = _batch(rank, s)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(idx), y).backward()
            opt.step()
            stepped = flat(model)
            sent = worker.stats.bytes_sent
            averager.average_parameters(opt.param_groups)
            log.append((stepped, flat(model), worker.stats.bytes_sent - sent, state.iter))
        state.close()
        twins = []
        for warm in (None, steps + 1, 0):      # the plain hook; warm-up all the way; local SGD with H = 1
            model = DDP(_model(0), bucket_cap_mb=0.05)
            if warm is None:
                zt.register(model)
            else:
                model.register_comm_hook(zs.PostLocalSGDState(None, warm, model=model), zs.post_localSGD_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            if warm == 0:
                opt = zs.PostLocalSGDOptimizer(opt, zs.PeriodicModelAverager(1))
            _train(model, opt, rank, range(steps))
            twins.append(flat(model))
        try:     # DDP would allreduce through the group's worker while the hook's thread uses it
            zt.register(DDP(_model(0), find_unused_parameters=True))
            refused = ""
        except ValueError as e:
            refused = str(e)
    finally:
        dist.destroy_process_group()
    return log, twins, refused


def join_training(rank, world, port, batches, modes):
    """Uneven inputs under torch's Join with init_process_group("zerosum"): rank r has batches[r]
    batches. Per mode, the final parameters, the bytes this rank's worker sent after it ran out of
    data, per step before that, or the error it raised ("error: ...")."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP
    import zerosum.sync as zs
    import zerosum.torch as zt
    from zerosum.compression import TopKBlocks
    dist.init_process_group("zerosum", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    worker = zt.default_worker()
    out = {}
    try:
        for mode in modes:
            group = dist.new_group(backend="gloo") if mode == "gloo" else None
            model = DDP(_model(0), bucket_cap_mb=0.05, process_group=group)
            joinables, divide, state = [model], True, None
            if mode in ("hook", "topk", "divide"):
                state = zt.register(model, compressor=TopKBlocks(density=0.2) if mode == "topk" else None)
                divide = mode != "divide"
            elif mode == "local":
                state = zs.PostLocalSGDState(start_localSGD_iter=2, model=model)
                model.register_comm_hook(state, zs.post_localSGD_hook)
                joinables.append(zs.PeriodicModelAverager(period=2, warmup_steps=2))
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            try:
                with Join(joinables, divide_by_initial_world_size=divide):
                    for s in range(batches[rank]):
                        idx, y = _batch(rank, s)
                        opt.zero_grad()
                        torch.nn.functional.mse_loss(model(idx), y).backward()
                        opt.step()
                        if len(joinables) > 1:
                            joinables[1].average_parameters(model.parameters())
                        if s == 0:
                            first = worker.stats.bytes_sent
                    own = worker.stats.bytes_sent
                params = {k: p.detach().numpy().copy() for k, p in model.module.named_parameters()}
                out[mode] = (params, worker.stats.bytes_sent - own, (own - first) / max(1, batches[rank] - 1))
            except Exception as e:
                out[mode] = f"error: {type(e).__name__}: {e}"
            if state is not None:
                state.close()
    finally:
        dist.destroy_process_group()
    return out


def delayed_sgd(rank, world, port, steps, lr):
    """Under init_process_group("zerosum"): a linear model trained `steps` iterations with the delayed
    gradient hook; returns the initial weights, this rank's data and the final weights."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import zerosum.sync as zs
    dist.init_process_group("zerosum", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(6, 1, bias=False))
        w0 = model.module.weight.detach().clone()
        g = torch.Generator().manual_seed(100 + rank)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        state = zs.DelayedGradientState(model=model)
        model.register_comm_hook(state, zs.delayed_gradient_hook)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        left = state.flush()
        state.close()
        return w0.numpy(), x.numpy(), y.numpy(), model.module.weight.detach().numpy().copy(), \
            {k: v.numpy() for k, v in left.items()}
    finally:
        dist.destroy_process_group()


class _Branchy:
    """An MLP with a branch that some steps skip (for find_unused_parameters)."""

    @staticmethod
    def build(seed):
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(seed)
                self.a = torch.nn.Linear(20, 32)
                self.b = torch.nn.Linear(32, 1)
                self.extra = torch.nn.Linear(32, 1)     # used on even steps only

            def forward(self, x, use_extra=True):
                h = torch.relu(self.a(x))
                out = self.b(h)
                return out + self.extra(h) if use_extra else out
        return Net()


def ddp_on_backend(rank, world, port, backend, mode, steps, device="cpu"):
    """DistributedDataParallel on a process group of `backend` ("zerosum" or "gloo"), in one of the
    modes: plain, find_unused_parameters, static_graph, no_sync (gradient accumulation over two
    micro-batches) or join (uneven inputs: rank r has r more batches, under torch's Join). Returns the
    final parameters and the losses."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP
    import zerosum.torch  # noqa: F401  (registers the backend)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = DDP(_Branchy.build(0).to(device), find_unused_parameters=mode == "find_unused_parameters",
                static_graph=mode == "static_graph", bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []

    def step(i):
        x, y = torch.randn(16, 20, generator=g).to(device), torch.randn(16, 1, generator=g).to(device)
        use_extra = mode != "find_unused_parameters" or i % 2 == 0
        opt.zero_grad()
        if mode == "no_sync":
            x2, y2 = torch.randn(16, 20, generator=g).to(device), torch.randn(16, 1, generator=g).to(device)
            with model.no_sync():
                torch.nn.functional.mse_loss(model(x2), y2).backward()
        loss = torch.nn.functional.mse_loss(model(x, use_extra), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))

    if mode == "join":
        with Join([model]):
            for i in range(steps + rank):
                step(i)
    else:
        for i in range(steps):
            step(i)
    params = _params(model)
    pg = dist.distributed_c10d._get_default_group()
    sent = pg.worker.stats.bytes_sent if backend == "zerosum" else 0     # the buckets went through ZeroSum
    dist.destroy_process_group()
    return params, losses, sent


def backend_work_objects(rank, world, port):
    """Work objects of a zerosum process group: async all_reduce through ZeroSum and delegated to gloo,
    wait / is_completed / get_future, and a coalesced allreduce."""
    import torch
    import torch.distributed as dist
    import zerosum.torch  # noqa: F401  (registers the backend)
    dist.init_process_group("zerosum", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.arange(500, dtype=torch.float32) * (rank + 1)
    work = dist.all_reduce(t, async_op=True)                          # through ZeroSum
    assert work.wait() and work.is_completed()
    (got,) = work.get_future().wait()
    m = torch.full((3,), float(rank))
    w2 = dist.all_reduce(m, op=dist.ReduceOp.MAX, async_op=True)      # delegated to gloo
    w2.get_future().wait()
    parts = [torch.ones(4) * (rank + 1), torch.ones(2) * (rank + 1)]
    dist.all_reduce_coalesced(parts)
    own, groups = dist.new_subgroups(group_size=1)                   # one subgroup per rank
    alone = torch.full((3,), float(rank + 1))
    dist.all_reduce(alone, group=own)
    for g in groups:
        dist.destroy_process_group(g)
    # every rank has made its subgroup (through the store rank 0 serves) before rank 0 ends it
    dist.barrier()
    dist.destroy_process_group()
    return t.numpy(), got.numpy(), m.numpy(), [p.numpy() for p in parts], alone.numpy()


def backend_paths(rank, world, port, calls):
    """ZEROSUM_PATHS=auto: the same all_reduce `calls` times (each the exact integer sum on either path);
    returns the sums and the paths' report."""
    import torch
    import torch.distributed as dist
    os.environ["ZEROSUM_PATHS"] = "auto"
    import zerosum.torch  # noqa: F401  (registers the backend)
    dist.init_process_group("zerosum", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pg = dist.distributed_c10d._get_default_group()
    sums = []
    for call in range(calls):
        t = torch.zeros(40_000)
        t[rank * 1000: rank * 1000 + 3000] = torch.arange(3000, dtype=torch.float32) + call   # sparse: 3 of 157 blocks
        dist.all_reduce(t)
        ti = torch.full((5000,), rank + call, dtype=torch.int32)                             # dense
        dist.all_reduce(ti)
        sums.append((t.numpy().copy(), ti.numpy().copy()))
    report = pg.paths.report()
    dist.barrier()
    dist.destroy_process_group()
    return sums, report


def ddp_surviving(rank, world, port, aggregator, after, kill_at, aggregator_pid, standby=None, device="cpu"):
    """DDP with the hybrid hook, ZeroSum preferred for every bucket; rank 0 SIGKILLs the aggregator in the
    middle of step `kill_at` (the test restarts it); training goes on until `after` steps past the ranks'
    return to ZeroSum (at most 3000 steps). Returns per-step losses and parameter digests, step times,
    the failover's report and how many buckets took each path."""
    import signal
    import threading
    import time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import zerosum
    import zerosum.torch as zt
    _init_gloo(rank, world, port)
    torch.set_num_threads(1)
    model = DDP(_model(0).to(device), bucket_cap_mb=0.05)
    worker = zerosum.Worker(rank, world, [aggregator])
    worker.open()
    state = zt.register(model, worker, paths="auto", standby=standby and [standby])
    state.paths.margin = 1e9            # ZeroSum for every bucket while the aggregator lives
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses, digests, times = [], [], []
    back = None
    for step in range(3000):
        if back is None and state.failover.rejoins:
            back = step                 # agreed: the same step on every rank
        if back is not None and step >= back + after:
            break
        idx = torch.randint(0, 5000, (32, 4), generator=g).to(device)
        y = torch.randn(32, 1, generator=g).to(device)
        opt.zero_grad()
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(idx), y)
        if step == kill_at and rank == 0:
            threading.Timer(0.002, os.kill, (aggregator_pid, signal.SIGKILL)).start()   # during the backward
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        digests.append(_digest(model))
    params = _params(model)
    state.close()
    report = {"failover": state.failover.report(), "paths": state.paths.report()["paths"], "back": back}
    worker.close()
    dist.barrier()
    dist.destroy_process_group()
    return params, losses, digests, times, report


def failover_alone(rank, world, port):
    """Rank 0's aggregator fails and it seeks agreement; rank 1 never takes part (dead or cut off)."""
    import time
    import types
    import threading
    import torch
    import torch.distributed as dist
    import zerosum.torch as zt
    from zerosum.errors import ZeroSumError
    _init_gloo(rank, world, port)
    if rank != 0:
        time.sleep(6)
        os._exit(0)                       # gone without a word
    worker = types.SimpleNamespace(world_size=world, rank=rank, block_size=4)
    f = zt.Failover(worker, dist.distributed_c10d._get_default_group(), threading.Lock(), timeout=2.0)
    start = time.monotonic()
    try:
        f.failed(0, torch.ones(8), None, True)
    except ZeroSumError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start
