"""`zerosum.Worker`: the public API. Drives the worker state machine over a UDP socket."""
from __future__ import annotations

import socket
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import protocol as P
from .aggregator_machine import new_nonce
from . import tensors
from .blocks import BlockView, CollectedBlocks, find_nonzero_blocks
from .errors import ZeroSumError, ZeroSumTimeout
from .layout import Layout
from .udp import LossHook, open_socket, parse_address
from .worker_machine import AllreduceMachine, WorkerConfig

JOIN_INTERVAL = 0.05
FLUSH_EVERY = 16   # datagrams processed before sending what is ready, even if more are queued


@dataclass
class WorkerStats:
    allreduces: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    datagrams_sent: int = 0
    datagrams_received: int = 0
    retransmitted_entries: int = 0
    drops: dict = field(default_factory=dict)


class Worker:
    """One rank of a ZeroSum job. Use as a context manager; `allreduce(x)` returns the sum over ranks.

    aggregators: "HOST:PORT" strings, in the same order on every worker (columns are striped over them).
    timeout: seconds without progress before an allreduce (or the join) fails with ZeroSumTimeout.
    loss: simulated loss rate of this worker's datagrams in both directions (for experiments and tests).
    bind: the local "HOST:PORT" (a switch knows its workers by source address and port).
    max_entries: entries per datagram; a P4 switch takes 1 (with block_size 64, its compiled width).
    gather_on_device: for torch tensors, detect and gather non-zero blocks with torch on the tensor's
        device and copy only those to the host (default: for non-CPU tensors; True forces it on CPU).
    """

    def __init__(self, rank: int, world_size: int, aggregators=("127.0.0.1:48879",), job: int = 1,
                 block_size: int = 256, *, timeout: float = 30.0, max_datagram: int = P.MAX_DATAGRAM,
                 rto: float = 0.2, loss: float = 0.0, seed: int | None = None, bind: str = "0.0.0.0:0",
                 gather_on_device: bool | None = None, max_entries: int = 0xFFFF):
        if not 1 <= world_size <= P.MAX_WORLD:
            raise ValueError(f"world_size must be 1..{P.MAX_WORLD}, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be 0..{world_size - 1}, got {rank}")
        if not 0 <= job <= 0xFFFF:
            raise ValueError(f"job must be 0..65535, got {job}")
        if not 1 <= block_size <= 0xFFFF:
            raise ValueError(f"block_size must be 1..65535, got {block_size}")
        if isinstance(aggregators, str):
            aggregators = [aggregators]
        if not aggregators:
            raise ValueError("at least one aggregator address is needed")
        self.aggregator_names = [str(a) for a in aggregators]
        self.aggregators = [parse_address(a) for a in aggregators]
        if not 1 <= max_entries <= 0xFFFF:
            raise ValueError(f"max_entries must be 1..65535, got {max_entries}")
        self.config = WorkerConfig(rank=rank, world=world_size, job=job, max_datagram=max_datagram,
                                   max_entries=max_entries,
                                   rto=rto, timeout=timeout, aggregator_names=self.aggregator_names)
        P.max_entries(max_datagram, block_size)   # validates that one block fits
        self.rank, self.world_size, self.job, self.block_size = rank, world_size, job, block_size
        self.timeout = timeout
        self.loss = LossHook(loss, seed)
        self.bind = parse_address(bind, 0)
        self.stats = WorkerStats()
        self.sock: socket.socket | None = None
        self.slots = 0
        self.epoch = 0
        self.gather_on_device = gather_on_device

    # -- lifecycle ----------------------------------------------------------------------------------
    def __enter__(self) -> "Worker":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        if self.sock is not None:
            return
        # Results arrive in bursts of up to one datagram per group of slots from every aggregator.
        self.sock, _ = open_socket(self.bind, rcvbuf=16 << 20)
        self._from = {addr: i for i, addr in enumerate(self.aggregators)}
        # One buffer per datagram of a batch: a batch's datagrams are parsed in place, then merged.
        self._bufs = [bytearray(P.MAX_DATAGRAM + 1) for _ in range(FLUSH_EVERY)]
        try:
            self._join()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    # -- I/O helpers --------------------------------------------------------------------------------
    def _send(self, aggregator: int, data: bytes) -> None:
        self.stats.bytes_sent += len(data)
        self.stats.datagrams_sent += 1
        if self.loss.drop():
            return
        try:
            self.sock.sendto(data, self.aggregators[aggregator])
        except OSError:
            pass    # e.g. ECONNREFUSED from an earlier ICMP error, or a full buffer: it is a loss

    def _recv(self, wait: float, slot: int = 0):
        """One datagram as (aggregator index, memoryview into buffer `slot`), or None after `wait` s."""
        self.sock.settimeout(max(wait, 0.0))   # 0: non-blocking
        buf = self._bufs[slot]
        try:
            n, addr = self.sock.recvfrom_into(buf)
        except (socket.timeout, BlockingIOError):
            return None
        except ConnectionRefusedError:
            return None
        self.stats.bytes_received += n
        self.stats.datagrams_received += 1
        if self.loss.drop():
            return None
        idx = self._from.get(addr)
        if idx is None:
            self.stats.drops["unknown_source"] = self.stats.drops.get("unknown_source", 0) + 1
            return None
        return idx, memoryview(buf)[:n]

    # -- join ---------------------------------------------------------------------------------------
    def _join(self) -> None:
        nonce = new_nonce()
        join = P.encode(P.Header(P.JOIN, self.job, self.rank, self.world_size, nonce, 0, self.block_size))
        full = (1 << self.world_size) - 1
        joined = [0] * len(self.aggregators)
        heard = [False] * len(self.aggregators)
        slots = [0] * len(self.aggregators)
        start = time.monotonic()
        next_send = start
        while not all(j == full for j in joined):
            now = time.monotonic()
            if now - start > self.timeout:
                raise ZeroSumTimeout(self._join_failure(joined, heard))
            if now >= next_send:
                for a in range(len(self.aggregators)):
                    if joined[a] != full:
                        self._send(a, join)
                next_send = now + JOIN_INTERVAL
            got = self._recv(next_send - now)
            if got is None:
                continue
            a, data = got
            try:
                d = P.decode(data)
            except P.ProtocolError:
                continue
            if d.header.type == P.JOIN_ACK and d.header.job == self.job and d.header.epoch == nonce:
                slots[a], bitmap = P.JOIN_ACK_BODY.unpack(d.body)
                joined[a] |= bitmap
                heard[a] = True
        self.slots = min(slots)
        # A rank that joined late may still be re-sending JOIN: the aggregators answer it, not us.

    def _join_failure(self, joined, heard) -> str:
        silent = [n for n, h in zip(self.aggregator_names, heard) if not h]
        if silent:
            return (f"rank {self.rank}: no answer to JOIN from aggregator {', '.join(silent)} within "
                    f"{self.timeout:.1f} s (is it running for job {self.job} with --workers "
                    f"{self.world_size}? a switch also needs its block size, 64, and this worker's "
                    f"address {self.sock.getsockname()[0]}:{self.sock.getsockname()[1]} in its membership table)")
        full = (1 << self.world_size) - 1
        missing = sorted({r for j in joined for r in range(self.world_size) if not (j | ~full) >> r & 1})
        return (f"rank {self.rank}: ranks {', '.join(map(str, missing))} did not join job {self.job} "
                f"within {self.timeout:.1f} s")

    # -- allreduce ----------------------------------------------------------------------------------
    def allreduce(self, x, out=None, *, average: bool = False):
        """Sum `x` over all ranks; returns an array of the same shape and dtype (float32 or int32).

        x: a numpy array or a torch tensor (on any device; the result is on the same device).
        out: where to write the sum (same shape and dtype); `out=x` reduces in place, which avoids
        allocating and zero-filling a result. By default a new array/tensor is returned.
        average: divide the sum by the number of ranks (float32 only), as each block arrives: the same
        values as dividing the result afterwards, without another pass over the whole tensor.
        """
        if self.sock is None:
            raise ZeroSumError("worker is not open: use `with zerosum.Worker(...) as w:` or call open()")
        if tensors.is_tensor(x):
            return self._allreduce_tensor(x, out, average)
        arr = np.asarray(x)
        if average and arr.dtype != np.float32:
            raise ValueError(f"average=True needs float32 data, not {arr.dtype}")
        flat = np.ascontiguousarray(arr).reshape(-1)
        view = BlockView(flat, self.block_size)
        sparse = find_nonzero_blocks(view)
        if out is None:
            result = np.zeros(arr.shape, flat.dtype)
        else:
            if not isinstance(out, np.ndarray) or out.shape != arr.shape or out.dtype != flat.dtype:
                raise ValueError(f"out must be a {flat.dtype} array of shape {arr.shape}")
            if not out.flags.c_contiguous:
                raise ValueError("out must be C-contiguous")
            result = out
            if np.may_share_memory(out, flat):
                if out.ctypes.data != flat.ctypes.data:
                    raise ValueError("out overlaps x without being x: pass out=x to reduce in place")
            else:
                result[...] = 0
        self._reduce(view, sparse, BlockView(result.reshape(-1), self.block_size), average)
        return result

    def _allreduce_tensor(self, t, out, average):
        tensors.check_dtype(t)
        if out is not None and (not tensors.is_tensor(out) or out.shape != t.shape or out.dtype != t.dtype
                                or out.device != t.device or not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous {t.dtype} tensor of shape {tuple(t.shape)} "
                             f"on {t.device}")
        on_device = self.gather_on_device if self.gather_on_device is not None else t.device.type != "cpu"
        if not on_device:
            # CPU tensors share memory with numpy: the numpy path, without copies.
            src = t.detach()
            if not src.is_contiguous():
                src = src.contiguous()
            res = self.allreduce(src.numpy(), out=None if out is None else out.detach().numpy(),
                                 average=average)
            return out if out is not None else sys.modules["torch"].from_numpy(res)
        view, sparse = tensors.gather_nonzero(t, self.block_size)
        if average and view.is_int:
            raise ValueError(f"average=True needs float32 data, not {t.dtype}")
        sink = CollectedBlocks(np.int32 if view.is_int else np.float32)
        self._reduce(view, sparse, sink, average)
        return tensors.scatter_result(t, sink, self.block_size, out)

    def _reduce(self, view, sparse, sink, average: bool = False) -> None:
        """One allreduce: a new epoch, then the state machine until every column is done."""
        self.epoch = (self.epoch + 1) & 0xFFFFFFFF or 1
        if view.nblocks:
            layout = Layout(len(self.aggregators), self.slots, view.nblocks)
            self._run(AllreduceMachine(self.config, self.epoch, view, sparse, layout, sink, average=average))
        self.stats.allreduces += 1

    def _run(self, m: AllreduceMachine) -> None:
        try:
            for a, data in m.start(time.monotonic()):
                self._send(a, data)
            batch = []
            while not m.done:
                # Read everything that is queued (up to FLUSH_EVERY datagrams) and apply it in one
                # pass before sending or judging timers: results only mark columns ready, and one flush
                # sends them all (fewer, fuller datagrams when behind); under CPU contention a result
                # may sit in the buffer while its timer expires.
                while len(batch) < FLUSH_EVERY and (got := self._recv(0.0, len(batch))) is not None:
                    batch.append(got)
                if batch:
                    m.receive_many(batch, time.monotonic())
                    batch = []
                for a, data in m.flush(time.monotonic()):
                    self._send(a, data)
                if m.done:
                    break
                now = time.monotonic()
                if now >= m.deadline_at:
                    for a, data in m.poll(now):
                        self._send(a, data)
                    continue
                got = self._recv(m.deadline_at - now)
                if got is not None:
                    batch.append(got)
        finally:
            self.stats.retransmitted_entries += m.retransmitted
            for k, v in m.drops.items():
                self.stats.drops[k] = self.stats.drops.get(k, 0) + v
