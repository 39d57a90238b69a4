"""The aggregator's side of the protocol, as a pure state machine (no sockets, no clocks).

`receive(datagram, source)` takes one datagram and the opaque address it came from and returns the
replies to send at once as (destination addresses, bytes): JOIN_ACKs, STATUS and shadow results for
retransmissions. Completed rounds are collected, and `flush()` returns their RESULT datagrams for all
workers: a server calls it when its socket has nothing more queued, so that when it is busy, the rounds
completed by many contributions go out in few, full datagrams. Slot state lives in arrays indexed by slot, and each datagram's
entries are processed together with numpy, as a switch pipeline processes one packet's fields.

The same names as the P4 program (switch_p4/) are used for the per-slot registers:
  slot_epoch, slot_block (the current round's block), slot_exp (its agreed exponent), bitmap, count,
  min_next, min_next_exp, has_data, acc (the running sum) and, for idempotent retransmissions, the
  shadow copy of the previous round's result: shadow, prev_epoch, prev_block, prev_next, prev_exp,
  prev_next_exp, prev_has_data.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np

from . import protocol as P


def newer(a: np.ndarray | int, b: np.ndarray | int):
    """Serial-number comparison of 32-bit epochs (RFC 1982): a is after b."""
    d = (np.asarray(a, np.int64) - np.asarray(b, np.int64)) & 0xFFFFFFFF
    return (d != 0) & (d < 0x80000000)


@dataclass
class Member:
    address: object
    nonce: int


@dataclass
class JobState:
    job: int
    world: int
    slots: int
    block_size: int = 0
    members: dict[int, Member] = field(default_factory=dict)

    @property
    def joined_bitmap(self) -> int:
        return sum(1 << r for r in self.members)

    def allocate(self, block_size: int) -> None:
        """(Re)initialise the slot registers for a new set of workers."""
        n, self.block_size = self.slots, block_size
        self.slot_epoch = np.zeros(n, np.int64)
        self.slot_block = np.full(n, P.END, np.int64)
        self.slot_exp = np.full(n, P.NO_EXP, np.int64)
        self.slot_tensor_blocks = np.zeros(n, np.int64)
        self.bitmap = np.zeros(n, np.int64)
        self.count = np.zeros(n, np.int64)
        self.min_next = np.full(n, P.END, np.int64)
        self.min_next_exp = np.full(n, P.NO_EXP, np.int64)
        self.has_data = np.zeros(n, bool)
        self.acc = np.zeros((n, block_size), np.int32)
        self.shadow = np.zeros((n, block_size), np.int32)
        self.prev_epoch = np.zeros(n, np.int64)
        self.prev_block = np.full(n, P.END, np.int64)
        self.prev_next = np.full(n, P.END, np.int64)
        self.prev_exp = np.full(n, P.NO_EXP, np.int64)
        self.prev_next_exp = np.full(n, P.NO_EXP, np.int64)
        self.prev_has_data = np.zeros(n, bool)


class AggregatorMachine:
    """Serves one job: `world` workers, `slots` aggregation slots of up to `max_block_size` values each."""

    def __init__(self, job: int, world: int, slots: int = 2048, max_block_size: int = 4096,
                 max_datagram: int = P.MAX_DATAGRAM):
        if not 1 <= world <= P.MAX_WORLD:
            raise ValueError(f"world size must be 1..{P.MAX_WORLD}, got {world}")
        if not 1 <= slots <= 0xFFFF:
            raise ValueError(f"slots must be 1..65535, got {slots}")
        self.state = JobState(job, world, slots)
        self._scratch = np.zeros(slots, np.int64)
        self.max_block_size = max_block_size
        self.max_datagram = max_datagram
        self.counters: dict[str, int] = {}
        self.completed: dict[tuple[int, int], list[np.ndarray]] = {}   # (epoch, tensor_blocks) -> slots

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _header(self, ptype: int, epoch: int = 0, tensor_blocks: int = 0, entries: int = 0) -> P.Header:
        s = self.state
        return P.Header(ptype, s.job, P.AGGREGATOR_RANK, s.world, epoch, tensor_blocks, s.block_size, entries)

    def receive(self, datagram, source) -> list[tuple[list, bytes]]:
        try:
            d = P.decode(datagram)
        except P.ProtocolError as e:
            self.count(f"drop_{e.reason}")
            return []
        h, s = d.header, self.state
        if h.job != s.job:
            self.count("drop_foreign_job")
            return []
        if h.type == P.JOIN:
            return self._join(h, source)
        if h.type != P.DATA:
            self.count("drop_type")
            return []
        member = s.members.get(h.rank)
        if member is None or member.address != source:
            self.count("drop_not_member")
            return []
        if h.world != s.world or h.block_size != s.block_size:
            self.count("drop_geometry")
            return []
        self.count("datagrams")
        return self._data(d, source)

    # -- membership ---------------------------------------------------------------------------------
    def _join(self, h: P.Header, source) -> list[tuple[list, bytes]]:
        s = self.state
        if h.world != s.world or h.rank >= s.world:
            self.count("drop_join_world")
            return []
        if not 1 <= h.block_size <= self.max_block_size:
            self.count("drop_join_block_size")
            return []
        member = s.members.get(h.rank)
        if member is not None and member.nonce != h.epoch:
            # A new incarnation of a registered rank: a new run of the job starts from scratch.
            self.count("job_restarts")
            s.members.clear()
        if s.members and h.block_size != s.block_size:
            self.count("drop_join_block_size")
            return []
        if not s.members:
            s.allocate(h.block_size)
            self.completed.clear()
        s.members[h.rank] = Member(source, h.epoch)
        self.count("joins")
        ack = P.encode(self._header(P.JOIN_ACK, epoch=h.epoch), body=P.JOIN_ACK_BODY.pack(s.slots, s.joined_bitmap))
        return [([source], ack)]

    # -- the data path ------------------------------------------------------------------------------
    def _data(self, d: P.Datagram, source) -> list[tuple[list, bytes]]:
        s, h = self.state, d.header
        slot, block = d.slot, d.block
        if len(slot) == 0:
            return []
        if slot.max() >= s.slots or P.repeats_a_slot(slot, self._scratch):
            self.count("drop_range")
            return []
        epoch = h.epoch
        rank_bit = np.int64(1) << h.rank

        # A bootstrap entry of a newer epoch starts the slot's next allreduce. The previous round
        # (prev_*, shadow) is kept: a worker that lost the last result of the old epoch still gets it.
        boot = (block == P.BOOT) & newer(epoch, s.slot_epoch[slot])
        if boot.any():
            b = slot[boot]
            s.slot_epoch[b] = epoch
            s.slot_block[b] = P.BOOT
            s.slot_exp[b] = P.NO_EXP
            s.slot_tensor_blocks[b] = h.tensor_blocks
            s.bitmap[b] = 0
            s.count[b] = 0
            s.min_next[b] = P.END
            s.min_next_exp[b] = P.NO_EXP
            partial = b[s.has_data[b]]      # an abandoned round left a partial sum behind
            s.acc[partial] = 0
            s.has_data[b] = False

        current = (s.slot_epoch[slot] == epoch) & (block == s.slot_block[slot])
        dup = current & ((s.bitmap[slot] & rank_bit) != 0)
        fresh = current & ~dup
        previous = ~current & (s.prev_epoch[slot] == epoch) & (s.prev_block[slot] == block)
        stale = ~(current | previous)
        if stale.any():
            self.count("drop_stale", int(np.count_nonzero(stale)))

        bad = fresh & ((d.has & (d.exp != s.slot_exp[slot])) | (s.slot_tensor_blocks[slot] != h.tensor_blocks))
        if bad.any():
            # The worker disagrees with the slot about the block's exponent or the tensor: never add it.
            self.count("drop_mismatch", int(np.count_nonzero(bad)))
            fresh &= ~bad

        out: list[tuple[list, bytes]] = []
        if fresh.any():
            out += self._accumulate(d, fresh, rank_bit)
        if dup.any():
            self.count("duplicates", int(np.count_nonzero(dup)))
            out.append(([source], self._status(slot[dup], epoch, h.tensor_blocks)))
        if previous.any():
            self.count("retransmissions_answered", int(np.count_nonzero(previous)))
            out += [([source], r) for r in self._shadow_results(slot[previous], epoch, h.tensor_blocks)]
        return out

    def _accumulate(self, d: P.Datagram, fresh: np.ndarray, rank_bit) -> list[tuple[list, bytes]]:
        s = self.state
        if fresh.all():
            slot, has, nxt, nexp = d.slot, d.has, d.next, d.next_exp
            data = d.data
        else:
            slot, has, nxt, nexp = d.slot[fresh], d.has[fresh], d.next[fresh], d.next_exp[fresh]
            data = d.data[d.row[fresh & d.has]]
        if len(data):
            # Slots are unique within a datagram, so the fancy-indexed add touches each row once.
            dst = slot[has]
            s.acc[dst] += data
            s.has_data[dst] = True
        s.bitmap[slot] |= rank_bit
        s.count[slot] += 1
        cur_min, cur_exp = s.min_next[slot], s.min_next_exp[slot]
        less, same = nxt < cur_min, nxt == cur_min
        s.min_next[slot] = np.where(less, nxt, cur_min)
        s.min_next_exp[slot] = np.where(less, nexp, np.where(same, np.maximum(cur_exp, nexp), cur_exp))

        done = slot[s.count[slot] == s.world]
        if len(done) == 0:
            return []
        # The round is complete: its result becomes the shadow copy, the slot moves to the minimum next.
        with_data = done[s.has_data[done]]   # header-only rounds have nothing to copy or clear
        s.shadow[with_data] = s.acc[with_data]
        s.acc[with_data] = 0
        s.prev_epoch[done] = s.slot_epoch[done]
        s.prev_block[done] = s.slot_block[done]
        s.prev_next[done] = s.min_next[done]
        s.prev_exp[done] = s.slot_exp[done]
        s.prev_next_exp[done] = s.min_next_exp[done]
        s.prev_has_data[done] = s.has_data[done]
        s.slot_block[done] = s.min_next[done]
        s.slot_exp[done] = s.min_next_exp[done]
        s.bitmap[done] = 0
        s.count[done] = 0
        s.min_next[done] = P.END
        s.min_next_exp[done] = P.NO_EXP
        s.has_data[done] = False
        self.count("rounds", len(done))
        self.completed.setdefault((d.header.epoch, d.header.tensor_blocks), []).append(done)
        return []

    def flush(self) -> list[tuple[list, bytes]]:
        """RESULT datagrams, for every worker, of the rounds completed since the last flush."""
        if not self.completed:
            return []
        addresses = [m.address for _, m in sorted(self.state.members.items())]
        out = []
        for (epoch, tensor_blocks), parts in self.completed.items():
            slots = parts[0] if len(parts) == 1 else np.concatenate(parts)
            out += [(addresses, r) for r in self._shadow_results(slots, epoch, tensor_blocks)]
        self.completed.clear()
        return out

    def _shadow_results(self, slot: np.ndarray, epoch: int, tensor_blocks: int) -> list[bytes]:
        """RESULT datagrams for these slots' previous rounds (a result may need more datagrams than
        the contribution that completed it: other workers' data makes it larger)."""
        has = self.state.prev_has_data[slot]
        cuts = P.split_points(has, self.state.block_size, self.max_datagram)
        return [self._shadow_result(slot[a:b], epoch, tensor_blocks)
                for a, b in zip(cuts[:-1], cuts[1:])]

    def _shadow_result(self, slot: np.ndarray, epoch: int, tensor_blocks: int) -> bytes:
        s = self.state
        ent = P.entries_array(len(slot))
        ent["slot"] = slot
        has = s.prev_has_data[slot]
        ent["flags"] = np.where(has, P.HAS_DATA, 0)
        ent["block"] = s.prev_block[slot]
        ent["next"] = s.prev_next[slot]
        ent["exp"] = s.prev_exp[slot]
        ent["next_exp"] = s.prev_next_exp[slot]
        return P.encode(self._header(P.RESULT, epoch, tensor_blocks), ent, s.shadow[slot[has]])

    def _status(self, slot: np.ndarray, epoch: int, tensor_blocks: int) -> bytes:
        s = self.state
        ent = P.entries_array(len(slot))
        ent["slot"] = slot
        ent["block"] = s.slot_block[slot]
        ent["next"] = s.bitmap[slot]
        ent["exp"] = P.NO_EXP
        ent["next_exp"] = P.NO_EXP
        return P.encode(self._header(P.STATUS, epoch, tensor_blocks), ent)


def new_nonce() -> int:
    """A random 32-bit session nonce for JOIN (tells a restarted worker from a retransmitted JOIN)."""
    return secrets.randbits(32)
