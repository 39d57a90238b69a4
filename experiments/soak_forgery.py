"""Soak: three keyed jobs on one aggregator process while a stranger sprays garbage and forgeries at it.

The aggregator (`zerosum aggregator --key-file`, on loopback) serves jobs 1, 2 and 3 (2 workers each),
which run allreduces of fresh sparse tensors back to back and check every result against the fixed-point
reference. Meanwhile a stranger, from its own socket, sends a mix of:
  garbage      random bytes of random length
  shaped       a valid header with random fields (what a fuzzer that read the spec sends)
  join_nomac   JOINs for the jobs' ids (and others) without a MAC: squatting, in every field
  join_badmac  the same with a MAC made with a wrong key
  replay       the real ranks' own JOINs (as an on-path attacker saw them), from the stranger's address
  data         DATA for the running jobs, as one of their ranks, from the stranger's address
Each one's expected drop reason is computed beforehand (protocol.check for the stateless rules, then
the admission rules), and at the end the aggregator's counters must hold exactly that many of each
reason, less what the kernel dropped for a full receive buffer (Udp RcvbufErrors). The aggregator's
resident memory is sampled: after warm-up it must not grow by more than --max-growth.

    python experiments/soak_forgery.py --seconds 600
"""
from __future__ import annotations

import argparse
import collections
import random
import socket
import sys
import threading
import time

import numpy as np

from zerosum import protocol as P
from zerosum.aggregator import request_stats
from zerosum.local import CTX, LocalAggregator, memory, new_key
from zerosum.reference import reference_allreduce
from zerosum.udp import parse_address

JOBS = (1, 2, 3)
WORLD = 2
SIZE = 40_000
BLOCK = 256


