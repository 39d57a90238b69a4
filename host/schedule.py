"""Priority scheduling with tensor partitioning: gradients in chunks, sent in the order the next
forward pass needs them, and a forward pass that waits per layer instead of for the whole allreduce.

    import torch, zerosum
    from zerosum.schedule import PriorityScheduler

    with zerosum.Worker(rank, world, ["10.0.0.1:48879"]) as worker:
        torch.manual_seed(0)                       # the same initial parameters on every rank
        model = make_model()                       # a plain nn.Module, not DDP
        sched = PriorityScheduler(model, worker, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
        for x, y in loader:
            loss = loss_fn(model(x), y)            # each layer first waits for its own update of the last step
            loss.backward()                        # chunks go out on the scheduler's thread
            sched.step()                           # the end of the iteration: returns at once
        sched.synchronize()                        # the last updates (before evaluating or saving)
        sched.close()

What ByteScheduler and P3 do for parameter servers, for ZeroSum: the gradient of each parameter is cut
into chunks of at most `chunk_elems` elements (a multiple of the worker's block size; small
parameters of one module are packed into one chunk, each at a block boundary), one background thread
averages the chunks through the Worker, and the optimizer steps module by module in the forward pre-hook
of the NEXT iteration, once that module's chunks are in. So the next forward pass starts as soon as the
first layer's chunks are averaged, and the last layers' communication overlaps the first layers'
compute.

**Static order.** ZeroSum numbers the calls of a Worker by epoch: every rank must make the same
allreduces in the same order. So the chunks are not sent in the order they happen to become ready
(which differs between ranks), but in a static order computed from the model, the same on every rank.
The comm thread takes the chunks of the schedule one after the other and waits for each in turn to be
ready. The order is built at the first backward pass from the first forward pass (forward pre-hooks
record the order in which the modules that hold parameters are called), and checked once over the ranks
(one exact int32 allreduce of a digest of the schedule and of the initial parameters): ranks that built
different schedules, or started from different parameters, fail at once instead of mixing chunks up.

- ``order="priority"``: chunks in forward order, first layer first. The comm thread cannot start before
  the first layer's gradient exists, i.e. at the end of the backward pass; nothing overlaps the
  backward pass, but the next forward pass starts after the first layer's chunks, and each later
  layer's chunks travel while the layers before it compute.
- ``order="bucket"``: chunks in the order their gradients become ready in the backward pass (reverse
  forward order, like DDP's buckets). Communication starts during the backward pass, but the first
  layer's chunks go last: the next forward pass waits for the whole allreduce. This is the baseline.
- ``order="priority", backward_chunks=K``: the first K chunks of the bucket order (the last layers)
  go during the backward pass, then the rest in forward order. K trades overlap with the backward pass
  against the delay before the first layer's chunks: K chunks the backward pass cannot hide are in
  front of the first layer.

Whatever the order, each chunk is the same allreduce with the same data, so the parameters are
bit-identical across orders, across chunk sizes (every parameter starts at a block boundary of its
chunk, so each block holds the same values) and across ranks (ZeroSum's fixed-point sum is).

**Iterations.** `step()` ends an iteration: parameters whose gradient hook did not fire in it (unused
in this iteration, frozen, or the rank had no data and called `step()` without a backward pass) are
sent as zero chunks (a zero gradient has no blocks to send, but the allreduce must still be made, so
every rank makes the same calls) and receive the other ranks' average like the rest. `step()` does not
wait for communication. A module's optimizer steps in its forward pre-hook, after waiting for that
module's chunks; the scheduler then sets the gradients to None. `synchronize()` waits for everything
outstanding and applies the pending updates: call it at the end of training and before evaluating,
checkpointing or reading the parameters (a forward pass under `torch.no_grad()` applies the updates of
the modules it calls, as a training forward pass does).

**Rules (a clear error where they are broken):**

- The scheduler owns the gradients: do not call `zero_grad()`, clip or otherwise change gradients
  between `backward()` and the update (a gradient changed in place or replaced is reported when its
  update is applied). Per-module optimizers mean no global gradient-norm clipping.
- One backward pass per iteration: `forward`, `backward`, `step()`. A second backward pass or a
  forward pass after `backward()` without `step()` raises. For gradient accumulation, run all but the
  last micro-batch inside ``with sched.no_sync():``.
- A parameter must be used in the forward of a module that holds it directly (the root module holds
  parameters used at the top level); a parameter used elsewhere first would be read before its update.
  A module called twice per forward pass waits and steps at its first call. Parameters of modules the
  first forward pass did not call are updated at the start of the forward pass (first pre-hook).
- float32 dense gradients only; a plain nn.Module (not DDP: the scheduler replaces it). Initial
  parameters must be equal on every rank (there is no broadcast: seed them). Give the scheduler a
  Worker no other thread uses while training: calls of two threads would interleave in an order that
  differs between ranks.
- Errors of the comm thread (a Worker timeout when a peer or the aggregator is gone, NaN in a gradient,
  ...) are raised in the training thread, with the iteration and chunk, at its next wait or call (a
  forward pre-hook, a gradient hook, `step()`, `synchronize()`): it never hangs; the same type for
  ZeroSum's errors (ZeroSumTimeout, ...), ZeroSumError for others.

**Counters.** `history` holds an `IterationStats` per ended iteration (the last `history` ones; the
comm thread and the next forward pass fill in the latest after `step()`): chunks sent and their order,
the comm thread's busy time, the time the training thread waited for that iteration's chunks (the
next forward pass, mostly), parameters sent as zero chunks, bytes sent and received.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import ZeroSumError
from .torch_backend import worker_lock

__all__ = ["PriorityScheduler", "Chunk", "IterationStats"]

ORDERS = ("priority", "bucket")


@dataclass
class Chunk:
    """One allreduce of the schedule: a slice of one parameter's flat gradient, or several whole small
    parameters of one module packed into a staging buffer, each at a block boundary."""
    index: int
    group: str                      # the module whose optimizer the chunk's parameters belong to
    parts: list                     # [(parameter index, start, stop, offset in the chunk)]
    numel: int                      # elements of the allreduce (with the packing's padding)
    names: tuple = ()               # the parameters' names
    buffer: torch.Tensor | None = field(default=None, repr=False)   # staging buffer of a packed chunk


@dataclass
class IterationStats:
    """What one iteration's communication did (filled by the comm thread and the training thread)."""
    iteration: int
    chunks: int = 0                 # chunks sent
    sent: list = field(default_factory=list)       # their indices, in the order sent
    comm_busy_s: float = 0.0        # time the comm thread spent on this iteration's chunks
    forward_wait_s: float = 0.0     # time the training thread waited for this iteration's chunks
    optimizer_s: float = 0.0        # time of the optimizer steps applying this iteration's averages
    zero_params: int = 0            # parameters without a gradient, sent as zero chunks
    bytes_sent: int = 0
    bytes_received: int = 0
    backward_end: float = 0.0       # time.perf_counter() at step()
    comm_start: float = 0.0         # when the first chunk started, and the last one ended
    comm_end: float = 0.0


