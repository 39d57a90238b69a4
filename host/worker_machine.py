"""The worker's side of one allreduce, as a pure state machine (no sockets, no clocks).

Drive it with `start(now)`, then `receive(aggregator, datagram, now)` for every datagram from an
aggregator (or `receive_many` for several queued ones at once), `flush(now)` when there is nothing
more to read, and `poll(now)` when `deadline_at` has passed; start, flush and poll return the
datagrams to send as (aggregator index, bytes). Results only mark their columns ready; flush sends all
ready columns together, so a worker that has fallen behind catches up with fewer, fuller datagrams.
`done` turns true when every column has reached END; `output` then holds the sum. The caller supplies
`now` (seconds, monotonic), so tests can drive time.

Per column the worker keeps the block of the current round and its agreed exponent, and a pointer to
its own next non-zero block in the column. In each round it sends one entry per column: the data of the
round's block if it is its own next non-zero block, otherwise a header-only entry; either way carrying
its next non-zero block index after the round's block (docs/protocol.md, "A round").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import protocol as P
from .blocks import BlockView, SparseBlocks
from .errors import ProtocolViolation, ZeroSumTimeout
from .fixedpoint import dequantize, quantize
from .layout import Layout


@dataclass
class WorkerConfig:
    rank: int
    world: int
    job: int
    max_datagram: int = P.MAX_DATAGRAM
    max_entries: int = 0xFFFF  # entries per datagram (1 for a P4 switch)
    rto: float = 0.2         # retransmission timeout before any round trip was measured
    min_rto: float = 0.05    # the adaptive timeout (TCP's srtt + 4 rttvar) stays within these
    max_rto: float = 1.0
    timeout: float = 30.0    # no progress for this long: give up with an error naming who is missing
    aggregator_names: list[str] = field(default_factory=list)  # for error messages only


class AllreduceMachine:
    def __init__(self, config: WorkerConfig, epoch: int, view: BlockView, sparse: SparseBlocks,
                 layout: Layout, output: BlockView, average: bool = False):
        self.cfg = config
        # Divide float sums by the world size as they are stored (DDP's averaging without a full pass).
        self.divisor = np.float32(config.world) if average else None
        self.epoch = epoch
        self.view = view
        self.layout = layout
        self.B = view.block_size
        self.is_int = view.is_int
        # Where sums are stored. Blocks that no worker sends are not written: the caller provides
        # zeros there (a zero-filled array, or the input itself, which is zero where nobody sends).
        self.output = output
        self.exp_of = np.append(sparse.exponents, P.NO_EXP)   # the last entry stands for END
        self.header = P.Header(P.DATA, config.job, config.rank, config.world, epoch,
                               layout.nblocks, self.B, 0)

        S = layout.columns
        # Own non-zero blocks sorted by (column, block): a column's blocks are a contiguous run of seq.
        nz = np.flatnonzero(sparse.nonzero)
        cols = layout.column_of_block(nz)
        order = np.argsort(cols, kind="stable")
        self.seq = np.append(nz[order], P.END).astype(np.int64)
        starts = np.searchsorted(cols[order], np.arange(S + 1))
        self.mine_pos = starts[:-1].astype(np.int64)
        self.col_stop = starts[1:].astype(np.int64)

        self.round_block = np.full(S, P.BOOT, np.int64)
        self.round_exp = np.full(S, P.NO_EXP, np.int64)
        self.deadline = np.full(S, np.inf)
        self.rto = np.full(S, config.rto)
        self.sent_at = np.full(S, np.nan)          # first transmission of the round (NaN once retransmitted)
        self.srtt = None
        self.rttvar = 0.0
        self.base_rto = config.rto
        self.waiting_for = np.zeros(S, np.int64)   # bitmap from the last STATUS per column (ranks heard)
        self.status_seen = np.zeros(S, bool)
        self._scratch = np.zeros(max(1, layout.slots_per_aggregator), np.int64)
        self.last_progress = None
        self.ready = np.zeros(S, bool)             # columns whose next round's entry is still to send
        self.columns_of = [np.arange(a, S, layout.aggregators) for a in range(layout.aggregators)]
        self.aggregator_of_column = layout.aggregator_of(np.arange(S))
        self.last_heard = np.zeros(layout.aggregators)
        self.bytes_sent = 0
        self.retransmitted = 0
        self.drops: dict[str, int] = {}

    # -- queries ------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return bool(np.all(self.round_block == P.END))

    @property
    def deadline_at(self) -> float:
        """When `poll` has work: a column's timer expired *and* its aggregator has been quiet.

        Retransmitting while results still stream in would only add load to a busy aggregator: a lost
        datagram's columns are retried once the aggregator falls silent.
        """
        d = np.inf
        for a, cols in enumerate(self.columns_of):
            if len(cols):
                d = min(d, max(float(self.deadline[cols].min()), self.last_heard[a] + self.base_rto))
        if self.last_progress is not None and not self.done:
            d = min(d, self.last_progress + self.cfg.timeout)
        return d

    def _mine(self, cols: np.ndarray, ahead: int = 0) -> np.ndarray:
        pos = self.mine_pos[cols] + ahead
        return self.seq[np.where(pos < self.col_stop[cols], pos, len(self.seq) - 1)]

    def _exp(self, blocks: np.ndarray) -> np.ndarray:
        return self.exp_of[np.where(blocks != P.END, blocks, len(self.exp_of) - 1)]

    def _drop(self, reason: str, n: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + n

    # -- events -------------------------------------------------------------------------------------
    def start(self, now: float) -> list[tuple[int, bytes]]:
        self.last_progress = now
        self.last_heard[:] = now
        self.ready[:] = True
        return self.flush(now)

    def flush(self, now: float) -> list[tuple[int, bytes]]:
        """Send the next round's entries of every column that got its result since the last flush."""
        cols = np.flatnonzero(self.ready)
        if len(cols) == 0:
            return []
        self.ready[cols] = False
        return self._send(cols, now)

    def poll(self, now: float) -> list[tuple[int, bytes]]:
        """Retransmit the columns whose timer expired; raise ZeroSumTimeout when progress stopped."""
        if self.done:
            return []
        if self.last_progress + self.cfg.timeout <= now:   # the same expression as deadline_at
            raise ZeroSumTimeout(self._timeout_message(now))
        quiet = self.last_heard + self.base_rto <= now   # the same expression as deadline_at
        due = np.flatnonzero((self.deadline <= now) & quiet[self.aggregator_of_column])
        if len(due) == 0:
            return []
        self.rto[due] = np.minimum(self.rto[due] * 2, self.cfg.max_rto)
        self.retransmitted += len(due)
        out = self._send(due, now)
        self.sent_at[due] = np.nan    # Karn's rule: no round-trip samples from retransmitted rounds
        return out

    def receive(self, aggregator: int, datagram, now: float) -> None:
        """Take one datagram from an aggregator; results only mark columns ready (see flush)."""
        self.receive_many([(aggregator, datagram)], now)

    def receive_many(self, datagrams, now: float) -> None:
        """Take several datagrams, as (aggregator index, bytes), in arrival order: the same outcome as
        receiving them one by one, but their results are applied in one vectorised pass (a worker that
        drains a queue of results pays the per-datagram numpy overhead once)."""
        results = [got for a, datagram in datagrams if (got := self._accept(a, datagram, now)) is not None]
        if len(results) == 1:
            d, cols = results[0]
            self._on_result(cols, d.block, d.row, d.exp, d.next, d.next_exp, d.data, now)
        elif results:
            self._on_result(*_merge(results), now, may_repeat=True)

    def _accept(self, aggregator: int, datagram, now: float):
        """Validate one datagram; apply a STATUS; return a RESULT's (datagram, columns), else None."""
        try:
            d = P.decode(datagram)
        except P.ProtocolError as e:
            self._drop(e.reason)
            return None
        h = d.header
        if h.job != self.cfg.job or h.rank != P.AGGREGATOR_RANK:
            self._drop("foreign")
            return None
        if h.type == P.JOIN_ACK:
            return None     # a late answer to a join: harmless
        if h.epoch != self.epoch:
            self._drop("stale_epoch")
            return None
        if h.tensor_blocks != self.layout.nblocks or h.block_size != self.B:
            self._drop("geometry")
            return None
        slots = d.slot
        if len(slots) == 0:
            return None
        if slots.max() >= self.layout.slots_used(aggregator) or P.repeats_a_slot(slots, self._scratch):
            self._drop("range")
            return None
        cols = self.layout.column_of(aggregator, slots)
        self.last_heard[aggregator] = now
        if h.type == P.STATUS:
            current = d.block == self.round_block[cols]
            waiting = cols[current]
            self.waiting_for[waiting] = d.next[current]
            self.status_seen[waiting] = True
            # The aggregator holds our contribution and waits for others: no need to resend soon.
            self.rto[waiting] = np.minimum(self.rto[waiting] * 2, self.cfg.max_rto)
            self.deadline[waiting] = np.maximum(self.deadline[waiting], now + self.rto[waiting])
            return None
        if h.type != P.RESULT:
            self._drop("type")
            return None
        return d, cols

    def _on_result(self, cols, block, rows, exp, nxt, next_exp, data, now: float, may_repeat=False) -> None:
        """Results for `cols`: store the sums, advance the columns. With may_repeat (several datagrams
        merged), a column may appear twice; only its first result for the current round counts, as
        one by one the second would find the round moved on."""
        fresh = block == self.round_block[cols]
        if may_repeat:
            fresh_at = np.flatnonzero(fresh)
            _, first = np.unique(cols[fresh_at], return_index=True)
            if len(first) < len(fresh_at):
                fresh[fresh_at] = False
                fresh[fresh_at[first]] = True
        if not fresh.all():
            self._drop("duplicate_result", int(np.count_nonzero(~fresh)))
            if not fresh.any():
                return
            cols, block, rows = cols[fresh], block[fresh], rows[fresh]
            exp, nxt, next_exp = exp[fresh], nxt[fresh], next_exp[fresh]
        has = rows >= 0
        mine = self._mine(cols)
        sent_data = mine == block
        # One combined test on the fast path; which rule was broken is worked out only when one was.
        exp_bad = has & (exp != self.round_exp[cols])
        dtype_bad = (nxt != P.END) & ((next_exp == P.INT_EXP) != self.is_int)
        if (sent_data & ~has | exp_bad | dtype_bad).any():
            if (sent_data & ~has).any():
                raise ProtocolViolation(f"aggregator {self._agg_name(cols[0])} returned no data for a block "
                                        f"this worker contributed (block {int(block[sent_data & ~has][0])})")
            if exp_bad.any():
                raise ProtocolViolation("result exponent differs from the agreed exponent of its block")
            raise ProtocolViolation("workers disagree on the dtype of this allreduce "
                                    "(float32 and int32 contributions to the same blocks)")
        if has.any():
            sums = data[rows[has]]
            if self.is_int:
                self.output.store(block[has], sums)
            else:
                values = dequantize(sums, exp[has], self.cfg.world)
                if self.divisor is not None:
                    values /= self.divisor
                self.output.store(block[has], values)
        self.mine_pos[cols[sent_data]] += 1
        if (nxt > self._mine(cols)).any():
            raise ProtocolViolation("aggregator skipped a block this worker still has to send")
        self.round_block[cols] = nxt
        self.round_exp[cols] = next_exp
        self._measure(now - self.sent_at[cols])
        self.rto[cols] = self.base_rto
        self.status_seen[cols] = False
        self.last_progress = now
        self.deadline[cols] = np.inf
        self.ready[cols[nxt != P.END]] = True

    def _measure(self, samples: np.ndarray) -> None:
        """Adapt the retransmission timeout to the round-trip times seen (RFC 6298)."""
        samples = samples[~np.isnan(samples)]
        if len(samples) == 0:
            return
        r = float(samples.max())
        if self.srtt is None:
            self.srtt, self.rttvar = r, r / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - r)
            self.srtt = 0.875 * self.srtt + 0.125 * r
        self.base_rto = min(max(self.srtt + 4 * self.rttvar, self.cfg.min_rto), self.cfg.max_rto)

    # -- building datagrams -------------------------------------------------------------------------
    def _send(self, cols: np.ndarray, now: float) -> list[tuple[int, bytes]]:
        """Build this round's entries for `cols`, fused into datagrams per aggregator."""
        self.deadline[cols] = now + self.rto[cols]
        self.sent_at[cols] = now
        agg = self.layout.aggregator_of(cols)
        order = np.lexsort((cols, agg))
        cols, agg = cols[order], agg[order]
        block = self.round_block[cols]
        mine = self._mine(cols)
        has = mine == block
        nxt = np.where(has, self._mine(cols, ahead=1), mine)
        ent = P.entries_array(len(cols))
        ent["slot"] = self.layout.slot_of(cols)
        ent["flags"] = np.where(has, P.HAS_DATA, 0)
        ent["block"] = block
        ent["next"] = nxt
        ent["exp"] = self.round_exp[cols]
        ent["next_exp"] = self._exp(nxt)
        out = []
        bounds = [0, *(np.flatnonzero(np.diff(agg)) + 1).tolist(), len(cols)]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            cuts = P.split_points(has[lo:hi], self.B, self.cfg.max_datagram, self.cfg.max_entries)
            for s, t in zip(cuts[:-1], cuts[1:]):
                s, t = s + lo, t + lo
                out.append((int(agg[s]), self._encode(ent[s:t], block[s:t][has[s:t]])))
        return out

    def _encode(self, ent: np.ndarray, data_blocks: np.ndarray) -> bytes:
        buf = bytearray(P.datagram_size(len(ent), len(data_blocks), self.B))
        n = P.encode_into(buf, self.header, ent)
        if len(data_blocks):
            wire = np.frombuffer(buf, P.WIRE_VALUE, offset=n).reshape(len(data_blocks), self.B)
            if self.is_int:
                wire[...] = self.view.rows(data_blocks)
            else:
                exps = ent["exp"][ent["flags"] != 0]
                on_device = getattr(self.view, "quantized", None)   # torch tensors: quantise there
                if on_device is not None:
                    wire[...] = on_device(data_blocks, exps, self.cfg.world)
                else:
                    quantize(self.view.rows(data_blocks), exps, self.cfg.world, out=wire, overwrite=True)
        self.bytes_sent += len(buf)
        return bytes(buf)

    # -- errors -------------------------------------------------------------------------------------
    def _agg_name(self, col) -> str:
        a = int(self.layout.aggregator_of(np.int64(col)))
        names = self.cfg.aggregator_names
        return names[a] if a < len(names) else f"#{a}"

    def _timeout_message(self, now: float) -> str:
        pending = np.flatnonzero(self.round_block != P.END)
        heard = self.status_seen[pending]
        head = (f"allreduce {self.epoch} of rank {self.cfg.rank} made no progress for "
                f"{now - self.last_progress:.1f} s ({len(pending)} of {self.layout.columns} columns unfinished)")
        if heard.any():
            everyone = (1 << self.cfg.world) - 1
            missing = 0
            for bitmap in self.waiting_for[pending[heard]]:
                missing |= everyone & ~int(bitmap)
            missing &= ~(1 << self.cfg.rank)
            ranks = [r for r in range(self.cfg.world) if missing >> r & 1]
            if ranks:
                return (f"{head}: waiting for rank{'s' if len(ranks) > 1 else ''} "
                        f"{', '.join(map(str, ranks))} (the aggregator has not heard from "
                        f"{'them' if len(ranks) > 1 else 'it'}; is it dead?)")
        names = sorted({self._agg_name(c) for c in pending[~heard]} or {self._agg_name(pending[0])})
        return (f"{head}: no answer from aggregator {', '.join(names)} "
                f"(is it running, and started with --workers {self.cfg.world}?)")


def _merge(results):
    """Several RESULT datagrams as one set of entries, in arrival order (data rows renumbered)."""
    def cat(field):
        return np.concatenate([getattr(d, field) for d, _ in results])
    rows, offset = [], 0
    for d, _ in results:
        rows.append(np.where(d.row >= 0, d.row + offset, -1))
        offset += len(d.data)
    data = np.concatenate([d.data for d, _ in results]) if offset else results[0][0].data
    cols = np.concatenate([c for _, c in results])
    return cols, cat("block"), np.concatenate(rows), cat("exp"), cat("next"), cat("next_exp"), data
