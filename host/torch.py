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
    ZEROSUM_WINDOW       bytes in flight per worker (Worker(window=...)): auto (default), the congestion
                         window (no window with every aggregator on this host); BYTES, its upper bound;
                         none, every column at once
    ZEROSUM_CONGESTION   0: no congestion window, ZEROSUM_WINDOW's BYTES is the fixed window
    ZEROSUM_DELAY_TARGET the queueing delay the congestion window allows, seconds (default 0.005)
    ZEROSUM_PACING       0: the congestion window's rounds leave in bursts, not paced (R-C7); 1: paced
                         on this host too (unset: paced unless every aggregator is on this host)
    ZEROSUM_MAX_DATAGRAM largest datagram (Worker(max_datagram=...)), e.g. the link's MTU - 28
    ZEROSUM_MULTICAST    with ZEROSUM_AGGREGATORS: the multicast GROUP:PORT they send results to (their
                         --multicast); without: auto (default), the aggregator started here sends each
                         result once to a group on loopback where multicast works on this host; off, to
                         each worker; GROUP[:PORT], to that group
    ZEROSUM_PATHS        zerosum (default): every SUM allreduce through ZeroSum; auto: each one through
                         ZeroSum or gloo's ring, whichever is faster at its density (zerosum.hybrid)
    ZEROSUM_SILENCE      seconds of an aggregator's silence after which an allreduce fails at once with
                         AggregatorSilent (Worker(silence=...), docs/protocol.md R-L7)
    ZEROSUM_STANDBY      the DDP hook with paths="auto": aggregators (HOST:PORT list) to turn to when the
                         ones in use failed and have not come back (zerosum.torch.Failover)

