"""torch tensors in `Worker.allreduce`: CPU tensors share memory with numpy; on other devices (CUDA)
block detection and gathering run on the device and only the non-zero blocks visit host memory.

Quantisation to int32 happens on the host for those gathered blocks: the agreed exponent of a block
(the maximum over the workers that have it) is only known while the column streams, and quantising
with it is what makes the result independent of who sent what first.
"""
from __future__ import annotations

import sys

import numpy as np

from .blocks import CollectedBlocks, CompactBlocks, SparseBlocks, block_count
from .fixedpoint import block_exponents
from .protocol import INT_EXP



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

    Returns (CompactBlocks on the host, SparseBlocks over all blocks). Raises ValueError on NaN/inf.
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
    pin = compact.is_cuda
    host_rows = compact.to("cpu", non_blocking=False) if not pin else compact.cpu().pin_memory()
    blocks = idx.cpu().numpy().astype(np.int64)
    nonzero = np.zeros(nblocks, bool)
    nonzero[blocks] = True
    exps = np.full(nblocks, INT_EXP if is_int else -32768, np.int32)
    if not is_int and len(blocks):
        exps[blocks] = block_exponents(maxabs.index_select(0, idx).cpu().numpy())
    view = CompactBlocks(blocks, host_rows.numpy(), nblocks, block_size)
    return view, SparseBlocks(nonzero, exps)


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
