"""Aggregators as local processes on loopback (for the benchmark, the demo, the torch backend, tests).

The aggregator runs as `python -m zerosum aggregator --announce`, a plain subprocess (so daemonic
processes, such as multiprocessing workers, can start one too). It prints its address when ready and
its counters as JSON when it stops; on SIGUSR1 it prints a snapshot of its counters and CPU time
(`LocalAggregator.snapshot`, for the benchmark's per-row measurements).
"""
from __future__ import annotations

import atexit
import ctypes
import json
import multiprocessing as mp
import os
import resource
import secrets
import select
import signal
import subprocess
import sys
import tempfile
from typing import Sequence

CTX = mp.get_context("spawn")
ANNOUNCE = "zerosum-aggregator-listening"
SNAPSHOT = "zerosum-aggregator-snapshot"


def memory(field: str = "VmRSS", pid: int | str = "self") -> int | None:
    """A process's memory figure from /proc/PID/status in bytes (VmRSS: resident now, VmHWM: its peak),
    None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss() -> int:
    """Peak resident memory of this process. (ru_maxrss would include the parent it was forked from.)"""
    peak = memory("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads) so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def snapshot(server) -> dict:
    """An aggregator's counters (received `datagrams`, drops, ...), the datagrams it sent and its CPU time."""
    return {**dict(server.machine.counters), "datagrams_sent": server.datagrams_sent, "cpu_s": cpu_seconds()}


class SnapshotOnSignal:
    """In the aggregator process: SIGUSR1 asks for one `SNAPSHOT {json}` line on stdout, which `answer()`
    prints; the serve loop calls it between batches (its stop check, at least every 0.2 s). Not from the
    signal handler itself: Python runs a handler between any two bytecodes, e.g. inside the service's
    `_end`, after a job has left the live jobs and before its counts reach the ended ones, and the
    snapshot then missed that job's counters (a run's rounds read as 0)."""

    def __init__(self, server):
        self.server, self.asked = server, False
        signal.signal(signal.SIGUSR1, self._ask)

    def _ask(self, *_) -> None:
        self.asked = True

    def answer(self) -> None:
        if self.asked:
            self.asked = False
            print(SNAPSHOT, json.dumps(snapshot(self.server)), flush=True)


def new_key() -> str:
    """A random secret for one run's aggregator and workers (256 bits, as hex)."""
    return secrets.token_hex(32)