The hook's state goes into training checkpoints (`HookState.state_dict()` / `load_state_dict()`), and
the hook works under torch's `Join` context manager (uneven inputs). Periodic model averaging (local
SGD) is in `zerosum.sync`.
"""
import argparse
import os
import random
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.distributed import AllreduceOptions, ReduceOp

from . import argtypes, hybrid
from .errors import AggregatorSilent, ZeroSumError
from .worker import Worker
from .worker_machine import DELAY_TARGET

__all__ = ["register", "HookState", "allreduce_hook", "ZeroSumProcessGroup", "worker_from_env", "default_worker",
           "compressor_state_dict", "load_compressor_state_dict"]

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


# -- checkpoints of compressor state ---------------------------------------------------------------

_TAG = "__zerosum__"


def _key_ok(k) -> bool:
    return isinstance(k, (str, int, float, bool)) or k is None or (isinstance(k, tuple) and all(map(_key_ok, k)))


def _encode(value, where: str):
    """`value` as plain containers, numbers, strings and tensors: what torch.save writes and
    torch.load(weights_only=True) reads back."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, np.generic):
        return {_TAG: "scalar", "dtype": value.dtype.str, "value": value.item()}
    if isinstance(value, np.ndarray):
        try:
            return {_TAG: "ndarray", "value": torch.from_numpy(np.array(value, copy=True))}
        except TypeError:
            raise TypeError(f"{where}: cannot save an array of dtype {value.dtype}") from None
    if isinstance(value, torch.Tensor):
        return {_TAG: "tensor", "value": value.detach().clone()}
    if isinstance(value, np.random.Generator):
        return {_TAG: "generator", "state": value.bit_generator.state}
    if isinstance(value, np.random.RandomState):
        return {_TAG: "randomstate", "state": _encode(value.get_state(legacy=False), where)}
    if isinstance(value, random.Random):
        return {_TAG: "pyrandom", "state": value.getstate()}
    if isinstance(value, tuple):
        return tuple(_encode(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not _key_ok(k)]
        if bad:
            raise TypeError(f"{where}: cannot save the key {bad[0]!r} "
                            "(keys must be strings, numbers or tuples of them)")
        return {_TAG: "dict", "items": [(k, _encode(v, f"{where}[{k!r}]")) for k, v in value.items()]}
    if hasattr(value, "__dict__") and not callable(value):
        return {_TAG: "object", "class": _class_name(value),
                "attrs": {k: _encode(v, f"{where}.{k}") for k, v in vars(value).items()}}
    raise TypeError(f"{where}: cannot save a {type(value).__name__} in a checkpoint")


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _new_restorable(class_name: str):
    """An empty object of `class_name` for state that a compressor makes during training (per-key
    objects, which a fresh compressor does not have yet), if that class says so (`restore_new`) and its
    module is loaded; else None. Nothing is imported, and no other class is made from a checkpoint."""
    module, _, name = class_name.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    return cls.__new__(cls) if isinstance(cls, type) and getattr(cls, "restore_new", False) is True else None


def _restore(current, enc, where: str):
    """The value `enc` (from _encode) stands for; objects, dicts, lists and random generators that
    exist already (`current`) are updated in place, so references to them stay valid."""
    if isinstance(enc, dict) and _TAG in enc:
        kind = enc[_TAG]
        if kind == "object":
            if current is None:
                current = _new_restorable(enc["class"])
            if current is None or _class_name(current) != enc["class"]:
                have = "nothing" if current is None else f"a {_class_name(current)}"
                raise ValueError(f"{where}: the checkpoint holds a {enc['class']}, this run has {have}")
            attrs = vars(current)
            for k, e in enc["attrs"].items():
                attrs[k] = _restore(attrs.get(k), e, f"{where}.{k}")
            return current
        if kind == "dict":
            old = current if isinstance(current, dict) else {}
            items = [(k, _restore(old.get(k), e, f"{where}[{k!r}]")) for k, e in enc["items"]]
            if isinstance(current, dict):
                current.clear()
                current.update(items)
                return current
            return dict(items)
        if kind == "ndarray":
            return enc["value"].cpu().numpy().copy()
        if kind == "tensor":
            t = enc["value"].clone()
            return t.to(current.device) if isinstance(current, torch.Tensor) else t
        if kind == "scalar":
            return np.dtype(enc["dtype"]).type(enc["value"])
        if kind == "generator":
            state = enc["state"]
            if not isinstance(current, np.random.Generator) or \
                    type(current.bit_generator).__name__ != state["bit_generator"]:
                current = np.random.Generator(getattr(np.random, state["bit_generator"])())
            current.bit_generator.state = state
            return current
        if kind == "randomstate":
            current = current if isinstance(current, np.random.RandomState) else np.random.RandomState()
            current.set_state(_restore(None, enc["state"], where))
            return current
        if kind == "pyrandom":
            current = current if isinstance(current, random.Random) else random.Random()
            current.setstate(_restore(None, enc["state"], where))
            return current
        raise ValueError(f"{where}: unknown entry {kind!r} in the checkpoint")
    if isinstance(enc, (tuple, list)):
        old = current if isinstance(current, (tuple, list)) and len(current) == len(enc) else [None] * len(enc)
        values = [_restore(o, e, f"{where}[{i}]") for i, (o, e) in enumerate(zip(old, enc))]
        if isinstance(enc, tuple):
            return tuple(values)
        if isinstance(current, list):
            current[:] = values
            return current
        return values
    return enc


def compressor_state_dict(compressor) -> dict:
    """Everything a zerosum.compression.Compressor holds (its per-key state such as error-feedback
    memory, DIANA shifts and DGC accumulators, its random generators, step sizes, epochs and
    settings), as tensors and plain values that torch.save/torch.load (weights_only) keep exactly."""
    return _encode(compressor, type(compressor).__name__)


def load_compressor_state_dict(compressor, state: dict) -> None:
    """Put what `compressor_state_dict` saved back into `compressor` (of the same class), in place."""
    _restore(compressor, state, type(compressor).__name__)


# -- DDP communication hook ------------------------------------------------------------------------

class HookState:
    """What the ZeroSum DDP hook keeps between calls (returned by `register`).

    - ``worker``: the open zerosum.Worker that sums the buckets (default: the `zerosum` default process
      group's); ``lock``: the lock its allreduces take, shared with that process group and averagers.
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
    - ``sequence``: [(key, numels)] of the buckets the hook reduced in the last whole iteration, in order.

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

    Checkpoints: `state_dict()` holds the compressor's whole state (`compressor_state_dict`), the
    layouts and the buckets of the last iteration, as tensors and plain values keyed by parameter
    names; `load_state_dict()` puts them back, so that a resumed run continues bit for bit. A fresh
    DDP model starts with its first-iteration buckets, not the rebuilt ones the checkpointed run had
    reached (and the blocks, the fixed-point exponents and a compressor's selection depend on how the
    parameters are grouped), so in the first iteration after `load_state_dict` the hook reduces the
    gradients in the checkpoint's groups, each group as soon as DDP has handed over all its
    parameters, in the checkpoint's order; from the next iteration on it follows DDP's buckets again
    (which DDP rebuilds into the same groups). Take the state dict between iterations (after
    `optimizer.step()`), like the model's and the optimizer's.

    Paths (``paths="auto"``): each bucket goes through ZeroSum or through the ring (``ring``, a gloo
    process group: by default the DDP model's, or the gloo side of a `zerosum` one), whichever this job's
    measurements say is faster at the bucket's block density; ``paths`` is then a
    zerosum.hybrid.PathChoice (``paths.report()``: buckets and bytes per path, each bucket's times and
    density), None with the default ``paths="zerosum"``. Every rank takes the same path for every bucket.

    Join (uneven inputs): DDP's join hook calls this hook with zero buckets for the ranks that ran out
    of data, in the same order, so every rank makes the same allreduces; a joined rank's zero gradient
    has no blocks to send. The hook divides by the initial world size, i.e. it supports
    `Join(..., divide_by_initial_world_size=True)` (the default); with False it fails at once.
    """

    def __init__(self, worker: Worker | None = None, compressor=None, model=None, *, paths: str = "zerosum",
                 ring=None, standby=None):
        worker = default_worker() if worker is None else worker
        group = getattr(model, "process_group", None)
        if isinstance(group, ZeroSumProcessGroup) and group.worker is worker and \
                (getattr(model, "find_unused_parameters", False) or getattr(model, "static_graph", False)):
            # DDP then allreduces its map of used parameters through the process group while the
            # buckets are still on this hook's thread: two threads on one worker, in an order
            # that may differ between ranks.
            raise ValueError("with find_unused_parameters=True or static_graph=True, DDP allreduces through its "
                             "'zerosum' process group during the backward pass, while the hook is reducing "
                             "buckets: give the hook a zerosum.Worker of its own (another job id)")
        self.worker = worker
        self.lock = worker_lock(self.worker)      # shared with the `zerosum` process group of this worker
        self.compressor = compressor     # a zerosum.compression.Compressor, or None for the plain sum
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerosum-hook")
        self.buckets = 0
        module = getattr(model, "module", model)     # a DDP model's names without the "module." prefix
        self.names = {} if module is None else {id(p): name for name, p in module.named_parameters()}
        self._ddp = weakref.ref(model) if model is not None and hasattr(model, "_join_config") else None
        self.layouts: dict = {}
        self.owner: dict = {}
        self.relayouts = 0
        self.sequence: list = []      # [(key, sizes)] the hook reduced in the last whole iteration
        self._current: list = []      # the same for the iteration under way
        self._replay = None           # after load_state_dict: the checkpoint's sequence, for one iteration
        self._next = 0
        self._where: dict = {}        # name -> (_Held, offset, numel) while replaying
        self._held: list = []
        self.ring = ring if ring is not None or paths == "zerosum" else ring_of(model)
        self.paths = path_choice(paths, self.ring)
        self.failover = None
        self._seq = 0                 # buckets reduced so far (the same count on every rank)
        if self.paths is not None:
            if self.worker.config.silence is None:
                self.worker.set_silence(SILENCE)
            if standby is None and os.environ.get("ZEROSUM_STANDBY"):
                standby = [a.strip() for a in os.environ["ZEROSUM_STANDBY"].split(",") if a.strip()]
            self.failover = Failover(self.worker, self.ring, self.lock, standby)

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
        """Wait for the buckets in flight; let go of the ring's process group (so that it is destroyed
        with torch.distributed's, not later, at the interpreter's exit)."""
        self.executor.shutdown(wait=True)
        self.ring = None
        if self.failover is not None:
            self.failover.ring = self.failover.previous = None
        if self.paths is not None:
            self.paths.agree = None

    # -- checkpoints -------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Wait until the background thread has finished what was submitted so far."""
        self.executor.submit(lambda: None).result()

    def state_dict(self) -> dict:
        """The hook's state for a checkpoint (see the class docstring): plain values and tensors,
        for torch.save; each rank saves its own (error-feedback memory and the like differ by rank)."""
        self._drain()
        unnamed = {n for key, _ in self.sequence for n in key if not isinstance(n, str)} | \
            {n for key in self.layouts for n in key if not isinstance(n, str)}
        if unnamed:
            raise ValueError("the hook state keys some parameters by their id(), which means nothing in another "
                             "process: build it with model=... (zerosum.torch.register does) to key them by name")
        return {"buckets": self.buckets, "relayouts": self.relayouts,
                "layouts": [(key, sizes) for key, sizes in self.layouts.items()],
                "owner": dict(self.owner),
                "sequence": list(self.sequence),
                "compressor": None if self.compressor is None else compressor_state_dict(self.compressor)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved (into a HookState built like the saved one: same compressor
        class, same model). The next iteration reduces in the checkpoint's groups (class docstring)."""
        self._drain()
        saved = state.get("compressor")
        if (saved is None) != (self.compressor is None):
            raise ValueError("the checkpoint's hook state was saved " + ("with" if saved is not None else "without") +
                             " a compressor, this hook has " + ("none" if self.compressor is None else "one"))
        known = set(self.names.values())
        names = {n for key, _ in state["layouts"] for n in key} | {n for key, _ in state["sequence"] for n in key}
        if known and not names <= known:
            raise ValueError(f"the checkpoint's hook state names parameters this model does not have: "
                             f"{sorted(names - known)[:5]}")
        if saved is not None:
            load_compressor_state_dict(self.compressor, saved)
        self.buckets, self.relayouts = int(state["buckets"]), int(state["relayouts"])
        self.layouts = {tuple(key): tuple(int(n) for n in sizes) for key, sizes in state["layouts"]}
        self.owner = {name: tuple(key) for name, key in state["owner"].items()}
        self.sequence = [(tuple(key), tuple(int(n) for n in sizes)) for key, sizes in state["sequence"]]
        self._current = []
        self._replay = list(self.sequence) or None
        self._next, self._where, self._held = 0, {}, []

    # -- the reduction -----------------------------------------------------------------------------

    def _record(self, key, sizes, last: bool) -> None:
        if key is not None:
            self._current.append((key, sizes))
        if last:
            self.sequence, self._current = self._current, []

    def _join_error(self):
        ddp = self._ddp() if self._ddp is not None else None
        config = getattr(ddp, "_join_config", None)
        if config is not None and config.enable and not getattr(ddp, "_divide_by_initial_world_size", True):
            return ValueError("the ZeroSum hook averages over the initial world size, i.e. a rank that ran out of "
                              "data counts with a zero gradient: use Join(..., divide_by_initial_world_size=True) "
                              "(or ddp_model.join(divide_by_initial_world_size=True), the default)")
        return None

    def _reduce_surviving(self, tensor: torch.Tensor, key: tuple, average: bool, last: bool) -> None:
        """paths="auto": the bucket through its chosen path, or through the ring while the aggregator is
        gone, or finished from the pieces after it failed (Failover); while it is gone, the agreement at
        each iteration's end."""
        f, seq = self.failover, self._seq
        self._seq += 1
        if f.before(seq, tensor, average):
            pass
        elif f.down:
            ring_allreduce(self.ring, tensor)
            if average:
                tensor.div_(self.worker.world_size)
            f.ring_buckets += 1
        else:
            try:
                if reduce_on_chosen_path(self.paths, key, tensor, self.worker, self.lock, self.ring, average=average) \
                        and average:
                    tensor.div_(self.worker.world_size)     # the ring's sum; ZeroSum averaged as it went
            except AggregatorSilent as e:
                f.failed(seq, tensor, e.received, average)
        f.completed(seq, tensor, last)
        if last:
            f.end_of_iteration(seq)

    def reduce(self, buffer: torch.Tensor, key: tuple, sizes: tuple, last: bool = True) -> torch.Tensor:
        """Average `buffer` (the gradients of the parameters `key`, of `sizes` elements, in this
        order) over the ranks, in place: the plain average, or the compressor's estimate. Runs on the
        background thread, in the same order on every rank."""
        if self.compressor is None:
            if self.paths is None:
                # Averaged as the blocks arrive: no second pass over the (mostly zero) bucket.
                with self.lock:
                    return self.worker.allreduce(buffer, out=buffer, average=True)
            self._reduce_surviving(buffer, key, True, last)
            return buffer
        self.adopt(key, sizes)         # here, after the previous bucket's compress is done
        # Compressors work on host arrays; they return the averaged estimate themselves.
        grad = buffer.detach().cpu().numpy()
        contribution = self.compressor.compress(grad, key)
        if self.paths is None:
            with self.lock:
                summed = self.worker.allreduce(contribution)
        else:   # the contribution decides the density, and so the path
            summed = np.ascontiguousarray(contribution).copy()
            self._reduce_surviving(torch.from_numpy(summed), key, False, last)
        estimate = self.compressor.decompress(summed, self.worker.world_size, key)
        buffer.copy_(torch.from_numpy(np.ascontiguousarray(estimate, np.float32)).reshape(buffer.shape))
        return buffer

    def _replay_bucket(self, buffer, key, sizes, last, fut):
        """First iteration after load_state_dict: hold the bucket and reduce every group of the
        checkpoint whose parameters have all arrived, in the checkpoint's order."""
        if sum(sizes) != buffer.numel():
            raise ValueError(f"the bucket's buffer has {buffer.numel()} elements, its parameters "
                             f"{sum(sizes)}: cannot regroup it")
        wanted = {n for group, _ in self._replay for n in group}
        missing = [n for n in key if n not in wanted]
        if missing:
            raise ValueError(f"the hook state loaded from the checkpoint has no group for the parameters "
                             f"{missing[:5]}: it was saved for another model or other trainable parameters")
        held = _Held(buffer, fut, len(key))
        self._held.append(held)
        for name, start, n in zip(key, np.cumsum((0,) + sizes[:-1]), sizes):
            self._where[name] = (held, int(start), n)
        while self._next < len(self._replay):
            group, gsizes = self._replay[self._next]
            if not all(n in self._where for n in group):
                break
            parts = [self._where[n] for n in group]
            if tuple(n for _, _, n in parts) != gsizes:
                raise ValueError(f"the parameters {group} changed size ({gsizes} -> "
                                 f"{tuple(n for _, _, n in parts)} elements) since the checkpoint")
            self._next += 1
            self._record(group, gsizes, False)
            self.executor.submit(self._reduce_group, group, gsizes, parts)
        if last:
            left = [group for group, _ in self._replay[self._next:]]
            helds = self._held
            self._replay, self._next, self._where, self._held = None, 0, {}, []
            self._record(None, None, True)
            if left:
                error = ValueError(f"the checkpoint's groups {left[:3]} hold parameters whose gradients DDP did "
                                   "not hand over in this iteration: the hook state was saved for another model")

                def fail():
                    for h in helds:
                        if not h.fut.done():
                            h.fut.set_exception(error)
                self.executor.submit(fail)
        return fut

    def _reduce_group(self, group, sizes, parts) -> None:
        try:
            flat = torch.cat([h.buffer[start:start + n] for h, start, n in parts])
            self.reduce(flat, group, sizes)
            at = 0
            for h, start, n in parts:
                h.buffer[start:start + n].copy_(flat[at:at + n])
                at += n
                h.left -= 1
                if h.left == 0:
                    h.fut.set_result(h.buffer)
        except BaseException as e:   # the training loop sees it when it waits on the Futures
            for h, _, _ in parts:
                if not h.fut.done():
                    h.fut.set_exception(e)


class _Held:
    """A bucket the hook holds while it reduces the checkpoint's groups (HookState._replay_bucket)."""

    def __init__(self, buffer, fut, left):
        self.buffer, self.fut, self.left = buffer, fut, left


def allreduce_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: returns at once; the bucket's sum, divided by the world size, arrives on the Future.

    DDP launches buckets in the same order on every rank, and the single background thread keeps that
    order, which is what ZeroSum's per-call epochs need. Compressor state is keyed by the bucket's
    parameters (see HookState), not by ``bucket.index()``, which DDP's bucket rebuild reassigns.
    """
    fut = torch.futures.Future()
    buffer = bucket.buffer()
    state.buckets += 1
    error = state._join_error()
    if error is not None:
        raise error
    last = bucket.is_last() if hasattr(bucket, "is_last") else True
    key = state.key(bucket)
    sizes = tuple(p.numel() for p in bucket.parameters())
    if state._replay is not None:
        return state._replay_bucket(buffer, key, sizes, last, fut)
    if state.compressor is not None and sum(sizes) != buffer.numel():
        raise ValueError(f"the bucket's buffer has {buffer.numel()} elements, its parameters "
                         f"{sum(sizes)}: cannot tell which state belongs to which parameter")
    state._record(key, sizes, last)

    def run():
        try:
            fut.set_result(state.reduce(buffer, key, sizes, last))
        except BaseException as e:   # the training loop sees it when it waits on the Future
            fut.set_exception(e)

    state.executor.submit(run)
    return fut


def register(ddp_model, worker: Worker | None = None, compressor=None, *, paths: str = "zerosum",
             ring=None, standby=None) -> HookState:
    """Send `ddp_model`'s gradient buckets through `worker` (an open zerosum.Worker; default: the
    worker of the `zerosum` default process group), optionally compressed by a
    zerosum.compression.Compressor, its state kept per set of parameters in a bucket and carried over
    when DDP rebuilds its buckets (see HookState). paths="auto": each bucket through ZeroSum or the
    ring (a gloo group; default: the model's), whichever is faster at its density (zerosum.hybrid), and
    training survives the aggregator (Failover), turning to the `standby` aggregators ("HOST:PORT" list;
    default: ZEROSUM_STANDBY) when the failed ones do not come back."""
    state = HookState(worker, compressor, model=ddp_model, paths=paths, ring=ring, standby=standby)
    ddp_model.register_comm_hook(state, allreduce_hook)
    return state


# -- per-bucket paths: ZeroSum or the ring (zerosum.hybrid) ----------------------------------------

def ring_of(model=None):
    """The gloo group of the ring path: the DDP model's process group (the gloo side of a `zerosum`
    one), else the default process group's."""
    group = getattr(model, "process_group", None)
    if group is None and dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
    return group.gloo if isinstance(group, ZeroSumProcessGroup) else group


def ring_allreduce(group, tensor: torch.Tensor, op=ReduceOp.SUM, timeout: float | None = None) -> None:
    """`tensor` reduced over `group` in place (its own collective, not the default group's); raises
    RuntimeError after `timeout` seconds if given."""
    opts = AllreduceOptions()
    opts.reduceOp = op
    work = group.allreduce([tensor], opts)
    if timeout is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=timeout))


