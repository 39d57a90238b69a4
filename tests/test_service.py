"""One aggregator, many jobs: admission, quotas, LEAVE, idle expiry and isolation (AggregatorService),
in memory and with real processes."""
import threading

import numpy as np
import pytest

from netsim import ServiceJob, run
from procs import Aggregator, run_workers
from test_end_to_end import check
from zerosum import protocol as P
from zerosum.aggregator_service import AggregatorService
from zerosum.errors import ZeroSumRefused
from zerosum.reference import reference_allreduce
from zerosum.worker_machine import JoinMachine, WorkerConfig


def _join(service, job, world, block_size=4, now=0.0, ranks=None):
    """JOIN every rank (twice, so all see the full bitmap); return the JoinMachines."""
    joins = [JoinMachine(WorkerConfig(rank=r, world=world, job=job, block_size=block_size), 1, 100 + r, now)
             for r in range(world)]
    for t in (now, now + 1):
        for r, m in enumerate(joins):
            if ranks is not None and r not in ranks:
                continue
            for _, d in m.datagrams_to_send(t):
                for _, reply in exchange(service, d, (job, r), t):
                    m.receive(0, bytes(reply), t)
    return joins


def exchange(service, datagram, source, now=0.0):
    """What the service sends after taking `datagram` (its driver interface, one datagram at a time)."""
    service.receive(datagram, source, now)
    return service.datagrams_to_send(now)


def test_jobs_get_fair_shares_and_a_full_aggregator_refuses_clearly():
    s = AggregatorService(slots=256, min_job_slots=64, max_job_slots=128)
    a = _join(s, 1, 2)
    b = _join(s, 2, 3)
    assert all(m.done for m in a + b) and a[0].slots == 128 and b[0].slots == 128   # min(max, 256 // n)
    assert s.slots_in_use == 256
    with pytest.raises(ZeroSumRefused, match=r"full: 2 jobs, 256 of 256 slots in use; job 3 was refused"):
        _join(s, 3, 2)
    assert s.counters["joins_refused"] == 1
    # job 1 ends (both ranks LEAVE): its slots return and job 3 is admitted with them
    for r, m in enumerate(a):
        (_, leave), = m.leave()
        s.receive(leave, (1, r), 5.0)
    assert 1 not in s.jobs and s.slots_in_use == 128 and s.counters["jobs_ended"] == 1
    c = _join(s, 3, 2)
    assert c[0].done and c[0].slots == 128


def test_a_leave_from_a_stranger_changes_nothing_and_idle_jobs_expire():
    s = AggregatorService(slots=128, min_job_slots=64, max_job_slots=128, job_idle=10.0)
    a = _join(s, 1, 2, now=0.0)
    (_, forged), = a[0].leave()
    s.receive(forged, ("elsewhere", 0), 2.0)           # wrong address: not the member's LEAVE
    assert 1 in s.jobs and s.job_counters(1)["drop_not_member"] == 1
    assert s.timer() == 11.0 and s.datagrams_to_send(10.0) == [] and 1 in s.jobs
    s.datagrams_to_send(11.0)
    assert 1 not in s.jobs and s.slots_in_use == 0 and s.counters["jobs_ended"] == 1
    # the ended job's counters stay in the totals: 3 JOINs (rank 0 repeated its until rank 1 had joined)
    assert s.counters["joins"] == 3


def test_a_declared_job_outlives_a_pause_longer_than_job_idle():
    """A declared job (zerosum aggregator --job J --workers N) is the operator's: silence past job_idle
    (a long evaluation between allreduces) does not end it; a job its JOINs created does end."""
    s = AggregatorService(slots=256, min_job_slots=64, max_job_slots=128, job_idle=10.0, declared={5: 2})
    _join(s, 5, 2, now=0.0)
    _join(s, 6, 2, now=0.0)
    assert s.timer() == 11.0
    s.datagrams_to_send(100.0)
    assert set(s.jobs) == {5} and s.timer() == float("inf")


def test_datagrams_for_no_job_and_declared_world_mismatch_are_counted_drops():
    s = AggregatorService(slots=128, min_job_slots=64, declared={5: 3})
    data = P.encode(P.Header(P.DATA, 9, 0, 2, 1, 4, 4, 0))
    assert exchange(s, data, "x") == [] and s.counters["drop_foreign_job"] == 1
    assert exchange(s, b"\x01", "x") == [] and s.counters["drop_short"] == 1
    # job 5 is declared with 3 workers: a JOIN with a world of 2 is refused, naming the declaration
    with pytest.raises(ZeroSumRefused, match=r"job 5 exists there with world 3 \(no rank joined it yet\), "
                                             r"this rank has world 2"):
        _join(s, 5, 2)
    assert 5 not in s.jobs and s.counters["drop_join_world"] == 1
    assert all(m.done for m in _join(s, 5, 3))


