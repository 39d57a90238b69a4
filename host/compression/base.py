"""The common compressor interface and ZeroSum's wire-cost model."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import protocol as P
from ..blocks import BlockView, find_nonzero_blocks


class Compressor:
    """compress(grad, key) -> this worker's contribution; decompress(sum, world, key) -> estimate.

    `block_size` is the ZeroSum block size: sparsifiers select whole blocks of it.
    """
    block_size: int = 256

    def compress(self, grad: np.ndarray, key="default") -> np.ndarray:
        raise NotImplementedError

    def decompress(self, summed: np.ndarray, world: int, key="default") -> np.ndarray:
        """Default: the mean over workers (what the default DDP hook computes)."""
        return summed / np.float32(world)

    def keyed_state(self) -> list[dict]:
        """The dicts that hold this compressor's per-key state, {key: array}, each array laid out
        element for element like the gradient last given for that key, and a missing key meaning
        all zeros (error-feedback memory, DIANA shifts, DGC accumulators). The DDP hook moves these
        arrays parameter by parameter when DDP regroups the parameters into new buckets. Default:
        none (stateless compressors; a compressor whose state is not element-wise says none too)."""
        return []


class NoCompression(Compressor):
    def compress(self, grad, key="default"):
        return np.asarray(grad, np.float32)


def nonzero_blocks(contribution: np.ndarray, block_size: int = 256) -> np.ndarray:
    """Per block: does this contribution send data there? (bool array)"""
    view = BlockView(np.ascontiguousarray(contribution, np.float32).reshape(-1), block_size)
    return find_nonzero_blocks(view).nonzero


def rounds_of(contributions, block_size: int = 256) -> np.ndarray:
    """The blocks that get a round: non-zero in any worker's contribution (bool array per block)."""
    return np.logical_or.reduce([nonzero_blocks(c, block_size) for c in contributions])


@dataclass(frozen=True)
class WireCost:
    """What one worker sends for one allreduce: entries (16 bytes each), payload bytes, datagrams."""
    entries: int
    payload: int
    datagrams: int

    @property
    def bytes(self) -> int:
        return self.entries * P.ENTRY_SIZE + self.payload + self.datagrams * P.PACKET_HEADER_SIZE


