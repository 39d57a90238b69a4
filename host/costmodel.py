"""Predicted communication per training step, for each way of synchronising (zerosum.examples.schemes),
from block densities, world size, link rate and ZeroSum's packet format.

ZeroSum's bytes come from `compression.wire_cost` (docs/protocol.md, "A round"): per allreduce a worker
sends a bootstrap entry per column and an entry per round, with data for its own non-zero blocks; there
is a round for every block non-zero on *any* worker (the union), and every worker receives each round's
result with the summed block. So one allreduce is described by two densities: the share of blocks a
worker has (`own`) and the share non-zero on some worker (`union`).

    cost = zerosum_allreduce(numel=12_800_000, own=0.02, union=0.07, world=4)
    step = scheme_step("localsgd", model_numel, world, densities, period=8)
    seconds = link_seconds("localsgd", step, world, rate_bps=1e9)

Schemes per step (averaged over the steady state):
- zerosum (every step): one allreduce of the gradient;
- a compressor: one allreduce of its contribution (own = its density, union = the blocks of any
  worker; independent choices when the overlap is not known: 1 - (1 - own)^world);
- localsgd:H: one allreduce of the model's change over H steps every H steps (densities of the
  change over H steps, which the optimizer decides: plain SGD moves only the rows a batch touched,
  Adam's momentum keeps moving every row it ever touched);
- delayed: the same bytes as every step (hidden behind the next step's compute, not fewer);
- gloo: the ring allreduce, 2 (W - 1) / W of the model's bytes each way.

Link time: every host has one full-duplex link of `rate_bps`. With one aggregator on every worker's
host (`aggregators=None`, experiments/shaped_network.py's default) the columns are striped over the W
aggregators: a worker's traffic to its own host's aggregator never touches the link, and each host's
aggregator serves the other W - 1 workers' share; so each link carries
    out: sent (W - 1) / W + received (W - 1) / W   (its worker's sends, its aggregator's results)
and the same in. With A aggregators on hosts of their own, a worker's link carries its sent and
received bytes, and an aggregator's link W / A times that. Latency and CPU are not modelled: the
prediction is the time the links need, a lower bound on the communication time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import protocol as P
from .compression.base import wire_cost


@dataclass(frozen=True)
class StepCost:
    """Bytes one worker sends and receives per training step (averaged over the steady state)."""
    sent: float
    received: float
    allreduces: float      # allreduces per step


def _mask(blocks: int, share: float, rng) -> np.ndarray:
    mask = np.zeros(blocks, bool)
    mask[rng.choice(blocks, size=int(round(share * blocks)), replace=False)] = True
    return mask


def zerosum_allreduce(numel: int, own: float, union: float | None = None, world: int = 1, block_size: int = 256,
                      max_datagram: int = P.MAX_DATAGRAM, columns: int = 2048, seed: int = 0) -> StepCost:
    """One worker's bytes for one loss-free allreduce of `numel` values of which a share `own` of the
    blocks is non-zero, `union` non-zero on some worker (default: independent blocks,
    1 - (1 - own)^world). Blocks are placed at random; entries and payload do not depend on where they
    are, the datagram headers (20 bytes per datagram) hardly."""
    if not 0 <= own <= 1:
        raise ValueError(f"own density must be in [0, 1], got {own}")
    union = 1 - (1 - own) ** world if union is None else union
    if not own <= union + 1e-12 <= 1 + 1e-12:
        raise ValueError(f"the union density ({union}) must be between the own density ({own}) and 1")
    blocks = -(-numel // block_size)
    rng = np.random.default_rng(seed)
    rounds = _mask(blocks, union, rng)
    mine = np.zeros(blocks, bool)
    inside = np.flatnonzero(rounds)
    mine[rng.choice(inside, size=min(len(inside), int(round(own * blocks))), replace=False)] = True

    def as_values(mask):
        return np.repeat(mask, block_size)[:numel].astype(np.float32)

    sent = wire_cost(as_values(mine), block_size, max_datagram, columns, rounds=rounds).bytes
    # Every round's RESULT comes back to every worker with the summed block (R-A7).
    received = wire_cost(as_values(rounds), block_size, max_datagram, columns, rounds=rounds).bytes
    return StepCost(float(sent), float(received), 1.0)


@dataclass(frozen=True)
class Densities:
    """Block densities measured on a model's gradients (or changes): `own[h]` the mean share of blocks
    a worker's change over h steps has non-zero, `union[h]` the share non-zero on some worker; h = 1 is
    one step's gradient."""
    own: dict
    union: dict


def scheme_step(kind: str, numel: int, world: int, densities: Densities, *, density: float | None = None,
                period: int = 1, block_size: int = 256, max_datagram: int = P.MAX_DATAGRAM,
                columns: int = 2048) -> StepCost:
    """The steady-state cost per step of a scheme (module docstring); `density` is a sparsifier's
    (topk, dgc) or random-k's share, `period` local SGD's H."""
    args = dict(block_size=block_size, max_datagram=max_datagram, columns=columns)
    if kind == "gloo":
        ring = 2 * (world - 1) / world * numel * 4
        return StepCost(ring, ring, 1.0)
    if kind == "local":
        return StepCost(0.0, 0.0, 0.0)
    if kind in ("zerosum", "delayed", "qsgd", "terngrad"):
        return zerosum_allreduce(numel, densities.own[1], densities.union[1], world, **args)
    if kind == "efsign":     # error feedback: every block that ever had a gradient stays non-zero
        return zerosum_allreduce(numel, 1.0, 1.0, world, **args)
    if kind in ("topk", "dgc", "diana"):
        if density is None:
            raise ValueError(f"{kind} needs its density")
        return zerosum_allreduce(numel, density, None, world, **args)
    if kind == "localsgd":
        if period not in densities.own:
            raise ValueError(f"no densities measured for changes over {period} steps "
                             f"(have {sorted(densities.own)})")
        one = zerosum_allreduce(numel, densities.own[period], densities.union[period], world, **args)
        return StepCost(one.sent / period, one.received / period, 1.0 / period)
    raise ValueError(f"no cost model for scheme {kind!r}")


def link_seconds(kind: str, cost: StepCost, world: int, rate_bps: float, aggregators: int | None = None) -> float:
    """The busiest link's time for one step's bytes of scheme `kind` (module docstring)."""
    if kind == "gloo":                       # the ring: each host's share once each way on its own link
        busiest = max(cost.sent, cost.received)
    elif aggregators is None:                # one aggregator on every worker's host
        busiest = (cost.sent + cost.received) * (world - 1) / world
    else:
        busiest = max(cost.sent, cost.received) * max(1.0, world / aggregators)
    return busiest * 8 / rate_bps
