"""Data and parameter placement for block-sparse allreduce: which worker trains on which samples, and
which parameters share a block.

ZeroSum sends a worker's gradient block by block and skips the blocks that are all zero, so what a
step costs follows how many blocks each worker's samples touch and how many blocks the workers touch
together. Both depend on placement:

1. **Data -> workers** (`partition_samples`). The samples and the parameter blocks form a bipartite
   graph (an edge where a sample has a non-zero feature in a block). A partition of the samples that
   cuts few edges gives every worker a shard whose samples share blocks among themselves and not with
   the other shards: fewer non-zero blocks per worker, and block sets that overlap little. The graph is
   partitioned by METIS (`pymetis`, multilevel k-way / recursive bisection) with balanced sample
   counts; "random" (a balanced random split) and "round_robin" are the baselines.
2. **Parameters -> blocks** (`feature_permutation`). A permutation of the features (or embedding rows)
   so that features used together land in the same blocks: "frequency" puts the hot features first
   (a minibatch's features then fill a few dense blocks instead of touching one block each);
   "cooccurrence" first groups the features by the set of shards that use them (the partitioner's
   order: the data partition of step 1, or a METIS partition into `groups` parts), hot first within a
   group.
   The model and the data are permuted once at set-up (`Permutation.apply_columns`,
   `permute_vector`); `unpermute_vector` maps the trained model back, exactly (it is indexing only).
3. **The trade-off** (`tradeoff`). Partitioning takes time before training starts; it pays back only
   after enough steps. `Assignment.seconds` and `Permutation.seconds` measure it, `block_footprint`
   predicts the blocks and wire bytes per step, and `tradeoff` gives the break-even number of steps
   (and "random" for a run too short to pay it back).

This follows Yubin Duan, Ning Wang and Jie Wu, "Minimizing Training Time of Distributed Machine Learning
by Reducing Data Communication", IEEE Transactions on Network Science and Engineering, 2021 (built on
PS-lite): placing training samples on workers and parameters on servers is a bipartite graph
partitioning problem (NP-complete); their two-step heuristic first partitions the data, then the
parameters given the data partition, uses a multilevel graph partitioner for the bipartite graph, and
weighs the partitioning time against the training time it saves; they report up to 14x less
communication than a random partition. Here the "servers" are the blocks of ZeroSum's tensor: step 2
assigns parameters to blocks, not to machines.

All functions are pure (no I/O) and deterministic for fixed seeds: every rank that calls them with the
same inputs gets the same result, so the assignment can be computed on every rank instead of being
sent. Needs scipy; the "metis" methods need pymetis (the `layout` extra: pip install -e '.[layout]').
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from . import protocol as P

SAMPLE_METHODS = ("metis", "random", "round_robin")
FEATURE_METHODS = ("identity", "frequency", "cooccurrence")


# -- input checks -------------------------------------------------------------------------------------

def _csr(X, name: str = "X") -> sp.csr_matrix:
    """X as a CSR matrix with sorted indices, or a clear error."""
    if not sp.issparse(X):
        raise TypeError(f"{name} must be a scipy.sparse matrix (samples x features), not {type(X).__name__}; "
                        "for embedding row ids use ids_to_csr(ids, rows)")
    if X.ndim != 2:
        raise ValueError(f"{name} must be 2-D (samples x features), got shape {X.shape}")
    X = sp.csr_matrix(X)
    if X.nnz and not X.data.all():           # stored zeros touch no block
        X = X.copy()
        X.eliminate_zeros()
    if not X.has_sorted_indices:
        X = X.copy()
        X.sort_indices()
    return X


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _parts(parts, samples: int, workers: int | None = None) -> tuple[np.ndarray, int]:
    parts = np.asarray(parts)
    if parts.ndim != 1 or parts.shape[0] != samples:
        raise ValueError(f"parts must have one entry per sample ({samples}), got shape {parts.shape}")
    if parts.size and not np.issubdtype(parts.dtype, np.integer):
        raise ValueError(f"parts must be integers, got {parts.dtype}")
    parts = parts.astype(np.int64)
    if workers is None:
        workers = int(parts.max()) + 1 if parts.size else 1
    if parts.size and (parts.min() < 0 or parts.max() >= workers):
        raise ValueError(f"parts must be in 0..{workers - 1}")
    return parts, workers


def ids_to_csr(ids, rows: int) -> sp.csr_matrix:
    """An embedding model's lookups as a design matrix: `ids` (samples x lookups, or one id per sample)
    of row ids below `rows` -> CSR samples x rows counting each sample's lookups of each row. Several
    tables: one matrix per table (each table is its own tensor), or offset the ids and hstack."""
    rows = _positive(rows, "rows")
    ids = np.asarray(ids)
    if ids.ndim == 1:
        ids = ids[:, None]
    if ids.ndim != 2:
        raise ValueError(f"ids must be samples x lookups, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be integers, got {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise ValueError(f"ids must be in 0..{rows - 1}")
    n, k = ids.shape
    X = sp.csr_matrix((np.ones(n * k, np.float32), ids.reshape(-1).astype(np.int64),
                       np.arange(0, n * k + 1, k, dtype=np.int64)), shape=(n, rows))
    X.sum_duplicates()
    return X


# -- blocks -------------------------------------------------------------------------------------------

def block_count(features: int, block_size: int, width: int = 1) -> int:
    """Blocks of `block_size` values in a tensor of `features` parameters of `width` values each."""
    return -(-features * width // block_size)


def sample_blocks(X, block_size: int, width: int = 1) -> sp.csr_matrix:
    """The sample-block incidence: CSR samples x blocks, entry = how many of the sample's features lie
    in the block. Feature j holds values j*width .. (j+1)*width-1 of the flattened tensor (width: the
    embedding dimension; 1 for a weight vector), so it is in blocks j*width // block_size up to
    ((j+1)*width - 1) // block_size."""
    X = _csr(X)
    block_size, width = _positive(block_size, "block_size"), _positive(width, "width")
    n, d = X.shape
    if block_size == 1 and width == 1:
        B = sp.csr_matrix((np.ones(X.nnz, np.int64), X.indices.astype(np.int64), X.indptr.astype(np.int64)),
                          shape=(n, d))
        B.sum_duplicates()
        return B
    first = np.arange(d, dtype=np.int64) * width // block_size
    last = ((np.arange(d, dtype=np.int64) + 1) * width - 1) // block_size
    span = last - first + 1
    rows = np.repeat(np.arange(d, dtype=np.int64), span)
    cols = np.repeat(first, span) + (np.arange(span.sum()) - np.repeat(np.cumsum(span) - span, span))
    F = sp.csr_matrix((np.ones(rows.size, np.int64), (rows, cols)), shape=(d, block_count(d, block_size, width)))
    ones = sp.csr_matrix((np.ones(X.nnz, np.int64), X.indices, X.indptr), shape=(n, d))
    B = sp.csr_matrix(ones @ F)
    B.sort_indices()
    return B


