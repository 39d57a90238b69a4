"""`zerosum.Worker`: the public API. Drives the worker state machine over a UDP socket."""
from __future__ import annotations

import numbers
import socket
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import protocol as P
from .aggregator_machine import new_nonce
from . import tensors
from .blocks import BlockSource, CollectedBlocks, DenseResult, block_count
from .errors import AggregatorSilent, ZeroSumError, ZeroSumTimeout
from .layout import Layout, balanced_column_order
from . import worker_kernels as K
from . import worker_state as WS
from . import perfmap
from . import transport as T
from .udp import LossHook, open_socket, parse_address
from .worker_machine import DELAY_TARGET, AllreduceMachine, JoinMachine, Scratch, WorkerConfig
from .warmup import warm_up

FLUSH_EVERY = 16   # datagrams processed before sending what is ready, even if more are queued


@dataclass
class WorkerStats:
    allreduces: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    datagrams_sent: int = 0
    datagrams_received: int = 0
    retransmitted_entries: int = 0
    probes: int = 0          # single entries sent to tell a loss from a slow peer (see AllreduceMachine.poll)
    tail_probes: int = 0     # of them, those sent for a quiet aggregator's round trips (R-L8)
    drops: dict = field(default_factory=dict)
    window: int = 0          # the last allreduce's window in bytes (the congestion window's, R-C*)
    srtt: float | None = None   # the longest of its aggregators' smoothed round trips, seconds
    min_rtt: float | None = None   # the least of its aggregators' least round trips
    window_cuts: tuple = (0, 0)  # congestion window cuts for delay and for loss (R-C3, R-C4), all allreduces
    spurious_entries: int = 0    # resent entries the aggregator already held (its STATUS answers; R-C4)
    drains: int = 0              # the congestion window's drains (R-C8), all allreduces
    competitive: bool = False    # the last drain found a queue that another flow keeps (R-C8)
    host_wait: float = 0.0       # the longest a result waited in the socket to be read, seconds (R-C4)
    # the last allreduce's exchange in time.monotonic(): from its bootstrap round (its blocks found, its
    # machine set up) to its last result, or to its failure; what came before it in the call was finding
    # the blocks
    exchange: tuple = (0.0, 0.0)


def _aggregator_list(aggregators) -> tuple[list[str], list[tuple[str, int]]]:
    """The aggregators' names and (host, port) addresses from "HOST:PORT" strings (or one string)."""
    if isinstance(aggregators, str):
        aggregators = [aggregators]
    if not aggregators:
        raise ValueError("at least one aggregator address is needed")
    return [str(a) for a in aggregators], [parse_address(a) for a in aggregators]


