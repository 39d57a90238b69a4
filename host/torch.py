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

This module is the hook; the backend is zerosum.torch_backend, the per-bucket choice of path and the
failover zerosum.torch_paths, the compressor's state in checkpoints zerosum.torch_checkpoint (their
public names are here too).
"""
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .errors import AggregatorSilent
from .torch_backend import (ZeroSumProcessGroup, default_worker, ring_of, window_from_env,  # noqa: F401
                            worker_from_env, worker_lock)
from .torch_checkpoint import compressor_state_dict, load_compressor_state_dict
from .torch_paths import SILENCE, Failover, path_choice, reduce_on_chosen_path, ring_allreduce
from .worker import Worker

__all__ = ["register", "HookState", "allreduce_hook", "ZeroSumProcessGroup", "worker_from_env", "default_worker",
           "compressor_state_dict", "load_compressor_state_dict", "Failover"]


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
