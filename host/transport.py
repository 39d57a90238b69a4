"""Batched UDP I/O for both endpoints, in compiled code: recvmmsg/sendmmsg, UDP GSO and GRO.

Python's socket module moves one datagram per system call and per trip through the interpreter, which
is what capped ZeroSum at loopback's 64 KiB datagrams and made MTU-sized ones unusable. Here the calls
are libc's, made from numba kernels (`nogil`), so a driver loop can receive, process and answer a batch
of datagrams without entering Python, as QUIC stacks do (quinn-udp, quiche, msquic):

- `receive(fd, rx, timeout_ms)`: poll(2) up to the timeout, then one recvmmsg(2) of up to RX_BATCH
  datagrams with their source addresses (`receive2`: from two sockets, a worker's and its multicast
  group's). With UDP GRO on (Linux >= 5.0, `UDP_GRO`), one buffer may hold several datagrams of one
  sender, all rx.seg[i] bytes long but the last: the drivers walk buffer i in steps of rx.seg[i].
  rx.tos[i] is the IPv4 TOS byte buffer i arrived with (`IP_RECVTOS`; GRO merges only datagrams with
  the same TOS), whose ECN bits tell a Congestion Experienced mark (docs/protocol.md, R-E1).
- `queue(tx, ...)` / `send(fd, tx)`: datagrams to send are queued as (memory, length, destination,
  segment size) and go out with sendmmsg(2), up to TX_BATCH at a time. A run of equally long datagrams
  to one destination that lie back to back in memory goes out as one GSO message (`UDP_SEGMENT`, Linux
  >= 4.18): the kernel cuts it into the datagrams, so a small datagram costs no system call of its own.
  A send that fails with EIO or EINVAL (no checksum offload on the device, an old kernel) turns GSO off
  for the socket and sends the same datagrams one by one (as Tailscale does on EIO).

Every datagram on the wire is an ordinary UDP datagram: GSO and GRO change how many cross the system
call boundary at once, never what a receiver without them sees. The structures are Linux's LP64 ABI
(x86-64, aarch64); `open_endpoint` detects at start-up what the kernel offers (`Endpoint.features`).
"""
from __future__ import annotations

import ipaddress
import os
import random
import socket
import struct
import sys
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from .spec import CE, ECN_MASK, ECT0

JIT = dict(cache=True, nogil=True)

# datagrams (or GRO buffers) per recvmmsg: 16 buffers of 64 KiB (1 MiB) are still in the core's L2
# cache when the loop adds or dequantises them after the kernel's copy; 64 (4 MiB) were not, and dense
# 4-worker allreduces took 0.197 s against 0.162 s (medians of 7 alternating bench runs, README)
RX_BATCH = 16
TX_BATCH = 256         # messages per sendmmsg (each may be a GSO run of datagrams)
RX_CAPACITY = 65536    # bytes per receive buffer: a datagram, or a GRO buffer of several
RX_CTRL_WORDS = 12     # 96 bytes of control messages per buffer: UDP_GRO's and IP_TOS's (24 bytes each),
#                        SO_TIMESTAMPNS's (32)
# times a receiver yields its core and looks again before it sleeps, for at most YIELD_FOR seconds: a
# yield to a task that runs its whole slice (milliseconds) must not delay the sleep that a datagram's
# arrival would end at once (receive2: why it yields)
YIELD_SPINS = 8
YIELD_FOR = 0.0005
GSO_MAX_SEGMENTS = 64  # UDP_MAX_SEGMENTS of Linux 4.18..6.x
GSO_MAX_BYTES = 65507  # a GSO message is one UDP payload before it is cut

SOL_IP, IP_TOS, IP_RECVTOS = 0, 1, 13    # Linux's (the control messages the kernels parse)
SOL_UDP = 17
SOL_SOCKET, SO_TIMESTAMPNS = 1, 35   # (SCM_TIMESTAMPNS is SO_TIMESTAMPNS)
UDP_SEGMENT = 103
UDP_GRO = 104
IP_MTU = 14
MSG_DONTWAIT = 0x40
POLLIN, POLLOUT = 0x1, 0x4
EAGAIN, EINTR, EIO, EINVAL, EMSGSIZE, EADDRINUSE = 11, 4, 5, 22, 90, 98
AF_INET = 2

