"""The software aggregator: the aggregator state machine behind a UDP socket."""
from __future__ import annotations

import logging
import socket
import time

from . import protocol as P
from .aggregator_machine import AggregatorMachine
from .warmup import warm_up
from .udp import LossHook, open_socket, parse_address

log = logging.getLogger("zerosum.aggregator")
FLUSH_EVERY = 16


class AggregatorServer:
    def __init__(self, workers: int, listen: str = f"0.0.0.0:{P.DEFAULT_PORT}", job: int = 1,
                 slots: int = 2048, loss: float = 0.0, seed: int | None = None):
        self.address = parse_address(listen)
        warm_up()     # compile the kernels before any worker can be waiting for this aggregator
        # Every worker may have a datagram in flight for every slot: size the buffer for all of them.
        per_slot = P.ENTRY_SIZE + 256 * P.WIRE_VALUE.itemsize
        want = max(8 << 20, 2 * workers * slots * per_slot)
        self.sock, got = open_socket(self.address, rcvbuf=want)
        granted = max(1, min(slots, got // (workers * per_slot)))
        if granted < slots:
            log.warning("receive buffer is %d bytes (raise net.core.rmem_max or run as root): "
                        "granting %d slots instead of %d", got, granted, slots)
        self.machine = AggregatorMachine(job, workers, slots=granted)
        self.loss = LossHook(loss, seed)
        self.address = self.sock.getsockname()
        self.datagrams_sent = 0

    def serve(self, stop=None, stats_interval: float = 0.0, idle_exit: float = 0.0) -> None:
        """Serve until `stop()` is true (checked at least every 0.2 s), or, with idle_exit, until
        workers have been silent for that many seconds after data arrived; otherwise forever."""
        buf = bytearray(P.MAX_DATAGRAM + 1)
        view = memoryview(buf)
        sock, machine = self.sock, self.machine
        sock.settimeout(0.2)
        next_stats = time.monotonic() + stats_interval if stats_interval else float("inf")
        backlog = 0
        last_data = None
        while stop is None or not stop():
            if idle_exit and last_data is not None and time.monotonic() - last_data > idle_exit:
                log.info("no datagrams for %.1f s: exiting", idle_exit)
                return
            # Block only when nothing is pending; otherwise drain what is queued, then flush the
            # completed rounds together (at least every FLUSH_EVERY datagrams).
            sock.settimeout(0.0 if machine.completed and backlog < FLUSH_EVERY else 0.2)
            try:
                n, addr = sock.recvfrom_into(buf)
            except (socket.timeout, BlockingIOError):
                n = 0
            except ConnectionRefusedError:
                continue
            if n:
                backlog += 1
                last_data = time.monotonic()
                if not self.loss.drop():
                    self._send(machine.receive(view[:n], addr))
            if not n or backlog >= FLUSH_EVERY:
                backlog = 0
                self._send(machine.flush())
            if time.monotonic() >= next_stats:
                log.info("counters: %s", self.counters_line())
                next_stats = time.monotonic() + stats_interval

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
                    self.machine.count("send_errors")
        self.datagrams_sent += sent

    def counters_line(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(self.machine.counters.items())) or "none"

    def close(self) -> None:
        self.sock.close()
