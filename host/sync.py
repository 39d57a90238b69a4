"""When to communicate: post-local SGD (periodic model averaging) and one-step delayed gradients
through ZeroSum.

The same shape as torch's post-local SGD (`torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook`
and `torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager`): for the first
`warmup_steps` steps DDP's gradients are averaged every step (through the ZeroSum hook); after them
each rank steps on its own gradients and every `period` steps the model is averaged:

    import zerosum.sync
    state = zerosum.sync.PostLocalSGDState(worker, start_localSGD_iter=100, model=ddp_model)
    ddp_model.register_comm_hook(state, zerosum.sync.post_localSGD_hook)
    averager = zerosum.sync.PeriodicModelAverager(period=4, warmup_steps=100, worker=worker)
    for batch in data:
        optimizer.zero_grad(); loss(ddp_model, batch).backward(); optimizer.step()
        averager.average_parameters(ddp_model.parameters())

`worker` may be left out under `init_process_group("zerosum")`: then the process group's worker is used.

What is averaged is the change since the last average, not the model: every rank holds the same
anchor (the model as the last average left it), sends `params - anchor`, and sets its parameters to
`anchor + mean of the changes`. Parameters a rank did not change (embedding rows no batch touched
since the last average, with an optimizer that leaves them alone, such as plain SGD) have a zero
change: a rank does not send its zero blocks, and a block zero on every rank gets no round at all.
After every average all ranks hold bit-identical parameters (ZeroSum's sum is bit-identical on all
ranks, and so is the anchor).
"""

from concurrent.futures import Future

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook, Joinable

from .torch import HookState, allreduce_hook
from .torch_backend import default_worker, worker_lock
from .worker import Worker

__all__ = ["PeriodicModelAverager", "PostLocalSGDState", "post_localSGD_hook", "PostLocalSGDOptimizer",
           "DelayedGradientState", "delayed_gradient_hook"]


def _params_to_average(params) -> list:
    """The parameters (or the parameters of optimizer param groups) that require gradients, in order,
    each once. Unlike torch's averager this does not skip parameters whose .grad is None: which
    parameters have gradients may differ between ranks, and the averaged vector must be the same
    on every rank."""
    out, seen = [], set()
    for p in params:
        group = p["params"] if isinstance(p, dict) else [p]
        for q in group:
            if not isinstance(q, torch.Tensor):
                raise TypeError(f"expected parameters or parameter groups, got a {type(q).__name__}")
            if q.requires_grad and id(q) not in seen:
                seen.add(id(q))
                out.append(q)
    return out


