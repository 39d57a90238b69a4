"""How the examples exchange gradients: one name per scheme, so one run can train the same model with
several side by side (`--schemes local,gloo,zerosum,topk:0.01,localsgd:8`).

    local            no exchange: each rank steps on its own gradients (the step time without
                     communication; not a training scheme, the floor the others are measured against)
    gloo             DDP's own allreduce (gloo's ring)
    zerosum          DDP with ZeroSum's hook, every step (zerosum.torch.register)
    hybrid           the same hook choosing per bucket between ZeroSum and gloo's ring, whichever is
                     faster at the bucket's density (register(..., paths="auto"); zerosum.hybrid)
    topk:D           ZeroSum + top-k blocks with error feedback, density D (TopKBlocks)
    tracked[:S[:D]]  ZeroSum + top-k blocks with error feedback, k per bucket tracked online by the
                     measured decrease of log ||result||² per bit, segments of S first steps' bits
                     (default 4), starting dense or from density D (a level chosen before training,
                     e.g. 0.01; TrackedTopKBlocks, a LevelTracker per bucket)
    dgc:D[:M]        ZeroSum + deep gradient compression, final density D (DGC, its warm-up schedule),
                     momentum correction M (default 0.9, the paper's); M = 0 leaves the momentum to
                     an optimiser that has its own (Adam's first moment), so that it is not applied twice
    qsgd:S           ZeroSum + QSGD with S levels (QSGD)
    terngrad         ZeroSum + TernGrad (TernGrad)
    efsign           ZeroSum + scaled sign with error feedback (SignEF)
    diana:T          ZeroSum + DIANA over random-k blocks, T = blocks kept per worker as a share of
                     1/world (RandomKBlocks inside DIANA; T = 1: tau = ceil(m / world), the paper's)
    localsgd:H[:W]   post-local SGD: W warm-up steps averaging gradients every step (default W = 0),
                     then each rank steps alone and the model is averaged every H steps
                     (zerosum.sync.PostLocalSGDState + PeriodicModelAverager)
    delayed          one-step delayed gradients: step t applies step t-1's average
                     (zerosum.sync.delayed_gradient_hook)

Every scheme but local and gloo uses the rank's one zerosum.Worker; a scheme's bytes are the worker's
counters over the timed steps. `Scheme.attach` returns what the training loop needs: the DDP model,
and a callback after each optimizer step (the averager's).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import zerosum.torch as zt

COMPRESSORS = ("topk", "tracked", "dgc", "qsgd", "terngrad", "efsign", "diana")
NAMES = ("local", "gloo", "zerosum", "hybrid", *COMPRESSORS, "localsgd", "delayed")


@dataclass
class Attached:
    """A scheme set up for one training run."""
    model: torch.nn.Module
    after_step: callable = lambda params: None
    closers: list = field(default_factory=list)
    paths: object = None        # the hook's zerosum.hybrid.PathChoice (scheme hybrid)
    compressor: object = None   # the hook's compressor (None: the plain sum, or no hook of zerosum.torch)
    failover: object = None     # the hook's zerosum.torch.Failover (scheme hybrid)

    def close(self) -> None:
        for close in self.closers:
            close()


@dataclass(frozen=True)
class Scheme:
    """A parsed scheme name (see the module docstring)."""
    text: str
    kind: str
    args: tuple = ()

    @property
    def uses_zerosum(self) -> bool:
        return self.kind not in ("local", "gloo")

    @property
    def carries_momentum(self) -> bool:
        """DGC's momentum correction is the momentum (Lin et al. 2018, eq. (7)): it runs with plain SGD
        where the other schemes run momentum SGD, so that every row trains with the same optimiser
        (not with dgc:D:0, which has no correction)."""
        return self.kind == "dgc" and (len(self.args) < 2 or self.args[1] > 0)

    def density(self, world: int) -> float | None:
        """The share of blocks a worker keeps under a sparsifier (topk, dgc; diana's random-k: about
        share / world), None for the other schemes (tracked: chosen during the run)."""
        if self.kind in ("topk", "dgc"):
            return self.args[0]
        if self.kind == "diana":
            return min(1.0, self.args[0] / world)
        return None

    def compressor(self, world: int, rank: int, seed: int):
        """The scheme's zerosum.compression.Compressor (None for the plain sum)."""
        from zerosum import compression as C
        a = self.args
        if self.kind == "topk":
            return C.TopKBlocks(density=a[0])
        if self.kind == "tracked":
            return C.TrackedTopKBlocks(**dict(zip(("segment_steps", "start_density"), a)))
        if self.kind == "dgc":
            # dgc:D:M sets the correction; without M, DGC's own default (the paper's 0.9)
            return C.DGC(density=a[0], world=world, seed=seed, **({"momentum": a[1]} if len(a) > 1 else {}))
        if self.kind == "qsgd":
            return C.QSGD(levels=int(a[0]), seed=seed, rank=rank)
        if self.kind == "terngrad":
            return C.TernGrad(seed=seed, rank=rank)
        if self.kind == "efsign":
            return C.SignEF()
        if self.kind == "diana":
            return _diana(world, rank, seed, a[0], self.density(world))
        return None

    def attach(self, initial: torch.nn.Module, worker, world: int, rank: int, seed: int,
               bucket_mb: float, bucket_view: bool) -> Attached:
        """A DDP copy of `initial` that exchanges its gradients by this scheme."""
        model = DDP(copy.deepcopy(initial), bucket_cap_mb=bucket_mb, gradient_as_bucket_view=bucket_view)
        if self.kind == "local":
            model.register_comm_hook(None, _no_communication)
            return Attached(model)
        if self.kind == "gloo":
            return Attached(model)
        if self.kind == "localsgd":
            from zerosum import sync
            period, warmup = int(self.args[0]), int(self.args[1]) if len(self.args) > 1 else 0
            state = sync.PostLocalSGDState(worker, start_localSGD_iter=warmup, model=model)
            model.register_comm_hook(state, sync.post_localSGD_hook)
            averager = sync.PeriodicModelAverager(period=period, warmup_steps=warmup, worker=worker)
            return Attached(model, averager.average_parameters, [state.close])
        if self.kind == "delayed":
            from zerosum import sync
            state = sync.DelayedGradientState(worker, model=model)
            model.register_comm_hook(state, sync.delayed_gradient_hook)
            return Attached(model, closers=[state.flush, state.close])
        state = zt.register(model, worker, self.compressor(world, rank, seed),
                            paths="auto" if self.kind == "hybrid" else "zerosum")
        return Attached(model, closers=[state.close], paths=state.paths, failover=state.failover,
                        compressor=state.compressor)


