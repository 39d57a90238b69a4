"""A small dense MLP classifier on synthetic data: dense gradients, ZeroSum's worst case.

    torchrun --nproc-per-node 4 -m zerosum.examples.mlp
"""
from __future__ import annotations

import torch

from . import harness
from .harness import parse_args

FEATURES, HIDDEN, CLASSES = 128, 512, 10
_TRUTH = torch.Generator().manual_seed(4321)
_W = torch.randn(FEATURES, CLASSES, generator=_TRUTH)


def model():
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def batch(gen, size):
    x = torch.randn(size, FEATURES, generator=gen)
    return (x,), (x @ _W).argmax(1)


def arguments(argv=None):
    return parse_args(__doc__, argv=argv, steps=30, batch=128, lr=0.05)


def task(args):
    """The model, the batches and the loss (for train, and for profiling)."""
    return model, batch, torch.nn.functional.cross_entropy


def main():
    harness.main(arguments, task)


if __name__ == "__main__":
    main()
