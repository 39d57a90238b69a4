"""torch tensors in `Worker.allreduce`: CPU tensors share memory with numpy; on other devices (CUDA)
block detection and the gathering of non-zero blocks run on the device and only those blocks visit
host memory, where the compiled kernels quantise them as they are packed (the agreed exponent of a
block is only known while its column streams, so quantising on the device would cost a device round
trip per datagram); the sums are scattered back on the device. Sparse COO tensors are turned into
block-sparse input directly from their indices and values.

The blocks cross between device and host through a Staging the worker keeps: host memory reused from one
allreduce to the next, page-locked for CUDA tensors. A fresh host array per allreduce costs a page fault
per 4 KiB when it is first written, and a copy from pageable memory runs through the driver's own bounce
buffer: on an H100, one rank's dense 100 MB took 66 ms to the host and 37 ms back that way, 2.6 and 2.4 ms
through the staging (README "GPU workers").
"""
from __future__ import annotations

import sys

import numpy as np

from .blocks import KeptBuffers, block_count


def is_tensor(x) -> bool:
    # torch is optional and heavy to import: if the caller has not imported it, x is no tensor
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def check_dtype(t) -> None:
    import torch
    if t.dtype not in (torch.float32, torch.int32):
        raise TypeError(f"allreduce supports float32 and int32 tensors, not {t.dtype}")


def _host_bytes(nbytes: int, pinned: bool) -> np.ndarray:
    """nbytes of host memory as a uint8 array (which keeps its torch buffer alive), page-locked if
    `pinned` and the driver has any left (pageable is slower, not wrong)."""
    import torch
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    except RuntimeError:
        buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf.numpy()


class Staging:
    """Host buffers kept between allreduces, one per role ("in": the blocks sent, "out": the sums
    received, "out-blocks": their indices), each grown to the largest asked for and never shrunk
    (blocks.KeptBuffers); page-locked (pinned) for tensors on a CUDA device, so that copies to and from
    it run as DMA."""

    def __init__(self):
        self._kept = {pinned: KeptBuffers(lambda nbytes, pinned=pinned: _host_bytes(nbytes, pinned))
                      for pinned in (False, True)}

    def array(self, role: str, values: int, dtype, pinned: bool) -> np.ndarray:
        """The first `values` elements of `dtype` of the role's buffer (contents undefined; KeptBuffers)."""
        return self._kept[bool(pinned)].array(role, values, dtype)