# libc, resolved by name when a kernel is linked (so the kernels stay in numba's on-disk cache).
# Pointers are passed as integers (uintp): the same registers in the LP64 calling conventions.
_recvmmsg = types.ExternalFunction("recvmmsg", types.intc(types.intc, types.uintp, types.uintc, types.intc,
                                                           types.uintp))
_sendmmsg = types.ExternalFunction("sendmmsg", types.intc(types.intc, types.uintp, types.uintc, types.intc))
_poll = types.ExternalFunction("poll", types.intc(types.uintp, types.uint64, types.intc))
_sched_yield = types.ExternalFunction("sched_yield", types.intc())
_errno_location = types.ExternalFunction("__errno_location", types.uintp())
_clock_gettime = types.ExternalFunction("clock_gettime", types.intc(types.intc, types.uintp))
CLOCK_REALTIME, CLOCK_MONOTONIC = 0, 1


@intrinsic
def _load_i32(typingctx, address):
    """The int32 at a machine address (errno)."""
    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], ir.IntType(32).as_pointer()))
    return types.int32(types.uintp), codegen


@intrinsic
def _pointer(typingctx, address, dtype):
    """A typed pointer to the machine address (for carray)."""
    item = dtype.dtype

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(item)))
    return types.CPointer(item)(types.uintp, dtype), codegen


@njit(**JIT)
def raw(a):
    """The same memory as an array without a reference count (numba.carray over its address).

    numba updates an array's reference count, atomically, whenever a function takes it, a record holding
    it is passed on, or a view of it is made, and its pruning of those updates gives up on branchy code:
    per datagram that was most of the aggregator's time. The driver loops work on raw copies of their
    records, made once per call, while the caller holds the real arrays alive."""
    return carray(_pointer(a.ctypes.data, a.dtype), a.shape)


