"""Compressors: selection, unbiasedness, error-feedback identities, DIANA, wire accounting."""
import numpy as np
import pytest

from zerosum import compression as C
from zerosum import protocol as P
from zerosum.compression import adaptive as A
from zerosum.compression.base import block_rows


def grad(n=4096, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32) * \
        np.repeat(np.random.default_rng(seed + 1).random(-(-n // 256)) * 10, 256)[:n].astype(np.float32)


def nonzero_blocks(x, B=256):
    rows, _ = block_rows(x, B)
    return np.flatnonzero(np.abs(rows).max(axis=1) > 0)


def test_topk_blocks_selects_largest_and_keeps_the_rest():
    g = grad()
    c = C.TopKBlocks(density=0.25)
    sent = c.compress(g, "a")
    rows, _ = block_rows(g, 256)
    norms = (rows ** 2).sum(axis=1)
    assert set(nonzero_blocks(sent)) == set(np.argsort(norms)[-4:])
    assert np.array_equal(sent + c.ef.memory["a"], g)                # nothing is lost
    g2 = grad(seed=5)
    sent2 = c.compress(g2, "a")
    assert np.allclose(sent2 + c.ef.memory["a"], g - sent + g2)       # m ← m + g − sent
    assert C.wire_bytes(sent) < C.wire_bytes(g) / 3


def test_topk_elements_counts_and_feedback():
    g = grad()
    c = C.TopKElements(density=0.01)
    sent = c.compress(g, 0)
    assert np.count_nonzero(sent) == 41
    assert np.array_equal(sent + c.ef.memory[0], g)
    # scattered non-zeros: far more blocks on the wire than the same volume of top blocks would need
    assert len(nonzero_blocks(sent)) > 1


def test_random_k_blocks_is_unbiased():
    g = grad(n=2048)
    c = C.RandomKBlocks(world=4, seed=1)            # m = 8 blocks, tau = 2
    draws = [c.compress(g) for _ in range(4000)]
    assert all(len(nonzero_blocks(d)) == 2 for d in draws[:20])
    mean = np.mean(draws, axis=0)
    assert np.abs(mean - g).max() < 0.1 * np.abs(g).max()
    assert np.abs(mean - g).mean() < 0.03 * np.abs(g).mean() + 0.02


def test_qsgd_levels_and_unbiasedness():
    g = grad(n=512)
    c = C.QSGD(levels=4, seed=2)
    q = c.compress(g)
    rows, _ = block_rows(g, 256)
    norms = np.sqrt((rows ** 2).sum(axis=1))
    levels = np.abs(block_rows(q, 256)[0]) / norms[:, None] * 4
    assert np.allclose(levels, np.round(levels), atol=1e-4)          # multiples of norm/s
    mean = np.mean([c.compress(g) for _ in range(3000)], axis=0)
    assert np.abs(mean - g).mean() < 0.05 * np.abs(g).mean()


def test_terngrad_is_ternary_and_unbiased_without_clipping():
    g = grad(n=512)
    c = C.TernGrad(clip=0, seed=3)
    t = c.compress(g)
    s = np.abs(g).max()
    assert set(np.unique(np.abs(t))) <= {0.0, np.float32(s)}
    mean = np.mean([c.compress(g) for _ in range(4000)], axis=0)
    assert np.abs(mean - g).mean() < 0.05 * np.abs(g).mean()


def test_sign_error_feedback_memory():
    g = grad(n=700)
    c = C.SignEF()
    d = c.compress(g, "k")
    assert np.allclose(d + c.memory["k"], g, atol=1e-5)
    rows, _ = block_rows(d, 256)
    for r in rows[:2]:
        assert len(np.unique(np.abs(r))) == 1                          # one magnitude per block


def test_dgc_warmup_masking_and_conservation():
    c = C.DGC(density=0.001, momentum=0.9, blockwise=True, block_size=16, seed=0)
    c.set_epoch(0)
    assert c.density == 0.25
    g = grad(n=16 * 400)
    sent = c.compress(g, 0)
    assert 0.15 < len(nonzero_blocks(sent, 16)) / 400 < 0.35
    # what is sent plus what stays accumulated is everything accumulated so far (u_1 = g, v_1 = g)
    assert np.allclose(sent + c.v[0], g)
    assert np.all(c.u[0][sent != 0] == 0) and np.all(c.v[0][sent != 0] == 0)
    c.set_epoch(9)
    assert c.density == 0.001


def test_adaptive_k_maximises_decrease_per_byte():
    g = grad(n=256 * 64)
    c = C.AdaptiveTopKBlocks()
    rows, _ = block_rows(g, 256)
    k = c.choose_k(rows)
    norms = np.sort((rows.astype(np.float64) ** 2).sum(axis=1))[::-1]
    ratios = [norms[:j].sum() / c.cost(np.array(j), 64) for j in range(1, 65)]
    assert k == int(np.argmax(ratios)) + 1
    assert k > 1                       # header and entry costs make k = 1 a bad deal
    sent = c.compress(g, 0)
    assert len(nonzero_blocks(sent)) == c.history[-1]


def _quadratic(n_workers=4, d=64, seed=0):
    rng = np.random.default_rng(seed)
    A = [rng.standard_normal((d, d)).astype(np.float64) / np.sqrt(d) + np.eye(d) for _ in range(n_workers)]
    b = [rng.standard_normal(d) * 3 for _ in range(n_workers)]
    H = sum(a.T @ a for a in A) / n_workers
    x_star = np.linalg.solve(H, sum(a.T @ bb for a, bb in zip(A, b)) / n_workers)
    f = lambda x: sum(0.5 * np.sum((a @ x - bb) ** 2) for a, bb in zip(A, b)) / n_workers
    grads = lambda x: [(a.T @ (a @ x - bb)).astype(np.float32) for a, bb in zip(A, b)]
    return f, grads, x_star, d


@pytest.mark.parametrize("shifts", [True, False])
def test_diana_converges_linearly_where_plain_compression_stalls(shifts):
    f, grads, x_star, d = _quadratic()
    n = 4
    inner = [C.RandomKBlocks(world=n, seed=7, rank=r, block_size=8) for r in range(n)]   # m=8, tau=2
    omega = 8 / 2 - 1
    comp = [C.DIANA(inner[r], omega=omega) if shifts else inner[r] for r in range(n)]
    x = np.zeros(d)
    gamma = 0.05
    for _ in range(3000):
        contributions = [c.compress(g, 0) for c, g in zip(comp, grads(x))]
        total = np.sum(contributions, axis=0)                  # what the aggregator returns
        ests = [c.decompress(total, n, 0) for c in comp]
        assert all(np.array_equal(e, ests[0]) for e in ests)   # every worker computes the same step
        x = x - gamma * ests[0].astype(np.float64)
    gap = f(x) - f(x_star)
    if shifts:
        assert gap < 1e-6
    else:
        assert gap > 1e-3            # the compression noise of raw gradients never vanishes


def test_diana_shift_update():
    inner = C.RandomKBlocks(world=2, seed=0, block_size=4)
    c = C.DIANA(inner, omega=1.0)
    g = np.arange(16, dtype=np.float32)
    delta = c.compress(g, 0)
    assert np.array_equal(c.h_local[0], 0.5 * delta)
    est = c.decompress(delta * 2, 2, 0)
    assert np.array_equal(est, delta) and np.array_equal(c.h[0], 0.5 * delta)


def test_diana_with_random_k_is_isega():
    """DIANA(RandomKBlocks) with α = 1/(1+ω) = τ/m is the "99%" paper's ISEGA (Algorithm 3):
    h_i ← h_i + (∇f_i − h_i)_U (eq. 9), and worker i's estimate g_i = h_i + (m/τ)(∇f_i − h_i)_U (eq. 10)."""
    B, m, world = 4, 12, 3
    tau = m // world
    c = C.DIANA(C.RandomKBlocks(world=world, seed=3, block_size=B), omega=m / tau - 1)
    rng = np.random.default_rng(0)
    h = np.zeros(m * B, np.float32)
    for _ in range(5):
        grad = rng.standard_normal(m * B).astype(np.float32)
        sent = c.compress(grad, 0)
        U = np.repeat(np.abs(sent.reshape(m, B)).max(axis=1) > 0, B)   # the blocks this worker sampled
        assert U.sum() == tau * B
        assert np.allclose(sent, np.where(U, (m / tau) * (grad - h), 0), rtol=1e-5, atol=1e-5)   # eq. (10) − h
        h = h + np.where(U, grad - h, 0)                                                         # eq. (9)
        assert np.allclose(c.h_local[0], h, rtol=1e-5, atol=1e-5)


def test_compressed_allreduce_through_a_real_aggregator():
    from procs import Aggregator
    from test_worker_api import run_threads
    agg = Aggregator(3)
    try:
        gs = [grad(n=256 * 40, seed=r) for r in range(3)]

        def fn(rank, w):
            c = C.TopKBlocks(density=0.1)
            est = C.allreduce(w, gs[rank], c, key="w")
            return est, c.compress(gs[rank] * 0, key="other")

        outs = run_threads(3, agg.address, fn)
    finally:
        agg.stop()
    sent = [C.TopKBlocks(density=0.1).compress(g) for g in gs]
    expected = np.sum(sent, axis=0) / 3
    for est, _ in outs:
        assert est.tobytes() == outs[0][0].tobytes()
        assert np.allclose(est, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block_size,size", [(256, 256 * 3907 + 17), (1, 113)])
def test_wire_cost_matches_what_a_real_worker_sends(block_size, size):
    """Entries and payload of wire_cost equal a real worker's bytes (minus datagram headers) for a
    loss-free allreduce, including the header-only entries for other workers' blocks; its datagram
    count is a lower bound; without `rounds` the cost is a lower bound too."""
    from procs import Aggregator
    from test_worker_api import run_threads
    rng = np.random.default_rng(7)
    blocks = -(-size // block_size)
    xs = []
    for r in range(3):
        mask = np.repeat(rng.random(blocks) < 0.1 * (r + 1), block_size)[:size]
        xs.append((rng.standard_normal(size) * mask).astype(np.float32))
    agg = Aggregator(3)
    try:
        def fn(rank, w):
            w.allreduce(xs[rank])          # the first allreduce also carries the JOIN; measure the second
            s0, d0 = w.stats.bytes_sent, w.stats.datagrams_sent
            w.allreduce(xs[rank])
            return w.stats.bytes_sent - s0, w.stats.datagrams_sent - d0
        real = run_threads(3, agg.address, fn, block_size=block_size)
    finally:
        agg.stop()
    rounds = C.rounds_of(xs, block_size)
    for r, (sent, datagrams) in enumerate(real):
        cost = C.wire_cost(xs[r], block_size, rounds=rounds)
        assert sent - datagrams * 20 == cost.entries * 16 + cost.payload, r
        assert cost.payload == int(nonzero_blocks(xs[r], block_size).size) * block_size * 4
        assert 1 <= cost.datagrams <= datagrams
        assert C.wire_bytes(xs[r], block_size) < C.wire_bytes(xs[r], block_size, rounds=rounds) <= sent


def test_ddp_hook_with_a_compressor():
    pytest.importorskip("torch", reason="torch is not installed")
    from procs import Aggregator
    from torch_procs import ddp_training, spawn
    from zerosum.udp import free_port
    agg = Aggregator(2)
    try:
        res = spawn(ddp_training, 2, free_port(), agg.address, "topk", 4)
    finally:
        agg.stop()
    (p0, l0), (p1, _) = res
    for a, b in zip(p0, p1):
        assert a.tobytes() == b.tobytes()
    assert l0[-1] < l0[0] * 1.5          # it trains (the loss does not blow up)


def test_lsvrg_is_unbiased_and_vr_diana_converges():
    rng = np.random.default_rng(0)
    n, per, d = 4, 50, 16
    A = rng.standard_normal((n, per, d))
    b = rng.standard_normal((n, per))
    lam = 0.1

    def grad_fn(i):
        def g(x, idx):
            Ai, bi = (A[i], b[i]) if idx is None else (A[i][idx], b[i][idx])
            return (Ai.T @ (Ai @ x - bi) / len(bi) + lam * x).astype(np.float32)
        return g

    est = C.LSVRG(grad_fn(0), per, batch=1, p=0.0, seed=1)
    x = rng.standard_normal(d)
    mean = np.mean([est.estimate(x) for _ in range(20000)], axis=0)
    assert np.abs(mean - grad_fn(0)(x, None)).max() < 0.05
    # VR-DIANA: L-SVRG estimates compressed by DIANA(random-k) reach the optimum of the finite sum
    H = sum(A[i].T @ A[i] / per for i in range(n)) / n + lam * np.eye(d)
    x_star = np.linalg.solve(H, sum(A[i].T @ b[i] / per for i in range(n)) / n)
    ests = [C.LSVRG(grad_fn(i), per, batch=5, seed=10 + i) for i in range(n)]
    comps = [C.DIANA(C.RandomKBlocks(n, seed=3, rank=i, block_size=4), omega=3) for i in range(n)]
    x = np.zeros(d)
    for _ in range(6000):
        contributions = [c.compress(e.estimate(x), 0) for c, e in zip(comps, ests)]
        total = np.sum(contributions, axis=0)
        step = [c.decompress(total, n, 0) for c in comps][0]
        x = x - 0.05 * step.astype(np.float64)
    assert np.linalg.norm(x - x_star) < 1e-3


def test_saga_removes_the_sampling_noise_floor():
    rng = np.random.default_rng(1)
    n, per, d = 4, 40, 16
    A = rng.standard_normal((n, per, d))
    b = rng.standard_normal((n, per)) + np.arange(n)[:, None]        # heterogeneous workers
    lam = 0.1

    def sample_grads(i):
        return lambda x, idx: A[i][idx] * (A[i][idx] @ x - b[i][idx])[:, None] + lam * x

    x0, x1 = rng.standard_normal(d), rng.standard_normal(d)
    full = sample_grads(0)(x1, np.arange(per)).mean(axis=0)

    def second_draw(seed):
        e = C.SAGA(sample_grads(0), per, batch=4, seed=seed)
        e.estimate(x0)                      # the table now holds gradients at x0 (and 4 at x0 again)
        return e.estimate(x1)

    mean = np.mean([second_draw(s) for s in range(4000)], axis=0)
    assert np.abs(mean - full).max() < 0.05 * np.abs(full).max()     # unbiased at a point off the table
    H = sum(A[i].T @ A[i] / per for i in range(n)) / n + lam * np.eye(d)
    x_star = np.linalg.solve(H, sum(A[i].T @ b[i] / per for i in range(n)) / n)
    errors = {}
    for mode in ("saga", "sgd"):
        ests = [C.SAGA(sample_grads(i), per, batch=4, seed=10 + i) for i in range(n)]
        draw = np.random.default_rng(5)
        x = np.zeros(d)
        for _ in range(4000):
            gs = [e.estimate(x) for e in ests] if mode == "saga" else \
                [sample_grads(i)(x, draw.choice(per, 4, replace=False)).mean(axis=0) for i in range(n)]
            x = x - 0.02 * np.mean(gs, axis=0)
        errors[mode] = np.linalg.norm(x - x_star)
    assert errors["saga"] < 1e-6 < 1e-2 < errors["sgd"]                # same step: SGD stalls, SAGA converges


def test_error_feedback_follows_mem_sgd_with_a_changing_step():
    """Stich et al. 2018, Algorithm 1: g_t = top_k(m_t + η_t ∇), m_{t+1} = m_t + η_t ∇ − g_t (the step
    enters the memory when the gradient does). With set_lr, η_t × contribution equals g_t exactly."""
    steps = [0.5, 0.5, 0.1, 0.02, 0.3]
    for make, top in [(lambda: C.TopKBlocks(density=0.25, block_size=8), "blocks"),
                      (lambda: C.TopKElements(density=0.1), "elements"),
                      (lambda: C.SignEF(block_size=8), "sign")]:
        c = make()
        m = np.zeros(64, np.float64)
        for t, eta in enumerate(steps):
            g = grad(n=64, seed=20 + t).astype(np.float64)
            p = m + eta * g
            if top == "blocks":
                rows = p.reshape(8, 8)
                keep = np.argsort((rows ** 2).sum(axis=1))[-2:]
                sent = np.zeros_like(rows)
                sent[keep] = rows[keep]
                sent = sent.reshape(-1)
            elif top == "elements":
                keep = np.argsort(np.abs(p))[-6:]
                sent = np.zeros_like(p)
                sent[keep] = p[keep]
            else:
                rows = p.reshape(8, 8)
                sent = (np.abs(rows).mean(axis=1, keepdims=True) * np.sign(rows)).reshape(-1)
            m = p - sent
            c.set_lr(eta)
            out = c.compress(g.astype(np.float32), "k")
            assert np.allclose(eta * out, sent, rtol=1e-4, atol=1e-5), (top, t)


def test_dgc_warmup_ramps_to_the_final_density_not_below_it():
    c = C.DGC(density=0.01)
    densities = []
    for e in range(8):
        c.set_epoch(e)
        densities.append(c.density)
    assert densities[:3] == [0.25, 0.0625, 0.015625]
    assert densities[3:] == [0.01] * 5            # never 0.004 or 0.001 when the target is 1%
    assert all(a >= b for a, b in zip(densities, densities[1:]))


def test_dgc_refines_a_sampled_threshold_that_selects_far_too_many():
    """Lin et al. 2018, Section 5: if the sampled threshold lets through far more than expected, a
    precise threshold is computed from the already-selected gradients."""
    v = np.ones(100_000, np.float32)
    v[::100] = 2.0                                # 1% large values, the sample sees ~10 of them
    c = C.DGC(density=0.001, momentum=0.0, blockwise=False, seed=3)
    sent = c.compress(v, 0)
    assert np.count_nonzero(sent) == 100          # k = 0.1% of 100000, not all 1000 large ones
    assert np.all(sent[sent != 0] == 2.0)
    assert np.allclose(sent + c.v[0], v)


# Adaptive sparsification in the paper's setting (zerosum.compression.adaptive, experiments/adaptive_sparsification.py)

BIT_COSTS = [dict(per_message=0), dict(per_message=336), dict(per_message=248, max_payload=816)]


@pytest.mark.parametrize("d", [1, 2, 7, 64, 113, 301])
@pytest.mark.parametrize("kw", BIT_COSTS)
def test_bit_cost_counts_exactly_what_the_encoder_emits(d, kw):
    rng = np.random.default_rng(d)
    cost = A.BitCost(d, **kw)
    g = (rng.standard_normal(d) * rng.exponential(size=d)).astype(np.float32)
    for k in sorted({1, 2 if d > 1 else 1, max(1, d // 2), d}):
        keep = A.magnitude_order(g)[:k]
        messages = A.encode_sparse(keep, g[keep], cost)
        assert A.emitted_bits(messages) == cost(k)              # the model is what goes out
        assert len(messages) == cost.messages(k)
        assert all(m.size <= cost.per_message + (cost.max_payload or m.size) for m in messages)
        idx, values = A.decode_sparse(messages, cost)
        sent = np.zeros(d, np.float32)
        sent[idx] = values
        assert np.array_equal(sent, A.top_k(g, k))              # and it carries T_k(g) exactly


@pytest.mark.parametrize("seed", range(12))
def test_adaptive_k_is_the_brute_force_argmax_of_decrease_per_bit(seed):
    rng = np.random.default_rng(seed)
    d = int(rng.integers(1, 40))
    g = (rng.standard_normal(d) * rng.exponential(size=d) ** 3).astype(np.float32)
    for kw in BIT_COSTS:
        cost = A.BitCost(d, **kw)
        k, order = A.choose_k(g, cost)
        ratios = []
        for j in range(1, d + 1):                    # T_j(g) and the encoder's bits, from scratch
            sent = A.top_k(g, j).astype(np.float64)
            keep = np.argsort(-np.abs(g), kind="stable")[:j]
            bits = A.emitted_bits(A.encode_sparse(keep, g[keep], cost))
            ratios.append(np.sum(sent ** 2) / bits)
        assert k == int(np.argmax(ratios)) + 1
        if not kw["per_message"]:
            assert k == 1               # payload only: ||T_k(g)||²/k never grows with k


def _rows(rng, nblocks, block_size):
    return rng.standard_normal((nblocks, block_size)) * rng.exponential(size=(nblocks, 1)) ** 2


@pytest.mark.parametrize("columns", [2048, 3])
@pytest.mark.parametrize("block_size", [1, 8])
def test_zerosum_prefix_bytes_is_wire_bytes_with_every_worker_sending_the_set(columns, block_size):
    rng = np.random.default_rng(block_size + columns)
    nblocks, workers = 13, 3
    small = P.PACKET_HEADER_SIZE + 2 * (P.ENTRY_SIZE + 4 * block_size) + 5      # rounds over several datagrams
    local = [_rows(rng, nblocks, block_size) for _ in range(workers)]
    local[0][rng.random(nblocks) < 0.3] = 0                           # worker 0 has no data there
    has = np.abs(local[0]).max(axis=1) > 0
    order = rng.permutation(nblocks)
    for max_datagram in (P.MAX_DATAGRAM, small):
        costs = A.zerosum_prefix_bytes(order, nblocks, block_size, has, columns, max_datagram)
        for k in range(1, nblocks + 1):
            chosen = np.zeros(nblocks, bool)
            chosen[order[:k]] = True
            contributions = [(rows * chosen[:, None]).astype(np.float32).reshape(-1) for rows in local]
            rounds = C.rounds_of(contributions, block_size)
            assert np.array_equal(rounds, chosen)
            assert costs[k - 1] == C.wire_bytes(contributions[0], block_size, max_datagram, columns, rounds)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("columns", [2048, 4])
def test_adaptive_blocks_are_the_brute_force_argmax_of_decrease_per_zerosum_byte(seed, columns):
    rng = np.random.default_rng(seed)
    nblocks, block_size = int(rng.integers(1, 20)), int(rng.choice([1, 4, 8]))
    rows = _rows(rng, nblocks, block_size).astype(np.float32)
    has = rng.random(nblocks) < 0.8
    max_datagram = int(rng.choice([P.MAX_DATAGRAM, P.PACKET_HEADER_SIZE + 3 * (P.ENTRY_SIZE + 4 * block_size)]))
    k, order = A.choose_blocks(rows, has, columns, max_datagram)
    norms = (rows.astype(np.float64) ** 2).sum(axis=1)
    ratios = []
    for j in range(1, nblocks + 1):
        chosen = np.zeros(nblocks, bool)
        chosen[np.argsort(-norms, kind="stable")[:j]] = True
        mine = (rows * (chosen & has)[:, None]).reshape(-1)
        ratios.append(norms[chosen].sum() / C.wire_bytes(mine, block_size, max_datagram, columns, rounds=chosen))
    assert k == int(np.argmax(ratios)) + 1


@pytest.mark.parametrize("d", [1, 7, 64, 301])
@pytest.mark.parametrize("kw", BIT_COSTS)
def test_dense_bits_count_exactly_what_the_dense_encoder_emits(d, kw):
    cost = A.BitCost(d, **kw)
    g = np.random.default_rng(d).standard_normal(d).astype(np.float32)
    messages = A.encode_dense(g, cost)
    assert A.emitted_bits(messages) == cost.dense_bits
    assert all(m.size <= cost.per_message + (cost.max_payload or m.size) for m in messages)
    assert np.array_equal(A.decode_dense(messages, cost), g)
    if not kw["per_message"]:
        assert cost.dense_bits == 32 * d                      # plain floats, no indices


def test_level_grid_is_geometric_from_dense_and_keeps_only_k_cheaper_than_dense():
    cost = A.BitCost(16)                                      # 4 + 32 bits an entry, dense 512 bits
    assert A.level_grid(16, cost, cost.dense_bits).tolist() == [16, 13, 11, 10, 8, 7, 6, 5, 4, 3, 2, 1]
    udp = A.BitCost(16, per_message=336)                      # 36k + 336 < 848 only for k ≤ 14
    assert A.level_grid(16, udp, udp.dense_bits, ratio=2).tolist() == [16, 8, 4, 2, 1]
    assert A.level_grid(16, lambda k: 100 * k, 150).tolist() == [16, 1]
    assert A.level_grid(1, cost, 32).tolist() == [1]


def _track(tracker, rate, cost, steps, start_potential=0.0):
    """Plays `steps` steps: at level k a step costs cost[k] bits and lowers the potential by
    rate(k, steps at k since the last switch) · cost[k]. Returns the bits spent at each level."""
    potential, bits, spent, last, run = start_potential, 0.0, {}, None, 0
    for _ in range(steps):
        k = tracker.choose(potential, bits)
        run = run + 1 if k == last else 1
        last = k
        potential -= rate(k, run) * cost[k]
        bits += cost[k]
        spent[k] = spent.get(k, 0.0) + cost[k]
    return spent


def test_level_tracker_climbs_to_the_best_level_and_stays_with_probes_backing_off():
    levels = [64, 45, 32, 23, 16, 11, 8]
    best = 23
    rate = lambda k, run: 1.0 - 0.1 * abs(np.log2(k / best))      # unimodal in log k, per bit
    cost = {k: 10.0 + k for k in levels}
    tracker = A.LevelTracker(levels, segment_bits=200.0)
    spent = _track(tracker, rate, cost, 6000)
    assert tracker.levels[tracker.current] == best
    path = [k for k, _ in tracker.segments]
    assert path[:7:2] == [64, 45, 32, 23]                        # current, probe down (accepted), ...
    arrived = path.index(best)
    probes = sum(k != best for k in path[arrived:])
    assert probes <= 2 * np.log2(len(path) - arrived) + 2          # back-off: logarithmically many probes
    assert spent[best] / sum(spent.values()) > 0.85


def test_level_tracker_does_not_move_on_a_tie_or_a_worse_neighbour():
    levels = [8, 4, 2]
    tracker = A.LevelTracker(levels, segment_bits=50.0)
    _track(tracker, lambda k, run: 1.0 if k == 8 else 0.5, {8: 10.0, 4: 10.0, 2: 10.0}, 400)
    assert tracker.levels[tracker.current] == 8 and {k for k, _ in tracker.segments} == {8, 4}
    flat = A.LevelTracker(levels, segment_bits=50.0, start=1)
    _track(flat, lambda k, run: 1.0, {8: 10.0, 4: 10.0, 2: 10.0}, 400)
    assert flat.levels[flat.current] == 4                          # equal scores: stays


def test_level_tracker_warmup_ignores_the_transient_after_a_switch():
    """A level that is good for its first steps after a switch (the greedy rule's trap: the largest
    entries go first) and worse afterwards fools segments scored from their first step, not those
    whose first half is left unscored."""
    levels = [16, 8]
    cost = {16: 10.0, 8: 10.0}
    rate = lambda k, run: 1.0 if k == 16 else (3.0 if run <= 3 else 0.5)
    fooled = A.LevelTracker(levels, segment_bits=100.0)
    spent = _track(fooled, rate, cost, 300)
    assert [k for k, _ in fooled.segments[:5]] == [16, 8, 8, 16, 16]     # moves to 8, then back, and again
    assert spent[8] == spent[16]
    careful = A.LevelTracker(levels, segment_bits=100.0, warmup=0.5)
    spent = _track(careful, rate, cost, 300)
    assert careful.levels[careful.current] == 16
    assert spent[8] / (spent[8] + spent[16]) < 0.15                     # probes only, backing off


def test_gap_level_tracker_scores_the_log_gap_with_the_latest_lower_bound():
    tracker = A.GapLevelTracker([8, 4], segment_bits=10.0)
    tracker.choose_gap(9.0, 0.0, 0.0)                       # f = 9, f* ≥ 0
    tracker.choose_gap(5.0, 1.0, 10.0)                      # segment ends: ℓ = 1 for both ends
    assert tracker.segments[0][0] == 8
    assert np.isclose(tracker.segments[0][1], np.log(8 / 4) / 10)
    tracker.choose_gap(3.0, 0.5, 20.0)                      # a looser bound does not replace a tighter one
    assert np.isclose(tracker.segments[1][1], np.log(4 / 2) / 10) and tracker.lower == 1.0


# -- TrackedTopKBlocks: a LevelTracker per key, fed with what every rank receives ---------------------

def _play_tracked(c, steps, drop, world=4, nblocks=64, key=("w",)):
    """Drives `c` as the DDP hook does, with made-up results: each step compresses a gradient of
    `nblocks` blocks, then observes a result whose union is the world·k blocks the k kept by each
    worker can make (at most all) and whose log ||result||² falls by drop(k) per step. Returns the
    k of every step."""
    B, potential, played = c.block_size, 0.0, []
    for _ in range(steps):
        sent = c.compress(np.ones(nblocks * B, np.float32), key)
        k = len(nonzero_blocks(sent, B))
        union = min(world * k, nblocks)
        result = np.zeros(nblocks * B, np.float32)
        result[:union * B] = np.sqrt(np.exp(potential) / (union * B))
        c.decompress(result, world, key)
        potential -= drop(k)
        played.append(k)
    return played


def test_tracked_topk_keeps_dense_until_a_result_then_levels_below_what_the_dense_union_costs():
    c = C.TrackedTopKBlocks(block_size=4, ratio=2)
    key = ("a", "b")
    g = grad(n=400)                                       # 100 blocks of 4
    assert len(nonzero_blocks(c.compress(g, key), 4)) == 100      # no result yet: every block
    zero = np.zeros_like(g)
    c.decompress(zero, 2, key)                            # all zero: bits count, no tracker yet
    t = c.trackers[key]
    assert t.tracker is None and t.k == 100 and t.bits == c.result_bits(0, 100)
    c.compress(g, key)
    result = np.zeros_like(g)
    result[:60 * 4] = 1.0                                 # a union of 60 blocks, from dense k
    c.decompress(result, 2, key)
    # dense, then 100 / 2^j for the k whose union (at most 2k blocks) costs less than 60 blocks
    assert t.tracker.levels.tolist() == [100, 25, 12, 6, 3, 2, 1]
    assert t.tracker.segment_bits == 4 * c.result_bits(60, 100)
    assert t.k == 100 and t.played == [100, 100]          # start = 0: dense
    assert t.bits == c.result_bits(0, 100) + c.result_bits(60, 100)
    late = C.TrackedTopKBlocks(block_size=4, ratio=2, start=99)
    late.compress(g, key)
    late.decompress(result, 2, key)
    assert late.trackers[key].k == 1                      # start past the end: the smallest k


def test_tracked_topk_moves_to_cheaper_levels_where_a_step_does_as_much():
    """A step lowers the potential as much at every level, so per bit the cheaper level scores higher:
    each probe down is taken, one level per two segments, down to the smallest k; where a bit does
    more at larger k, it never leaves dense."""
    c = C.TrackedTopKBlocks(block_size=4, ratio=2, segment_steps=2, warmup=0.5)
    played = _play_tracked(c, 400, lambda k: 0.01)
    tracker = c.trackers[("w",)].tracker
    assert tracker.levels.tolist() == [64, 8, 4, 2, 1]    # world 4: unions of 32, 16, 8, 4 blocks < 64
    path = [k for k, _ in tracker.segments]
    assert path[:8:2] == [64, 8, 4, 2] and path[1:8:2] == [8, 4, 2, 1]   # probe down, taken, ...
    assert tracker.levels[tracker.current] == 1 and played[-1] == 1
    assert played[0] == 64 and played.count(64) <= 3      # dense: its first segment and the result before it

    per_bit = C.TrackedTopKBlocks(block_size=4, ratio=2, segment_steps=2, warmup=0.5)
    played = _play_tracked(per_bit, 400, lambda k: 1e-6 * (1 + k / 64) * float(per_bit.result_bits(min(4 * k, 64), 64)))
    tracker = per_bit.trackers[("w",)].tracker
    assert tracker.levels[tracker.current] == 64 and played[-1] == 64
    assert {k for k, _ in tracker.segments} == {64, 8}    # probes down only, backing off


def test_tracked_topk_choice_depends_on_the_results_only():
    """Ranks with different gradients, the same results: the same k at every step."""
    ranks = [C.TrackedTopKBlocks(block_size=4, ratio=2, segment_steps=1, warmup=0) for _ in range(3)]
    rng = np.random.default_rng(3)
    for step in range(60):
        sent = [c.compress(rng.standard_normal(256).astype(np.float32) * (r + 1), "k") for r, c in enumerate(ranks)]
        summed = np.sum(sent, axis=0, dtype=np.float32) * np.float32(0.97 ** step)
        for c in ranks:
            c.decompress(summed, 3, "k")
    histories = [c.trackers["k"].played for c in ranks]
    assert histories[0] == histories[1] == histories[2] and len(set(histories[0])) > 1


def test_tracked_topk_follows_rebuilt_buckets_and_refuses_misuse():
    c = C.TrackedTopKBlocks(block_size=4)
    g = np.ones(16, np.float32)
    first = ("0.weight", "0.bias", "1.weight")
    c.compress(g, first)
    c.decompress(g, 2, first)
    c.compress(g[:8], ("1.weight",))               # DDP's rebuilt bucket: the first key is gone
    assert list(c.trackers) == [("1.weight",)]
    with pytest.raises(ValueError, match="compressed again before its result"):
        c.compress(g[:8], ("1.weight",))
    c.decompress(g[:8], 2, ("1.weight",))
    with pytest.raises(ValueError, match="without a compress"):
        c.decompress(g[:8], 2, ("1.weight",))
    with pytest.raises(ValueError, match="without a compress"):
        c.decompress(g, 2, "never")
    with pytest.raises(ValueError, match="had 2 blocks and now has 4"):
        c.compress(g, ("1.weight",))
    for kwargs, words in [({"ratio": 1}, "ratio"), ({"segment_steps": 0}, "segment_steps"),
                          ({"warmup": 1}, "warmup"), ({"smooth": 0}, "smooth"), ({"smooth": 1.5}, "smooth"),
                          ({"start": -1}, "start"), ({"start_density": 0}, "start_density"),
                          ({"start_density": 1.5}, "start_density")]:
        with pytest.raises(ValueError, match=words):
            C.TrackedTopKBlocks(**kwargs)


def test_tracked_topk_from_a_starting_density_begins_there_and_searches_around_it():
    """start_density: the first steps keep that share of the blocks, the tracker starts at the level
    nearest it (not dense), its segments are the first result's bits, and the grid is cut where a
    union would cost what every block costs."""
    c = C.TrackedTopKBlocks(block_size=4, ratio=2, start_density=0.05, segment_steps=2, warmup=0.5)
    key = "k"
    g = grad(n=400)                                       # 100 blocks of 4
    assert len(nonzero_blocks(c.compress(g, key), 4)) == 5    # before any result: 5 % of the blocks
    result = np.zeros_like(g)
    result[:10 * 4] = 1.0                                 # a union of 10 blocks
    c.decompress(result, 2, key)
    t = c.trackers[key]
    assert t.tracker.levels.tolist() == [100, 25, 12, 6, 3, 2, 1]   # unions of 2k < 100 blocks
    assert t.tracker.levels[t.tracker.current] == 6 and t.k == 6    # nearest 5 blocks, in ratio
    assert t.tracker.segment_bits == 2 * c.result_bits(10, 100)
    # where a step does as much at every level, it walks down from there, never up to dense
    played = _play_tracked(C.TrackedTopKBlocks(block_size=4, ratio=2, segment_steps=2, warmup=0.5,
                                               start_density=0.1), 400, lambda k: 0.01)
    assert played[0] == 6 and max(played) <= 8 and played[-1] == 1


# The fixed-level sweep of experiments/compression.py (E1, E3: the best level in hindsight)

def _tiny_problem(workers=2):
    from compression import Problem
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 8))          # equal shards: the mean of the workers' gradients is f's
    y = np.sign(X @ rng.standard_normal(8) + 0.5 * rng.standard_normal(64))
    return Problem(X, y, workers, lam=0.1)


def test_a_worker_alone_reaches_its_own_shards_optimum_and_no_further():
    """The no-exchange bound of E1-E3 (Problem.alone): worker i's own optimum is where its shard's
    gradient vanishes, and its f − f* is positive when the shards differ, zero when they are the same."""
    from compression import Problem, no_exchange_text
    prob = _tiny_problem()
    gaps = prob.alone()
    assert gaps.shape == (2,) and (gaps > 1e-6).all()
    for i, idx in enumerate(prob.shards):
        x_i = Problem(prob.X[idx], prob.y[idx], 1, prob.lam).optimum()[0]
        assert np.linalg.norm(prob.grad_i(x_i, i)) < 1e-10           # optimal for its own shard
        assert np.isclose(prob.loss(x_i) - prob.optimum()[1], gaps[i])
    twice = Problem(np.vstack([prob.X, prob.X]), np.concatenate([prob.y, prob.y]), 2, prob.lam)
    assert np.allclose(twice.alone(), 0, atol=1e-12)                  # equal shards: alone is optimal
    assert "above every target here" in no_exchange_text({2: gaps}, (gaps.min() / 2,))
    assert "do not test the exchange" in no_exchange_text({2: gaps}, (gaps.min() * 2,))


def test_the_sweep_covers_powers_of_two_and_every_block():
    from compression import levels_up_to
    assert levels_up_to(16) == [1, 2, 4, 8, 16]
    assert levels_up_to(113) == [1, 2, 4, 8, 16, 32, 64, 113]
    assert levels_up_to(1) == [1]


def test_random_k_with_every_block_is_dense_gd():
    """The sweep's last level (τ = m) is dense GD through the same compressor and step rule (ω = 0)."""
    from compression import random_k_step, run
    prob = _tiny_problem()
    L = 0.25 * np.linalg.eigvalsh(prob.X.T @ prob.X / len(prob.y)).max() + prob.lam
    assert random_k_step(L, 2, 4)(4) == 1 / L
    dense = run(prob, [C.NoCompression() for _ in range(2)], 30, 1 / L, 2)
    every = run(prob, [C.DIANA(C.RandomKBlocks(2, tau=4, seed=1, rank=r, block_size=2), omega=0)
                       for r in range(2)], 30, 1 / L, 2)
    assert np.array_equal(dense[1], every[1])                  # the same bits
    assert np.allclose(dense[0], every[0], rtol=1e-5, atol=1e-10)   # the same gaps, up to float32 rounding


def test_the_best_level_in_hindsight_is_the_level_with_the_fewest_bits_to_each_target():
    from compression import (TARGETS, bits_to_target, dense_rows, first_below, levels_up_to,
                             priced_as_run, random_k_step, run, stated_and_best, sweep, values_only)
    prob, n, block, m = _tiny_problem(workers=8), 8, 2, 4   # many workers: sparse levels pay
    L = 0.25 * np.linalg.eigvalsh(prob.X.T @ prob.X / len(prob.y)).max() + prob.lam
    methods = {"DIANA": (lambda t, seed: [C.DIANA(C.RandomKBlocks(n, tau=t, seed=seed, rank=r, block_size=block),
                                                     omega=m / t - 1) for r in range(n)], random_k_step(L, n, m), True)}
    seeds, steps, levels = (1, 2), 400, levels_up_to(m)
    trajectories = sweep(prob, methods, levels, seeds, steps, block, min(TARGETS), m, full_at=2)
    trajectories["dense GD", 1] = run(prob, [C.NoCompression() for _ in range(n)], steps, 1 / L, block)
    chosen = []
    for how, price in (("as run", priced_as_run), ("values only", values_only(block))):
        rows = dense_rows(8, 1) + stated_and_best("DIANA", how, how, 2, levels, price, seeds)
        table = bits_to_target(trajectories, rows, ("dense GD", 1), 8, steps, "seeds 1, 2")
        best_row = next(line for line in table if line.startswith("| DIANA, best τ in hindsight"))
        for eps, cell in zip(TARGETS, best_row.strip(" |").split(" | ")[2:]):
            mean_bits = {}                              # brute force, over the levels every seed reaches ε at
            for t in levels:
                runs = [trajectories[("DIANA", t), s] for s in seeds]
                reached = [first_below(gaps, eps) for gaps, _ in runs]
                if None not in reached:
                    mean_bits[t] = np.mean([price(t)(bits, r) for (_, bits), r in zip(runs, reached)])
            chosen.append(min(mean_bits, key=mean_bits.get))
            assert cell.startswith(f"τ = {chosen[-1]}: ")
    assert len(set(chosen)) > 1          # the problem separates the levels: the pick is no constant


def test_e2_steps_and_bits_are_what_iterations_to_returns():
    from compression import iterations_to, run, steps_and_bits
    prob = _tiny_problem(workers=2)
    L = 0.25 * np.linalg.eigvalsh(prob.X.T @ prob.X / len(prob.y)).max() + prob.lam
    make = lambda: [C.DIANA(C.RandomKBlocks(2, tau=2, seed=3, rank=r, block_size=2), omega=1) for r in range(2)]
    _, fstar = prob.optimum()
    for eps, cap in ((1e-4, 400), (1e-12, 20)):                       # reached; not within the cap
        expected = iterations_to(prob, make(), 1 / (2 * L), eps, cap, fstar, 2)
        assert steps_and_bits(run(prob, make(), cap, 1 / (2 * L), 2, eps), eps) == expected


def test_e2_steps_over_seeds_say_how_many_seeds_reached_the_target():
    from compression import mean_if_reached, steps_over_seeds
    assert steps_over_seeds([767, 767, 767]) == "767"
    assert steps_over_seeds([1530, 1500, 1620]) == "1550 (1500–1620)"
    assert steps_over_seeds([None, None, None]) == "—"
    assert steps_over_seeds([1000, None, 1200]) == "1100 (1000–1200) in 2 of 3 seeds"
    assert mean_if_reached([1000, 1200]) == 1100.0 and mean_if_reached([1000, None]) is None


def test_e5_counts_zerosum_bytes_and_block_values_with_indices_and_epochs_to_the_target():
    from dgc import BLOCK, step_bits, to_target
    own = np.zeros(10 * BLOCK + 3, np.float32)
    own[[5, 3 * BLOCK, 3 * BLOCK + 1, 10 * BLOCK + 2]] = 1.0                # 3 of 11 blocks non-zero
    other = np.zeros_like(own)
    other[7 * BLOCK] = 1.0                                                 # a round only the other opens
    zerosum, values = step_bits([own, other])
    assert zerosum == 8 * C.wire_bytes(own, BLOCK, rounds=C.rounds_of([own, other], BLOCK))
    assert values == 3 * (32 * BLOCK + 4)                                  # 11 blocks: 4-bit indices
    target = 0.85
    runs = [([target - 0.1, target, target + 0.1], [(1, 10), (2, 20), (3, 30)]),
            ([target - 0.1] * 3, [(1, 10), (2, 20), (3, 30)])]
    assert to_target(runs, 0, target) == [(2, 2), (None, None)]
    assert to_target(runs, 1, target) == [(2, 20), (None, None)]


def test_e5_target_is_what_dense_reaches_in_every_seed_unless_training_alone_reaches_it():
    from dgc import target_accuracy
    results = {"dense": [[0.84, 0.8519], [0.8526, 0.85]], "dense, momentum": [[0.8531, 0.853]],
               "local": [[0.849, 0.8]], "local, momentum": [[0.7, 0.8]]}
    assert target_accuracy(results, ("dense", "dense, momentum"), ("local", "local, momentum")) == 0.851
    results["local, momentum"] = [[0.7, 0.8511]]
    assert target_accuracy(results, ("dense", "dense, momentum"), ("local", "local, momentum")) is None


def test_e5_one_worker_training_alone_is_dense_sgd_bit_for_bit():
    from types import SimpleNamespace
    from dgc import train
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    X, Xt = torch.randn(256, 6, generator=gen), torch.randn(512, 6, generator=gen)
    y, yt = (X[:, 0] > 0).long(), (Xt[:, 0] > 0).long()
    runs = {}
    for workers in (1, 3):
        args = SimpleNamespace(workers=workers, epochs=3, batch=16, lr=0.1)
        for local in (False, True):
            runs[workers, local] = train("e5", lambda r: C.NoCompression(), X, y, Xt, yt, args, 1, 0.9, local=local)
    (dense_acc, dense_bits), (alone_acc, alone_bits) = runs[1, False], runs[1, True]
    assert alone_acc == dense_acc and all(b.sum() > 0 for b in dense_bits) and not np.any(alone_bits)
    assert runs[3, True][0] != runs[3, False][0]                           # with 3 workers exchange matters


def test_e4_held_out_runs_are_read_as_ranges_over_all_samples_and_the_draws():
    from adaptive_sparsification import check_finding, check_report, check_runs

    def run(seed, keep, tracker, best=100.0):
        d = 8
        bits = lambda v: {"steps": 10, "bits": {"check": v}, "k_mean": 3.0}
        runs = {f"k={k}": bits(best + abs(k - 4)) for k in (1, 2, 4, 8)}      # k = 4 is the best
        runs["k=8"] = bits(150.0)                                               # dense
        runs |= {"greedy[check]": bits(120.0), "tracker[check]": bits(tracker),
                 "tracker-PL[check]": bits(best * 1.02), "tracker-f*[check]": bits(best)}
        return {"dataset": "a9a", "lam": 0.01, "eps": 1e-6, "d": d, "cost": "39k + 32 bits", "seed": seed,
                "keep": keep, "runs": runs}
    stored = run(None, 1.0, 110.0)
    assert check_runs(stored) == [stored] and check_runs(None) == []          # a file from before the draws
    runs = [run(1, 0.9, 104.0), stored, run(0, 0.9, 101.0)]
    assert [r["seed"] for r in check_runs(runs)] == [None, 0, 1]                 # all samples first
    text = check_finding(runs)
    assert "3 runs: all samples; 90% of them, seed 0; 90% of them, seed 1" in text
    assert "the tracker needs 1.01–1.10× the bits of the best fixed k (k = 4)" in text
    assert "0.67–0.73× those of dense GD" in text and "missed: 1 of 3 runs above 1.05× the best" in text
    table = check_report(runs)
    assert [line.split(" | ")[0] for line in table[-3:]] == ["| all samples", "| 90% of them, seed 0",
                                                             "| 90% of them, seed 1"]