def _on_loopback(listen: str) -> bool:
    """Whether a HOST:PORT to listen on is this host's loopback."""
    import ipaddress
    try:
        return ipaddress.ip_address(listen.rsplit(":", 1)[0].strip("[]")).is_loopback
    except ValueError:
        return listen.rsplit(":", 1)[0] == "localhost"


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the parent dies, so no aggregator outlives its user (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


LOOPBACK_GROUP = "239.255.77.1"   # administratively scoped (RFC 2365); sent with TTL 0, it stays on the host
OFF = ("", "off", "none")


def named_group(setting: str | None) -> str | None:
    """The group a setting names where ZeroSum does not start the aggregator on loopback itself (given
    aggregators): auto and off mean results to each worker, anything else is the group."""
    return None if setting is None or setting.strip().lower() in ("auto", *OFF) else setting.strip()


def results_group(setting: str | None = "auto", interface: str = "127.0.0.1") -> tuple[str | None, str]:
    """The multicast group that an aggregator ZeroSum starts on this host should send its results to
    (LocalAggregator's and Worker's `multicast`), from a setting (`--multicast`, ZEROSUM_MULTICAST):

    - "auto" (the default): LOOPBACK_GROUP, on a port of its own, where multicast works on loopback here
      (tried once: transport.multicast_problem); else None, results to each worker. Each result then
      crosses the aggregator's socket once instead of once per worker, which with W workers on one
      host is most of the aggregator's system-call and copy cost (README "Results by multicast").
    - "off" / "none" / "": None.
    - "GROUP" or "GROUP:PORT": that group (a port of its own when none is given); ValueError where it
      does not work here.

    Returns (GROUP:PORT or None, one line saying which and why, for the user)."""
    from . import transport as T
    return choose_group(setting, LOOPBACK_GROUP, lambda group, port: T.multicast_problem(group, interface),
                        "on loopback")


def choose_group(setting: str | None, default: str, probe, where: str) -> tuple[str | None, str]:
    """A --multicast setting made a group: off -> None; auto -> the `default` group where
    probe(group, port or None) -> (port, problem) finds that it works `where` (else None, saying why), and
    only with batched I/O; "GROUP[:PORT]" -> that group, which must work (ValueError). Returns (GROUP:PORT
    or None, one line saying which and why, for the user)."""
    from . import transport as T
    setting = "auto" if setting is None else setting.strip().lower()
    if setting in OFF:
        return None, "results to each worker (multicast off)"
    if setting == "auto" and T.io_mode() == "plain":
        return None, "results to each worker (multicast needs batched I/O; ZEROSUM_IO is plain)"
    group, _, port = (default, "", "") if setting == "auto" else setting.partition(":")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"multicast {setting!r}: {port} is not a port (1-65535); give GROUP[:PORT], auto or off")
    if not T.is_multicast(group):
        raise ValueError(f"multicast {setting!r}: {group} is not an IPv4 multicast address (224.0.0.0/4); "
                         "give GROUP[:PORT], auto or off")
    found, problem = probe(group, int(port) if port else None)
    if problem is not None:
        if setting == "auto":
            return None, f"results to each worker (multicast {where} does not work here: {problem})"
        raise ValueError(f"multicast {setting!r}: {problem}")
    chosen = f"{group}:{port or found}"
    return chosen, f"results by multicast to {chosen}" + (f" (auto: {where})" if setting == "auto" else "")


LEAST_LOOPBACK_SLOTS = 256
CACHE_SHARE = 4          # a job's bytes in flight on loopback: at most a quarter of the last-level cache


def last_level_cache(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """Bytes of the largest data or unified cache of the first CPU (Linux sysfs: index*/type and size,
    e.g. "32768K"), None where it does not say."""
    best = None
    try:
        names = os.listdir(root)
    except OSError:
        return None
    for name in names:
        try:
            with open(f"{root}/{name}/type") as f:
                kind = f.read().strip()
            with open(f"{root}/{name}/size") as f:
                size = f.read().strip()
        except OSError:
            continue
        if kind in ("Data", "Unified") and size[:-1].isdigit():
            n = int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 0)
            best = n if best is None or n > best else best
    return best


def loopback_slots(world: int, block_size: int = 256) -> tuple[int, str]:
    """Slots per job for an aggregator that ZeroSum starts on loopback with all `world` workers on this
    host: the most (a power of two, LEAST_LOOPBACK_SLOTS to MAX_JOB_SLOTS) that keep the job's bytes in
    flight, world x slots blocks, within a quarter (CACHE_SHARE) of the last-level cache. On loopback
    every copy of a datagram (the worker's quantised block, the socket queue, the aggregator's bank, the
    result) is one host's memory traffic: with 8 workers and 2,048 slots (16 MiB in flight against a
    32 MiB cache) dense allreduces took about 13 % longer than with 1,024 (medians of eight alternating
    pairs), 16 workers 8-11 % longer than with 512, while 4 workers (8 MiB) gained nothing from fewer
    (benchmark log, "Slots by the cache on loopback"). On links the round trip decides instead, and
    fewer slots cost dense allreduces there: this is for loopback only. Returns (slots, why)."""
    from .aggregator_service import MAX_JOB_SLOTS
    cache = last_level_cache()
    if not cache:
        return MAX_JOB_SLOTS, f"{MAX_JOB_SLOTS:,} slots per job (the cache's size is unknown here)"
    per_slot = world * block_size * 4          # a block of int32 per worker in flight per slot
    slots = MAX_JOB_SLOTS
    while slots > LEAST_LOOPBACK_SLOTS and slots * per_slot * CACHE_SHARE > cache:
        slots //= 2
    bound = "at most" if slots * per_slot * CACHE_SHARE <= cache else "the least on loopback, more than"
    return slots, (f"{slots:,} slots per job (auto on loopback: {slots * per_slot / 2**20:g} MiB in flight, "
                   f"{bound} a quarter of the {cache / 2**20:g} MiB last-level cache)")


