"""Training examples: run with `torchrun --nproc-per-node 4 -m zerosum.examples.<name>`."""