@dataclass(frozen=True)
class Footprint:
    """Non-zero blocks per worker and step: `per_worker[s, w]` blocks of worker w's gradient in step s,
    `union[s]` the blocks some worker has (the rounds of that allreduce, besides one bootstrap round
    per column). `overlap` is the mean number of workers that share a union block (1: disjoint block
    sets; `workers`: every worker has every block)."""
    block_size: int
    width: int
    nblocks: int
    workers: int
    per_worker: np.ndarray
    union: np.ndarray

    @property
    def steps(self) -> int:
        return int(self.union.shape[0])

    @property
    def mean_per_worker(self) -> float:
        return float(self.per_worker.mean()) if self.per_worker.size else 0.0

    @property
    def max_per_worker(self) -> float:
        """The busiest worker's blocks, averaged over steps."""
        return float(self.per_worker.max(axis=1).mean()) if self.per_worker.size else 0.0

    @property
    def mean_union(self) -> float:
        return float(self.union.mean()) if self.union.size else 0.0

    @property
    def overlap(self) -> float:
        live = self.union > 0
        if not live.any():
            return 0.0
        return float((self.per_worker[live].sum(axis=1) / self.union[live]).mean())

    @property
    def density(self) -> float:
        """Mean fraction of a worker's gradient blocks that are non-zero."""
        return self.mean_per_worker / self.nblocks if self.nblocks else 0.0

    def wire_bytes(self, columns: int) -> dict:
        """Predicted bytes per step and worker (entries and block data; without the 20-byte packet
        headers, joins and retransmissions), from the protocol's rules (docs/protocol.md): an
        allreduce has one bootstrap round per column (`columns` = min(slots x aggregators, blocks))
        plus one round per union block; in every round every worker sends a 16-byte entry, with its
        block's values (4 bytes each) if the block is one of its own, and receives the round's result
        entry, with the summed block's values for every union block."""
        columns = min(_positive(columns, "columns"), self.nblocks) if self.nblocks else 0
        data = self.block_size * P.WIRE_VALUE.itemsize
        rounds = self.union.astype(np.float64) + columns
        sent = P.ENTRY_SIZE * rounds[:, None] + data * self.per_worker
        received = P.ENTRY_SIZE * rounds + data * self.union
        return {"sent_mean": float(sent.mean()), "sent_max": float(sent.max(axis=1).mean()),
                "received": float(received.mean()), "rounds": float(rounds.mean())}

    def summary(self) -> dict:
        return {"block_size": self.block_size, "nblocks": self.nblocks, "workers": self.workers,
                "steps": self.steps, "mean_per_worker": self.mean_per_worker,
                "max_per_worker": self.max_per_worker, "mean_union": self.mean_union,
                "overlap": self.overlap, "density": self.density}


