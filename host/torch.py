"""ZeroSum for torch training loops: a DDP communication hook and a `torch.distributed` backend.

    import zerosum.torch
    zerosum.torch.register(ddp_model, worker)          # DDP gradients through ZeroSum

    dist.init_process_group("zerosum")                   # or the whole process group (under torchrun)

The backend sends SUM allreduces of float32 and int32 tensors through ZeroSum and delegates every other
collective, reduce op and dtype to a gloo process group built on the same store. It reads torchrun-style
environment variables:

    ZEROSUM_AGGREGATORS  comma-separated HOST:PORT list (default: rank 0 starts a local aggregator and
                         shares its address through the process group's store)
    ZEROSUM_JOB          job id (default: 1; with a local aggregator a random one)
    ZEROSUM_BLOCK_SIZE   values per block (default 256)
    ZEROSUM_TIMEOUT      seconds without progress before an allreduce fails (default 30)
    ZEROSUM_KEY          a secret shared with the aggregators (their --key-file): authenticated JOINs
"""
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.distributed import AllreduceOptions, ReduceOp

from .worker import Worker

__all__ = ["register", "HookState", "allreduce_hook", "ZeroSumProcessGroup", "worker_from_env"]


# -- DDP communication hook ------------------------------------------------------------------------

class HookState:
    """What the ZeroSum DDP hook keeps between calls (returned by `register`).

    - ``worker``: the open zerosum.Worker that sums the buckets.
    - ``compressor``: a zerosum.compression.Compressor, or None for the plain (averaged) sum.
    - ``executor``: one background thread; it runs the allreduces in the order DDP launches the
      buckets, the same on every rank, which is what ZeroSum's per-call epochs need.
    - ``buckets``: how many buckets the hook was given so far.
    - ``names``: {id(parameter): name} of the model's parameters, to name each bucket's contents.
    - ``layouts``: {key: (numel, ...)} for every key whose compressor state is live; a key is the
      tuple of the names of the parameters in a bucket, in the bucket's order (parameters without a
      name in ``names`` stand as their id()), and the numels give each one's place in the bucket.
    - ``owner``: {name: key}, the key whose state holds each parameter's part now.
    - ``relayouts``: how many times a bucket came with a new grouping of parameters that had state
      under other keys (DDP's rebuild after the first iteration, typically), so their state moved.

    The compressor's state (error-feedback memory, DIANA shifts, DGC accumulators) is kept per key,
    i.e. per set of parameters in bucket order, not per ``bucket.index()``: DDP rebuilds its buckets
    after the first iteration (in the order the gradients became ready, with ``bucket_cap_mb``),
    after which an index names other parameters, and state kept by index would be added to the
    gradients of other parameters, or fail on a shape mismatch. The names are the same on every rank
    and in every iteration. When a bucket's key is new, the state arrays of its parameters
    (`Compressor.keyed_state`, element-wise) are cut out of their old keys' arrays and laid out in
    the new bucket's order, so nothing the error feedback holds back is lost; old keys are dropped
    once none of their parameters is left in them. State of a compressor whose `keyed_state` does not
    list it stays under the old key, unused: with another grouping it starts afresh.
    """

    def __init__(self, worker: Worker, compressor=None, model=None):
        self.worker = worker
        self.compressor = compressor     # a zerosum.compression.Compressor, or None for the plain sum
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerosum-hook")
        self.buckets = 0
        module = getattr(model, "module", model)     # a DDP model's names without the "module." prefix
        self.names = {} if module is None else {id(p): name for name, p in module.named_parameters()}
        self.layouts: dict = {}
        self.owner: dict = {}
        self.relayouts = 0

    def key(self, bucket) -> tuple:
        """The names of the bucket's parameters, in the order of its buffer."""
        return tuple(self.names.get(id(p), id(p)) for p in bucket.parameters())

    def adopt(self, key: tuple, sizes: tuple) -> None:
        """Make the compressor's state for `key` (parameters of `sizes` elements, in this order)
        hold what its parameters' state was under the keys they were in before."""
        known = self.layouts.get(key)
        if known is not None and known != sizes:
            raise ValueError(f"the parameters {key} changed size ({known} -> {sizes} elements): "
                             "their compressor state no longer fits them")
        sources = {self.owner.get(name) for name in key}
        if known is not None and sources == {key}:
            return                                   # the usual case: the same bucket as before
        self.layouts[key] = sizes
        previous = {name: self.owner[name] for name in key if name in self.owner}
        for name in key:
            self.owner[name] = key
        if not any(k != key for k in previous.values()):
            return                                   # new parameters: no state to move
        self.relayouts += 1
        where = {}                                   # name -> (old key, offset there)
        for old in set(previous.values()):
            offsets = np.cumsum((0,) + self.layouts[old])
            for i, name in enumerate(old):
                if previous.get(name) == old:
                    where[name] = (old, int(offsets[i]))
        for d in (self.compressor.keyed_state() if self.compressor is not None else []):
            if not any(old in d for old, _ in where.values()):
                continue
            parts = []
            for name, n in zip(key, sizes):
                old, start = where.get(name, (None, 0))
                if old is not None and old in d:
                    arr = np.asarray(d[old]).reshape(-1)
                    if arr.size != sum(self.layouts[old]):
                        raise ValueError(f"compressor state for {old} has {arr.size} elements, "
                                         f"its parameters {sum(self.layouts[old])}")
                    parts.append(arr[start:start + n])
                else:
                    parts.append(np.zeros(n, np.float32))
            d[key] = np.concatenate(parts).astype(np.float32, copy=False)
        for old in set(previous.values()) - {key}:
            if not any(self.owner.get(name) == old for name in old):
                del self.layouts[old]
                for d in (self.compressor.keyed_state() if self.compressor is not None else []):
                    d.pop(old, None)

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def allreduce_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: returns at once; the bucket's sum, divided by the world size, arrives on the Future.

    DDP launches buckets in the same order on every rank, and the single background thread keeps that
    order, which is what ZeroSum's per-call epochs need. Compressor state is keyed by the bucket's
    parameters (see HookState), not by ``bucket.index()``, which DDP's bucket rebuild reassigns.
    """
    fut = torch.futures.Future()
    buffer = bucket.buffer()
    world = state.worker.world_size
    state.buckets += 1
    if state.compressor is not None:
        key = state.key(bucket)
        sizes = tuple(p.numel() for p in bucket.parameters())
        if sum(sizes) != buffer.numel():
            raise ValueError(f"the bucket's buffer has {buffer.numel()} elements, its parameters "
                             f"{sum(sizes)}: cannot tell which state belongs to which parameter")

    def run():
        try:
            if state.compressor is None:
                # Averaged as the blocks arrive: no second pass over the (mostly zero) bucket.
                fut.set_result(state.worker.allreduce(buffer, out=buffer, average=True))
                return
            state.adopt(key, sizes)         # here, after the previous bucket's compress is done
            # Compressors work on host arrays; they return the averaged estimate themselves.
            grad = buffer.detach().cpu().numpy()
            contribution = state.compressor.compress(grad, key)
            estimate = state.compressor.decompress(state.worker.allreduce(contribution), world, key)
            buffer.copy_(torch.from_numpy(np.ascontiguousarray(estimate, np.float32)).reshape(buffer.shape))
            fut.set_result(buffer)
        except BaseException as e:   # the training loop sees it when it waits on the Future
            fut.set_exception(e)

    state.executor.submit(run)
    return fut


def register(ddp_model, worker: Worker, compressor=None) -> HookState:
    """Send `ddp_model`'s gradient buckets through `worker` (an open zerosum.Worker), optionally
    compressed by a zerosum.compression.Compressor, its state kept per set of parameters in a bucket
    and carried over when DDP rebuilds its buckets (see HookState)."""
    state = HookState(worker, compressor, model=ddp_model)
    ddp_model.register_comm_hook(state, allreduce_hook)
    return state


# -- configuration from the environment -------------------------------------------------------------

def worker_from_env(store, rank: int, world_size: int):
    """An open Worker configured from ZEROSUM_* variables, and the local aggregator it started (or None).

    Without ZEROSUM_AGGREGATORS, rank 0 starts an aggregator on this machine and publishes its address
    and a random job id in `store` (a torch.distributed Store), where the other ranks read them.
    """
    local = None
    env = os.environ.get("ZEROSUM_AGGREGATORS")
    if env:
        aggregators = [a.strip() for a in env.split(",") if a.strip()]
        job = int(os.environ.get("ZEROSUM_JOB", 1))
    else:
        if rank == 0:
            from .local import LocalAggregator
            job = int(os.environ.get("ZEROSUM_JOB", random.randrange(1, 0xFFFF)))
            local = LocalAggregator(world_size, job=job)
            store.set("zerosum/aggregators", local.address)
            store.set("zerosum/job", str(job))
        aggregators = [store.get("zerosum/aggregators").decode()]
        job = int(store.get("zerosum/job").decode())
    worker = Worker(rank, world_size, aggregators, job=job,
                    block_size=int(os.environ.get("ZEROSUM_BLOCK_SIZE", 256)),
                    timeout=float(os.environ.get("ZEROSUM_TIMEOUT", 30)),
                    key=os.environ.get("ZEROSUM_KEY") or None)
    worker.open()
    return worker, local


# -- torch.distributed backend ---------------------------------------------------------------------

_DELEGATED = ["broadcast", "allgather", "_allgather_base", "allgather_coalesced",
              "allgather_into_tensor_coalesced", "reduce", "gather", "scatter", "reduce_scatter",
              "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
              "send", "recv", "recv_anysource", "barrier", "monitored_barrier", "allreduce_coalesced"]
_ZEROSUM_DTYPES = (torch.float32, torch.int32)


class ZeroSumProcessGroup(dist.ProcessGroup):
    """SUM allreduce of float32/int32 through ZeroSum (dense, or sparse COO from its values alone, as
    gloo supports); everything else through gloo."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta):
        super().__init__(rank, world_size)
        self._rank, self._world = rank, world_size
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size, timeout)
        self.worker, self.local_aggregator = worker_from_env(store, rank, world_size)
        self._lock = threading.Lock()

    def getBackendName(self):
        return "zerosum"

    def size(self):
        return self._world

    def allreduce(self, tensors, opts=None):
        if opts is None:
            opts = AllreduceOptions()
        elif isinstance(opts, ReduceOp):
            op, opts = opts, AllreduceOptions()
            opts.reduceOp = op
        if opts.reduceOp != ReduceOp.SUM or any(t.dtype not in _ZEROSUM_DTYPES for t in tensors):
            return self.gloo.allreduce(tensors, opts)
        fut = torch.futures.Future()
        try:
            with self._lock:
                for t in tensors:
                    if t.is_sparse:
                        # like gloo: the coalesced sum replaces the input; cost follows its values
                        t.copy_(self.worker.allreduce(t))
                    elif t.is_contiguous():
                        self.worker.allreduce(t, out=t)
                    else:
                        t.copy_(self.worker.allreduce(t))
            fut.set_result(tensors)
        except BaseException as e:
            fut.set_exception(e)
        return _create_work_from_future(fut)

    def shutdown(self):
        self.worker.close()
        if self.local_aggregator is not None:
            self.local_aggregator.stop()
            self.local_aggregator = None


def _make_delegate(name):
    def delegate(self, *args, **kwargs):
        return getattr(self.gloo, name)(*args, **kwargs)
    delegate.__name__ = name
    delegate.__doc__ = f"Delegated to gloo: {name}."
    return delegate


for _name in _DELEGATED:
    setattr(ZeroSumProcessGroup, _name, _make_delegate(_name))


def _create(store, rank, world_size, timeout):
    return ZeroSumProcessGroup(store, rank, world_size, timeout)


if "zerosum" not in dist.Backend.backend_list:
    dist.Backend.register_backend("zerosum", _create, devices=["cpu"])
