"""zerosum.transport: batched system calls, UDP GSO and GRO, their fallbacks, and the path's datagram size;
then whole allreduces through each I/O mode (ZEROSUM_IO) with MTU-sized datagrams, exact to the bit."""
import socket
import time

import numpy as np
import pytest

from procs import Aggregator, run_workers
from test_end_to_end import check
from zerosum import transport as T


def sockets(n, gro=True):
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        out.append(s)
    return out


def receive_all(sock, rx, expect):
    """Every datagram queued on sock, GRO buffers cut at their segment size."""
    got = []
    while len(got) < expect:
        n = T.receive(sock.fileno(), rx, 1000)
        if not n:
            break
        for i in range(n):
            length, seg = int(rx.length[i]), int(rx.seg[i])
            got += [bytes(rx.buf[i, off:min(off + seg, length)]) for off in range(0, length, seg)]
            assert T.address_of(int(rx.source[i]))[0] == "127.0.0.1"
    return got


def datagrams(sizes, seed=0):
    """Datagrams of these sizes back to back in one buffer: (buffer, starts, ends, the bytes of each)."""
    rng = np.random.default_rng(seed)
    ends = np.cumsum(sizes).astype(np.int64)
    starts = ends - np.asarray(sizes, np.int64)
    buf = rng.integers(0, 256, int(ends[-1]), dtype=np.uint8)
    return buf, starts, ends, [bytes(buf[a:b]) for a, b in zip(starts, ends)]


@pytest.mark.parametrize("receiver_gro", [True, False])
def test_runs_of_datagrams_arrive_whole_and_in_order_with_and_without_gro(receiver_gro):
    tx_sock, rx_sock = sockets(2)
    try:
        features = T.detect(tx_sock)
        if not features.batched:
            pytest.skip("no recvmmsg/sendmmsg here (not Linux LP64)")
        T.detect(rx_sock, gro=receiver_gro)
        # runs of equal sizes (GSO messages), a shorter one ending a run, odd sizes alone; > TX_BATCH
        sizes = [1472] * 70 + [900] + [1472] * 5 + [8972] * 7 + [20, 37, 65507] + [1060] * 300 + [16]
        buf, starts, ends, want = datagrams(sizes)
        tx, rx = T.tx_queue(features.gso), T.rx_batch()
        dest = T.address_key(rx_sock.getsockname())
        T.queue_datagrams(tx_sock.fileno(), tx, buf.ctypes.data, starts, ends, len(sizes), dest, 0.0)
        assert T.send(tx_sock.fileno(), tx) == 0
        assert tx.state[T.DATAGRAMS] == len(sizes) and tx.state[T.SEND_ERRORS] == 0
        if features.gso:     # fewer messages than datagrams: runs went out as one GSO message each
            assert tx.state[T.MESSAGES] < len(sizes) / 10
        assert receive_all(rx_sock, rx, len(sizes)) == want
    finally:
        tx_sock.close()
        rx_sock.close()


def test_a_gso_message_the_kernel_refuses_is_sent_datagram_by_datagram():
    tx_sock, rx_sock = sockets(2)
    try:
        features = T.detect(tx_sock)
        if not features.gso:
            pytest.skip("no UDP GSO on this kernel")
        # more segments than the kernel takes in one message (UDP_MAX_SEGMENTS): EINVAL
        buf, starts, ends, want = datagrams([100] * 200)
        tx, rx = T.tx_queue(True), T.rx_batch()
        T.queue(tx_sock.fileno(), tx, buf.ctypes.data, int(ends[-1]), T.address_key(rx_sock.getsockname()), 100)
        assert T.send(tx_sock.fileno(), tx) == 0
        assert tx.state[T.GSO_ON] == 0 and tx.state[T.GSO_FALLBACKS] == 1
        assert tx.state[T.DATAGRAMS] == 200
        assert receive_all(rx_sock, rx, 200) == want
    finally:
        tx_sock.close()
        rx_sock.close()


def test_receive_times_out_empty_and_reports_the_sender():
    a, b = sockets(2)
    try:
        if not T.detect(a).batched:
            pytest.skip("no recvmmsg here")
        rx = T.rx_batch()
        assert T.receive(a.fileno(), rx, 0) == 0
        assert T.receive(a.fileno(), rx, 20) == 0
        b.sendto(b"x" * 5, a.getsockname())
        assert T.receive(a.fileno(), rx, 1000) == 1
        assert rx.length[0] == 5 and T.address_of(int(rx.source[0])) == b.getsockname()
    finally:
        a.close()
        b.close()


