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
(quantise and encode, decode and dequantise into the output) is in zerosum.kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import kernels as K
from . import protocol as P
from .blocks import BlockSource, CollectedBlocks, DenseResult
from .errors import ProtocolViolation, ZeroSumRefused, ZeroSumTimeout
from .fixedpoint import precision_bits
from .layout import Layout

JOIN_INTERVAL = 0.05   # R-J1 (docs/protocol.md): JOIN is repeated every 50 ms until all ranks joined


@dataclass
class WorkerConfig:
    rank: int
    world: int
    job: int
    max_datagram: int = P.MAX_DATAGRAM
    max_entries: int = 0xFFFF  # entries per datagram (1 for a P4 switch)
    rto: float = 0.2         # R-L1: retransmission timeout before any round trip was measured
    min_rto: float = 0.05    # the adaptive timeout (TCP's srtt + 4 rttvar) stays within these
    max_rto: float = 1.0
    timeout: float = 30.0    # no progress for this long: give up with an error naming who is missing
    block_size: int = 256
    aggregator_names: list[str] = field(default_factory=list)  # for error messages only
    key: bytes | None = None   # shared with the aggregators: JOINs carry an HMAC (docs/protocol.md, "Admission")
    window: int | None = None  # bytes of entries in flight at most (R-L6 in docs/protocol.md); None: every column


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
        if h is not None and h[0] == P.REFUSED and h[1] == self.cfg.job and h[3] == self.cfg.world \
                and len(datagram) == P.PACKET_HEADER_SIZE + P.REFUSED_BODY.size:
            reason, jobs, used, total = P.REFUSED_BODY.unpack_from(datagram, P.PACKET_HEADER_SIZE)
            name = (self.cfg.aggregator_names or [f"#{aggregator}"] * (aggregator + 1))[aggregator]
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
            return (f"rank {self.cfg.rank}: no answer to JOIN from aggregator {', '.join(silent)} within "
                    f"{self.cfg.timeout:.1f} s (is it running for job {self.cfg.job} with --workers "
                    f"{self.cfg.world}?")
        missing = sorted({r for j in self.joined for r in range(self.cfg.world) if not (j >> r) & 1})
        return (f"rank {self.cfg.rank}: ranks {', '.join(map(str, missing))} did not join job "
                f"{self.cfg.job} within {self.cfg.timeout:.1f} s")