class Worker:
    """One rank of a ZeroSum job. Use as a context manager; `allreduce(x)` returns the sum over ranks.

    aggregators: "HOST:PORT" strings, in the same order on every worker (columns are striped over them).
    timeout: seconds without progress before an allreduce (or the join) fails with ZeroSumTimeout.
    loss: simulated loss rate of this worker's datagrams in both directions (for experiments and tests).
    bind: the local "HOST:PORT" (a switch knows its workers by source address and port).
    max_entries: entries per datagram; a P4 switch takes 1 (with block_size 64, its compiled width).
    key: a secret (bytes or str) shared with the aggregators: JOINs carry an HMAC over their fields, so
        only holders of the key can join as a rank or restart the job (DATA is not authenticated).
    gather_on_device: for torch tensors, detect and gather non-zero blocks with torch on the tensor's
        device and copy only those to the host (default: for non-CPU tensors; True forces it on CPU).
    max_datagram: the largest datagram sent (UDP payload bytes); by default the path MTU to the
        aggregators less 28 bytes of headers (1,472 for MTU 1,500, 65,507 on loopback), so that no
        datagram is IP-fragmented. With UDP GSO a run of them costs one system call.
    multicast: "GROUP:PORT", the IP multicast group an aggregator started with --multicast sends the
        results to (once for every worker, instead of once per worker); this worker joins it.
    window: bytes in flight (docs/protocol.md, R-L6): the entries of at most window / (16 +
        4 * block_size) columns are out at once, and so are their results, which is what the link to
        this worker must queue. "auto" (the default): a congestion window that finds the path's rate by
        itself (R-C1..R-C8: slow start, additive increase, cuts on queueing delay and on loss, drains
        that share a link between jobs); where every aggregator is on this host (no link to find the
        rate of), no window. A number of bytes: an upper bound for the congestion window.
        None: no window, every column at once, as fast as the socket takes them (on a link slower than
        the aggregator's, the results then overflow the link's queue).
    congestion: False turns the congestion window off: a number `window` is then the fixed window,
        e.g. a hand-tuned bandwidth-delay product plus what the switch port can queue.
    delay_target: the queueing delay the congestion window allows above the least round trip seen,
        in seconds (R-C3).
    pacing: the rounds the congestion window admits leave paced, a little faster than the window per
        round trip, so that a large window does not reach a shallow switch queue in one burst (R-C7).
        None (the default): paced unless every aggregator is on this host, where no link queues them.
        False sends them in bursts (to compare); True paces them on this host too.
    silence: seconds after which an aggregator that answers nothing while this worker waits for it is
        taken as gone (docs/protocol.md, R-L7): the allreduce raises AggregatorSilent at once, saying which
        blocks of the output are final, instead of waiting for `timeout` (a live aggregator answers
        probes even while it waits for a slower rank). None (the default): only `timeout`.
    """

    def __init__(self, rank: int, world_size: int, aggregators=("127.0.0.1:48879",), job: int = 1,
                 block_size: int = 256, *, timeout: float = 30.0, max_datagram: int | None = None,
                 rto: float = 0.2, loss: float = 0.0, seed: int | None = None, bind: str = "0.0.0.0:0",
                 gather_on_device: bool | None = None, max_entries: int = 0xFFFF, key=None,
                 window: int | str | None = "auto", congestion: bool = True,
                 delay_target: float = DELAY_TARGET, pacing: bool | None = None, multicast: str | None = None,
                 silence: float | None = None):
        if not 1 <= world_size <= P.MAX_WORLD:
            raise ValueError(f"world_size must be 1..{P.MAX_WORLD}, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be 0..{world_size - 1}, got {rank}")
        if not 0 <= job <= 0xFFFF:
            raise ValueError(f"job must be 0..65535, got {job}")
        if not 1 <= block_size <= 0xFFFF:
            raise ValueError(f"block_size must be 1..65535, got {block_size}")
        self.aggregator_names, self.aggregators = _aggregator_list(aggregators)
        if not 1 <= max_entries <= 0xFFFF:
            raise ValueError(f"max_entries must be 1..65535, got {max_entries}")
        if window is not None and window != "auto":
            if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
                raise ValueError(f"window must be 'auto', a positive number of bytes or None, got {window!r}")
            window = int(window)
        if not (isinstance(delay_target, numbers.Real) and delay_target > 0):
            raise ValueError(f"delay_target must be a positive number of seconds, got {delay_target!r}")
        if isinstance(key, str):
            key = key.encode()
        if key is not None and not key:
            raise ValueError("key must not be empty (pass None for no key)")
        if max_datagram is None:
            # the path's MTU less the IPv4 and UDP headers: never IP fragments (docs/protocol.md, "Fusion")
            max_datagram = T.datagram_limit(self.aggregators, P.MAX_DATAGRAM)
        self._asked = (window, pacing)
        self.config = WorkerConfig(rank=rank, world=world_size, job=job, max_datagram=max_datagram,
                                   max_entries=max_entries, block_size=block_size, key=key,
                                   rto=rto, timeout=timeout, aggregator_names=self.aggregator_names,
                                   congestion=bool(congestion), delay_target=float(delay_target),
                                   # R-C8: drains fall on the wall clock's periods, time.monotonic() drives
                                   wall_clock=time.time() - time.monotonic())
        self._follow_path()
        self.set_silence(silence)     # R-L7
        P.max_entries(max_datagram, block_size)   # validates that one block fits
        self.rank, self.world_size, self.job, self.block_size = rank, world_size, job, block_size
        self.timeout = timeout
        self.loss = LossHook(loss, seed)
        if seed is not None:
            T.seed_loss(seed)      # the compiled driver's simulated loss
        self.bind = parse_address(bind, 0)
        self.multicast = None
        if multicast:
            self.multicast = parse_address(multicast)
            if not T.is_multicast(self.multicast[0]):
                raise ValueError(f"multicast={multicast!r}: {self.multicast[0]} is not an IPv4 multicast address")
        self._group = None      # the socket that receives the multicast group
        self.stats = WorkerStats()
        self.sock: socket.socket | None = None
        self.slots = 0
        self._column_orders: dict[int, np.ndarray] = {}   # nblocks -> column order (balance_columns)
        self.epoch = 0
        self.gather_on_device = gather_on_device
        self._staging = tensors.Staging()     # host memory for device tensors' blocks, kept between allreduces
        self._path = None     # what the last allreduce learnt of the path (PathEstimate) for the next one
        self._scratch = Scratch()   # memory the allreduces' machines reuse, one at a time
        # (blocks of the last allreduce's sum that hold data, blocks of its tensor): the union density of
        # the ranks' non-zero blocks, the same on every rank
        self.last_union = (0, 0)
        self._leave = None    # the LEAVE datagram, once joined
        self._rejoin = None   # the JoinMachine of poll_rejoin, while it runs

    # -- lifecycle ----------------------------------------------------------------------------------
    def __enter__(self) -> "Worker":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        if self.sock is not None:
            return
        warm_up()     # compile the kernels before the join barrier, not during the first allreduce
        # Results arrive in bursts of up to one datagram per group of slots from every aggregator.
        self.sock, _ = open_socket(self.bind, rcvbuf=16 << 20)
        self._from = {addr: i for i, addr in enumerate(self.aggregators)}
        self._keys = np.array([T.address_key(a) for a in self.aggregators], np.int64)
        self._features = T.detect(self.sock)
        self._rx = T.rx_batch()
        # Not with GSO: the simulated loss drops single datagrams, not runs of them; and a switch
        # (max_entries 1) may read raw frames (bmv2, the emulator's ports), where a GSO run crosses a
        # veth link uncut, as one oversized frame, instead of as datagrams
        self._tx = T.tx_queue(self._features.gso and not self.loss.rate and self.config.max_entries > 1)
        # One buffer per datagram of a batch: a batch's datagrams are parsed in place, then merged.
        self._buf = bytearray(P.MAX_DATAGRAM + 1)
        self._view = memoryview(self._buf)
        try:
            if self.multicast:
                self._join_group()
            self._join()
        except BaseException:
            self.close()
            raise

    def _join_group(self) -> None:
        """Receive the multicast group the aggregators send results to, through the interface that
        reaches the first aggregator."""
        if not self._features.batched:
            raise ZeroSumError("multicast results need batched I/O (Linux, ZEROSUM_IO other than plain)")
        self._group = T.multicast_receiver(self.multicast, T.local_ip(self.aggregators[0]), 16 << 20)

    def close(self) -> None:
        if self.sock is not None:
            if self._leave:    # end this rank's run: the aggregators free the job's slots once every rank left
                self._send_all(self._leave)
            self.sock.close()
            self.sock = None
            self._leave = None
        if self._group is not None:
            self._group.close()
            self._group = None
        self._scratch = Scratch()    # the memory kept for the next allreduce goes with the socket
        self._staging = tensors.Staging()
        if perfmap.installed():
            perfmap.write()      # a multiprocessing child ends without running atexit

    # -- I/O helpers --------------------------------------------------------------------------------
    def _send_all(self, datagrams) -> None:
        for a, data in datagrams:
            self._send(a, data)

    def _send(self, aggregator: int, data: bytes) -> None:
        self.stats.datagrams_sent += 1
        if self.loss.drop():
            return
        try:
            self.sock.sendto(data, self.aggregators[aggregator])
        except OSError:
            pass    # e.g. ECONNREFUSED from an earlier ICMP error, or a full buffer: it is a loss

    def _recv(self, wait: float):
        """One datagram as (aggregator index, memoryview into the receive buffer, valid until the next
        call, whether it arrived marked Congestion Experienced), or None after `wait` s."""
        self.sock.settimeout(max(wait, 0.0))   # 0: non-blocking
        buf = self._buf
        try:
            n, ancdata, _, addr = self.sock.recvmsg_into([buf], T.ECN_ANCILLARY)
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
        return idx, self._view[:n], T.congestion_experienced(ancdata)

    # -- join ---------------------------------------------------------------------------------------
    def _join(self) -> None:
        """Register with every aggregator; return once every rank has joined (a barrier)."""
        m = JoinMachine(self.config, len(self.aggregators), new_nonce(), time.monotonic())
        try:
            while not m.done:
                now = time.monotonic()
                self._send_all(m.datagrams_to_send(now))
                got = self._recv(m.timer() - now)
                if got is not None:
                    m.receive(got[0], got[1], time.monotonic())
        except ZeroSumTimeout as e:
            if all(m.heard):
                raise
            # an aggregator never answered: it may be a switch that does not know this worker
            silent = next(a for a, heard in enumerate(m.heard) if not heard)
            raise ZeroSumTimeout(f"{e}; a switch answers only the workers in its membership table: this "
                                 f"worker sends from {self._source_to(silent)}") from None
        self.slots = m.slots
        self._leave = m.leave()
        sends = [self.aggregator_names[a] for a, f in enumerate(m.features) if f & P.FEATURE_MULTICAST]
        if sends and self._group is None:
            raise ZeroSumError(f"aggregator {', '.join(sends)} sends results to an IP multicast group: give "
                               "this worker the group it was started with (Worker(multicast='GROUP:PORT'), "
                               "ZEROSUM_MULTICAST)")
        # A rank that joined late may still be re-sending JOIN: the aggregators answer it, not us.

    def set_silence(self, seconds: float | None) -> None:
        """Set `silence` (see the class docstring) for the allreduces that follow."""
        if seconds is not None and not seconds > 0:
            raise ValueError(f"silence must be a positive number of seconds or None, got {seconds!r}")
        self.config.silence = seconds
        # R-L7: probes at most silence / 3 apart, so that a live aggregator is heard from in time
        self.config.max_rto = 1.0 if seconds is None else min(1.0, seconds / 3)

    def _follow_path(self) -> None:
        """The window and the pacer for the aggregators' path. No link carries the datagrams to an
        aggregator on this host: there "auto" is no window, since the congestion window (R-C*) would find
        only the processes' waits for a core, and the pacer (R-C7) would turn those into a rate."""
        window, pacing = self._asked
        here = T.on_this_host(self.aggregators)
        self.config.window = None if window == "auto" and here else window   # R-L6: every column at once
        self.config.pacing = not here if pacing is None else bool(pacing)

    def use_aggregators(self, aggregators) -> None:
        """Send to these aggregators ("HOST:PORT" strings, the same list on every rank) from now on, e.g. a
        standby after the aggregators failed; join them with poll_rejoin. The datagram size limit stays
        the one of the first aggregators; the window and the pacer follow the new ones."""
        self._check_open()
        self.aggregator_names, self.aggregators = _aggregator_list(aggregators)
        self.config.aggregator_names = self.aggregator_names
        self._from = {addr: i for i, addr in enumerate(self.aggregators)}
        self._keys = np.array([T.address_key(a) for a in self.aggregators], np.int64)
        self._column_orders.clear()        # a balance for other aggregators' columns
        self._follow_path()                # e.g. from an aggregator on this host to one across a link
        self._path = None
        self._rejoin = None

    def poll_rejoin(self) -> bool:
        """Join again, without blocking: send the JOIN when due, take what has arrived, and say whether
        every rank has joined. The first call starts a new run of the job (a new nonce, R-J3: e.g. at an
        aggregator restarted after a failure); later calls continue it (and start over once a run of the
        JOIN timed out). Once True, allreduces go through the aggregators again, and it stays True until
        the next allreduce (a new nonce before then would restart the job under the other ranks' feet)."""
        self._check_open()
        now = time.monotonic()
        if self._rejoin is None:
            self._rejoin = JoinMachine(self.config, len(self.aggregators), new_nonce(), now)
        m = self._rejoin
        if m.done:
            return True
        try:
            self._send_all(m.datagrams_to_send(now))
            while not m.done:
                got = self._recv(0.0)
                if got is None:
                    break
                m.receive(got[0], got[1], time.monotonic())
        except ZeroSumTimeout:
            self._rejoin = None            # nobody answered within the timeout: the next call starts over
            return False
        if not m.done:
            return False
        self.slots = m.slots
        self._leave = m.leave()
        return True

    def _source_to(self, aggregator: int) -> str:
        """The address (IP:PORT) this worker's datagrams to `aggregator` come from, as the aggregator
        sees it (the socket may be bound to the wildcard address)."""
        ip, port = self.sock.getsockname()[:2]
        if ip == "0.0.0.0":
            try:
                ip = T.local_ip(self.aggregators[aggregator])
            except OSError:
                pass
        return f"{ip}:{port}"

    # -- allreduce ----------------------------------------------------------------------------------
    def allreduce(self, x, out=None, *, average: bool = False):
        """Sum `x` over all ranks; returns an array of the same shape and dtype (float32 or int32).

        x: a numpy array or a torch tensor (on any device; the result is on the same device). A torch
        sparse COO tensor (e.g. the gradient of nn.Embedding(sparse=True)) is reduced from its non-zero
        values alone and the sum is returned as a coalesced sparse tensor of the same layout.
        out: where to write the sum (same shape and dtype); `out=x` reduces in place, which avoids
        allocating and zero-filling a result. By default a new array/tensor is returned.
        average: divide the sum by the number of ranks (float32 only), as each block arrives: the same
        values as dividing the result afterwards, without another pass over the whole tensor.
        """
        self._check_open()
        if tensors.is_tensor(x):
            if x.layout != sys.modules["torch"].strided:
                if out is not None:
                    raise ValueError("out is not supported for sparse tensors")
                return self._allreduce_sparse_tensor(x, average)
            return self._allreduce_tensor(x, out, average)
        arr = np.asarray(x)
        if average and arr.dtype != np.float32:
            raise ValueError(f"average=True needs float32 data, not {arr.dtype}")
        flat = np.ascontiguousarray(arr).reshape(-1)
        source = BlockSource.dense(flat, self.block_size)
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
        self._reduce(source, DenseResult(result.reshape(-1)), average)
        return result

    def allreduce_blocks(self, blocks, rows, num_blocks: int, *, average: bool = False):
        """Sum block-sparse input over all ranks: `blocks` (sorted, unique block indices below
        `num_blocks`, the same on every rank) with their values `rows` (len(blocks) x block_size,
        float32 or int32). Returns (block indices, rows) of the sum, sorted: every block some rank
        sent. The cost follows the blocks given, not num_blocks: no dense buffer is scanned or written.
        The sums are collected in memory the worker keeps for its next allreduces (the largest union so
        far, and half again) and returned as copies; close() releases it.
        """
        self._check_open()
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] != self.block_size:
            raise ValueError(f"rows must be a (len(blocks), {self.block_size}) array, got shape {rows.shape}")
        if average and rows.dtype != np.float32:
            raise ValueError(f"average=True needs float32 data, not {rows.dtype}")
        return self._reduce_blocks(blocks, rows, int(num_blocks), average)

    def _reduce_blocks(self, blocks, rows, num_blocks: int, average: bool, staging_for=None):
        """allreduce_blocks after its checks; with `staging_for` (a device tensor) the sums are collected
        in this worker's Staging and returned in arrival order, as views of it."""
        source = BlockSource.compact(blocks, rows, num_blocks)
        # room for the union (at most every block) and what the driver reserves ahead of a batch, so
        # that a dense result is not copied into a larger buffer near its end
        reserve = T.RX_BATCH * self._rows_per_buffer(self.block_size)
        capacity = max(64, min(2 * len(source.blocks), num_blocks + reserve))
        if staging_for is None:
            # collected in memory kept between allreduces, returned as sorted copies
            sink = CollectedBlocks(rows.dtype, self.block_size, capacity=capacity,
                                   allocate=self._scratch.kept.array)
        else:
            pinned = staging_for.is_cuda

            def allocate(role, values, dtype):
                # the sums page-locked for their copy to the device; their indices stay on the host
                return self._staging.array("out" if role == "rows" else "out-blocks", values, dtype,
                                           pinned and role == "rows")
            sink = CollectedBlocks(rows.dtype, self.block_size, capacity=capacity, allocate=allocate)
        try:
            self._reduce(source, sink, average)
        except AggregatorSilent as e:
            e.collected = sink.collected(sort=staging_for is None)
            raise
        return sink.collected(sort=staging_for is None)

    def _check_open(self) -> None:
        if self.sock is None:
            raise ZeroSumError("worker is not open: use `with zerosum.Worker(...) as w:` or call open()")

    def balance_columns(self, nonzero_counts) -> tuple[np.ndarray, np.ndarray]:
        """Serve the columns of tensors of len(nonzero_counts) blocks by measured load, not by striping.

        A collective, like allreduce: every rank calls it at the same point, between allreduces, with
        how often each of its blocks was non-zero in recent steps. The counts are summed over the ranks
        through the aggregators (an exact int32 allreduce), so every rank derives the same column order
        (layout.balanced_column_order), which the following allreduces of that size use. Returns the
        aggregators' share of the summed load under plain striping and under the new order.
        """
        counts = np.ascontiguousarray(nonzero_counts, np.int64).reshape(-1)
        if not len(counts) or (counts < 0).any() or counts.max() > np.iinfo(np.int32).max // self.world_size:
            raise ValueError("nonzero_counts must be a non-empty vector of non-negative counts, one per block")
        total = self.allreduce(counts.astype(np.int32))
        A = len(self.aggregators)
        order = balanced_column_order(total, A, self.slots)
        self._column_orders[len(counts)] = order
        before = Layout(A, self.slots, len(counts)).aggregator_load(total)
        after = Layout(A, self.slots, len(counts), order).aggregator_load(total)
        scale = max(1.0, float(total.sum()))
        return before / scale, after / scale

    def stripe_columns(self) -> None:
        """Back to plain striping for every tensor size (undoes balance_columns; between allreduces)."""
        self._column_orders.clear()

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
        if average and not t.is_floating_point():
            raise ValueError(f"average=True needs float32 data, not {t.dtype}")
        self._check_open()
        blocks, rows = tensors.gather_nonzero(t, self.block_size, self._staging)
        nblocks = block_count(t.numel(), self.block_size)
        try:
            summed = self._reduce_blocks(blocks, rows, nblocks, average, staging_for=t) if nblocks else \
                (np.zeros(0, np.int64), rows)
        except AggregatorSilent as e:
            # R-L7 promises the sums received so far in the output, as the host path writes them there
            if out is not None and e.collected is not None:
                tensors.scatter_result(t, *e.collected, self.block_size, out)
            raise
        return tensors.scatter_result(t, *summed, self.block_size, out)

    def _allreduce_sparse_tensor(self, t, average):
        blocks, rows, nblocks = tensors.sparse_to_blocks(t, self.block_size)
        summed = self.allreduce_blocks(blocks, rows, nblocks, average=average)
        return tensors.blocks_to_sparse(t, *summed, self.block_size)

    def _reduce(self, source: BlockSource, sink, average: bool = False) -> None:
        """One allreduce: a new epoch, then the state machine until every column is done."""
        self.epoch = (self.epoch + 1) & 0xFFFFFFFF or 1
        self.last_union = (0, source.nblocks)
        self._rejoin = None
        if source.nblocks:
            layout = Layout(len(self.aggregators), self.slots, source.nblocks,
                            self._column_orders.get(source.nblocks))
            m = AllreduceMachine(self.config, self.epoch, source, layout, sink, average=average, path=self._path,
                                 scratch=self._scratch)
            began = time.monotonic()
            try:
                self._run(m)
            finally:
                self.stats.exchange = (began, time.monotonic())
            self._path = m.path
            # (the path's window: an allreduce that ended in a drain (R-C8) held 2 entries only for it)
            self.stats.window = int(self._path.cwnd) if m.st.i[WS.I_CONGESTION] else m.window_columns * (
                P.ENTRY_SIZE + 4 * self.block_size)
            self.stats.srtt, self.stats.min_rtt = m.srtt, m.min_rtt
            cuts = m.window_cuts
            self.stats.window_cuts = (self.stats.window_cuts[0] + cuts[0], self.stats.window_cuts[1] + cuts[1])
            self.stats.spurious_entries += m.spurious_entries
            self.stats.drains += m.drains
            self.stats.competitive = self._path.competitive > 0
            self.stats.host_wait = max(self.stats.host_wait, self._path.host_wait)
            self.last_union = (m.union_blocks, source.nblocks)
        else:
            now = time.monotonic()
            self.stats.exchange = (now, now)      # nothing to exchange
        self.stats.allreduces += 1

    def _run(self, m: AllreduceMachine) -> None:
        """Drive the machine until the allreduce is done: in compiled code (worker_kernels.drive: batches of
        received datagrams applied, ready rounds sent with sendmmsg/GSO, waits on the socket until the
        machine's timer), entering Python only for probes, retransmissions, violations and growing a
        sink; where batched I/O is not available, through the machine's Python interface."""
        before = m.st.i[WS.I_DATAGRAMS_SENT], m.st.i[WS.I_BYTES_RECEIVED], m.st.i[WS.I_DATAGRAMS_RECEIVED]
        try:
            if self._features.batched:
                self._run_compiled(m)
            else:
                self._run_python(m)
        finally:
            i = m.st.i
            self.stats.datagrams_sent += int(i[WS.I_DATAGRAMS_SENT] - before[0])
            self.stats.bytes_received += int(i[WS.I_BYTES_RECEIVED] - before[1])
            self.stats.datagrams_received += int(i[WS.I_DATAGRAMS_RECEIVED] - before[2])
            self.stats.bytes_sent += m.bytes_sent
            self.stats.retransmitted_entries += m.retransmitted
            self.stats.probes += m.probes
            self.stats.tail_probes += m.tail_probes
            for k, v in m.drops.items():
                self.stats.drops[k] = self.stats.drops.get(k, 0) + v

    def _run_compiled(self, m: AllreduceMachine) -> None:
        fd, rx, tx = self.sock.fileno(), self._rx, self._tx
        keys = self._keys
        m.begin(time.monotonic())
        n = i = off = 0
        room = 0
        while True:
            if m.output.collect:
                m.grow(T.RX_BATCH * self._rows_per_buffer(m.B))
                room = m.output.capacity
            outcome, n, i, off = K.drive(fd, self._group.fileno() if self._group is not None else -1, rx, tx,
                                         m.st, keys, self.loss.rate, room, n, i, off)
            if outcome == K.DONE:
                return
            now = time.monotonic()
            if outcome == K.PROBE:
                m.judge_probes(now)
            elif outcome == K.VIOLATION:
                m.fail(int(m.st.i[WS.I_VIOLATION]), int(m.st.i[WS.I_EVENT_AGG]))      # R-L4: raises
            elif outcome == K.TIMER:
                self._send_all(m.poll(now))   # retransmissions (rare: Python's sends will do)

    @staticmethod
    def _rows_per_buffer(block_size: int) -> int:
        """Result rows one receive buffer can hold, at most."""
        return T.RX_CAPACITY // (4 * block_size) + 1

    def _run_python(self, m: AllreduceMachine) -> None:
        """The sans-IO interface over Python's socket module: read everything queued (up to FLUSH_EVERY
        datagrams), then send what became ready in one go, then wait for the next datagram or the
        machine's timer. Under CPU contention a result may sit in the buffer while its timer expires:
        the queue is read before timers are judged."""
        self._send_all(m.start(time.monotonic()))
        while not m.done:
            for _ in range(FLUSH_EVERY):
                got = self._recv(0.0)
                if got is None:
                    break
                m.receive(got[0], got[1], time.monotonic(), got[2])
            now = time.monotonic()
            self._send_all(m.datagrams_to_send(now))
            if m.done:
                break
            got = self._recv(m.timer() - time.monotonic())
            if got is not None:
                m.receive(got[0], got[1], time.monotonic(), got[2])
