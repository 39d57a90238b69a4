"""The aggregator's side of the protocol, as a pure state machine (no sockets, no clocks).

The driver interface is the worker machine's (and h11's / aioquic's): `receive(datagram, source, now)`
takes one datagram and the opaque address it came from; `datagrams_to_send(now)` returns what is to be
sent as (destination addresses, datagram): the replies to what was received (JOIN_ACKs, STATUS, shadow
results for retransmissions), then the RESULT datagrams of the rounds completed since the last call, for
all workers; `timer()` is when the machine next needs `datagrams_to_send` without a datagram (never: a
job's aggregation has no timers of its own, R-A*; the service's job expiry has). A server calls
`datagrams_to_send` when its socket has nothing more queued (or once per received batch), so that when it
is busy, the rounds completed by many contributions go out in few, full datagrams.

The data path (validation, the int32 add, completion, RESULT and STATUS encoding) is in
zerosum.aggregator_kernels, over the job's SlotTable; this class keeps membership and the control flow
per datagram (the server's compiled driver, aggregator_kernels.serve, takes members' DATA past it over
the same table). Slot state is one int64 register array (slots x registers) with the P4 program's
register names (aggregator_kernels.REGISTERS:
slot_epoch, slot_block, slot_exp, bitmap, count, min_next, min_next_exp, has_data, and for idempotent
retransmissions the previous round: prev_epoch, prev_block, prev_next, prev_exp, prev_next_exp,
prev_has_data; congestion, prev_congestion: a contribution arrived marked CE, R-E1; and bank), plus the
`pool` of sums: two banks per slot (2 x slots x block_size int32), one summing the current round, the
other holding the previous round's result, flipped when a round completes, as on the switch.
Counters are one int64 array indexed by COUNTERS (docs/protocol.md, "Counters").
"""
from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from . import aggregator_kernels as AK
from . import transport as T
from . import protocol as P

from .spec import COUNTER_INDEX as C
from .spec import COUNTERS


class Counters(Mapping):
    """The counters as a read-only mapping name -> count (the names users see), over one int64 array.
    Like a dict of what happened: counters still at zero are not listed."""

    def __init__(self):
        self.array = np.zeros(len(COUNTERS), np.int64)

    def __getitem__(self, name: str) -> int:
        value = int(self.array[C[name]])
        if not value:
            raise KeyError(name)
        return value

    def __iter__(self):
        return (name for name, v in zip(COUNTERS, self.array.tolist()) if v)

    def __len__(self) -> int:
        return int(np.count_nonzero(self.array))

    def add(self, name: str, n: int = 1) -> None:
        self.array[C[name]] += n


@dataclass
class Member:
    address: object
    nonce: int
    left: bool = False    # sent LEAVE: its run is over (kept, so that its next JOIN restarts the job)


@dataclass
class JobState:
    job: int
    world: int
    slots: int
    max_datagram: int = P.MAX_DATAGRAM
    multicast: tuple | None = None     # (group, port) that results go to, instead of to each member
    block_size: int = 0
    members: dict[int, Member] = field(default_factory=dict)

    @property
    def joined_bitmap(self) -> int:
        return sum(1 << r for r, m in self.members.items() if not m.left)

    def allocate(self, block_size: int, counters: np.ndarray) -> None:
        """(Re)initialise the slot registers for a new set of workers (counting on in `counters`)."""
        self.block_size = block_size
        group = -1 if self.multicast is None else T.address_key(self.multicast)
        self.table = AK.slot_table(self.job, self.world, self.slots, block_size, self.max_datagram, counters,
                                   group)
        self.regs, self.pool = self.table.regs, self.table.pool

    def __getattr__(self, name: str):
        # The registers by name, as views of one column of `regs` (e.g. state.bitmap).
        if name in AK.REGISTERS and "regs" in self.__dict__:
            return self.__dict__["regs"][:, AK.REGISTERS.index(name)]
        raise AttributeError(name)


