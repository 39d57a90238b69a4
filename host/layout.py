"""How blocks map to columns, columns to aggregators and aggregator slots (OmniReduce striping).

With A aggregators each granting P slots there are S = min(A*P, nblocks) columns. Block b belongs to
column b % S; column g is served by aggregator g % A in its local slot g // A. Every worker computes the
same layout from the same numbers, so no layout travels on the wire.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    aggregators: int
    slots_per_aggregator: int
    nblocks: int

    @property
    def columns(self) -> int:
        return min(self.aggregators * self.slots_per_aggregator, self.nblocks)

    def column_of_block(self, blocks: np.ndarray) -> np.ndarray:
        return blocks % self.columns

    def aggregator_of(self, columns: np.ndarray) -> np.ndarray:
        return columns % self.aggregators

    def slot_of(self, columns: np.ndarray) -> np.ndarray:
        return columns // self.aggregators

    def column_of(self, aggregator: int, slots: np.ndarray) -> np.ndarray:
        return slots.astype(np.int64) * self.aggregators + aggregator

    def slots_used(self, aggregator: int) -> int:
        """How many local slots of `aggregator` hold a column."""
        return max(0, -(-(self.columns - aggregator) // self.aggregators))