def test_three_jobs_at_once_sum_exactly_and_never_touch_each_other():
    """Worlds 2, 3, 4 with block sizes 64, 256, 1024 through one service, interleaved with garbage,
    a lossy fourth job's traffic and a job with a dead rank; every sum bit-identical to the reference."""
    s = AggregatorService(slots=4096, min_job_slots=16, max_job_slots=64)
    rng = np.random.default_rng(3)
    specs = [(1, 2, 64), (2, 3, 256), (3, 4, 1024)]
    # job 5: rank 1 never joins (dead); its slots stay taken but nobody else is affected
    _join(s, 5, 2, ranks={0})
    garbage = [bytes(rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8)) for _ in range(50)]
    for job, world, B in specs:
        arrays = [(rng.standard_normal(B * 37 + 5) * (rng.random(B * 37 + 5) < 0.3)).astype(np.float32)
                  for _ in range(world)]
        for g in garbage[:10]:
            s.receive(g, ("noise", 0), 0.0)
        outs, _ = run(arrays, [ServiceJob(s, job)], block_size=B, loss=0.1, dup=0.1, reorder=0.3, seed=job)
        ref = reference_allreduce(arrays, B)
        assert all(o.tobytes() == ref.tobytes() for o in outs)
    assert set(s.jobs) == {1, 2, 3, 5}
    for job, world, _ in specs:
        c = s.job_counters(job)
        assert c["joins"] >= world and c["rounds"] > 0
    assert s.job_counters(5).get("rounds", 0) == 0


