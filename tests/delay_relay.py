"""A far path on loopback: a UDP relay that holds every datagram a fixed time each way.

The kernels these tests run on may lack the netem queueing discipline, so the delay is added here:
workers send to `address`; each worker's datagrams leave for the aggregator from a socket of the relay's
own for that worker (the aggregator tells workers apart by their source address, as it would behind a
router), and whatever the aggregator sends to that socket goes back to the worker, each datagram
`delay` seconds after it arrived. A thread does the relaying; datagrams keep their order."""
from __future__ import annotations

import heapq
import itertools
import selectors
import socket
import threading
import time

BUFFER = 1 << 22        # a dense round's burst must not overflow the relay's own sockets
LARGEST = 1 << 16


class DelayRelay:
    def __init__(self, upstream: tuple[str, int], delay: float):
        self.upstream, self.delay = upstream, delay
        self.front = self._socket()
        self.address = "%s:%d" % self.front.getsockname()
        self.relayed = 0
        self._worker_of: dict[socket.socket, tuple[str, int]] = {}   # relay's socket -> the worker's address
        self._socket_for: dict[tuple[str, int], socket.socket] = {}
        self._due: list = []                                          # (due, order, socket, data, destination)
        self._order = itertools.count()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.front, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    @staticmethod
    def _socket() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
        return s

    def _relay(self) -> None:
        while not self._stop.is_set():
            wait = min(0.05, max(0.0, self._due[0][0] - time.monotonic())) if self._due else 0.05
            for key, _ in self._selector.select(wait):
                self._take(key.fileobj)
            now = time.monotonic()
            while self._due and self._due[0][0] <= now:
                _, _, sock, data, destination = heapq.heappop(self._due)
                sock.sendto(data, destination)
                self.relayed += 1

    def _take(self, sock: socket.socket) -> None:
        while True:
            try:
                data, source = sock.recvfrom(LARGEST)
            except BlockingIOError:
                return
            if sock is self.front:          # a worker's datagram, for the aggregator
                out = self._socket_for.get(source)
                if out is None:
                    out = self._socket_for[source] = self._socket()
                    self._worker_of[out] = source
                    self._selector.register(out, selectors.EVENT_READ)
                destination = self.upstream
            else:                           # the aggregator's, back to the worker it was for
                out, destination = self.front, self._worker_of[sock]
            heapq.heappush(self._due, (time.monotonic() + self.delay, next(self._order), out, data, destination))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._selector.close()
        for s in (self.front, *self._socket_for.values()):
            s.close()
