"""A recommendation-style model (NCF/DeepLight-like): large embedding tables, a small MLP on top,
trained on synthetic click data. Only the embedding rows a batch looks up get gradients, so the
gradient is naturally block-sparse (e.g. ~98% of 256-value blocks are zero with the defaults).

    torchrun --nproc-per-node 4 -m zerosum.examples.embedding            # gloo, then ZeroSum
    torchrun --nproc-per-node 4 -m zerosum.examples.embedding --mode gloo
    torchrun --nproc-per-node 4 -m zerosum.examples.embedding --rows 1000000   # tables of 1M rows
"""
from __future__ import annotations

import functools

import torch

from ..argtypes import positive_int
from . import harness
from .harness import parse_args

TABLES, ROWS, DIM, LOOKUPS = 4, 100_000, 32, 2


class Recommender(torch.nn.Module):
    def __init__(self, rows: int = ROWS):
        super().__init__()
        self.tables = torch.nn.ModuleList(torch.nn.EmbeddingBag(rows, DIM, mode="sum") for _ in range(TABLES))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(TABLES * DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, ids):
        return self.mlp(torch.cat([t(ids[:, i]) for i, t in enumerate(self.tables)], dim=1)).squeeze(1)


@functools.lru_cache(maxsize=None)
def _truth(rows: int) -> torch.Tensor:
    """A fixed hidden "true" model makes the clicks learnable."""
    return torch.randn(TABLES, rows, generator=torch.Generator().manual_seed(1234))


def batch(gen, size, rows: int = ROWS):
    # Zipf-like popularity: a few items are looked up often, most rarely (as in click logs).
    u = torch.rand(size, TABLES, LOOKUPS, generator=gen)
    ids = (rows * u ** 3).long().clamp(max=rows - 1)
    weights = _truth(rows)
    score = sum(weights[t][ids[:, t]].sum(1) for t in range(TABLES))
    clicks = (score + 0.5 * torch.randn(size, generator=gen) > 0).float()
    return (ids,), clicks


def arguments(argv=None):
    return parse_args(__doc__, lambda p: p.add_argument("--rows", type=positive_int, default=ROWS,
                                                      help=f"rows per embedding table (default {ROWS:,})"),
                      argv, steps=30, batch=256, lr=0.5)


def task(args):
    """The model, the batches and the loss that `args` describe (for train, and for profiling)."""
    return (functools.partial(Recommender, args.rows), functools.partial(batch, rows=args.rows),
            torch.nn.functional.binary_cross_entropy_with_logits)


def main():
    harness.main(arguments, task)


if __name__ == "__main__":
    main()