class LocalAggregator:
    """A software aggregator in its own process on 127.0.0.1; `stop()` ends it and returns its counters."""

    def __init__(self, workers: int | None, *, listen: str = "127.0.0.1:0", job: int = 1,
                 slots: int | None = None, loss: float = 0.0, seed: int | None = None,
                 max_job_slots: int | None = None, job_idle: float | None = None, prefix: Sequence[str] = (),
                 max_datagram: int | None = None, multicast: str | None = None, key: str | None = None,
                 insecure: bool = False, block_size: int = 256):
        """workers and job declare a job (None: jobs only come from JOINs); with `slots` alone, the one
        job gets them all (max_job_slots caps a job's share instead); with neither, a declared job on
        loopback gets `loopback_slots(workers, block_size)` (`slots_note` says how many and why).
        `prefix` is put before the command, e.g. ["ip", "netns", "exec", NS] to run it in a network
        namespace (the prefix must exec the command, so that the snapshot's signal reaches the
        aggregator). `key`: the secret the workers' JOINs must be authenticated with (handed over in a
        file only this user can read, removed once the aggregator has started); without one, a `listen`
        address other than loopback needs `insecure` (protected mode: zerosum aggregator --insecure)."""
        self.slots_note = None
        if slots is None and max_job_slots is None and workers and not prefix and _on_loopback(listen):
            max_job_slots, self.slots_note = loopback_slots(workers, block_size)
        cmd = [*prefix, sys.executable, "-m", "zerosum", "aggregator", "--listen", listen, "--job", str(job),
               "--loss", str(loss), "--announce"]
        if workers:
            cmd += ["--workers", str(workers)]
        if slots:
            most = max_job_slots or slots
            cmd += ["--slots", str(slots), "--max-job-slots", str(most), "--min-job-slots", str(min(64, most))]
        elif max_job_slots:
            cmd += ["--max-job-slots", str(max_job_slots)]
        if job_idle is not None:
            cmd += ["--job-idle", str(job_idle)]
        if seed is not None:
            cmd += ["--seed", str(seed)]
        if max_datagram is not None:
            cmd += ["--max-datagram", str(max_datagram)]
        if multicast:
            cmd += ["--multicast", multicast]
        if insecure:
            cmd += ["--insecure"]
        self.key = key
        self._counters: dict = {}
        with tempfile.TemporaryDirectory(prefix="zerosum-key-") as private:    # mode 0700
            if key is not None:
                key_file = os.path.join(private, "key")
                with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                    f.write(key)
                cmd += ["--key-file", key_file]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                         preexec_fn=_die_with_parent)
            atexit.register(self.stop)
            line = self.proc.stdout.readline().split()     # the key is read before the address is announced
        if len(line) != 2 or line[0] != ANNOUNCE:
            self.proc.kill()
            raise RuntimeError(f"the aggregator process did not start (exit code {self.proc.wait()})")
        self.address = line[1]
        self.port = int(self.address.rsplit(":", 1)[1])

    def snapshot(self, timeout: float = 30.0) -> dict:
        """The running aggregator's counters, `datagrams_sent` and `cpu_s` (CPU seconds so far)."""
        self.proc.send_signal(signal.SIGUSR1)
        # The aggregator prints nothing else on stdout until it stops, so nothing is left buffered.
        while select.select([self.proc.stdout], [], [], timeout)[0]:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(SNAPSHOT + " "):
                return json.loads(line.split(" ", 1)[1])
        raise RuntimeError("the aggregator process did not report its counters "
                           f"(exit code {self.proc.poll()})")

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
