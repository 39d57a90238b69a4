"""ECN (docs/protocol.md, R-E1, R-C6): the software aggregator reads the CE mark of the DATA it receives
and echoes it in the CONGESTION flag of the round's RESULT to every worker (and in STATUS), over real
loopback sockets in every I/O mode; sockets send ECT(0); the kernels' control-message parser reads the
TOS byte beside the GRO segment size."""
import socket
import threading

import numpy as np
import pytest

from zerosum import protocol as P
from zerosum import spec
from zerosum import transport as T
from zerosum.aggregator import AggregatorServer

B = 64
WORLD = 2


def worker_socket(tos: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    T.enable_ecn(s)
    s.setsockopt(socket.IPPROTO_IP, T.IP_TOS, tos)
    s.settimeout(5.0)
    return s


def receive(s: socket.socket) -> tuple[P.Datagram, int]:
    """The next datagram and the TOS byte it arrived with."""
    data, ancdata, _, _ = s.recvmsg(P.MAX_DATAGRAM, T.ECN_ANCILLARY)
    tos = next(d[0] for level, kind, d in ancdata if (level, kind) == (T.SOL_IP, T.IP_TOS))
    return P.decode(data), tos


def data(rank: int, block: int, nxt: int, values=None, epoch: int = 1) -> bytes:
    entry = P.entries_array(1)
    has = values is not None
    entry[0] = (0, P.HAS_DATA if has else 0, block, nxt, 0 if has else P.NO_EXP, 0 if nxt != P.END else P.NO_EXP)
    rows = np.asarray(values, np.int64).reshape(1, B) if has else None
    return P.encode(P.Header(P.DATA, 1, rank, WORLD, epoch, 4, B, 1), entry, rows)


@pytest.fixture(params=["gso", "batched", "plain"])
def aggregator(request, monkeypatch):
    monkeypatch.setenv("ZEROSUM_IO", request.param)
    server = AggregatorServer(WORLD, listen="127.0.0.1:0", slots=64, min_job_slots=1)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, kwargs=dict(stop=stop.is_set), daemon=True)
    thread.start()
    yield server.address
    stop.set()
    thread.join(5)
    server.close()


def send(s: socket.socket, tos: int, payload: bytes, to) -> None:
    s.setsockopt(socket.IPPROTO_IP, T.IP_TOS, tos)
    s.sendto(payload, to)


def test_the_aggregator_echoes_a_contributions_ce_mark_to_every_worker(aggregator):
    socks = [worker_socket(spec.ECT0) for _ in range(WORLD)]
    try:
        for r, s in enumerate(socks):
            s.sendto(P.encode(P.Header(P.JOIN, 1, r, WORLD, 100 + r, 0, B, 0)), aggregator)
            assert receive(s)[0].header.type == P.JOIN_ACK
        rounds = []

        def round_(tos0, tos1, block, nxt, values):
            for r, (s, tos) in enumerate(zip(socks, (tos0, tos1))):
                send(s, tos, data(r, block, nxt, values[r] if values else None), aggregator)
            got = [receive(s) for s in socks]
            for d, tos in got:
                assert d.header.type == P.RESULT and d.block[0] == block
                assert tos == spec.ECT0                            # the aggregator sends ECT(0), DSCP 0
            rounds.append([int(d.flags[0]) for d, _ in got])
            return got

        round_(spec.ECT0, spec.ECT0, P.BOOT, 0, None)
        rng = np.random.default_rng(1)
        values = [rng.integers(-2**20, 2**20, B) for _ in range(WORLD)]
        got = round_(spec.CE, spec.ECT0, 0, 1, values)           # rank 0's contribution was marked
        assert np.array_equal(got[0][0].data[0].astype(np.int64), values[0] + values[1])
        # a retransmission of the marked round: the shadow copy's RESULT carries the same flag
        send(socks[1], spec.ECT0, data(1, 0, 1, values[1]), aggregator)
        again, _ = receive(socks[1])
        assert again.header.type == P.RESULT and int(again.flags[0]) == spec.HAS_DATA | spec.CONGESTION
        assert bytes(again.data) == bytes(got[1][0].data)
        round_(spec.NOT_ECT, spec.ECT0, 1, 2, None)              # Not-ECT and ECT(0): no mark, no flag
        # a duplicate in a round that heard a mark: the STATUS says so
        send(socks[0], spec.CE, data(0, 2, P.END), aggregator)
        send(socks[0], spec.ECT0, data(0, 2, P.END), aggregator)
        status, _ = receive(socks[0])
        assert status.header.type == P.STATUS and int(status.flags[0]) == spec.CONGESTION
        send(socks[1], spec.ECT0, data(1, 2, P.END), aggregator)
        for s in socks:
            d, _ = receive(s)
            assert d.header.type == P.RESULT and int(d.flags[0]) == spec.CONGESTION
        assert rounds == [[0, 0], [spec.HAS_DATA | spec.CONGESTION] * 2, [0, 0]]
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("gro", [True, False])
def test_receive_reads_the_tos_byte_beside_the_gro_segment_size(gro):
    tx_sock, rx_sock = (worker_socket(spec.ECT0) for _ in range(2))
    try:
        features = T.detect(tx_sock)
        if not features.batched:
            pytest.skip("no recvmmsg/sendmmsg here (not Linux LP64)")
        T.detect(rx_sock, gro=gro)
        rx = T.rx_batch()
        for tos in (spec.CE, spec.NOT_ECT, spec.ECT0):
            tx_sock.setsockopt(socket.IPPROTO_IP, T.IP_TOS, tos)
            tx = T.tx_queue(features.gso)
            buf = np.arange(10 * 100, dtype=np.uint8)          # a GSO run of ten datagrams (one with GRO)
            starts = np.arange(0, 1000, 100, dtype=np.int64)
            T.queue_datagrams(tx_sock.fileno(), tx, buf.ctypes.data, starts, starts + 100, 10,
                              T.address_key(rx_sock.getsockname()), 0.0)
            assert T.send(tx_sock.fileno(), tx) == 0
            got = 0
            while got < 1000:
                n = T.receive(rx_sock.fileno(), rx, 1000)
                assert n
                for i in range(n):
                    assert rx.tos[i] == tos and rx.seg[i] == 100
                    got += int(rx.length[i])
    finally:
        tx_sock.close()
        rx_sock.close()
