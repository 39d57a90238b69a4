"""Stores that bypass the caches, for sums written into outputs larger than the caches.

A worker writes each block's sum into the output as it arrives. A plain store first reads the output's
cache line in (write-allocate), so dequantising a 100 MB sum moves 200 MB through memory; stores marked
non-temporal go to memory through the write-combining buffers without that read (x86 `vmovntps`,
LLVM's `!nontemporal`). Alone on one core this took 3.7 ms for 100 MB where plain stores took 7.2 ms.
They leave nothing in the cache, so they pay only where the output would not stay there anyway: glibc's
memcpy switches to them above 3/4 of the shared cache, and so does `streams(nbytes)`.

Non-temporal stores are weakly ordered: they are seen by this thread at once but by other threads and
devices (a GPU's copy out of pinned memory) only after a store fence, which `fence()` issues; the
driver calls it before it hands the output back (worker_kernels.drive).
"""
from __future__ import annotations

import os
import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

JIT = dict(cache=True, nogil=True)

LANES = 16              # floats per call of the vector kernel (64 bytes: one cache line)
ALIGN = 16              # bytes: the narrowest vector store (xmm); numpy allocates on 16-byte boundaries
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _shared_cache_bytes() -> int:
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        size = 0
    return size if size > 0 else 32 << 20


# outputs at least this large are written with non-temporal stores (glibc's non-temporal threshold)
STREAM_MIN_BYTES = _shared_cache_bytes() * 3 // 4


def streams(nbytes: int) -> bool:
    """Whether an output of `nbytes` is written with non-temporal stores (x86 only: elsewhere LLVM
    may not lower them to a store that skips the read, and the fence below is x86's)."""
    return X86 and nbytes >= STREAM_MIN_BYTES


def _stream_kernel(divide: bool):
    @intrinsic
    def kernel(typingctx, src, dst, scale, divisor):
        """LANES big-endian int32 at address `src` -> float32(int) * scale (/ divisor), stored at `dst`
        (ALIGN-aligned) with non-temporal stores. The same arithmetic, in the same order and precision,
        as worker_kernels._store_floats, so the sums are bit-identical."""
        def codegen(context, builder, signature, args):
            i32, f32 = ir.IntType(32), ir.FloatType()
            vi, vf = ir.VectorType(i32, LANES), ir.VectorType(f32, LANES)
            words = builder.load(builder.inttoptr(args[0], vi.as_pointer()), align=1)
            bswap = builder.module.declare_intrinsic(f"llvm.bswap.v{LANES}i32", fnty=ir.FunctionType(vi, [vi]))
            values = builder.sitofp(builder.call(bswap, [words]), vf)

            def splat(x):
                one = builder.insert_element(ir.Constant(vf, ir.Undefined), x, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, ir.Constant(vf, ir.Undefined), ir.Constant(vi, [0] * LANES))
            values = builder.fmul(values, splat(args[2]))
            if divide:
                values = builder.fdiv(values, splat(args[3]))
            nontemporal = builder.module.add_metadata([ir.Constant(i32, 1)])
            per = ALIGN // 4
            part_type = ir.VectorType(f32, per)
            for k in range(LANES // per):
                part = builder.shuffle_vector(values, ir.Constant(vf, ir.Undefined),
                                              ir.Constant(ir.VectorType(i32, per), list(range(k * per, k * per + per))))
                address = builder.add(args[1], ir.Constant(args[1].type, k * ALIGN))
                store = builder.store(part, builder.inttoptr(address, part_type.as_pointer()), align=ALIGN)
                store.set_metadata("nontemporal", nontemporal)
            return context.get_dummy_value()
        return types.void(types.uintp, types.uintp, types.float32, types.float32), codegen
    return kernel


_stream_product = _stream_kernel(divide=False)
_stream_quotient = _stream_kernel(divide=True)


@intrinsic
def _sfence(typingctx):
    def codegen(context, builder, signature, args):
        if X86:
            fn = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(fn, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@njit(inline="always", **JIT)
def fence():
    """Make the non-temporal stores so far visible to every other thread and device."""
    _sfence()


@njit(inline="always", **JIT)
def stream_floats(words, count, scale, divisor, out, dst):
    """out[dst:dst + count] = float32(swap(words)) * scale (/ divisor unless it is 1), bypassing the
    caches. Returns False, having stored nothing, where the run is not whole vectors at an aligned
    address (then the caller stores it the plain way)."""
    src, at = words.ctypes.data, out.ctypes.data + 4 * dst
    if count % LANES or at % ALIGN or dst < 0 or dst + count > out.size or count > words.size:
        return False
    if divisor == np.float32(1.0):
        for v in range(0, count, LANES):
            _stream_product(src + 4 * v, at + 4 * v, scale, divisor)
    else:
        for v in range(0, count, LANES):
            _stream_quotient(src + 4 * v, at + 4 * v, scale, divisor)
    return True
