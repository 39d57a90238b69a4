"""Per-bucket path choice (zerosum.hybrid): the policy alone, ranks agreeing under different local timings,
and the DDP hook and the `zerosum` backend choosing between ZeroSum and gloo's ring on real processes."""
import threading

import numpy as np
import pytest

from zerosum.hybrid import RING, ZEROSUM, PathChoice


def alone(values):
    return np.asarray(values, np.float64)


def test_first_uses_measure_both_paths_then_the_faster_one_wins():
    p = PathChoice(alone, explore_every=1000, agree_every=1)
    p.base = 0.2
    assert p.choose("b") == ZEROSUM
    p.observe("b", ZEROSUM, 4000, 0.010, 1.0)
    assert p.choose("b") == RING
    p.observe("b", RING, 4000, 0.004, None)
    for _ in range(5):
        assert p.choose("b") == RING              # dense: the ring's 4 ms beat ZeroSum's 10 ms
        p.observe("b", RING, 4000, 0.004, None)
    c = p.counts
    assert (c[ZEROSUM].buckets, c[RING].buckets, c[RING].bytes) == (1, 6, 24000)


def test_the_density_moves_the_choice_across_the_crossover():
    # ZeroSum 10 ms at density 1 with base 0.2: 2 ms + 8 ms x density; the ring 4 ms: crossover at 0.25
    p = PathChoice(alone, explore_every=1000, agree_every=1)
    p.base = 0.2
    p.choose("b")
    p.observe("b", ZEROSUM, 1, 0.010, 1.0)
    p.choose("b")
    p.observe("b", RING, 1, 0.004, 0.30)          # the ring's result, scanned: density 0.30
    assert p.choose("b") == RING                    # predicted 2 + 2.4 = 4.4 ms > 4 ms
    p.observe("b", RING, 1, 0.004, 0.20)
    assert p.predicted(p.buckets["b"])[ZEROSUM] == pytest.approx(0.0036)
    assert p.choose("b") == ZEROSUM                 # 3.6 ms < 4 ms
    p.observe("b", ZEROSUM, 1, 0.0036, 0.24)
    assert p.choose("b") == ZEROSUM


def test_the_other_path_is_measured_again_every_explore_every_uses():
    p = PathChoice(alone, explore_every=5, agree_every=1)
    p.base = 0.5
    taken = []
    for _ in range(22):
        path = p.choose("b")
        taken.append(path)
        p.observe("b", path, 1, 0.001 if path == ZEROSUM else 0.002, 0.01)
    assert taken[:2] == [ZEROSUM, RING]
    assert [i for i, t in enumerate(taken) if t == RING] == [1, 4, 9, 14, 19]


def test_calibration_agrees_on_the_slowest_rank():
    seen = []

    def agree(v):
        seen.append(list(v))
        return np.maximum(v, [0.002, 0.010])      # another rank was slower at density 1
    p = PathChoice(agree)
    times = iter([0.001, 0.0012, 0.0011, 0.004, 0.005, 0.0045])
    assert p.calibrate(lambda d: next(times)) == pytest.approx(0.2)
    assert seen == [[0.0011, 0.0045]]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        PathChoice(alone, explore_every=1)
    with pytest.raises(ValueError):
        PathChoice(alone, agree_every=0)


def test_ranks_with_different_timings_take_the_same_path_every_time():
    """Three 'ranks' in threads, each timing its own allreduces differently (and noisily); their
    agreements are a real collective (every rank must call it at the same point, or the barrier breaks)."""
    world, uses = 3, 300
    barrier = threading.Barrier(world, timeout=10)
    slots = [None] * world
    calls = [0] * world
    taken = [[] for _ in range(world)]

    def run(rank):
        rng = np.random.default_rng(rank)

        def agree(v):
            calls[rank] += 1
            slots[rank] = np.asarray(v, np.float64)
            barrier.wait()
            out = np.max(slots, axis=0)
            barrier.wait()
            return out
        p = PathChoice(agree, explore_every=7, agree_every=3)
        p.calibrate(lambda d: (0.002 + 0.008 * d) * rng.uniform(0.5, 2.0))
        for i in range(uses):
            for key in ("sparse", "dense", "drifting"):
                path = p.choose(key)
                taken[rank].append((key, path))
                density = {"sparse": 0.01, "dense": 1.0, "drifting": (i % 100) / 100}[key]
                t = (0.002 + 0.008 * density if path == ZEROSUM else 0.005) * rng.uniform(0.5, 2.0)
                union = density if path == ZEROSUM or p.scan_due(key, path) else None
                p.observe(key, path, 1000, t, union)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert taken[0] == taken[1] == taken[2] and len(taken[0]) == 3 * uses
    assert len(set(calls)) == 1
    paths = {key: [path for k, path in taken[0] if k == key] for key in ("sparse", "dense")}
    assert paths["sparse"].count(ZEROSUM) > 0.8 * uses       # ZeroSum's ~2 ms against the ring's ~5 ms
    assert paths["dense"].count(RING) > 0.8 * uses           # the ring's ~5 ms against ZeroSum's ~10 ms


# -- on real processes ------------------------------------------------------------------------------------