@intrinsic
def _prefetch_line(typingctx, address):
    """A hint to bring the cache line at a machine address in (llvm.prefetch: read, keep in all levels)."""
    def codegen(context, builder, signature, args):
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]))
        builder.call(fn, [builder.inttoptr(args[0], byte_pointer), ir.Constant(i32, 0), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(types.uintp), codegen


@njit(inline="always", **JIT)
def prefetch(a, start, count):
    """Ask for a[start:start + count] in the cache while other work goes on. The blocks of a sparse
    allreduce lie scattered over the tensor, each a cache miss that the hardware prefetcher does not see
    coming; asked for one block ahead, quantising 4,096 scattered blocks of 256 values out of 100 MB took
    0.44-0.47 ms instead of 0.62-0.66, storing their sums likewise. Blocks that follow each other need it
    too where a loop does other work between them (encoding an entry, adding to a slot): the prefetcher
    fell behind kernels.encode_data and aggregator_kernels.contribute on dense data."""
    if start >= 0 and start + count <= a.size:
        # every line the span touches, from the line holding its first byte (a span that does not
        # start on a line, such as a 24-byte record, may end on one more line than its length fills)
        first = a.ctypes.data + start * a.itemsize
        for line in range(first & ~63, first + count * a.itemsize, 64):
            _prefetch_line(line)


@njit(**JIT)
def errno():
    return np.int64(_load_i32(_errno_location()))


@njit(**JIT)
def monotonic(clock):
    """time.monotonic() (CLOCK_MONOTONIC) from compiled code; `clock` is a 2-element int64 scratch array."""
    _clock_gettime(CLOCK_MONOTONIC, clock.ctypes.data)
    return np.float64(clock[0]) + np.float64(clock[1]) * 1e-9


class RxBatch(NamedTuple):
    """Receive buffers and the kernel structures that point at them (set up once; see rx_batch)."""
    buf: np.ndarray       # uint8 [RX_BATCH, RX_CAPACITY]
    hdrs: np.ndarray      # uint64 [RX_BATCH, 8]: struct mmsghdr
    names: np.ndarray     # uint8 [RX_BATCH, 16]: struct sockaddr_in
    ctrl: np.ndarray      # uint64 [RX_BATCH, RX_CTRL_WORDS]: control messages (GRO segment size, TOS)
    length: np.ndarray    # int64 [RX_BATCH]: bytes received
    source: np.ndarray    # int64 [RX_BATCH]: the sender, ip << 16 | port
    seg: np.ndarray       # int64 [RX_BATCH]: GRO segment size, or the length when not coalesced
    tos: np.ndarray       # int64 [RX_BATCH]: the IPv4 TOS byte (0 where the kernel did not say)
    arrived: np.ndarray   # float64 [RX_BATCH]: when the kernel received it, on monotonic()'s clock (the
    #                       receive call's time where the kernel did not say: SO_TIMESTAMPNS)
    pollfd: np.ndarray    # int32 [4]: two struct pollfd
    clock: np.ndarray     # int64 [2]: struct timespec


class TxQueue(NamedTuple):
    """Datagrams queued for sendmmsg (see tx_queue). state = [queued, gso on, send errors, messages
    sent, datagrams sent, gso fallbacks]."""
    hdrs: np.ndarray      # uint64 [TX_BATCH, 8]
    iov: np.ndarray       # uint64 [TX_BATCH, 2]
    names: np.ndarray     # uint8 [TX_BATCH, 16]
    ctrl: np.ndarray      # uint64 [TX_BATCH, 3]: one UDP_SEGMENT control message each
    seg: np.ndarray       # int64 [TX_BATCH]: segment size of a GSO message, 0 for a plain datagram
    state: np.ndarray     # int64 [6]
    pollfd: np.ndarray    # int32 [2]


QUEUED, GSO_ON, SEND_ERRORS, MESSAGES, DATAGRAMS, GSO_FALLBACKS = range(6)


@njit(**JIT)
def raw_rx(rx):
    return RxBatch(raw(rx.buf), raw(rx.hdrs), raw(rx.names), raw(rx.ctrl), raw(rx.length), raw(rx.source),
                   raw(rx.seg), raw(rx.tos), raw(rx.arrived), raw(rx.pollfd), raw(rx.clock))


@njit(**JIT)
def raw_tx(tx):
    return TxQueue(raw(tx.hdrs), raw(tx.iov), raw(tx.names), raw(tx.ctrl), raw(tx.seg), raw(tx.state),
                   raw(tx.pollfd))


def rx_batch() -> RxBatch:
    rx = RxBatch(np.zeros((RX_BATCH, RX_CAPACITY), np.uint8), np.zeros((RX_BATCH, 8), np.uint64),
                 np.zeros((RX_BATCH, 16), np.uint8), np.zeros((RX_BATCH, RX_CTRL_WORDS), np.uint64),
                 np.zeros(RX_BATCH, np.int64), np.zeros(RX_BATCH, np.int64), np.zeros(RX_BATCH, np.int64),
                 np.zeros(RX_BATCH, np.int64), np.zeros(RX_BATCH, np.float64), np.zeros(4, np.int32),
                 np.zeros(2, np.int64))
    iov = np.zeros((RX_BATCH, 2), np.uint64)
    for i in range(RX_BATCH):
        iov[i] = (rx.buf[i].ctypes.data, RX_CAPACITY)
        # struct msghdr: name, namelen, iov, iovlen, control, controllen, flags; then msg_len
        rx.hdrs[i, 0] = rx.names[i].ctypes.data
        rx.hdrs[i, 2] = iov[i].ctypes.data
        rx.hdrs[i, 3] = 1
        rx.hdrs[i, 4] = rx.ctrl[i].ctypes.data
    _keep[id(rx)] = iov      # the iovecs must live as long as the batch
    return rx


def tx_queue(gso: bool) -> TxQueue:
    tx = TxQueue(np.zeros((TX_BATCH, 8), np.uint64), np.zeros((TX_BATCH, 2), np.uint64),
                 np.zeros((TX_BATCH, 16), np.uint8), np.zeros((TX_BATCH, 3), np.uint64),
                 np.zeros(TX_BATCH, np.int64), np.zeros(6, np.int64), np.zeros(2, np.int32))
    tx.state[GSO_ON] = int(gso)
    for i in range(TX_BATCH):
        tx.hdrs[i, 0] = tx.names[i].ctypes.data
        tx.hdrs[i, 1] = 16
        tx.hdrs[i, 2] = tx.iov[i].ctypes.data
        tx.hdrs[i, 3] = 1
        # struct cmsghdr {len = CMSG_LEN(2), level SOL_UDP, type UDP_SEGMENT}, then the u16 segment size
        tx.ctrl[i, 0] = 16 + 2
        tx.ctrl[i, 1] = SOL_UDP | (UDP_SEGMENT << 32)
        tx.names[i, :2] = np.frombuffer(struct.pack("=H", AF_INET), np.uint8)
    return tx


_keep: dict = {}


@njit(**JIT)
def _wait(pollfd, fd, events, timeout_ms):
    """poll(2) one descriptor; True when it is ready."""
    pollfd[0] = fd
    pollfd[1] = events
    return _poll(pollfd.ctypes.data, 1, timeout_ms) > 0


@njit(**JIT)
def receive(fd, rx, timeout_ms):
    """Up to RX_BATCH datagrams (or GRO buffers) into rx; waits up to timeout_ms (0: not at all, -1:
    forever) for the first. Returns how many (0 on timeout or error: ICMP errors are reported once and
    cleared by the call, so the next call goes on)."""
    return receive2(fd, -1, rx, timeout_ms)


@njit(**JIT)
def receive2(fd, fd2, rx, timeout_ms):
    """receive() from two sockets (fd2 -1: none), e.g. a worker's own and the multicast group's.

    Before it sleeps in poll(2) it gives the core away up to YIELD_SPINS times (sched_yield(2)) and looks
    again after each. Where the aggregator and the workers share the cores, a datagram that finds its
    receiver asleep wakes it, and a woken receiver may preempt the sender in the middle of its burst:
    on loopback (where the kernel delivers in the sender's call) a worker then took an aggregator's burst
    of results a datagram at a time, each answer waking the aggregator in turn, and the aggregator spent
    a quarter of its CPU time in wakeups and task switches. A receiver that yields stays runnable: the
    sender finishes its burst, and the receiver reads it in one batch. Where nothing else waits for the
    core, a yield returns at once: the spins cost a few microseconds before each sleep; where a task
    that computes waits for it, the spins end after YIELD_FOR."""
    if timeout_ms != 0:
        since = monotonic(rx.clock)
        for _ in range(YIELD_SPINS):
            _sched_yield()
            got = _receive_ready(fd, fd2, rx)
            if got > 0:
                return _arrivals(rx, got)
            if monotonic(rx.clock) - since > YIELD_FOR:
                break
        rx.pollfd[0] = fd
        rx.pollfd[1] = POLLIN
        rx.pollfd[2] = fd2
        rx.pollfd[3] = POLLIN
        if _poll(rx.pollfd.ctypes.data, 1 if fd2 < 0 else 2, timeout_ms) <= 0:
            return 0
    return _arrivals(rx, _receive_ready(fd, fd2, rx))


@njit(inline="always", **JIT)
def _receive_ready(fd, fd2, rx):
    """One recvmmsg(2) per socket of what is queued, without waiting: how many buffers. The second
    socket (a worker's multicast group) is read first: every rank must apply an aggregator's results in
    the order it sent them (R-A8), and a RESULT that comes to a worker's own socket answers its probe or
    retransmission of a round whose RESULT went to the group before it (the aggregator never answers a
    round whose RESULT still waits for its flush). Read first, that answer put its round ahead of
    results still queued in the group's socket after a stall: that rank then sent the next rounds in
    another order than the rest, and rounds the others had sent long before completed after later
    ones, which R-C4 took for losses (1,305 entries resent in one loss-free dense run, every one held)."""
    n = rx.hdrs.shape[0]
    for i in range(n):
        rx.hdrs[i, 1] = 16              # msg_namelen
        rx.hdrs[i, 5] = RX_CTRL_WORDS * 8   # msg_controllen
        rx.ctrl[i, 0] = 0
    first, second = (fd2, fd) if fd2 >= 0 else (fd, -1)
    got = max(0, _recvmmsg(first, rx.hdrs.ctypes.data, n, MSG_DONTWAIT, 0))
    if second >= 0 and got < n:
        got += max(0, _recvmmsg(second, rx.hdrs.ctypes.data + got * 64, n - got, MSG_DONTWAIT, 0))
    return got


@njit(inline="always", **JIT)
def _arrivals(rx, got):
    """Length, source, GRO segment size, TOS and arrival time of the `got` buffers received."""
    # the kernel stamps arrivals on the wall clock (SO_TIMESTAMPNS); this call's two clocks convert them
    now = to_monotonic = 0.0
    if got > 0:
        now = monotonic(rx.clock)
        _clock_gettime(CLOCK_REALTIME, rx.clock.ctypes.data)
        to_monotonic = now - (np.float64(rx.clock[0]) + np.float64(rx.clock[1]) * 1e-9)
    for i in range(got):
        # (rows indexed in place throughout: a row view costs atomic reference count updates)
        length = np.int64(rx.hdrs[i, 7] & np.uint64(0xFFFFFFFF))    # msg_len
        rx.length[i] = length
        nm = rx.names
        port = (np.int64(nm[i, 2]) << 8) | np.int64(nm[i, 3])
        ip = ((np.int64(nm[i, 4]) << 24) | (np.int64(nm[i, 5]) << 16) | (np.int64(nm[i, 6]) << 8)
              | np.int64(nm[i, 7]))
        rx.source[i] = (ip << 16) | port
        seg, tos, stamp = _control_messages(rx.ctrl, i, np.int64(rx.hdrs[i, 5]), length)
        rx.seg[i] = seg if seg > 0 else 1
        rx.tos[i] = tos
        # (never after this call: the wall clock may have been stepped since)
        rx.arrived[i] = min(now, stamp + to_monotonic) if stamp > 0.0 else now
    return got


@njit(inline="always", **JIT)
def _control_messages(c, i, size, length):
    """(GRO segment size, or `length`; TOS byte, or 0; arrival on the wall clock in seconds, or 0) from the
    `size` bytes of control messages of buffer i: struct cmsghdr {size_t len; int level; int type;} and
    its data, each 8-byte aligned."""
    seg = length
    tos = np.int64(0)
    stamp = 0.0
    at = 0
    while at + 16 <= size and at // 8 + 2 < c.shape[1]:
        w = at // 8
        clen = np.int64(c[i, w])
        level = c[i, w + 1] & np.uint64(0xFFFFFFFF)
        kind = c[i, w + 1] >> np.uint64(32)
        if clen < 16:
            break
        if level == SOL_UDP and kind == UDP_GRO:
            s = np.int64(c[i, w + 2] & np.uint64(0xFFFFFFFF))
            if 0 < s < length:
                seg = s
        elif level == SOL_IP and kind == IP_TOS:
            tos = np.int64(c[i, w + 2] & np.uint64(0xFF))
        elif level == SOL_SOCKET and kind == SO_TIMESTAMPNS and w + 3 < c.shape[1]:
            stamp = np.float64(np.int64(c[i, w + 2])) + np.float64(np.int64(c[i, w + 3])) * 1e-9
        at += (clen + 7) & ~7
    return seg, tos, stamp


@njit(inline="always", **JIT)
def queue(fd, tx, address, length, destination, seg):
    """Queue `length` bytes at machine address `address` to `destination` (ip << 16 | port); `seg` > 0
    asks for GSO: the bytes are datagrams of `seg` bytes each (the last may be shorter). Sends the
    queue first when it is full. The memory must stay as it is until the queue is sent."""
    k = tx.state[QUEUED]
    if k == tx.hdrs.shape[0]:
        send(fd, tx)
        k = 0
    tx.iov[k, 0] = address
    tx.iov[k, 1] = length
    nm = tx.names
    port = destination & 0xFFFF
    ip = destination >> 16
    nm[k, 2] = (port >> 8) & 0xFF
    nm[k, 3] = port & 0xFF
    nm[k, 4] = (ip >> 24) & 0xFF
    nm[k, 5] = (ip >> 16) & 0xFF
    nm[k, 6] = (ip >> 8) & 0xFF
    nm[k, 7] = ip & 0xFF
    if seg > 0 and seg < length:
        tx.ctrl[k, 2] = seg
        tx.hdrs[k, 4] = tx.ctrl.ctypes.data + k * 24
        tx.hdrs[k, 5] = 24                  # CMSG_SPACE(sizeof(uint16_t))
        tx.seg[k] = seg
    else:
        tx.hdrs[k, 4] = 0
        tx.hdrs[k, 5] = 0
        tx.seg[k] = 0
    tx.state[QUEUED] = k + 1


@njit(**JIT)
def queue_datagrams(fd, tx, base, starts, ends, n, destination, loss):
    """Queue datagrams [starts[i], ends[i]) of the buffer at machine address `base` to one destination,
    in order; with GSO on, runs of equally long datagrams that lie back to back go as one message.
    With a simulated `loss` rate, each datagram is dropped with that probability, and sent alone."""
    if loss > 0.0:
        for k in range(n):
            if np.random.random() >= loss:
                queue(fd, tx, base + starts[k], ends[k] - starts[k], destination, 0)
        return
    i = 0
    gso = tx.state[GSO_ON] != 0
    while i < n:
        size = ends[i] - starts[i]
        j = i + 1
        if gso:
            total = size
            while (j < n and j - i < GSO_MAX_SEGMENTS and starts[j] == ends[j - 1]
                   and ends[j] - starts[j] <= size and total + ends[j] - starts[j] <= GSO_MAX_BYTES):
                total += ends[j] - starts[j]
                j += 1
                if ends[j - 1] - starts[j - 1] < size:   # a shorter datagram can only end a run
                    break
        queue(fd, tx, base + starts[i], ends[j - 1] - starts[i], destination, size if j - i > 1 else 0)
        i = j


@njit(**JIT)
def send(fd, tx):
    """Send everything queued (sendmmsg); returns the number of datagrams that failed. A full socket
    buffer is waited for (poll, at most 1 s at a time); other errors drop the message (counted), as a
    loss would; EIO/EINVAL on a GSO message turns GSO off and sends its datagrams one by one."""
    k = tx.state[QUEUED]
    done = 0
    failed = 0
    while done < k:
        r = _sendmmsg(fd, tx.hdrs.ctypes.data + done * 64, k - done, 0)
        if r > 0:
            for i in range(done, done + r):
                tx.state[MESSAGES] += 1
                s = tx.seg[i]
                tx.state[DATAGRAMS] += (np.int64(tx.iov[i, 1]) + s - 1) // s if s > 0 else 1
            done += r
            continue
        e = errno()
        if _retry(e, tx, fd):
            continue
        if tx.seg[done] > 0 and (e == EIO or e == EINVAL):
            tx.state[GSO_ON] = 0
            tx.state[GSO_FALLBACKS] += 1
            failed += _send_unsegmented(fd, tx, done)
        else:
            failed += 1
            tx.state[SEND_ERRORS] += 1
        done += 1
    tx.state[QUEUED] = 0
    return failed


@njit(**JIT)
def _retry(e, tx, fd):
    """Whether a failed send is to be tried again: interrupted, or the socket buffer was full (then
    wait until it has room, at most 1 s)."""
    if e == EAGAIN:
        _wait(tx.pollfd, fd, POLLOUT, 1000)
    return e == EINTR or e == EAGAIN


@njit(**JIT)
def _send_unsegmented(fd, tx, k):
    """The datagrams of GSO message k, one sendmmsg message each (in slots after the queue's end would
    not fit: reuse message k's own slot, one datagram at a time)."""
    base = np.int64(tx.iov[k, 0])
    total = np.int64(tx.iov[k, 1])
    seg = tx.seg[k]
    tx.hdrs[k, 4] = 0
    tx.hdrs[k, 5] = 0
    failed = 0
    off = 0
    while off < total:
        size = min(seg, total - off)
        tx.iov[k, 0] = base + off
        tx.iov[k, 1] = size
        while True:
            r = _sendmmsg(fd, tx.hdrs.ctypes.data + k * 64, 1, 0)
            if r == 1:
                tx.state[MESSAGES] += 1
                tx.state[DATAGRAMS] += 1
                break
            if _retry(errno(), tx, fd):
                continue
            failed += 1
            tx.state[SEND_ERRORS] += 1
            break
        off += size
    return failed


@njit(**JIT)
def seed_loss(value):
    """Seed the compiled code's random numbers (the simulated loss of workers and aggregators)."""
    np.random.seed(value)


# -- sockets ------------------------------------------------------------------------------------------

def address_key(address: tuple[str, int]) -> int:
    """(ip, port) as the int the kernels use: ip << 16 | port."""
    return (int.from_bytes(socket.inet_aton(address[0]), "big") << 16) | address[1]


def address_of(key: int) -> tuple[str, int]:
    return socket.inet_ntoa((key >> 16).to_bytes(4, "big")), key & 0xFFFF


class Features(NamedTuple):
    batched: bool     # recvmmsg/sendmmsg through libc (Linux, LP64)
    gso: bool         # UDP_SEGMENT
    gro: bool         # UDP_GRO
    stamps: bool = False   # SO_TIMESTAMPNS: the kernel's arrival time of each datagram

    def describe(self) -> str:
        if not self.batched:
            return "one datagram per system call (no recvmmsg/sendmmsg here)"
        return ("recvmmsg/sendmmsg" + (", UDP GSO" if self.gso else ", no UDP GSO")
                + (", UDP GRO" if self.gro else ", no UDP GRO")
                + (", arrival stamps" if self.stamps else ", no arrival stamps"))


IO_MODES = ("gso", "batched", "plain")


def io_mode() -> str:
    """ZEROSUM_IO: "gso" (the default: batched system calls with UDP GSO/GRO where the kernel has them),
    "batched" (recvmmsg/sendmmsg without GSO/GRO) or "plain" (one datagram per system call, through
    Python's socket module), to compare them or to work around a kernel or device that misbehaves."""
    mode = os.environ.get("ZEROSUM_IO", "gso").strip().lower() or "gso"
    if mode not in IO_MODES:
        raise ValueError(f"ZEROSUM_IO must be one of {', '.join(IO_MODES)}, got {mode!r}")
    return mode


def enable_ecn(sock: socket.socket) -> None:
    """Send ECN-capable datagrams, ECT(0) with the DSCP bits zero, and be told the TOS byte of those that
    arrive (IP_RECVTOS: a control message with each), so that a Congestion Experienced mark a queue set
    on the way is seen (RFC 3168; docs/protocol.md, R-E1, R-C6)."""
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, ECT0)
    if hasattr(socket, "IP_RECVTOS"):     # elsewhere no mark is seen, and none is acted on
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)