def gather_nonzero(t, block_size: int, staging: Staging | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Detect and gather the non-zero blocks of `t` on its device; return (sorted block indices,
    their rows) on the host (in `staging`'s "in" buffer if given). Raises ValueError on NaN/inf."""
    import torch
    check_dtype(t)
    flat = t.detach().reshape(-1)
    n = flat.numel()
    nblocks = block_count(n, block_size)
    pad = nblocks * block_size - n
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    rows = flat.view(nblocks, block_size)
    if t.dtype == torch.int32:
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
    blocks = idx.cpu().numpy().astype(np.int64)
    if len(blocks) == nblocks:
        compact = rows                 # dense: no gathering copy on the device
    else:
        compact = rows.index_select(0, idx)
    if staging is None:
        return blocks, compact.cpu().numpy()
    host = staging.array("in", compact.numel(), np.float32 if t.dtype == torch.float32 else np.int32,
                         pinned=compact.is_cuda).reshape(len(blocks), block_size)
    torch.from_numpy(host).copy_(compact)
    return blocks, host


def scatter_result(t, blocks: np.ndarray, rows: np.ndarray, block_size: int, out=None):
    """Write summed blocks (in any order) into `out` (or a new zero tensor) on t's device."""
    import torch
    n = t.numel()
    nfull = n // block_size
    if out is None:
        result = torch.zeros_like(t, memory_format=torch.contiguous_format)
    else:
        result = out
        if out.data_ptr() != t.data_ptr():
            result.zero_()
    if len(blocks) == 0:
        return result
    # a blocking copy: `rows` may be a Staging buffer that the next allreduce overwrites
    src = torch.from_numpy(np.ascontiguousarray(rows)).to(t.device)
    whole = result.view(-1)[: nfull * block_size].view(nfull, block_size)
    short = np.flatnonzero(blocks == nfull)          # the short last block, if it is among them
    if len(short) == 0:
        whole.index_copy_(0, torch.from_numpy(blocks).to(t.device), src)
        return result
    full = np.flatnonzero(blocks != nfull)
    whole.index_copy_(0, torch.from_numpy(blocks[full]).to(t.device), src[torch.from_numpy(full).to(t.device)])
    # the short last block: only its first n mod block_size values exist
    result.view(-1)[nfull * block_size:] = src[int(short[0]), : n - nfull * block_size]
    return result


def sparse_to_blocks(t, block_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A sparse COO tensor (any sparse/dense split, e.g. nn.Embedding(sparse=True)'s gradient) as
    block-sparse input: (sorted block indices, their rows, number of blocks of the dense tensor).
    Work and memory follow the stored values, not the tensor's size."""
    check_dtype(t)
    c = t.detach().coalesce().cpu()
    indices = c.indices().numpy()
    values = c.values().numpy()
    sparse_shape = tuple(t.shape[: c.sparse_dim()])
    dense = int(np.prod(t.shape[c.sparse_dim():], dtype=np.int64))
    position = np.ravel_multi_index(tuple(indices), sparse_shape) if indices.shape[1] else \
        np.zeros(0, np.int64)
    elements = (position.astype(np.int64)[:, None] * dense + np.arange(dense)).reshape(-1)
    flat_values = values.reshape(-1)
    keep = flat_values != 0
    elements, flat_values = elements[keep], flat_values[keep]
    block_of = elements // block_size
    blocks, inverse = np.unique(block_of, return_inverse=True)
    rows = np.zeros((len(blocks), block_size), values.dtype)
    rows[inverse, elements % block_size] = flat_values
    nblocks = block_count(int(np.prod(t.shape, dtype=np.int64)), block_size)
    return blocks.astype(np.int64), rows, nblocks


def blocks_to_sparse(t, blocks: np.ndarray, rows: np.ndarray, block_size: int):
    """Summed blocks as a coalesced sparse COO tensor with t's shape, sparse/dense split and device:
    every sparse index some summed block covers."""
    import torch
    c = t.detach()
    sparse_dim = c.sparse_dim()
    sparse_shape = tuple(t.shape[:sparse_dim])
    dense_shape = tuple(t.shape[sparse_dim:])
    dense = int(np.prod(dense_shape, dtype=np.int64))
    n = int(np.prod(t.shape, dtype=np.int64))
    elements = (blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)
    positions = np.unique(elements[elements < n] // dense)
    wanted = (positions[:, None] * dense + np.arange(dense)).reshape(-1)
    at = np.searchsorted(blocks, wanted // block_size)
    found = (at < len(blocks)) & (blocks[np.minimum(at, len(blocks) - 1)] == wanted // block_size) \
        if len(blocks) else np.zeros(len(wanted), bool)
    values = np.zeros(len(wanted), rows.dtype)
    values[found] = rows[at[found], wanted[found] % block_size]
    # keep the sparse indices with a non-zero sum (a block also covers indices nobody touched)
    live = values.reshape(len(positions), dense).any(axis=1) if dense else np.zeros(0, bool)
    positions = positions[live]
    values = values.reshape(-1, dense)[live].reshape(-1)
    index = np.stack(np.unravel_index(positions, sparse_shape)) if sparse_shape else \
        np.zeros((0, len(positions)), np.int64)
    # row-major positions from np.unique are sorted and unique: the tensor is coalesced as built
    return torch.sparse_coo_tensor(torch.from_numpy(np.ascontiguousarray(index, np.int64)),
                                   torch.from_numpy(values.reshape(len(positions), *dense_shape)),
                                   t.shape, device=t.device, is_coalesced=True, check_invariants=False)
