"""Per-bucket path choice: each gradient bucket goes through ZeroSum or through the ring (gloo), whichever
this job's own measurements say is faster at the bucket's block density; every rank chooses the same.

ZeroSum's time grows with the union of the ranks' non-zero blocks (its wire bytes), plus a part that does
not (the scan of the input, per-call set-up); the ring's time is that of the dense bytes. So the choice
for a bucket is a crossover in density, which depends on the links, the CPUs and the bucket's size and
is therefore measured, not assumed (as NCCL's tuner picks ring or tree from measured costs, and SparCML
switches from sparse to dense inside its allreduce when data gets dense):

- start-up: the density-independent share `base` of ZeroSum's time, from a few timed allreduces of an
  all-zero and a dense buffer (`calibrate`);
- per bucket (its key: its parameters, as the hook keys compressor state), its first use goes through
  ZeroSum (which also tells the union density of its blocks), its second through the ring; from then on
  the bucket takes the path whose predicted time is lower, ZeroSum's predicted as its measured time
  scaled to the current density: t_z * (base + (1 - base) d) / (base + (1 - base) d_z);
- online: every `explore_every`-th use a bucket takes the other path once, so both times stay current;
  times are averaged locally and agreed every `agree_every` uses; the union density comes from every
  ZeroSum result (identical on every rank) and, while a bucket stays on the ring, from its result every
  `agree_every` uses.

Every input of a decision is the same on every rank: times are agreed (the maximum over ranks, one
small ring allreduce at points that every rank reaches in the same order), densities come from results
that are identical on every rank (agreed too where a ring result is scanned). So every rank takes the
same path for every bucket, which a collective needs.

The two paths' sums differ in how they round: ZeroSum adds fixed-point values (docs/protocol.md, "Fixed
point": exact, independent of order, then one rounding to float32), the ring adds float32 values in its
ring order; each is identical on every rank, and they differ from each other by float rounding.

This object does no I/O: the hook gives it the agreement (`agree`) and the timed allreduces
(`calibrate`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

ZEROSUM, RING = "zerosum", "ring"
PATHS = (ZEROSUM, RING)


@dataclass
class BucketPaths:
    """What is known of one bucket (one key)."""
    uses: int = 0
    seconds: dict = field(default_factory=dict)     # path -> agreed seconds of its last window
    density_at: dict = field(default_factory=dict)  # path -> the union density when those were measured
    density: float = 1.0                            # union density of its last known result
    pending: dict = field(default_factory=dict)     # path -> [local seconds summed, uses] since agreement
    scan_due: bool = False                          # a ring result's density is to be agreed this use


@dataclass
class PathCounts:
    buckets: int = 0
    bytes: int = 0


class PathChoice:
    """Which path each bucket takes (module docstring). `agree(values) -> values` returns the maximum
    of a float64 vector over the ranks (a collective: every rank calls it at the same points)."""

    def __init__(self, agree: Callable[[np.ndarray], np.ndarray], *, explore_every: int = 50,
                 agree_every: int = 10, margin: float = 1.0):
        if explore_every < 2 or agree_every < 1 or margin <= 0:
            raise ValueError("explore_every must be at least 2, agree_every at least 1, margin positive")
        self.agree = agree
        self.explore_every = explore_every
        self.agree_every = agree_every
        self.margin = margin           # ZeroSum is taken while its predicted time <= margin * ring's
        self.base: float | None = None  # density-independent share of ZeroSum's time (calibrate)
        self.buckets: dict = {}
        self.counts = {p: PathCounts() for p in PATHS}

    # -- start-up ----------------------------------------------------------------------------------
    def calibrate(self, timed: Callable[[float], float], repeats: int = 3) -> float:
        """Measure `base` with timed(density) -> seconds of one ZeroSum allreduce of a buffer at that
        density (0: every block zero, 1: dense); the medians are agreed. Returns base."""
        zero = float(np.median([timed(0.0) for _ in range(repeats)]))
        dense = float(np.median([timed(1.0) for _ in range(repeats)]))
        zero, dense = (float(v) for v in self.agree(np.array([zero, dense])))
        self.base = min(max(zero / dense, 0.0), 1.0) if dense > 0 else 1.0
        return self.base

    # -- per bucket --------------------------------------------------------------------------------
    def predicted(self, b: BucketPaths) -> dict:
        """Each path's predicted seconds for bucket b at its current density (paths not yet measured
        are missing)."""
        out = {}
        if RING in b.seconds:
            out[RING] = b.seconds[RING]
        if ZEROSUM in b.seconds:
            base = 1.0 if self.base is None else self.base
            scale = (base + (1 - base) * b.density) / max(base + (1 - base) * b.density_at[ZEROSUM], 1e-12)
            out[ZEROSUM] = b.seconds[ZEROSUM] * scale
        return out

    def choose(self, key) -> str:
        """The path of this use of bucket `key` (the same on every rank)."""
        b = self.buckets.setdefault(key, BucketPaths())
        if ZEROSUM not in b.seconds and not b.pending.get(ZEROSUM):
            return ZEROSUM                       # first use: ZeroSum tells the union density too
        if RING not in b.seconds and not b.pending.get(RING):
            return RING
        p = self.predicted(b)
        if ZEROSUM not in p or RING not in p:    # still being measured: stay on the measured path
            return ZEROSUM if ZEROSUM not in b.seconds else RING
        best = ZEROSUM if p[ZEROSUM] <= self.margin * p[RING] else RING
        if b.uses % self.explore_every == self.explore_every - 1:
            return RING if best == ZEROSUM else ZEROSUM        # refresh the other path's time
        return best

    def scan_due(self, key, path: str) -> bool:
        """Whether this use of a ring bucket should report its result's union density to `observe`
        (ZeroSum reports it every time, from the worker)."""
        b = self.buckets.setdefault(key, BucketPaths())
        return path == RING and self._agreeing(b, path)

    def _agreeing(self, b: BucketPaths, path: str) -> bool:
        """Whether this use closes path's window (then observe agrees on it)."""
        s, n = b.pending.get(path, (0.0, 0))
        return n + 1 >= self.agree_every or path not in b.seconds or b.uses % self.explore_every == \
            self.explore_every - 1

    def observe(self, key, path: str, nbytes: int, seconds: float, density: float | None) -> None:
        """After the bucket's allreduce on `path`: its local time and, where known, the union density of
        its result (every ZeroSum use; ring uses where scan_due said so)."""
        b = self.buckets.setdefault(key, BucketPaths())
        closing = self._agreeing(b, path)
        s, n = b.pending.get(path, (0.0, 0))
        s, n = s + seconds, n + 1
        if path == ZEROSUM and density is not None:
            b.density = density              # identical on every rank: no agreement needed
        if closing:
            scanned = density if (path == RING and density is not None) else -1.0
            mean, agreed_density = (float(v) for v in self.agree(np.array([s / n, scanned])))
            if path == RING and agreed_density >= 0:
                b.density = agreed_density
            b.seconds[path] = mean
            b.density_at[path] = b.density
            s, n = 0.0, 0
        b.pending[path] = (s, n)
        b.uses += 1
        c = self.counts[path]
        c.buckets += 1
        c.bytes += int(nbytes)

    def report(self) -> dict:
        """Buckets and bytes that took each path, and each bucket's last times and density."""
        return {"paths": {p: {"buckets": c.buckets, "bytes": c.bytes} for p, c in self.counts.items()},
                "base": self.base,
                "buckets": {str(k): {"uses": b.uses, "density": b.density, "seconds": dict(b.seconds)}
                            for k, b in self.buckets.items()}}
