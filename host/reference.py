"""The result an allreduce must produce, computed directly with numpy (for tests and the benchmark).

Fixed point makes the sum exact to define: every block is quantised with the exponent agreed over the
workers that have it non-zero, the integers are summed, and the sum is scaled back.
"""
from __future__ import annotations

import numpy as np

from .blocks import BlockView, find_nonzero_blocks
from .fixedpoint import dequantize, quantize
from .protocol import NO_EXP


def reference_allreduce(arrays: list[np.ndarray], block_size: int = 256) -> np.ndarray:
    flats = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    if flats[0].dtype == np.int32:
        return np.sum(np.stack(flats), axis=0, dtype=np.int64).astype(np.int32).reshape(arrays[0].shape)
    world = len(arrays)
    views = [BlockView(f, block_size) for f in flats]
    sparse = [find_nonzero_blocks(v) for v in views]
    nblocks = views[0].nblocks
    agreed = np.full(nblocks, NO_EXP, np.int64)
    for sp in sparse:
        agreed = np.maximum(agreed, np.where(sp.nonzero, sp.exponents, NO_EXP))
    total = np.zeros((nblocks, block_size), np.int32)
    for v, sp in zip(views, sparse):
        idx = np.flatnonzero(sp.nonzero)
        total[idx] += quantize(v.rows(idx), agreed[idx], world)
    out = np.zeros((nblocks, block_size), np.float32)
    live = np.flatnonzero(agreed != NO_EXP)
    out[live] = dequantize(total[live], agreed[live], world)
    n = flats[0].size
    return out.reshape(-1)[:n].reshape(arrays[0].shape)
