"""Aggregators as local processes on loopback (for the benchmark, the demo and tests)."""
from __future__ import annotations

import multiprocessing as mp
import resource

CTX = mp.get_context("spawn")


def _peak_rss() -> int:
    """Peak resident memory of this process. (ru_maxrss would include the parent it was forked from.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _aggregator_main(ready, stop, result, workers, kwargs):
    from .aggregator import AggregatorServer
    server = AggregatorServer(workers, kwargs.pop("listen", "127.0.0.1:0"), **kwargs)
    ready.put(server.address[1])
    server.serve(stop=stop.is_set)
    counters = dict(server.machine.counters)
    counters["max_rss_bytes"] = _peak_rss()
    result.put(counters)
    server.close()


class LocalAggregator:
    """An AggregatorServer in its own process; `stop()` ends it and returns its counters."""

    def __init__(self, workers: int, **kwargs):
        self._ready, self._stop, self._result = CTX.Queue(), CTX.Event(), CTX.Queue()
        self.proc = CTX.Process(target=_aggregator_main,
                                args=(self._ready, self._stop, self._result, workers, kwargs), daemon=True)
        self.proc.start()
        try:
            self.port = self._ready.get(timeout=60)
        except Exception:
            self.proc.kill()
            raise RuntimeError("the aggregator process did not start") from None
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> dict:
        self._stop.set()
        try:
            return self._result.get(timeout=10)
        finally:
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
