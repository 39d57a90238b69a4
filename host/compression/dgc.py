"""Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018)."""
from __future__ import annotations

import numpy as np

from .base import Compressor, block_rows

WARMUP = (0.25, 0.0625, 0.015625, 0.004, 0.001)   # Section 3.3: exponential density warm-up per epoch


class DGC(Compressor):
    """Momentum correction (u ← m·u + g, v ← v + u; Section 3.2, eq. (6)), momentum factor masking
    (u and v cleared where sent), local gradient clipping (Section 3.2: per-worker norm bound scaled
    by N^(-1/2)), a threshold from a 1% sample (Section 4), and the density warm-up. Use it with plain
    SGD: the momentum is inside. blockwise=True selects whole blocks by norm, so ZeroSum skips the rest.

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

    @property
    def density(self) -> float:
        return self.warmup[self.epoch] if self.epoch < len(self.warmup) else self.final

    def _threshold(self, score: np.ndarray, density: float) -> float:
        sample = score if score.size <= 1000 else self.rng.choice(score, max(1000, int(score.size * self.sample)))
        return float(np.quantile(sample, 1 - density))

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
            keep = score >= self._threshold(score, self.density)
            mask = np.repeat(keep, self.block_size)[:n].reshape(g.shape)
        else:
            mask = np.abs(v) >= self._threshold(np.abs(v).reshape(-1), self.density)
        sent = np.where(mask, v, 0).astype(np.float32)
        self.v[key] = np.where(mask, 0, v).astype(np.float32)
        self.u[key] = np.where(mask, 0, u).astype(np.float32)
        return sent
