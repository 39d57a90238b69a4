"""Quantisers. ZeroSum carries int32 fixed point with one exponent per block, so a quantiser's few bits
per element do not shrink the payload of a block that is sent; what they save on ZeroSum's wire are the
blocks that quantise to all zeros. The sum of the workers' quantised values is exact up to the
fixed-point rounding (see docs/protocol.md), so unbiasedness carries over to the aggregate."""
from __future__ import annotations

import numpy as np

from .base import Compressor, WithErrorFeedback, block_rows


class QSGD(Compressor):
    """QSGD with s levels per bucket (Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD", NeurIPS 2017):
    Section 3.1, eq. (4): Q_s(v_i) = ||v||_2 · sgn(v_i) · ξ_i(v, s), with ξ_i = (ℓ+1)/s with probability
    p = |v_i| s / ||v||_2 − ℓ and ℓ/s otherwise (ℓ = floor(|v_i| s / ||v||_2)); Q_s(0) = 0.
    Lemma 3.1: unbiased, E||Q_s(v) − v||² ≤ min(n/s², √n/s)·||v||². Section 4 ("QSGD Variants")
    quantises buckets of d consecutive values independently, the bound then holding with d for n:
    here a bucket is a ZeroSum block, so ω = min(d/s², √d/s) with d = block_size. (Section 4's other
    variant, scaling by the bucket's max instead of its 2-norm, is not used.) The same formula is in
    the reference code of Stich et al., epfml/sparsifiedSGD qsgd.py."""

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
    """TernGrad (Wen, Xu, Yan, Wu, Wang, Chen, Li, NeurIPS 2017): clip at c·σ (c = 2.5), then
    g̃ = s · sign(g) ∘ b with b_i ~ Bernoulli(|g_i| / s), s = max |g|: unbiased for the clipped gradient.

    Checked against the authors' code (wenwei202/terngrad, terngrad/inception/bingrad_common.py):
    `clip_gradients_by_stddev` clips each tensor to ±c·σ with σ its standard deviation about its mean
    (as here) and c = 2.5 by default; `stochastical_binarize_gradients` sends sign·scaler where
    uniform(0, scaler) < |g| (as here). Two differences, both keeping E[g̃] = clipped g: with clipping
    on, that code uses scaler = c·σ, here s = max|clipped g| = min(max|g|, c·σ) (never larger, so a
    lower variance); and it shares the scaler over workers (a max), here each worker keeps its own,
    because ZeroSum only sums. The authors' poster and slides (same repository) give the paper's
    formulas: g̃ = s·sign(g)∘b, s = ||g||_∞, P(b_k = 1) = |g_k|/s, clipping to ±cσ with "c = 2.5 works
    well"; the paper's equation numbers could not be checked (its text was not found). As in the
    paper's layer-wise ternarizing, σ and s are per tensor (per key), not over the whole model."""

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


class SignEF(WithErrorFeedback):
    """Scaled sign with error feedback (EF-SignSGD, Karimireddy, Rebjock, Stich, Jaggi, "Error feedback
    fixes SignSGD and other gradient compression schemes", ICML 2019): p = γ g + e;
    Δ = (||p||_1 / d) sign(p); e ← p − Δ. As for top-k (see base.ErrorFeedback), the memory is
    kept in units of the current step γ (scaled sign is positively homogeneous), and `set_lr(γ)`
    rescales it when γ changes. Checked against the authors' code (epfml/error-feedback-SGD,
    optimizers/ErrorFeedbackSGD.py: `scaled_sign(x) = x.norm(p=1) / x.nelement() * sign(x)`, memory =
    memory + γg − Δ), which applies the scale per parameter tensor; here it is per block (d = the
    block's length), the block-wise form of 1-bit SGD's per-column reconstruction (Seide et al. 2014),
    so that blocks stay whole for ZeroSum. The paper's text was not found, so its algorithm number is
    not cited (docs/compression-sources.md)."""

    def __init__(self, block_size: int = 256):
        super().__init__()
        self.block_size = block_size

    @property
    def memory(self) -> dict:
        return self.ef.memory

    def compress(self, grad, key="default"):
        g = np.asarray(grad, np.float32)
        p = self.ef.corrected(g, key)
        rows, n = block_rows(p, self.block_size)
        counts = np.full(len(rows), self.block_size, np.float32)
        if n % self.block_size:
            counts[-1] = n % self.block_size
        scale = (np.abs(rows).sum(axis=1) / counts)[:, None]
        delta = (scale * np.sign(rows)).reshape(-1)[:n].reshape(g.shape).astype(np.float32)
        self.ef.remember(p, delta, key)
        return delta
