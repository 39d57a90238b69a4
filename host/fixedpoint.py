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


def scale_factors(shift: np.ndarray) -> list[np.ndarray]:
    """Per-row float32 factors whose product is 2**shift, each a normal float32 power of two.

    Multiplying by them in turn scales exactly; one factor in the usual case, two when a shift is
    beyond float32's exponent range. numpy and the torch device path both scale with these.
    """
    if len(shift) == 0 or (_F32_MIN_EXP <= int(shift.min()) and int(shift.max()) <= _F32_MAX_EXP):
        return [np.exp2(shift.astype(np.float32))]
    first = np.clip(shift, _F32_MIN_EXP, _F32_MAX_EXP)
    rest = shift - first
    factors = [np.exp2(first.astype(np.float32))]
    if rest.any():
        factors.append(np.exp2(rest.astype(np.float32)))
    return factors


def _scale_rows(rows: np.ndarray, shift: np.ndarray) -> None:
    """rows *= 2**shift (per row), exactly, in place."""
    for factor in scale_factors(shift):
        rows *= factor[:, None]


def quantize(rows: np.ndarray, exps: np.ndarray, world: int, out: np.ndarray | None = None,
             overwrite: bool = False) -> np.ndarray:
    """float32 rows (n, B) and agreed exponents (n,) -> int32 rows (n, B), into `out` if given.

    `out` may have any int32 byte order, e.g. a big-endian view into a datagram being built.
    With overwrite=True, `rows` (a float32 array) is used as scratch space.
    """
    scaled = rows if overwrite and rows.dtype == np.float32 else np.array(rows, dtype=np.float32, copy=True)
    _scale_rows(scaled, precision_bits(world) - exps.astype(np.int64))
    np.rint(scaled, out=scaled)
    if out is None:
        return scaled.astype(np.int32)
    out[...] = scaled
    return out


def dequantize(sums: np.ndarray, exps: np.ndarray, world: int, out: np.ndarray | None = None) -> np.ndarray:
    """int32 sums (n, B) with their exponents (n,) -> float32 rows (n, B)."""
    if out is None:
        out = np.empty(sums.shape, dtype=np.float32)
    out[...] = sums
    _scale_rows(out, exps.astype(np.int64) - precision_bits(world))
    return out


def max_error(exps: np.ndarray, world: int) -> np.ndarray:
    """Bound on |result - exact sum| per element for blocks with these agreed exponents (per row)."""
    step = np.ldexp(1.0, (exps.astype(np.int64) - precision_bits(world)).astype(np.int32))
    # world roundings of half a step, plus the final int32 -> float32 rounding of the sum
    return world * step / 2 + np.ldexp(1.0, (exps.astype(np.int64) + 2 - 24).astype(np.int32)) * world
