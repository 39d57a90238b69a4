"""The `zerosum` torch.distributed backend: SUM allreduces of float32 and int32 through ZeroSum, every
other collective through gloo (zerosum.torch describes its ZEROSUM_* environment), and the lock that
the threads sharing one worker take."""
from __future__ import annotations

import argparse
import os
import random
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.distributed import AllreduceOptions, ReduceOp

from . import argtypes
from .torch_paths import path_choice, reduce_on_chosen_path
from .worker import Worker
from .worker_machine import DELAY_TARGET

_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def worker_lock(worker) -> threading.Lock:
    """The lock that serialises the allreduces of `worker` between the threads that share it (the
    `zerosum` process group's callers, the DDP hook's thread, a model averager)."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(worker)
        if lock is None:
            lock = _LOCKS[worker] = threading.Lock()
        return lock


def default_worker(group=None) -> Worker:
    """The zerosum.Worker of a `zerosum` process group (default: the default process group)."""
    if group is None:
        if not dist.is_initialized():
            raise ValueError("no worker given and no process group: pass a zerosum.Worker, or call "
                             "torch.distributed.init_process_group(\"zerosum\") first")
        group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, ZeroSumProcessGroup):
        name = group.getBackendName() if hasattr(group, "getBackendName") else type(group).__name__
        raise ValueError(f"the process group is a {name!r} group, not a 'zerosum' one: pass a zerosum.Worker, "
                         "or call torch.distributed.init_process_group(\"zerosum\")")
    return group.worker


def ring_of(model=None):
    """The gloo group of the ring path: the DDP model's process group (the gloo side of a `zerosum`
    one), else the default process group's."""
    group = getattr(model, "process_group", None)
    if group is None and dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
    return group.gloo if isinstance(group, ZeroSumProcessGroup) else group


# -- configuration from the environment -------------------------------------------------------------

def window_from_env(text: str):
    """ZEROSUM_WINDOW: "auto", "none" or a number of bytes (Worker(window=...))."""
    try:
        return argtypes.window(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"ZEROSUM_WINDOW={text!r}: {e}") from None


def switch_from_env(name: str) -> bool:
    """A switch that is on unless set to 0, off, no or false (ZEROSUM_CONGESTION; ZEROSUM_PACING once set)."""
    return os.environ.get(name, "1") not in ("0", "off", "no", "false")


def worker_from_env(store, rank: int, world_size: int):
    """An open Worker configured from ZEROSUM_* variables, and the local aggregator it started (or None).

    Without ZEROSUM_AGGREGATORS, rank 0 starts an aggregator on this machine and publishes its address,
    a random job id and a random key (ZEROSUM_KEY if set) in `store` (a torch.distributed Store), where
    the other ranks read them: the aggregator admits only this job's ranks.
    """
    local = None
    env = os.environ.get("ZEROSUM_AGGREGATORS")
    key = os.environ.get("ZEROSUM_KEY") or None
    multicast = os.environ.get("ZEROSUM_MULTICAST", "auto")
    block_size = int(os.environ.get("ZEROSUM_BLOCK_SIZE", 256))
    if env:
        aggregators = [a.strip() for a in env.split(",") if a.strip()]
        job = int(os.environ.get("ZEROSUM_JOB", 1))
        from .local import named_group     # "auto" picks a group only for an aggregator started here
        multicast = named_group(multicast)
    else:
        if rank == 0:
            # Protected by default: a fresh secret that only this job's ranks learn, through the store
            # they already trust, so that nobody else can join (or squat) the local aggregator's job.
            from .local import LocalAggregator, new_key, results_group
            job = int(os.environ.get("ZEROSUM_JOB", random.randrange(1, 0xFFFF)))
            group, _ = results_group(multicast)    # every rank is on this host: by multicast where it works
            local = LocalAggregator(world_size, job=job, key=key or new_key(), multicast=group,
                                    block_size=block_size)    # slots by the cache (local.loopback_slots)
            store.set("zerosum/aggregators", local.address)
            store.set("zerosum/job", str(job))
            store.set("zerosum/key", local.key)
            store.set("zerosum/multicast", group or "")
        aggregators = [store.get("zerosum/aggregators").decode()]
        job = int(store.get("zerosum/job").decode())
        key = store.get("zerosum/key").decode()
        multicast = store.get("zerosum/multicast").decode()
    worker = Worker(rank, world_size, aggregators, job=job, block_size=block_size,
                    timeout=float(os.environ.get("ZEROSUM_TIMEOUT", 30)),
                    key=key,
                    window=window_from_env(os.environ.get("ZEROSUM_WINDOW", "auto")),
                    congestion=switch_from_env("ZEROSUM_CONGESTION"),
                    delay_target=float(os.environ.get("ZEROSUM_DELAY_TARGET", DELAY_TARGET)),
                    pacing=switch_from_env("ZEROSUM_PACING") if os.environ.get("ZEROSUM_PACING") else None,
                    multicast=multicast or None,
                    silence=float(os.environ["ZEROSUM_SILENCE"]) if os.environ.get("ZEROSUM_SILENCE") else None,
                    **({"max_datagram": int(os.environ["ZEROSUM_MAX_DATAGRAM"])}
                       if os.environ.get("ZEROSUM_MAX_DATAGRAM") else {}))
    worker.open()
    return worker, local


# -- the process group ------------------------------------------------------------------------------

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
        self._group_name = self._group_desc = ""
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size, timeout)
        self.worker, self.local_aggregator = worker_from_env(store, rank, world_size)
        self._lock = worker_lock(self.worker)    # shared with a DDP hook or an averager on this worker
        # ZEROSUM_PATHS=auto: each allreduce through ZeroSum or gloo's ring (zerosum.hybrid), keyed by
        # its size and dtype (a DDP model's buckets, for instance)
        self.paths = path_choice(os.environ.get("ZEROSUM_PATHS", "zerosum"), self.gloo)

    def getBackendName(self):
        return "zerosum"

    # The name torch gives the group (dist.new_group, destroy_process_group): a ProcessGroup keeps it in
    # its registered backends, and this one has none (its collectives are these Python methods).
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

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
            for t in tensors:
                if self.paths is not None and not t.is_sparse and t.is_contiguous():
                    reduce_on_chosen_path(self.paths, ("all_reduce", t.numel(), str(t.dtype)), t, self.worker,
                                          self._lock, self.gloo)
                    continue
                with self._lock:
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
    # CUDA tensors too: Worker.allreduce finds and gathers their blocks on the device (zerosum.tensors), and
    # the collectives delegated to gloo take CUDA tensors as gloo does
    dist.Backend.register_backend("zerosum", _create, devices=["cpu", "cuda"])