def wire_cost(contribution: np.ndarray, block_size: int = 256, max_datagram: int = P.MAX_DATAGRAM,
              columns: int = 2048, rounds: np.ndarray | None = None) -> WireCost:
    """ZeroSum's cost for one worker and one loss-free allreduce, following docs/protocol.md ("A round"):
    a bootstrap entry per column; then, in every round, an entry from every worker, with the block's
    data only from the workers that have it (the others acknowledge with a header-only entry). So the
    entries depend on all workers: `rounds` are the blocks non-zero in any contribution (`rounds_of`);
    without it, the others are assumed to send the same blocks as this one (the lower bound).

    Entries and payload are exact (tests/test_compression.py checks them against a real worker). The
    datagram count is a lower bound: the rounds of a column run one after another, so each round
    number is at least one datagram of its own, fused over all columns up to max_datagram."""
    own = nonzero_blocks(contribution, block_size)
    rounds = own if rounds is None else (np.asarray(rounds, bool) | own)
    nblocks = len(own)
    cols = min(columns, nblocks)

    def by_column(mask):   # row k, column c: block c + k*cols
        return np.pad(mask, (0, -nblocks % cols)).reshape(-1, cols)

    grid = by_column(rounds)
    # Block b is round number (#rounds of blocks b - cols, b - 2*cols, ... before it) of column b mod cols.
    number = (np.cumsum(grid, axis=0) - 1)[grid]
    sizes = P.ENTRY_SIZE + by_column(own)[grid] * (block_size * P.WIRE_VALUE.itemsize)
    per_round = np.bincount(number, weights=sizes) if number.size else np.zeros(0)
    room = max_datagram - P.PACKET_HEADER_SIZE
    datagrams = -(-cols * P.ENTRY_SIZE // room) + int(np.ceil(per_round / room).sum())
    return WireCost(entries=cols + int(rounds.sum()), payload=int(own.sum()) * block_size * P.WIRE_VALUE.itemsize,
                    datagrams=datagrams)


def wire_bytes(contribution: np.ndarray, block_size: int = 256, max_datagram: int = P.MAX_DATAGRAM,
               columns: int = 2048, rounds: np.ndarray | None = None) -> int:
    """Bytes on the wire of `wire_cost` (same arguments)."""
    return wire_cost(contribution, block_size, max_datagram, columns, rounds).bytes


def allreduce(worker, grad: np.ndarray, compressor: Compressor, key="default") -> np.ndarray:
    """Compress, sum over workers with ZeroSum, decompress."""
    contribution = compressor.compress(np.asarray(grad, np.float32), key)
    return compressor.decompress(worker.allreduce(contribution), worker.world_size, key)


def block_rows(x: np.ndarray, block_size: int) -> tuple[np.ndarray, int]:
    """x flattened and zero-padded to whole blocks, as (blocks, block_size) rows (a copy)."""
    flat = np.asarray(x, np.float32).reshape(-1)
    n = flat.size
    nblocks = -(-n // block_size)
    rows = np.zeros(nblocks * block_size, np.float32)
    rows[:n] = flat
    return rows.reshape(nblocks, block_size), n


class ErrorFeedback:
    """Memory per key: what was not sent is added to the next gradient.

    Stich, Cordonnier, Jaggi, "Sparsified SGD with memory", NeurIPS 2018, Section 2.3, eq. (8) and
    Algorithm 1 (MEM-SGD): g_t = comp_k(m_t + η_t ∇f(x_t)), x_{t+1} = x_t − g_t,
    m_{t+1} = m_t + η_t ∇f(x_t) − g_t. The paper stresses that gradients are multiplied by η_t when
    they enter the memory, not when they leave it. A compressor here returns a gradient-sized
    contribution that the optimiser multiplies by the current step, so the memory is kept in units
    of the current step: stored = m_t / η_t. For top-k (and scaled sign) comp(c·x) = c·comp(x), so
    this is Algorithm 1 exactly while η is constant; when the step changes, `set_lr` rescales the
    memory by η_old / η_new, which keeps it exact (m_t itself is unchanged)."""

    def __init__(self):
        self.memory: dict = {}
        self.lr: float | None = None

    def set_lr(self, lr: float) -> None:
        if lr <= 0:
            raise ValueError(f"step size must be positive, got {lr}")
        if self.lr is not None and lr != self.lr:
            ratio = np.float32(self.lr / lr)
            for key in self.memory:
                self.memory[key] = self.memory[key] * ratio
        self.lr = float(lr)

    def corrected(self, grad: np.ndarray, key) -> np.ndarray:
        m = self.memory.get(key)
        return grad.astype(np.float32) if m is None else m + grad

    def remember(self, corrected: np.ndarray, sent: np.ndarray, key) -> None:
        self.memory[key] = corrected - sent


class WithErrorFeedback(Compressor):
    """A compressor of the gradient plus what it left unsent before (`ErrorFeedback`), or of the
    gradient alone when built without error feedback. Call `set_lr(η_t)` before `compress` when the
    step size changes during training."""

    def __init__(self, error_feedback: bool = True):
        self.ef = ErrorFeedback() if error_feedback else None

    def set_lr(self, lr: float) -> None:
        """Tell the error feedback the step size the sent gradient will be multiplied by."""
        if self.ef:
            self.ef.set_lr(lr)

    def keyed_state(self) -> list[dict]:
        return [self.ef.memory] if self.ef else []


class TopK(WithErrorFeedback):
    """Keeps a fraction `density` (in (0, 1]) of the gradient: the top-k sparsifiers' common part."""

    def __init__(self, density: float = 0.01, error_feedback: bool = True):
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        super().__init__(error_feedback)
        self.density = density
