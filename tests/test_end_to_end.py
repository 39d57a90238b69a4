"""Real processes on loopback: workers, software aggregators, loss, dead peers and garbage."""
import socket
import threading

import numpy as np
import pytest

from delay_relay import DelayRelay
from procs import Aggregator, run_workers, sparse_tensor
from zerosum import protocol as P
from zerosum.reference import reference_allreduce

N = 200_003   # not a multiple of the block size


def check(results, world, seeds, n, density, dtype=np.float32, block_size=256):
    for s_i, seed in enumerate(seeds):
        ref = reference_allreduce([sparse_tensor(r, seed, n, density, block_size, dtype) for r in range(world)],
                                  block_size)
        for rank in range(world):
            status, payload, _ = results[rank]
            assert status == "ok", payload
            got = payload[s_i]
            assert got.dtype == np.dtype(dtype) and got.shape == ref.shape
            assert got.tobytes() == ref.tobytes(), f"rank {rank} seed {seed}: wrong sum"


@pytest.mark.parametrize("world, naggs", [(2, 1), (4, 1), (8, 1), (4, 2)])
def test_random_sparse_data_exact_on_every_worker(world, naggs):
    aggs = [Aggregator(world) for _ in range(naggs)]
    try:
        seeds = [1, 2, 3]
        res = run_workers(world, [a.address for a in aggs], seeds, N, 0.2)
        check(res, world, seeds, N, 0.2)
    finally:
        for a in aggs:
            a.stop()


@pytest.mark.parametrize("window", [None, 1 << 20])
def test_an_aggregator_further_away_than_another_is_neither_a_loss_nor_a_queue(window):
    """Of two aggregators one is reached through a relay that holds every datagram 25 ms each way (the
    kernel may have no netem), with no window and with a congestion window. Each aggregator's round trips
    are judged against its own (R-L1, R-L8, R-C3): nothing is resent or probed and the window is never cut,
    through three allreduces, the later ones starting from the estimates the first one left. (Judged by
    the nearer one's, each rank sent 4 probes and resent 4 entries that the far one held, and the window
    was cut 5 times. With R-L1's 50 ms floor under srtt + 4 rttvar instead of under 4 rttvar, the far
    path's timeout was 51 ms once its rttvar had decayed, and a hiccup of the relay on this busy host cost
    a probe in about one run of ten.)"""
    world, n, seeds = 2, 1 << 16, [1, 2, 3]
    aggs = [Aggregator(world, slots=16), Aggregator(world, slots=16)]
    relay = DelayRelay(("127.0.0.1", aggs[1].port), 0.025)
    try:
        res = run_workers(world, [aggs[0].address, relay.address], seeds, n, 1.0, window=window)
        check(res, world, seeds, n, 1.0)
    finally:
        relay.close()
        for a in aggs:
            a.stop()
    assert relay.relayed > 0
    for rank in range(world):
        stats = res[rank][2]
        assert (stats.retransmitted_entries, stats.probes, stats.spurious_entries) == (0, 0, 0), stats
        assert stats.window_cuts == (0, 0), stats
        assert 0.05 <= stats.srtt < 0.1 and stats.min_rtt < 0.01, stats      # the far path's, the near one's


def test_int32_is_summed_exactly_and_dense_float_works():
    agg = Aggregator(3)
    try:
        res = run_workers(3, [agg.address], [7], 50_000, 1.0, dtype=np.int32)
        check(res, 3, [7], 50_000, 1.0, dtype=np.int32)
        exact = sum(sparse_tensor(r, 7, 50_000, 1.0, dtype=np.int32).astype(np.int64) for r in range(3))
        assert np.array_equal(res[0][1][0], exact.astype(np.int32))
        res = run_workers(3, [agg.address], [8], 50_000, 1.0, block_size=64)
        check(res, 3, [8], 50_000, 1.0, block_size=64)
    finally:
        agg.stop()