torch_procs = pytest.importorskip("torch_procs", reason="torch is not installed (pip install 'zerosum[torch]')")


@pytest.mark.parametrize("hook", ["hybrid", "hybrid-topk"])
def test_ddp_hook_chooses_per_bucket_and_ranks_stay_identical_after_every_step(hook):
    from procs import Aggregator
    from zerosum.udp import free_port
    agg = Aggregator(2)
    try:
        runs = torch_procs.spawn(torch_procs.ddp_training, 2, free_port(), agg.address, hook, 8)
    finally:
        agg.stop()
    (p0, l0, d0, report0), (p1, _, d1, report1) = runs
    assert d0 == d1                                   # the same parameters on both ranks after every step
    for a, b in zip(p0, p1):
        assert a.tobytes() == b.tobytes()
    assert report0["paths"] == report1["paths"]       # the same path for every bucket
    assert report0["paths"][ZEROSUM]["buckets"] > 0 and report0["paths"][RING]["buckets"] > 0
    if hook == "hybrid":                               # either path averages: training as with gloo's DDP
        plain = torch_procs.spawn(torch_procs.ddp_training, 2, free_port(), None, False, 8)
        for a, b in zip(p0, plain[0][0]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(l0, plain[0][1], rtol=1e-4)


def test_backend_all_reduce_chooses_per_call_and_sums_exactly():
    from zerosum.udp import free_port
    world, calls = 2, 6
    runs = torch_procs.spawn(torch_procs.backend_paths, world, free_port(), calls)
    for call in range(calls):
        expected = np.zeros(40_000, np.float32)
        for rank in range(world):
            expected[rank * 1000: rank * 1000 + 3000] += np.arange(3000, dtype=np.float32) + call
        for sums, _ in runs:
            assert np.array_equal(sums[call][0], expected)
            assert np.array_equal(sums[call][1], np.full(5000, sum(r + call for r in range(world)), np.int32))
    reports = [report for _, report in runs]
    assert reports[0]["paths"] == reports[1]["paths"]
    used = reports[0]["paths"]
    assert used[ZEROSUM]["buckets"] >= 2 and used[RING]["buckets"] >= 2     # each key measured both paths
    assert used[ZEROSUM]["buckets"] + used[RING]["buckets"] == 2 * calls
    sparse = next(v for k, v in reports[0]["buckets"].items() if "40000" in k)
    assert sparse["density"] == pytest.approx(16 / 157)    # values 0..3999 are non-zero: blocks 0..15 of 157


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not _cuda_available(), reason="no CUDA device on this machine"))])
def test_training_survives_the_aggregator_being_killed_and_goes_back_to_it_once_restarted(device):
    """The aggregator is SIGKILLed during a backward pass and restarted 2 s later on the same port: the
    ranks finish the interrupted bucket, train through the ring meanwhile, rejoin, and end with the
    same parameters on every rank after every step, as a run through gloo alone would (within rounding).
    On a GPU model too: the buckets and the pieces a failed bucket is finished from are CUDA tensors."""
    import threading
    from procs import Aggregator
    from zerosum.udp import free_port
    world, after, kill_at = 2, 20, 5
    agg = Aggregator(world)
    restarted, finished = [], threading.Event()

    def restart():
        agg.proc.wait()
        finished.wait(2.0)
        if not finished.is_set():
            restarted.append(Aggregator(world, listen=agg.address))
        finished.wait()      # (the aggregator dies with the thread that started it)
    t = threading.Thread(target=restart, daemon=True)
    t.start()
    try:
        runs = torch_procs.spawn(torch_procs.ddp_surviving, world, free_port(), agg.address, after, kill_at,
                                 agg.proc.pid, None, device)
    finally:
        agg.proc.kill()
        counters = restarted[0].stop() if restarted else {}
        finished.set()
        t.join(30)
    (p0, l0, d0, times, r0), (p1, _, d1, _, r1) = runs
    assert d0 == d1                                   # identical on both ranks after every step
    assert r0 == r1
    assert r0["failover"]["failures"] >= 1 and r0["failover"]["rejoins"] == 1 and not r0["failover"]["down"]
    assert r0["failover"]["ring_buckets_while_down"] > 0
    assert counters.get("rounds", 0) > 0              # the restarted aggregator summed the last steps
    assert r0["back"] is not None and len(l0) == r0["back"] + after
    plain = torch_procs.spawn(torch_procs.ddp_training, world, free_port(), None, False, len(l0), device)
    for a, b in zip(p0, plain[0][0]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(l0, plain[0][1], rtol=1e-4)
    assert times[kill_at] < 5.0                       # the failed step, far below the 30 s timeout


# -- R-L7 in the worker's machine (sans-IO, simulated time) ----------------------------------------------

def _machines(arrays, agg, silence, block_size=16):
    from netsim import join_all
    from zerosum.blocks import BlockSource, DenseResult
    from zerosum.layout import Layout
    from zerosum.worker_machine import AllreduceMachine, WorkerConfig
    slots = join_all([agg], len(arrays), block_size)
    out = []
    for r, x in enumerate(arrays):
        source = BlockSource.dense(x, block_size)
        cfg = WorkerConfig(rank=r, world=len(arrays), job=agg.state.job, timeout=1e9, block_size=block_size,
                           silence=silence, max_rto=silence / 3)
        out.append(AllreduceMachine(cfg, 1, source, Layout(1, min(slots, 4), source.nblocks),
                                    DenseResult(x.copy())))
    return out


def _drive(machines, agg, end, *, alive=lambda now, n: True, active=None):
    """Deliver everything in order (no loss) until `end`; the aggregator takes datagrams while
    alive(now, datagrams taken so far). Returns {rank: (time, AggregatorSilent)} of the ranks that gave up."""
    from zerosum.errors import AggregatorSilent
    active = set(range(len(machines))) if active is None else set(active)
    queue, taken, now, gave_up = [], 0, 0.0, {}
    for r in active:
        queue += [("agg", r, bytes(d)) for _, d in machines[r].start(now)]
    while now < end and any(not machines[r].done for r in active - set(gave_up)):
        if queue:
            kind, r, data = queue.pop(0)
            if kind == "agg":
                if alive(now, taken):
                    taken += 1
                    agg.receive(data, ("w", r), now)
                    for dests, reply in agg.datagrams_to_send(now):
                        queue += [("worker", dest, bytes(reply)) for _, dest in dests if dest in active]
            elif r not in gave_up:
                machines[r].receive(0, data, now)
                queue += [("agg", r, bytes(d)) for _, d in machines[r].flush(now)]
            continue
        live = [r for r in active - set(gave_up) if not machines[r].done]
        now = min(machines[r].timer() for r in live)
        for r in live:
            try:
                queue += [("agg", r, bytes(d)) for _, d in machines[r].poll(now)]
            except AggregatorSilent as e:
                gave_up[r] = (now, e)
    return gave_up


def _aggregator(world, block_size=16):
    from zerosum.aggregator_machine import AggregatorMachine
    return AggregatorMachine(1, world, slots=4)


def test_a_live_aggregator_waiting_for_a_slower_rank_is_not_taken_for_dead():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(16 * 40).astype(np.float32) for _ in range(2)]
    agg = _aggregator(2)
    machines = _machines(arrays, agg, silence=0.6)
    assert _drive(machines, agg, end=20.0, active=[0]) == {}      # rank 1 never comes: 20 s of probes
    assert not machines[0].done and machines[0].probes > 10