def test_jobs_run_concurrently_on_one_aggregator_process():
    """Real processes: jobs 1 (2 workers, blocks of 64) and 2 (3 workers, 256) at the same time on one
    aggregator started without any job declared, plus job 3 whose rank 1 dies; then job 4 runs on the
    freed slots."""
    agg = Aggregator(None, slots=256, max_job_slots=64, job_idle=2.0)
    results = {}
    try:
        def job(j, world, B, **kw):
            results[j] = run_workers(world, [agg.address], [j], 20_000, 0.3, job=j, block_size=B, **kw)
        threads = [threading.Thread(target=job, args=(1, 2, 64)), threading.Thread(target=job, args=(2, 3, 256)),
                   threading.Thread(target=job, args=(3, 2, 256), kwargs=dict(dead={1}, timeout=3.0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        check(results[1], 2, [1], 20_000, 0.3, block_size=64)
        check(results[2], 3, [2], 20_000, 0.3, block_size=256)
        status, msg, _ = results[3][0]
        assert status == "error" and "waiting for rank 1" in msg, msg
        results[4] = run_workers(2, [agg.address], [4], 20_000, 0.3, job=4, block_size=64)
        check(results[4], 2, [4], 20_000, 0.3, block_size=64)
    finally:
        counters = agg.stop()
    assert counters["jobs_started"] >= 4 and counters["jobs_ended"] >= 3


def test_stats_request_answers_totals_and_every_job():
    s = AggregatorService(slots=256, min_job_slots=64, max_job_slots=128)
    _join(s, 4, 2)
    request = P.encode(P.Header(P.STATS, 0, 0, 0))
    (dest, reply), = exchange(s, request, "asker")
    d = P.decode(bytes(reply))
    assert dest == ["asker"] and d.header.type == P.STATS
    import json
    stats = json.loads(d.body)
    assert stats["slots"] == 256 and stats["slots_in_use"] == 128
    assert stats["jobs"]["4"]["members"] == [0, 1] and stats["jobs"]["4"]["counters"]["joins"] == 3
    assert stats["counters"]["jobs_started"] == 1


def test_zerosum_stats_command_against_a_running_aggregator():
    import json
    import subprocess
    import sys
    import zerosum
    agg = Aggregator(None)
    try:
        with zerosum.Worker(0, 1, [agg.address], job=5) as w:
            w.allreduce(np.ones(1000, np.float32))
            out = subprocess.run([sys.executable, "-m", "zerosum", "stats", agg.address], capture_output=True,
                                 text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        assert stats["jobs"]["5"]["counters"]["rounds"] > 0 and stats["counters"]["jobs_started"] == 1
    finally:
        counters = agg.stop()
    assert counters["leaves"] == 1 and counters["jobs_ended"] == 1     # the worker's LEAVE ended the job
    from zerosum.udp import free_port
    out = subprocess.run([sys.executable, "-m", "zerosum", "stats", f"127.0.0.1:{free_port(2)}", "--timeout", "0.3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no answer from an aggregator" in out.stderr


def _keyed_join(service, job, rank, world, key, nonce, source):
    cfg = WorkerConfig(rank=rank, world=world, job=job, block_size=4, key=key)
    m = JoinMachine(cfg, 1, nonce, 0.0)
    (_, join), = m.datagrams_to_send(0.0)
    return m, join, [bytes(r) for _, r in exchange(service, join, source)]


def test_with_a_key_only_authenticated_fresh_joins_are_admitted():
    s = AggregatorService(slots=256, min_job_slots=64, max_job_slots=128, key=b"secret")
    # no MAC, or a MAC made with another key: dropped and counted, nothing admitted
    _, _, replies = _keyed_join(s, 1, 0, 2, None, 11, "w0")
    assert replies == [] and s.counters["drop_auth"] == 1
    _, _, replies = _keyed_join(s, 1, 0, 2, b"guess", 11, "w0")
    assert replies == [] and s.counters["drop_auth"] == 2 and 1 not in s.jobs
    # the right key: admitted; the same JOIN again (a retransmission) is answered, not a restart
    m0, join0, replies = _keyed_join(s, 1, 0, 2, b"secret", 11, "w0")
    assert len(replies) == 1 and P.decode(replies[0]).header.type == P.JOIN_ACK
    assert len(exchange(s, join0, "w0")) == 1
    _keyed_join(s, 1, 1, 2, b"secret", 12, "w1")
    assert s.job_counters(1).get("job_restarts", 0) == 0 and sorted(s.jobs[1].machine.state.members) == [0, 1]
    # rank 0 restarts (new nonce): a new run; then rank 0's old JOIN, replayed, must not restart it again
    _keyed_join(s, 1, 0, 2, b"secret", 13, "w0")
    assert s.job_counters(1)["job_restarts"] == 1
    assert exchange(s, join0, "attacker") == [] and s.counters["drop_replay"] == 1
    assert s.job_counters(1)["job_restarts"] == 1
    # DATA from an address that was never admitted never reaches a slot
    entry = P.entries_array(1)
    entry[0] = (0, 0, P.BOOT, P.END, P.NO_EXP, P.NO_EXP)
    data = P.encode(P.Header(P.DATA, 1, 1, 2, 1, 4, 4, 1), entry)
    assert exchange(s, data, "attacker") == []
    assert s.job_counters(1)["drop_not_member"] == 1 and not (s.jobs[1].machine.state.bitmap != 0).any()


def test_workers_with_the_key_work_end_to_end_and_without_it_time_out(tmp_path):
    import zerosum
    key_file = tmp_path / "key"
    key_file.write_bytes(b"s3cret\n")
    import subprocess
    import sys
    from zerosum.local import ANNOUNCE
    proc = subprocess.Popen([sys.executable, "-m", "zerosum", "aggregator", "--listen", "127.0.0.1:0",
                             "--key-file", str(key_file), "--announce"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        tag, address = proc.stdout.readline().split()
        assert tag == ANNOUNCE
        with zerosum.Worker(0, 1, [address], job=3, key="s3cret") as w:
            assert np.array_equal(w.allreduce(np.arange(300, dtype=np.int32)), np.arange(300, dtype=np.int32))
        with pytest.raises(zerosum.ZeroSumTimeout, match="no answer to JOIN"):
            with zerosum.Worker(0, 1, [address], job=4, key="wrong", timeout=0.5):
                pass
    finally:
        proc.terminate()
        proc.wait(10)


def test_soak_script_jobs_come_and_go_without_leaks():
    """experiments/soak_jobs.py, briefly: jobs start and end in a loop; no slot or job is left behind,
    every sum is exact and memory stays flat (the script's own checks; run it longer by hand)."""
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "soak_jobs.py")
    out = subprocess.run([sys.executable, script, "--seconds", "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "slots in use 0" in out.stdout and "sums exact" in out.stdout


def test_per_job_keys():
    s = AggregatorService(slots=256, min_job_slots=64, max_job_slots=128, key={1: b"one", 2: b"two"})
    assert _keyed_join(s, 1, 0, 1, b"one", 5, "a")[2] and 1 in s.jobs
    assert not _keyed_join(s, 2, 0, 1, b"one", 6, "b")[2] and 2 not in s.jobs    # job 1's key for job 2
    assert not _keyed_join(s, 3, 0, 1, b"one", 7, "c")[2] and 3 not in s.jobs    # job 3 has no key: none
    assert _keyed_join(s, 2, 0, 1, b"two", 8, "b")[2] and s.counters["drop_auth"] == 2


def test_key_file_forms(tmp_path):
    from zerosum.cli import _keys
    f = tmp_path / "k"
    f.write_bytes(b"plain secret\n")
    assert _keys(str(f)) == b"plain secret"
    f.write_text('{"1": "a", "7": "b"}')
    assert _keys(str(f)) == {1: b"a", 7: b"b"}
    for text in ("", "{\"x\": \"a\"}", "{\"1\": \"\"}"):
        f.write_text(text)
        with pytest.raises(ValueError):
            _keys(str(f))
