"""The worker's side of the protocol, as pure state machines (no sockets, no clocks).

JoinMachine registers a rank with every aggregator (docs/protocol.md, "Joining"); AllreduceMachine runs
one allreduce. Both have one driver interface, in the style of sans-IO protocol libraries:
`receive(aggregator, datagram, now)` for every datagram from an aggregator, `datagrams_to_send(now)`
for what to send (call it when nothing more is queued on the socket: results only mark their columns
ready, so a worker that has fallen behind catches up with fewer, fuller datagrams), and `timer()`, the
time at which `datagrams_to_send` has retransmissions (or raises ZeroSumTimeout). Datagrams to send are
(aggregator index, memoryview); the views point into the machine's own buffer and are valid until the
next call into the machine, so a driver sends them at once (or copies them). The caller supplies `now`
(seconds, monotonic), so tests drive time.

Per column the worker keeps the block of the current round and its agreed exponent, and a pointer to
its own next non-zero block in the column. In each round it sends one entry per column: the data of the
round's block if it is its own next non-zero block, otherwise a header-only entry; either way carrying
its next non-zero block index after the round's block (docs/protocol.md, "A round"). The per-entry work
(quantise and encode, decode and dequantise into the output) is in zerosum.worker_kernels, which rounds go
next and the timers in zerosum.worker_rounds, the round-trip estimates, the congestion window and the pacer
in zerosum.congestion, all over the record of zerosum.worker_state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from . import congestion as CC
from . import worker_kernels as K
from . import worker_rounds as R
from . import protocol as P
from . import worker_state as WS
from .blocks import BlockSource, CollectedBlocks, DenseResult, KeptBuffers
from .errors import AggregatorSilent, ProtocolViolation, ZeroSumRefused, ZeroSumTimeout
from .fixedpoint import precision_bits
from .layout import Layout
from .stores import streams

JOIN_INTERVAL = 0.05   # R-J1 (docs/protocol.md): JOIN is repeated every 50 ms until all ranks joined
DELAY_TARGET = 0.005   # R-C3: well under the 50 ms a shaper or switch port typically queues
_NO_ORDER = np.zeros(0, np.int64)   # Layout.column_order None: plain striping (worker_kernels.sort_by_column)


def _per_aggregator(value, aggregators: int, dtype=np.float64) -> np.ndarray:
    """A PathEstimate field as one value per aggregator (a number: the same for each)."""
    per = np.asarray(value, dtype)
    if per.ndim and per.shape != (aggregators,):
        raise ValueError(f"a path estimate for {per.shape[0]} aggregators, not {aggregators}")
    return np.full(aggregators, per) if not per.ndim else per.copy()


def _timing(config: "WorkerConfig", cwnd: float, cap: float, average: bool, path: "PathEstimate | None"):
    """The state record's f[] (zerosum.worker_state's F_*) at an allreduce's start, by name: the timers'
    bounds, the window, and what `path` (None: nothing) carried over from the last allreduce."""
    f = np.zeros(WS.N_F)
    f[WS.F_LAST_PROGRESS] = np.nan
    f[[WS.F_NEXT_CUT, WS.F_EPOCH_START, WS.F_PACE_AT, WS.F_DRAIN_SLOT, WS.F_DRAIN_START, WS.F_DRAIN_END,
       WS.F_RACK_FROM]] = -np.inf
    f[WS.F_MIN_RTO], f[WS.F_MAX_RTO], f[WS.F_TIMEOUT] = config.min_rto, config.max_rto, config.timeout
    f[WS.F_DIVISOR] = config.world if average else 1
    f[WS.F_CWND], f[WS.F_CAP], f[WS.F_SSTHRESH] = cwnd, cap, np.inf
    f[WS.F_TARGET], f[WS.F_WALL_CLOCK], f[WS.F_DRAIN_PERIOD] = config.delay_target, config.wall_clock, CC.DRAIN_PERIOD
    if path is not None:
        f[WS.F_SSTHRESH], f[WS.F_DRAIN_SLOT] = path.ssthresh, path.drain_slot
        f[WS.F_HOST_WAIT], f[WS.F_HOST_WAIT_AT] = path.host_wait, path.host_wait_at
        f[WS.F_OTHER_QUEUE] = path.other_queue
    return f


class PathEstimate(NamedTuple):
    """What one allreduce learnt about the paths to the aggregators, for the next one (RFC 6298 keeps
    its round-trip estimate per path, not per transfer; so does the congestion window here, one for all
    the aggregators). srtt, rttvar, min_rtt and reorder are per aggregator (NaN, inf: none measured); a
    number stands for every aggregator's."""
    srtt: tuple[float, ...] | float
    rttvar: tuple[float, ...] | float
    cwnd: float
    ssthresh: float
    min_rtt: tuple[float, ...] | float   # per aggregator, the least round trip (inf: none measured)
    reorder: tuple[int, ...] | int = 1   # per aggregator, the reordering window's multiple (R-C4)
    drain_slot: float = -np.inf   # the last wall-clock period drained (R-C8)
    competitive: int = 0          # drains without a queue to go before delay counts again (R-C8)
    host_wait: float = 0.0        # the longest wait of a datagram in the worker's socket (R-C4)
    host_wait_at: float = 0.0     # when it was seen (it fades from then on)
    other_queue: float = 0.0      # the queue another flow keeps, as the last drain that found one saw (R-C8)


