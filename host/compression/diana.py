"""DIANA (Mishchenko, Gorbunov, Takáč, Richtárik, "Distributed learning with compressed gradient
differences", arXiv:1901.09269, 2019): compress differences to learned shifts, so the compression error
vanishes at the optimum and the method converges linearly under strong convexity.

Not checked against the paper's text, which was not found (docs/compression-sources.md), so no
algorithm or equation number is cited; the update below is issue 6's, and it agrees with the DIANA
class of the authors' group's federated-learning code (burlachenkok/flpytorch,
fl_pytorch/utils/algorithms.py). With RandomKBlocks inside and α = 1/(1+ω) it is the "99%" paper's
ISEGA, Algorithm 3, eqs. (9)-(10) (see RandomKBlocks)."""
from __future__ import annotations

import numpy as np

from .base import Compressor


class DIANA(Compressor):
    """Worker i sends Δ_i = C(g_i − h_i) and updates h_i ← h_i + α Δ_i; the aggregate side computes
    ĝ = h + mean_i Δ_i and h ← h + α mean_i Δ_i, with α = 1/(1+ω) (ω: the inner compressor's variance
    factor). With ZeroSum every worker receives the same sum, so every worker keeps the same h itself.
    `inner` must be unbiased (RandomKBlocks, QSGD, TernGrad). α = 1/(1+ω) is the value issue 6 asks
    for; the paper's admissible range for α and its step-size conditions were not verified."""

    def __init__(self, inner: Compressor, omega: float | None = None, alpha: float | None = None):
        self.inner = inner
        omega = omega if omega is not None else getattr(inner, "omega", None)
        if alpha is None:
            if omega is None:
                raise ValueError("give omega (the inner compressor's variance factor) or alpha")
            alpha = 1.0 / (1.0 + omega)
        self.alpha = np.float32(alpha)
        self.h_local: dict = {}
        self.h: dict = {}

    def keyed_state(self) -> list[dict]:
        return [self.h_local, self.h] + self.inner.keyed_state()

    def compress(self, grad, key="default"):
        g = np.asarray(grad, np.float32)
        h_i = self.h_local.get(key, np.zeros_like(g))
        delta = self.inner.compress(g - h_i, key)
        self.h_local[key] = h_i + self.alpha * delta
        return delta

    def decompress(self, summed, world, key="default"):
        mean = np.asarray(summed, np.float32) / np.float32(world)
        h = self.h.get(key, np.zeros_like(mean))
        self.h[key] = h + self.alpha * mean
        return h + mean
