"""The software aggregator: the aggregation service (one state machine per job) behind a UDP socket."""
from __future__ import annotations

import ipaddress
import logging
import math
import socket
import time

import numpy as np

from . import aggregator_kernels as AK
from . import protocol as P
from . import transport as T
from .aggregator_service import MAX_JOB_SLOTS, AggregatorService
from .spec import CE, ECN_MASK
from .warmup import warm_up
from .udp import LossHook, open_socket, parse_address

log = logging.getLogger("zerosum.aggregator")


def request_stats(address: str, timeout: float = 5.0) -> dict:
    """Ask a running aggregator at HOST:PORT for its counters (a STATS request, docs/protocol.md);
    returns its JSON answer as a dict, or raises OSError when none comes within `timeout` seconds."""
    import json
    target = parse_address(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(P.encode(P.Header(P.STATS, 0, 0, 0)), target)
        end = time.monotonic() + timeout
        while True:
            try:
                data, source = s.recvfrom(P.MAX_DATAGRAM + 1)
            except (socket.timeout, ConnectionRefusedError):
                raise OSError(f"no answer from an aggregator at {address} within {timeout} s") from None
            d = P.decode(data) if source == target else None
            if d is not None and d.header.type == P.STATS:
                return json.loads(d.body)
            s.settimeout(max(0.01, end - time.monotonic()))


class AggregatorServer:
    """Serves any number of concurrent jobs from a pool of `slots` (see AggregatorService). `workers`
    with `job` declares that job's world size up front (its JOINs must match), `declared` several
    ({job: workers}); None declares nothing."""

    def __init__(self, workers: int | None = None, listen: str = f"0.0.0.0:{P.DEFAULT_PORT}", job: int = 1,
                 slots: int = 8192, loss: float = 0.0, seed: int | None = None, *, max_jobs: int = 16,
                 min_job_slots: int = 64, max_job_slots: int | None = None, job_idle: float = 0.0,
                 join_timeout: float = 30.0,
                 key: bytes | None = None, declared: dict[int, int] | None = None,
                 max_datagram: int = P.MAX_DATAGRAM, multicast: str | None = None, insecure: bool = False):
        """max_datagram: the largest RESULT/STATUS datagram sent (UDP payload bytes); on links whose MTU
        is smaller than 64 KiB, MTU - 28 keeps results from being IP-fragmented (docs/protocol.md, "Fusion").
        multicast: "GROUP:PORT": results go to that IP multicast group once, instead of to each worker
        (the workers join it: Worker(multicast=...)); needs batched I/O (Linux)."""
        group = None
        if multicast:
            group = parse_address(multicast)
            if not T.is_multicast(group[0]):
                raise ValueError(f"--multicast {multicast}: {group[0]} is not an IPv4 multicast address "
                                 "(224.0.0.0 to 239.255.255.255)")
        if not P.PACKET_HEADER_SIZE + P.ENTRY_SIZE <= max_datagram <= P.MAX_DATAGRAM:
            raise ValueError(f"max_datagram must be {P.PACKET_HEADER_SIZE + P.ENTRY_SIZE}..{P.MAX_DATAGRAM} "
                             f"bytes, got {max_datagram}")
        self.address = parse_address(listen)
        if key is None and not ipaddress.ip_address(self.address[0]).is_loopback:
            # Protected mode (as Redis's): without a key, anyone who can send one datagram could join a
            # job as a rank, restart it, or squat its id.
            if not insecure:
                raise ValueError(f"listening on {self.address[0]} (not loopback) without a key: give the "
                                 "workers' secret with --key-file FILE, or run open with --insecure")
            log.warning("running open on %s (--insecure): anyone who can reach it can join or disturb a job",
                        self.address[0])
        warm_up()     # compile the kernels before any worker can be waiting for this aggregator
        max_job_slots = min(slots, max_job_slots or MAX_JOB_SLOTS)
        # Every worker of a job may have a datagram in flight for every slot of the job: size the buffer
        # for the largest job (its declared size, or 4 workers) and fewer slots if the kernel gives less.
        per_slot = P.ENTRY_SIZE + 256 * P.WIRE_VALUE.itemsize
        world = max([workers or 4, *(declared or {}).values()])
        want = max(8 << 20, 2 * world * max_job_slots * per_slot)
        self.sock, got = open_socket(self.address, rcvbuf=want)
        granted = max(1, min(max_job_slots, got // (world * per_slot)))
        if granted < max_job_slots:
            log.warning("receive buffer is %d bytes (raise net.core.rmem_max or run as root): "
                        "granting at most %d slots per job instead of %d", got, granted, max_job_slots)
        self.service = AggregatorService(max(slots, granted), max_jobs=max_jobs,
                                         min_job_slots=min(min_job_slots, granted), max_job_slots=granted,
                                         job_idle=job_idle, join_timeout=join_timeout,
                                         declared=declared or ({job: workers} if workers else None),
                                         key=key, max_datagram=max_datagram, multicast=group)
        self.machine = self.service     # what the benchmark and older callers read counters from
        self.loss = LossHook(loss, seed)
        if seed is not None:
            T.seed_loss(seed)
        self.address = self.sock.getsockname()
        self.features = T.detect(self.sock, stamps=False)   # (the workers' round trips use them, R-C3)
        if group is not None:
            if not self.features.batched:
                raise ValueError("--multicast needs batched I/O (Linux, ZEROSUM_IO other than plain)")
            T.multicast_sender(self.sock, self.address[0])
        self._rx = T.rx_batch()
        # the simulated loss drops single datagrams: not with GSO, which sends runs of them at once
        self._tx = T.tx_queue(self.features.gso and not loss)
        self._tables_key, self._tables = None, None
        self.max_datagram = max_datagram
        self._backlog = 0
        self._sent = 0

    def serve(self, stop=None, stats_interval: float = 0.0, idle_exit: float = 0.0) -> None:
        """Serve until `stop()` is true (checked at least every 0.2 s), or, with idle_exit, until
        workers have been silent for that many seconds after data arrived; otherwise forever.

        Datagrams arrive in batches (recvmmsg); the members' DATA of a batch is aggregated, and its
        replies and completed rounds sent (sendmmsg, GSO), by compiled code (aggregator_kernels.serve)
        without entering Python; Python takes the rest (JOIN, LEAVE, STATS, anything dropped) one by one,
        in arrival order, through the service's machines."""
        next_stats = time.monotonic() + stats_interval if stats_interval else float("inf")
        last_data = None
        buf = bytearray(P.MAX_DATAGRAM + 1)
        while stop is None or not stop():
            now = time.monotonic()
            if idle_exit and last_data is not None and now - last_data > idle_exit:
                log.info("no datagrams for %.1f s: exiting", idle_exit)
                return
            if self.features.batched:
                # compiled, batch after batch, until Python has work: a datagram for the machines, a
                # timer of the service, the stop check (every 0.2 s), the counters line, the idle exit
                deadline = min(now + 0.2, self.service.timer(), next_stats,
                               last_data + idle_exit if idle_exit and last_data is not None else float("inf"))
                n, i, off = self._serve_compiled(deadline)
                now = time.monotonic()
                if self._take_heard(now) or i < n:
                    last_data = now
                if i < n:
                    self._serve_batch(n, i, off, now)
                self._count_send_errors()
            elif self._receive_plain(buf):
                now = last_data = time.monotonic()
            if now >= self.service.timer():
                self._send(self.service.datagrams_to_send(now))
            if now >= next_stats:
                log.info("counters: %s", self.counters_line())
                next_stats = now + stats_interval

    def _receive_plain(self, buf: bytearray) -> int:
        """Without batched I/O: one datagram through the machines (Python's socket module), then the
        completed rounds once nothing more is queued."""
        self.sock.settimeout(0.0 if self.service.has_output else 0.2)
        try:
            n, ancdata, _, addr = self.sock.recvmsg_into([buf], T.ECN_ANCILLARY)
        except (socket.timeout, BlockingIOError, ConnectionRefusedError):
            self._send(self.service.datagrams_to_send(time.monotonic()))
            return 0
        if not self.loss.drop():
            now = time.monotonic()
            self.service.receive(memoryview(buf)[:n], addr, now, T.congestion_experienced(ancdata))
            self._send(self.service.datagrams_to_send(now, results=False))
        self._backlog += 1
        if self._backlog >= 16:     # a busy socket is never empty: send at least every 16 datagrams
            self._backlog = 0
            self._send(self.service.datagrams_to_send(time.monotonic()))
        return 1

    def _serve_compiled(self, deadline: float) -> tuple[int, int, int]:
        """aggregator_kernels.serve_until over the jobs served (or, with none, one batch received for
        the machines): (n, i, off) of the batch that needs Python from datagram (i, off) on."""
        tables = self._fast_tables()
        if tables is not None:
            return AK.serve_until(self.sock.fileno(), self._rx, *tables, self._tx, self.loss.rate, deadline)
        wait_ms = max(1, min(200, math.ceil((deadline - time.monotonic()) * 1000)))
        return T.receive(self.sock.fileno(), self._rx, wait_ms), 0, 0

    def _serve_batch(self, n: int, i: int, off: int, now: float) -> None:
        """The received batch from datagram (i, off) on: what the compiled loop left (JOIN, LEAVE, STATS,
        anything dropped) through the machines, one by one in arrival order, the members' DATA in between
        through the compiled loop again; then the machines' replies."""
        rx, fd = self._rx, self.sock.fileno()
        while i < n:
            # a datagram for the machines (the compiled loop leaves these to the simulated loss here)
            size = min(int(rx.seg[i]), int(rx.length[i]) - off)
            if not self.loss.drop():
                data = bytes(rx.buf[i, off:off + size])
                self.service.receive(data, T.address_of(int(rx.source[i])), now,
                                     (int(rx.tos[i]) & ECN_MASK) == CE)
            off += int(rx.seg[i])
            if off >= rx.length[i]:         # (an empty datagram too: its seg is 0)
                i, off = i + 1, 0
            tables = self._fast_tables()
            if tables is not None and i < n:
                i, off = AK.serve(fd, rx, n, i, off, *tables, self._tx, self.loss.rate)
        self._take_heard(now)
        self._send(self.service.datagrams_to_send(now))

    def _take_heard(self, now: float) -> bool:
        """Whether the compiled loop took DATA of any job since the last call (each such job was heard
        from now, for its idle expiry)."""
        heard = False
        for job in self.service.jobs.values():
            state = job.machine.table.state
            if state[AK.HEARD]:
                state[AK.HEARD] = 0
                job.last_heard = now
                heard = True
        return heard

    def _count_send_errors(self) -> None:
        errors = int(self._tx.state[T.SEND_ERRORS])
        if errors:
            self._tx.state[T.SEND_ERRORS] = 0
            self.service.count("send_errors", errors)

    def _fast_tables(self):
        """(job ids, SlotTables) of the jobs served, for the compiled loop; rebuilt when a job starts,
        ends or restarts (a JOIN allocates a new table). None while no job is served."""
        jobs = self.service.jobs
        key = tuple((job, id(j.machine.table), len(j.machine.state.members)) for job, j in jobs.items())
        if key != self._tables_key:
            self._tables_key = key
            for j in jobs.values():
                self._fit_path(j.machine)
            if not jobs:
                self._tables = None
            else:
                first, *others = (j.machine.table for j in jobs.values())
                tables = AK.table_list(first)
                for table in others:
                    AK.append_table(tables, table)
                self._tables = (np.array(list(jobs), np.int64), tables)
        return self._tables

    def _fit_path(self, machine) -> None:
        """Results to a job's members no larger than the path MTU to each of them allows (less 28 bytes
        of headers), within --max-datagram: never IP fragments (docs/protocol.md, "Fusion")."""
        addresses = [m.address for m in machine.state.members.values()]
        machine.table.geometry[3] = T.datagram_limit(addresses, self.max_datagram)

    @property
    def datagrams_sent(self) -> int:
        return self._sent + int(self._tx.state[T.DATAGRAMS])

    def _send(self, out) -> None:
        sent = 0
        for dests, data in out:
            for dest in dests:
                if self.loss.drop():
                    continue
                try:
                    self.sock.sendto(data, dest)
                    sent += 1
                except OSError:
                    self.service.count("send_errors")
        self._sent += sent

    def counters_line(self) -> str:
        """The totals, then each job's counters and slots."""
        def line(counters):
            return ", ".join(f"{k}={v}" for k, v in sorted(counters.items())) or "none"
        jobs = "".join(f"; job {job} ({j.slots} slots, {j.machine.state.world} workers): "
                       f"{line(dict(j.machine.counters))}" for job, j in sorted(self.service.jobs.items()))
        return line(self.service.counters) + jobs

    def close(self) -> None:
        self.sock.close()
