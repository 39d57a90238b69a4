"""A timed network for the congestion window: every worker reaches the aggregator over links of a given
rate, delay and queue (a drop-tail FIFO, as tbf or a switch port), in both directions.

Events happen at the times the links give them: a datagram leaves a link's queue after the ones before
it, at the link's rate, and arrives `delay` later; a datagram that finds the queue full is dropped and
counted. The aggregator and the workers take no time (the links are what is scarce here). The state
machines are the real ones (AggregatorMachine, AllreduceMachine), driven through their sans-IO
interfaces with the simulated clock.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from zerosum.aggregator_machine import AggregatorMachine
from zerosum.blocks import BlockSource, DenseResult
from zerosum.layout import Layout
from zerosum.worker_machine import AllreduceMachine, WorkerConfig

from netsim import join_all

IP_UDP = 28   # bytes of IPv4 and UDP header a datagram takes on the link


@dataclass
class Link:
    rate: float            # bytes per second
    delay: float           # seconds of propagation
    queue: int             # bytes the queue holds before it drops
    loss: float = 0.0      # chance that a datagram is lost on the way (not for want of room)
    rng: object = None
    free_at: float = 0.0   # when the last queued datagram has left
    dropped: int = 0
    carried: int = 0       # bytes that got through
    peak_queue: float = 0.0  # the most bytes the queue held (the datagram being sent included)
    bursts: list = None    # (time, bytes): what was put on the link at one instant, after `watch_from`
    watch_from: float = 0.0
    burst_at: float = -1.0

    def send(self, now: float, size: int) -> float | None:
        """When a datagram of `size` bytes put on the link at `now` arrives; None: dropped."""
        size += IP_UDP
        self._count_burst(now, size)
        backlog = max(0.0, self.free_at - now) * self.rate
        if backlog + size > self.queue:
            self.dropped += 1
            return None
        self.peak_queue = max(self.peak_queue, backlog + size)
        self.free_at = max(now, self.free_at) + size / self.rate
        self.carried += size
        if self.loss and self.rng.random() < self.loss:
            return None
        return self.free_at + self.delay

    def _count_burst(self, now: float, size: int) -> None:
        if now < self.watch_from:
            return
        if self.bursts is None:
            self.bursts = []
        if now == self.burst_at:
            self.bursts[-1] = (now, self.bursts[-1][1] + size)
        else:
            self.bursts.append((now, size))
            self.burst_at = now

    @property
    def largest_burst(self) -> int:
        """The most bytes put on the link at one instant (from `watch_from` on)."""
        return max((b for _, b in self.bursts or ()), default=0)


@dataclass
class Run:
    outputs: list
    machines: list
    uplinks: list
    downlinks: list
    finished: float                  # simulated seconds until the last worker was done
    windows: list                    # per worker, (time, congestion window in bytes) after every event
    buckets: list                    # per worker, (time, the pacer's bucket in bytes) after every event (R-C7)


def run_timed(arrays, *, rate: float, delay: float, queue: int, block_size: int = 256,
              max_datagram: int = 1472, window="auto", congestion: bool = True, delay_target: float = 0.005,
              path=None, changes=(), slots: int | None = None, until: float = 60.0, loss: float = 0.0,
              seed: int = 0, pacing: bool = True, watch_from: float = 0.0, answer_after=(0.0,)) -> Run:
    """One allreduce of `arrays` (one per rank) through the aggregators of `answer_after` (one by
    default) over links of `rate` bytes/s, `delay` seconds and `queue` bytes in each direction. `changes`:
    (time, rate) pairs that set every link's rate from that time on. `path`: PathEstimate per rank from an
    earlier run (or None). `loss`: the chance that a link loses a datagram it carried (random loss, not
    congestion). `pacing`: WorkerConfig.pacing. `watch_from`: the links list their bursts from this time
    on (Link.bursts). `answer_after`: one aggregator per entry (the columns striped over them), each taking
    a datagram that many seconds after it arrived (an aggregator that waits for a core)."""
    rng = np.random.default_rng(seed)
    world = len(arrays)
    aggs = [AggregatorMachine(1, world, slots=slots or 4096) for _ in answer_after]
    granted = join_all(aggs, world, block_size)
    ups = [Link(rate, delay, queue, loss, rng, watch_from=watch_from) for _ in range(world)]
    downs = [Link(rate, delay, queue, loss, rng, watch_from=watch_from) for _ in range(world)]
    machines, windows, buckets = [], [[] for _ in range(world)], [[] for _ in range(world)]
    for r, x in enumerate(arrays):
        source = BlockSource.dense(np.ascontiguousarray(x).reshape(-1), block_size)
        cfg = WorkerConfig(rank=r, world=world, job=1, max_datagram=max_datagram, timeout=30.0,
                           block_size=block_size, window=window, congestion=congestion,
                           delay_target=delay_target, pacing=pacing)
        machines.append(AllreduceMachine(cfg, 1, source, Layout(len(aggs), granted, source.nblocks),
                                         DenseResult(np.zeros(x.size, x.dtype)),
                                         path=None if path is None else path[r]))
    events: list = []      # (time, sequence, kind, rank, payload)
    seq = 0

    def at(t, kind, r, payload=None):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, r, payload))

    def worker_sends(r, now, datagrams):
        for a, d in datagrams:
            arrival = ups[r].send(now, len(d))
            if arrival is not None:
                at(arrival + answer_after[a], "agg", r, (a, bytes(d)))
        windows[r].append((now, machines[r].cwnd))
        buckets[r].append((now, machines[r].pacing[1]))
        t = machines[r].timer()
        if np.isfinite(t):
            at(max(t, now), "timer", r)

    for t, new_rate in changes:
        at(t, "rate", -1, new_rate)
    for r, m in enumerate(machines):
        worker_sends(r, 0.0, m.start(0.0))
    now = 0.0
    while events and not all(m.done for m in machines):
        now, _, kind, r, payload = heapq.heappop(events)
        if now > until:
            raise AssertionError(f"not done after {until} simulated seconds")
        if kind == "rate":
            for link in ups + downs:
                link.free_at = max(link.free_at, now)
                link.rate = payload
        elif kind == "agg":
            a, data = payload
            aggs[a].receive(data, ("w", r), now)
            for dests, reply in aggs[a].datagrams_to_send(now):
                for _, w in dests:
                    arrival = downs[w].send(now, len(reply))
                    if arrival is not None:
                        at(arrival, "worker", w, (a, bytes(reply)))
        elif not machines[r].done:
            m = machines[r]
            if kind == "worker":
                m.receive(*payload, now)
            if kind == "worker" or now >= m.timer():
                worker_sends(r, now, m.datagrams_to_send(now))
    outs = [m.output.flat.reshape(arrays[0].shape) for m in machines]
    return Run(outs, machines, ups, downs, now, windows, buckets)
