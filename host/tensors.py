"""torch tensors in `Worker.allreduce`: CPU tensors share memory with numpy; on other devices (CUDA)
block detection, gathering and quantisation run on the device and only the non-zero blocks, as int32,
visit host memory.

Quantisation is lazy: the agreed exponent of a block (the maximum over the workers that have it) is
only known while its column streams, so the worker state machine asks `DeviceBlocks.quantized` for
the blocks of each datagram it builds. Scaling by a power of two and rounding half to even give the
same integers on every device as numpy's path, so results stay bit-identical across workers.
"""
from __future__ import annotations

import sys

import numpy as np

from .blocks import CollectedBlocks, SparseBlocks, block_count
from .fixedpoint import block_exponents, precision_bits, scale_factors
from .protocol import INT_EXP


class DeviceBlocks:
    """The non-zero blocks of a tensor, kept on its device (what the worker state machine reads)."""

    def __init__(self, blocks: np.ndarray, compact, nblocks: int, block_size: int):
        self.blocks = blocks              # sorted block indices (host)
        self.compact = compact            # their rows on the device, (len(blocks), block_size)
        self.nblocks = nblocks
        self.block_size = block_size
        self.is_int = str(compact.dtype) == "torch.int32"

    def _index(self, blocks: np.ndarray):
        import torch
        pos = np.searchsorted(self.blocks, blocks)
        return torch.from_numpy(pos).to(self.compact.device)

    def rows(self, blocks: np.ndarray) -> np.ndarray:
        return self.compact.index_select(0, self._index(blocks)).cpu().numpy()

    def quantized(self, blocks: np.ndarray, exps: np.ndarray, world: int) -> np.ndarray:
        """int32 rows of `blocks` scaled by 2**(p - exp) and rounded half to even, on the device."""
        import torch
        rows = self.compact.index_select(0, self._index(blocks))
        for factor in scale_factors(precision_bits(world) - exps.astype(np.int64)):
            rows = rows * torch.from_numpy(factor).to(rows.device)[:, None]
        out = torch.round(rows).to(torch.int32)
        return (out.cpu().pin_memory() if out.is_cuda else out.cpu()).numpy()



def is_tensor(x) -> bool:
    # torch is optional and heavy to import: if the caller has not imported it, x is no tensor
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def check_dtype(t) -> None:
    import torch
    if t.dtype not in (torch.float32, torch.int32):
        raise TypeError(f"allreduce supports float32 and int32 tensors, not {t.dtype}")


def gather_nonzero(t, block_size: int):
    """Detect and gather the non-zero blocks of `t` on its device.

    Returns (DeviceBlocks, SparseBlocks over all blocks on the host). Raises ValueError on NaN/inf.
    """
    import torch
    check_dtype(t)
    flat = t.detach().reshape(-1)
    n = flat.numel()
    nblocks = block_count(n, block_size)
    pad = nblocks * block_size - n
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    rows = flat.view(nblocks, block_size)
    is_int = t.dtype == torch.int32
    if is_int:
        live = (rows != 0).any(dim=1)
    else:
        maxabs = rows.abs().amax(dim=1) if nblocks else torch.zeros(0, device=t.device)
        bad = ~torch.isfinite(maxabs)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"tensor has NaN or infinite values (first in block {b}, elements "
                             f"{b * block_size}..{(b + 1) * block_size - 1}); "
                             f"fixed-point aggregation cannot carry them")
        live = maxabs > 0
    idx = live.nonzero().squeeze(1)
    compact = rows.index_select(0, idx)
    blocks = idx.cpu().numpy().astype(np.int64)
    nonzero = np.zeros(nblocks, bool)
    nonzero[blocks] = True
    exps = np.full(nblocks, INT_EXP if is_int else -32768, np.int32)
    if not is_int and len(blocks):
        exps[blocks] = block_exponents(maxabs.index_select(0, idx).cpu().numpy())
    return DeviceBlocks(blocks, compact, nblocks, block_size), SparseBlocks(nonzero, exps)


def scatter_result(t, sink: CollectedBlocks, block_size: int, out=None):
    """Write the collected sums into `out` (or a new zero tensor) on t's device."""
    import torch
    blocks, rows = sink.collected(block_size)
    n = t.numel()
    nblocks = block_count(n, block_size)
    if out is None:
        result = torch.zeros_like(t, memory_format=torch.contiguous_format)
    else:
        result = out
        if out.data_ptr() != t.data_ptr():
            result.zero_()
    if len(blocks) == 0:
        return result
    padded = torch.zeros(nblocks * block_size, dtype=t.dtype, device=t.device) \
        if n % block_size else None
    target = padded if padded is not None else result.view(-1)
    src = torch.from_numpy(rows).to(t.device, non_blocking=True)
    target.view(nblocks, block_size).index_copy_(0, torch.from_numpy(blocks).to(t.device), src)
    if padded is not None:
        # only the written blocks may change: blocks nobody sent keep the zeros `result` has there
        mask = torch.zeros(nblocks, dtype=torch.bool, device=t.device)
        mask[torch.from_numpy(blocks).to(t.device)] = True
        full = mask.repeat_interleave(block_size)[:n]
        result.view(-1)[full] = padded[:n][full]
    return result
