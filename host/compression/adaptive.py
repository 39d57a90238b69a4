"""Adaptive sparsification (Khirirat, Magnússon, Aytekin, Johansson, arXiv:2003.06377, 2020; v1 "Communication
efficient sparsification for large scale machine learning", v2 and AAAI 2021 "A flexible framework for
communication-efficient machine learning"): at each iteration choose the compression level that maximises
"the improvement in the objective function that is achieved per communicated bit", with a model of "how the
communication cost depends on the compression level for the specific technology" (both phrases from the
abstracts; the paper's body, its exact rule, data sets, step sizes and k values were not found: what
was, docs/compression.md, E4).

For plain compressed gradient descent x⁺ = x − (1/L)·T_k(∇f(x)) on an L-smooth f, the descent lemma gives
f(x⁺) ≤ f(x) − ||T_k(∇f(x))||²/(2L), so the rule is

    k* = argmax_k ||T_k(g)||² / C(k),

T_k keeping the k entries of largest magnitude. This module holds the rule over an explicit cost C:

- `BitCost`: the paper's kind of model, ⌈log2 d⌉ index bits + 32 value bits per kept entry, plus an
  optional fixed cost per message (a header of the specific technology) and messages of bounded payload.
  `encode_sparse` is an encoder that emits exactly those bits (tested), `decode_sparse` reads them back.
  With no per-message cost, ||T_k(g)||²/k never grows with k, so the rule always picks k = 1.
- `zerosum_prefix_bytes`: ZeroSum's cost of sending the first k blocks of an ordering, exactly
  `wire_bytes` (entries, payload, datagram headers, and the header-only entries of a worker that has no
  data in a block of the common set), for every k at once; `choose_blocks` applies the rule with it.

`LevelTracker` replaces the one-step rule by an online search over levels scored by the measured
decrease of log ||∇f||² per bit over segments of steps; `level_grid` gives it the levels, from dense
(`encode_dense`: all d values without indices, `BitCost.dense_bits`) down. `TrackedTopKBlocks`
(zerosum.compression.tracked) runs a tracker per DDP bucket, fed with the allreduce's result.

`AdaptiveTopKBlocks` is the rule applied inside error feedback, per worker, on whole blocks, with an
approximate ZeroSum cost; that is not the setting in which the descent-lemma argument holds (the previous
E4 measured it: docs/compression.md)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import protocol as P
from .base import wire_bytes
from .sparsify import TopKBlocks


# ---------------------------------------------------------------------------------------------------------
# The rule

def magnitude_order(g: np.ndarray) -> np.ndarray:
    """Indices of g by decreasing |g| (ties: lower index first), so T_k(g) keeps order[:k]."""
    g = np.asarray(g).reshape(-1)
    return np.argsort(-np.abs(g), kind="stable")


def argmax_ratio(gains: np.ndarray, costs: np.ndarray) -> int:
    """The k (1-based) that maximises gains[k-1] / costs[k-1]; the smallest such k on ties."""
    ratio = np.asarray(gains, np.float64) / np.asarray(costs, np.float64)
    return int(np.argmax(ratio)) + 1


def choose_k(g: np.ndarray, cost) -> tuple[int, np.ndarray]:
    """The rule: k* = argmax_k ||T_k(g)||² / cost(k), with `cost` a function of an array of k = 1..d.
    Returns k* and the magnitude order of g (T_k*(g) keeps order[:k*])."""
    g = np.asarray(g, np.float64).reshape(-1)
    order = magnitude_order(g)
    gains = np.cumsum(g[order] ** 2)
    return argmax_ratio(gains, cost(np.arange(1, g.size + 1))), order


def top_k(g: np.ndarray, k: int) -> np.ndarray:
    """T_k(g): g with all but its k entries of largest magnitude set to zero."""
    g = np.asarray(g)
    out = np.zeros_like(g).reshape(-1)
    keep = magnitude_order(g)[:k]
    out[keep] = g.reshape(-1)[keep]
    return out.reshape(g.shape)


# ---------------------------------------------------------------------------------------------------------
# Bits: index + value per kept entry, plus an optional cost per message

def index_bits(d: int) -> int:
    """⌈log2 d⌉: the bits of an index into d entries (0 for d = 1)."""
    if d < 1:
        raise ValueError(f"dimension must be positive, got {d}")
    return (d - 1).bit_length()


@dataclass(frozen=True)
class BitCost:
    """C(k) in bits for k kept entries of a d-vector: k·(⌈log2 d⌉ + 32) payload bits, cut into messages of
    at most `max_payload` payload bits (entries are not split over messages; None: one message), each
    message costing `per_message` bits more (0: the payload-only model)."""
    d: int
    per_message: int = 0
    max_payload: int | None = None
    value_bits: int = 32

    def __post_init__(self):
        if self.per_message < 0:
            raise ValueError("per_message must be >= 0")
        if self.max_payload is not None and self.max_payload < self.entry_bits:
            raise ValueError(f"a message of {self.max_payload} payload bits cannot carry one "
                             f"{self.entry_bits}-bit entry")

    @property
    def entry_bits(self) -> int:
        return index_bits(self.d) + self.value_bits

    @property
    def entries_per_message(self) -> int | None:
        return None if self.max_payload is None else self.max_payload // self.entry_bits

    def messages(self, k):
        k = np.asarray(k, np.int64)
        if self.entries_per_message is None:
            return np.ones_like(k)
        return np.maximum(1, -(-k // self.entries_per_message))

    def __call__(self, k):
        k = np.asarray(k, np.int64)
        return k * self.entry_bits + self.messages(k) * self.per_message

    @property
    def values_per_dense_message(self) -> int | None:
        return None if self.max_payload is None else self.max_payload // self.value_bits

    @property
    def dense_bits(self) -> int:
        """All d values without indices (`value_bits` each, in index order), cut into messages like the
        entries: what `encode_dense` emits. Sparse k entries are worth sending only below this."""
        per = self.values_per_dense_message
        messages = 1 if per is None else -(-self.d // per)
        return self.d * self.value_bits + messages * self.per_message

    def describe(self) -> str:
        s = f"{index_bits(self.d)}+{self.value_bits} bits per entry"
        if self.per_message:
            s += f", {self.per_message} bits per message"
        if self.max_payload is not None:
            s += f", at most {self.entries_per_message} entries per message"
        return s


def _bits(values: np.ndarray, width: int) -> np.ndarray:
    """Each value as `width` bits, most significant first: (n, width) uint8."""
    if width == 0:
        return np.zeros((len(values), 0), np.uint8)
    v = np.asarray(values, np.uint64)[:, None]
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
    return ((v >> shifts) & np.uint64(1)).astype(np.uint8)


def encode_sparse(indices: np.ndarray, values: np.ndarray, cost: BitCost) -> list[np.ndarray]:
    """The messages that carry the entries (indices[i], values[i]) under `cost`: each a uint8 array of bits,
    a header of cost.per_message bits (zeros: it stands for the technology's framing, which is not
    modelled further) then, per entry, the index in ⌈log2 d⌉ bits and the value as IEEE float32 bits.
    The bits emitted are exactly cost(len(indices)) (tests/test_compression.py)."""
    indices = np.asarray(indices, np.int64).reshape(-1)
    if indices.size and (indices.min() < 0 or indices.max() >= cost.d):
        raise ValueError("index out of range")
    raw = np.asarray(values, np.float32).reshape(-1).view(np.uint32)
    if raw.size != indices.size:
        raise ValueError("one value per index")
    if cost.value_bits != 32:
        raise ValueError("the encoder sends float32 values (value_bits = 32)")
    entries = np.hstack([_bits(indices, index_bits(cost.d)), _bits(raw, 32)])
    per = cost.entries_per_message or max(1, len(entries))
    header = np.zeros(cost.per_message, np.uint8)
    chunks = [entries[i:i + per] for i in range(0, max(1, len(entries)), per)]
    return [np.concatenate([header, c.reshape(-1)]) for c in chunks]


def encode_dense(values: np.ndarray, cost: BitCost) -> list[np.ndarray]:
    """The messages that carry all cost.d values without indices: each a header of cost.per_message bits
    then float32 values in index order; exactly cost.dense_bits bits (tests/test_compression.py)."""
    raw = np.asarray(values, np.float32).reshape(-1).view(np.uint32)
    if raw.size != cost.d:
        raise ValueError(f"a dense message carries all {cost.d} values, got {raw.size}")
    if cost.value_bits != 32:
        raise ValueError("the encoder sends float32 values (value_bits = 32)")
    bits = _bits(raw, 32)
    per = cost.values_per_dense_message or cost.d
    header = np.zeros(cost.per_message, np.uint8)
    return [np.concatenate([header, bits[i:i + per].reshape(-1)]) for i in range(0, cost.d, per)]


def decode_dense(messages: list[np.ndarray], cost: BitCost) -> np.ndarray:
    """The float32 values of `encode_dense`'s messages."""
    bits = np.vstack([m[cost.per_message:].reshape(-1, 32) for m in messages])
    weights = np.uint64(1) << np.arange(31, -1, -1, dtype=np.uint64)
    return (bits.astype(np.uint64) * weights).sum(axis=1).astype(np.uint32).view(np.float32)


