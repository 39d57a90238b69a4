"""An in-memory network that drives the pure state machines: loss, duplication and reordering."""
from __future__ import annotations

import random

import numpy as np

from zerosum.aggregator_machine import AggregatorMachine, new_nonce
from zerosum.blocks import BlockSource, DenseResult
from zerosum.layout import Layout
from zerosum import protocol as P
from zerosum.worker_machine import AllreduceMachine, JoinMachine, WorkerConfig


def join_all(aggs: list[AggregatorMachine], world: int, block_size: int) -> int:
    """Register every rank with every aggregator through the workers' JoinMachines (each rank's JOIN
    once, in rank order, then once more so that every rank sees the full bitmap); return the slots
    granted (the minimum)."""
    joins = [JoinMachine(WorkerConfig(rank=r, world=world, job=aggs[0].state.job, block_size=block_size),
                         len(aggs), new_nonce(), 0.0) for r in range(world)]
    for now in (0.0, 1.0):
        for r, m in enumerate(joins):
            for a, join in m.datagrams_to_send(now):
                aggs[a].receive(join, ("w", r), now)
                for dests, ack in aggs[a].datagrams_to_send(now):
                    m.receive(a, bytes(ack), now)
    assert all(m.done for m in joins)
    return joins[0].slots


class ServiceJob:
    """One job of an AggregatorService as `run` drives an aggregator machine: sources are (job, rank),
    and the service's clock is the simulation's shifted by `start`."""

    def __init__(self, service, job: int, start: float = 0.0):
        self.service, self.job, self.start = service, job, start
        self.state = type("State", (), {"job": job})()

    def receive(self, data, source, now: float) -> None:
        self.service.receive(data, (self.job, source[1]), self.start + now)

    def datagrams_to_send(self, now: float) -> list:
        out = self.service.datagrams_to_send(self.start + now)
        return [(dests, d) for dests, d in out if dests[0][0] == self.job]

    def timer(self) -> float:
        return self.service.timer() - self.start


def run(arrays, aggs, *, block_size=256, epoch=1, loss=0.0, dup=0.0, reorder=0.0, seed=0,
        max_datagram=P.MAX_DATAGRAM, max_steps=1_000_000, slots=None, max_entries=0xFFFF, batch=0.5,
        column_order=None, window=None, congestion=True, check=None):
    """Run one allreduce of `arrays` (one per rank) through `aggs`; return each rank's output.
    `batch`: the chance that a worker takes one more of its queued datagrams in the same receive_many.
    `column_order(aggregators, slots, nblocks)`: the column order every worker uses (default: striping).
    `window`: the workers' window in bytes (WorkerConfig.window), one for all or a list per rank;
    `congestion`: WorkerConfig.congestion (False: a number is the fixed window).
    `check(machines)`: called after every step (e.g. to assert an invariant)."""
    rng = random.Random(seed)
    world = len(arrays)
    granted = join_all(aggs, world, block_size) if slots is None else slots
    machines = []
    for r, x in enumerate(arrays):
        source = BlockSource.dense(np.ascontiguousarray(x).reshape(-1), block_size)
        layout = Layout(len(aggs), granted, source.nblocks,
                        None if column_order is None else column_order(len(aggs), granted, source.nblocks))
        cfg = WorkerConfig(rank=r, world=world, job=aggs[0].state.job, max_datagram=max_datagram,
                           max_entries=max_entries, timeout=1e9, block_size=block_size,
                           window=window[r] if isinstance(window, (list, tuple)) else window,
                           congestion=congestion)
        out = DenseResult(np.zeros(x.size, x.dtype))
        machines.append(AllreduceMachine(cfg, epoch, source, layout, out))
    now = 0.0
    queue = []  # (destination kind, index, from, bytes)

    def post(kind, idx, src, data):
        if rng.random() < loss:
            return
        data = bytes(data)    # the machines' datagrams are views into their buffers, valid until the next call
        queue.append((kind, idx, src, data))
        if rng.random() < dup:
            queue.append((kind, idx, src, data))

    for r, m in enumerate(machines):
        for a, data in m.start(now):
            post("agg", a, r, data)
    steps = 0
    while not all(m.done for m in machines):
        if check is not None:
            check(machines)
        steps += 1
        if steps >= max_steps:
            m = next(m for m in machines if not m.done)
            pend = np.flatnonzero(m.round_block != P.END)
            raise AssertionError(f"simulation did not converge: now={now} queue={len(queue)} "
                                 f"pending={pend[:5]} deadline={m.deadline[pend[:5]]} heard={m.last_heard} "
                                 f"rto={m.base_rto} ready={m.ready[pend[:5]]} at={m.timer()}")
        if not queue:
            flushed = False
            for r, m in enumerate(machines):
                for a, data in m.flush(now):
                    post("agg", a, r, data)
                    flushed = True
            if flushed:
                continue
            # the clock never goes back: a timer already due (a loss judged at once, R-C4) fires now
            now = max(now, min(m.timer() for m in machines if not m.done))
            for r, m in enumerate(machines):
                for a, data in m.poll(now):
                    post("agg", a, r, data)
            continue
        i = rng.randrange(len(queue)) if rng.random() < reorder else 0
        kind, idx, src, data = queue.pop(i)
        if kind == "agg":
            aggs[idx].receive(data, ("w", src), now)
            # send at once or let results pile up, as a busy aggregator would
            out = (aggs[idx].datagrams_to_send(now)
                   if rng.random() < 0.7 or not any(q[0] == "agg" and q[1] == idx for q in queue) else [])
            for dests, reply in out:
                for _, r in dests:
                    post("worker", r, idx, reply)
        else:
            # a worker that drains its socket takes several queued datagrams at once
            taken = [(src, data)]
            while len(taken) < 16 and rng.random() < batch:
                j = next((j for j, q in enumerate(queue) if q[0] == "worker" and q[1] == idx), None)
                if j is None:
                    break
                taken.append(queue.pop(j)[2:])
            machines[idx].receive_many(taken, now)
            # flush at once or let results pile up, as a busy worker would
            if rng.random() < 0.7 or not any(q[0] == "worker" and q[1] == idx for q in queue):
                for a, d2 in machines[idx].flush(now):
                    post("agg", a, idx, d2)
    return [m.output.flat.reshape(arrays[0].shape) for m in machines], machines