@dataclass
class WorkerConfig:
    rank: int
    world: int
    job: int
    max_datagram: int = P.MAX_DATAGRAM
    max_entries: int = 0xFFFF  # entries per datagram (1 for a P4 switch)
    rto: float = 0.2         # R-L1: retransmission timeout before any round trip was measured
    min_rto: float = 0.05    # the adaptive timeout: srtt + 4 rttvar, the variation term at least min_rto,
    max_rto: float = 1.0     # the whole at most max_rto (R-L1)
    timeout: float = 30.0    # no progress for this long: give up with an error naming who is missing
    block_size: int = 256
    aggregator_names: list[str] = field(default_factory=list)  # for error messages only
    key: bytes | None = None   # shared with the aggregators: JOINs carry an HMAC (docs/protocol.md, "Admission")
    # bytes of entries in flight (R-L6 in docs/protocol.md): None, every column at once; "auto", the
    # congestion window (R-C1..R-C5); a number, the congestion window's upper bound (with
    # congestion=False, the window itself)
    window: int | str | None = None
    congestion: bool = True
    delay_target: float = DELAY_TARGET   # R-C3: queueing delay the congestion window allows, in seconds
    pacing: bool = True      # R-C7: the congestion window's sends are paced (False: bursts, to compare)
    silence: float | None = None  # R-L7: an aggregator quiet this long while awaited is gone (None: only timeout)
    wall_clock: float = 0.0  # wall-clock time minus the driver's `now`: drains start on the wall clock (R-C8)


class JoinMachine:
    """Joining as a barrier: JOIN to every aggregator every JOIN_INTERVAL until each one's JOIN_ACK
    bitmap has all `world` ranks; then `slots` is the number of slots every aggregator grants. A REFUSED
    answer (the aggregator serves as many jobs as it can) raises ZeroSumRefused at once.
    `leave()` is the LEAVE datagram that ends this rank's run of the job."""

    def __init__(self, config: WorkerConfig, aggregators: int, nonce: int, now: float):
        self.cfg, self.nonce = config, nonce
        self.full = (1 << config.world) - 1
        self.joined = [0] * aggregators
        self.heard = [False] * aggregators
        self.granted = [0] * aggregators
        self.features = [0] * aggregators     # per aggregator, from its JOIN_ACK (P.FEATURE_*)
        self.started = now
        self.next_send = now
        self.join = P.encode(P.Header(P.JOIN, config.job, config.rank, config.world, nonce, 0,
                                      config.block_size))
        if config.key is not None:
            self.join += P.join_mac(config.key, self.join)

    @property
    def done(self) -> bool:
        return all(j == self.full for j in self.joined)

    def leave(self) -> list[tuple[int, bytes]]:
        """The LEAVE datagrams, to the aggregators that understand LEAVE (a switch does not): R-J5."""
        leave = P.encode(P.Header(P.LEAVE, self.cfg.job, self.cfg.rank, self.cfg.world, self.nonce, 0,
                                  self.cfg.block_size))
        return [(a, leave) for a, f in enumerate(self.features) if f & P.FEATURE_LEAVE]

    @property
    def slots(self) -> int:
        return min(self.granted)

    def timer(self) -> float:
        return min(self.next_send, self.started + self.cfg.timeout)

    def receive(self, aggregator: int, datagram, now: float) -> None:
        h = P.parse_header(datagram)
        if h is not None and h[0] == P.REFUSED and h[1] == self.cfg.job \
                and len(datagram) == P.PACKET_HEADER_SIZE + P.REFUSED_BODY.size:
            reason, jobs, used, total = P.REFUSED_BODY.unpack_from(datagram, P.PACKET_HEADER_SIZE)
            name = (self.cfg.aggregator_names or [f"#{aggregator}"] * (aggregator + 1))[aggregator]
            if reason == P.REFUSED_CONFLICT:                # R-J6: the header has the job's geometry
                world, block_size = h[3], h[6]
                held = (f"world {world} and block size {block_size}" if block_size else
                        f"world {world} (no rank joined it yet)")
                raise ZeroSumRefused(
                    f"rank {self.cfg.rank}: aggregator {name} refused the JOIN: job {self.cfg.job} exists there "
                    f"with {held}, this rank has world {self.cfg.world} and block size "
                    f"{self.cfg.block_size} (another run of the job, or someone else's JOIN, holds the id: "
                    "use another job id, or wait for that job to end)")
            if h[3] != self.cfg.world:
                return                                      # not the answer to this rank's JOIN
            if reason == P.REFUSED_UNKNOWN_JOB:
                raise ZeroSumRefused(f"rank {self.cfg.rank}: aggregator {name} does not serve job {self.cfg.job}: "
                                     f"it is not configured there ({jobs} jobs are; configure the job with the "
                                     "switch's control plane, or use one of its jobs)")
            raise ZeroSumRefused(f"rank {self.cfg.rank}: aggregator {name} is full: {jobs} jobs, {used} of "
                                 f"{total} slots in use; job {self.cfg.job} was refused (retry when a job "
                                 f"ends, or start the aggregator with more --slots or --max-jobs)")
        if h is None or h[0] != P.JOIN_ACK or h[1] != self.cfg.job or h[4] != self.nonce:
            return
        if len(datagram) != P.PACKET_HEADER_SIZE + P.JOIN_ACK_BODY.size or h[7]:
            return
        slots, bitmap = P.JOIN_ACK_BODY.unpack_from(datagram, P.PACKET_HEADER_SIZE)
        self.features[aggregator] = h[5]
        self.granted[aggregator] = slots
        self.joined[aggregator] |= bitmap
        self.heard[aggregator] = True

    def datagrams_to_send(self, now: float) -> list[tuple[int, bytes]]:
        if self.done:
            return []
        if now - self.started > self.cfg.timeout:
            raise ZeroSumTimeout(self._failure())
        if now < self.next_send:
            return []
        self.next_send = now + JOIN_INTERVAL
        return [(a, self.join) for a, j in enumerate(self.joined) if j != self.full]

    def _failure(self) -> str:
        names = self.cfg.aggregator_names or [f"#{a}" for a in range(len(self.joined))]
        silent = [n for n, h in zip(names, self.heard) if not h]
        if silent:
            heard = [n for n, h in zip(names, self.heard) if h]
            return (f"rank {self.cfg.rank}: no answer to JOIN from aggregator {', '.join(silent)} within "
                    f"{self.cfg.timeout:.1f} s" + (f" ({', '.join(heard)} answered)" if heard else "")
                    + ": is it running, and reachable from here? (a software aggregator answers every JOIN "
                    f"of job {self.cfg.job}, or refuses it with the reason, but ignores JOINs without its "
                    "--key-file's key" + (")" if self.cfg.key is None else ": check that it has this key)"))
        missing = sorted({r for j in self.joined for r in range(self.cfg.world) if not (j >> r) & 1})
        return (f"rank {self.cfg.rank}: ranks {', '.join(map(str, missing))} did not join job "
                f"{self.cfg.job} within {self.cfg.timeout:.1f} s")


