"""Gradient compressors that turn into fewer bytes on ZeroSum's wire.

Every compressor maps a worker's gradient to what it contributes to the sum (`compress`), and the sum
over workers back to the gradient estimate (`decompress`). What it contributes is an ordinary dense
float32 array: sparsifiers zero whole blocks, which ZeroSum then does not send; quantisers produce
values the fixed-point sum carries exactly enough (see each class). State such as error-feedback memory
is kept per key (one key per tensor, or per set of parameters in a DDP bucket).

    c = TopKBlocks(density=0.01)
    contribution = c.compress(grad, key="layer1")
    estimate = c.decompress(worker.allreduce(contribution), world=4, key="layer1")

`allreduce(worker, grad, compressor, key)` does the three steps.
"""
from .base import Compressor, NoCompression, WireCost, allreduce, rounds_of, wire_bytes, wire_cost
from .sparsify import RandomKBlocks, TopKBlocks, TopKElements
from .quantize import QSGD, SignEF, TernGrad
from .dgc import DGC
from .diana import DIANA
from .adaptive import AdaptiveTopKBlocks
from .tracked import TrackedTopKBlocks
from .vr import LSVRG, SAGA

__all__ = ["Compressor", "NoCompression", "WireCost", "allreduce", "rounds_of", "wire_bytes", "wire_cost",
           "TopKBlocks", "TopKElements", "RandomKBlocks", "QSGD", "TernGrad", "SignEF", "DGC", "DIANA", "AdaptiveTopKBlocks", "TrackedTopKBlocks",
           "LSVRG", "SAGA"]