def _in_backward() -> bool:
    """Is this thread running a backward pass (a checkpointed module's forward is recomputed then)?"""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class _Group:
    """A module's trainable parameters, with its optimizer; `pending`: the iteration whose averaged
    gradients they hold and whose update is not applied yet (None: nothing pending)."""

    def __init__(self, index, name, params):
        self.index, self.name, self.params = index, name, params
        self.optimizer = None
        self.chunks: list[int] = []
        self.pending: int | None = None


class PriorityScheduler:
    """Average `module`'s gradients through `worker` in chunks, in a static priority order, and apply
    each module's update just before its next forward (see the module docstring).

    module: a plain nn.Module whose trainable parameters are float32. worker: an open zerosum.Worker
    (its block size aligns the chunks). optimizer_factory: called once per module that holds trainable
    parameters, with the list of those parameters; returns its optimizer (e.g.
    ``lambda ps: torch.optim.SGD(ps, lr=0.1)``); `optimizers` maps module names to them, for learning
    rate schedules. chunk_elems: the most elements per chunk (rounded down to a multiple of the block
    size, at least one block). order: "priority" or "bucket"; backward_chunks: with "priority", how many
    chunks of the bucket order go first. history: how many IterationStats to keep.

    Attributes once the first backward pass started: `chunks` (list of Chunk), `schedule` (chunk
    indices in sending order), `forward_order` (module names in the order the first forward pass called
    them).
    """

    def __init__(self, module: torch.nn.Module, worker, optimizer_factory, *, chunk_elems: int = 1 << 20,
                 order: str = "priority", backward_chunks: int = 0, history: int = 1000):
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("give the PriorityScheduler the plain module, not a DistributedDataParallel "
                             "model: the scheduler does the gradient averaging that DDP would")
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            raise RuntimeError("the PriorityScheduler needs torch 2.1 or later "
                               "(Tensor.register_post_accumulate_grad_hook)")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if backward_chunks < 0 or (backward_chunks and order != "priority"):
            raise ValueError("backward_chunks must be a non-negative number, and is only meaningful with "
                             "order='priority'")
        if chunk_elems < 1:
            raise ValueError("chunk_elems must be a positive number")
        self.module, self.worker, self.order = module, worker, order
        self.backward_chunks = int(backward_chunks)
        self.block = int(worker.block_size)
        self.chunk_elems = max(self.block, int(chunk_elems) // self.block * self.block)
        self.lock = worker_lock(worker)

        # parameters (each once) and the module that owns each: the first that holds it, by named_parameters
        self.params, self.names, owner = [], [], {}
        for name, p in module.named_parameters():
            if p.requires_grad:
                if p.dtype != torch.float32:
                    raise TypeError(f"parameter {name!r} is {p.dtype}: ZeroSum averages float32 gradients")
                owner[id(p)] = name.rpartition(".")[0]
                self.params.append(p)
                self.names.append(name)
        if not self.params:
            raise ValueError("the module has no trainable parameters")
        index = {id(p): i for i, p in enumerate(self.params)}
        self.groups: list[_Group] = []
        by_name: dict[str, _Group] = {}
        for i, p in enumerate(self.params):
            g = by_name.get(owner[id(p)])
            if g is None:
                g = by_name[owner[id(p)]] = _Group(len(self.groups), owner[id(p)], [])
                self.groups.append(g)
            g.params.append(i)
        self._group_of = [None] * len(self.params)
        for g in self.groups:
            for i in g.params:
                self._group_of[i] = g
            g.optimizer = optimizer_factory([self.params[i] for i in g.params])
        self.optimizers = {g.name: g.optimizer for g in self.groups}
        # the modules holding each parameter directly (tied weights: several)
        self._holders: dict[int, list[int]] = {}       # id(module) -> parameter indices it holds
        self._module_names: dict[int, str] = {}
        self._hooks = []
        for name, m in module.named_modules():
            held = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
            if held or m is module:
                self._holders[id(m)] = held
                self._module_names[id(m)] = name
                self._hooks.append(m.register_forward_pre_hook(self._pre_hook))
        for i, p in enumerate(self.params):
            p.grad = None             # the scheduler owns the gradients from now on
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(i)))

        # the forward order (recorded until the schedule is built), the schedule, the apply points
        self._seen: dict[int, int] = {}                 # id(module) -> position in the first forward
        self.forward_order: list[str] = []
        self.chunks: list[Chunk] = []
        self.schedule: list[int] | None = None
        self._apply_at: dict[int, list[_Group]] = {}    # id(module) -> groups updated in its pre-hook
        self._early: list[_Group] = []                  # groups updated at the first pre-hook of a forward
        self._param_chunks: list[list[int]] = [[] for _ in self.params]

        # iteration state (the training thread's) and the state shared with the comm thread (under _cv)
        self._iter = 0                                  # iterations ended by step()
        self._marked = [-1] * len(self.params)          # the iteration each parameter's gradient came in
        self._nmarked = 0                               # parameters marked in the current iteration
        self._held: list = [None] * len(self.params)    # the gradient tensor each parameter sent
        self._version = [0] * len(self.params)          # its expected version counter
        self._started_forward = False                   # a pre-hook ran since the last step()
        self._accumulating = False
        self._cv = threading.Condition()
        self._left: list[int] = []                      # parameters a chunk still waits for
        self._ready: list[int] = []                     # the last iteration each chunk was ready for
        self._done: list[int] = []                      # ... and sent for
        self._error: BaseException | None = None
        self._error_where = ""
        self._stop = False
        self._thread: threading.Thread | None = None
        self.history: deque = deque(maxlen=max(1, int(history)))
        self._records: dict[int, IterationStats] = {}
        self._open_record(0)

    # -- the schedule --------------------------------------------------------------------------------

    def _make_chunks(self) -> None:
        """Cut every group's parameters into chunks (independent of the order and of the forward pass)."""
        B, cap = self.block, self.chunk_elems
        chunks = []

        def add(group, parts, numel):
            packed = len(parts) > 1
            if not packed:
                numel = parts[0][2] - parts[0][1]
            c = Chunk(len(chunks), group.name, parts, numel, tuple(self.names[i] for i, *_ in parts))
            if packed:
                c.buffer = torch.zeros(numel, dtype=torch.float32, device=self.params[parts[0][0]].device)
            chunks.append(c)
            group.chunks.append(c.index)
            for i, *_ in parts:
                self._param_chunks[i].append(c.index)

        for g in self.groups:
            pack, at = [], 0
            for i in g.params:
                n = self.params[i].numel()
                padded = -(-n // B) * B
                if padded >= cap:                       # a large parameter: chunks of its own
                    if pack:
                        add(g, pack, at)
                        pack, at = [], 0
                    for a in range(0, n, cap):
                        add(g, [(i, a, min(a + cap, n), 0)], min(a + cap, n) - a)
                    continue
                if at + padded > cap:
                    add(g, pack, at)
                    pack, at = [], 0
                pack.append((i, 0, n, at))
                at += padded
            if pack:
                add(g, pack, at)
        self.chunks = chunks

    def _build(self) -> None:
        """The static schedule, from the first forward pass's order (called at the first gradient)."""
        self._make_chunks()
        pos = {}
        for g in self.groups:
            where = [(self._seen[m], m) for m, held in self._holders.items()
                     if m in self._seen and any(i in held for i in g.params)]
            if where:
                p, m = min(where)
                self._apply_at.setdefault(m, []).append(g)
                pos[g.index] = p
            else:
                self._early.append(g)
                pos[g.index] = -1
        groups = sorted(self.groups, key=lambda g: (pos[g.index], g.index))
        priority = [c for g in groups for c in g.chunks]
        # bucket order: reverse forward order; the pieces of one parameter stay in ascending order
        runs: list[list[int]] = []
        for c in priority:
            first = self.chunks[c].parts[0][0]
            if runs and len(self.chunks[c].parts) == 1 and len(self.chunks[runs[-1][0]].parts) == 1 \
                    and self.chunks[runs[-1][0]].parts[0][0] == first:
                runs[-1].append(c)
            else:
                runs.append([c])
        bucket = [c for run in reversed(runs) for c in run]
        if self.order == "bucket":
            schedule = bucket
        else:
            front = bucket[:self.backward_chunks]
            taken = set(front)
            schedule = front + [c for c in priority if c not in taken]
        self.schedule = schedule
        self.forward_order = [self._module_names[m] for m, _ in sorted(self._seen.items(), key=lambda kv: kv[1])]
        n = len(self.chunks)
        self._left = [len(c.parts) for c in self.chunks]
        self._ready = [self._iter - 1] * n
        self._done = [self._iter - 1] * n
        self._thread = threading.Thread(target=self._comm, args=(self._iter,), daemon=True,
                                        name="zerosum-priority-scheduler")
        self._thread.start()

    def _digest(self) -> np.ndarray:
        """The schedule and the initial parameters, as 8 words of 15 bits (an exact int32 sum)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr([(c.numel, [(self.names[i], a, b, o) for i, a, b, o in c.parts])
                       for c in (self.chunks[k] for k in self.schedule)]).encode())
        with torch.no_grad():
            for p in self.params:
                h.update(p.detach().cpu().contiguous().numpy().tobytes())
        return np.frombuffer(h.digest(), np.uint16).astype(np.int32) & 0x7FFF

    # -- the comm thread -----------------------------------------------------------------------------

    def _comm(self, t: int) -> None:
        where = "checking that the ranks agree on the schedule"
        try:
            mine = self._digest()
            with self.lock:
                total = self.worker.allreduce(mine)
            if not np.array_equal(np.asarray(total), mine * self.worker.world_size):
                raise ZeroSumError("the ranks do not agree on the schedule or on the initial parameters: "
                                   "every rank must build the same model with the same initial values "
                                   "(seed it) and call its modules in the same order in the first forward pass")
            stats = self.worker.stats
            while True:
                for c in self.schedule:
                    with self._cv:
                        while self._ready[c] < t:
                            if self._stop:
                                return
                            self._cv.wait()
                        record = self._records.get(t)
                    where = f"iteration {t}, chunk {c} ({', '.join(self.chunks[c].names)})"
                    start = time.perf_counter()
                    with self.lock:
                        sent, received = stats.bytes_sent, stats.bytes_received
                        self._send(self.chunks[c])
                        sent, received = stats.bytes_sent - sent, stats.bytes_received - received
                    end = time.perf_counter()
                    with self._cv:
                        self._done[c] = t
                        if record is not None:
                            if not record.chunks:
                                record.comm_start = start
                            record.chunks += 1
                            record.sent.append(c)
                            record.comm_busy_s += end - start
                            record.comm_end = end
                            record.bytes_sent += sent
                            record.bytes_received += received
                        self._cv.notify_all()
                t += 1
        except BaseException as e:      # raised in the training thread at its next wait
            with self._cv:
                self._error, self._error_where = e, where
                self._cv.notify_all()

    def _send(self, chunk: Chunk) -> None:
        """Average one chunk in place (the gradients the training thread handed over in _held)."""
        held, version = self._held, self._version
        if chunk.buffer is None:
            i, a, b, _ = chunk.parts[0]
            grad = held[i]
            before = grad._version
            flat = grad.view(-1)[a:b]
            self.worker.allreduce(flat, out=flat, average=True)
            version[i] += grad._version - before
            return
        buf = chunk.buffer
        for i, a, b, off in chunk.parts:
            buf[off:off + b - a].copy_(held[i].view(-1))
        self.worker.allreduce(buf, out=buf, average=True)
        for i, a, b, off in chunk.parts:
            grad = held[i]
            before = grad._version
            grad.view(-1).copy_(buf[off:off + b - a])
            version[i] += grad._version - before

    def _raise_error(self) -> None:
        e = self._error
        message = f"the scheduler's communication thread failed ({self._error_where}): {type(e).__name__}: {e}"
        if isinstance(e, ZeroSumError):
            try:
                raise type(e)(message) from e
            except TypeError:
                pass
        raise ZeroSumError(message) from e

    # -- the training thread's side ----------------------------------------------------------------------

    def _open_record(self, t: int) -> None:
        record = IterationStats(t)
        with self._cv:
            self._records[t] = record
            for old in [k for k in self._records if k < t - 2]:
                del self._records[old]

    def _grad_hook(self, i: int):
        def hook(p):
            self._on_grad(i, p)
        return hook

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        g = self._group_of[i]
        if g.pending is not None:
            raise RuntimeError(
                f"parameter {self.names[i]!r} got a gradient before its update from iteration {g.pending} "
                f"was applied: the forward pass used it outside the module(s) that hold it, before they "
                f"were called (or those modules were not called), so it read the old value. Use each "
                f"parameter inside the forward of a module that holds it")
        if self._accumulating:
            return
        if self._error is not None:
            self._raise_error()
        if self._marked[i] == self._iter:
            raise RuntimeError(f"parameter {self.names[i]!r} got a second gradient in iteration {self._iter}: "
                               "call step() after each backward pass (accumulate gradients over several "
                               "backward passes inside `with scheduler.no_sync():`, all but the last)")
        grad = p.grad
        if grad.layout != torch.strided:
            raise TypeError(f"parameter {self.names[i]!r} has a sparse gradient: the PriorityScheduler "
                            "averages dense gradients (use zerosum.torch.register for sparse ones)")
        if not grad.is_contiguous():
            p.grad = grad = grad.contiguous()
        if self.schedule is None:
            self._build()
        self._hand_over([i], [grad])

    def _hand_over(self, indices, grads) -> None:
        """The gradients of these parameters are final for this iteration: the comm thread may send them."""
        t = self._iter
        for i, grad in zip(indices, grads):
            self._held[i] = grad
            self._version[i] = grad._version
            self._marked[i] = t
        self._nmarked += len(indices)
        with self._cv:
            ready = False
            for i in indices:
                for c in self._param_chunks[i]:
                    self._left[c] -= 1
                    if self._left[c] == 0:
                        self._left[c] = len(self.chunks[c].parts)
                        self._ready[c] = t
                        ready = True
            if ready:
                self._cv.notify_all()

    def _pre_hook(self, module, args) -> None:
        key = id(module)
        if self.schedule is None:
            if key not in self._seen:
                self._seen[key] = len(self._seen)
            return
        if self._nmarked and not self._accumulating and not _in_backward():
            raise RuntimeError(f"forward pass (module {self._module_names[key] or 'the root'!r}) after backward() "
                               "without step(): call scheduler.step() at the end of every iteration "
                               "(for gradient accumulation, run all but the last micro-batch inside "
                               "`with scheduler.no_sync():`)")
        if self._error is not None:
            self._raise_error()
        if not self._started_forward:
            self._started_forward = True
            for g in self._early:
                if g.pending is not None:
                    self._apply(g)
        for g in self._apply_at.get(key, ()):
            if g.pending is not None:
                self._apply(g)

    def _wait(self, chunks, t: int) -> float:
        """Wait until these chunks are sent for iteration t; returns the time waited."""
        start = time.perf_counter()
        done = self._done
        with self._cv:
            while not all(done[c] >= t for c in chunks):
                if self._error is not None:
                    self._raise_error()
                if not self._cv.wait(1.0) and not self._thread.is_alive() and self._error is None:
                    raise ZeroSumError("the scheduler's communication thread is gone (closed?)")
        return time.perf_counter() - start

    def _apply(self, g: _Group) -> None:
        """Wait for the group's chunks, check its gradients, step its optimizer, clear its gradients."""
        t = g.pending
        waited = self._wait(g.chunks, t)
        start = time.perf_counter()
        for i in g.params:
            p = self.params[i]
            if p.grad is not self._held[i] or p.grad._version != self._version[i]:
                raise RuntimeError(f"the gradient of {self.names[i]!r} was cleared, replaced or changed in place "
                                   f"between backward() and its update (zero_grad()? gradient clipping?): the "
                                   "scheduler owns the gradients and clears them itself after each update")
        g.optimizer.step()
        for i in g.params:
            self.params[i].grad = None
            self._held[i] = None
        g.pending = None
        record = self._records.get(t)
        if record is not None:
            record.forward_wait_s += waited
            record.optimizer_s += time.perf_counter() - start

    # -- the public API ------------------------------------------------------------------------------

    def step(self) -> None:
        """End the iteration: hand over the gradients that did not come through the hooks (zero chunks
        for parameters without a gradient) and return without waiting for communication."""
        if self._accumulating:
            raise RuntimeError("step() inside no_sync(): leave the no_sync() block for the last micro-batch")
        if self._error is not None:
            self._raise_error()
        if self.schedule is None:
            self._build()
        t = self._iter
        record = self._records.get(t)
        if self._nmarked < len(self.params):
            missing, grads = [], []
            for i, p in enumerate(self.params):
                if self._marked[i] == t:
                    continue
                g = self._group_of[i]
                if g.pending is not None:      # its module was not called in this iteration's forward
                    self._apply(g)
                grad = p.grad
                if grad is None:
                    p.grad = grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if record is not None:
                        record.zero_params += 1
                elif grad.layout != torch.strided or not grad.is_contiguous():
                    p.grad = grad = grad.to_dense().contiguous()
                missing.append(i)
                grads.append(grad)
            self._hand_over(missing, grads)
        for g in self.groups:
            g.pending = t
        if record is not None:
            record.backward_end = time.perf_counter()
            self.history.append(record)       # its communication and wait times are filled in later
        self._iter = t + 1
        self._nmarked = 0
        self._started_forward = False
        self._open_record(t + 1)

    def synchronize(self) -> None:
        """Wait for every chunk sent so far and apply the pending updates (the parameters are then
        current: for evaluation, checkpoints, the end of training)."""
        if self._error is not None:
            self._raise_error()
        for g in self.groups:
            if g.pending is not None:
                self._apply(g)

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate into the gradients without handing them over (gradient
        accumulation); the backward pass after the block (then step()) sends the accumulated sum."""
        if self._nmarked:
            raise RuntimeError("no_sync() after a backward pass of this iteration: enter it first, for all "
                               "micro-batches but the last")
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def close(self) -> None:
        """Apply the pending updates (unless communication failed), stop the thread, remove the hooks."""
        try:
            if self._error is None and self._thread is not None:
                self.synchronize()
        finally:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            if self._thread is not None:
                self._thread.join()
            for h in self._hooks:
                h.remove()
            self._hooks = []

    def __enter__(self) -> "PriorityScheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def state_dict(self) -> dict:
        """The optimizers' states by module name and the iteration counter (after synchronize())."""
        self.synchronize()
        return {"iteration": self._iter,
                "optimizers": {g.name: g.optimizer.state_dict() for g in self.groups}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved, between iterations (before a forward pass)."""
        if self._nmarked or any(g.pending is not None for g in self.groups):
            raise RuntimeError("load_state_dict() between iterations only (after synchronize(), before a forward pass)")
        names = set(state["optimizers"])
        if names != set(self.optimizers):
            raise ValueError(f"the checkpoint has optimizers for the modules {sorted(names)[:5]}, this model "
                             f"{sorted(self.optimizers)[:5]}")
        for g in self.groups:
            g.optimizer.load_state_dict(state["optimizers"][g.name])
        if self.schedule is None:
            self._iter = int(state["iteration"])
            self.history.clear()
            with self._cv:
                self._records.clear()
            self._open_record(self._iter)