def test_a_worker_reads_its_groups_results_before_an_answer_to_its_own_socket():
    """R-A8 across a worker's two sockets: results queued on the multicast group's socket before an
    answer came to the worker's own socket (a probe's RESULT, which the aggregator sends only after the
    round's RESULT went to the group) come out of receive2 first, also where more than a batch waits."""
    own, group, sender = sockets(3)
    try:
        if not T.detect(own).batched:
            pytest.skip("no recvmmsg here")
        rx = T.rx_batch()
        for queued in (3, rx.hdrs.shape[0] + 3):
            results = [b"result %d" % k for k in range(queued)]
            for r in results:
                sender.sendto(r, group.getsockname())
            sender.sendto(b"answer", own.getsockname())
            got = []
            while len(got) < queued + 1:
                n = T.receive2(own.fileno(), group.fileno(), rx, 1000)
                assert n > 0
                got += [bytes(rx.buf[i, :int(rx.length[i])]) for i in range(n)]
            assert got == results + [b"answer"]
    finally:
        for s in (own, group, sender):
            s.close()


def test_arrivals_carry_the_kernels_time_not_the_time_they_were_read():
    """A datagram read 80 ms after it arrived says so (rx.arrived, on monotonic()'s clock): the wait of a
    worker that is behind (or waits for a core) is not the path's (R-C3, R-C4)."""
    a, b = sockets(2)
    try:
        features = T.detect(a)
        if not features.stamps:
            pytest.skip("no SO_TIMESTAMPNS with batched receives here")
        rx = T.rx_batch()
        sent = time.monotonic()
        b.sendto(b"x" * 5, a.getsockname())
        b.sendto(b"y" * 7, a.getsockname())
        time.sleep(0.08)
        assert T.receive(a.fileno(), rx, 1000) == 2
        read = time.monotonic()
        for k in range(2):
            assert sent - 0.002 <= rx.arrived[k] <= sent + 0.03      # when it came, not when it was read
            assert read - rx.arrived[k] >= 0.07
        c = sockets(1)[0]                                             # not asked for (the aggregator)
        try:
            assert not T.detect(c, stamps=False).stamps
            b.sendto(b"z", c.getsockname())
            time.sleep(0.08)
            before = time.monotonic()
            assert T.receive(c.fileno(), rx, 1000) == 1
            assert before <= rx.arrived[0] <= time.monotonic()         # the time it was read
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_the_default_datagram_follows_the_path_mtu():
    # loopback's MTU is 65,536: the UDP limit of 65,507 applies; a cap below it wins
    assert T.datagram_limit([("127.0.0.1", 9)], 65507) == 65507
    assert T.datagram_limit([("127.0.0.1", 9)], 1472) == 1472
    assert T.address_of(T.address_key(("10.1.2.3", 4567))) == ("10.1.2.3", 4567)


def test_io_mode_is_checked(monkeypatch):
    monkeypatch.setenv("ZEROSUM_IO", "fast")
    with pytest.raises(ValueError, match="ZEROSUM_IO must be one of gso, batched, plain"):
        T.io_mode()
    monkeypatch.setenv("ZEROSUM_IO", "plain")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        assert T.detect(s) == T.Features(False, False, False)


@pytest.mark.parametrize("mode", ["gso", "batched", "plain"])
def test_mtu_sized_datagrams_sum_exactly_in_every_io_mode(mode, monkeypatch):
    """4 workers and an aggregator with 1,472-byte datagrams (one block of 256 values each), dense and
    sparse, in each I/O mode: bit-identical to the reference, nothing retransmitted."""
    monkeypatch.setenv("ZEROSUM_IO", mode)     # inherited by the aggregator and worker processes
    agg = Aggregator(4, max_datagram=1472)
    try:
        seeds = [3, 4]
        res = run_workers(4, [agg.address], seeds, 300_001, 1.0, max_datagram=1472)
        check(res, 4, seeds, 300_001, 1.0)
        res = run_workers(4, [agg.address], [5], 300_001, 0.05, max_datagram=1472)
        check(res, 4, [5], 300_001, 0.05)
        assert sum(res[r][2].retransmitted_entries for r in range(4)) == 0
    finally:
        counters = agg.stop()
    assert counters.get("send_errors", 0) == 0


def _netns_or_skip():
    from zerosum import netns
    why = netns.available()
    if why:
        pytest.skip(f"the namespace star {why}")
    return netns