class AllreduceMachine:
    def __init__(self, config: WorkerConfig, epoch: int, source: BlockSource, layout: Layout,
                 output: DenseResult | CollectedBlocks, average: bool = False, rtt: tuple | None = None):
        """rtt: (srtt, rttvar) measured by an earlier allreduce to the same aggregators (RFC 6298 keeps
        its estimate per path, not per transfer); None starts with config.rto."""
        self.cfg = config
        self.epoch = epoch
        self.source = source
        self.layout = layout
        self.B = source.block_size
        self.is_int = source.is_int
        # Float sums are divided by the world size as they are stored (DDP's averaging, no extra pass).
        self.divisor = np.float32(config.world if average else 1)
        self.precision = precision_bits(config.world)
        # Where sums are stored. Blocks that no worker sends are not written: the caller provides
        # zeros there (a zero-filled array, or the input itself, which is zero where nobody sends).
        self.output = output
        self.hdr = np.array([config.job, config.rank, config.world, epoch, layout.nblocks, self.B], np.int64)

        S = layout.columns
        # Own non-zero blocks sorted by (column, block): a column's blocks are a contiguous run of seq.
        cols = layout.column_of_block(source.blocks)
        order = np.argsort(cols, kind="stable")
        self.seq = np.append(source.blocks[order], P.END).astype(np.int64)
        self.seq_exp = source.exps[order].astype(np.int64)
        self.seq_row = source.rows[order]
        starts = np.searchsorted(cols[order], np.arange(S + 1))
        self.mine_pos = starts[:-1].astype(np.int64)
        self.col_stop = starts[1:].astype(np.int64)

        A = layout.aggregators
        self.round_block = np.full(S, P.BOOT, np.int64)
        self.round_exp = np.full(S, P.NO_EXP, np.int64)
        self.deadline = np.full(S, np.inf)
        self.rto = np.full(S, config.rto)
        self.sent_at = np.full(S, np.nan)          # first transmission of the round (NaN once retransmitted)
        self.srtt = None
        self.rttvar = 0.0
        self.base_rto = config.rto
        if rtt is not None and rtt[0] is not None:
            self.srtt, self.rttvar = rtt
            self.base_rto = self._rto_of(self.srtt, self.rttvar)
            self.rto[:] = self.base_rto
        # Probing (see poll): per aggregator, the column sent alone to test for loss, or -1
        self.probe = np.full(A, -1, np.int64)
        self.loss_confirmed = np.zeros(A, bool)
        self._allow = np.zeros(A, np.int64)
        self.probes = 0
        self.waiting_for = np.zeros(S, np.int64)   # bitmap from the last STATUS per column (ranks heard)
        self.status_seen = np.zeros(S, bool)
        self.ready = np.zeros(S, bool)             # columns whose next round's entry is still to send
        self.columns_of = [np.arange(a, S, A) for a in range(A)]
        # The window (R-L6): at most `window` columns past their bootstrap in flight, admitted in column
        # order; a column stays admitted until it ends. `admitted` columns (a prefix) may send.
        entry = P.ENTRY_SIZE + 4 * self.B
        self.window_columns = S if config.window is None else int(min(S, max(1, config.window // entry)))
        self.admitted = S if self.window_columns >= S else 0
        self.slots_used = [layout.slots_used(a) for a in range(A)]
        self._seen = np.zeros(max(1, layout.slots_per_aggregator), np.int64)
        self._stamp = 0
        self._cols = np.zeros(S, np.int64)
        self._quiet = np.zeros(A, bool)
        self.last_heard = np.zeros(A)
        self.last_progress = None
        self.remaining = S                         # columns not yet at END
        # Datagrams are built here: at most one per column, each at most max_datagram bytes.
        self._out = np.zeros(self._out_size(S), np.uint8)
        self._cuts = np.zeros((S + A, 3), np.int64)
        self._counts = output.count if output.collect else np.zeros(3, np.int64)
        self._max_rows = max(1, (P.MAX_DATAGRAM - P.PACKET_HEADER_SIZE) // (P.ENTRY_SIZE + 4 * self.B))
        self.bytes_sent = 0
        self.retransmitted = 0
        self.drops: dict[str, int] = {}

    def _out_size(self, S: int) -> int:
        per_data = 4 * self.B
        return S * (P.ENTRY_SIZE + per_data) + (S + self.layout.aggregators) * P.PACKET_HEADER_SIZE

    # -- queries ------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.remaining == 0

    def timer(self) -> float:
        """When `datagrams_to_send` has retransmissions: a column's timer expired *and* its aggregator
        has been quiet (docs/protocol.md, "Loss recovery"), or when the allreduce times out.

        Retransmitting while results still stream in would only add load to a busy aggregator: a lost
        datagram's columns are retried once the aggregator falls silent.
        """
        if self.done or self.last_progress is None:
            return np.inf
        t = K.next_timer(self.round_block, self.deadline, self.layout.aggregators, self.last_heard,
                         self.base_rto, self.probe, self.loss_confirmed)
        return min(t, self.last_progress + self.cfg.timeout)

    def _drop(self, reason: str, n: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + n

    # -- events -------------------------------------------------------------------------------------
    def start(self, now: float) -> list[tuple[int, memoryview]]:
        """Begin the allreduce: the bootstrap round of every column."""
        self.last_progress = now
        self.last_heard[:] = now
        self.ready[:] = True
        self.remaining = self.layout.columns
        return self.datagrams_to_send(now)

    def datagrams_to_send(self, now: float) -> list[tuple[int, memoryview]]:
        """The next round of every column that got its result since the last call, then any
        retransmissions that are due. Raises ZeroSumTimeout when progress stopped."""
        out = self.flush(now)
        if not out and not self.done and now >= self.timer():
            out = self.poll(now)
        return out

    def flush(self, now: float) -> list[tuple[int, memoryview]]:
        """Send the next round's entries of every column that got its result since the last flush."""
        if self.admitted < self.layout.columns:
            self.admitted = K.admit(self.round_block, self.admitted, self.window_columns)
        n = K.take_ready(self.ready, self._cols, self.layout.aggregators, self.deadline, self.sent_at,
                         self.rto, now, self.round_block, self.admitted)
        return self._send(n) if n else []

    def poll(self, now: float) -> list[tuple[int, memoryview]]:
        """Retransmit what the timers say is lost; raise ZeroSumTimeout when progress stopped.

        A column's timer expiring while its aggregator is quiet means a loss *or* a round that waits
        for a slower worker; only a reply tells them apart. So the first expired column of a quiet
        aggregator is sent alone, as a probe (R-L2; like TCP's window probe): a STATUS answer says the
        aggregator holds our entries and waits for others, and every column of that aggregator backs
        off; a RESULT answer (the entry was missing) or no answer within the probe's timeout confirms a
        loss, and then every expired column of that aggregator is retransmitted at once.
        """
        if self.done:
            return []
        if self.last_progress + self.cfg.timeout <= now:   # R-L5; the same expression as timer()
            raise ZeroSumTimeout(self._timeout_message(now))
        np.less_equal(self.last_heard + self.base_rto, now, out=self._quiet)
        S = self.layout.columns
        for a in range(self.layout.aggregators):
            p = self.probe[a]
            if self.loss_confirmed[a] or (p >= 0 and self.deadline[p] <= now):
                self._allow[a] = S           # loss: everything that expired
            elif p < 0 and self._quiet[a]:
                self._allow[a] = 1           # probe
            else:
                self._allow[a] = 0
        n = K.take_expired(self.round_block, self._cols, self.layout.aggregators, self.deadline,
                           self.sent_at, self.rto, self._allow, self.cfg.max_rto, now)
        if n == 0:
            self.loss_confirmed[:] = False     # nothing expired: no loss left to repair
            return []
        for a in range(self.layout.aggregators):
            if self._allow[a] == 1:
                taken = self._cols[:n][self._cols[:n] % self.layout.aggregators == a]
                if len(taken):
                    self.probe[a] = taken[0]
                    self.waiting_for[taken[0]] = -1    # a fresh STATUS (a bitmap, >= 0) answers the probe
                    self.probes += 1
            elif self._allow[a] == S:
                self.retransmitted += int(np.count_nonzero(self._cols[:n] % self.layout.aggregators == a))
                self.probe[a] = -1
                self.loss_confirmed[a] = False
        return self._send(n)

    def _probe_answered(self, a: int, now: float) -> None:
        """After a datagram from aggregator a: did it answer the outstanding probe?"""
        p = self.probe[a]
        if self.waiting_for[p] >= 0:
            # The aggregator holds our entry and waits for others: back off every pending column.
            self.probe[a] = -1
            cols = self.columns_of[a]
            # (not the columns the window holds back: they have nothing in flight)
            pending = cols[(self.round_block[cols] != P.END) & ~(self.ready[cols] & (cols >= self.admitted))]
            self.rto[pending] = np.minimum(self.rto[pending] * 2, self.cfg.max_rto)
            self.deadline[pending] = np.maximum(self.deadline[pending], now + self.rto[pending])
        elif self.round_block[p] == P.END or not np.isfinite(self.deadline[p]) or self.ready[p]:
            # The probe's round completed. A loss if other columns of this aggregator are still
            # expired without a result; none when the probe merely crossed the RESULT of its round.
            self.probe[a] = -1
            cols = self.columns_of[a]
            expired = (self.round_block[cols] != P.END) & ~self.ready[cols] & (self.deadline[cols] <= now)
            self.loss_confirmed[a] = bool(expired.any())

    def receive(self, aggregator: int, datagram, now: float) -> None:
        """Take one datagram from an aggregator; results only mark columns ready (see flush)."""
        h = P.parse_header(datagram)
        if h is None:
            self._drop("short" if len(datagram) < P.PACKET_HEADER_SIZE else "version")
            return
        ptype, job, rank, world, epoch, tensor_blocks, block_size, nent = h
        if ptype not in P.TYPE_NAMES:
            self._drop("type")
            return
        if job != self.cfg.job or rank != P.AGGREGATOR_RANK:
            self._drop("foreign")
            return
        if ptype == P.JOIN_ACK:
            return     # a late answer to a join: harmless
        if ptype not in (P.RESULT, P.STATUS):
            self._drop("type")
            return
        if epoch != self.epoch:
            self._drop("stale_epoch")
            return
        if tensor_blocks != self.layout.nblocks or block_size != self.B:
            self._drop("geometry")
            return
        if nent == 0:
            return
        if self.output.collect:
            self.output.reserve(self._max_rows)
        values = self.output.flat
        self._stamp += 1
        code, rtt, block = K.apply_datagram(
            np.frombuffer(datagram, np.uint8), len(datagram), ptype, nent, aggregator,
            self.layout.aggregators, self.slots_used[aggregator], self.hdr, self.is_int, self.precision,
            self.divisor, self.round_block, self.round_exp, self.mine_pos, self.col_stop, self.seq,
            self.ready, self.deadline, self.rto, self.sent_at, self.waiting_for, self.status_seen,
            self.base_rto, self.cfg.max_rto, now, values, values.size, self.output.collect, self._blocks_out(), self._counts, self._seen, self._stamp)
        if code < 0:
            self._drop(K.DROP_REASONS[-code].removeprefix("drop_"))
            return
        if code > 0:
            raise ProtocolViolation(self._violation(code, aggregator, block))     # R-L4
        self.last_heard[aggregator] = now
        if self.probe[aggregator] >= 0:
            self._probe_answered(aggregator, now)
        if ptype == P.RESULT:
            self.last_progress = now
            self.remaining = self.layout.columns - int(self._counts[2])
            if rtt >= 0:
                self._measure(rtt)
        if self._counts[0]:
            self._drop("duplicate_result", int(self._counts[0]))     # R-L4
            self._counts[0] = 0

    def receive_many(self, datagrams, now: float) -> None:
        """Take several datagrams, as (aggregator index, bytes), in arrival order."""
        for a, datagram in datagrams:
            self.receive(a, datagram, now)

    def _blocks_out(self):
        return self.output.blocks if self.output.collect else self._no_blocks

    _no_blocks = np.zeros(0, np.int64)

    def _violation(self, code: int, aggregator: int, block: int) -> str:
        if code == K.VIOLATION_NO_DATA:
            return (f"aggregator {self._agg_name_of(aggregator)} returned no data for a block this worker "
                    f"contributed (block {block})")
        if code == K.VIOLATION_EXPONENT:
            return "result exponent differs from the agreed exponent of its block"
        if code == K.VIOLATION_DTYPE:
            return ("workers disagree on the dtype of this allreduce "
                    "(float32 and int32 contributions to the same blocks)")
        return "aggregator skipped a block this worker still has to send"

    def _measure(self, r: float) -> None:
        """Adapt the retransmission timeout to the round-trip times seen (RFC 6298, section 2)."""
        if self.srtt is None:
            self.srtt, self.rttvar = r, r / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - r)
            self.srtt = 0.875 * self.srtt + 0.125 * r
        self.base_rto = self._rto_of(self.srtt, self.rttvar)

    def _rto_of(self, srtt: float, rttvar: float) -> float:
        return min(max(srtt + 4 * rttvar, self.cfg.min_rto), self.cfg.max_rto)

    # -- building datagrams -------------------------------------------------------------------------
    def _send(self, ncols: int) -> list[tuple[int, memoryview]]:
        """Build this round's entries for the first `ncols` of self._cols, fused into datagrams."""
        src = self.source
        nd = K.encode_data(self._out, self._cuts, self._cols, ncols, self.layout.aggregators, self.hdr,
                           self.round_block, self.round_exp, self.mine_pos, self.col_stop, self.seq,
                           self.seq_exp, self.seq_row, src.values, src.n_values, self.is_int,
                           self.precision, self.cfg.max_datagram, self.cfg.max_entries)
        view = memoryview(self._out)
        cuts = self._cuts[:nd].tolist()
        self.bytes_sent += cuts[-1][2] if cuts else 0
        return [(a, view[s:e]) for a, s, e in cuts]

    # -- errors -------------------------------------------------------------------------------------
    def _agg_name_of(self, a: int) -> str:
        names = self.cfg.aggregator_names
        return names[a] if a < len(names) else f"#{a}"

    def _agg_name(self, col) -> str:
        return self._agg_name_of(int(self.layout.aggregator_of(np.int64(col))))

    def _timeout_message(self, now: float) -> str:
        pending = np.flatnonzero(self.round_block != P.END)
        heard = self.status_seen[pending]
        head = (f"allreduce {self.epoch} of rank {self.cfg.rank} made no progress for "
                f"{now - self.last_progress:.1f} s ({len(pending)} of {self.layout.columns} columns unfinished)")
        if heard.any():
            everyone = (1 << self.cfg.world) - 1
            missing = 0
            for bitmap in self.waiting_for[pending[heard]]:
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
                f"(is it running, and started with --workers {self.cfg.world}? A job its JOINs created ends "
                f"after the aggregator's --job-idle seconds without traffic)")