class PeriodicModelAverager(Joinable):
    """Average the model every `period` steps after `warmup_steps` steps, through ZeroSum.

    Call `average_parameters(params)` after every `optimizer.step()`, with the model's parameters or
    the optimizer's parameter groups (the same ones in the same order on every rank). It averages
    when `step >= warmup_steps` and `(step - warmup_steps) % period == 0`, then counts the step, as
    torch's PeriodicModelAverager does.

    worker: an open zerosum.Worker; process_group: a process group (default: the default group).
    Without a worker, the worker of a `zerosum` process group is used; another process group (gloo)
    gets a plain SUM all_reduce of the changes, divided by its size.

    The first average has no anchor yet: it averages the parameters themselves (every non-zero block
    is sent, once), which also makes them identical on every rank whatever happened before; from
    then on only the changes since the last average travel (see the module docstring). The anchor
    costs one float32 copy of the averaged parameters. All parameters must be float32.

    `state_dict()` / `load_state_dict()` save and restore the step counter and the anchor, so a run
    resumed from a checkpoint (with each rank's own model, optimizer and averager state) continues
    bit for bit. The averager is a torch `Joinable`: `with Join([ddp_model, averager]):` lets ranks
    run out of data; a joined rank keeps counting steps and takes part in every average with its
    last parameters (its change is zero after the first average it joins, so it sends nothing).
    """

    def __init__(self, period: int = 1, warmup_steps: int = 0, process_group=None, *, worker: Worker | None = None):
        super().__init__()
        if warmup_steps < 0:
            raise ValueError("warmup_steps must be a non-negative number")
        if period < 1:
            raise ValueError("period must be a positive number")
        self.period, self.warmup_steps = int(period), int(warmup_steps)
        self.process_group = process_group
        self.worker = worker
        self.step = 0
        self.anchor: torch.Tensor | None = None   # the parameters after the last average, flattened
        self.sizes: tuple | None = None           # the numel of each parameter in the anchor
        self.averages = 0                         # how many averages this averager took part in
        self._params: list | None = None          # the last parameters given (for Join's shadow steps)

    # -- the training loop's side -------------------------------------------------------------------

    def due(self) -> bool:
        """Is the current step one that averages?"""
        return self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0

    def average_parameters(self, params) -> None:
        """Average `params` if this step is due (see the class docstring), then count the step."""
        self._params = _params_to_average(params)
        Join.notify_join_context(self)
        if self.due():
            self._average(self._params)
        self.step += 1

    def _communicator(self):
        if self.worker is None:
            group = self.process_group if self.process_group is not None else \
                (dist.distributed_c10d._get_default_group() if dist.is_initialized() else None)
            if group is None:
                raise ValueError("no worker given and no process group: pass worker=zerosum.Worker(...), "
                                 "or call torch.distributed.init_process_group first")
            try:
                self.worker = default_worker(group)
            except ValueError:
                return group
        return self.worker

    def _reduce(self, flat: torch.Tensor) -> None:
        comm = self._communicator()
        if isinstance(comm, dist.ProcessGroup):
            dist.all_reduce(flat, group=comm)
            flat.div_(dist.get_world_size(comm))
        else:
            with worker_lock(comm):
                comm.allreduce(flat, out=flat, average=True)

    def _average(self, params: list) -> None:
        bad = [p.dtype for p in params if p.dtype != torch.float32]
        if bad:
            raise TypeError(f"ZeroSum averages float32 parameters, got {bad[0]}")
        sizes = tuple(p.numel() for p in params)
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
            if self.anchor is None:
                self._reduce(flat)                   # the parameters themselves, once
                self.anchor, self.sizes = flat, sizes
            else:
                if sizes != self.sizes:
                    raise ValueError(f"the parameters to average changed ({len(self.sizes)} tensors of "
                                     f"{sum(self.sizes)} elements before, {len(sizes)} of {sum(sizes)} now): "
                                     "give the same parameters in the same order at every step")
                flat.sub_(self.anchor)               # the change since the last average: zero where untouched
                self._reduce(flat)
                self.anchor.add_(flat)
            at = 0
            for p, n in zip(params, sizes):
                p.copy_(self.anchor[at:at + n].view_as(p))
                at += n
        self.averages += 1

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The step counter and the anchor (each rank's, though the anchors are equal), for torch.save."""
        return {"step": self.step, "period": self.period, "warmup_steps": self.warmup_steps,
                "anchor": None if self.anchor is None else self.anchor.clone(),
                "sizes": None if self.sizes is None else list(self.sizes), "averages": self.averages}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step counter and the anchor (period and warm-up stay as constructed)."""
        self.step = int(state["step"])
        self.averages = int(state.get("averages", 0))
        anchor = state.get("anchor")
        self.anchor = None if anchor is None else anchor.detach().clone().to(torch.float32)
        self.sizes = None if state.get("sizes") is None else tuple(int(n) for n in state["sizes"])

    # -- Join (uneven inputs) -----------------------------------------------------------------------

    def join_hook(self, **kwargs) -> JoinHook:
        return _AveragerJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    @property
    def join_process_group(self):
        if self.process_group is not None:
            return self.process_group
        return dist.group.WORLD if dist.is_initialized() else None


class _AveragerJoinHook(JoinHook):
    """A joined rank shadows the averages of the ranks still training (with its last parameters)."""

    def __init__(self, averager: PeriodicModelAverager):
        self.averager = averager

    def main_hook(self) -> None:
        a = self.averager
        if a.due():
            if a._params is None:
                raise RuntimeError("this rank ran out of data before its first average_parameters() call, "
                                   "so the averager does not know which parameters to average")
            a._average(a._params)
        a.step += 1


# -- the DDP hook ------------------------------------------------------------------------------------

class PostLocalSGDState(HookState):
    """State of `post_localSGD_hook`: the ZeroSum hook's state (see zerosum.torch.HookState) and the
    iteration counter `iter`.

    The first `start_localSGD_iter` iterations average the gradients through ZeroSum (optionally
    compressed); after them the hook returns each rank's own gradient, and a PeriodicModelAverager
    with ``warmup_steps=start_localSGD_iter`` averages the model. With `subgroup` (a torch process
    group, e.g. the ranks of one machine) the gradients are averaged within it after the warm-up,
    as torch's hook does; torch's default is to build intra-node subgroups, here the default is none
    (pure local SGD). `state_dict()` adds the counter to HookState's, so a resumed run does not warm
    up again.
    """

    def __init__(self, worker: Worker | None = None, start_localSGD_iter: int = 0, compressor=None, model=None,
                 subgroup=None):
        super().__init__(worker, compressor, model=model)
        if start_localSGD_iter < 0:
            raise ValueError("start_localSGD_iter must be a non-negative number")
        self.start_localSGD_iter = int(start_localSGD_iter)
        self.subgroup = subgroup
        self.iter = 0

    def maybe_increase_iter(self, bucket) -> None:
        """Count an iteration when its last bucket comes (bucket 0 in torch's terms: is_last())."""
        if bucket.is_last():
            self.iter += 1

    def state_dict(self) -> dict:
        return {**super().state_dict(), "iter": self.iter, "start_localSGD_iter": self.start_localSGD_iter}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.iter = int(state["iter"])


def post_localSGD_hook(state: PostLocalSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: ZeroSum's gradient average for the first `start_localSGD_iter` iterations, then the
    rank's own gradient (or the average within `state.subgroup`)."""
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(state, bucket)
    buffer = bucket.buffer()
    if state.subgroup is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        return default_hooks._allreduce_fut(state.subgroup, buffer)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


# -- delayed (one-step stale) gradients -------------------------------------------------------------

class DelayedGradientState(HookState):
    """State of `delayed_gradient_hook`: the ZeroSum hook's state, and per parameter the average of the
    previous iteration's gradient, still being reduced on the hook's thread.

    Staleness bound: exactly one iteration. The update of iteration t applies the average of
    iteration t-1's gradients (computed at the parameters of iteration t-1), and the first iteration
    applies zero; so each allreduce overlaps a whole iteration of compute (forward, backward and the
    optimizer step of the next iteration) instead of the tail of its own backward pass. The averages
    are kept by parameter name, so DDP's bucket rebuild after the first iteration does not mix them
    up. With SGD at step size lr this is w_{t+1} = w_t - lr * mean_r g_r(w_{t-1}), the one-step
    delayed SGD whose convergence holds for lr below about 1/(2L) (delay 1); `flush()` returns the
    last average, which no iteration applied.
    """

    def __init__(self, worker: Worker | None = None, compressor=None, model=None):
        super().__init__(worker, compressor, model=model)
        self.pending: dict = {}     # parameter -> (future of its bucket's average, offset, elements)

    def take(self, key: tuple, sizes: tuple, like: torch.Tensor) -> torch.Tensor:
        """The previous iteration's average for these parameters, in this order (zero where none)."""
        out = torch.zeros_like(like)
        at = 0
        for name, n in zip(key, sizes):
            held = self.pending.pop(name, None)
            if held is not None:
                job, start, m = held
                out[at:at + n].copy_(job.result()[start:start + m])
            at += n
        return out

    def flush(self) -> dict:
        """The averages no iteration has applied yet, by parameter (e.g. to apply them at the end)."""
        out = {}
        for name, (job, start, n) in self.pending.items():
            out[name] = job.result()[start:start + n].clone()
        self.pending = {}
        return out

    def state_dict(self) -> dict:
        self._drain()
        pending = {name: job.result()[start:start + n].clone() for name, (job, start, n) in self.pending.items()}
        return {**super().state_dict(), "pending": pending}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._replay = None      # the delayed hook reduces bucket by bucket; the pending averages carry over
        self.pending = {}
        for name, tensor in state.get("pending", {}).items():
            done = Future()
            done.set_result(tensor)
            self.pending[name] = (done, 0, tensor.numel())


def delayed_gradient_hook(state: DelayedGradientState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: answers at once with the previous iteration's averaged gradient of the bucket's
    parameters, and starts averaging this iteration's on the hook's thread (DelayedGradientState)."""
    buffer = bucket.buffer()
    state.buckets += 1
    key = state.key(bucket)
    sizes = tuple(p.numel() for p in bucket.parameters())
    if sum(sizes) != buffer.numel():
        raise ValueError(f"the bucket's buffer has {buffer.numel()} elements, its parameters {sum(sizes)}")
    previous = state.take(key, sizes, buffer)
    grad = buffer.detach().clone()          # DDP reuses the bucket's buffer in the next iteration
    job = state.executor.submit(state.reduce, grad, key, sizes)
    for name, start, n in zip(key, np.cumsum((0,) + sizes[:-1]).tolist(), sizes):
        state.pending[name] = (job, start, n)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(previous)
    return fut


def _post_local_sgd_optimizer():
    # torch.distributed.optim scripts its functional optimizers on import (deprecation warnings): only
    # import it when PostLocalSGDOptimizer is used.
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer

    class PostLocalSGDOptimizer(TorchPostLocalSGDOptimizer):
        """torch's PostLocalSGDOptimizer (the local optimizer's step, then the averager's), whose state
        dict also holds the averager's whole state (its anchor, not only its step counter)."""

        def state_dict(self):
            out = super().state_dict()
            if hasattr(self.averager, "state_dict"):
                out["averager"] = self.averager.state_dict()
            return out

        def load_state_dict(self, state_dict):
            state_dict = dict(state_dict)
            averager = state_dict.pop("averager", None)
            super().load_state_dict(state_dict)
            if averager is not None:
                self.averager.load_state_dict(averager)

    PostLocalSGDOptimizer.__module__ = __name__
    return PostLocalSGDOptimizer


def __getattr__(name):
    if name == "PostLocalSGDOptimizer":
        cls = globals()["PostLocalSGDOptimizer"] = _post_local_sgd_optimizer()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
