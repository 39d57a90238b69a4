"""Quantisers. ZeroSum carries int32 fixed point with one exponent per block, so a quantiser's few bits
per element do not shrink the payload of a block that is sent; what they save on ZeroSum's wire are the
blocks that quantise to all zeros. The sum of the workers' quantised values is exact up to the
fixed-point rounding (see docs/protocol.md), so unbiasedness carries over to the aggregate."""
from __future__ import annotations

import numpy as np

from .base import Compressor, block_rows


class QSGD(Compressor):
    """QSGD with s levels per bucket (Alistarh et al., "QSGD", NeurIPS 2017, Section 3.1):
    Q_s(v)_i = ||v||_2 · sign(v_i) · ξ_i, with ξ_i = (l+1)/s with probability |v_i|s/||v|| − l and l/s
    otherwise (l = floor(|v_i| s / ||v||)); unbiased with variance factor ω = min(d/s², √d/s) per bucket
    of d values (Lemma 3.1). Buckets are ZeroSum blocks."""

    def __init__(self, levels: int = 4, seed: int = 0, rank: int = 0, block_size: int = 256):
        self.s, self.block_size = levels, block_size
        self.rng = np.random.default_rng([seed, rank])
        d = block_size
        self.omega = min(d / levels**2, np.sqrt(d) / levels)

    def compress(self, grad, key="default"):
        grad = np.asarray(grad, np.float32)
        rows, n = block_rows(grad, self.block_size)
        norm = np.sqrt(np.einsum("ij,ij->i", rows, rows))[:, None]
        safe = np.where(norm > 0, norm, 1)
        r = np.abs(rows) / safe * self.s
        low = np.floor(r)
        xi = (low + (self.rng.random(rows.shape) < (r - low))) / self.s
        out = (norm * np.sign(rows) * xi).astype(np.float32)
        return out.reshape(-1)[:n].reshape(grad.shape)


class TernGrad(Compressor):
    """TernGrad (Wen et al., NeurIPS 2017, eq. (5) and Section 3.3): clip at c·σ (c = 2.5), then
    g̃ = s · sign(g) ∘ b with b_i ~ Bernoulli(|g_i| / s), s = max |g|: unbiased for the clipped gradient.
    The paper shares s over workers (a max); ZeroSum only sums, so each worker uses its own s, which
    keeps every contribution unbiased (the sum of unbiased terms)."""

    def __init__(self, clip: float = 2.5, seed: int = 0, rank: int = 0):
        self.clip = clip
        self.rng = np.random.default_rng([seed, rank])

    def compress(self, grad, key="default"):
        g = np.asarray(grad, np.float32)
        if self.clip:
            bound = np.float32(self.clip * g.std())
            if bound > 0:
                g = np.clip(g, -bound, bound)
        s = np.float32(np.abs(g).max()) if g.size else np.float32(0)
        if s == 0:
            return np.zeros_like(g)
        b = self.rng.random(g.shape) < (np.abs(g) / s)
        return (s * np.sign(g) * b).astype(np.float32)


class SignEF(Compressor):
    """Sign compression with error feedback (Karimireddy et al., "Error feedback fixes SignSGD",
    ICML 2019, Algorithm 1: p = e + g; δ = (||p||_1 / d) sign(p); e ← p − δ), with the scale per block
    (the block-wise variant, like 1-bit SGD's per-column reconstruction values, Seide et al. 2014)."""

    def __init__(self, block_size: int = 256):
        self.block_size = block_size
        self.memory: dict = {}

    def compress(self, grad, key="default"):
        g = np.asarray(grad, np.float32)
        p = g + self.memory[key] if key in self.memory else g.copy()
        rows, n = block_rows(p, self.block_size)
        counts = np.full(len(rows), self.block_size, np.float32)
        if n % self.block_size:
            counts[-1] = n % self.block_size
        scale = (np.abs(rows).sum(axis=1) / counts)[:, None]
        delta = (scale * np.sign(rows)).reshape(-1)[:n].reshape(g.shape).astype(np.float32)
        self.memory[key] = p - delta
        return delta
