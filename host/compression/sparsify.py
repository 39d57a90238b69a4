"""Sparsifiers that zero whole blocks (so ZeroSum skips them), and element-wise top-k for comparison."""
from __future__ import annotations

import numpy as np

from .base import Compressor, TopK, block_rows


class TopKBlocks(TopK):
    """Keep the k blocks of largest L2 norm (k = density × blocks, at least 1), with error feedback.

    The block-wise form of top_k (Stich et al. 2018, Definition 2.2, defined there per coordinate)
    inside MEM-SGD (their Algorithm 1, see `ErrorFeedback`). Call `set_lr(η_t)` before `compress`
    when the step size changes during training.
    """

    def __init__(self, density: float = 0.01, error_feedback: bool = True, block_size: int = 256):
        super().__init__(density, error_feedback)
        self.block_size = block_size

    def k_for(self, nblocks: int) -> int:
        return max(1, int(round(self.density * nblocks)))

    def select(self, rows: np.ndarray, k: int) -> np.ndarray:
        norms = np.einsum("ij,ij->i", rows, rows)
        if k >= len(rows):
            return np.arange(len(rows))
        return np.argpartition(norms, len(rows) - k)[len(rows) - k:]

    def choose_k(self, rows: np.ndarray, key="default") -> int:
        """How many of these (blocks, block_size) rows of `key`'s corrected gradient to keep."""
        return self.k_for(len(rows))

    def compress(self, grad, key="default"):
        grad = np.asarray(grad, np.float32)
        x = self.ef.corrected(grad, key) if self.ef else grad
        rows, n = block_rows(x, self.block_size)
        keep = self.select(rows, self.choose_k(rows, key))
        out = np.zeros_like(rows)
        out[keep] = rows[keep]
        sent = out.reshape(-1)[:n].reshape(grad.shape)
        if self.ef:
            self.ef.remember(x, sent, key)
        return sent


class TopKElements(TopK):
    """Element-wise top-k (by magnitude) with error feedback: for comparison. Its non-zeros scatter
    over many blocks, so on ZeroSum's wire it costs far more than its density suggests.

    top_k as in Stich et al. 2018, Definition 2.2, with the memory of their Algorithm 1 (the
    reference code epfml/sparsifiedSGD memory.py does the same: m += η g; send m[top k]; m[top k] = 0).
    """

    def compress(self, grad, key="default"):
        grad = np.asarray(grad, np.float32)
        x = self.ef.corrected(grad, key) if self.ef else grad
        flat = x.reshape(-1)
        k = max(1, int(round(self.density * flat.size)))
        keep = np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]
        sent = np.zeros_like(flat)
        sent[keep] = flat[keep]
        sent = sent.reshape(grad.shape)
        if self.ef:
            self.ef.remember(x, sent, key)
        return sent


class RandomKBlocks(Compressor):
    """Independent block sparsification (Mishchenko, Hanzely, Richtárik, "99% of worker-master
    communication in distributed optimization is not needed", UAI 2020, PMLR 124): each of the n
    workers keeps τ of the m blocks, chosen uniformly and independently of the other workers
    (Algorithm 1, line 4), scaled by m/τ so that E[contribution] = gradient. The paper's τ is the
    fraction τ/m here; τ defaults to ceil(m/n), its τ = 1/n (Corollaries 1-3). The scaling is the
    paper's unbiased estimator of ISEGA, eq. (10), g = h + (1/τ)(∇f_i − h)_U, with h = 0 (its IBCD and
    ISAGA, Algorithms 1 and 2, apply the sampled blocks unscaled inside a step size of their own);
    also Stich et al. 2018, eq. (6), (d/k)·rand_k. Inside DIANA with α = 1/(1+ω) = τ/m, this is ISEGA
    exactly: h ← h + (∇f_i − h)_U, eq. (9) (tests/test_compression.py)."""

    def __init__(self, world: int, tau: int | None = None, seed: int = 0, rank: int = 0, block_size: int = 256):
        self.world, self.tau, self.block_size = world, tau, block_size
        self.rng = np.random.default_rng([seed, rank])

    def compress(self, grad, key="default"):
        grad = np.asarray(grad, np.float32)
        rows, n = block_rows(grad, self.block_size)
        m = len(rows)
        tau = min(m, self.tau or -(-m // self.world))
        keep = self.rng.choice(m, size=tau, replace=False)
        out = np.zeros_like(rows)
        out[keep] = rows[keep] * np.float32(m / tau)
        return out.reshape(-1)[:n].reshape(grad.shape)