class AggregatorMachine:
    """Serves one job: `world` workers, `slots` aggregation slots of up to `max_block_size` values each."""

    def __init__(self, job: int, world: int, slots: int = 2048, max_block_size: int = 4096,
                 max_datagram: int = P.MAX_DATAGRAM, multicast: tuple | None = None):
        """multicast: (group address, port): the RESULTs of completed rounds go there once, for every
        member, instead of to each (JOIN_ACK says so with FEATURE_MULTICAST)."""
        if not 1 <= world <= P.MAX_WORLD:
            raise ValueError(f"world size must be 1..{P.MAX_WORLD}, got {world}")
        if not 1 <= slots <= 0xFFFF:
            raise ValueError(f"slots must be 1..65535, got {slots}")
        self.state = JobState(job, world, slots, max_datagram, multicast)
        self.max_block_size = max_block_size
        self.counters = Counters()
        self.state.allocate(1, self.counters.array)
        self.table = self.state.table
        self._outbox: list[tuple[list, bytes]] = []

    @property
    def has_output(self) -> bool:
        """Whether `datagrams_to_send` has something to send: replies, or results of completed rounds."""
        return bool(self._outbox) or bool(self.table.counts[AK.DONE])

    def count(self, name: str, n: int = 1) -> None:
        self.counters.add(name, n)

    TAKES = frozenset((P.JOIN, P.DATA, P.LEAVE))   # R-V3 (STATS is the service's)

    def receive(self, datagram, source, now: float, ce: bool = False) -> None:
        """One datagram, validated in the order of docs/protocol.md "Validation" (R-V1 ... R-V10); `ce`:
        it arrived with the ECN Congestion Experienced mark (R-E1).
        (`now` for the driver interface's sake: no rule of a job's aggregation depends on time.)"""
        reason, fields = P.check(datagram, self.TAKES)             # R-V1 ... R-V5
        if reason:
            self.count(reason)
            return
        self.receive_checked(datagram, fields, source, ce)

    def datagrams_to_send(self, now: float, *, results: bool = True) -> list[tuple[list, bytes]]:
        """The replies queued since the last call, then the RESULTs of the rounds completed since.
        results=False: the replies only; the completed rounds wait for a later call (a driver whose
        socket has more queued lets them fuse with the rounds those datagrams complete)."""
        if results:
            self.table.state[AK.USED] = 0
            AK.flush_results(self.table)
            self._take(None)
        out, self._outbox = self._outbox, []
        return out

    def timer(self) -> float:
        return float("inf")

    def receive_checked(self, datagram, fields: tuple, source, ce: bool = False) -> None:
        """A datagram that passed protocol.check (an AggregatorService checks once for all its jobs)."""
        self.table.state[AK.USED] = 0
        _, ptype, job, rank, world, epoch, tensor_blocks, block_size, nent = fields
        s = self.state
        if job != s.job:
            self.count("drop_foreign_job")                         # R-V7
            return
        if ptype == P.JOIN:
            # (a JOIN's MAC, when the aggregator has a key, was checked by the service: R-V6)
            self._join(rank, world, epoch, block_size, source)
            return
        member = s.members.get(rank)
        if member is None or member.address != source or (      # R-V8
                member.nonce != epoch if ptype == P.LEAVE else member.left):
            self.count("drop_not_member")
            return
        if ptype == P.LEAVE:
            if not member.left:
                member.left = True                                 # R-J5
                self.count("leaves")
                self.table.accept[rank] = -1
            return
        if world != s.world or block_size != s.block_size:
            self.count("drop_geometry")                            # R-V10
            return
        AK.handle_data(self.table, np.frombuffer(datagram, np.uint8), len(datagram), nent, epoch,
                       tensor_blocks, rank, ce)
        self._take(source)

    # -- membership ---------------------------------------------------------------------------------
    def _join(self, rank: int, world: int, nonce: int, block_size: int, source) -> None:
        s = self.state
        if world != s.world:                                       # R-V9, R-J6: refused, naming the job's
            self._refuse("drop_join_world", source)
            return
        if rank >= s.world:                                        # R-V9
            self.count("drop_join_world")
            return
        if not 1 <= block_size <= self.max_block_size:
            self.count("drop_join_block_size")
            return
        member = s.members.get(rank)
        restart = member is not None and member.nonce != nonce     # R-J3: a new incarnation of the rank
        # R-V9 before R-J3 (as the switch checks): a JOIN of another block size is refused, naming the
        # job's (R-J6); it restarts the job only once every rank has left.
        if s.members and block_size != s.block_size and not (restart and self.idle):
            self._refuse("drop_join_block_size", source)
            return
        if member is not None and member.nonce == nonce and member.address != source and not member.left:
            # R-J4: the rank's own JOIN again, from elsewhere: a replay (its answer would move the rank)
            self.count("drop_replay")
            return
        if restart:
            # R-J3: a new run of the job starts from scratch.
            self.count("job_restarts")
            s.members.clear()
        if not s.members:
            s.allocate(block_size, self.counters.array)
            self.table = s.table
        s.members[rank] = Member(source, nonce)
        self._addresses()
        self.count("joins")
        features = P.FEATURE_LEAVE | (P.FEATURE_MULTICAST if s.multicast else 0)
        header = P.Header(P.JOIN_ACK, s.job, P.AGGREGATOR_RANK, s.world, nonce, features, s.block_size, 0)
        self._outbox.append(([source], P.encode(header, body=P.JOIN_ACK_BODY.pack(s.slots, s.joined_bitmap))))

    def _refuse(self, counter: str, source) -> None:
        """R-J6: REFUSED, reason CONFLICT, naming the job's world and block size (0: no member yet)."""
        s = self.state
        self.count(counter)
        self._outbox.append(([source], P.refused(s.job, s.world, s.block_size if s.members else 0,
                                                 P.REFUSED_CONFLICT)))

    def _addresses(self) -> None:
        """The members' addresses as the compiled driver knows them (ip << 16 | port), where they are
        IPv4 (address, port) pairs (tests may use any object: those only take the Python path)."""
        t = self.table
        t.accept[:] = -1
        t.members[:] = -1
        for r, m in self.state.members.items():
            key = _address_key(m.address)
            t.members[r] = key
            t.accept[r] = -1 if m.left else key

    @property
    def idle(self) -> bool:
        """Every registered rank has left (or none joined yet)."""
        return all(m.left for m in self.state.members.values())

    # -- the data path ------------------------------------------------------------------------------
    def _take(self, source) -> None:
        """Queue the datagrams the kernels listed since the last call: to every member, or to `source`
        (copied: the kernels' buffer is reused by the next call)."""
        t = self.table
        n = int(t.state[AK.NCUTS])
        if not n:
            return
        t.state[AK.NCUTS] = 0
        wire = t.wire
        everyone = ([self.state.multicast] if self.state.multicast else
                    [m.address for _, m in sorted(self.state.members.items())])
        self._outbox += [(everyone if to_all else [source], wire[a:b].tobytes())
                         for a, b, to_all in t.cuts[:n].tolist()]


def _address_key(address) -> int:
    try:
        return T.address_key(address)
    except (TypeError, ValueError, OSError, IndexError):
        return -1


def new_nonce() -> int:
    """A random 32-bit session nonce for JOIN (tells a restarted worker from a retransmitted JOIN)."""
    return secrets.randbits(32)
