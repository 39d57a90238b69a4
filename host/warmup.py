"""Compile (or load from numba's cache) every kernel before it is needed.

The first call of a numba kernel compiles it (about 10 s for all of ZeroSum's on a cold cache, well under
a second from the cache, which lives beside the package). An aggregator or worker that compiled in
the middle of its first allreduce would stall its peers into probing, so both warm up first: one tiny
allreduce per dtype and result kind, through the pure machines in memory (no sockets).

    python -c "from zerosum.warmup import warm_up; warm_up()"   # e.g. while building an image
"""
from __future__ import annotations

import itertools

import numpy as np

from .aggregator_machine import AggregatorMachine
from .blocks import BlockSource, CollectedBlocks, DenseResult
from .layout import Layout
from .worker_machine import AllreduceMachine, JoinMachine, WorkerConfig

_done = False


def warm_up() -> None:
    """Run each kernel once (per process; later calls return at once)."""
    global _done
    if _done:
        return
    B = 4
    # datagrams as bytes (read-only buffers) and as bytearrays (what sockets fill): numba compiles each
    for dtype, collect, buffer in itertools.product((np.float32, np.int32), (False, True), (bytes, bytearray)):
        if True:
            agg = AggregatorMachine(1, 1, slots=2)
            cfg = WorkerConfig(rank=0, world=1, job=1, block_size=B, window=1 if buffer is bytes else None)
            join = JoinMachine(cfg, 1, 1, 0.0)
            for _, d in join.datagrams_to_send(0.0):
                for _, ack in agg.receive(d, "w"):
                    join.receive(0, buffer(ack), 0.0)
            x = np.arange(1, 7, dtype=dtype)
            if collect:
                source = BlockSource.compact(np.array([0, 1]), np.arange(1, 9, dtype=dtype).reshape(2, B), 2)
                sink = CollectedBlocks(dtype, B)
            else:
                source = BlockSource.dense(x, B)
                sink = DenseResult(np.zeros_like(x))
            m = AllreduceMachine(cfg, 1, source, Layout(1, join.slots, source.nblocks), sink, average=False)
            pending = m.start(0.0)
            while not m.done:
                m.timer()
                for _, d in pending:
                    d = buffer(d)
                    replies = agg.receive(d, "w") + agg.flush()
                    replies += agg.receive(d, "w")      # a retransmission: answered from the shadow copy
                    for _, reply in replies:
                        m.receive(0, buffer(reply), 0.0)
                pending = m.datagrams_to_send(0.0)
            m.poll(0.0)
    _done = True