def path_choice(paths: str, ring) -> "hybrid.PathChoice | None":
    """paths="zerosum": None (every allreduce through ZeroSum); "auto": a PathChoice whose agreements
    (the maximum over ranks) run on `ring`."""
    if paths == "zerosum":
        return None
    if paths != "auto":
        raise ValueError(f"paths must be 'zerosum' or 'auto', got {paths!r}")
    if ring is None:
        raise ValueError("paths='auto' needs a ring: a gloo process group (ring=...), or "
                         "torch.distributed initialised with one")

    def agree(values):
        t = torch.tensor(np.asarray(values, np.float64))
        ring_allreduce(ring, t, ReduceOp.MAX)
        return t.numpy()
    return hybrid.PathChoice(agree)


def union_density(t: torch.Tensor, block_size: int) -> float:
    """The share of t's blocks of `block_size` values that hold a non-zero value."""
    flat = t.reshape(-1)
    n = flat.numel()
    full = n // block_size * block_size
    nonzero = int((flat[:full].view(-1, block_size) != 0).any(1).sum())
    if n > full and bool((flat[full:] != 0).any()):
        nonzero += 1
    return nonzero / max(1, -(-n // block_size))


CALIBRATION_VALUES = (1 << 16, 1 << 21)    # the calibration buffer: a bucket's size within these
SILENCE = 1.0     # paths="auto": seconds of an aggregator's silence after which the ranks go on without it
# seconds a rank waits for the others in the failover's agreements (they may be up to a backward pass and
# their own detection apart) before it raises: a rank that is dead or cut off from this one
AGREEMENT_TIMEOUT = 60.0


def reduce_on_chosen_path(paths, key, tensor: torch.Tensor, worker: Worker, lock, ring,
                          average: bool = False) -> bool:
    """Sum `tensor` (contiguous, on any device) over the ranks in place, through ZeroSum (averaged with
    `average`) or through the ring, as `paths` chooses for `key`; timed and reported to `paths`. The
    first call calibrates `paths` (a few ZeroSum allreduces of a zero and a dense buffer). Returns
    whether the ring took it (then the sum is not averaged)."""
    if paths.base is None:
        n = min(max(tensor.numel(), CALIBRATION_VALUES[0]), CALIBRATION_VALUES[1])

        def timed(density):
            # on the bucket's device: a CUDA bucket's time includes its copies to and from the host
            x = (torch.zeros if density == 0 else torch.ones)(n, device=tensor.device)
            with lock:
                start = time.perf_counter()
                worker.allreduce(x, out=x)
                return time.perf_counter() - start
        timed(1.0)                       # warm: the first allreduce of a size allocates
        paths.calibrate(timed)
    path = paths.choose(key)
    start = time.perf_counter()
    if path == hybrid.RING:
        ring_allreduce(ring, tensor)
        seconds = time.perf_counter() - start
        density = union_density(tensor, worker.block_size) if paths.scan_due(key, path) else None
    else:
        with lock:
            start = time.perf_counter()
            worker.allreduce(tensor, out=tensor, average=average)
            seconds = time.perf_counter() - start
        union, blocks = worker.last_union
        density = union / blocks if blocks else 0.0
    paths.observe(key, path, tensor.numel() * tensor.element_size(), seconds, density)
    return path == hybrid.RING


class Failover:
    """Training that survives its aggregator (the hook with paths="auto"): when an aggregator falls silent
    (AggregatorSilent, R-L7), the ranks agree where they are, finish the bucket it left unfinished from
    what each rank has, send the following buckets through the ring, and go back to ZeroSum once every
    rank has joined an aggregator again (Worker.poll_rejoin: a restarted one). No step is lost or applied
    twice, and every rank applies the same update.

    Where the ranks can be when an aggregator dies: a rank completes bucket k only once every rank has
    sent all of k, so the ranks stand at most one bucket apart, at k ("failed at k": some of its blocks
    final, the rest still its input) and at k + 1 (k complete). The ranks that fail agree on every rank's
    position (`statuses`, one small ring allreduce, only after a failure); then:

    - bucket k: if some rank completed it, the lowest such rank broadcasts its result (still in the
      bucket's buffer: DDP writes into a bucket again only in the next backward pass, which cannot begin
      before every bucket of this one is done); otherwise it is finished from the pieces (`finish`):
      blocks that some rank received are final (the maximum over ranks of the received values, identical
      wherever received), the others are the ring sum of the inputs, which every rank still holds there;
    - bucket k + 1 is finished the same way by every rank when it gets to it (a rank that had started
      it holds some final blocks, the others none);
    - then every bucket goes through the ring; at the end of each iteration the ranks agree whether every
      rank has rejoined, and then go back to ZeroSum. With `standby` aggregators, the ranks turn to them
      (all at the same iteration, by the agreed time down) when the failed ones have not come back within
      `standby_after` seconds, and back again after as long, until one set answers.

    One case cannot be repaired: bucket k was the last of its iteration, and a rank that completed it has
    gone on to the next iteration's backward pass, which overwrote k's buffer (the aggregator would have
    had to die between sending k's last results to one rank and to another). Then every rank raises the
    same error instead of applying different updates. Guarding against it would cost an agreement in every
    iteration (on 2 shared cores one small ring allreduce took ~7 ms a step).
    """

    def __init__(self, worker: Worker, ring, lock, standby=None, standby_after: float = 2.0,
                 timeout: float = AGREEMENT_TIMEOUT):
        self.worker, self.ring, self.lock = worker, ring, lock
        self.timeout = timeout         # a rank that does not take part in an agreement this long: an error
        # aggregators to turn to when the failed ones have not come back within `standby_after` seconds
        # (the failed ones become the standby in turn)
        self.standby = list(standby) if standby else None
        self.standby_after = standby_after
        self.down_at = 0.0             # when this rank went down (its own clock)
        self.switched_at = 0.0         # agreed seconds down at the last turn to the standby
        self.world, self.rank = worker.world_size, worker.rank
        self.down = False              # the aggregator is gone: every bucket through the ring
        self.down_since: int | None = None   # the bucket at which it went (the agreed lowest position)
        self.pending: int | None = None   # the bucket every rank finishes from the pieces when it gets to it
        self.previous = None           # (seq, tensor holding its result, last of its iteration) of the last
        #                                bucket completed
        self.failures = 0
        self.recovered = 0             # buckets finished from the pieces or taken from another rank
        self.ring_buckets = 0          # buckets sent through the ring because the aggregator was gone
        self.rejoins = 0

    def _reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM) -> None:
        """A collective of the failover over the ring, or a clear error if the ranks cannot all take part."""
        try:
            ring_allreduce(self.ring, tensor, op, self.timeout)
        except RuntimeError as e:
            raise self._unreachable(e) from e

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        try:
            self.ring.broadcast([tensor], src).wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise self._unreachable(e) from e

    def _unreachable(self, e) -> ZeroSumError:
        return ZeroSumError(f"rank {self.rank}: the ranks could not agree through the ring within {self.timeout:.0f} s "
                            f"after the aggregator failed ({e}): a rank is dead or cannot reach this one "
                            "(partitioned); this step's update was not applied")

    def statuses(self, seq: int, joined: bool = True, previous_last: bool = False, down_for: float = 0.0):
        """Every rank's position (the first bucket it has not completed), whether it has rejoined, and
        whether its previous bucket was the last of an iteration (three vectors over the ranks), and the
        longest any rank has been down (seconds)."""
        w = self.world
        v = torch.full((3 * w + 1,), -1.0, dtype=torch.float64)
        v[self.rank] = seq
        v[w + self.rank] = 1.0 if joined else 0.0
        v[2 * w + self.rank] = 1.0 if previous_last else 0.0
        v[3 * w] = down_for
        self._reduce(v, ReduceOp.MAX)
        v = v.numpy()
        return v[:w].astype(np.int64), v[w:2 * w] > 0, v[2 * w:3 * w] > 0, float(v[3 * w])

    def finish(self, tensor: torch.Tensor, received, average: bool) -> None:
        """Finish a bucket from the pieces (class docstring): `received`, per block, whether this rank's
        tensor holds its final sum there (None: nowhere, the tensor is all input)."""
        B = self.worker.block_size
        n = tensor.numel()
        nblocks = -(-n // B)
        mine = torch.zeros(nblocks) if received is None else torch.from_numpy(np.asarray(received, np.float32))
        anyone = mine.clone()
        self._reduce(anyone, ReduceOp.MAX)
        flat = tensor.view(-1)
        mine_v = mine.repeat_interleave(B)[:n].bool().to(flat.device)
        anyone_v = anyone.repeat_interleave(B)[:n].bool().to(flat.device)
        final = torch.where(mine_v, flat, torch.tensor(float("-inf"), dtype=flat.dtype, device=flat.device))
        self._reduce(final, ReduceOp.MAX)
        inputs = torch.where(anyone_v, torch.zeros((), dtype=flat.dtype, device=flat.device), flat)
        self._reduce(inputs)
        if average:
            inputs.div_(self.world)
        flat.copy_(torch.where(anyone_v, final, inputs))
        self.recovered += 1

    def failed(self, seq: int, tensor: torch.Tensor, received, average: bool) -> None:
        """This rank's allreduce of bucket `seq` raised AggregatorSilent: agree, then finish it."""
        self.failures += 1
        previous_last = self.previous is not None and self.previous[0] == seq - 1 and self.previous[2]
        positions, _, lasts, _ = self.statuses(seq, previous_last=previous_last)
        low, high = int(positions.min()), int(positions.max())
        if high - low > 1:
            raise ZeroSumError(f"ranks are more than one bucket apart after the aggregator failed "
                               f"({positions.tolist()}): cannot agree on the buckets to finish")
        self.down, self.down_since = True, low
        self.down_at, self.switched_at = time.monotonic(), 0.0
        if high == low:
            self.finish(tensor, received, average)
            return
        # bucket `low` from a rank that completed it; the ranks at `high` then finish that one
        src = int(np.flatnonzero(positions == high)[0])
        if lasts[src]:
            raise ZeroSumError(
                f"the aggregator failed while ranks {np.flatnonzero(positions == low).tolist()} waited for the last "
                f"results of an iteration that ranks {np.flatnonzero(positions == high).tolist()} had completed and "
                "gone past: that bucket cannot be finished the same way on every rank (restart from a checkpoint)")
        if seq == low:
            self._broadcast(tensor, src)
            self.pending = high
        else:
            held_seq, held, _ = self.previous
            self._broadcast(held, src)
            self.finish(tensor, received, average)
        self.recovered += 1

    def before(self, seq: int, tensor: torch.Tensor, average: bool) -> bool:
        """Before bucket `seq`: finish it from the pieces if it is the agreed pending one (returns True:
        done), else False (send it through the ring when `down`, else by its chosen path)."""
        if self.pending is not None and seq == self.pending:
            self.pending = None
            self.finish(tensor, None, average)
            return True
        return False

    def completed(self, seq: int, result: torch.Tensor, last: bool) -> None:
        self.previous = (seq, result, last)

    def end_of_iteration(self, last_seq: int) -> None:
        """After an iteration's last bucket, while the aggregator is gone (and was gone before that bucket,
        so that every rank gets here): whether every rank has rejoined one; then back to ZeroSum."""
        if not self.down or self.down_since >= last_seq:
            return
        with self.lock:
            joined = self.worker.poll_rejoin()
        _, rejoined, _, down_for = self.statuses(last_seq + 1, joined, down_for=time.monotonic() - self.down_at)
        if rejoined.all() and self.pending is None:
            self.down, self.down_since = False, None
            self.rejoins += 1
        elif self.standby and down_for - self.switched_at >= self.standby_after:
            # agreed: every rank turns at the same iteration
            with self.lock:
                failed = self.worker.aggregator_names
                self.worker.use_aggregators(self.standby)
            self.standby, self.switched_at = failed, down_for

    def report(self) -> dict:
        return {"failures": self.failures, "recovered_buckets": self.recovered,
                "ring_buckets_while_down": self.ring_buckets, "rejoins": self.rejoins, "down": self.down}


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
            local = LocalAggregator(world_size, job=job, key=key or new_key(), multicast=group)
            store.set("zerosum/aggregators", local.address)
            store.set("zerosum/job", str(job))
            store.set("zerosum/key", local.key)
            store.set("zerosum/multicast", group or "")
        aggregators = [store.get("zerosum/aggregators").decode()]
        job = int(store.get("zerosum/job").decode())
        key = store.get("zerosum/key").decode()
        multicast = store.get("zerosum/multicast").decode()
    worker = Worker(rank, world_size, aggregators, job=job,
                    block_size=int(os.environ.get("ZEROSUM_BLOCK_SIZE", 256)),
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
