"""Tensors as blocks: what a worker contributes (BlockSource: its non-zero blocks, their exponents and
where their values are) and where sums go (DenseResult, CollectedBlocks).

The scan that finds non-zero blocks is one compiled pass (block_scan.scan_blocks). BlockView and
SparseBlocks are the per-block views the reference sum and the compressors use.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import block_scan
from .protocol import MAX_BLOCKS, NO_EXP
from .worker_state import N_COUNTS

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.int32))


def block_count(n: int, block_size: int) -> int:
    return -(-n // block_size)


@dataclass
class BlockView:
    """A flat float32 or int32 array seen as `nblocks` rows of `block_size` (the last one zero-padded)."""
    flat: np.ndarray
    block_size: int

    def __post_init__(self):
        if self.flat.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"allreduce supports float32 and int32 arrays, not {self.flat.dtype}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        n = self.flat.size
        self.nblocks = block_count(n, self.block_size)
        if self.nblocks >= MAX_BLOCKS:
            raise ValueError(f"a tensor of {n} elements has too many blocks of {self.block_size}")
        self.nfull = n // self.block_size
        self.full = self.flat[: self.nfull * self.block_size].reshape(self.nfull, self.block_size)
        self.tail = None
        if self.nfull < self.nblocks:
            self.tail = np.zeros((1, self.block_size), self.flat.dtype)
            self.tail[0, : n - self.nfull * self.block_size] = self.flat[self.nfull * self.block_size:]

    @property
    def is_int(self) -> bool:
        return self.flat.dtype == np.int32

    def rows(self, blocks: np.ndarray) -> np.ndarray:
        """The rows of the given blocks, as a new (len(blocks), block_size) array."""
        blocks = np.asarray(blocks, dtype=np.int64)
        if self.tail is None or len(blocks) == 0 or blocks.max() < self.nfull:
            return self.full[blocks]
        out = np.empty((len(blocks), self.block_size), self.flat.dtype)
        inner = blocks < self.nfull
        out[inner] = self.full[blocks[inner]]
        out[~inner] = self.tail
        return out


@dataclass
class SparseBlocks:
    """What a worker knows about its own tensor: which blocks are non-zero and their exponents."""
    nonzero: np.ndarray    # bool per block
    exponents: np.ndarray  # int32 per block: frexp exponent of max|x| (INT_EXP for int32 data)


def scan(values: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-zero blocks of a flat float32/int32 array and their exponents, in one compiled pass.

    Returns (sorted block indices, int32 exponents: frexp of the largest magnitude, INT_EXP for int32
    data). Rejects NaN and infinity, which fixed point cannot carry.
    """
    flat = np.ascontiguousarray(values).reshape(-1)
    if flat.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"allreduce supports float32 and int32 arrays, not {flat.dtype}")
    nblocks = block_count(flat.size, block_size)
    blocks = np.empty(nblocks, np.int64)
    exps = np.empty(nblocks, np.int32)
    count, bad = block_scan.scan_blocks(flat.view(np.int32), block_size, flat.dtype == np.int32, blocks, exps)
    if bad >= 0:
        raise ValueError(f"tensor has NaN or infinite values (first in block {bad}, elements "
                         f"{bad * block_size}..{(bad + 1) * block_size - 1}); "
                         f"fixed-point aggregation cannot carry them")
    return blocks[:count], exps[:count]


def find_nonzero_blocks(view: BlockView) -> SparseBlocks:
    """Which blocks of `view` are non-zero, and their exponents (NO_EXP for zero blocks)."""
    blocks, exps = scan(view.flat, view.block_size)
    nonzero = np.zeros(view.nblocks, bool)
    nonzero[blocks] = True
    all_exps = np.full(view.nblocks, NO_EXP, np.int32)
    all_exps[blocks] = exps
    return SparseBlocks(nonzero, all_exps)


