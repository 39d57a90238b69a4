"""A mixed model: a large embedding table (block-sparse gradient: only the rows a batch looks up) under a
dense MLP tower whose gradient is about as large (dense: every block non-zero), as in recommendation
models (DLRM-like). Neither path suits the whole model: ZeroSum for the table, the ring for the tower,
which is what the hook's per-bucket choice is for (`--schemes gloo,zerosum,hybrid`).

    torchrun --nproc-per-node 4 -m zerosum.examples.mixed --schemes gloo,zerosum,hybrid --bucket-mb 4

The table's parameters come last in the model, so DDP puts them in a bucket of their own (DDP fills its
buckets in reverse parameter order); with `--bucket-mb` at most the tower's largest layer, no bucket mixes
the two.
"""
from __future__ import annotations

import functools

import torch

from ..argtypes import positive_int
from . import harness
from .harness import parse_args

ROWS, DIM, LOOKUPS, HIDDEN = 100_000, 32, 8, 1024


class Mixed(torch.nn.Module):
    def __init__(self, rows: int = ROWS, hidden: int = HIDDEN):
        super().__init__()
        self.tower = torch.nn.Sequential(torch.nn.Linear(DIM, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, 1))
        self.table = torch.nn.EmbeddingBag(rows, DIM, mode="mean")

    def forward(self, ids):
        return self.tower(self.table(ids)).squeeze(1)


@functools.lru_cache(maxsize=None)
def _truth(rows: int) -> torch.Tensor:
    return torch.randn(rows, generator=torch.Generator().manual_seed(4242))


def batch(gen, size, rows: int = ROWS):
    # Zipf-like popularity, as in click logs: a few rows are looked up often, most rarely.
    ids = (rows * torch.rand(size, LOOKUPS, generator=gen) ** 3).long().clamp(max=rows - 1)
    clicks = (_truth(rows)[ids].sum(1) + 0.5 * torch.randn(size, generator=gen) > 0).float()
    return (ids,), clicks


def arguments(argv=None):
    def extra(p):
        p.add_argument("--rows", type=positive_int, default=ROWS, help=f"rows of the table (default {ROWS:,})")
        p.add_argument("--hidden", type=positive_int, default=HIDDEN, help=f"width of the tower (default {HIDDEN})")
    return parse_args(__doc__, extra, argv, steps=30, batch=128, lr=0.05)


def task(args):
    """The model, the batches and the loss that `args` describe."""
    return (functools.partial(Mixed, args.rows, args.hidden), functools.partial(batch, rows=args.rows),
            torch.nn.functional.binary_cross_entropy_with_logits)


def main():
    harness.main(arguments, task)


if __name__ == "__main__":
    main()
