"""Aggregators as local processes on loopback (for the benchmark, the demo, the torch backend, tests).

The aggregator runs as `python -m zerosum aggregator --announce`, a plain subprocess (so daemonic
processes, such as multiprocessing workers, can start one too). It prints its address when ready and
its counters as JSON when it stops.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import multiprocessing as mp
import resource
import signal
import subprocess
import sys

CTX = mp.get_context("spawn")
ANNOUNCE = "zerosum-aggregator-listening"


def peak_rss() -> int:
    """Peak resident memory of this process. (ru_maxrss would include the parent it was forked from.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the parent dies, so no aggregator outlives its user (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LocalAggregator:
    """A software aggregator in its own process on 127.0.0.1; `stop()` ends it and returns its counters."""

    def __init__(self, workers: int, *, listen: str = "127.0.0.1:0", job: int = 1, slots: int | None = None,
                 loss: float = 0.0, seed: int | None = None):
        cmd = [sys.executable, "-m", "zerosum", "aggregator", "--workers", str(workers), "--listen", listen,
               "--job", str(job), "--loss", str(loss), "--announce"]
        if slots:
            cmd += ["--slots", str(slots)]
        if seed is not None:
            cmd += ["--seed", str(seed)]
        self._counters: dict = {}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     preexec_fn=_die_with_parent)
        atexit.register(self.stop)
        line = self.proc.stdout.readline().split()
        if len(line) != 2 or line[0] != ANNOUNCE:
            self.proc.kill()
            raise RuntimeError(f"the aggregator process did not start (exit code {self.proc.wait()})")
        self.address = line[1]
        self.port = int(self.address.rsplit(":", 1)[1])

    def stop(self) -> dict:
        if self.proc.returncode is not None:
            return self._counters
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self._counters = {}
        for line in reversed(out.splitlines()):
            if line.startswith("{"):
                self._counters = json.loads(line)
                break
        return self._counters
