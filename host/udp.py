"""UDP plumbing shared by workers and aggregators: addresses, sockets sized for bursts, a loss hook."""
from __future__ import annotations

import random
import socket

from .protocol import DEFAULT_PORT


def parse_address(text: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """'host:port', 'host', ':port' or 'port' -> (IPv4 address, port; no host: 0.0.0.0); ValueError with
    a clear message otherwise."""
    host, sep, port = str(text).rpartition(":")
    if not sep and not port.isdigit():
        host, port = port, str(default_port)
    try:
        port_n = int(port)
        if not 0 <= port_n <= 65535:
            raise ValueError
    except ValueError:
        raise ValueError(f"bad port in address {text!r}: expected HOST:PORT with PORT 0..65535") from None
    try:
        ip = socket.getaddrinfo(host or "0.0.0.0", port_n, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve host {host!r} in address {text!r}: {e.strerror}") from None
    return ip, port_n


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port free on 127.0.0.1 right now (TCP by default, or kind=socket.SOCK_DGRAM), for a server
    started next; another process may take it first, which then fails to bind with a clear error."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_buffer(sock: socket.socket, option: int, force_option: int, size: int) -> int:
    """Ask for `size` bytes; as root go past the sysctl cap (SO_*BUFFORCE). Returns what was granted."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, force_option, size)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, option, size)
    # Linux reports twice the usable size (it books kernel overhead in the same budget).
    return sock.getsockopt(socket.SOL_SOCKET, option) // 2


SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)


def open_socket(bind: tuple[str, int], rcvbuf: int, sndbuf: int = 4 << 20) -> tuple[socket.socket, int]:
    """A bound UDP socket with large buffers (bursts of 64 KiB datagrams must not overflow them)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        got = _set_buffer(sock, socket.SO_RCVBUF, SO_RCVBUFFORCE, rcvbuf)
        _set_buffer(sock, socket.SO_SNDBUF, SO_SNDBUFFORCE, sndbuf)
        sock.bind(bind)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot bind UDP {bind[0]}:{bind[1]}: {e.strerror}") from None
    return sock, got


class LossHook:
    """Drops datagrams with probability `rate` (seeded): simulated packet loss for tests and experiments."""

    def __init__(self, rate: float = 0.0, seed: int | None = None):
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"loss rate must be in [0, 1), got {rate}")
        self.rate = rate
        self.rng = random.Random(seed)
        self.dropped = 0

    def drop(self) -> bool:
        if self.rate and self.rng.random() < self.rate:
            self.dropped += 1
            return True
        return False