class Scratch:
    """Memory a worker keeps from one allreduce to the next. The buffer its datagrams are built in holds
    a round of every column with its data (2 MiB for 2,048 columns of 256 values); allocated and zero-filled
    for each allreduce, it took 0.06-0.1 ms of a worker's CPU time at density 0.01 (the machine's set-up:
    0.39-0.41 ms, 0.31-0.34 reusing it). Its old bytes need no clearing: encode_data writes every byte of
    a datagram (header, entries, data, padding). The sums of block input are collected in kept buffers
    too (`kept.array`, CollectedBlocks' allocator), which the caller copies out of."""

    def __init__(self):
        self._datagrams = np.zeros(0, np.uint8)
        self.kept = KeptBuffers()

    def datagram_buffer(self, nbytes: int) -> np.ndarray:
        if self._datagrams.size < nbytes:
            self._datagrams = np.zeros(nbytes, np.uint8)
        return self._datagrams[:nbytes]


class AllreduceMachine:
    """One allreduce. Its state is one record of arrays (worker_state.WorkerState, `self.st`), which the
    kernels update: per column the block of the current round and its agreed exponent, a pointer to the
    worker's own next non-zero block in the column, the retransmission timer; per aggregator the probe
    and when it was last heard. The Python methods below are the sans-IO driver interface; Worker's
    compiled driver (worker_kernels.drive) runs the same kernels over the same record, and returns here for
    what is decided per event rather than per datagram (probes, retransmissions, violations)."""

    def __init__(self, config: WorkerConfig, epoch: int, source: BlockSource, layout: Layout,
                 output: DenseResult | CollectedBlocks, average: bool = False, path: PathEstimate | None = None,
                 scratch: Scratch | None = None):
        """path: what an earlier allreduce to the same aggregators measured (`self.path`); None starts
        with config.rto and the initial window. scratch: memory kept from the worker's last allreduce
        (None: allocated here), not in use by any other machine."""
        self.cfg = config
        self.epoch = epoch
        self.source = source
        self.layout = layout
        self.B = source.block_size
        # Where sums are stored. Blocks that no worker sends are not written: the caller provides
        # zeros there (a zero-filled array, or the input itself, which is zero where nobody sends).
        self.output = output

        S, A = layout.columns, layout.aggregators
        # Own non-zero blocks sorted by (column, block): a column's blocks are a contiguous run of own.
        k = len(source.blocks)
        own = np.empty((k + 1, 3), np.int64)
        starts = np.empty(S + 1, np.int64)
        K.sort_by_column(source.blocks, source.exps, source.rows, S,
                         _NO_ORDER if layout.column_order is None else layout.column_order, own, starts)
        # The window (R-L6): at most `window` columns past their bootstrap in flight, admitted in column
        # order. `admitted` columns (a prefix) may send. The congestion window (R-C*) sets it as it goes.
        entry = P.ENTRY_SIZE + 4 * self.B
        cap = np.inf if config.window in (None, "auto") else float(config.window)
        congestion = config.window is not None and config.congestion
        srtt = np.full(A, np.nan) if path is None else _per_aggregator(path.srtt, A)
        fresh = bool(np.isnan(srtt).all())
        cwnd = float(CC.INITIAL_WINDOW * entry) if fresh else path.cwnd
        window = (S if config.window is None else
                  int(min(S, max(1, min(cwnd, cap) // entry))) if congestion else
                  int(min(S, max(1, cap // entry))))
        per_data = 4 * self.B
        self.st = WS.WorkerState(
            hdr=np.array([config.job, config.rank, config.world, epoch, layout.nblocks, self.B], np.int64),
            round_block=np.full(S, P.BOOT, np.int64), round_exp=np.full(S, P.NO_EXP, np.int64),
            mine_pos=starts[:-1].copy(), col_stop=starts[1:].copy(), own=own,
            src=source.values, ready=np.zeros(S, bool), queue=np.zeros(S, np.int64), deadline=np.full(S, np.inf),
            rto=np.full(S, config.rto), sent_at=np.full(S, np.nan), sent_order=np.zeros(S, np.int64),
            resent=np.zeros(S, bool),
            ready_at=np.zeros(S), waiting_for=np.zeros(S, np.int64),
            status_seen=np.zeros(S, bool), probe=np.full(A, -1, np.int64), loss_confirmed=np.zeros(A, bool),
            tail_armed=np.zeros(A, np.int64),
            last_heard=np.zeros(A), delivered_sent=np.zeros(A), delivered_ready=np.zeros(A),
            delivered_column=np.zeros(A, np.int64), srtt=srtt,
            rttvar=np.zeros(A) if fresh else _per_aggregator(path.rttvar, A), base_rto=np.full(A, config.rto),
            tail_pto=np.full(A, np.inf), min_rtt=np.full(A, np.inf) if fresh else _per_aggregator(path.min_rtt, A),
            epoch_min=np.full(A, np.inf), drain_min=np.full(A, np.inf),
            reo_mult=np.ones(A, np.int64) if fresh else _per_aggregator(path.reorder, A, np.int64),
            reo_clean=np.zeros(A, np.int64), reo_epoch=np.full(A, np.nan),
            slots_used=np.array([layout.slots_used(a) for a in range(A)], np.int64),
            allow=np.zeros(A, np.int64), cols=np.zeros(S, np.int64), order=np.zeros(S, np.int64),
            seen=np.zeros(max(1, layout.slots_per_aggregator), np.int64),
            # datagrams are built here: at most one per column, each at most max_datagram bytes
            out=(scratch or Scratch()).datagram_buffer(
                S * (P.ENTRY_SIZE + per_data) + (S + A) * P.PACKET_HEADER_SIZE),
            cuts=np.zeros((S + A, 3), np.int64), values=output.flat, blocks_out=self._blocks_out(),
            counts=output.count if output.collect else np.zeros(WS.N_COUNTS, np.int64),
            f=_timing(config, min(cwnd, cap), cap, average, None if fresh else path),
            i=np.zeros(WS.N_I, np.int64), drops=np.zeros(len(WS.WORKER_DROPS), np.int64))
        self.st.counts[5:7] = -1
        self.st.counts[9] = -1
        i = self.st.i
        i[WS.I_CONGESTION] = congestion
        i[WS.I_PACING] = congestion and config.pacing
        i[WS.I_COMPETITIVE] = 0 if fresh else path.competitive
        i[WS.I_ENTRY] = entry
        i[WS.I_ADMITTED] = S if window >= S else 0
        i[WS.I_WINDOW] = window
        i[WS.I_REMAINING] = S
        i[WS.I_IS_INT] = source.is_int
        i[WS.I_PRECISION] = precision_bits(config.world)
        i[WS.I_COLLECT] = output.collect
        i[WS.I_MAX_DATAGRAM] = config.max_datagram
        i[WS.I_MAX_ENTRIES] = config.max_entries
        i[WS.I_SOURCE_N] = source.n_values
        # sums into an output larger than the caches bypass them (stores.py); collected rows are read next
        i[WS.I_STREAM] = not output.collect and not source.is_int and streams(output.flat.nbytes)
        for a in np.flatnonzero(~np.isnan(srtt)):
            CC.update_rto(self.st, a)
        self.st.rto[:] = self.st.base_rto[np.arange(S) % A]
        self.columns_of = [np.arange(a, S, A) for a in range(A)]
        self._quiet = np.zeros(A, bool)
        self._max_rows = max(1, (P.MAX_DATAGRAM - P.PACKET_HEADER_SIZE) // (P.ENTRY_SIZE + 4 * self.B))
        self.probes = 0           # R-L2's probes and R-L8's tail probes
        self.tail_probes = 0
        self.retransmitted = 0
        # per aggregator: the probe out is a tail probe (R-L8); the column it resent, that round's place
        # in the sending order before (sent_order), when it could first be sent (ready_at) and was sent
        self._tail_out = np.zeros(A, bool)
        self._tail_column = np.full(A, -1, np.int64)
        self._tail_order = np.zeros(A, np.int64)
        self._tail_ready = np.zeros(A)
        self._tail_sent = np.zeros(A)
        # Filled datagrams (MTU-sized ones of more than one entry, "Fusion") send a rank's header-only
        # entries ahead of its data entries: ranks then do not send a flush's rounds in one order, and
        # none counts as before another.
        self._flush_in_one_order = not K.fills_datagrams(
            min(config.max_datagram, P.MAX_DATAGRAM) - P.PACKET_HEADER_SIZE, config.max_entries)
        self._tail_probe_of = np.empty(A, np.int64)   # scratch for worker_rounds.tail_candidates
        # per aggregator, the other columns whose timers had expired when its probe went out, and their
        # rounds then (probe_answered: did any of them complete without being resent?)
        self._probed_expired = [(np.zeros(0, np.int64), np.zeros(0, np.int64))] * A
        self.failed: str | None = None    # a protocol violation ended this allreduce (R-L4)

    # -- the record's scalars, by name ----------------------------------------------------------------
    round_block = property(lambda self: self.st.round_block)
    deadline = property(lambda self: self.st.deadline)
    ready = property(lambda self: self.st.ready)
    last_heard = property(lambda self: self.st.last_heard)
    probe = property(lambda self: self.st.probe)
    admitted = property(lambda self: int(self.st.i[WS.I_ADMITTED]))
    base_rto = property(lambda self: self.st.base_rto.copy(), doc="per aggregator, R-L1's base timeout")
    bytes_sent = property(lambda self: int(self.st.i[WS.I_BYTES_SENT]))
    remaining = property(lambda self: int(self.st.i[WS.I_REMAINING]))
    # blocks of the sum that hold data so far: the union of the ranks' non-zero blocks, identical on every
    # rank once the allreduce is done
    union_blocks = property(lambda self: int(self.st.counts[3]))

    @property
    def window_columns(self) -> int:
        """The window in columns now (R-L6; the congestion window's, R-C5)."""
        return int(self.st.i[WS.I_WINDOW])

    @property
    def cwnd(self) -> float:
        """The congestion window in bytes (R-C1..R-C4)."""
        return float(self.st.f[WS.F_CWND])

    @property
    def window_cuts(self) -> tuple[int, int]:
        """How often the congestion window was cut for delay (R-C3) and for loss (R-C4)."""
        return int(self.st.i[WS.I_DELAY_CUTS]), int(self.st.i[WS.I_LOSS_CUTS])

    @property
    def pacing(self) -> tuple[float, float]:
        """The pacer's rate in bytes per second and its bucket in bytes (R-C7); (inf, inf) when off."""
        rate = float(CC.pacing_rate(self.st))
        return (rate, float(CC.pacing_burst(self.st, rate))) if np.isfinite(rate) else (np.inf, np.inf)

    @property
    def ecn_marks(self) -> int:
        """Datagrams that came with an ECN mark, echoed in the CONGESTION flag or their own CE (R-C6)."""
        return int(self.st.i[WS.I_MARKS])

    @property
    def drains(self) -> int:
        """Drains of the congestion window in this allreduce (R-C8)."""
        return int(self.st.i[WS.I_DRAINS])

    @property
    def spurious_entries(self) -> int:
        """Resent entries that the aggregator answered with STATUS: it held them already (R-C4)."""
        return int(self.st.i[WS.I_SPURIOUS])

    @property
    def path(self) -> PathEstimate:
        """What this allreduce learnt about the path, for the next one."""
        f = self.st.f
        draining = f[WS.F_DRAIN_END] > -np.inf       # an allreduce that ends while draining: the saved window
        cwnd = max(f[WS.F_CWND], f[WS.F_DRAIN_CWND]) if draining else f[WS.F_CWND]
        st = self.st
        return PathEstimate(tuple(st.srtt.tolist()), tuple(st.rttvar.tolist()), float(cwnd), float(f[WS.F_SSTHRESH]),
                            tuple(st.min_rtt.tolist()), tuple(st.reo_mult.tolist()), float(f[WS.F_DRAIN_SLOT]),
                            int(st.i[WS.I_COMPETITIVE]), float(f[WS.F_HOST_WAIT]), float(f[WS.F_HOST_WAIT_AT]),
                            float(f[WS.F_OTHER_QUEUE]))

    @property
    def min_rtt(self) -> float | None:
        """The least round trip over the aggregators (None: none measured)."""
        t = CC.least_rtt(self.st)
        return float(t) if np.isfinite(t) else None

    @property
    def srtt(self) -> float | None:
        """The longest smoothed round trip over the aggregators (None: none measured)."""
        t = CC.longest_srtt(self.st)
        return None if np.isnan(t) else float(t)

    @property
    def last_progress(self):
        t = float(self.st.f[WS.F_LAST_PROGRESS])
        return None if np.isnan(t) else t

    @property
    def drops(self) -> dict[str, int]:
        """What this worker dropped, by reason (counts above zero)."""
        return {name: int(n) for name, n in zip(WS.WORKER_DROPS, self.st.drops.tolist()) if n}

    # -- queries ------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.remaining == 0

    def timer(self) -> float:
        """When `datagrams_to_send` has retransmissions: a column's timer expired *and* its aggregator
        has been quiet (docs/protocol.md, "Loss recovery"), or when the allreduce times out; or, earlier,
        when the pacer lets the columns it held back go (R-C7).

        Retransmitting while results still stream in would only add load to a busy aggregator: a lost
        datagram's columns are retried once the aggregator falls silent.
        """
        if self.last_progress is None:
            return np.inf
        return float(R.timer(self.st))

    # -- events -------------------------------------------------------------------------------------
    def begin(self, now: float) -> None:
        """Begin the allreduce: every column's bootstrap round is ready to send."""
        self.st.f[WS.F_LAST_PROGRESS] = now
        self.st.last_heard[:] = now
        self.st.tail_armed[:] = WS.TAIL_PROBES
        self.st.ready[:] = True
        self.st.ready_at[:] = now
        self.st.queue[:] = np.arange(self.layout.columns)
        self.st.i[WS.I_QUEUED] = self.layout.columns
        self.st.i[WS.I_REMAINING] = self.layout.columns

    def start(self, now: float) -> list[tuple[int, memoryview]]:
        """Begin the allreduce and return the bootstrap round of every column."""
        self.begin(now)
        return self.datagrams_to_send(now)

    def datagrams_to_send(self, now: float) -> list[tuple[int, memoryview]]:
        """The next round of every column that got its result since the last call, then any
        retransmissions that are due. Raises ZeroSumTimeout when progress stopped."""
        self._check_failed()
        out = self.flush(now)
        if not out and not self.done and now >= self.timer():
            out = self.poll(now)
        return out

    def flush(self, now: float) -> list[tuple[int, memoryview]]:
        """Send the next round's entries of every column that got its result since the last flush (and
        judge the answers to probes that came with them: judge_probes)."""
        self.judge_probes(now)
        return self._datagrams(K.flush_ready(self.st, now))

    def poll(self, now: float) -> list[tuple[int, memoryview]]:
        """What the machine's timer is for: retransmit what the timers say is lost, raise ZeroSumTimeout
        when progress stopped; or, while loss recovery's timer is still ahead, send the columns the pacer
        held back (R-C7).

        A column's timer expiring while its aggregator is quiet means a loss *or* a round that waits
        for a slower worker; only a reply tells them apart. So the first expired column of a quiet
        aggregator is sent alone, as a probe (R-L2; like TCP's window probe): a STATUS answer says the
        aggregator holds our entries and waits for others, and every column of that aggregator backs
        off; a RESULT answer (the entry was missing) confirms a loss, and then every expired column of
        that aggregator is retransmitted at once. A probe without an answer within its own timeout is
        sent again, its timer doubled, as TCP resends only its earliest segment when its timer expires
        (RFC 6298, 5.4-5.6): an aggregator that waits for a core answers late, and taking its silence
        for a loss resent whole windows of entries it held.
        """
        if self.done:
            return []
        self.judge_probes(now)
        st = self.st
        if st.i[WS.I_PACE_HELD] and now < R.recovery_timer(st):
            return self.flush(now)
        if self.last_progress + self.cfg.timeout <= now:   # R-L5; the same expression as timer()
            raise ZeroSumTimeout(self._timeout_message(now))
        self._check_silence(now)
        np.less_equal(st.last_heard + st.base_rto, now, out=self._quiet)
        S = self.layout.columns
        for a in range(self.layout.aggregators):
            p = st.probe[a]
            if st.loss_confirmed[a]:
                st.allow[a] = S           # loss: everything that expired
            elif (p < 0 and self._quiet[a]) or (p >= 0 and st.deadline[p] <= now):
                st.allow[a] = 1           # probe, or probe again
            else:
                st.allow[a] = 0
        expired = self._expired(now)
        A = self.layout.aggregators
        n = R.take_expired(st.round_block, st.cols, A, st.deadline, st.sent_at, st.resent,
                           st.rto, st.allow, self.cfg.max_rto, now)
        taken_from = np.bincount(st.cols[:n] % A, minlength=A)
        st.loss_confirmed[taken_from == 0] = False     # nothing expired there: no loss left to repair
        tails = self._tail_probes(now, taken_from, n)
        if n + tails == 0:
            return []
        for a in range(A):
            taken = st.cols[:n][st.cols[:n] % A == a]
            if st.allow[a] == 1:
                if len(taken):
                    self._tail_out[a] = False
                    st.probe[a] = taken[0]
                    st.waiting_for[taken[0]] = -1    # a fresh STATUS (a bitmap, >= 0) answers the probe
                    cols = self.columns_of[a]
                    waited = cols[expired[cols] & (cols != taken[0])]
                    self._probed_expired[a] = (waited, st.round_block[waited].copy())
                    self.probes += 1
            elif st.allow[a] == S and len(taken):
                if (st.waiting_for[taken] != WS.ASKED).any():
                    CC.on_loss(st, now)       # R-C4 (rounds only asked after are no evidence against the path)
                self.retransmitted += len(taken)
                self._tail_out[a] = False
                st.probe[a] = -1
                st.loss_confirmed[a] = False
        return self._datagrams(K.encode_columns(st, n + tails))

    def _tail_probes(self, now: float, taken_from: np.ndarray, n: int) -> int:
        """R-L8 (after RACK's tail loss probe, RFC 8985, section 7): an aggregator quiet for its tail_pto
        while rounds this worker sent it await their results, with nothing of it expired or probed now,
        is sent the entry of one round in flight, as it was, after st.cols[:n]: lost rounds that no later
        round reveals (R-C4) end an allreduce, and R-L1's timer, backed off by every retransmission, is no
        quicker than 50 ms. First the round sent last (in the sending order): a RESULT answer says that
        every round sent before it is overdue (probe_answered). If a STATUS answers it (the aggregator
        holds it and waits for another rank), the round sent first: a round that a STATUS said held may
        have completed since with its RESULT to this worker lost, which no other rank can ask for. Then none
        until the aggregator's next RESULT. Nothing backs off. Returns how many went out."""
        st = self.st
        if not np.isfinite(st.tail_pto).any():
            return 0
        probe_of = self._tail_probe_of
        R.tail_candidates(st, probe_of)
        k = 0
        for a in range(self.layout.aggregators):
            c = int(probe_of[a])
            if (c < 0 or taken_from[a] or st.probe[a] >= 0 or st.loss_confirmed[a] or st.tail_armed[a] == 0
                    or now < max(st.last_heard[a], st.sent_at[c]) + st.tail_pto[a]):
                continue
            if st.tail_armed[a] < WS.TAIL_PROBES and c == self._tail_column[a]:
                st.tail_armed[a] = 0                      # the round sent first is the one just asked after
                continue
            self._tail_order[a], self._tail_ready[a] = st.sent_order[c], st.ready_at[c]
            self._tail_sent[a] = st.sent_at[c]
            st.sent_at[c], st.resent[c] = now, True       # no round-trip sample from it (Karn's rule)
            st.probe[a] = c
            st.waiting_for[c] = WS.ASKED                  # a STATUS answering it is no spurious resend (R-C4)
            st.tail_armed[a] -= 1
            self._tail_out[a] = True
            self._tail_column[a] = c
            st.cols[n + k] = c
            k += 1
            self.probes += 1
            self.tail_probes += 1
        return k

    def _check_silence(self, now: float) -> None:
        """R-L7: an aggregator that answered nothing for `silence` seconds while columns wait for it is
        gone. Probes are answered within a round trip by a live aggregator, and max_rto keeps them at most
        silence / 3 apart (WorkerConfig), so a live one is heard from at least twice in that time."""
        if self.cfg.silence is None:
            return
        st = self.st
        for a in range(self.layout.aggregators):
            cols = self.columns_of[a]
            if now - st.last_heard[a] >= self.cfg.silence and (st.round_block[cols] != P.END).any():
                raise AggregatorSilent(
                    f"allreduce {self.epoch} of rank {self.cfg.rank}: aggregator {self._agg_name_of(a)} answered "
                    f"nothing for {now - st.last_heard[a]:.1f} s while this rank waited for it (dead, restarted "
                    "or unreachable)", self.received_blocks())

    def received_blocks(self) -> np.ndarray:
        """Per block of the tensor: whether its sum is in the output (its column's rounds are past it;
        a block outside the union counts as received: its sum, zero, is what every output holds there)."""
        blocks = np.arange(self.layout.nblocks, dtype=np.int64)
        current = self.st.round_block[self.layout.column_of_block(blocks)]
        return (current == P.END) | ((current != P.BOOT) & (blocks < current))

    def judge_probes(self, now: float) -> None:
        """R-L2: what the answers to the probes out say, judged once everything queued has been read
        (drivers call it after each batch they read, through flush, datagrams_to_send or poll): the results of
        other columns may lie behind a probe's answer, and on another socket (a multicast group's), and
        judged without them those columns looked lost. A probe not answered yet stays out."""
        for a in np.flatnonzero(self.st.probe >= 0):
            self.probe_answered(int(a), now)

    def probe_answered(self, a: int, now: float) -> None:
        """Whether aggregator a answered its probe, and what that says (see judge_probes)."""
        st = self.st
        p = st.probe[a]
        tail = self._tail_out[a]
        if st.waiting_for[p] >= 0:
            # The aggregator holds our entry and waits for others (after a tail probe, R-L8, nothing backs
            # off: the tail probe asked, and another rank's loss is what keeps it waiting)
            st.probe[a] = -1
            self._tail_out[a] = False
            if not tail:
                self._back_off(a, now)
        elif st.round_block[p] == P.END or not np.isfinite(st.deadline[p]) or st.ready[p]:
            st.probe[a] = -1
            self._tail_out[a] = False
            if tail:
                st.waiting_for[p] = 0
                self._overdue_after_tail_probe(a, now)
                return
            # The probe's round completed. A loss if other columns of this aggregator are still expired
            # without a result; none when the probe merely crossed the RESULT of its round, and none when a
            # column that had expired with it completed since without being resent: the aggregator had
            # that entry, and its rounds waited for a slower rank, as the probe's may have (F-RTO's test of
            # a timeout, RFC 5682, section 2.1: new data acknowledged that was not retransmitted).
            waited, rounds = self._probed_expired[a]
            if ((st.round_block[waited] != rounds) | st.ready[waited]).any():
                self._back_off(a, now)
                return
            st.loss_confirmed[a] = bool(self._expired(now)[self.columns_of[a]].any())

    def _overdue_after_tail_probe(self, a: int, now: float) -> None:
        """R-L8: a tail probe's round got its RESULT: the aggregator is there, and had been quiet for two
        round trips and the reordering window, so every round still in flight to it that was sent before
        the probed one, and could be sent no later, is overdue (RACK's rule, RFC 8985, section 6.2, step 5;
        R-C4's for a round that became ready later): lost, resent at once (a round the aggregator had said
        it holds is asked after: its RESULT may be what was lost). "Before" is the sending order, not the
        send time: the rounds of one flush share their time, and every rank sends them in one order (R-A8),
        so the probed round's completion says nothing of rounds sent after it in the same flush (taken as
        lost, the dense bench's rounds waiting for a rank that stalled 41 ms were resent, 1,924 entries on
        each of three ranks, all held)."""
        st = self.st
        cols = self.columns_of[a]
        # (and, as R-C4, only columns up to the probed one where ranks' windows may differ: a column past
        # it may not be admitted yet by a rank with a smaller window)
        cols = cols[cols < CC.judged_columns(st, self._tail_column[a])]
        before = st.sent_order[cols] < self._tail_order[a]
        if not self._flush_in_one_order:
            before &= st.sent_at[cols] != self._tail_sent[a]     # not of the probed round's flush
        lost = cols[(st.round_block[cols] != P.END) & np.isfinite(st.deadline[cols])
                    & before & (st.ready_at[cols] <= self._tail_ready[a])]
        if len(lost):
            st.deadline[lost] = np.minimum(st.deadline[lost], now)
            st.waiting_for[lost[st.status_seen[lost]]] = WS.ASKED
            st.loss_confirmed[a] = True

    def _expired(self, now: float) -> np.ndarray:
        """Per column: its round is in flight without a result and its timer has expired."""
        st = self.st
        return (st.round_block != P.END) & ~st.ready & (st.deadline <= now)

    def _back_off(self, a: int, now: float) -> None:
        """Aggregator a holds our entries and waits for other ranks: every pending column's timer doubles."""
        st = self.st
        cols = self.columns_of[a]
        # (not the columns the window holds back: they have nothing in flight)
        pending = cols[(st.round_block[cols] != P.END) & ~(st.ready[cols] & (cols >= self.admitted))]
        st.rto[pending] = np.minimum(st.rto[pending] * 2, self.cfg.max_rto)
        st.deadline[pending] = np.maximum(st.deadline[pending], now + st.rto[pending])

    def receive(self, aggregator: int, datagram, now: float, ce: bool = False) -> None:
        """Take one datagram from an aggregator (`ce`: it arrived marked Congestion Experienced, R-C6);
        results only mark columns ready (see flush), and answers to probes are judged after the batch
        (judge_probes)."""
        self._check_failed()
        if self.output.collect:
            self.grow(self._max_rows)
        code = K.receive(self.st, np.frombuffer(datagram, np.uint8), len(datagram), aggregator, now, ce)
        if code > 0:
            self.fail(code, aggregator)

    def receive_many(self, datagrams, now: float) -> None:
        """Take several datagrams, as (aggregator index, bytes), in arrival order."""
        for a, datagram in datagrams:
            self.receive(a, datagram, now)

    def grow(self, rows: int) -> None:
        """Room for `rows` more collected rows (CollectedBlocks grows by copying: the record follows)."""
        before = self.output.flat
        self.output.reserve(rows)
        if self.output.flat is not before:
            self.st = self.st._replace(values=self.output.flat, blocks_out=self.output.blocks)

    def _blocks_out(self):
        return self.output.blocks if self.output.collect else self._no_blocks

    _no_blocks = np.zeros(0, np.int64)

    def fail(self, code: int, aggregator: int) -> None:
        """A protocol violation (R-L4) in a datagram from `aggregator`: none of its entries was applied,
        and the allreduce is over: raise now and at every later call."""
        self.failed = self.violation(code, aggregator)
        raise ProtocolViolation(self.failed)

    def _check_failed(self) -> None:
        if self.failed is not None:
            raise ProtocolViolation(f"this allreduce failed earlier: {self.failed}")

    def violation(self, code: int, aggregator: int) -> str:
        block = int(self.st.i[WS.I_BAD_BLOCK])
        if code == K.VIOLATION_NO_DATA:
            return (f"aggregator {self._agg_name_of(aggregator)} returned no data for a block this worker "
                    f"contributed (block {block})")
        if code == K.VIOLATION_EXPONENT:
            return "result exponent differs from the agreed exponent of its block"
        if code == K.VIOLATION_DTYPE:
            return ("workers disagree on the dtype of this allreduce "
                    "(float32 and int32 contributions to the same blocks)")
        return "aggregator skipped a block this worker still has to send"

    # -- building datagrams -------------------------------------------------------------------------
    def _datagrams(self, nd: int) -> list[tuple[int, memoryview]]:
        """The datagrams the kernels built, listed in st.cuts[:nd], as (aggregator, view)."""
        if not nd:
            return []
        view = memoryview(self.st.out)
        return [(a, view[s:e]) for a, s, e in self.st.cuts[:nd].tolist()]

    # -- errors -------------------------------------------------------------------------------------
    def _agg_name_of(self, a: int) -> str:
        names = self.cfg.aggregator_names
        return names[a] if a < len(names) else f"#{a}"

    def _agg_name(self, col) -> str:
        return self._agg_name_of(int(self.layout.aggregator_of(np.int64(col))))

    def _timeout_message(self, now: float) -> str:
        pending = np.flatnonzero(self.round_block != P.END)
        heard = self.st.status_seen[pending]
        head = (f"allreduce {self.epoch} of rank {self.cfg.rank} made no progress for "
                f"{now - self.last_progress:.1f} s ({len(pending)} of {self.layout.columns} columns unfinished)")
        if heard.any():
            everyone = (1 << self.cfg.world) - 1
            missing = 0
            for bitmap in self.st.waiting_for[pending[heard]]:
                if bitmap >= 0:       # -1: a probe's answer is still outstanding
                    missing |= everyone & ~int(bitmap)
            missing &= ~(1 << self.cfg.rank)
            ranks = [r for r in range(self.cfg.world) if missing >> r & 1]
            if ranks:
                return (f"{head}: waiting for rank{'s' if len(ranks) > 1 else ''} "
                        f"{', '.join(map(str, ranks))} (the aggregator has not heard from "
                        f"{'them' if len(ranks) > 1 else 'it'}; is it dead?)")
        names = sorted({self._agg_name(c) for c in pending[~heard]} or {self._agg_name(pending[0])})
        return (f"{head}: no answer from aggregator {', '.join(names)} "
                "(is it still running, and reachable? A job its JOINs created ends after the aggregator's "
                "--job-idle seconds without traffic)")
