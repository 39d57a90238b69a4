"""One aggregator, many jobs: admission and slot quotas around the per-job state machines (no I/O).

A job comes into being with its workers' first JOIN (job id, world size, block size), or is declared up
front with its world size (then JOINs must match it). Each job gets a quota of the aggregator's slot
pool when it is admitted: its fair share of the pool (the pool divided by the jobs served, this one
included), at least `min_job_slots` and at most `max_job_slots`, taken from the slots still free. A JOIN
that cannot be admitted (`max_jobs` served, or fewer than `min_job_slots` free) is answered with REFUSED,
which the workers raise as an error ("aggregator full: N jobs, M slots in use"), not a timeout. A job
ends, and its slots return to the pool, when all its ranks have sent LEAVE or (unless it was declared)
when it has been silent for `job_idle` seconds or its ranks have not all joined within `join_timeout`
seconds of its first JOIN (R-J7: a stray JOIN cannot hold a job id; ended by `datagrams_to_send(now)`
once `now` reaches `timer()`, and logged). A JOIN whose world or block size disagrees with its job's is
answered with REFUSED naming the job's (R-J6), so that its worker fails at once with the reason. A job's
state is its own AggregatorMachine, so one job's traffic (loss, garbage, a dead rank, a JOIN storm) never
touches another job's slots.

Admission: with a `key`, a JOIN must carry HMAC-SHA256(key, its header) (else drop_auth), and a nonce
this rank has not used before unless it is the current one (else drop_replay), so nobody without the
key can join as a rank or restart a job with a replayed JOIN. DATA is not authenticated (a switch
could not check it per packet); it stays bound to the admitted rank's address and port.
A STATS request (from any address: the counters are not secret) is answered with `stats()` as JSON.
Counters: per job (`job_counters(job)`), and in all (`counters`), which add the ended jobs' counts and
the service's own: jobs_started, jobs_ended, joins_refused, and the drops before a job is known: the
stateless rules (R-V1 ... R-V5: drop_short, drop_version, drop_type, drop_length, drop_flags,
drop_range, drop_exponent), admission (R-V6: drop_auth, drop_replay), datagrams for no job
(drop_foreign_job) and JOINs whose world disagrees with their job's declaration (drop_join_world).
The rules are checked in the order of docs/protocol.md, "Validation", as the switch checks them.

The driver interface is AggregatorMachine's: `receive(datagram, source, now)`, `datagrams_to_send(now)`,
`timer()`.
"""
from __future__ import annotations

import collections
import hmac
import json
import logging
from dataclasses import dataclass

import numpy as np

from . import protocol as P
from .aggregator_machine import COUNTERS, AggregatorMachine

# a job's traffic that its machine accepted (keeps the job from expiring)
_DATAGRAMS, _JOINS, _LEAVES = (COUNTERS.index(name) for name in ("datagrams", "joins", "leaves"))
MAX_JOB_SLOTS = 2048  # the most slots one job gets, by default (zerosum aggregator --max-job-slots)
REPLAY_WINDOW = 64    # nonces remembered per (job, rank) when JOINs are authenticated
log = logging.getLogger("zerosum.aggregator")


@dataclass
class Job:
    machine: AggregatorMachine
    slots: int
    last_heard: float
    join_deadline: float    # R-J7: all ranks joined by then, or the job ends (inf: joined, or declared)


