"""Protected by default: a conflicting JOIN fails fast with its reason (R-J6), a stray JOIN cannot hold a
job id (R-J7), keyed aggregators ignore forgeries, embedded runs are keyed, and an aggregator on an
address other than loopback refuses to run open (protected mode)."""
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import zerosum
from netsim import ServiceJob, run
from procs import Aggregator, run_workers
from test_end_to_end import check
from zerosum import protocol as P
from zerosum.aggregator_service import AggregatorService
from zerosum.errors import ZeroSumRefused
from zerosum.local import new_key
from zerosum.reference import reference_allreduce
from zerosum.udp import parse_address


def forged_join(job, rank, world, block_size=256, nonce=7, key=None) -> bytes:
    join = P.encode(P.Header(P.JOIN, job, rank, world, nonce, 0, block_size))
    return join + P.join_mac(key, join) if key is not None else join


def spray(address: str, datagrams) -> None:
    host, port = parse_address(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for d in datagrams:
            s.sendto(d, (host, port))
    time.sleep(0.2)       # taken by the aggregator before anyone else's JOIN


def test_a_squatted_job_id_fails_its_real_ranks_at_once_naming_the_conflict():
    """No key: one forged JOIN creates job 13 with world 3; the real job's ranks (world 2) are refused
    at once with the job's world and block size, not after their 30 s JOIN timeout."""
    agg = Aggregator(None)
    try:
        spray(agg.address, [forged_join(13, 0, 3)])
        t0 = time.monotonic()
        with pytest.raises(ZeroSumRefused, match=r"job 13 exists there with world 3 and block size 256, "
                                                 r"this rank has world 2"):
            with zerosum.Worker(0, 2, [agg.address], job=13, timeout=30.0):
                pass
        assert time.monotonic() - t0 < 5.0      # an answer, not the timeout
    finally:
        counters = agg.stop()
    assert counters["drop_join_world"] == 1 and counters["jobs_started"] == 1


def test_with_a_key_forged_joins_go_unnoticed_and_are_counted():
    key = new_key()
    agg = Aggregator(None, key=key)
    try:
        spray(agg.address, [forged_join(13, 0, 3),                    # no MAC
                            forged_join(13, 0, 2, key=b"a guess"),    # a MAC with another key
                            forged_join(13, 1, 2, key=b"a guess", block_size=64)])
        results = run_workers(2, [agg.address], [1, 2], 20_000, 0.3, job=13, key=key)
        check(results, 2, [1, 2], 20_000, 0.3)
    finally:
        counters = agg.stop()
    assert counters["drop_auth"] == 3 and counters["jobs_started"] == 1 and "drop_join_world" not in counters


def test_a_stray_join_holds_a_job_id_only_until_the_join_timeout():
    s = AggregatorService(slots=256, min_job_slots=64, max_job_slots=128, join_timeout=5.0)
    s.receive(forged_join(13, 0, 3, block_size=4), ("stray", 1), 0.0)
    assert 13 in s.jobs and s.timer() == 5.0
    s.datagrams_to_send(4.9)
    assert 13 in s.jobs
    s.datagrams_to_send(5.0)
    assert 13 not in s.jobs and s.slots_in_use == 0 and s.counters["jobs_join_timeout"] == 1
    # the id is free again: the real job (world 2) runs; once all its ranks joined, the deadline is gone
    arrays = [np.arange(40, dtype=np.float32) * (r + 1) for r in range(2)]
    outs, _ = run(arrays, [ServiceJob(s, 13, start=6.0)], block_size=4)
    assert all(o.tobytes() == reference_allreduce(arrays, 4).tobytes() for o in outs)
    assert s.timer() == float("inf")
    s.datagrams_to_send(1e9)
    assert 13 in s.jobs and s.counters["jobs_join_timeout"] == 1


@pytest.mark.parametrize("keyed", [False, True])
def test_forged_joins_during_a_job_change_nothing_of_it(keyed):
    """While job 1 (world 2, block 4) runs, a stranger sends JOINs that disagree in every field (world,
    block size, rank, job) and a stranger's DATA for the job: the sums stay exact; each forgery is
    refused or dropped and counted by its reason (with a key: all as drop_auth, before any job rule)."""
    key = b"k" if keyed else None
    s = AggregatorService(slots=256, min_job_slots=64, max_job_slots=128, key=key)
    stranger = ("mallory", 9)
    entry = P.entries_array(1)
    entry[0] = (0, 0, P.BOOT, P.END, P.NO_EXP, P.NO_EXP)
    forgeries = [forged_join(1, 0, 3, block_size=4), forged_join(1, 1, 2, block_size=8),
                 forged_join(1, 5, 2, block_size=4), forged_join(1, 0, 2, block_size=4, nonce=9999)[:-1],
                 P.encode(P.Header(P.DATA, 1, 1, 2, 1, 4, 4, 1), entry)]
    answers, sent, steps = [], [], []

    def meddle(machines):      # one forgery a step of the simulation, once the job runs
        steps.append(1)
        if len(steps) > 1 and len(sent) < len(forgeries):
            d = forgeries[len(sent)]
            sent.append(d)
            s.receive(d, stranger, 0.0)
            answers.extend(dests for dests, _ in s.datagrams_to_send(0.0, results=False) if dests == [stranger])

    arrays = [np.arange(1, 4001, dtype=np.float32) * (r + 1) for r in range(2)]
    if keyed:
        # the job's own ranks JOIN with the key (netsim's JoinMachines carry none): admit them first
        for r in range(2):
            s.receive(forged_join(1, r, 2, block_size=4, nonce=100 + r, key=key), (1, r), 0.0)
        s.datagrams_to_send(0.0)
    outs, _ = run(arrays, [ServiceJob(s, 1)], block_size=4, check=meddle,
                  slots=s.jobs[1].slots if keyed else None)
    assert len(sent) == len(forgeries)
    assert all(o.tobytes() == reference_allreduce(arrays, 4).tobytes() for o in outs)
    c = s.counters
    if keyed:
        assert (c["drop_auth"], c["drop_short"], c["drop_not_member"]) == (3, 1, 1) and answers == []
        assert "drop_join_world" not in c and "job_restarts" not in c
    else:
        # world 3 and block size 8: refused (two answers); rank 5: dropped; the JOIN cut short: drop_short
        assert (c["drop_join_world"], c["drop_join_block_size"], c["drop_short"], c["drop_not_member"]) == \
            (2, 1, 1, 1)
        assert len(answers) == 2


def test_protected_mode_refuses_to_run_open_off_loopback():
    out = subprocess.run([sys.executable, "-m", "zerosum", "aggregator", "--listen", "0.0.0.0:0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "without a key" in out.stderr and "--key-file" in out.stderr and "--insecure" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    proc = subprocess.Popen([sys.executable, "-m", "zerosum", "aggregator", "--listen", "0.0.0.0:0", "--insecure",
                             "--announce"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("zerosum-aggregator-listening 0.0.0.0:")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "running open on 0.0.0.0 (--insecure)" in err


def test_a_port_alone_is_a_port():
    assert parse_address("48992") == ("0.0.0.0", 48992)
    assert parse_address(":48992") == ("0.0.0.0", 48992)
    assert parse_address("127.0.0.1") == ("127.0.0.1", P.DEFAULT_PORT)


def test_an_embedded_aggregator_admits_only_its_own_ranks():
    """worker_from_env (the torch backend and the DDP hook) starts the local aggregator with a fresh key
    and hands it to the ranks through the store; a JOIN without it is dropped."""
    pytest.importorskip("torch")
    import torch.distributed as dist
    from zerosum.torch import worker_from_env
    store = dist.HashStore()
    worker, local = worker_from_env(store, 0, 1)
    try:
        key = store.get("zerosum/key").decode()
        assert len(key) == 64 and local.key == key
        x = np.arange(1000, dtype=np.float32)
        assert np.array_equal(worker.allreduce(x), x)
        spray(local.address, [forged_join(worker.job, 0, 1)])
    finally:
        worker.close()
        counters = local.stop()
    assert counters["drop_auth"] == 1 and counters["joins"] == 1


def test_a_ranks_own_join_replayed_from_elsewhere_does_not_move_the_rank():
    """R-J4: with a key, a rank's current JOIN (seen on the wire) sent from another address is dropped as
    a replay; without that rule its JOIN_ACK would re-register the rank at the attacker's address."""
    s = AggregatorService(slots=256, min_job_slots=64, max_job_slots=128, key=b"k")
    joins = [forged_join(1, r, 2, block_size=4, nonce=100 + r, key=b"k") for r in range(2)]
    for r, j in enumerate(joins):
        s.receive(j, ("w", r), 0.0)
    assert len(s.datagrams_to_send(0.0)) == 2
    s.receive(joins[0], ("mallory", 1), 1.0)
    assert s.datagrams_to_send(1.0) == [] and s.counters["drop_replay"] == 1
    assert s.jobs[1].machine.state.members[0].address == ("w", 0)
    s.receive(joins[0], ("w", 0), 2.0)               # the rank's own retransmission: answered
    (dest, _), = s.datagrams_to_send(2.0)
    assert dest == [("w", 0)]


def test_an_empty_datagram_is_a_counted_drop():
    agg = Aggregator(None)
    try:
        spray(agg.address, [b"", b"", b"\x01"])
    finally:
        counters = agg.stop()
    assert counters["drop_short"] == 3


def test_soak_script_three_keyed_jobs_under_forgery():
    """experiments/soak_forgery.py, briefly: three keyed jobs stay exact while a stranger sprays garbage,
    squatting JOINs, replays and foreign DATA, each counted by its reason (the script's own checks;
    run it for 10 minutes by hand)."""
    import os
    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "soak_forgery.py")
    out = subprocess.run([sys.executable, script, "--seconds", "6", "--rate", "1000"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every job exact, every forgery counted" in out.stdout