def tensor(job: int, rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng([job, rank, step])
    x = rng.standard_normal(SIZE).astype(np.float32)
    x[~np.repeat(rng.random(-(-SIZE // BLOCK)) < 0.3, BLOCK)[:SIZE]] = 0
    return x


def join_of(job: int, rank: int, nonce: int, key: str) -> bytes:
    """A rank's JOIN, as an on-path attacker sees it go by."""
    join = P.encode(P.Header(P.JOIN, job, rank, WORLD, nonce, 0, BLOCK))
    return join + P.join_mac(key.encode(), join)


def worker(job: int, rank: int, address: str, key: str, nonce: int, seconds: float, joined, out) -> None:
    """One rank (its JOIN nonce given, so that the stranger can replay its JOIN): allreduces until
    `seconds` are up, every result checked; reports when it joined, then (steps, wrong sums)."""
    import zerosum
    import zerosum.worker
    zerosum.worker.new_nonce = lambda: nonce
    try:
        with zerosum.Worker(rank, WORLD, [address], job=job, block_size=BLOCK, key=key, timeout=60.0) as w:
            joined.put((job, rank))
            steps = wrong = 0
            end = time.monotonic() + seconds
            while True:
                stop = np.array([time.monotonic() > end], np.int32)
                if w.allreduce(stop)[0]:          # every rank stops after the same step
                    break
                got = w.allreduce(tensor(job, rank, steps))
                ref = reference_allreduce([tensor(job, r, steps) for r in range(WORLD)], BLOCK)
                wrong += got.tobytes() != ref.tobytes()
                steps += 1
        out.put((job, rank, steps, wrong, None))
    except Exception as e:     # reported by the soak
        out.put((job, rank, 0, 0, f"{type(e).__name__}: {e}"))


class Stranger:
    """Sprays forgeries, each with the counter the aggregator must add for it."""

    def __init__(self, address: str, seed: int):
        self.target = parse_address(address)
        self.rng = random.Random(seed)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sent = collections.Counter()       # kind -> datagrams
        self.expected = collections.Counter()   # counter -> datagrams
        self.replays: list[bytes] = []

    def header(self, ptype, job, rank=0, world=WORLD, epoch=None, blocks=0, block_size=BLOCK, entries=0):
        epoch = self.rng.getrandbits(32) if epoch is None else epoch
        return P.encode(P.Header(ptype, job, rank, world, epoch, blocks, block_size, entries))

    def one(self) -> None:
        r = self.rng
        kind = r.choice(["garbage", "shaped", "join_nomac", "join_badmac", "data"]
                        + (["replay"] if self.replays else []))
        job = r.choice(JOBS + (r.randrange(0x10000),))
        if kind == "garbage":
            d = r.randbytes(r.randrange(0, 300))
        elif kind == "shaped":
            d = P.HEADER.pack(P.VERSION, r.randrange(256), job, r.randrange(0x10000), r.randrange(0x10000),
                              r.getrandbits(32), r.getrandbits(32), r.randrange(0x10000), r.randrange(4))
            d += r.randbytes(r.choice([0, 16, 32, 48, 1040]))
        elif kind in ("join_nomac", "join_badmac"):
            d = self.header(P.JOIN, job, r.randrange(4), r.choice([WORLD, 3, 4]),
                            block_size=r.choice([BLOCK, 64]))
            if kind == "join_badmac":
                d += P.join_mac(b"not the key", d)
        elif kind == "replay":
            d = r.choice(self.replays)
        else:
            entry = P.entries_array(1)
            entry[0] = (r.randrange(64), 0, P.BOOT, P.END, P.NO_EXP, P.NO_EXP)
            d = P.encode(P.Header(P.DATA, r.choice(JOBS), r.randrange(WORLD), WORLD, r.randrange(1, 100),
                                  SIZE // BLOCK + 1, BLOCK, 1), entry)
        self.expected[self.reason(d)] += 1
        self.sent[kind] += 1
        self.sock.sendto(d, self.target)

    def reason(self, d: bytes) -> str:
        """The counter the aggregator adds for `d` from this stranger (docs/protocol.md, "Validation")."""
        reason, fields = P.check(d, P.AGGREGATOR_TAKES)
        if reason:
            return reason
        ptype, job = fields[1], fields[2]
        if ptype == P.STATS:
            return "answered"           # a STATS request: answered, not a drop
        if ptype == P.JOIN:
            if d in self.replays:
                return "drop_replay"    # a ranks's current JOIN from another address
            return "drop_auth"          # no MAC, or a wrong one
        return "drop_not_member" if job in JOBS else "drop_foreign_job"     # DATA or LEAVE of a stranger


def rcvbuf_errors() -> int:
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Udp:")]
    return int(rows[1][rows[0].index("RcvbufErrors")])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--rate", type=float, default=2000.0, help="forged datagrams per second")
    ap.add_argument("--max-growth", type=float, default=0.2, help="allowed RSS growth after warm-up (0.2 = 20 %%)")
    args = ap.parse_args(argv)
    key = new_key()
    agg = LocalAggregator(None, key=key, job_idle=0)
    joined, out = CTX.Queue(), CTX.Queue()
    nonces = {(job, rank): random.getrandbits(32) for job in JOBS for rank in range(WORLD)}
    procs = [CTX.Process(target=worker, args=(job, rank, agg.address, key, nonce, args.seconds, joined, out),
                         daemon=True) for (job, rank), nonce in nonces.items()]
    for p in procs:
        p.start()
    for _ in procs:
        joined.get(timeout=120)
    stranger = Stranger(agg.address, seed=1)
    stranger.replays = [join_of(job, rank, nonce, key) for (job, rank), nonce in nonces.items()]
    kernel_drops = rcvbuf_errors()
    samples, stop = [], threading.Event()

    def sample():
        while not stop.wait(2.0):
            samples.append(memory("VmRSS", agg.proc.pid) // 1024)
    threading.Thread(target=sample, daemon=True).start()
    start = time.monotonic()
    reports = []
    while len(reports) < len(procs):
        # forgeries while every job runs (the workers stop after `seconds` from their start, later)
        if time.monotonic() - start < args.seconds - 1.0 and not reports:
            for _ in range(max(1, int(args.rate / 100))):
                stranger.one()
        time.sleep(0.01)
        while not out.empty():
            reports.append(out.get())
        if time.monotonic() - start > args.seconds + 120:
            break
    time.sleep(0.5)
    stop.set()
    kernel_drops = rcvbuf_errors() - kernel_drops
    stats = request_stats(agg.address, 5.0)["counters"]
    counters = agg.stop()
    for p in procs:
        p.join(10)
    ok = True
    print(f"{time.monotonic() - start:.0f} s, {sum(stranger.sent.values())} forged datagrams "
          f"({', '.join(f'{k} {v}' for k, v in sorted(stranger.sent.items()))}); kernel drops {kernel_drops}")
    for job, rank, steps, wrong, error in sorted(reports):
        print(f"job {job} rank {rank}: {steps} allreduces, {wrong} wrong" + (f", FAILED: {error}" if error else ""))
        ok &= error is None and wrong == 0 and steps > 0
    ok &= len(reports) == len(procs)
    short = 0
    for reason, n in sorted(stranger.expected.items()):
        if reason == "answered":
            continue
        got = stats.get(reason, 0)
        print(f"  {reason}: expected {n}, counted {got}")
        short += n - got
    if not 0 <= short <= kernel_drops:
        print(f"counted {short} fewer than sent, but the kernel dropped {kernel_drops}")
        ok = False
    base = samples[min(2, len(samples) - 1)] if samples else 0
    growth = (max(samples[2:] or samples) - base) / base if base else 0.0
    print(f"aggregator RSS {base / 1024:.1f} -> {samples[-1] / 1024 if samples else 0:.1f} MiB "
          f"(max growth {growth:+.1%}); jobs ended {counters.get('jobs_ended', 0)}")
    ok &= growth <= args.max_growth
    print("soak: " + ("every job exact, every forgery counted" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