def block_footprint(X, parts, block_size: int, *, width: int = 1, workers: int | None = None,
                    batches=None) -> Footprint:
    """How many blocks each worker's gradient has non-zero, and how much the workers' block sets
    overlap. X: samples x features (CSR, in the column order the model uses); parts: the worker of
    every sample; batches: the steps' sample indices (e.g. `minibatch_indices`), each worker computing
    the samples of a step that it holds; None: one full-batch step over all samples."""
    X = _csr(X)
    n = X.shape[0]
    parts, workers = _parts(parts, n, workers)
    B = sample_blocks(X, block_size, width)
    if batches is None:
        batches = [np.arange(n)]
    per_worker = np.zeros((len(batches), workers), np.int64)
    union = np.zeros(len(batches), np.int64)
    seen = np.zeros(B.shape[1], np.int64)    # step-stamped marks: no per-step allocation of nblocks
    for s, batch in enumerate(batches):
        batch = np.asarray(batch, np.int64)
        if batch.size and (batch.min() < 0 or batch.max() >= n):
            raise ValueError(f"batch {s} names samples outside 0..{n - 1}")
        owner = parts[batch]
        total = 0
        for w in range(workers):
            blocks = np.unique(B[batch[owner == w]].indices)
            per_worker[s, w] = blocks.size
            fresh = blocks[seen[blocks] != s + 1]
            seen[fresh] = s + 1
            total += fresh.size
        union[s] = total
    return Footprint(block_size, width, B.shape[1], workers, per_worker, union)


def minibatch_indices(samples: int, batch: int, step: int, seed: int = 0) -> np.ndarray:
    """Step `step`'s global minibatch: `batch` sample indices drawn uniformly without replacement
    (sorted), from a generator seeded by (seed, step) alone. Every rank draws the same indices and
    computes the gradient of those it holds, so the sum over workers is the same whatever the
    placement: placement changes who computes what, not the step's result."""
    samples, batch = _positive(samples, "samples"), _positive(batch, "batch")
    if batch > samples:
        raise ValueError(f"batch ({batch}) is larger than the data set ({samples})")
    rng = np.random.default_rng([seed, step])
    return np.sort(rng.choice(samples, size=batch, replace=False))


# -- 1. data -> workers --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Assignment:
    """Which worker holds each sample. `parts[i]` is sample i's worker; `seconds` the time the
    assignment took (METIS and rebalancing; the footprint is not counted); `footprint` the full-batch
    block footprint at the block size it was made for; `edge_cut` METIS's objective (None for the
    baselines); `moved` samples moved after METIS to meet the balance tolerance."""
    parts: np.ndarray
    workers: int
    method: str
    seconds: float
    imbalance: float
    footprint: Footprint
    edge_cut: int | None = None
    moved: int = 0
    seed: int = 0

    @property
    def sizes(self) -> np.ndarray:
        return np.bincount(self.parts, minlength=self.workers)

    @property
    def blocks_per_worker(self) -> np.ndarray:
        """Non-zero blocks of each worker's full-batch gradient."""
        return self.footprint.per_worker[0]

    def summary(self) -> dict:
        sizes = self.sizes
        return {"method": self.method, "workers": self.workers, "seconds": self.seconds,
                "sizes_min": int(sizes.min()), "sizes_max": int(sizes.max()), "edge_cut": self.edge_cut,
                "moved": self.moved, "blocks_per_worker_mean": float(self.blocks_per_worker.mean()),
                "blocks_per_worker_max": int(self.blocks_per_worker.max()),
                "union": int(self.footprint.union[0]), "overlap": self.footprint.overlap}


