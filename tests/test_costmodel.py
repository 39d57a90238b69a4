"""zerosum.costmodel: its bytes against a real worker's counters, and its per-scheme arithmetic."""
import numpy as np
import pytest

from zerosum import costmodel as CM


def _contributions(world, numel, block, own, union, rng):
    """Tensors whose blocks cover exactly `union` of the blocks, each rank holding `own` of them."""
    blocks = -(-numel // block)
    inside = rng.choice(blocks, size=int(round(union * blocks)), replace=False)
    k = int(round(own * blocks))
    xs = []
    for r in range(world):
        # every block of the union is somebody's: rank r takes a rotating window of the union, size k
        mine = np.zeros(blocks, bool)
        mine[np.roll(inside, -r * (len(inside) // world))[:k]] = True
        xs.append((rng.standard_normal(numel) * np.repeat(mine, block)[:numel]).astype(np.float32))
    return xs


@pytest.mark.parametrize("own,union", [(1.0, 1.0), (0.05, 0.15), (0.2, 0.5)])
def test_allreduce_bytes_match_a_real_worker(own, union):
    """Predicted bytes sent and received per worker for one allreduce equal what real workers count,
    up to the datagram headers (the model's datagram count is a lower bound)."""
    from procs import Aggregator
    from test_worker_api import run_threads
    world, block, numel = 3, 256, 256 * 3000 + 17
    xs = _contributions(world, numel, block, own, union, np.random.default_rng(3))
    agg = Aggregator(world)
    try:
        def fn(rank, w):
            w.allreduce(xs[rank])      # the first allreduce carries the JOIN: measure the second
            s0, r0, d0, e0 = w.stats.bytes_sent, w.stats.bytes_received, w.stats.datagrams_sent, w.stats.datagrams_received
            w.allreduce(xs[rank])
            return (w.stats.bytes_sent - s0, w.stats.bytes_received - r0,
                    w.stats.datagrams_sent - d0, w.stats.datagrams_received - e0)
        real = run_threads(world, agg.address, fn, block_size=block)
    finally:
        agg.stop()
    cost = CM.zerosum_allreduce(numel, own, union, world, block_size=block)
    for sent, received, dsent, dreceived in real:
        assert abs(cost.sent - sent) <= 20 * dsent, (cost, sent)
        assert abs(cost.received - received) <= 20 * dreceived, (cost, received)


def test_scheme_arithmetic():
    d = CM.Densities(own={1: 0.02, 4: 0.05}, union={1: 0.07, 4: 0.15})
    n, w = 1_000_000, 4
    every = CM.scheme_step("zerosum", n, w, d)
    assert every == CM.zerosum_allreduce(n, 0.02, 0.07, w)
    assert CM.scheme_step("delayed", n, w, d) == every           # same bytes, only hidden behind compute
    h4 = CM.scheme_step("localsgd", n, w, d, period=4)
    change = CM.zerosum_allreduce(n, 0.05, 0.15, w)
    assert h4.sent == change.sent / 4 and h4.received == change.received / 4 and h4.allreduces == 0.25
    gloo = CM.scheme_step("gloo", n, w, d)
    assert gloo.sent == gloo.received == 2 * 3 / 4 * n * 4
    assert CM.scheme_step("topk", n, w, d, density=0.01).sent < every.sent
    # links: colocated aggregators carry (sent + received)(W-1)/W each way; gloo its ring share
    assert CM.link_seconds("zerosum", every, w, 1e9) == pytest.approx((every.sent + every.received) * 0.75 * 8 / 1e9)
    assert CM.link_seconds("gloo", gloo, w, 1e9) == pytest.approx(gloo.sent * 8 / 1e9)
    assert CM.link_seconds("zerosum", every, w, 1e9, aggregators=1) == pytest.approx(every.received * 4 * 8 / 1e9)
    with pytest.raises(ValueError, match="no densities"):
        CM.scheme_step("localsgd", n, w, d, period=8)
    with pytest.raises(ValueError, match="needs its density"):
        CM.scheme_step("topk", n, w, d)
    with pytest.raises(ValueError, match="union density"):
        CM.zerosum_allreduce(n, 0.5, 0.1, w)
    with pytest.raises(ValueError, match="no cost model"):
        CM.scheme_step("carrier-pigeon", n, w, d)