def test_a_dead_aggregator_is_detected_within_silence_and_the_final_blocks_are_named():
    from zerosum.reference import reference_allreduce
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(16 * 40).astype(np.float32) for _ in range(2)]
    for x in arrays:
        x[16 * 5: 16 * 9] = 0                       # some blocks outside the union
    expected = reference_allreduce(arrays, 16)
    agg = _aggregator(2)
    machines = _machines(arrays, agg, silence=0.6)
    gave_up = _drive(machines, agg, end=60.0, alive=lambda now, n: n < 12)     # dies after 12 datagrams
    assert set(gave_up) == {0, 1}
    for r, (when, e) in gave_up.items():
        m = machines[r]
        quiet = when - float(m.last_heard.max())
        assert 0.6 <= quiet <= 0.6 + 0.2 + 1e-9, quiet            # within silence + max_rto
        received = np.repeat(e.received, 16)
        out = m.output.flat
        assert 0 < e.received.sum() < e.received.size
        assert np.array_equal(out[received], expected[received])   # final where it says so
        assert np.array_equal(out[~received], arrays[r][~received])   # the rank's input everywhere else


def test_training_turns_to_the_standby_aggregator_when_the_failed_one_stays_dead():
    from procs import Aggregator
    from zerosum.udp import free_port
    world, after, kill_at = 2, 10, 4
    agg, standby = Aggregator(world), Aggregator(world)
    try:
        runs = torch_procs.spawn(torch_procs.ddp_surviving, world, free_port(), agg.address, after, kill_at,
                                 agg.proc.pid, standby.address)
    finally:
        agg.proc.kill()
        counters = standby.stop()
    (p0, l0, d0, _, r0), (p1, _, d1, _, r1) = runs
    assert d0 == d1 and r0 == r1
    assert r0["failover"]["failures"] == 1 and r0["failover"]["rejoins"] == 1 and not r0["failover"]["down"]
    assert counters.get("rounds", 0) > 0              # the standby summed the steps after the switch
    plain = torch_procs.spawn(torch_procs.ddp_training, world, free_port(), None, False, len(l0))
    for a, b in zip(p0, plain[0][0]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_rank_that_cannot_take_part_in_the_agreement_is_a_clear_error_not_a_hang():
    from zerosum.udp import free_port
    from torch_procs import CTX, _main
    from procs import collect
    out, port = CTX.Queue(), free_port()
    procs = [CTX.Process(target=_main, args=(out, torch_procs.failover_alone, r, 2, (port,)), daemon=True)
             for r in range(2)]
    (rank, ok, value), = collect(procs, out, 1, 60)
    assert ok and rank == 0, value
    message, seconds = value
    assert message is not None and "could not agree" in message and "partitioned" in message, message
    assert seconds < 10
