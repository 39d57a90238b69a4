"""Each allreduce through ZeroSum or gloo's ring, whichever is faster at its density (zerosum.hybrid
decides, this module runs it on torch tensors), and training that survives its aggregator (Failover)."""
from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import torch
from torch.distributed import AllreduceOptions, ReduceOp

from . import hybrid
from .errors import ZeroSumError
from .worker import Worker


def ring_allreduce(group, tensor: torch.Tensor, op=ReduceOp.SUM, timeout: float | None = None) -> None:
    """`tensor` reduced over `group` in place (its own collective, not the default group's); raises
    RuntimeError after `timeout` seconds if given."""
    opts = AllreduceOptions()
    opts.reduceOp = op
    work = group.allreduce([tensor], opts)
    if timeout is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=timeout))


def path_choice(paths: str, ring) -> "hybrid.PathChoice | None":
    """paths="zerosum": None (every allreduce through ZeroSum); "auto": a PathChoice whose agreements
    (the maximum over ranks) run on `ring`."""
    if paths == "zerosum":
        return None
    if paths != "auto":
        raise ValueError(f"paths must be 'zerosum' or 'auto', got {paths!r}")
    if ring is None:
        raise ValueError("paths='auto' needs a ring: a gloo process group (ring=...), or "
                         "torch.distributed initialised with one")

    def agree(values):
        t = torch.tensor(np.asarray(values, np.float64))
        ring_allreduce(ring, t, ReduceOp.MAX)
        return t.numpy()
    return hybrid.PathChoice(agree)