# Control-message room for recvmsg through Python's socket module (the path without batched I/O).
ECN_ANCILLARY = socket.CMSG_SPACE(4)


def tos_of(ancdata) -> int:
    """The TOS byte recvmsg's control messages (Python's socket module has parsed them) report, or 0."""
    return next((data[0] for level, kind, data in ancdata if level == SOL_IP and kind == IP_TOS and data), 0)


def congestion_experienced(ancdata) -> bool:
    """Whether the datagram of recvmsg's control messages arrived with the CE mark."""
    return (tos_of(ancdata) & ECN_MASK) == CE


def _try_option(sock: socket.socket, level: int, option: int, value: int) -> bool:
    """Set a socket option; False where this kernel does not have it."""
    try:
        sock.setsockopt(level, option, value)
        return True
    except OSError:
        return False


def detect(sock: socket.socket, gso: bool = True, gro: bool = True, stamps: bool = True) -> Features:
    """What this kernel offers on `sock` (within ZEROSUM_IO), turning GRO on where it exists (`gso`/`gro`
    False: do not use), ECN on (enable_ecn), and the kernel's arrival stamps on (SO_TIMESTAMPNS, read
    with the batched receive: rx.arrived; `stamps` False: not asked for)."""
    enable_ecn(sock)
    mode = io_mode()
    gso, gro = gso and mode == "gso", gro and mode == "gso"
    batched = sys.platform.startswith("linux") and struct.calcsize("P") == 8 and mode != "plain"
    # (UDP_SEGMENT 0: no default segment size; setting it probes the support)
    have_gso = batched and gso and _try_option(sock, SOL_UDP, UDP_SEGMENT, 0)
    have_gro = batched and gro and _try_option(sock, SOL_UDP, UDP_GRO, 1)
    have_stamps = batched and stamps and _try_option(sock, SOL_SOCKET, SO_TIMESTAMPNS, 1)
    return Features(batched, have_gso, have_gro, have_stamps)


