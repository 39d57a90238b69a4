"""Compile (or load from numba's cache) every kernel before it is needed.

The first call of a numba kernel compiles it (about 45 s for all of ZeroSum's on a cold cache, well under
a second from the cache, which lives beside the package). An aggregator or worker that compiled in
the middle of its first allreduce would stall its peers into probing, so both warm up first: one tiny
allreduce per dtype and result kind, through the pure machines in memory, then through the compiled
driver loops over two loopback sockets.

    python -c "from zerosum.warmup import warm_up; warm_up()"   # e.g. while building an image
"""
from __future__ import annotations

import itertools
import socket
import threading
import time

import numpy as np

from . import aggregator_kernels as AK
from . import congestion as CC
from . import worker_kernels as K
from . import worker_rounds as R
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
                agg.receive(d, "w", 0.0)
                for _, ack in agg.datagrams_to_send(0.0):
                    join.receive(0, buffer(ack), 0.0)
            x = np.arange(1, 7, dtype=dtype)
            if collect:
                source = BlockSource.compact(np.array([0, 1]), np.arange(1, 9, dtype=dtype).reshape(2, B), 2)
                sink = CollectedBlocks(dtype, B)
            else:
                source = BlockSource.dense(x, B)
                sink = DenseResult(np.zeros_like(x))
            m = AllreduceMachine(cfg, 1, source, Layout(1, join.slots, source.nblocks), sink, average=False)
            # The first round is lost: loss recovery's own kernels run too (the timers, a probe, its answer,
            # the retransmission of the other expired column; R-L1, R-L2), or the first loss of a process's
            # life would compile them while its peers wait.
            m.start(0.0)
            now, pending = 0.0, []
            while not m.done:
                m.timer()
                R.recovery_timer(m.st)        # (what poll asks while the pacer holds columns back, R-C7)
                if not pending:
                    now = max(now, m.timer())
                    pending = m.poll(now)
                for _, d in pending:
                    d = buffer(d)
                    agg.receive(d, "w", 0.0)
                    replies = agg.datagrams_to_send(0.0)
                    agg.receive(d, "w", 0.0)            # a retransmission: answered from the shadow copy
                    replies += agg.datagrams_to_send(0.0)
                    for _, reply in replies:
                        m.receive(0, buffer(reply), now)
                pending = m.datagrams_to_send(now)
            m.poll(now)
            # what the machines call from Python only later: on an allreduce that starts from the last
            # one's round-trip estimate, on a loss, for the pacer's report (this machine is done with)
            CC.update_rto(m.st, np.int64(0))
            CC.on_loss(m.st, 0.0)
            R.tail_candidates(m.st, np.empty(1, np.int64))     # a tail probe (R-L8)
            CC.judged_columns(m.st, np.int64(0))                # the rounds its RESULT makes overdue
            m.pacing
            m.srtt, m.min_rtt
    _warm_up_transport(B)
    _done = True


def _warm_up_transport(B: int) -> int:
    """The compiled driver loops (worker_kernels.drive, aggregator_kernels.serve_until) over two loopback sockets, one
    tiny allreduce per dtype and result kind. Returns how many of the four finished (0 without batched
    I/O, where these loops do not run)."""
    from . import transport as T
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        if not T.detect(probe).batched:
            return 0
    finished = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as a, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as w:
        a.bind(("127.0.0.1", 0))
        w.bind(("127.0.0.1", 0))
        keys = np.array([T.address_key(a.getsockname())], np.int64)
        rx_a, rx_w, tx_a, tx_w = T.rx_batch(), T.rx_batch(), T.tx_queue(False), T.tx_queue(False)
        for dtype, collect in itertools.product((np.float32, np.int32), (False, True)):
            agg = AggregatorMachine(1, 1, slots=2)
            cfg = WorkerConfig(rank=0, world=1, job=1, block_size=B, rto=0.002, min_rto=0.001, timeout=5.0)
            join = JoinMachine(cfg, 1, 1, 0.0)
            for _, d in join.datagrams_to_send(0.0):
                agg.receive(d, w.getsockname(), 0.0)
                for _, ack in agg.datagrams_to_send(0.0):
                    join.receive(0, ack, 0.0)
            tables = AK.table_list(agg.table)
            AK.append_table(AK.table_list(agg.table), agg.table)    # (a second job joining)
            job_ids = np.array([1], np.int64)
            if collect:
                source = BlockSource.compact(np.array([0, 1]), np.arange(1, 9, dtype=dtype).reshape(2, B), 2)
                sink = CollectedBlocks(dtype, B)
            else:
                source = BlockSource.dense(np.arange(1, 7, dtype=dtype), B)
                sink = DenseResult(np.zeros(6, dtype))
            m = AllreduceMachine(cfg, 1, source, Layout(1, join.slots, source.nblocks), sink)
            m.begin(time.monotonic())
            n = i = off = 0
            end = time.monotonic() + 5.0
            # The aggregator's loop on a thread of its own (both loops release the GIL): taking turns, the
            # worker's loop waited out its timer for every answer (about 1 s of each process's start).
            done = threading.Event()
            server = threading.Thread(target=_serve, args=(a.fileno(), rx_a, job_ids, tables, tx_a, done, end),
                                      daemon=True)
            server.start()
            try:
                while time.monotonic() < end:
                    if collect:
                        m.grow(64)
                    outcome, n, i, off = K.drive(w.fileno(), -1, rx_w, tx_w, m.st, keys, 0.0,
                                                 sink.count[1] + 64 if collect else 0, n, i, off)
                    if outcome == K.DONE:
                        finished += 1
                        break
            finally:
                done.set()
                server.join()
        T.receive(a.fileno(), rx_a, 0)     # (the server's receive while no job is served)
    return finished


def _serve(fd, rx, job_ids, tables, tx, done, end) -> None:
    """The aggregator's compiled loop, a few milliseconds at a time, until `done` is set or `end` passes."""
    while not done.is_set() and time.monotonic() < end:
        AK.serve_until(fd, rx, job_ids, tables, tx, 0.0, time.monotonic() + 0.005)