def test_packet_loss_in_workers_and_aggregators():
    aggs = [Aggregator(4, loss=0.05, seed=1), Aggregator(4, loss=0.05, seed=2)]
    try:
        seeds = [11, 12]
        res = run_workers(4, [a.address for a in aggs], seeds, N, 0.3, loss=0.05)
        check(res, 4, seeds, N, 0.3)
        assert sum(res[r][2].retransmitted_entries for r in range(4)) > 0
    finally:
        counters = [a.stop() for a in aggs]
    assert any(c.get("retransmissions_answered", 0) + c.get("duplicates", 0) for c in counters)


def test_dead_worker_gives_a_clear_error_and_the_aggregator_serves_the_next_run():
    agg = Aggregator(3)
    try:
        res = run_workers(3, [agg.address], [5], N, 0.5, dead={2}, timeout=2.0)
        for rank in (0, 1):
            status, msg, _ = res[rank]
            assert status == "error" and "ZeroSumTimeout" in msg and "waiting for rank 2" in msg, msg
        res = run_workers(3, [agg.address], [6], N, 0.5)
        check(res, 3, [6], N, 0.5)
    finally:
        counters = agg.stop()
    assert counters["job_restarts"] >= 1


def test_worker_killed_mid_allreduce():
    agg = Aggregator(3)
    try:
        res = run_workers(3, [agg.address], [9], 4_000_000, 1.0, killed=(1,), timeout=3.0)
    finally:
        agg.stop()
    for rank in (0, 2):
        status, msg, _ = res[rank]
        assert status == "error" and "ZeroSumTimeout" in msg and "waiting for rank 1" in msg, msg


def test_no_aggregator_gives_a_clear_error():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))      # a port nobody answers on
    addr = f"127.0.0.1:{s.getsockname()[1]}"
    res = run_workers(2, [addr], [1], 1000, 1.0, timeout=1.0)
    s.close()
    for rank in (0, 1):
        status, msg, _ = res[rank]
        assert status == "error" and "no answer to JOIN from aggregator" in msg, msg


def test_garbage_and_foreign_jobs_during_an_allreduce():
    agg = Aggregator(4)
    stop = threading.Event()
    sent = [0]

    def attack():
        rng = np.random.default_rng(0)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        target = ("127.0.0.1", agg.port)
        ent = P.entries_array(1)
        ent[0] = (0, P.HAS_DATA, 0, P.END, 3, P.NO_EXP)
        junk = np.full((1, 256), 2**20, np.int32)
        packets = [
            P.encode(P.Header(P.DATA, 2, 0, 4, 1, 782, 256, 1), ent, junk),         # foreign job
            P.encode(P.Header(P.DATA, 1, 0, 4, 1, 782, 256, 1), ent, junk),         # spoofed rank 0
            P.encode(P.Header(P.DATA, 1, 9, 4, 1, 782, 256, 1), ent, junk),         # unknown rank
            P.encode(P.Header(P.RESULT, 1, 0, 4, 1, 782, 256, 1), ent, junk),       # wrong direction
            P.encode(P.Header(P.DATA, 1, 0, 4, 1, 782, 256, 1), ent, junk)[:-3],    # truncated
        ]
        while not stop.is_set():
            for p in packets:
                s.sendto(p, target)
            s.sendto(rng.bytes(int(rng.integers(0, 2000))), target)
            sent[0] += 6
            stop.wait(0.001)
        s.close()

    t = threading.Thread(target=attack, daemon=True)
    t.start()
    try:
        seeds = [21, 22, 23]
        res = run_workers(4, [agg.address], seeds, N, 0.3)
        check(res, 4, seeds, N, 0.3)
    finally:
        stop.set()
        t.join()
        counters = agg.stop()
    assert sent[0] > 0
    drops = sum(v for k, v in counters.items() if k.startswith("drop_"))
    assert counters.get("drop_foreign_job", 0) > 0 and counters.get("drop_not_member", 0) > 0
    assert drops >= sent[0] * 0.5   # every garbage datagram is dropped and counted (some are in flight)