def _diana(world, rank, seed, share, kept):
    from zerosum import compression as C

    class _Tau(C.RandomKBlocks):
        """tau = share * ceil(m / world) blocks (at least one), decided per tensor."""
        def compress(self, grad, key="default"):
            import numpy as np
            m = -(-np.asarray(grad).size // self.block_size)
            self.tau = max(1, round(share * -(-m // world)))
            return super().compress(grad, key)

    inner = _Tau(world, seed=seed, rank=rank)
    # omega of rand-k scaled by m/tau: m/tau - 1; it depends on m, so alpha is fixed from the share
    # kept: alpha = 1/(1+omega) = tau/m ~ share/world.
    return C.DIANA(inner, alpha=kept)


def _no_communication(state, bucket):
    """A DDP hook that keeps the local gradient: measures the step without any allreduce."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


_ARITY = {"topk": (1, 1), "tracked": (0, 2), "dgc": (1, 2), "qsgd": (1, 1), "diana": (1, 1), "localsgd": (1, 2)}


def parse(text: str) -> Scheme:
    """'topk:0.01' -> Scheme('topk:0.01', 'topk', (0.01,)); a clear error for anything else."""
    kind, *raw = text.strip().split(":")
    if kind not in NAMES:
        raise ValueError(f"unknown scheme {text!r}: choose from {', '.join(NAMES)} (see zerosum.examples.schemes)")
    low, high = _ARITY.get(kind, (0, 0))
    if not low <= len(raw) <= high:
        raise ValueError(f"scheme {text!r}: {kind} takes {low}" + (f" to {high}" if high > low else "") +
                         " argument(s) after ':'")
    try:
        args = tuple(float(v) for v in raw)
    except ValueError:
        raise ValueError(f"scheme {text!r}: arguments must be numbers") from None
    if kind in ("topk", "dgc") and not 0 < args[0] <= 1:
        raise ValueError(f"scheme {text!r}: the density must be in (0, 1]")
    if kind in ("qsgd", "localsgd") and (args[0] < 1 or args[0] != int(args[0])):
        raise ValueError(f"scheme {text!r}: {'levels' if kind == 'qsgd' else 'the period'} must be a positive integer")
    if kind == "localsgd" and len(args) > 1 and (args[1] < 0 or args[1] != int(args[1])):
        raise ValueError(f"scheme {text!r}: the warm-up must be a non-negative integer")
    if kind == "dgc" and len(args) > 1 and not 0 <= args[1] < 1:
        raise ValueError(f"scheme {text!r}: the momentum correction must be in [0, 1)")
    if kind == "diana" and args[0] <= 0:
        raise ValueError(f"scheme {text!r}: the share must be positive")
    if kind == "tracked" and args and not args[0] > 0:
        raise ValueError(f"scheme {text!r}: the segment (in first steps' bits) must be positive")
    if kind == "tracked" and len(args) > 1 and not 0 < args[1] <= 1:
        raise ValueError(f"scheme {text!r}: the starting density must be in (0, 1]")
    return Scheme(text.strip(), kind, args)


def parse_list(text: str) -> list[Scheme]:
    """A comma-separated list of schemes, each once."""
    schemes = [parse(t) for t in text.split(",") if t.strip()]
    if not schemes:
        raise ValueError("no scheme given")
    names = [s.text for s in schemes]
    if len(set(names)) != len(names):
        raise ValueError(f"a scheme is listed twice: {text!r}")
    return schemes
