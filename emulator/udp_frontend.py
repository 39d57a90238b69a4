"""Mode (a): the emulated switch as a UDP aggregator (`zerosum switch --udp HOST:PORT`).

Every datagram received on the socket becomes the Ethernet/IPv4/UDP frame a switch port would see
(source = the datagram's source address, destination = the switch's service address), goes through the
same pipeline, and every frame the pipeline sends is handed back to the kernel as a datagram to the
frame's IPv4/UDP destination. So a host runtime talks to it exactly as to the P4 switch. The frame carries
the datagram's TOS byte (IP_RECVTOS), so a CE mark on the way in is echoed as the switch echoes it; what
it sends leaves ECT(0), as from a software aggregator (its own ECN marks need a queue it does not have).
"""
from __future__ import annotations

import select
import socket
import struct

from .. import transport as T
from ..protocol import MAX_DATAGRAM
from ..udp import LossHook, open_socket
from .headers import IPv4
from ..switch_p4.layout import PORT
from .pipeline import Switch
from .serving import serve_until

UDP_PORT_INDEX = 1          # the switch port all UDP-mode traffic enters on
_ETH = struct.Struct("!6s6sH")
_UDP = struct.Struct("!HHHH")
HEADERS = 14 + 20 + 8


def ip_int(ip: str) -> int:
    return struct.unpack("!I", socket.inet_aton(ip))[0]


def frame_for(payload, src: tuple[str, int], dst: tuple[str, int], dst_mac: int = 0, tos: int = 0) -> bytes:
    """The frame a host at `src` sends to `dst` for this UDP payload (UDP checksum 0: none, as allowed)."""
    ip = IPv4(4, 5, tos, 20 + 8 + len(payload), 0, 0b010, 0, 64, 17, 0, ip_int(src[0]), ip_int(dst[0]))
    ip.hdrChecksum = ip.checksum()
    return (_ETH.pack(dst_mac.to_bytes(6, "big"), bytes(6), 0x0800) + ip.emit()
            + _UDP.pack(src[1], dst[1], 8 + len(payload), 0) + bytes(payload))


def datagram_of(frame: bytes) -> tuple[tuple[str, int], bytes] | None:
    """(destination address, UDP payload) of an IPv4/UDP frame, None for anything else."""
    if len(frame) < HEADERS or frame[12:14] != b"\x08\x00" or frame[23] != 17:
        return None
    dst_ip = socket.inet_ntoa(frame[30:34])
    _, dport, length, _ = _UDP.unpack_from(frame, 34)
    return (dst_ip, dport), frame[HEADERS:HEADERS + length - 8]


class UdpFrontend:
    def __init__(self, switch: Switch, listen: tuple[str, int], loss: float = 0.0, seed: int | None = None):
        self.switch = switch
        self.loss = LossHook(loss, seed)   # simulated ingress loss: these datagrams are the incoming frames
        self.listen = listen
        self.sock, _ = open_socket(listen, rcvbuf=32 << 20, sndbuf=32 << 20)
        T.enable_ecn(self.sock)
        self.address = self.sock.getsockname()
        # The frames carry the switch's service address; the socket's own port may differ (tests run
        # several switches side by side), which the workers never see: replies leave from the socket.
        self.service = (self.address[0], PORT)
        self.buf = bytearray(MAX_DATAGRAM + 1)
        self.frames_in = self.frames_out = self.send_errors = 0

    def handle(self, payload, source: tuple[str, int], tos: int = 0) -> None:
        self.frames_in += 1
        if self.loss.drop():
            return
        for _port, frame in self.switch.process(frame_for(payload, source, self.service, tos=tos), UDP_PORT_INDEX):
            out = datagram_of(frame)
            if out is None:
                continue
            try:
                self.sock.sendto(out[1], out[0])
                self.frames_out += 1
            except OSError:
                self.send_errors += 1

    def poll(self, timeout: float) -> int:
        """Wait up to `timeout` s for datagrams, then handle all that are queued; returns how many."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return 0
        mv, handled = memoryview(self.buf), 0
        while True:
            try:
                n, ancdata, _, source = self.sock.recvmsg_into([self.buf], T.ECN_ANCILLARY, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return handled
            except ConnectionRefusedError:
                continue
            self.handle(mv[:n], source, T.tos_of(ancdata))
            handled += 1

    def serve(self, duration: float | None = None, idle_exit: float | None = None, stop=None) -> None:
        """Serve until `duration` passes, `idle_exit` seconds pass without traffic (after the first
        datagram), or stop() is true."""
        serve_until(self.poll, duration, idle_exit, stop)

    def close(self) -> None:
        self.sock.close()
