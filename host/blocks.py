"""Splitting a flat tensor into fixed-size blocks and finding the non-zero ones.

Everything here is vectorised: one pass of max/min over a (blocks, block_size) view, no per-block
Python. The last block may be short; it is handled as its own padded row so that the bulk of the
tensor is never copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .fixedpoint import block_exponents
from .protocol import INT_EXP, MAX_BLOCKS

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

    def store(self, blocks: np.ndarray, rows: np.ndarray) -> None:
        """Write rows into the given blocks of `flat` (the last block's padding is dropped)."""
        if self.tail is None or len(blocks) == 0 or blocks.max() < self.nfull:
            self.full[blocks] = rows
            return
        inner = blocks < self.nfull
        self.full[blocks[inner]] = rows[inner]
        start = self.nfull * self.block_size
        self.flat[start:] = rows[~inner][0, : self.flat.size - start]

    def _any_bits(self, rows: np.ndarray) -> np.ndarray:
        """Whether each row has a non-zero bit pattern: one pass over the raw integers (-0.0 counts)."""
        return rows.view(np.uint32).max(axis=1) != 0 if rows.shape[1] else np.zeros(len(rows), bool)

    @staticmethod
    def _max_abs_rows(rows: np.ndarray) -> np.ndarray:
        # max and -min instead of abs(): no temporary the size of the data
        return np.maximum(rows.max(axis=1), -rows.min(axis=1))

    def max_abs(self) -> np.ndarray:
        """Largest magnitude per block (float32; for int32 data 1.0 marks a non-zero block).

        A cheap integer pass finds the candidate blocks first, so sparse tensors only pay for
        magnitudes where there is data.
        """
        out = np.zeros(self.nblocks, np.float32)
        for base, rows in ((0, self.full), (self.nfull, self.tail)):
            if rows is None or len(rows) == 0:
                continue
            live = self._any_bits(rows)
            if self.is_int:
                out[base: base + len(rows)] = live
                continue
            idx = np.flatnonzero(live)
            if len(idx) > len(rows) // 2:
                out[base: base + len(rows)] = self._max_abs_rows(rows)
            elif len(idx):
                out[base + idx] = self._max_abs_rows(rows[idx])
        return out


@dataclass
class SparseBlocks:
    """What a worker knows about its own tensor: which blocks are non-zero and their exponents."""
    nonzero: np.ndarray    # bool per block
    exponents: np.ndarray  # int32 per block: frexp exponent of max|x| (INT_EXP for int32 data)


def find_nonzero_blocks(view: BlockView) -> SparseBlocks:
    """Detect the non-zero blocks; reject NaN and infinity, which fixed point cannot carry."""
    maxabs = view.max_abs()
    if not view.is_int:
        bad = ~np.isfinite(maxabs)
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            raise ValueError(f"tensor has NaN or infinite values (first in block {b}, elements "
                             f"{b * view.block_size}..{(b + 1) * view.block_size - 1}); "
                             f"fixed-point aggregation cannot carry them")
    nonzero = maxabs > 0
    if view.is_int:
        exps = np.full(view.nblocks, INT_EXP, np.int32)
    else:
        exps = block_exponents(maxabs)
    return SparseBlocks(nonzero, exps)


class CollectedBlocks:
    """A result sink that keeps the summed blocks as they arrive (to be scattered on the device)."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self._blocks: list[np.ndarray] = []
        self._rows: list[np.ndarray] = []

    def store(self, blocks: np.ndarray, rows: np.ndarray) -> None:
        self._blocks.append(np.array(blocks, np.int64))
        self._rows.append(np.asarray(rows, self.dtype))

    def collected(self, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        if not self._blocks:
            return np.zeros(0, np.int64), np.zeros((0, block_size), self.dtype)
        return np.concatenate(self._blocks), np.concatenate(self._rows)
