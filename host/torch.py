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
    """The worker and the single background thread that runs its allreduces in bucket order."""

    def __init__(self, worker: Worker, compressor=None):
        self.worker = worker
        self.compressor = compressor     # a zerosum.compression.Compressor, or None for the plain sum
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerosum-hook")
        self.buckets = 0

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def allreduce_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: returns at once; the bucket's sum, divided by the world size, arrives on the Future.

    DDP launches buckets in the same order on every rank, and the single background thread keeps that
    order, which is what ZeroSum's per-call epochs need.
    """
    fut = torch.futures.Future()
    buffer = bucket.buffer()
    world = state.worker.world_size
    state.buckets += 1

    key = bucket.index()

    def run():
        try:
            if state.compressor is None:
                # Averaged as the blocks arrive: no second pass over the (mostly zero) bucket.
                fut.set_result(state.worker.allreduce(buffer, out=buffer, average=True))
                return
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
    compressed by a zerosum.compression.Compressor (its state is kept per bucket)."""
    state = HookState(worker, compressor)
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
                    timeout=float(os.environ.get("ZEROSUM_TIMEOUT", 30)))
    worker.open()
    return worker, local


# -- torch.distributed backend ---------------------------------------------------------------------

_DELEGATED = ["broadcast", "allgather", "_allgather_base", "allgather_coalesced",
              "allgather_into_tensor_coalesced", "reduce", "gather", "scatter", "reduce_scatter",
              "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
              "send", "recv", "recv_anysource", "barrier", "monitored_barrier", "allreduce_coalesced"]
_ZEROSUM_DTYPES = (torch.float32, torch.int32)


class ZeroSumProcessGroup(dist.ProcessGroup):
    """SUM allreduce of float32/int32 through ZeroSum; everything else through gloo."""

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
                    if t.is_contiguous():
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
