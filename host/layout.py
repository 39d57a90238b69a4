"""How blocks map to columns, columns to aggregators and aggregator slots (OmniReduce striping).

With A aggregators each granting P slots there are S = min(A*P, nblocks) columns. Block b belongs to
column b % S; column g is served by aggregator g % A in its local slot g // A. Every worker computes the
same layout from the same numbers, so no layout travels on the wire.

Striping balances the aggregators when non-zero blocks are spread evenly; a skewed workload (e.g. the
hot first rows of several embedding tables, whose starts fall on the same aggregator) can load one
aggregator with most of the rounds. `balanced_column_order` then places the block's column by measured
load instead: a permutation of the columns (logical column b % S -> the column whose slot serves it),
computed by every worker from the same summed history, so that the busiest aggregator carries close
to 1/A of the load.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Layout:
    aggregators: int
    slots_per_aggregator: int
    nblocks: int
    # logical column (b % S) -> the column that serves it; None: the identity (plain striping)
    column_order: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.column_order is not None and (
                len(self.column_order) != self.columns
                or not np.array_equal(np.sort(self.column_order), np.arange(self.columns))):
            raise ValueError(f"column_order must be a permutation of the {self.columns} columns")

    @property
    def columns(self) -> int:
        return min(self.aggregators * self.slots_per_aggregator, self.nblocks)

    def column_of_block(self, blocks: np.ndarray) -> np.ndarray:
        logical = blocks % self.columns
        return logical if self.column_order is None else self.column_order[logical]

    def aggregator_of(self, columns: np.ndarray) -> np.ndarray:
        return columns % self.aggregators

    def slots_used(self, aggregator: int) -> int:
        """How many local slots of `aggregator` hold a column."""
        return max(0, -(-(self.columns - aggregator) // self.aggregators))

    def aggregator_load(self, block_load: np.ndarray) -> np.ndarray:
        """The load each aggregator carries when block b costs block_load[b] (e.g. how often it was
        non-zero on any worker)."""
        cols = self.column_of_block(np.arange(self.nblocks))
        return np.bincount(self.aggregator_of(cols), weights=np.asarray(block_load, np.float64),
                           minlength=self.aggregators)


def balanced_column_order(block_load: np.ndarray, aggregators: int, slots_per_aggregator: int) -> np.ndarray:
    """A column order under which every aggregator carries about 1/A of `block_load` (one value per block).

    Longest-processing-time-first (Graham's LPT rule, within 4/3 of the optimum makespan): the logical
    columns, heaviest first, each go to the least-loaded aggregator that still has a free slot, ties to
    the lower index, so every worker that computes it from the same load gets the same order.
    """
    load = np.asarray(block_load, np.float64)
    if load.ndim != 1 or not len(load) or (load < 0).any():
        raise ValueError("block_load must be a non-empty vector of non-negative loads, one per block")
    plain = Layout(aggregators, slots_per_aggregator, len(load))
    S = plain.columns
    column_load = np.bincount(np.arange(len(load)) % S, weights=load, minlength=S)
    free = [list(range(a, S, aggregators)) for a in range(aggregators)]   # the columns each one serves
    carried = np.zeros(aggregators)
    order = np.empty(S, np.int64)
    for g in np.argsort(-column_load, kind="stable"):
        open_ = [a for a in range(aggregators) if free[a]]
        a = min(open_, key=lambda i: (carried[i], i))
        order[g] = free[a].pop(0)
        carried[a] += column_load[g]
    return order
