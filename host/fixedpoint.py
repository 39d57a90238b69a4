"""Fixed-point conversion of float32 blocks, SwitchML style.

A block with largest magnitude m has exponent e = frexp(m)[1], so |x| < 2**e for all its elements.
Workers agree on one exponent per block (the maximum over the workers that send it) and send
round(x * 2**s) with s = precision_bits(world) - e, so that |q| < 2**(31 - ceil(log2 world)) and the
sum of `world` values cannot overflow int32. Scaling by a power of two is exact in float32, so the only
error is the rounding to an integer, at most 2**(e - 1 - precision_bits(world)) per element. Integer
sums do not depend on arrival order: every worker gets a bit-identical result.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .protocol import NO_EXP

# Powers of two a float32 can hold as a normal number; larger scalings are done in two steps.
_F32_MAX_EXP = 127
_F32_MIN_EXP = -126


@functools.lru_cache(maxsize=None)
def precision_bits(world: int) -> int:
    if not 1 <= world <= 128:
        raise ValueError(f"world size must be 1..128 for fixed point, got {world}")
    return 31 - math.ceil(math.log2(world))


def block_exponents(maxabs: np.ndarray) -> np.ndarray:
    """Exponent e with max|x| < 2**e per block (int32); NO_EXP for all-zero blocks."""
    _, e = np.frexp(maxabs.astype(np.float32, copy=False))
    return np.where(maxabs > 0, e, NO_EXP).astype(np.int32)


def scale_rows(rows: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """rows * 2**shift per row, rounded once (float32 in, float32 out).

    np.ldexp builds the power of two from its exponent bits: exact on every CPU, unlike np.exp2,
    whose SIMD float32 kernel returns 2**127 one ulp off on some (AVX-512) CPUs, which would make
    hosts with different CPUs dequantise the same integer sum to different floats.
    """
    return np.ldexp(rows.astype(np.float32, copy=False), shift.astype(np.int32)[:, None])


def quantize(rows: np.ndarray, exps: np.ndarray, world: int) -> np.ndarray:
    """float32 rows (n, B) and agreed exponents (n,) -> int32 rows (n, B): round_half_even(x * 2**(p - e)).

    The numpy form of the rule, for the reference sum and the tests; the data path runs the same rule
    in the compiled kernels (zerosum.worker_kernels), which the tests hold to this one bit for bit.
    """
    scaled = scale_rows(np.asarray(rows, np.float32), precision_bits(world) - exps.astype(np.int64))
    return np.rint(scaled).astype(np.int32)


def dequantize(sums: np.ndarray, exps: np.ndarray, world: int) -> np.ndarray:
    """int32 sums (n, B) with their exponents (n,) -> float32 rows: float32(sum) * 2**(e - p)."""
    return scale_rows(sums.astype(np.float32), exps.astype(np.int64) - precision_bits(world))


def max_error(exps: np.ndarray, world: int) -> np.ndarray:
    """Bound on |result - exact sum| per element for blocks with these agreed exponents (per row)."""
    step = np.ldexp(1.0, (exps.astype(np.int64) - precision_bits(world)).astype(np.int32))
    # world roundings of half a step, plus the final int32 -> float32 rounding of the sum
    return world * step / 2 + np.ldexp(1.0, (exps.astype(np.int64) + 2 - 24).astype(np.int32)) * world
