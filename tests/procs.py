"""Real processes on loopback: aggregators and workers for end-to-end tests."""
from __future__ import annotations

import queue
import traceback

import numpy as np

from zerosum.local import CTX, LocalAggregator as Aggregator  # noqa: F401


def sparse_tensor(rank: int, seed: int, n: int, density: float, block_size: int = 256, dtype=np.float32):
    rng = np.random.default_rng([seed, rank])
    if dtype == np.int32:
        x = rng.integers(-2**20, 2**20, n).astype(np.int32)
    else:
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 5, n)).astype(np.float32)
    nblocks = -(-n // block_size)
    x[~np.repeat(rng.random(nblocks) < density, block_size)[:n]] = 0
    return x


def _worker_main(out, rank, world, addresses, seeds, n, density, kwargs, dtype, exit_after_join, killed):
    import os
    import zerosum
    try:
        with zerosum.Worker(rank, world, addresses, **kwargs) as w:
            if exit_after_join:     # die without a word (a clean close would send LEAVE)
                os._exit(0)
            if killed:              # die hard in the middle of the allreduce
                _die_once_results_arrive()
            results = [w.allreduce(sparse_tensor(rank, s, n, density, w.block_size, dtype)) for s in seeds]
            out.put((rank, "ok", results, w.stats))
    except Exception as e:  # reported to the test, which asserts on it
        out.put((rank, "error", f"{type(e).__name__}: {e}", traceback.format_exc()))


def _die_once_results_arrive():
    """SIGKILL this process as soon as its first allreduce has received a datagram from the aggregator
    (its bootstrap round completed, the rounds with this rank's data still to come): in the middle of
    the allreduce whatever the machine's speed (a timer set when the rank joined had fired after a fast
    allreduce of 16 MB had finished)."""
    import os
    import signal
    import threading
    import time
    from zerosum import worker_state as WS
    from zerosum.worker_machine import AllreduceMachine
    begin = AllreduceMachine.begin

    def begin_then_die(self, now):
        begin(self, now)
        received = self.st.i[WS.I_DATAGRAMS_RECEIVED]

        def watch():
            while self.st.i[WS.I_DATAGRAMS_RECEIVED] == received:
                time.sleep(0.0002)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=watch, daemon=True).start()
    AllreduceMachine.begin = begin_then_die


def run_workers(world, addresses, seeds, n, density, *, dtype=np.float32, dead=(), killed=(),
                hang_after=120, **kwargs):
    """Run `world` worker processes; return {rank: (status, payload, extra)} for the live ones.

    dead: ranks that die right after joining (no LEAVE); killed: ranks SIGKILLed in the middle of their
    first allreduce (once it has received its first result).
    """
    out = CTX.Queue()
    procs = [CTX.Process(target=_worker_main, args=(out, r, world, addresses, seeds, n, density, kwargs,
                                                    dtype, r in dead, r in killed), daemon=True)
             for r in range(world)]
    reports = collect(procs, out, world - len(dead) - len(killed), hang_after)
    return {rank: (status, payload, extra) for rank, status, payload, extra in reports}


def collect(procs, out, expected: int, hang_after: float) -> list[tuple]:
    """Start `procs`, take `expected` reports (tuples starting with the rank) from `out`, reap them."""
    for p in procs:
        p.start()
    reports = []
    try:
        for _ in range(expected):
            reports.append(out.get(timeout=hang_after))
    except queue.Empty:
        raise AssertionError(f"processes hung: only ranks {sorted(r[0] for r in reports)} reported") from None
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    return reports
