"""Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018)."""
from __future__ import annotations

import numpy as np

from .base import Compressor, block_rows

WARMUP = (0.25, 0.0625, 0.015625, 0.004, 0.001)   # Section 4.1: the warm-up sparsities 75% … 99.9%
OVERSHOOT = 1.3     # refine the sampled threshold when it selects more than this many times k


class DGC(Compressor):
    """Deep Gradient Compression, with the section numbers of the paper (arXiv:1712.01887):

    - momentum correction, Section 3.2, eq. (7): u ← m·u + g; v ← v + u; send sparse(v);
    - local gradient clipping, Section 3.2: clip the gradient by its L2 norm *before* it is added to
      the accumulation, with the threshold scaled by N^(-1/2) (N = `world`);
    - momentum factor masking, Section 3.3: the same mask clears both v and u where sent;
    - warm-up, Section 3.3 and Section 4.1: density 25%, 6.25%, 1.5625%, 0.4%, 0.1% (sparsity 75%,
      93.75%, 98.4375%, 99.6%, 99.9%), "exponentially increase till 99.9%"; the warm-up densities
      never go below the final `density` (the schedule ramps *to* the final value);
    - threshold from a sample, Section 5: top-k on a 0.1–1% sample gives the threshold; "if the number
      of gradients exceeding the threshold is far more than expected, a precise threshold is
      calculated from the already-selected gradients" (here: more than 1.3·k, the bound the reference
      code synxlin/deep-gradient-compression dgc/compression.py uses, then exact top-k of those).

    Use it with plain SGD: the momentum is inside (eq. (7) applies η to the sum of sparse(v)).
    blockwise=True selects whole blocks by norm, so ZeroSum skips the rest. The paper's mask is
    |v| > thr; here it is ≥ thr so that ties at the threshold are still sent.

    Call `set_epoch(e)` to follow the warm-up; `density` is the final density.
    """

    def __init__(self, density: float = 0.001, momentum: float = 0.9, clip_norm: float | None = None,
                 world: int = 1, warmup=WARMUP, blockwise: bool = True, sample: float = 0.01, seed: int = 0,
                 block_size: int = 256):
        self.final, self.m, self.world, self.warmup = density, momentum, world, tuple(warmup)
        self.clip_norm, self.blockwise, self.sample, self.block_size = clip_norm, blockwise, sample, block_size
        self.rng = np.random.default_rng(seed)
        self.u: dict = {}
        self.v: dict = {}
        self.epoch = len(self.warmup)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def keyed_state(self) -> list[dict]:
        return [self.u, self.v]

    @property
    def density(self) -> float:
        if self.epoch < len(self.warmup):
            return max(self.warmup[self.epoch], self.final)
        return self.final

    def _threshold(self, score: np.ndarray, density: float) -> float:
        sample = score if score.size <= 1000 else self.rng.choice(score, max(1000, int(score.size * self.sample)))
        return float(np.quantile(sample, 1 - density))

    def _select(self, score: np.ndarray, density: float) -> np.ndarray:
        """Boolean mask over `score`: at or above the sampled threshold, refined to the exact top k
        when the sample's threshold lets through far more than expected (Section 5)."""
        k = max(1, int(np.ceil(density * score.size)))
        keep = score >= self._threshold(score, density)
        chosen = np.flatnonzero(keep)
        if len(chosen) > OVERSHOOT * k:
            top = chosen[np.argpartition(score[chosen], len(chosen) - k)[len(chosen) - k:]]
            keep = np.zeros_like(keep)
            keep[top] = True
        return keep

    def compress(self, grad, key="default"):
        g = np.asarray(grad, np.float32)
        if self.clip_norm:
            bound = self.clip_norm / np.sqrt(self.world)
            norm = float(np.linalg.norm(g))
            if norm > bound:
                g = g * np.float32(bound / norm)
        u = self.m * self.u.get(key, 0) + g
        v = self.v.get(key, 0) + u
        if self.blockwise:
            rows, n = block_rows(v, self.block_size)
            score = np.sqrt(np.einsum("ij,ij->i", rows, rows))
            keep = self._select(score, self.density)
            mask = np.repeat(keep, self.block_size)[:n].reshape(g.shape)
        else:
            mask = self._select(np.abs(v).reshape(-1), self.density).reshape(g.shape)
        sent = np.where(mask, v, 0).astype(np.float32)
        self.v[key] = np.where(mask, 0, v).astype(np.float32)
        self.u[key] = np.where(mask, 0, u).astype(np.float32)
        return sent