def balance_limits(samples: int, workers: int, imbalance: float) -> tuple[int, int]:
    """The stated tolerance: every part holds between floor((1 - imbalance) n / W) and
    ceil((1 + imbalance) n / W) samples (n samples, W workers)."""
    mean = samples / workers
    lo = max(0, math.floor((1 - imbalance) * mean + 1e-9))
    hi = max(math.ceil((1 + imbalance) * mean - 1e-9), math.ceil(mean))
    return lo, hi


def _rebalance(parts: np.ndarray, workers: int, lo: int, hi: int, degree: np.ndarray) -> int:
    """Move samples until every part holds lo..hi: from the largest part to the smallest, the samples
    with the fewest edges first (they cost the fewest cut edges). Deterministic. (lo*W <= n <= hi*W,
    so every move is at least one sample and the loop ends.)"""
    moved = 0
    sizes = np.bincount(parts, minlength=workers)
    while sizes.max() > hi or sizes.min() < lo:
        src, dst = int(np.argmax(sizes)), int(np.argmin(sizes))
        if sizes[src] > hi:
            count = min(sizes[src] - hi, hi - sizes[dst])
        else:
            count = min(lo - sizes[dst], sizes[src] - lo)
        members = np.flatnonzero(parts == src)
        take = members[np.lexsort((members, degree[members]))[:count]]
        parts[take] = dst
        sizes[src] -= count
        sizes[dst] += count
        moved += int(count)
    return moved


def _metis(nparts: int, adjacency: sp.csr_matrix, vweights: np.ndarray, seed: int, imbalance: float):
    """METIS k-way partition of a symmetric CSR graph (edge weights = its values)."""
    try:
        import pymetis
    except ImportError:
        raise ImportError("method 'metis' needs pymetis: pip install pymetis "
                          "(or pip install -e '.[layout]')") from None
    options = pymetis.Options(seed=int(seed) & 0x7FFFFFFF, ufactor=max(1, int(round(imbalance * 1000))))
    xadj = adjacency.indptr.astype(np.int64)
    adjncy = adjacency.indices.astype(np.int64)
    eweights = adjacency.data.astype(np.int64)
    if hasattr(pymetis, "CSRAdjacency"):
        graph = {"adjacency": pymetis.CSRAdjacency(xadj, adjncy)}
    else:   # pymetis before 2025.2
        graph = {"xadj": xadj, "adjncy": adjncy}
    cut, part = pymetis.part_graph(nparts, **graph, vweights=vweights.astype(np.int64),
                                   eweights=eweights, options=options)
    return int(cut), np.asarray(part, np.int64)