def decode_sparse(messages: list[np.ndarray], cost: BitCost) -> tuple[np.ndarray, np.ndarray]:
    """Indices and float32 values from `encode_sparse`'s messages."""
    ib = index_bits(cost.d)
    rows = [m[cost.per_message:].reshape(-1, cost.entry_bits) for m in messages]
    bits = np.vstack(rows) if rows else np.zeros((0, cost.entry_bits), np.uint8)
    weights = lambda w: (np.uint64(1) << np.arange(w - 1, -1, -1, dtype=np.uint64))
    idx = (bits[:, :ib].astype(np.uint64) * weights(ib)).sum(axis=1) if ib else np.zeros(len(bits), np.uint64)
    raw = (bits[:, ib:].astype(np.uint64) * weights(32)).sum(axis=1).astype(np.uint32)
    return idx.astype(np.int64), raw.view(np.float32)


def emitted_bits(messages: list[np.ndarray]) -> int:
    return int(sum(m.size for m in messages))


# ---------------------------------------------------------------------------------------------------------
# ZeroSum bytes

def zerosum_prefix_bytes(order: np.ndarray, nblocks: int, block_size: int, has_data: np.ndarray | None = None,
                         columns: int = 2048, max_datagram: int = P.MAX_DATAGRAM) -> np.ndarray:
    """ZeroSum bytes one worker sends when the common set of blocks is order[:k], for k = 1..len(order):
    exactly `wire_bytes(contribution, rounds=set)` where the contribution has data in the blocks of the
    set for which `has_data` is true (default: all) and a header-only entry in the others. Every worker
    sending the same set, there are no other rounds. With at least as many columns as blocks (each block
    its own column, round 0) this is a closed form; otherwise each k is counted by `wire_bytes`."""
    order = np.asarray(order, np.int64)
    has = np.ones(nblocks, bool) if has_data is None else np.asarray(has_data, bool)
    cols = min(columns, nblocks)
    room = max_datagram - P.PACKET_HEADER_SIZE
    per_block = block_size * P.WIRE_VALUE.itemsize
    k = np.arange(1, len(order) + 1)
    if cols == nblocks:
        payload = np.cumsum(has[order]) * per_block
        boot = -(-cols * P.ENTRY_SIZE // room)
        round0 = k * P.ENTRY_SIZE + payload
        datagrams = boot + -(-round0 // room)
        return (cols + k) * P.ENTRY_SIZE + payload + datagrams * P.PACKET_HEADER_SIZE
    out = np.empty(len(order), np.int64)
    for i in range(len(order)):
        chosen = np.zeros(nblocks, bool)
        chosen[order[:i + 1]] = True
        contribution = np.repeat((chosen & has).astype(np.float32), block_size)
        out[i] = wire_bytes(contribution, block_size, max_datagram, columns, rounds=chosen)
    return out


def common_blocks_bytes(k, nblocks: int, block_size: int = 256, columns: int = 2048,
                        max_datagram: int = P.MAX_DATAGRAM):
    """Bytes a worker sends for k of nblocks blocks when the other workers send the same k: one bootstrap
    entry per column, an entry plus payload per block (the entries and payload of `wire_cost` without
    `rounds`), and a datagram header per datagram's room of the whole (`wire_cost` counts a datagram per
    round at least; where the k blocks lie is not needed here). `zerosum_prefix_bytes` is exact."""
    k = np.asarray(k)
    body = (min(columns, nblocks) + k) * P.ENTRY_SIZE + k * block_size * P.WIRE_VALUE.itemsize
    return body + np.ceil(body / (max_datagram - P.PACKET_HEADER_SIZE)) * P.PACKET_HEADER_SIZE


def choose_blocks(rows: np.ndarray, has_data: np.ndarray | None = None, columns: int = 2048,
                  max_datagram: int = P.MAX_DATAGRAM) -> tuple[int, np.ndarray]:
    """The rule on whole blocks with ZeroSum's cost: rows is the (blocks, block_size) gradient (the
    aggregate, when every worker sends the chosen set); k* maximises ||T_k(rows)||² / zerosum bytes(k),
    T_k keeping the k blocks of largest norm. Returns k* and the block order (the set is order[:k*])."""
    rows = np.asarray(rows, np.float64)
    norms = np.einsum("ij,ij->i", rows, rows)
    order = magnitude_order(norms)
    gains = np.cumsum(norms[order])
    costs = zerosum_prefix_bytes(order, len(rows), rows.shape[1], has_data, columns, max_datagram)
    return argmax_ratio(gains, costs), order


# ---------------------------------------------------------------------------------------------------------
# Tracking the best level online

def level_grid(d: int, sparse_cost, dense_cost: float, ratio: float = 2 ** 0.25) -> np.ndarray:
    """The levels `LevelTracker` moves over, from dense down: d (every entry, sent in the cheaper format),
    then round(d / ratio^j), j = 1, 2, ..., down to 1, keeping only the k whose sparse cost is below
    dense_cost (a larger k would cost more than sending all d values without indices and move fewer).
    `sparse_cost` is a function of an array of k; duplicates after rounding are dropped."""
    ks = {int(round(d / ratio ** j)) for j in range(1, int(np.ceil(np.log(d) / np.log(ratio))) + 2)}
    ks = np.array(sorted((k for k in ks if 1 <= k < d), reverse=True), np.int64)
    cheaper = ks[np.asarray(sparse_cost(ks)) < dense_cost] if ks.size else ks
    return np.r_[d, cheaper].astype(np.int64)


class LevelTracker:
    """Chooses the compression level online by the measured improvement per communicated bit, the quantity
    Khirirat et al. (arXiv:2003.06377) maximise, but measured over many steps instead of bounded for one.

    The one-step rule k* = argmax ||T_k(g)||²/C(k) is greedy: the entries it prizes are the largest now,
    and after a few steps of small k the gradient is flat and each entry buys less (docs/compression.md,
    E4: it never reached the best fixed k). Over a segment of steps at one level, the progress that counts
    for the bits to a target is the decrease of log(f − f*); it is measured here through the potential
    log ||∇f||², which differs from log(f − f*) by at most log(L/μ) on an L-smooth, μ-PL function
    (2μ(f − f*) ≤ ||∇f||² ≤ 2L(f − f*): the left side is the Polyak–Łojasiewicz inequality, Polyak 1963,
    Karimi, Nutini & Schmidt, ECML-PKDD 2016, §2; the right side the descent lemma at x − ∇f(x)/L), so
    over long segments the two rates agree. A segment's score is

        (potential at its start − potential at its end) / bits sent in it.

    The levels lie on one axis (`level_grid`: d, then geometrically smaller k). The tracker plays its
    current level for a segment, then a neighbour (one level down, then one up, alternating) for a segment
    of the same bits, and moves to the neighbour when it scored higher: compass search (Kolda, Lewis &
    Torczon, "Optimization by direct search", SIAM Review 45(3), 2003) on a discrete axis with noisy
    evaluations, each comparison between adjacent segments so that the slow change of the rate over the
    run affects both alike. The first `warmup` share of each segment's bits is not scored: right after a
    switch to a smaller k the largest entries go first and the potential drops faster than it will. A
    probe that fails doubles the number of current segments before the next probe in that direction
    (exponential back-off), a move resets them, so that where the best level is the current one,
    exploring costs a vanishing share. No regret bound is claimed; E4 (docs/compression.md) measures it
    against the best fixed level in hindsight: 0.95–1.08× of it and below dense GD without indices in
    every run, missing 1.05× where a run is a few dozen dense steps long (the walk down from dense takes
    a large share) and on a long held-out run, where top-k flattening the gradient makes ||∇f||² fall
    faster than f − f* and drifts it to small k (`GapLevelTracker` scores f itself).

        tracker = LevelTracker(levels, segment_bits)
        k = tracker.choose(np.log(g @ g), bits_sent_so_far)      # before each step
    """

    restore_new = True      # a checkpoint may hold one that a fresh compressor has not made yet (per key)

    def __init__(self, levels, segment_bits: float, start: int = 0, margin: float = 0.0, warmup: float = 0.0):
        self.levels = np.asarray(levels, np.int64)
        if not self.levels.size:
            raise ValueError("no levels")
        if segment_bits <= 0:
            raise ValueError("segment_bits must be positive")
        if not 0 <= warmup < 1:
            raise ValueError("warmup is a share of a segment's bits, in [0, 1)")
        self.segment_bits, self.margin, self.warmup = float(segment_bits), margin, warmup
        self.current = self.active = start
        self.direction = 1                      # +1: toward the end of `levels` (smaller k)
        self.wait = {1: 1, -1: 1}               # current segments before the next probe, per direction
        self.since_probe = 0
        self.probing = False
        self.current_score = None
        self.segment_start = None               # (potential, bits) where the segment's level began
        self.scored_from = None                 # (potential, bits) where its scored part began
        self.segments: list[tuple[int, float]] = []      # (level, score) of every finished segment

    def _neighbour(self) -> int | None:
        for direction in (self.direction, -self.direction):
            if 0 <= self.current + direction < len(self.levels):
                self.direction = direction
                return self.current + direction
        return None

    def _end_segment(self, score: float) -> None:
        self.segments.append((int(self.levels[self.active]), score))
        if self.probing:
            if score > self.current_score + self.margin * abs(self.current_score):
                self.current = self.active
                self.wait = {1: 1, -1: 1}
            else:
                self.wait[self.direction] *= 2
                self.direction = -self.direction
            self.probing, self.active = False, self.current
            return
        self.current_score = score
        self.since_probe += 1
        neighbour = self._neighbour()
        if neighbour is not None and self.since_probe >= self.wait[self.direction]:
            self.probing, self.active, self.since_probe = True, neighbour, 0

    def _score(self, start: tuple[float, float], end: tuple[float, float]) -> float:
        """A segment's score from its observations (potential, bits) where scoring began and at its end."""
        return (start[0] - end[0]) / (end[1] - start[1])

    def choose(self, potential: float, bits: float) -> int:
        """The level for the next step, given the potential now (log ||∇f||²) and the bits sent so far."""
        now = (potential, bits)
        if self.segment_start is None:
            self.segment_start = now
        if self.scored_from is None and bits - self.segment_start[1] >= self.warmup * self.segment_bits:
            self.scored_from = now
        if bits - self.segment_start[1] >= self.segment_bits and bits > self.scored_from[1]:
            self._end_segment(self._score(self.scored_from, now))
            self.segment_start, self.scored_from = now, None
            if self.warmup == 0:
                self.scored_from = self.segment_start
        return int(self.levels[self.active])


class GapLevelTracker(LevelTracker):
    """`LevelTracker` with the potential log(f(x) − ℓ) instead of log ||∇f(x)||², ℓ the largest lower bound
    on f* given so far, applied to both ends of a segment when it ends (so that a later, tighter bound
    rescales both alike). For a μ-strongly convex f, f* ≥ f(x) − ||∇f(x)||²/(2μ) at every x (the minimum
    over y of the lower bound f(x) + ∇f(x)ᵀ(y − x) + μ/2·||y − x||²), a bound that tightens as ∇f → 0;
    with ℓ = f* (an oracle) a segment's score is the decrease of log(f − f*) per bit, the quantity the
    bits to a target depend on. Unlike ||∇f||², f − ℓ does not drop when top-k flattens the gradient.

        tracker.choose_gap(f(x), f(x) - g @ g / (2 * mu), bits_sent_so_far)
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lower = -np.inf

    def _score(self, start, end) -> float:
        gap = lambda value: max(value - self.lower, np.finfo(float).tiny)
        return (np.log(gap(start[0])) - np.log(gap(end[0]))) / (end[1] - start[1])

    def choose_gap(self, value: float, lower: float, bits: float) -> int:
        """The level for the next step, given f(x) now, a lower bound on f*, and the bits sent so far."""
        self.lower = max(self.lower, lower)
        return self.choose(value, bits)


# ---------------------------------------------------------------------------------------------------------
# The rule inside error feedback (the previous E4)

class AdaptiveTopKBlocks(TopKBlocks):
    """Top-k blocks with error feedback, k chosen on each call by k* = argmax ||T_k(rows)||² / cost(k) on
    this worker's corrected gradient (gradient plus stored remainder). This is not the paper's setting:
    the descent-lemma argument behind the rule is for plain compressed gradient descent, and inside error
    feedback more blocks buy bytes rather than progress; its cost omits the header-only entries this
    worker sends for the other workers' blocks (what they send is not known when k is chosen). Kept for
    the DDP hook and for comparison; docs/compression.md, E4."""

    def __init__(self, columns: int = 2048, max_datagram: int = P.MAX_DATAGRAM, error_feedback: bool = True,
                 block_size: int = 256):
        super().__init__(density=1.0, error_feedback=error_feedback, block_size=block_size)
        self.columns, self.max_datagram = columns, max_datagram
        self.history: list[int] = []

    def cost(self, k: np.ndarray, nblocks: int) -> np.ndarray:
        """Bytes a worker sends for k blocks (`common_blocks_bytes`)."""
        return common_blocks_bytes(k, nblocks, self.block_size, self.columns, self.max_datagram)

    def choose_k(self, rows: np.ndarray, key="default") -> int:
        norms = np.sort(np.einsum("ij,ij->i", rows, rows))[::-1]
        k = np.arange(1, len(rows) + 1)
        gain = np.cumsum(norms) / self.cost(k, len(rows))
        best = int(k[np.argmax(gain)])
        self.history.append(best)
        return best