@dataclass
class BlockSource:
    """What a worker contributes: its non-zero blocks (sorted), their exponents, and where their values
    are: row `rows[i]` (of block_size values) of the flat `values`, of which `n_values` exist (the rest
    of a short last row is zero padding). A dense tensor is its own source (rows = blocks); block-sparse
    input (indices and rows) and device-gathered blocks are compact sources (rows = 0..k-1)."""
    blocks: np.ndarray      # int64, sorted, unique
    exps: np.ndarray        # int32, one per block
    rows: np.ndarray        # int64, one per block
    values: np.ndarray      # flat float32, or int32 data as uint32 bits
    n_values: int
    nblocks: int
    block_size: int
    is_int: bool

    @classmethod
    def dense(cls, flat: np.ndarray, block_size: int) -> "BlockSource":
        view = BlockView(flat, block_size)     # validates dtype, block size and the block count
        blocks, exps = scan(flat, block_size)
        return cls._of(flat, blocks, exps, blocks, view.nblocks, block_size)

    @classmethod
    def compact(cls, blocks: np.ndarray, rows: np.ndarray, nblocks: int) -> "BlockSource":
        """Block-sparse input: sorted unique `blocks` and their (k, block_size) `rows`; all-zero rows
        are left out."""
        rows = np.ascontiguousarray(rows)
        if rows.ndim != 2 or rows.shape[0] != len(blocks):
            raise ValueError(f"block rows must be a (len(blocks), block_size) array, got {rows.shape} "
                             f"for {len(blocks)} blocks")
        block_size = rows.shape[1]
        blocks = np.asarray(blocks)
        if blocks.ndim != 1 or (blocks.size and blocks.dtype.kind not in "iu"):
            raise TypeError(f"block indices must be a 1-D array of integers, not {blocks.dtype} "
                            f"of shape {blocks.shape}")
        blocks = blocks.astype(np.int64)
        if len(blocks) and (blocks[0] < 0 or blocks[-1] >= nblocks or (np.diff(blocks) <= 0).any()):
            raise ValueError(f"block indices must be sorted, unique and within 0..{nblocks - 1}")
        if not 0 <= nblocks < MAX_BLOCKS:
            raise ValueError(f"a tensor of {nblocks} blocks is not supported")
        try:
            live, exps = scan(rows, block_size)
        except ValueError:
            bad = int(np.flatnonzero(~np.isfinite(rows).all(axis=1))[0])
            b = int(blocks[bad])
            raise ValueError(f"tensor has NaN or infinite values (first in block {b}, elements "
                             f"{b * block_size}..{(b + 1) * block_size - 1}); "
                             f"fixed-point aggregation cannot carry them") from None
        return cls._of(rows.reshape(-1), blocks[live], exps, live, nblocks, block_size)

    @classmethod
    def _of(cls, flat, blocks, exps, rows, nblocks, block_size):
        is_int = flat.dtype == np.int32
        values = flat.view(np.uint32) if is_int else flat
        return cls(blocks, exps, rows.astype(np.int64, copy=False), values, flat.size, nblocks, block_size,
                   bool(is_int))


class DenseResult:
    """A result sink writing sums straight into a flat array (block b at b*block_size)."""
    collect = False

    def __init__(self, flat: np.ndarray):
        self.flat = flat


def host_bytes(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, np.uint8)


class KeptBuffers:
    """Memory kept from one allreduce to the next (a fresh host array costs a page fault per 4 KiB when it
    is first written): one byte buffer per role, made by `allocate(nbytes)` (a uint8 array), grown to the
    largest asked for with room for half again, never shrunk. `buffers` holds them by role."""

    def __init__(self, allocate=host_bytes):
        self._allocate = allocate
        self.buffers: dict = {}

    def array(self, role, values: int, dtype) -> np.ndarray:
        """The first `values` elements of `dtype` of the role's buffer (contents undefined); asked for
        again while no larger, it keeps its start (CollectedBlocks' growth then copies onto itself)."""
        dtype = np.dtype(dtype)
        nbytes = values * dtype.itemsize
        buf = self.buffers.get(role)
        if buf is None or buf.size < nbytes:
            buf = self.buffers[role] = self._allocate(max(64, nbytes + nbytes // 2))
        return buf[:nbytes].view(dtype)


class CollectedBlocks:
    """A result sink that keeps the summed blocks as they arrive (for sparse results and the device
    path): rows and their block indices are appended to buffers that grow as needed.
    `allocate(role, values, dtype)` gives those buffers (role "rows" or "blocks"; the kernel writes every
    row and index before it is read, so they need not be zeroed): a KeptBuffers' `array`, the sink's own
    by default. Workers pass memory they keep between allreduces (worker_machine.Scratch, tensors.Staging
    for the device path), which hands out the same start again, so that a growth copies onto itself:
    fresh memory for every allreduce cost a page fault per 4 KiB written, a fifth of the CPU time of 1 %
    allreduces of block input."""
    collect = True

    def __init__(self, dtype, block_size: int, capacity: int = 64, allocate=None):
        self.dtype = np.dtype(dtype)
        self.block_size = block_size
        self._allocate = allocate or KeptBuffers().array
        # the kernel's counters: duplicates, rows used, columns done, blocks of the sum with data, and the
        # congestion controller's samples of the last datagram (kernels.apply_datagram)
        self.count = np.zeros(N_COUNTS, np.int64)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        flat = self._allocate("rows", capacity * self.block_size, self.dtype)
        blocks = self._allocate("blocks", capacity, np.int64)
        if hasattr(self, "flat"):
            used = int(self.count[1])
            flat[: used * self.block_size] = self.flat[: used * self.block_size]
            blocks[:used] = self.blocks[:used]
        self.flat, self.blocks, self.capacity = flat, blocks, capacity

    def reserve(self, rows: int) -> None:
        """Room for `rows` more rows (called before each datagram is applied)."""
        if self.count[1] + rows > self.capacity:
            self._grow(max(2 * self.capacity, int(self.count[1]) + rows))

    def collected(self, sort: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(block indices, rows) of the sums received: sorted by block (copies), or in arrival order
        (views of the buffer: the device path scatters them by index, in any order)."""
        used = int(self.count[1])
        blocks = self.blocks[:used]
        rows = self.flat[: used * self.block_size].reshape(used, self.block_size)
        if not sort:
            return blocks, rows
        order = np.argsort(blocks, kind="stable")
        return blocks[order], rows[order]