def partition_samples(X, workers: int, block_size: int = 1, method: str = "metis", *, seed: int = 0,
                      imbalance: float = 0.03, width: int = 1) -> Assignment:
    """Assign the samples (rows of X) to `workers` workers with balanced counts.

    method "metis": partition the bipartite sample-block graph (samples and the blocks of
    `block_size` parameters, in X's column order, an edge weighted by how many of the sample's
    features lie in the block) with METIS; only samples carry weight, so METIS balances the sample
    counts, and a block ends up with the samples that use it most. Blocks used by a single sample
    cannot be cut and are left out of the graph. block_size=1 partitions the sample-feature graph,
    which does not depend on the feature order: the first step of the two-step heuristic, before
    `feature_permutation`. "random": a balanced random split; "round_robin": sample i to worker
    i mod W (the baselines).

    Balance: every worker gets between floor((1-imbalance)*n/W) and ceil((1+imbalance)*n/W) samples
    (`balance_limits`); METIS is asked for that (ufactor), and samples are moved afterwards if it
    missed (`Assignment.moved`). The result depends only on the inputs and `seed` (METIS's seed too).
    """
    X = _csr(X)
    workers = _positive(workers, "workers")
    block_size, width = _positive(block_size, "block_size"), _positive(width, "width")
    if method not in SAMPLE_METHODS:
        raise ValueError(f"method must be one of {', '.join(SAMPLE_METHODS)}, got {method!r}")
    if not 0 <= imbalance < 1:
        raise ValueError(f"imbalance must be in [0, 1), got {imbalance}")
    n = X.shape[0]
    if n < workers:
        raise ValueError(f"cannot assign {n} samples to {workers} workers: every worker needs a sample")
    lo, hi = balance_limits(n, workers, imbalance)
    t0 = time.perf_counter()
    cut, moved = None, 0
    if method == "round_robin":
        parts = np.arange(n, dtype=np.int64) % workers
    elif method == "random":
        rng = np.random.default_rng(seed)
        parts = np.empty(n, np.int64)
        parts[rng.permutation(n)] = np.arange(n, dtype=np.int64) % workers
    elif workers == 1:
        parts = np.zeros(n, np.int64)
    else:
        B = sample_blocks(X, block_size, width)
        keep = np.flatnonzero(np.diff(B.tocsc().indptr) >= 2)     # blocks that can be cut
        A = sp.csr_matrix(B[:, keep])
        graph = sp.bmat([[None, A], [A.T, None]], format="csr")
        graph.sort_indices()
        vweights = np.r_[np.ones(n, np.int64), np.zeros(keep.size, np.int64)]
        cut, part = _metis(workers, graph, vweights, seed, imbalance)
        parts = part[:n].copy()
        moved = _rebalance(parts, workers, lo, hi, np.diff(A.indptr))
    seconds = time.perf_counter() - t0
    sizes = np.bincount(parts, minlength=workers)
    footprint = block_footprint(X, parts, block_size, width=width, workers=workers)
    return Assignment(parts, workers, method, seconds, float(sizes.max() / (n / workers) - 1), footprint,
                      cut, moved, seed)