@pytest.mark.parametrize("mtu", [1500, 9000])
def test_on_a_real_link_the_default_datagram_fits_its_mtu(mtu):
    import subprocess
    import sys
    netns = _netns_or_skip()
    hosts = {"a": netns.aggregator_ip(0), "w": netns.worker_ip(0)}
    with netns.star(hosts, mtu) as (ns, _):
        code = ("import zerosum; w = zerosum.Worker(0, 1, ['%s:9']); print(w.config.max_datagram)"
                % netns.aggregator_ip(0))
        out = subprocess.run(["ip", "netns", "exec", ns["w"], sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) == mtu - 28


def test_bench_on_veth_links_of_mtu_1500_sums_exactly(tmp_path):
    """`zerosum bench --mtu 1500`: every rank and the aggregator on hosts of their own, datagrams of the
    path's size (no fragments), every result checked against the reference, nothing retransmitted."""
    import json
    import subprocess
    import sys
    _netns_or_skip()
    out = subprocess.run([sys.executable, "-m", "zerosum", "bench", "--mtu", "1500", "--workers", "2",
                          "--size", "300000", "--densities", "1.0,0.05", "--rounds", "1", "--no-baseline",
                          "--output", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "veth links of MTU 1500" in out.stdout
    run = json.loads((tmp_path / "bench.json").read_text())["runs"][0]
    assert [r["density"] for r in run["rows"]] == [1.0, 0.05]
    assert all(r["retransmitted_entries"] == 0 for r in run["rows"])
    # --multicast auto: by multicast across the bridge where a probe got through, and the output says so
    assert ("results by multicast" in " ".join(out.stdout.split())) == (run["multicast"] is not None)


def test_a_multicast_probe_reaches_every_worker_of_its_star_and_no_other():
    """netns.multicast_problem: one datagram from each aggregator host, through its own veth link, must
    reach every worker host joined to the group; a worker on another star (another bridge, the same
    addresses) is named as not reached. in_namespace makes a socket on that host only."""
    netns = _netns_or_skip()
    hosts = {"a0": netns.aggregator_ip(0), "a1": netns.aggregator_ip(1), "w0": netns.worker_ip(0),
             "w1": netns.worker_ip(1)}
    group, port = "239.255.77.1", 48901
    with netns.star(hosts, 1500) as (ns, _), netns.star({"w0": netns.worker_ip(0)}, 1500) as (other, _):
        on = {h: (ns[h], ip) for h, ip in hosts.items()}
        senders = {h: on[h] for h in ("a0", "a1")}
        assert netns.multicast_problem(group, port, senders, {h: on[h] for h in ("w0", "w1")}) is None
        why = netns.multicast_problem(group, port, senders, {"w9": (other["w0"], netns.worker_ip(0))},
                                      wait=0.3)
        assert why is not None and "a0, a1" in why and "did not reach w9" in why
        bound = netns.in_namespace(ns["w0"], lambda: socket.create_server((netns.worker_ip(0), 0),
                                                                          family=socket.AF_INET))
        bound.close()
        with pytest.raises(OSError):        # that address is the namespace's, not this host's
            socket.create_server((netns.worker_ip(0), 0), family=socket.AF_INET).close()


def test_the_bench_resolves_multicast_on_its_star(monkeypatch):
    """bench.star_results_group: auto takes the star's group when the probe gets through and falls back to
    each worker, saying why, when it does not; a group asked for by name must get through; off is off."""
    from zerosum import bench
    netns = _netns_or_skip()
    hosts = {"a0": netns.aggregator_ip(0), "w0": netns.worker_ip(0), "w1": netns.worker_ip(1)}
    with netns.star(hosts, 1500) as (ns, _):
        on = {h: (ns[h], ip) for h, ip in hosts.items()}
        assert bench.star_results_group("off", on) == (None, "results to each worker (multicast off)")
        assert bench.star_results_group("239.1.2.3:5555", on)[0] == "239.1.2.3:5555"
        group, note = bench.star_results_group("auto", on)
        assert group == f"{bench.STAR_GROUP}:{bench.STAR_PORT}" and "across the veth links" in note
        with pytest.raises(ValueError, match="not an IPv4 multicast address"):
            bench.star_results_group("10.0.0.1", on)
        monkeypatch.setattr(netns, "multicast_problem", lambda *a, **k: "no route")
        group, note = bench.star_results_group("auto", on)
        assert group is None and "does not work here: no route" in note
        with pytest.raises(ValueError, match="no route"):
            bench.star_results_group("239.255.77.1", on)
        monkeypatch.setenv("ZEROSUM_IO", "plain")
        assert bench.star_results_group("auto", on)[0] is None


def test_results_by_multicast_are_exact_and_a_worker_without_the_group_is_told():
    """An aggregator with --multicast sends each result once to the group (TTL 0 on loopback: nothing
    leaves the host), which the workers joined: sums bit-identical to the reference; a worker that was not
    given the group fails at once with what to do, not with a timeout."""
    from zerosum.udp import free_port
    import zerosum
    group = f"239.255.77.1:{free_port(socket.SOCK_DGRAM)}"
    agg = Aggregator(4, multicast=group)
    try:
        res = run_workers(4, [agg.address], [21, 22], 300_001, 0.3, multicast=group)
        check(res, 4, [21, 22], 300_001, 0.3)
    finally:
        agg.stop()
    agg = Aggregator(1, multicast=group)
    try:
        with pytest.raises(zerosum.ZeroSumError, match="sends results to an IP multicast group"):
            with zerosum.Worker(0, 1, [agg.address], timeout=10):
                pass
    finally:
        agg.stop()


def test_multicast_needs_a_multicast_address():
    import zerosum
    with pytest.raises(ValueError, match="not an IPv4 multicast address"):
        zerosum.Worker(0, 1, ["127.0.0.1:9"], multicast="10.0.0.1:5000")


def test_a_results_group_port_is_held_by_no_socket_and_outside_the_ephemeral_range(monkeypatch):
    """transport.unused_group_port: a port that no socket on this host holds, chosen below the range the
    kernel gives unbound senders their ports from, so that none can take it before the workers join."""
    from zerosum import local
    low, high = T.ephemeral_ports()
    assert 1024 <= low <= high
    port = T.unused_group_port(local.LOOPBACK_GROUP)
    assert 1024 <= port < low
    found, problem = T.multicast_problem(local.LOOPBACK_GROUP, "127.0.0.1")
    assert problem is not None or 1024 <= found < low
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as held:      # as an unbound sender's would be
        held.bind(("0.0.0.0", port))
        other = T.unused_group_port(local.LOOPBACK_GROUP)
        assert other not in (0, port)
        monkeypatch.setattr(T.random, "sample", lambda band, k: [port, other])
        assert T.unused_group_port(local.LOOPBACK_GROUP) == other      # the held port is passed over
        monkeypatch.setattr(T.random, "sample", lambda band, k: [port])
        assert T.unused_group_port(local.LOOPBACK_GROUP) == 0          # none free: the kernel's choice


def test_results_go_by_multicast_on_loopback_where_it_works_and_to_each_worker_where_not(monkeypatch):
    """local.results_group: "auto" takes a group on loopback when a datagram sent to it arrives here, and
    falls back to unicast (saying why) when not; a group asked for by name must work or is an error."""
    from zerosum import local
    port, problem = T.multicast_problem(local.LOOPBACK_GROUP, "127.0.0.1")
    assert (port > 0) == (problem is None)
    assert T.multicast_problem(local.LOOPBACK_GROUP, "192.0.2.1")[1]     # no such interface here
    assert local.results_group("off") == (None, "results to each worker (multicast off)")
    # where ZeroSum does not start the aggregator on loopback, only a group given by name is used
    assert [local.named_group(v) for v in (None, "auto", " OFF", "none", "", "239.1.2.3:5555 ")] == \
        [None, None, None, None, None, "239.1.2.3:5555"]
    with pytest.raises(ValueError, match="not an IPv4 multicast address"):
        local.results_group("10.0.0.1:5000")
    for port in ("abc", "0", "65536", "-1"):
        with pytest.raises(ValueError, match="is not a port"):
            local.results_group(f"239.1.2.3:{port}")
    if problem is None:
        assert local.results_group("239.1.2.3:5555")[0] == "239.1.2.3:5555"
        assert local.results_group("auto")[0].startswith(local.LOOPBACK_GROUP + ":")
    monkeypatch.setattr(T, "multicast_problem", lambda group, interface: (0, "no route"))
    group, note = local.results_group("auto")
    assert group is None and "does not work here: no route" in note
    with pytest.raises(ValueError, match="no route"):
        local.results_group("239.255.77.1")
    monkeypatch.setenv("ZEROSUM_IO", "plain")
    assert local.results_group("auto")[0] is None


def test_the_warm_up_finishes_each_allreduce_through_the_compiled_loops():
    """warmup._warm_up_transport: the worker's compiled loop (worker_kernels.drive) against the aggregator's
    (serve_until, on a thread of its own) over two loopback sockets; each of its four tiny allreduces
    (float32/int32, dense/collected) finishes, or the process would meet a kernel's first compile later."""
    from zerosum import warmup
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        if not T.detect(s).batched:
            pytest.skip("no batched I/O here: the compiled loops do not run")
    assert warmup._warm_up_transport(4) == 4


def test_the_aggregators_list_of_job_tables_is_built_in_compiled_code():
    """aggregator_kernels.table_list / append_table: the typed list that serve and serve_until take, one
    SlotTable per job in the order added, each the job's own arrays (not copies)."""
    from zerosum import aggregator_kernels as AK
    from zerosum.aggregator_machine import AggregatorMachine
    first, second = AggregatorMachine(1, 2, slots=4).table, AggregatorMachine(2, 3, slots=8).table
    tables = AK.table_list(first)
    AK.append_table(tables, second)
    assert len(tables) == 2
    for got, table in zip(tables, (first, second)):
        assert np.shares_memory(got.regs, table.regs) and got.regs.shape == table.regs.shape