def multicast_receiver(group: tuple[str, int], interface: str, rcvbuf: int) -> socket.socket:
    """A socket that receives what is sent to the multicast `group` (address, port) through the interface
    with address `interface` (its GRO turned on where the kernel has it)."""
    import struct as _struct
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.bind(group)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                     _struct.pack("4s4s", socket.inet_aton(group[0]), socket.inet_aton(interface)))
        detect(s)
    except OSError as e:
        s.close()
        raise OSError(e.errno, f"cannot receive multicast group {group[0]}:{group[1]} on {interface}: "
                               f"{e.strerror}") from None
    return s


def multicast_sender(sock: socket.socket, interface: str) -> None:
    """Send `sock`'s multicast through the interface with that address (0.0.0.0: the route's); on
    loopback with TTL 0, so that nothing leaves the host (Linux drops TTL-0 multicast after its local
    copy), elsewhere TTL 1 (the link)."""
    if interface != "0.0.0.0":
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(interface))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 0 if interface.startswith("127.") else 1)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)


def multicast_problem(group: str, interface: str, wait: float = 0.5) -> tuple[int, str | None]:
    """Try sending results to the multicast `group` through the interface with address `interface`: one
    datagram to a receiver joined there, as the aggregator and its workers would. Returns (port, None)
    when it arrived (port: a port of the group free on this host just now), or (0, why not): a host
    without a route or membership for the group, a container without multicast on its loopback."""
    import select
    try:
        receiver = multicast_receiver((group, unused_group_port(group)), interface, 1 << 16)
    except OSError as e:
        return 0, str(e)
    try:
        port = receiver.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            multicast_sender(sender, interface)
            sender.sendto(b"zerosum multicast probe", (group, port))
        if not select.select([receiver], [], [], wait)[0] or receiver.recv(64) != b"zerosum multicast probe":
            return 0, f"a datagram sent to {group}:{port} through {interface} did not arrive within {wait} s"
        return port, None
    except OSError as e:
        return 0, f"cannot send to {group} through {interface}: {e.strerror or e}"
    finally:
        receiver.close()


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel gives ports from to sockets that send or connect unbound (Linux's
    ip_local_port_range; its default where that cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def unused_group_port(group: str, tries: int = 64) -> int:
    """A port that no socket of this host has bound for the multicast `group`, below the ephemeral range
    (0 where none is found: then the kernel picks one). A port taken by binding port 0 is ephemeral: in
    the time between this choice and the workers joining the group, any socket that sends or connects
    unbound can be given it, without SO_REUSEADDR, and the workers' bind then fails with EADDRINUSE (seen
    once in torch's conformance suite, which starts many groups in a row). Each candidate is bound once
    without SO_REUSEADDR: that fails while any socket holds the port, a group receiver of another job too."""
    low, _ = ephemeral_ports()
    band = range(max(1024, low - 12768), low)
    for port in random.sample(band, min(tries, len(band))):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind((group, port))
                return port
            except OSError as e:
                if e.errno != EADDRINUSE:
                    raise
    return 0


def is_multicast(address: str) -> bool:
    return 224 <= int(address.split(".")[0]) <= 239


def path_mtu(address: tuple[str, int]) -> int | None:
    """The MTU of the route to `address` (IP_MTU on a connected UDP socket), None where unknown."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(address)
            return s.getsockopt(socket.IPPROTO_IP, IP_MTU)
    except OSError:
        return None


def local_ip(address: tuple[str, int]) -> str:
    """This host's address on the route to `address`: where a socket bound to 0.0.0.0 sends from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(address)
        return s.getsockname()[0]


def on_this_host(addresses) -> bool:
    """Whether every address is this host's own (loopback, or an address of one of its interfaces): the
    datagrams then cross no link."""
    try:
        return all(ipaddress.ip_address(a[0]).is_loopback or local_ip(a) == a[0] for a in addresses)
    except (OSError, ValueError):
        return False


def datagram_limit(addresses, cap: int) -> int:
    """The largest UDP payload that reaches every address without IP fragments: path MTU - 28 (IPv4 and
    UDP headers), at most `cap` (65,507 on loopback, whose MTU is 65,536)."""
    limit = cap
    for a in addresses:
        mtu = path_mtu(a)
        if mtu:
            limit = min(limit, mtu - 28)
    return limit
