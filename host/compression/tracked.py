"""Top-k blocks whose k a `LevelTracker` chooses online, per key (a DDP bucket), from the results every
rank receives: the compressor of the `tracked` scheme (zerosum.examples.schemes)."""
from __future__ import annotations

import math

import numpy as np

from .. import protocol as P
from .adaptive import LevelTracker, common_blocks_bytes, level_grid
from .base import nonzero_blocks
from .sparsify import TopKBlocks


class BucketLevels:
    """A key's state in `TrackedTopKBlocks` (see there)."""

    restore_new = True      # a checkpoint may hold one that a fresh compressor has not made yet

    def __init__(self, nblocks: int, k: int):
        self.nblocks = nblocks
        self.tracker: LevelTracker | None = None   # made from the key's first non-zero result
        self.k = k                       # blocks kept at the key's next compress (the start until the tracker)
        self.bits = 0.0                  # bits of the key's results observed so far
        self.pending = False             # compressed, result not observed yet
        self.played: list[int] = []      # k of every compress, in order
        self.recent: list[float] = []    # the last `smooth` values of log ||result||²


class TrackedTopKBlocks(TopKBlocks):
    """Top-k blocks with error feedback (`TopKBlocks`: Stich et al. 2018, MEM-SGD), k chosen per key by
    a `LevelTracker`: the compression level that maximises the measured improvement per communicated bit
    (Khirirat, Magnússon, Aytekin, Johansson, arXiv:2003.06377), tracked by compass search over a
    geometric grid of levels (Kolda, Lewis & Torczon, "Optimization by direct search", SIAM Review 45(3),
    2003), scored over segments of steps by the decrease of a potential per bit.

    Every rank must keep the same k at every step (the union of the blocks, hence the bytes, and the
    update would otherwise differ by rank), so the tracker sees only what every rank has, bit for bit:
    the summed result of the allreduce (`decompress`), never this rank's gradient, memory or byte
    counters. State per key (`trackers`, a `BucketLevels`), and its rules:

    - ``k``: the blocks the key's next `compress` keeps. It is set by `decompress` of the key's previous
      result, so the k of step t depends only on the results of steps before t. Until the first
      non-zero result, k is every block (dense: with error feedback, uncompressed), or with
      `start_density` round(start_density × blocks): a level chosen before training by a stated rule
      (e.g. 1 % of the blocks), from which the search moves one level at a time instead of walking
      down from dense.
    - ``bits``: 8 × `common_blocks_bytes` of the union of the non-zero blocks of each result, summed
      over the key's results: the bytes of a worker that sends every block of the union (an upper bound
      on what a worker sends; what it receives), a function of the result alone.
    - potential: log ||result||², the squared norm summed in float64 in numpy's fixed pairwise order and
      logged by `math.log` (not BLAS, not numpy's SIMD log, whose last bits can differ between hosts),
      averaged over the last `smooth` results; a result that is all zero is not scored (its bits count).
    - ``tracker``: made from the first non-zero result: levels `level_grid(nblocks)`, every block then
      k = round(nblocks / ratio^j), keeping the k whose result could cost fewer bits than a dense result
      (a union of at most world·k blocks; the dense result's cost is that first result's when it was
      dense, else every block's); segments of `segment_steps` times the first result's bits, the first
      `warmup` share of each unscored; starting at grid index `start` (0: dense; past the end: the
      smallest k), or with `start_density` at the level nearest its k (in ratio).
    - after each result: ``k = tracker.choose(potential, bits before it)``. The result of step t is
      the (compressed) gradient at the parameters step t started from, so its potential goes with the
      bits of the steps before t, as `LevelTracker.choose` expects; a switch takes effect one step after
      the observation that decides it, so the new segment's first step was played at the old level:
      unscored when warmup × segment_steps ≥ 1 (the defaults: 2), a dense step being the dearest.

    The potential is that of what was sent: with error feedback a switch to a smaller k first lowers it
    (fewer blocks), then raises it while the memory fills; the unscored `warmup` keeps that transient
    out of the scores only when it is shorter than a segment's first part.

    Keys are the hook's (`zerosum.torch.HookState`: the names of a bucket's parameters), not bucket
    indices, so DDP's rebuild of its buckets after the first iteration gives the rebuilt buckets keys
    of their own, each with a fresh tracker (dense first again); the trackers of the keys they replace
    (tuple keys that share a parameter with a new key) are dropped. A key whose bucket changes its
    number of blocks is an error, and so are a `compress` whose previous result was not observed and a
    `decompress` without a `compress` before it.

        c = TrackedTopKBlocks()
        zerosum.torch.register(ddp_model, worker, c)      # c.report(): levels and k per key
    """

    def __init__(self, ratio: float = 2 ** 0.5, segment_steps: float = 4.0, warmup: float = 0.5,
                 smooth: int = 1, start: int = 0, start_density: float | None = None,
                 error_feedback: bool = True, block_size: int = 256, columns: int = 2048,
                 max_datagram: int = P.MAX_DATAGRAM):
        if not ratio > 1:
            raise ValueError(f"ratio between levels must be > 1, got {ratio}")
        if not segment_steps > 0:
            raise ValueError(f"segment_steps (a segment's bits, in dense results) must be > 0, got {segment_steps}")
        if not 0 <= warmup < 1:
            raise ValueError(f"warmup is the unscored share of a segment, in [0, 1), got {warmup}")
        if int(smooth) != smooth or smooth < 1:
            raise ValueError(f"smooth (results averaged in the potential) must be a positive integer, got {smooth}")
        if int(start) != start or start < 0:
            raise ValueError(f"start (an index into the levels, 0: dense) must be a non-negative integer, got {start}")
        if start_density is not None and not 0 < start_density <= 1:
            raise ValueError(f"start_density (a share of the blocks) must be in (0, 1], got {start_density}")
        super().__init__(density=1.0, error_feedback=error_feedback, block_size=block_size)
        self.ratio, self.segment_steps, self.warmup = float(ratio), float(segment_steps), float(warmup)
        self.smooth, self.start, self.start_density = int(smooth), int(start), start_density
        self.columns, self.max_datagram = columns, max_datagram
        self.trackers: dict = {}

    def result_bits(self, union, nblocks: int):
        """Bits charged for a result with `union` non-zero blocks of `nblocks` (array or number)."""
        return 8.0 * common_blocks_bytes(union, nblocks, self.block_size, self.columns, self.max_datagram)

    def compress(self, grad, key="default"):
        self._track(key, -(-np.asarray(grad).size // self.block_size))     # checked before the memory is used
        return super().compress(grad, key)

    def _track(self, key, nblocks: int) -> BucketLevels:
        track = self.trackers.get(key)
        if track is None:
            self._forget_replaced(key)
            track = self.trackers[key] = BucketLevels(nblocks, self._start_k(nblocks))
        elif track.nblocks != nblocks:
            raise ValueError(f"key {key!r} had {track.nblocks} blocks and now has {nblocks}: "
                             "its levels no longer fit it")
        return track

    def _start_k(self, nblocks: int) -> int:
        return nblocks if self.start_density is None else max(1, round(self.start_density * nblocks))

    def choose_k(self, rows: np.ndarray, key="default") -> int:
        track = self._track(key, len(rows))
        if track.pending:
            raise ValueError(f"key {key!r} compressed again before its result was observed: call "
                             "decompress(result, world, key) after each compress")
        track.pending = True
        track.played.append(track.k)
        return track.k

    def decompress(self, summed: np.ndarray, world: int, key="default") -> np.ndarray:
        track = self.trackers.get(key)
        if track is None or not track.pending:
            raise ValueError(f"decompress for key {key!r} without a compress before it")
        track.pending = False
        union = int(nonzero_blocks(summed, self.block_size).sum())
        bits = float(self.result_bits(union, track.nblocks))
        values = np.asarray(summed).reshape(-1)
        norm2 = float(np.square(values[values != 0], dtype=np.float64).sum())     # the non-zero part: cheaper
        if norm2 > 0:
            if track.tracker is None:
                track.tracker = self._tracker(track.nblocks, union, world, bits)
            track.recent = (track.recent + [math.log(norm2)])[-self.smooth:]
            track.k = track.tracker.choose(sum(track.recent) / len(track.recent), track.bits)
        track.bits += bits
        return super().decompress(summed, world, key)

    def _tracker(self, nblocks: int, union: int, world: int, first_bits: float) -> LevelTracker:
        """The tracker of a key whose first non-zero result had `union` blocks, costing `first_bits`."""
        def sparse(k):       # at most world·k blocks in the union when each worker keeps k
            return self.result_bits(np.minimum(world * np.asarray(k), nblocks), nblocks)
        started_dense = self._start_k(nblocks) == nblocks
        dense_bits = first_bits if started_dense else float(self.result_bits(nblocks, nblocks))
        levels = level_grid(nblocks, sparse, dense_bits, self.ratio)
        start = min(self.start, len(levels) - 1)
        if not started_dense:     # the level nearest the starting k, in ratio
            start = int(np.argmin(np.abs(np.log(levels / self._start_k(nblocks)))))
        return LevelTracker(levels, self.segment_steps * first_bits, start=start, warmup=self.warmup)

    def _forget_replaced(self, key) -> None:
        if not isinstance(key, tuple):
            return
        for old in [k for k in self.trackers if isinstance(k, tuple) and set(k) & set(key)]:
            del self.trackers[old]

    def report(self) -> list[dict]:
        """Per key, in the order first seen: its blocks, levels, k of every step, and its segments."""
        out = []
        for key, t in self.trackers.items():
            out.append({"key": list(key) if isinstance(key, tuple) else key, "blocks": t.nblocks,
                        "levels": [] if t.tracker is None else t.tracker.levels.tolist(),
                        "k": list(t.played), "bits": t.bits,
                        "segments": [] if t.tracker is None else [[k, s] for k, s in t.tracker.segments]})
        return out