class AggregatorService:
    def __init__(self, slots: int = 8192, *, max_jobs: int = 16, min_job_slots: int = 64,
                 max_job_slots: int = MAX_JOB_SLOTS, job_idle: float = 0.0, join_timeout: float = 30.0,
                 declared: dict[int, int] | None = None,
                 max_block_size: int = 4096, max_datagram: int = P.MAX_DATAGRAM,
                 key: bytes | dict[int, bytes] | None = None, multicast: tuple | None = None):
        """key: one secret for every job, or {job: secret} (jobs without one are then not admitted).
        multicast: (group, port) that every job's results go to (AggregatorMachine).
        join_timeout: a job its JOINs created ends unless all its ranks joined within this many seconds
        (R-J7; 0: never)."""
        self.multicast = multicast
        if not 1 <= min_job_slots <= max_job_slots <= 0xFFFF:
            raise ValueError(f"need 1 <= min_job_slots <= max_job_slots <= 65535, got {min_job_slots} "
                             f"and {max_job_slots}")
        if slots < min_job_slots:
            raise ValueError(f"a pool of {slots} slots cannot hold one job of at least {min_job_slots}")
        self.slots, self.max_jobs, self.job_idle, self.join_timeout = slots, max_jobs, job_idle, join_timeout
        self.min_job_slots, self.max_job_slots = min_job_slots, max_job_slots
        self.declared = dict(declared or {})
        for job, world in self.declared.items():
            if not 0 <= job <= 0xFFFF or not 1 <= world <= P.MAX_WORLD:
                raise ValueError(f"job {job} with {world} workers: job ids are 0..65535, worlds 1..{P.MAX_WORLD}")
        self.max_block_size, self.max_datagram = max_block_size, max_datagram
        self.key = key
        self._nonces: dict[tuple[int, int], collections.deque] = {}   # (job, rank) -> nonces seen
        self.jobs: dict[int, Job] = {}
        self._ended = np.zeros(len(COUNTERS), np.int64)     # counters of the jobs that ended
        self.service_counters = collections.Counter()
        self._drops = collections.Counter()   # counted before a job is known (R-V1 ... R-V7), send_errors
        self._outbox: list[tuple[list, bytes]] = []   # the service's own replies (STATS, REFUSED)

    def count(self, name: str, n: int = 1) -> None:
        """Count an event of the transport's (send_errors)."""
        self._drops[name] += n

    # -- queries ------------------------------------------------------------------------------------
    @property
    def slots_in_use(self) -> int:
        return sum(j.slots for j in self.jobs.values())

    @property
    def has_output(self) -> bool:
        """Whether `datagrams_to_send` has something to send now."""
        return bool(self._outbox) or any(j.machine.has_output for j in self.jobs.values())

    def job_counters(self, job: int) -> dict[str, int]:
        return dict(self.jobs[job].machine.counters) if job in self.jobs else {}

    @property
    def counters(self) -> dict[str, int]:
        total = self._ended.copy()
        for j in self.jobs.values():
            total += j.machine.counters.array
        out = {name: int(v) for name, v in zip(COUNTERS, total.tolist()) if v}
        for name, v in (*self._drops.items(), *self.service_counters.items()):
            if v:
                out[name] = out.get(name, 0) + v
        return {name: out[name] for name in COUNTERS if name in out}

    def stats(self) -> dict:
        """Everything a `zerosum stats` request shows: totals, the pool, and each job's counters."""
        return {"slots": self.slots, "slots_in_use": self.slots_in_use, "counters": self.counters,
                "jobs": {str(job): {"world": j.machine.state.world, "slots": j.slots,
                                    "members": sorted(j.machine.state.members),
                                    "counters": dict(j.machine.counters)} for job, j in self.jobs.items()}}

    # -- events -------------------------------------------------------------------------------------
    def receive(self, datagram, source, now: float, ce: bool = False) -> None:
        """One datagram, validated in the order of docs/protocol.md "Validation" (R-V1 ... R-V10): the
        stateless rules and admission here, once for all jobs, the rest by the job's machine (`ce`: it
        arrived marked Congestion Experienced, R-E1)."""
        reason, fields = P.check(datagram, P.AGGREGATOR_TAKES)     # R-V1 ... R-V5
        if reason:
            self._drops[reason] += 1
            return
        _, ptype, job_id, rank, world, nonce, _, block_size, _ = fields
        if ptype == P.STATS:      # a request: the counters, to the asker alone
            body = json.dumps(self.stats(), separators=(",", ":")).encode()[: P.MAX_DATAGRAM - P.PACKET_HEADER_SIZE]
            self._outbox.append(([source], P.encode(P.Header(P.STATS, 0, P.AGGREGATOR_RANK, 0), body=body)))
            return
        if ptype == P.JOIN and self.key is not None and not self._admissible(datagram, job_id, rank, nonce):
            return                                                  # R-V6
        job = self.jobs.get(job_id)
        if job is None:                                             # R-V7
            if ptype != P.JOIN:
                self._drops["drop_foreign_job"] += 1
                return
            job, refusal = self._admit(job_id, world, block_size, now)
            if job is None:
                if refusal is not None:
                    self._outbox.append(([source], refusal))
                return
        counts = job.machine.counters.array
        accepted = counts[_DATAGRAMS] + counts[_JOINS] + counts[_LEAVES]   # scalars: a hot path
        job.machine.receive_checked(datagram, fields, source, ce)
        if counts[_DATAGRAMS] + counts[_JOINS] + counts[_LEAVES] != accepted:
            job.last_heard = now      # only a member's traffic keeps a job alive, not drops
            if ptype == P.JOIN and job.machine.state.joined_bitmap == (1 << job.machine.state.world) - 1:
                job.join_deadline = float("inf")                    # R-J7: every rank joined
        if ptype == P.LEAVE and job.machine.idle:
            self._end(job_id, now)

    def datagrams_to_send(self, now: float, *, results: bool = True) -> list[tuple[list, bytes]]:
        """End the jobs silent for job_idle seconds, then everything to send: the service's replies and
        each job's (AggregatorMachine.datagrams_to_send, `results` as there)."""
        if now >= self.timer():
            self._expire(now)
        out, self._outbox = self._outbox, []
        for job in self.jobs.values():
            out += job.machine.datagrams_to_send(now, results=results)
        return out

    def timer(self) -> float:
        """When `datagrams_to_send` next has work without a datagram: the next idle job's expiry or
        join deadline (inf without either)."""
        return min((self._ends_at(job, j) for job, j in self.jobs.items()), default=float("inf"))

    def _ends_at(self, job_id: int, job: Job) -> float:
        if job_id in self.declared:
            return float("inf")
        return min(job.last_heard + self.job_idle if self.job_idle else float("inf"), job.join_deadline)

    def _expire(self, now: float) -> None:
        """End the jobs silent for job_idle seconds (a dead job's slots return to the pool) and those
        whose ranks did not all join in time (R-J7)."""
        # A declared job is the operator's (like a switch's configured job): a pause in training longer
        # than job_idle must not end it under its live workers; it ends when all its ranks LEAVE.
        gone = [(job, j) for job, j in self.jobs.items() if now >= self._ends_at(job, j)]
        for job, j in gone:
            self._end(job, now)
            if now >= j.join_deadline:
                self.service_counters["jobs_join_timeout"] += 1
                log.info("job %d ended: ranks %s of %d did not join within %.1f s", job,
                         _ranks(~j.machine.state.joined_bitmap, j.machine.state.world),
                         j.machine.state.world, self.join_timeout)
            else:
                log.info("job %d ended: idle for %.1f s", job, self.job_idle)

    # -- admission ----------------------------------------------------------------------------------
    def _admissible(self, datagram, job_id: int, rank: int, nonce: int) -> bool:
        """With a key: the JOIN's HMAC must be right, and its nonce not one this rank used before
        (a replayed JOIN of an earlier run must not restart the job)."""
        raw = bytes(datagram)
        mac = raw[P.PACKET_HEADER_SIZE:]
        key = self.key.get(job_id) if isinstance(self.key, dict) else self.key
        if key is None or len(mac) != P.JOIN_MAC_SIZE or not hmac.compare_digest(mac, P.join_mac(key, raw)):
            self._drops["drop_auth"] += 1
            return False
        seen = self._nonces.setdefault((job_id, rank), collections.deque(maxlen=REPLAY_WINDOW))
        job = self.jobs.get(job_id)
        member = job.machine.state.members.get(rank) if job is not None else None
        if nonce in seen and (member is None or member.nonce != nonce):
            self._drops["drop_replay"] += 1
            return False
        if nonce not in seen:
            seen.append(nonce)
        return True

    def _admit(self, job_id: int, world: int, block_size: int, now: float):
        """A new job's machine, or (None, REFUSED datagram) when it cannot be served."""
        declared = self.declared.get(job_id)
        if not 1 <= world <= P.MAX_WORLD:
            self._drops["drop_join_world"] += 1
            return None, None
        if declared is not None and world != declared:
            self._drops["drop_join_world"] += 1                     # R-J6: refused, naming the declaration
            return None, P.refused(job_id, declared, 0, P.REFUSED_CONFLICT)
        free = self.slots - self.slots_in_use
        share = self.slots // (len(self.jobs) + 1)
        quota = min(free, self.max_job_slots, max(self.min_job_slots, share))
        if len(self.jobs) >= self.max_jobs or quota < self.min_job_slots:
            self.service_counters["joins_refused"] += 1            # R-J6
            return None, P.refused(job_id, world, block_size, P.REFUSED_FULL, len(self.jobs),
                                   self.slots_in_use, self.slots)
        machine = AggregatorMachine(job_id, world, slots=quota, max_block_size=self.max_block_size,
                                    max_datagram=self.max_datagram, multicast=self.multicast)
        deadline = now + self.join_timeout if self.join_timeout and declared is None else float("inf")
        self.jobs[job_id] = Job(machine, quota, now, deadline)
        self.service_counters["jobs_started"] += 1
        return self.jobs[job_id], None

    def _end(self, job_id: int, now: float) -> None:
        job = self.jobs.pop(job_id)
        self._outbox += job.machine.datagrams_to_send(now)     # what it still had to say
        self._ended += job.machine.counters.array
        self.service_counters["jobs_ended"] += 1


def _ranks(bitmap: int, world: int) -> str:
    return ", ".join(str(r) for r in range(world) if bitmap >> r & 1)