# -- 2. parameters -> blocks ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Permutation:
    """A permutation of d features. `forward[old] = new` position, `inverse[new] = old`. Permute the
    data with `apply_columns` (or `apply_ids` for embedding lookups) and the model with
    `permute_vector`; `unpermute_vector` brings a vector (or a table whose rows are the features) back
    to the original order. Pure indexing: round trips are exact."""
    forward: np.ndarray
    inverse: np.ndarray
    method: str = "identity"
    seconds: float = 0.0
    groups: np.ndarray | None = field(default=None, compare=False)   # each new position's group (cooccurrence)

    def __post_init__(self):
        d = self.forward.shape[0]
        if self.forward.ndim != 1 or self.inverse.shape != (d,) \
                or not np.array_equal(self.forward[self.inverse], np.arange(d)):
            raise ValueError("forward and inverse must be inverse permutations of 0..d-1")

    @classmethod
    def from_order(cls, order, method: str = "custom", seconds: float = 0.0, groups=None) -> "Permutation":
        """From the old indices listed in their new order (new position j holds old feature order[j])."""
        order = np.asarray(order)
        if order.ndim != 1 or (order.size and not np.issubdtype(order.dtype, np.integer)):
            raise ValueError("order must be a 1-D integer array")
        d = order.shape[0]
        order = order.astype(np.int64)
        if d and (order.min() < 0 or order.max() >= d or np.bincount(order, minlength=d).max() != 1):
            raise ValueError(f"order must list every index 0..{d - 1} exactly once")
        forward = np.empty(d, np.int64)
        forward[order] = np.arange(d, dtype=np.int64)
        return cls(forward, order, method, seconds, groups)

    @classmethod
    def identity(cls, features: int) -> "Permutation":
        idx = np.arange(features, dtype=np.int64)
        return cls(idx, idx.copy(), "identity")

    @property
    def size(self) -> int:
        return int(self.forward.shape[0])

    def apply_columns(self, X) -> sp.csr_matrix:
        """X (samples x features) with its columns in the new order: column forward[j] of the result is
        column j of X."""
        X = _csr(X)
        if X.shape[1] != self.size:
            raise ValueError(f"X has {X.shape[1]} columns, the permutation {self.size}")
        out = sp.csr_matrix((X.data.copy(), self.forward[X.indices], X.indptr.copy()), shape=X.shape)
        out.sort_indices()
        return out

    def apply_ids(self, ids) -> np.ndarray:
        """Feature (row) ids in the new numbering."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.size):
            raise ValueError(f"ids must be in 0..{self.size - 1}")
        return self.forward[ids]

    def _check(self, v):
        v = np.asarray(v)
        if v.ndim < 1 or v.shape[0] != self.size:
            raise ValueError(f"expected {self.size} rows (one per feature), got shape {v.shape}")
        return v

    def permute_vector(self, v) -> np.ndarray:
        """A model vector (or a table with one row per feature) in the new order."""
        return self._check(v)[self.inverse]

    def unpermute_vector(self, v) -> np.ndarray:
        """The inverse of `permute_vector`: back to the original order."""
        return self._check(v)[self.forward]


def feature_permutation(X, block_size: int = 1, method: str = "frequency", *, parts=None,
                        workers: int | None = None, groups: int = 16, seed: int = 0) -> Permutation:
    """A permutation of X's columns (features, embedding rows) that puts features used together in
    the same blocks.

    "identity": no change. "frequency": by the number of samples that use a feature, most used first
    (ties by index; unused features last). "cooccurrence": the second step of the two-step heuristic,
    given the data partition `parts` (the worker of every sample): features are grouped by the set of
    workers whose samples use them -- first the features only one worker uses (worker 0's, worker 1's,
    ...), then those two workers share, and so on; unused features last -- and sorted by frequency
    within a group. A block then holds features of one group, so it is non-zero only for that group's
    workers, and a minibatch's hot features share blocks. Without `parts`, the samples are first
    partitioned into `groups` parts by METIS on the sample-feature graph (with `seed`), so features
    that occur in the same samples end up together. block_size is accepted for symmetry with the
    other functions; the order does not depend on it.
    """
    X = _csr(X)
    _positive(block_size, "block_size")
    if method not in FEATURE_METHODS:
        raise ValueError(f"method must be one of {', '.join(FEATURE_METHODS)}, got {method!r}")
    n, d = X.shape
    t0 = time.perf_counter()
    if method == "identity":
        perm = Permutation.identity(d)
        return Permutation(perm.forward, perm.inverse, method, time.perf_counter() - t0)
    counts = np.bincount(X.indices, minlength=d).astype(np.int64)
    idx = np.arange(d, dtype=np.int64)
    if method == "frequency":
        order = np.lexsort((idx, -counts))
        return Permutation.from_order(order, method, time.perf_counter() - t0)
    if parts is None:
        parts = partition_samples(X, _positive(groups, "groups"), 1, "metis", seed=seed).parts
        workers = groups
    parts, workers = _parts(parts, n, workers)
    # used[w, f]: whether any of worker w's samples uses feature f
    rows = np.repeat(parts, np.diff(X.indptr))
    used = np.zeros((workers, d), bool)
    used[rows, X.indices] = True
    users = used.sum(axis=0)
    size = np.where(users == 0, workers + 1, users)        # one worker's features first, unused last
    order = np.lexsort((idx, -counts, *[~used[w] for w in range(workers - 1, -1, -1)], size))
    sorted_used = used[:, order]
    change = np.r_[True, (np.diff(size[order]) != 0) | (sorted_used[:, 1:] != sorted_used[:, :-1]).any(axis=0)]
    return Permutation.from_order(order, method, time.perf_counter() - t0, groups=np.cumsum(change) - 1)


# -- 4. the trade-off -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TradeOff:
    """Partitioning time against the time it saves per step. `break_even_steps`: steps after which the
    placement has paid for itself (inf if it saves nothing)."""
    partition_seconds: float
    saved_seconds_per_step: float
    break_even_steps: float
    basis: str

    def pick(self, steps: int) -> str:
        """"partitioned" if a run of `steps` steps pays the partitioning back, else "random"."""
        return "partitioned" if steps > self.break_even_steps else "random"

    def net_seconds(self, steps: int) -> float:
        """Seconds a run of `steps` steps saves overall (negative: partitioning costs more)."""
        return steps * self.saved_seconds_per_step - self.partition_seconds


def tradeoff(partition_seconds: float, *, baseline_bytes: float | None = None, placed_bytes: float | None = None,
             link_bits_per_second: float | None = None, baseline_step_seconds: float | None = None,
             placed_step_seconds: float | None = None) -> TradeOff:
    """Weigh `partition_seconds` against the time saved per step, either predicted from the bytes per
    step on the busiest worker's link (`baseline_bytes`, `placed_bytes` at `link_bits_per_second`;
    e.g. from `Footprint.wire_bytes`) or measured (`baseline_step_seconds`, `placed_step_seconds`)."""
    if partition_seconds < 0:
        raise ValueError(f"partition_seconds must be >= 0, got {partition_seconds}")
    measured = baseline_step_seconds is not None or placed_step_seconds is not None
    predicted = baseline_bytes is not None or placed_bytes is not None or link_bits_per_second is not None
    if measured == predicted:
        raise ValueError("give either baseline_bytes, placed_bytes and link_bits_per_second (predicted) "
                         "or baseline_step_seconds and placed_step_seconds (measured)")
    if predicted:
        if baseline_bytes is None or placed_bytes is None or not link_bits_per_second:
            raise ValueError("a prediction needs baseline_bytes, placed_bytes and link_bits_per_second > 0")
        if link_bits_per_second <= 0:
            raise ValueError(f"link_bits_per_second must be > 0, got {link_bits_per_second}")
        saved = (baseline_bytes - placed_bytes) * 8.0 / link_bits_per_second
        basis = f"bytes at {link_bits_per_second:g} bit/s"
    else:
        if baseline_step_seconds is None or placed_step_seconds is None:
            raise ValueError("a measurement needs baseline_step_seconds and placed_step_seconds")
        saved = baseline_step_seconds - placed_step_seconds
        basis = "measured step time"
    break_even = partition_seconds / saved if saved > 0 else math.inf
    return TradeOff(float(partition_seconds), float(saved), float(break_even), basis)


# -- synthetic data ---------------------------------------------------------------------------------------

def planted_clusters(samples: int, features: int, clusters: int, *, nnz: int = 20, zipf: float = 1.1,
                     noise: float = 0.1, seed: int = 0):
    """Sparse binary data with planted clusters and Zipf feature frequencies, for tests and experiments.

    The features are split into `clusters` equal pools; sample i belongs to a random cluster and draws
    Poisson(`nnz`) features (at least 1): each from its cluster's pool with probability 1 - `noise`,
    else from all features, by Zipf popularity (rank r drawn with probability proportional to
    (r+1)^-zipf; the ranks of the global draw follow a random order of all features). Duplicates
    collapse. Feature ids are then scrambled by a random permutation, as hashed features are, so the
    given column order carries no structure. Labels: y = [x.w* / sqrt(nnz) + 0.5 e > 0] for a hidden
    w* ~ N(0, 1) and e ~ N(0, 1). Returns (X: CSR float32 samples x features with values 1, y: float32
    0/1, cluster of every sample)."""
    samples, features = _positive(samples, "samples"), _positive(features, "features")
    clusters, nnz = _positive(clusters, "clusters"), _positive(nnz, "nnz")
    if clusters > features:
        raise ValueError(f"clusters ({clusters}) cannot exceed features ({features})")
    if not 0 <= noise <= 1:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    if zipf < 0:
        raise ValueError(f"zipf must be >= 0, got {zipf}")
    rng = np.random.default_rng(seed)
    cluster = rng.integers(0, clusters, samples)
    counts = np.maximum(rng.poisson(nnz, samples), 1)
    own = rng.binomial(counts, 1 - noise)
    pool = features // clusters

    def zipf_ranks(size: int, m: int) -> np.ndarray:
        cdf = np.cumsum(np.arange(1, size + 1, dtype=np.float64) ** -zipf)
        return np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(m), side="right"), size - 1)

    who_own = np.repeat(np.arange(samples), own)
    feat_own = cluster[who_own] * pool + zipf_ranks(pool, who_own.size)
    who_any = np.repeat(np.arange(samples), counts - own)
    feat_any = rng.permutation(features)[zipf_ranks(features, who_any.size)]
    rows = np.r_[who_own, who_any]
    scramble = rng.permutation(features)
    cols = scramble[np.r_[feat_own, feat_any]]
    X = sp.csr_matrix((np.ones(rows.size, np.float32), (rows, cols)), shape=(samples, features))
    X.sum_duplicates()
    X.data[:] = 1.0
    w_true = rng.standard_normal(features)
    margin = X @ w_true / math.sqrt(nnz)
    y = (margin + 0.5 * rng.standard_normal(samples) > 0).astype(np.float32)
    return X, y, cluster