def union_density(t: torch.Tensor, block_size: int) -> float:
    """The share of t's blocks of `block_size` values that hold a non-zero value."""
    flat = t.reshape(-1)
    n = flat.numel()
    full = n // block_size * block_size
    nonzero = int((flat[:full].view(-1, block_size) != 0).any(1).sum())
    if n > full and bool((flat[full:] != 0).any()):
        nonzero += 1
    return nonzero / max(1, -(-n // block_size))


CALIBRATION_VALUES = (1 << 16, 1 << 21)    # the calibration buffer: a bucket's size within these
SILENCE = 1.0     # paths="auto": seconds of an aggregator's silence after which the ranks go on without it
# seconds a rank waits for the others in the failover's agreements (they may be up to a backward pass and
# their own detection apart) before it raises: a rank that is dead or cut off from this one
AGREEMENT_TIMEOUT = 60.0


def reduce_on_chosen_path(paths, key, tensor: torch.Tensor, worker: Worker, lock, ring,
                          average: bool = False) -> bool:
    """Sum `tensor` (contiguous, on any device) over the ranks in place, through ZeroSum (averaged with
    `average`) or through the ring, as `paths` chooses for `key`; timed and reported to `paths`. The
    first call calibrates `paths` (a few ZeroSum allreduces of a zero and a dense buffer). Returns
    whether the ring took it (then the sum is not averaged)."""
    if paths.base is None:
        n = min(max(tensor.numel(), CALIBRATION_VALUES[0]), CALIBRATION_VALUES[1])

        def timed(density):
            # on the bucket's device: a CUDA bucket's time includes its copies to and from the host
            x = (torch.zeros if density == 0 else torch.ones)(n, device=tensor.device)
            with lock:
                start = time.perf_counter()
                worker.allreduce(x, out=x)
                return time.perf_counter() - start
        timed(1.0)                       # warm: the first allreduce of a size allocates
        paths.calibrate(timed)
    path = paths.choose(key)
    start = time.perf_counter()
    if path == hybrid.RING:
        ring_allreduce(ring, tensor)
        seconds = time.perf_counter() - start
        density = union_density(tensor, worker.block_size) if paths.scan_due(key, path) else None
    else:
        with lock:
            start = time.perf_counter()
            worker.allreduce(tensor, out=tensor, average=average)
            seconds = time.perf_counter() - start
        union, blocks = worker.last_union
        density = union / blocks if blocks else 0.0
    paths.observe(key, path, tensor.numel() * tensor.element_size(), seconds, density)
    return path == hybrid.RING


class Failover:
    """Training that survives its aggregator (the hook with paths="auto"): when an aggregator falls silent
    (AggregatorSilent, R-L7), the ranks agree where they are, finish the bucket it left unfinished from
    what each rank has, send the following buckets through the ring, and go back to ZeroSum once every
    rank has joined an aggregator again (Worker.poll_rejoin: a restarted one). No step is lost or applied
    twice, and every rank applies the same update.

    Where the ranks can be when an aggregator dies: a rank completes bucket k only once every rank has
    sent all of k, so the ranks stand at most one bucket apart, at k ("failed at k": some of its blocks
    final, the rest still its input) and at k + 1 (k complete). The ranks that fail agree on every rank's
    position (`statuses`, one small ring allreduce, only after a failure); then:

    - bucket k: if some rank completed it, the lowest such rank broadcasts its result (still in the
      bucket's buffer: DDP writes into a bucket again only in the next backward pass, which cannot begin
      before every bucket of this one is done); otherwise it is finished from the pieces (`finish`):
      blocks that some rank received are final (the maximum over ranks of the received values, identical
      wherever received), the others are the ring sum of the inputs, which every rank still holds there;
    - bucket k + 1 is finished the same way by every rank when it gets to it (a rank that had started
      it holds some final blocks, the others none);
    - then every bucket goes through the ring; at the end of each iteration the ranks agree whether every
      rank has rejoined, and then go back to ZeroSum. With `standby` aggregators, the ranks turn to them
      (all at the same iteration, by the agreed time down) when the failed ones have not come back within
      `standby_after` seconds, and back again after as long, until one set answers.

    One case cannot be repaired: bucket k was the last of its iteration, and a rank that completed it has
    gone on to the next iteration's backward pass, which overwrote k's buffer (the aggregator would have
    had to die between sending k's last results to one rank and to another). Then every rank raises the
    same error instead of applying different updates. Guarding against it would cost an agreement in every
    iteration (on 2 shared cores one small ring allreduce took ~7 ms a step).
    """

    def __init__(self, worker: Worker, ring, lock, standby=None, standby_after: float = 2.0,
                 timeout: float = AGREEMENT_TIMEOUT):
        self.worker, self.ring, self.lock = worker, ring, lock
        self.timeout = timeout         # a rank that does not take part in an agreement this long: an error
        # aggregators to turn to when the failed ones have not come back within `standby_after` seconds
        # (the failed ones become the standby in turn)
        self.standby = list(standby) if standby else None
        self.standby_after = standby_after
        self.down_at = 0.0             # when this rank went down (its own clock)
        self.switched_at = 0.0         # agreed seconds down at the last turn to the standby
        self.world, self.rank = worker.world_size, worker.rank
        self.down = False              # the aggregator is gone: every bucket through the ring
        self.down_since: int | None = None   # the bucket at which it went (the agreed lowest position)
        self.pending: int | None = None   # the bucket every rank finishes from the pieces when it gets to it
        self.previous = None           # (seq, tensor holding its result, last of its iteration) of the last
        #                                bucket completed
        self.failures = 0
        self.recovered = 0             # buckets finished from the pieces or taken from another rank
        self.ring_buckets = 0          # buckets sent through the ring because the aggregator was gone
        self.rejoins = 0

    def _reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM) -> None:
        """A collective of the failover over the ring, or a clear error if the ranks cannot all take part."""
        try:
            ring_allreduce(self.ring, tensor, op, self.timeout)
        except RuntimeError as e:
            raise self._unreachable(e) from e

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        try:
            self.ring.broadcast([tensor], src).wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise self._unreachable(e) from e

    def _unreachable(self, e) -> ZeroSumError:
        return ZeroSumError(f"rank {self.rank}: the ranks could not agree through the ring within {self.timeout:.0f} s "
                            f"after the aggregator failed ({e}): a rank is dead or cannot reach this one "
                            "(partitioned); this step's update was not applied")

    def statuses(self, seq: int, joined: bool = True, previous_last: bool = False, down_for: float = 0.0):
        """Every rank's position (the first bucket it has not completed), whether it has rejoined, and
        whether its previous bucket was the last of an iteration (three vectors over the ranks), and the
        longest any rank has been down (seconds)."""
        w = self.world
        v = torch.full((3 * w + 1,), -1.0, dtype=torch.float64)
        v[self.rank] = seq
        v[w + self.rank] = 1.0 if joined else 0.0
        v[2 * w + self.rank] = 1.0 if previous_last else 0.0
        v[3 * w] = down_for
        self._reduce(v, ReduceOp.MAX)
        v = v.numpy()
        return v[:w].astype(np.int64), v[w:2 * w] > 0, v[2 * w:3 * w] > 0, float(v[3 * w])

    def finish(self, tensor: torch.Tensor, received, average: bool) -> None:
        """Finish a bucket from the pieces (class docstring): `received`, per block, whether this rank's
        tensor holds its final sum there (None: nowhere, the tensor is all input)."""
        B = self.worker.block_size
        n = tensor.numel()
        nblocks = -(-n // B)
        mine = torch.zeros(nblocks) if received is None else torch.from_numpy(np.asarray(received, np.float32))
        anyone = mine.clone()
        self._reduce(anyone, ReduceOp.MAX)
        flat = tensor.view(-1)
        mine_v = mine.repeat_interleave(B)[:n].bool().to(flat.device)
        anyone_v = anyone.repeat_interleave(B)[:n].bool().to(flat.device)
        final = torch.where(mine_v, flat, torch.tensor(float("-inf"), dtype=flat.dtype, device=flat.device))
        self._reduce(final, ReduceOp.MAX)
        inputs = torch.where(anyone_v, torch.zeros((), dtype=flat.dtype, device=flat.device), flat)
        self._reduce(inputs)
        if average:
            inputs.div_(self.world)
        flat.copy_(torch.where(anyone_v, final, inputs))
        self.recovered += 1

    def failed(self, seq: int, tensor: torch.Tensor, received, average: bool) -> None:
        """This rank's allreduce of bucket `seq` raised AggregatorSilent: agree, then finish it."""
        self.failures += 1
        previous_last = self.previous is not None and self.previous[0] == seq - 1 and self.previous[2]
        positions, _, lasts, _ = self.statuses(seq, previous_last=previous_last)
        low, high = int(positions.min()), int(positions.max())
        if high - low > 1:
            raise ZeroSumError(f"ranks are more than one bucket apart after the aggregator failed "
                               f"({positions.tolist()}): cannot agree on the buckets to finish")
        self.down, self.down_since = True, low
        self.down_at, self.switched_at = time.monotonic(), 0.0
        if high == low:
            self.finish(tensor, received, average)
            return
        # bucket `low` from a rank that completed it; the ranks at `high` then finish that one
        src = int(np.flatnonzero(positions == high)[0])
        if lasts[src]:
            raise ZeroSumError(
                f"the aggregator failed while ranks {np.flatnonzero(positions == low).tolist()} waited for the last "
                f"results of an iteration that ranks {np.flatnonzero(positions == high).tolist()} had completed and "
                "gone past: that bucket cannot be finished the same way on every rank (restart from a checkpoint)")
        if seq == low:
            self._broadcast(tensor, src)
            self.pending = high
        else:
            held_seq, held, _ = self.previous
            self._broadcast(held, src)
            self.finish(tensor, received, average)
        self.recovered += 1

    def before(self, seq: int, tensor: torch.Tensor, average: bool) -> bool:
        """Before bucket `seq`: finish it from the pieces if it is the agreed pending one (returns True:
        done), else False (send it through the ring when `down`, else by its chosen path)."""
        if self.pending is not None and seq == self.pending:
            self.pending = None
            self.finish(tensor, None, average)
            return True
        return False

    def completed(self, seq: int, result: torch.Tensor, last: bool) -> None:
        self.previous = (seq, result, last)

    def end_of_iteration(self, last_seq: int) -> None:
        """After an iteration's last bucket, while the aggregator is gone (and was gone before that bucket,
        so that every rank gets here): whether every rank has rejoined one; then back to ZeroSum."""
        if not self.down or self.down_since >= last_seq:
            return
        with self.lock:
            joined = self.worker.poll_rejoin()
        _, rejoined, _, down_for = self.statuses(last_seq + 1, joined, down_for=time.monotonic() - self.down_at)
        if rejoined.all() and self.pending is None:
            self.down, self.down_since = False, None
            self.rejoins += 1
        elif self.standby and down_for - self.switched_at >= self.standby_after:
            # agreed: every rank turns at the same iteration
            with self.lock:
                failed = self.worker.aggregator_names
                self.worker.use_aggregators(self.standby)
            self.standby, self.switched_at = failed, down_for

    def report(self) -> dict:
        return {"failures": self.failures, "recovered_buckets": self.recovered,
                "ring_buckets_while_down": self.ring_buckets, "rejoins": self.rejoins, "down": self.down}
