"""E4: adaptive sparsification (Khirirat, Magnússon, Aytekin, Johansson, arXiv:2003.06377) in the paper's
setting. Writes docs/adaptive_sparsification.{json,png} and the E4 section of docs/compression.md.

    python experiments/adaptive_sparsification.py --data DIR     # DIR holds a9a.xz etc. (LIBSVM format, xz)

Everything takes about ten minutes of one core; each invocation adds its runs to (or replaces them in)
docs/adaptive_sparsification.json and rewrites the section from all of it, so the parts can be run one
at a time, e.g. `--logistic a9a --ridge "" --zerosum-dataset ""` (about two minutes).

Part 1 (the paper's setting): plain compressed gradient descent x⁺ = x − (1/L)·T_k(∇f(x)) on one node
with the true gradient, no error feedback, T_k per coordinate (the k entries of largest magnitude).
Each step's message goes through an encoder that emits ⌈log2 d⌉ index bits and 32 value bits per entry,
plus an optional fixed cost per message (zerosum.compression.adaptive.BitCost, encode_sparse), and the
bits counted are the bits it emitted. k is either fixed (a sweep) or chosen each step by the rule
k* = argmax_k ||T_k(g)||² / C(k) with C exactly the cost being counted (the script checks this at every
step). Variants of the rule: the same ratio with the curvature-aware one-step bound
(||T_k g||²/L − g_Sᵀ M g_S/(2L²), M the Hessian bound), the log-reduction of the gap f − f* per bit
(uses f*, an oracle), and a multi-step criterion (for each k of the grid, a 30-step rollout of top-k GD
on the quadratic model at x*). The same runs are also priced in ZeroSum bytes for one worker with
1-value blocks, and the rule is run with that cost. Problems: logistic regression and least squares
(on the ±1 labels) with λ/2·||x||², a bias feature, f* by Newton's method or a linear solve.

Part 2 (ZeroSum): logistic regression over n workers, blocks of B values; every worker sends its local
gradient on a common set of blocks, so the sum is T_k of the aggregate gradient (plain compressed GD
again). The set is chosen on the aggregate (the paper's rule, an oracle here: the aggregate is known only
after the allreduce) or on the previous step's aggregate (what every worker has; no extra traffic);
bytes are worker 0's in ZeroSum packets (`wire_bytes` with every worker's blocks), and the rule optimises
exactly those (`zerosum_prefix_bytes`). For reference, the previous E4 design: per-worker top-k blocks
inside error feedback (TopKBlocks, AdaptiveTopKBlocks).

Part 3 (against the baselines a user would pick; `--baselines`, about 15 minutes): logistic regression on
each data set in 3 draws of 90 % of its samples, every step sent in the cheaper of two formats (k entries
with indices, or all d values without them). Rows: dense GD without indices, k = 1 % of d (a budget
chosen before training), the one-step rule, the best fixed k in hindsight (a fine sweep near d), and
`LevelTracker`, which tracks the best level online by the measured decrease of log ||g||² per bit.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from zerosum import compression as C
from zerosum.compression import adaptive as A
from zerosum.compression.base import block_rows
from libsvm import read_libsvm, signed_labels
from report import update_sections


# ---------------------------------------------------------------------------------------------------------
# Data and problems

def load_libsvm(path: Path):
    """A LIBSVM file (xz): COO arrays (rows, cols 0-based, values), labels mapped to ±1, features."""
    rows, cols, vals, labels = read_libsvm(path)
    return rows, cols, vals, signed_labels(labels), int(cols.max()) + 1


class Data:
    """The samples with a bias feature (value 1) appended, as COO sorted by row, plus column access.
    With `keep` < 1, a random share of the samples (without replacement, drawn with `seed`): one draw of
    the data set, for spread over seeds where the method itself is deterministic."""

    def __init__(self, path: Path, keep: float = 1.0, seed: int = 0):
        r, c, v, self.y, d0 = load_libsvm(path)
        self.name = path.name.removesuffix(".xz")
        if keep < 1:
            rows = np.sort(np.random.default_rng(seed).choice(len(self.y), int(keep * len(self.y)), replace=False))
            renumber = np.full(len(self.y), -1)
            renumber[rows] = np.arange(len(rows))
            inside = renumber[r] >= 0
            r, c, v, self.y = renumber[r[inside]], c[inside], v[inside], self.y[rows]
        self.N, self.d = len(self.y), d0 + 1
        r = np.r_[r, np.arange(self.N)]
        c = np.r_[c, np.full(self.N, d0)]
        v = np.r_[v, np.ones(self.N)]
        o = np.argsort(r, kind="stable")
        self.r, self.c, self.v = r[o], c[o], v[o]
        self.row_ptr = np.r_[0, np.cumsum(np.bincount(self.r, minlength=self.N))]

    def chunks(self, weights_per_value=None, size=4096):
        """Dense row chunks (start, stop, matrix)."""
        for a in range(0, self.N, size):
            b = min(self.N, a + size)
            lo, hi = self.row_ptr[a], self.row_ptr[b]
            X = np.zeros((b - a, self.d))
            vals = self.v[lo:hi] if weights_per_value is None else weights_per_value[lo:hi]
            X[self.r[lo:hi] - a, self.c[lo:hi]] = vals
            yield a, b, X


class Logistic:
    """f(x) = (1/N) Σ_i log(1 + exp(−y_i a_iᵀx)) + λ/2 ||x||². With z = Bx (B's rows y_i a_i), the gradient
    is Bᵀs/N + λx, s_i = −1/(1 + exp(z_i)); z is updated column by column when few coordinates move.
    M = 0.25 BᵀB/N + λI bounds the Hessian; L = λ_max(M). f* by Newton's method."""
    kind = "logistic"

    def __init__(self, data: Data, lam: float, workers: int = 1):
        self.data, self.lam, self.d, self.N = data, lam, data.d, data.N
        self.w = data.y[data.r] * data.v                      # B in COO
        o = np.argsort(data.c, kind="stable")
        self.col_rows, self.col_w = data.r[o], self.w[o]
        self.col_ptr = np.r_[0, np.cumsum(np.bincount(data.c, minlength=self.d))]
        BtB = sum(X.T @ X for _, _, X in data.chunks(self.w))
        self.M = 0.25 * BtB / self.N + lam * np.eye(self.d)
        self.L = float(np.linalg.eigvalsh(self.M).max())
        bounds = np.linspace(0, self.N, workers + 1).round().astype(int)
        self.shards = [(data.row_ptr[a], data.row_ptr[b], (b - a) / self.N) for a, b in zip(bounds, bounds[1:])]
        self.x_star, self.f_star = self._newton()
        z = self._z(self.x_star)
        p = 1 / (1 + np.exp(-z))
        self.H = sum((X * (p[a:b] * (1 - p[a:b]))[:, None]).T @ X for a, b, X in data.chunks(self.w)) / self.N \
            + lam * np.eye(self.d)
        self.H_inv = np.linalg.inv(self.H)
        self.reset()

    def _newton(self):
        x = np.zeros(self.d)
        for _ in range(40):
            g, H = self.lam * x, self.lam * np.eye(self.d)
            for a, b, X in self.data.chunks(self.w):
                z = X @ x
                p = 1 / (1 + np.exp(-z))
                g = g - X.T @ (1 - p) / self.N
                H = H + (X * (p * (1 - p))[:, None]).T @ X / self.N
            step = np.linalg.solve(H, g)
            x -= step
            if np.abs(step).max() < 1e-13:
                break
        self.x = x
        self.z = self._z(x)
        return x, self.value()

    def _z(self, x):
        return np.bincount(self.data.r, weights=self.w * x[self.data.c], minlength=self.N)

    def reset(self):
        self.x = np.zeros(self.d)
        self.z = np.zeros(self.N)
        self.moves = 0

    def value(self):
        return float(np.mean(np.logaddexp(0, -self.z)) + self.lam / 2 * self.x @ self.x)

    def gap(self):
        return self.value() - self.f_star

    def grad(self):
        s = -1 / (1 + np.exp(self.z))
        return np.bincount(self.data.c, weights=self.w * s[self.data.r], minlength=self.d) / self.N + self.lam * self.x

    def local_grads(self):
        """Each worker's share: B_iᵀs_i/N + (N_i/N)λx (they sum to the gradient)."""
        s = -1 / (1 + np.exp(self.z))
        out = []
        for lo, hi, share in self.shards:
            g = np.bincount(self.data.c[lo:hi], weights=self.w[lo:hi] * s[self.data.r[lo:hi]], minlength=self.d)
            out.append(g / self.N + share * self.lam * self.x)
        return out

    def move(self, idx, delta):
        idx = np.asarray(idx)
        self.x[idx] += delta
        self.moves += 1
        if (self.col_ptr[idx + 1] - self.col_ptr[idx]).sum() > len(self.w) / 3 or self.moves % 2000 == 0:
            self.z = self._z(self.x)
            return
        for j, dj in zip(idx, delta):
            lo, hi = self.col_ptr[j], self.col_ptr[j + 1]
            self.z[self.col_rows[lo:hi]] += self.col_w[lo:hi] * dj


class Ridge:
    """f(x) = (1/2N) ||Ax − y||² + λ/2 ||x||² (least squares on the ±1 labels): gradient Hx − q with
    H = AᵀA/N + λI (= M, exact), f − f* = ½ (x − x*)ᵀ H (x − x*); both updated exactly per coordinate."""
    kind = "ridge"

    def __init__(self, data: Data, lam: float):
        self.data, self.lam, self.d, self.N = data, lam, data.d, data.N
        self.M = sum(X.T @ X for _, _, X in data.chunks()) / self.N + lam * np.eye(self.d)
        self.q = np.zeros(self.d)
        for a, b, X in data.chunks():
            self.q += X.T @ data.y[a:b] / self.N
        self.L = float(np.linalg.eigvalsh(self.M).max())
        self.x_star = np.linalg.solve(self.M, self.q)
        self.H, self.H_inv = self.M, np.linalg.inv(self.M)
        self.f_star = float(0.5 * np.mean(data.y ** 2) - 0.5 * self.q @ self.x_star)
        self.reset()

    def reset(self):
        self.x = np.zeros(self.d)
        self.g = -self.q.copy()

    def gap(self):
        return float(0.5 * (self.x - self.x_star) @ self.g)

    def grad(self):
        return self.g.copy()

    def move(self, idx, delta):
        self.x[idx] += delta
        self.g += self.M[:, idx] @ delta


# ---------------------------------------------------------------------------------------------------------
# Costs and rules

def bit_costs(d: int) -> dict[str, A.BitCost]:
    """The bit-cost models: payload only (the paper's ⌈log2 d⌉ + 32 per entry), plus a fixed cost per message
    for two technologies (illustrative values, not the paper's): UDP over IPv4 over Ethernet (14 + 20 + 8 header
    bytes, one message: at most 1472 payload bytes, which every message here fits), and IEEE 802.15.4-like
    frames (31 bytes of PHY and MAC overhead per frame, at most 102 payload bytes)."""
    return {"payload": A.BitCost(d),
            "udp": A.BitCost(d, per_message=8 * 42, max_payload=8 * 1472),
            "802.15.4": A.BitCost(d, per_message=8 * 31, max_payload=8 * 102)}


COST_LABELS = {"payload": "payload only", "udp": "+ UDP/IPv4/Ethernet header per message",
               "802.15.4": "802.15.4-like frames", "zerosum": "ZeroSum bytes (1 worker, 1-value blocks)"}


def zerosum_single_cost(d: int):
    """ZeroSum bytes for k one-value blocks sent by one worker (columns = d), for the rule (bits: ×8)."""
    table = 8 * A.zerosum_prefix_bytes(np.arange(d), d, 1)
    return lambda k: table[np.asarray(k) - 1]


def zerosum_single_bytes(d: int, idx: np.ndarray, vals: np.ndarray) -> int:
    contribution = np.zeros(d, np.float32)
    contribution[idx] = vals
    return C.wire_bytes(contribution, 1, columns=d)


class Rule:
    """Selects the coordinates to send from the gradient g: fixed k, or the adaptive rule and its variants."""

    def __init__(self, name, k=None, cost=None, criterion="bound", horizon=30):
        self.name, self.k, self.cost, self.criterion, self.horizon = name, k, cost, criterion, horizon
        self.history: list[int] = []

    def rollout(self, g, problem):
        """Multi-step criterion: for each k of the fixed sweep, run `horizon` steps of top-k GD (step 1/L) on
        the quadratic model gᵀδ + ½δᵀHδ (H: the Hessian at x*, exact for least squares) and take the k with
        the largest log-reduction of the model's gap per bit, ½rᵀH⁻¹r with r its gradient."""
        H, Hinv, L = problem.H, problem.H_inv, problem.L
        gap0 = 0.5 * g @ Hinv @ g
        best, best_rate = 1, -np.inf
        for k in k_grid(len(g)):
            r = g.copy()
            for _ in range(self.horizon):
                idx = np.argpartition(-np.abs(r), k - 1)[:k] if k < len(r) else np.arange(len(r))
                r += H[:, idx] @ (-r[idx] / L)
            gap = max(0.5 * r @ Hinv @ r, 1e-300)
            rate = np.log(gap0 / gap) / (self.horizon * float(self.cost(np.array([k]))[0]))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def __call__(self, g, problem):
        order = A.magnitude_order(g)
        if self.k is not None:
            k = min(self.k, len(g))
        elif self.criterion == "bound":
            k, _ = A.choose_k(g, self.cost)
        else:
            gs = g[order].astype(np.float64)
            G = np.cumsum(gs ** 2)
            costs = self.cost(np.arange(1, len(g) + 1))
            if self.criterion == "curvature":
                W = problem.M[np.ix_(order, order)] * np.outer(gs, gs)
                Q = np.diagonal(np.cumsum(np.cumsum(W, axis=0), axis=1))
                gain = G / problem.L - Q / (2 * problem.L ** 2)
            elif self.criterion == "log-gap":
                gap = problem.gap()
                gain = -np.log1p(-np.minimum(G / (2 * problem.L) / gap, 1 - 1e-15))
            elif self.criterion == "rollout":
                k = self.rollout(g, problem)
                self.history.append(k)
                return order[:k]
            else:
                raise ValueError(self.criterion)
            k = A.argmax_ratio(gain, costs)
        self.history.append(k)
        return order[:k]


def to_target(problem, step, eps, max_steps):
    """From the start, step() until f − f* ≤ ε or `max_steps` steps: (steps to ε or None, the last gap)."""
    problem.reset()
    for n in range(max_steps + 1):
        gap = problem.gap()
        if gap <= eps:
            return n, gap
        if n == max_steps:
            return None, gap
        step()


def gd_to_target(problem, step, eps, max_steps):
    """Compressed GD with step 1/L from the start until f − f* ≤ ε or `max_steps`: step(g) gives the message
    (indices, float32 values) sent for gradient g. Returns (steps to ε or None, the last gap)."""
    def gd_step():
        idx, vals = step(problem.grad())
        problem.move(idx, -vals.astype(np.float64) / problem.L)
    return to_target(problem, gd_step, eps, max_steps)


def descend(problem, rule, d, eps, max_steps, costs: dict[str, A.BitCost], own: str | None):
    """Compressed GD with step 1/L until f − f* ≤ ε. Every message is encoded under each bit-cost model and
    priced in ZeroSum bytes (`wire_bytes`); `own` names the cost the rule optimises, which is checked to be
    what is counted. The encoder's output length depends only on the number of entries, and `wire_bytes`
    of one worker's 1-value blocks (one column each) only on how many are non-zero, so each is measured
    once per message size and reused."""
    totals = {name: 0 for name in costs} | {"zerosum": 0}
    measured: dict = {}
    mismatches = 0

    def step(g):
        nonlocal mismatches
        idx = rule(g, problem)
        vals = g[idx].astype(np.float32)           # what the encoder carries (decode_sparse: tested)
        key = (len(idx), int(np.count_nonzero(vals)))
        if key not in measured:
            measured[key] = m = {name: A.emitted_bits(A.encode_sparse(idx, vals, cost)) for name, cost in costs.items()}
            m["zerosum"] = 8 * zerosum_single_bytes(d, idx, vals)
            if own is not None and m[own] != rule.cost(np.array([len(idx)]))[0]:
                mismatches += 1
        for name, bits in measured[key].items():
            totals[name] += bits
        return idx, vals

    steps, gap = gd_to_target(problem, step, eps, max_steps)
    ks = np.array(rule.history) if rule.history else np.array([0])
    return {"steps": steps, "final_gap": gap, "bits": totals, "mismatches": mismatches,
            "k_min": int(ks.min()), "k_max": int(ks.max()), "k_mean": float(ks.mean())}


def k_grid(d):
    return sorted({2 ** i for i in range(20) if 2 ** i < d} | {d})


# ---------------------------------------------------------------------------------------------------------
# Part 1: the paper's setting

def part1(problem, eps, max_steps, variants=True, refine=True, log=print):
    d = problem.d
    costs = bit_costs(d)
    models = list(costs) + ["zerosum"]
    model_cost = {name: costs[name] for name in costs} | {"zerosum": zerosum_single_cost(d)}
    runs = {}

    def fixed(k, fine):
        t = time.time()
        runs[f"k={k}"] = r = descend(problem, Rule(f"k={k}", k=k), d, eps, max_steps, costs, None)
        r["k"], r["fine"] = k, fine
        log(f"  {problem.data.name} {problem.kind} fixed k={k}: {r['steps']} steps, "
            f"{r['bits']['payload'] / 1e3:.0f} kbit payload ({time.time() - t:.1f}s)")

    for k in k_grid(d):
        fixed(k, False)
    if refine:          # every k from half to twice each cost's best k of the grid
        region = set()
        for model in models:
            done = [(r["bits"][model], r["k"]) for r in runs.values() if r["steps"] is not None]
            best = min(done)[1]
            region |= set(range(max(1, best // 2), min(d, 2 * best) + 1))
        for k in sorted(region - set(k_grid(d))):
            fixed(k, True)
    criteria = ["bound"] + (["curvature", "log-gap", "rollout"] if variants else [])
    for model in models:
        for crit in criteria:
            t = time.time()
            rule = Rule(f"adaptive[{model},{crit}]", cost=model_cost[model], criterion=crit)
            runs[rule.name] = r = descend(problem, rule, d, eps, max_steps, costs, model)
            r["model"], r["criterion"] = model, crit
            log(f"  {problem.data.name} {problem.kind} {rule.name}: {r['steps']} steps, "
                f"{r['bits'][model] / 1e3:.0f} kbit, k {r['k_min']}..{r['k_max']} mean {r['k_mean']:.1f}, "
                f"cost mismatches {r['mismatches']} ({time.time() - t:.1f}s)")
    return {"dataset": problem.data.name, "problem": problem.kind, "N": problem.N, "d": d, "lam": problem.lam,
            "L": problem.L, "f_star": problem.f_star, "eps": eps, "max_steps": max_steps,
            "costs": {name: costs[name].describe() for name in costs} | {"zerosum": "ZeroSum wire_bytes × 8"},
            "runs": runs}


def summarise(result, model):
    """Adaptive (and variants) against the worst and median fixed k of the grid and the best fixed k of the
    grid and its refinement (every k around the grid's best), in the model's cost."""
    fixed = [(r["k"], r["bits"][model], r.get("fine", False)) for name, r in result["runs"].items()
             if name.startswith("k=") and r["steps"] is not None]
    if not fixed:
        return None
    grid = sorted([(b, k) for k, b, fine in fixed if not fine])
    every = sorted([(b, k) for k, b, fine in fixed])
    best, worst = every[0][::-1], grid[-1][::-1]
    median = float(np.median([b for b, _ in grid]))
    out = {"best": best, "best_grid": grid[0][::-1], "worst": worst, "median": median, "n_fixed": len(fixed)}
    for crit in ("bound", "curvature", "log-gap", "rollout"):
        r = result["runs"].get(f"adaptive[{model},{crit}]")
        if r is not None:
            out[crit] = {"bits": r["bits"][model] if r["steps"] is not None else None, "steps": r["steps"],
                         "k": (r["k_min"], r["k_max"], r["k_mean"])}
    return out


# ---------------------------------------------------------------------------------------------------------
# Part 2: ZeroSum blocks, n workers

def part2(problem: Logistic, workers, B, eps, max_steps, log=print):
    d = problem.d
    m = -(-d // B)

    def blocks(v):
        return block_rows(v.astype(np.float32), B)[0]

    def run(name, select, stale=False):
        total, prev, ks, mismatches = 0, None, [], 0

        def step():
            nonlocal total, prev, mismatches
            local = problem.local_grads()
            agg = np.sum(local, axis=0)
            own_has = np.abs(blocks(local[0])).max(axis=1) > 0
            basis = agg if not stale else prev
            if basis is None:                                  # no previous aggregate yet: send everything
                chosen, model = np.ones(m, bool), None
            else:
                k, order, model = select(blocks(basis), own_has)
                chosen = np.zeros(m, bool)
                chosen[order[:k]] = True
            mask = np.repeat(chosen, B)[:d]
            contributions = [(g * mask).astype(np.float32) for g in local]
            sent = C.wire_bytes(contributions[0], B, columns=m, rounds=C.rounds_of(contributions, B))
            if model is not None and sent != model:
                mismatches += 1
            total += sent
            ks.append(int(chosen.sum()))
            estimate = np.sum(contributions, axis=0).astype(np.float64)
            idx = np.flatnonzero(mask)
            problem.move(idx, -estimate[idx] / problem.L)
            prev = agg

        steps, gap = to_target(problem, step, eps, max_steps)
        ks = np.array(ks or [0])
        r = {"steps": steps, "final_gap": gap, "bytes": total, "k_min": int(ks.min()), "k_max": int(ks.max()),
             "k_mean": float(ks.mean()), "mismatches": mismatches}
        log(f"  zerosum {name}: {steps} steps, {total * 8 / 1e3:.0f} kbit, blocks {r['k_min']}..{r['k_max']} "
            f"mean {r['k_mean']:.1f}, cost mismatches {mismatches}")
        return r

    def fixed(k):
        def select(rows, has):
            order = A.magnitude_order(np.einsum("ij,ij->i", rows, rows))
            return k, order, None
        return select

    def adaptive(rows, has):
        k, order = A.choose_blocks(rows, has, columns=m)
        return k, order, int(A.zerosum_prefix_bytes(order, m, B, has, columns=m)[k - 1])

    runs = {}
    grid = list(range(1, m + 1))
    for k in grid:
        runs[f"aggregate k={k}"] = run(f"aggregate k={k}", fixed(k))
    runs["aggregate adaptive"] = run("aggregate adaptive", adaptive)
    for k in grid:
        runs[f"stale k={k}"] = run(f"stale k={k}", fixed(k), stale=True)
    runs["stale adaptive"] = run("stale adaptive", adaptive, stale=True)
    runs.update(error_feedback(problem, workers, B, m, eps, max_steps, grid, log))
    return {"dataset": problem.data.name, "workers": workers, "block_size": B, "blocks": m, "lam": problem.lam,
            "L": problem.L, "eps": eps, "max_steps": max_steps, "runs": runs}


def error_feedback(problem, workers, B, m, eps, max_steps, grid, log):
    """The previous E4 design: each worker sends top-k blocks of its local gradient plus its remainder."""
    out = {}
    for k in grid + ["adaptive"]:
        comps = [C.AdaptiveTopKBlocks(columns=m, block_size=B) if k == "adaptive"
                 else C.TopKBlocks(k / m, True, block_size=B) for _ in range(workers)]
        total = 0

        def step():
            nonlocal total
            contributions = [c.compress(g.astype(np.float32), 0) for c, g in zip(comps, problem.local_grads())]
            total += C.wire_bytes(contributions[0], B, columns=m, rounds=C.rounds_of(contributions, B))
            estimate = np.sum(contributions, axis=0).astype(np.float64)
            problem.move(np.arange(problem.d), -estimate / problem.L)

        steps, gap = to_target(problem, step, eps, max_steps)
        name = f"EF k={k}" if k != "adaptive" else "EF adaptive"
        out[name] = {"steps": steps, "final_gap": gap, "bytes": total}
        if k == "adaptive":
            h = np.array(comps[0].history)
            out[name].update(k_min=int(h.min()), k_max=int(h.max()), k_mean=float(h.mean()))
        log(f"  zerosum {name}: {steps} steps, {total * 8 / 1e3:.0f} kbit")
    return out


# ---------------------------------------------------------------------------------------------------------
# Part 3: the rules against the baselines a user would pick, over draws of the data

SEGMENT_DENSE_STEPS = 2     # a LevelTracker segment: the bits of this many dense steps
WARMUP = 0.5                # the share of a segment not scored (the switch's transient)


def level_models(d: int) -> dict[str, tuple]:
    """Per cost model, (sparse cost: bits of k entries as a function of an array of k, dense cost: bits of a
    step that sends all d values without indices). The bit models are `bit_costs` (dense: `encode_dense`);
    for ZeroSum, sparse is one worker's 1-value blocks and dense is uncompressed ZeroSum (blocks of 256)."""
    models = {name: (cost, cost.dense_bits) for name, cost in bit_costs(d).items()}
    models["zerosum"] = (zerosum_single_cost(d), 8 * C.wire_bytes(np.ones(d, np.float32), 256, columns=2048))
    return models


def fixed_levels(d: int) -> list[int]:
    """The fixed k of the sweep: 1, k = 1 % of d, the powers of two, and every round(d / 2^(j/8)) down
    to d/8 (the best fixed k lies there in every run of the sweep above), and d."""
    return sorted({1, one_percent(d)} | {2 ** i for i in range(20) if 2 ** i < d}
                  | {int(round(d / 2 ** (j / 8))) for j in range(25)})


def one_percent(d: int) -> int:
    """k chosen before training by a budget: 1 % of the coordinates (at least one)."""
    return max(1, round(d / 100))


class Pricer:
    """Bits of one step under every model, each step sent in the cheaper of two formats: k entries with
    indices (`encode_sparse`; ZeroSum: `wire_bytes` of 1-value blocks) or all d values without indices
    (`encode_dense`; ZeroSum: uncompressed, blocks of 256). The bits are those the encoders emit, measured
    once per (k, non-zero values) and checked against the models' formulas."""

    def __init__(self, d: int, costs: dict[str, A.BitCost] | None = None):
        """`costs`: the bit models (default `bit_costs`, and ZeroSum beside them; given: those alone)."""
        self.d = d
        self.costs = bit_costs(d) if costs is None else costs
        self.models = level_models(d) if costs is None else {name: (c, c.dense_bits) for name, c in costs.items()}
        dense = np.ones(d, np.float32)
        self.dense = {name: A.emitted_bits(A.encode_dense(dense, cost)) for name, cost in self.costs.items()}
        if "zerosum" in self.models:
            self.dense["zerosum"] = self.models["zerosum"][1]
        for name, cost in self.costs.items():
            assert self.dense[name] == cost.dense_bits, name
        self.memo: dict = {}

    def __call__(self, idx: np.ndarray, vals: np.ndarray) -> dict[str, int]:
        key = (len(idx), int(np.count_nonzero(vals)))
        if key not in self.memo:
            sparse = {name: A.emitted_bits(A.encode_sparse(idx, vals, cost)) for name, cost in self.costs.items()}
            if "zerosum" in self.models:
                sparse["zerosum"] = 8 * zerosum_single_bytes(self.d, idx, vals)
            for name, cost in self.costs.items():
                assert sparse[name] == cost(np.array([len(idx)]))[0], name
            self.memo[key] = {name: min(bits, self.dense[name]) for name, bits in sparse.items()}
        return self.memo[key]


def descend_levels(problem, choose, pricer: Pricer, own: str | None, eps, max_steps):
    """Compressed GD with step 1/L until f − f* ≤ ε, k from choose(g, bits sent so far in the `own` model).
    Bits are counted under every model (`Pricer`)."""
    totals = dict.fromkeys(pricer.models, 0)
    ks = []

    def step(g):
        k = choose(g, totals[own] if own else 0)
        idx = A.magnitude_order(g)[:k]
        vals = g[idx].astype(np.float32)
        for name, bits in pricer(idx, vals).items():
            totals[name] += bits
        ks.append(k)
        return idx, vals

    steps, gap = gd_to_target(problem, step, eps, max_steps)
    ks = np.array(ks or [0])
    return {"steps": steps, "final_gap": gap, "bits": totals, "k_min": int(ks.min()), "k_max": int(ks.max()),
            "k_mean": float(ks.mean())}


def greedy_chooser(sparse, dense):
    """The paper's one-step rule, k* = argmax ||T_k(g)||² / C(k), with C(k) the cheaper format's bits."""
    return lambda g, bits: A.choose_k(g, lambda k: np.minimum(sparse(k), dense))[0]


TRACKERS = {"tracker": "log ||g||²", "tracker-PL": "log(f − ℓ), ℓ = max f − ||g||²/(2λ)",
            "tracker-f*": "log(f − f*), an oracle"}


def tracker_chooser(problem, sparse, dense, kind="tracker"):
    """A tracker over `level_grid`, segments of SEGMENT_DENSE_STEPS dense steps' bits, the first WARMUP
    of each unscored. 'tracker': `LevelTracker`, potential log ||g||²; 'tracker-PL': `GapLevelTracker`
    with the lower bound f − ||g||²/(2λ) (f is λ-strongly convex); 'tracker-f*': the same with f* itself."""
    levels = A.level_grid(problem.d, sparse, dense)
    if kind == "tracker":
        tracker = A.LevelTracker(levels, SEGMENT_DENSE_STEPS * dense, warmup=WARMUP)
        return (lambda g, bits: tracker.choose(float(np.log(g @ g)), bits)), tracker
    tracker = A.GapLevelTracker(levels, SEGMENT_DENSE_STEPS * dense, warmup=WARMUP)

    def choose(g, bits):
        f = problem.value()
        lower = problem.f_star if kind == "tracker-f*" else f - float(g @ g) / (2 * problem.lam)
        return tracker.choose_gap(f, lower, bits)
    return choose, tracker


def part3(problem, eps, max_steps, log=print, pricer: Pricer | None = None, levels=None):
    """Fixed k (`fixed_levels`, or `levels`), the one-step rule and the tracker under every model of
    `pricer` (default: `Pricer(d)`)."""
    d = problem.d
    pricer = pricer or Pricer(d)
    runs = {}
    for k in levels or fixed_levels(d):
        t = time.time()
        runs[f"k={k}"] = r = descend_levels(problem, lambda g, bits: k, pricer, None, eps, max_steps)
        log(f"  {problem.data.name} fixed k={k}: {r['steps']} steps ({time.time() - t:.1f}s)")
    for model, (sparse, dense) in pricer.models.items():
        t = time.time()
        runs[f"greedy[{model}]"] = r = descend_levels(problem, greedy_chooser(sparse, dense), pricer, model,
                                                      eps, max_steps)
        for kind in TRACKERS:
            choose, tracker = tracker_chooser(problem, sparse, dense, kind)
            runs[f"{kind}[{model}]"] = r2 = descend_levels(problem, choose, pricer, model, eps, max_steps)
            r2["path"] = [k for k, _ in tracker.segments]
            log(f"  {problem.data.name} {model}: {kind} {r2['steps']} steps k mean {r2['k_mean']:.1f}")
        log(f"  {problem.data.name} {model}: greedy {r['steps']} steps k mean {r['k_mean']:.1f} "
            f"({time.time() - t:.1f}s)")
    return {"dataset": problem.data.name, "N": problem.N, "d": d, "lam": problem.lam, "eps": eps, "L": problem.L,
            "max_steps": max_steps, "runs": runs}


CHECK = dict(dataset="a9a", lam=0.01, eps=1e-6, per_message=32)


def held_out_check(data_dir, max_steps, log=print, keep: float = 1.0, seed: int | None = None):
    """A setting none of the tracker's parameters was chosen on: a9a, λ = 0.01 (10 times the steps),
    C(k) = 39k + 32 bits (⌈log2 124⌉ + 32 bits an entry, 32 bits a message), on all samples or (keep < 1)
    on one draw of them. Fixed k only from d/8 up (k = 1 would need ~60,000 steps; the sweep's best k lies
    above d/8 everywhere)."""
    problem = Logistic(Data(Path(data_dir) / f"{CHECK['dataset']}.xz", keep, seed or 0), CHECK["lam"])
    d = problem.d
    pricer = Pricer(d, {"check": A.BitCost(d, per_message=CHECK["per_message"])})
    levels = sorted({k for k in fixed_levels(d) if k >= d / 8})
    res = part3(problem, CHECK["eps"], max_steps, log, pricer, levels)
    res.update(seed=seed if keep < 1 else None, keep=keep, cost=pricer.costs["check"].describe())
    return res


def check_runs(check) -> list[dict]:
    """The held-out runs: all samples, then the draws (a file from before the draws holds one run)."""
    runs = [check] if isinstance(check, dict) else list(check or [])
    return sorted(runs, key=lambda r: (r["keep"] < 1, r["seed"] or 0))


def samples_label(run) -> str:
    return "all samples" if run["keep"] >= 1 else f"{run['keep']:.0%} of them, seed {run['seed']}"


def check_finding(check) -> str | None:
    """The held-out runs' reading: tracker, one-step rule and k = d/2 against the best fixed k and dense GD,
    as ranges over the runs."""
    runs = check_runs(check)
    if not runs:
        return None
    cs = [compare(r, "check") for r in runs]
    rng = lambda key, base: ratio_range([c[key] / c[base] if c[key] else None for c in cs])
    best_ks = ", ".join(dict.fromkeys(str(c["best_k"]) for c in cs))      # each k once
    return (f"- Held out ({runs[0]['dataset']}, λ = {runs[0]['lam']:g}, {runs[0]['cost']}; {len(runs)} run{'s' if len(runs) > 1 else ''}: "
            f"{'; '.join(samples_label(r) for r in runs)}; table below): the tracker needs {rng('tracker', 'best')} "
            f"the bits of the best fixed k (k = {best_ks}) and {rng('tracker', 'dense')} those of dense GD "
            f"without indices; the one-step rule {rng('greedy', 'best')} and {rng('greedy', 'dense')}, fixed "
            f"k = d/2 {rng('half', 'best')} and {rng('half', 'dense')}; with the potentials log(f − ℓ) and "
            f"log(f − f*) the tracker needs {rng('tracker-PL', 'best')} and {rng('tracker-f*', 'best')} the best. "
            f"Goal (≤ 1.05× the best and < dense, in every run): "
            + goal_text([c["tracker"] / c["best"] for c in cs if c["tracker"]],
                        [c["tracker"] / c["dense"] for c in cs if c["tracker"]],
                        sum(c["tracker"] is None for c in cs)) + ".")


def check_report(check) -> list[str]:
    runs = check_runs(check)
    if not runs:
        return []
    first = runs[0]
    rows = []
    for run in runs:
        c = compare(run, "check")
        fixed = {int(n[2:]): r for n, r in run["runs"].items() if n.startswith("k=") and r["steps"] is not None}
        median_k = sorted(fixed)[len(fixed) // 2]
        tr, gr = run["runs"]["tracker[check]"], run["runs"]["greedy[check]"]
        rows.append(
            f"| {samples_label(run)} | {c['dense'] / 1e6:.3f} Mbit | {c['greedy'] / 1e6:.3f} Mbit (k mean {gr['k_mean']:.0f}) | "
            f"{c['best'] / 1e6:.3f} Mbit (k = {c['best_k']}) | {c['half'] / 1e6:.3f} Mbit | "
            f"{fixed[median_k]['bits']['check'] / 1e6:.3f} Mbit "
            f"(k = {median_k}) | {c['tracker'] / 1e6:.3f} Mbit (k mean {tr['k_mean']:.0f}) | "
            f"{c['tracker'] / c['best']:.2f}× | {c['tracker'] / c['dense']:.2f}× | "
            + " | ".join("—" if c.get(kind) is None else f"{c[kind] / c['best']:.2f}×" for kind in ("tracker-PL", "tracker-f*"))
            + " |")
    return ["", f"### Held out: {first['dataset']}, λ = {first['lam']:g}, ε = {first['eps']:g}, {first['cost']}", "",
            "A setting none of the tracker's parameters (segment, warm-up, grid) was chosen on: ten times the steps "
            "of λ = 0.1, one cost model; fixed k from d/8 to d. Run on all samples and on draws of them (the "
            "method being deterministic, the draws give the spread).", "",
            "| samples | dense GD, no indices | one-step rule | best fixed k | k = d/2 | median fixed k (k ≥ d/8) | tracker | "
            "tracker / best | tracker / dense | PL / best | f* / best |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
            *rows]


def compare(result, model):
    """The rules and baselines of one draw in one model's bits: dense (k = d, sent without indices),
    k = 1 % of d, the best fixed k in hindsight, the greedy rule and the tracker (None: ε not reached)."""
    runs = result["runs"]
    bits = lambda r: r["bits"][model] if r["steps"] is not None else None
    fixed = [(bits(r), -int(name[2:])) for name, r in runs.items() if name.startswith("k=") and bits(r)]
    best = min(fixed)                          # ties (k priced as dense): the largest k
    best = (best[0], -best[1])
    one = runs.get(f"k={one_percent(result['d'])}")
    return {"dense": bits(runs[f"k={result['d']}"]), "one_percent": one and bits(one),
            "half": bits(runs[f"k={round(result['d'] / 2)}"]),
            "best": best[0], "best_k": best[1], "greedy": bits(runs[f"greedy[{model}]"])} \
        | {kind: bits(runs[f"{kind}[{model}]"]) for kind in TRACKERS if f"{kind}[{model}]" in runs}


# ---------------------------------------------------------------------------------------------------------
# Report

def fmt_k(r):
    return f"{r['k_min']}–{r['k_max']}, mean {r['k_mean']:.1f}" if r["k_min"] != r["k_max"] else f"{r['k_min']}"


def kb(bits):
    return "—" if bits is None else f"{bits / 1e3:,.1f}"


PAPER = [
    "What the paper says, as far as it was found. Only the abstracts of arXiv:2003.06377 (v1, \"Communication "
    "efficient sparsification for large scale machine learning\"; v2 and AAAI 2021, 35(9) 8101–8109, \"A "
    "flexible framework for communication-efficient machine learning\") and v1's introduction were reachable "
    "(deepai.org, researchtrend.ai, ar5iv and AAAI abstract pages; the text search found no copy of the body). "
    "They state the rule's aim (maximise the improvement of the objective per communicated bit, at each "
    "iteration, adapting to the true gradient), the baseline (compression levels \"chosen before training\"), "
    "that the cost model is to be adapted to \"the specific technology\", and (v1's introduction) 32 bits per "
    "transmitted entry. Not found: the exact rule and its equation, the paper's cost model(s) and their "
    "parameters, its data sets, step size, k values and results. A third-party implementation (repository not "
    "identified) prices T entries at T·(32 + ⌈log2 d⌉) bits and a message at c0·payload/P_max + c1 with "
    "c0 = 576, c1 = 64, P_max = 512, citing the AAAI paper; that could not be checked. So the problems, "
    "λ, ε, the step 1/L (the step under which the descent-lemma argument gives the rule), the k grid and the "
    "per-message costs here are this repository's choices, not the paper's.",
]


PREVIOUS = (
    "The previous E4 applied the rule inside error feedback, on each worker's gradient plus its stored "
    "remainder, with whole 8-value blocks and a cost of 276 + 48k bytes that left out the header-only "
    "entries for the other workers' blocks (λ = 0.01, 8 workers on a9a: 2955 kbit against 2106 for the best "
    "of fixed k = 1, 2, 4, 8, 16 blocks, 1.40×) and called the claim not reproduced. That tested another "
    "setting than the paper's: inside error feedback the descent-lemma bound behind the rule does not hold "
    "(steps to ε hardly change with k there), the cost was not the one measured, and the baseline was the best "
    "fixed k chosen after the fact. Its design is the 'EF' rows of the ZeroSum table below.")


def ratio_range(values):
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{lo}×" if lo == hi else f"{lo}–{hi}×"


def conclusions(part1_results, zs):
    out = []
    if part1_results:
        per_d = [res["runs"]["k=1"]["steps"] / res["runs"][f"k={res['d']}"]["steps"] / res["d"]
                 for res in part1_results if res["runs"]["k=1"]["steps"] and res["runs"][f"k={res['d']}"]["steps"]]
        out.append(f"- Steps to ε grow about like d/k with the step 1/L: fixed k = 1 needs "
                   f"{min(per_d):.2f}–{max(per_d):.2f}·d times the steps of dense GD. A kept entry buys about the "
                   "same progress whatever k is, so with a cost per entry only, the bits to ε are nearly flat in k.")
        nodex = [res["runs"][f"k={res['d']}"]["steps"] * 32 * res["d"] / summarise(res, "payload")["best"][1]
                 for res in part1_results if res["runs"][f"k={res['d']}"]["steps"]]
        out.append(f"- k = d is priced with its indices like every other k; sent densely without them (32 bits a "
                   f"value) it would still cost {ratio_range(nodex)} the best fixed k with the payload-only cost.")
        for model in COST_LABELS:
            rows = [(res, summarise(res, model)) for res in part1_results]
            rows = [(res, s) for res, s in rows if s and s["bound"]["bits"] is not None]
            if not rows:
                continue
            rb = [s["bound"]["bits"] / s["best"][1] for _, s in rows]
            rm = [s["bound"]["bits"] / s["median"] for _, s in rows]
            rw = [s["bound"]["bits"] / s["worst"][1] for _, s in rows]
            ks = sorted({s["best"][0] for _, s in rows})
            kmean = [s["bound"]["k"][2] for _, s in rows]
            what = (f"the rule picks k = 1 (mean k ≤ {max(kmean):.2f}; k > 1 only on floating-point ties between "
                    "equal magnitudes), i.e. it is fixed k = 1, and costs"
                    if model == "payload" else f"the rule's k averages {min(kmean):.0f}–{max(kmean):.0f}; it costs")
            out.append(f"- {COST_LABELS[model][0].upper() + COST_LABELS[model][1:]}: {what} {ratio_range(rb)} the "
                       f"best fixed k (best k: {', '.join(map(str, ks))}), {ratio_range(rm)} the median and "
                       f"{ratio_range(rw)} the worst fixed k.")
        variants = []
        for res in part1_results:
            for model in COST_LABELS:
                s = summarise(res, model)
                if not s:
                    continue
                for crit in ("bound", "curvature", "log-gap", "rollout"):
                    v = res["runs"].get(f"adaptive[{model},{crit}]")
                    if v and v["steps"] is not None:
                        variants.append((v["bits"][model] / s["best"][1], res, model, crit))
        grid_wins = []
        for res in part1_results:
            for model in COST_LABELS:
                s_ = summarise(res, model)
                for crit in ("bound", "curvature", "log-gap", "rollout"):
                    v = res["runs"].get(f"adaptive[{model},{crit}]")
                    if s_ and v and v["steps"] is not None and v["bits"][model] < s_["best_grid"][1]:
                        grid_wins.append(v["bits"][model] / s_["best_grid"][1])
        wins = [v for v in variants if v[0] < 1]
        lo = min(variants, key=lambda v: v[0])
        if wins:
            out.append(f"- Rule or variant below the best fixed k, in {len(wins)} of {len(variants)} runs: "
                       + "; ".join(
                f"{r['dataset']} {r['problem']}, {COST_LABELS[m]}, {c}: {x:.3f}×" for x, r, m, c in wins)
                + f". Everywhere else it needed more; the lowest ratio was {lo[0]:.3f}×.")
        else:
            out.append(f"- In none of the {len(variants)} runs (rule and variants, every problem and cost) did "
                       f"adaptive k reach ε with less than the best fixed k; the closest was {lo[0]:.3f}× "
                       f"({lo[1]['dataset']} {lo[1]['problem']}, {COST_LABELS[lo[2]]}, {lo[3]}).")
        if grid_wins:
            out.append(f"- Against the best k of the powers-of-two grid alone, {len(grid_wins)} of the {len(variants)} "
                       f"runs needed less ({ratio_range(grid_wins)} of it): the best k of a coarse grid can be a few "
                       "per cent off the best k.")
        per = {m: [summarise(res, m) for res in part1_results] for m in COST_LABELS}
        rel = lambda m, key: [s["bound"]["bits"] / (s[key][1] if key != "median" else s[key])
                              for s in per[m] if s and s["bound"]["bits"] is not None]
        msg = ("udp", "802.15.4")
        final = ("- The sweep's one-step rule against its baselines: with a cost per message it needs "
                 f"{ratio_range(sum((rel(m, 'best') for m in msg), []))} the bits of the best fixed k in hindsight, "
                 f"{ratio_range(sum((rel(m, 'median') for m in msg), []))} those of the median of the powers-of-two "
                 f"sweep and {ratio_range(sum((rel(m, 'worst') for m in msg), []))} those of its worst (k = 1); "
                 f"in ZeroSum bytes {ratio_range(rel('zerosum', 'best'))} the best and "
                 f"{ratio_range(rel('zerosum', 'median'))} the median; with the payload-only cost it is k = 1. "
                 "The median and the worst of a sweep are no level a user would choose: against dense GD "
                 "without indices and the best fixed k, see the first table of this section, where the "
                 "tracker replaces it.")
    else:
        final = None
    if zs:
        runs = zs["runs"]
        agg = {n: r for n, r in runs.items() if n.startswith("aggregate k=") and r["steps"] is not None}
        best = min(agg.items(), key=lambda kv: kv[1]["bytes"])
        med = float(np.median([r["bytes"] for r in agg.values()]))
        a, st = runs["aggregate adaptive"], runs["stale adaptive"]
        ef = {n: r for n, r in runs.items() if n.startswith("EF") and r["steps"] is not None}
        ef_best = min(ef.items(), key=lambda kv: kv[1]["bytes"]) if ef else None
        line = (f"- ZeroSum blocks ({zs['workers']} workers, blocks of {zs['block_size']}): the rule on the "
                f"aggregate sends {a['bytes'] / best[1]['bytes']:.2f}× the bytes of the best fixed k "
                f"({best[0].split()[-1]}) and "
                f"{a['bytes'] / med:.2f}× the median; on the previous aggregate (implementable without extra traffic) "
                f"{st['bytes'] / best[1]['bytes']:.2f}× that best.")
        if ef_best:
            small_ef = [runs.get(f"EF k={k}", {}).get("steps") for k in (1, 2)]
            ef_small = (f"did not reach ε within {zs['max_steps']} steps" if None in small_ef else "reached it too")
            line += (f" Error feedback with per-worker top-k blocks, outside the rule's setting, reaches ε with less: "
                     f"{ef_best[0]} sends {ef_best[1]['bytes'] / best[1]['bytes']:.2f}× the best plain fixed k "
                     f"(its adaptive variant {runs['EF adaptive']['bytes'] / best[1]['bytes']:.2f}×), while k ≤ 2 "
                     f"blocks with error feedback {ef_small}.")
        out.append(line)
    if final:
        out.append(final)
    return out


def spread(values, fmt="{:.2f}×"):
    """'mean (min–max)' of the values, or '—' if any is missing."""
    if not values or any(v is None for v in values):
        return "—"
    return f"{fmt.format(np.mean(values))} ({min(values):.2f}–{max(values):.2f})"


BASELINE_ROWS = (("dense", "dense GD, no indices"), ("one_percent", "k = 1 % of d"), ("half", "k = d/2"),
                 ("greedy", "one-step rule"),
                 ("best", "best fixed k"), ("tracker", "tracker"))


def by_dataset(draws):
    out: dict = {}
    for r in draws:
        out.setdefault(r["dataset"], []).append(r)
    return out


def goal_text(tracker_best, tracker_dense, missing=0) -> str:
    """The issue's goal: within 1.05× of the best fixed k in hindsight and below dense GD, in every run."""
    if missing:
        return f"missed ({missing} runs did not reach ε)"
    worst_best, worst_dense = max(tracker_best), max(tracker_dense)
    if worst_best <= 1.05 and worst_dense < 1:
        return "met"
    misses = []
    if worst_best > 1.05:
        over = sum(r > 1.05 for r in tracker_best)
        misses.append(f"{over} of {len(tracker_best)} runs above 1.05× the best, the worst {worst_best:.3f}×")
    if worst_dense >= 1:
        misses.append(f"not below dense in {sum(r >= 1 for r in tracker_dense)} runs ({worst_dense:.2f}× at worst)")
    return "missed: " + "; ".join(misses)


def baseline_findings(draws) -> list[str]:
    """The goal (tracker within 1.05× the best fixed k in hindsight, and below dense GD without indices,
    in every draw of every data set) per cost model, with the one-step rule and the variants beside it."""
    out = []
    for model in COST_LABELS:
        rows = [compare(r, model) for r in draws]
        ratio = lambda key, ref: [c[key] / c[ref] for c in rows if c.get(key) and c[ref]]
        label = COST_LABELS[model][0].upper() + COST_LABELS[model][1:]
        if all(c["best"] == c["dense"] for c in rows):
            # against what a user without ZeroSum sends: dense GD's values alone (the payload cost of k = d)
            dense_plain = [compare(r, "payload")["dense"] for r in draws]
            plain = [c["tracker"] / d for c, d in zip(rows, dense_plain) if c.get("tracker") and d]
            out.append(f"- {label}: sending everything uncompressed is the best fixed level in every run (a 1-value "
                       f"block costs a 16-byte entry beside its 4 bytes); the tracker stays there "
                       f"({ratio_range(ratio('tracker', 'best'))} of it), and so does the one-step rule. With ZeroSum, "
                       "sparsifying a model of this size per coordinate does not pay. Against dense GD sent as plain "
                       f"floats without indices, that level and the tracker cost {ratio_range(plain)} the bits: "
                       "with 1-value blocks no level is below dense GD here, ZeroSum's blocks are for models whose "
                       "gradients are sparse in blocks of many values (E3, E6).")
            continue
        out.append(f"- {label}: the tracker needs {ratio_range(ratio('tracker', 'best'))} the bits of the best fixed k "
                   f"in hindsight and {ratio_range(ratio('tracker', 'dense'))} those of dense GD without indices "
                   f"({len(rows)} runs: {len(by_dataset(draws))} data sets × {len(rows) // len(by_dataset(draws))} "
                   f"draws); the one-step rule {ratio_range(ratio('greedy', 'best'))} the best, k = 1 % of d "
                   f"{ratio_range(ratio('one_percent', 'best'))}, dense GD {ratio_range(ratio('dense', 'best'))}, "
                   f"k = d/2 {ratio_range(ratio('half', 'best'))} the best and "
                   f"{ratio_range(ratio('half', 'dense'))} dense GD. "
                   f"Goal (≤ 1.05× the best and < dense, in every run): "
                   f"{goal_text(ratio('tracker', 'best'), ratio('tracker', 'dense'), sum(c['tracker'] is None for c in rows))}. "
                   f"With the potential log(f − ℓ): {ratio_range(ratio('tracker-PL', 'best'))} the best; with "
                   f"log(f − f*) (oracle): {ratio_range(ratio('tracker-f*', 'best'))}.")
    misses: dict = {}
    for r in draws:
        for model in COST_LABELS:
            c = compare(r, model)
            if c["tracker"] and c["tracker"] / c["best"] > 1.05:
                misses.setdefault(r["dataset"], []).append(c["tracker"] / c["best"])
    if misses:
        where = []
        for name, ratios in misses.items():
            r = next(r for r in draws if r["dataset"] == name)
            dense_steps = r["runs"][f"k={r['d']}"]["steps"]
            runs_text = f"{len(ratios)} run" + ("s" if len(ratios) > 1 else "")
            where.append(f"{name} in {runs_text} (up to {max(ratios):.3f}×; dense GD reaches ε in "
                         f"{dense_steps} steps there)")
    pairs = [(compare(r, m)["tracker"], compare(r, m)["half"], compare(r, m)["dense"]) for r in draws
             for m in ("payload", "udp", "802.15.4")]
    pairs = [(t, h, d) for t, h, d in pairs if t and h]
    if pairs:
        out.append(f"- Against fixed k = d/2: the tracker needs less in {sum(t < h for t, h, _ in pairs)} of "
                   f"{len(pairs)} bit-cost runs ({ratio_range([t / h for t, h, _ in pairs])} of its bits); k = d/2 "
                   f"stays below dense GD in {sum(h < d for _, h, d in pairs)} of them, the tracker in "
                   f"{sum(t < d for t, _, d in pairs)}. A fraction of d fixed before training does about as well "
                   "here, because the best k lies at 0.4–0.7·d on every data set of this section; the tracker finds "
                   "that level without being told, and sent less than dense GD in every run.")
    if misses:
        out.append("- Where the tracker misses 1.05×: " + ", ".join(where) + ". It starts dense and moves one level "
                   f"(a factor 2^(1/4) in k) per two segments of {SEGMENT_DENSE_STEPS} dense steps' bits, so on runs "
                   "of a few dozen dense steps the walk to the best k (about d/2) is a large share of the run; "
                   "shorter segments walk faster but compare noisier scores.")
    return out


def baseline_report(draws, args) -> list[str]:
    if not draws:
        return []
    keep, seeds = draws[0]["keep"], sorted({r["seed"] for r in draws})
    lines = ["### Against the baselines a user would pick", "",
             f"Logistic regression, λ = {draws[0]['lam']:g}, bits to f − f* ≤ {draws[0]['eps']:g}; each data set "
             f"in {len(seeds)} draws of {keep:.0%} of its samples (seeds {', '.join(map(str, seeds))}), the "
             "method itself being deterministic: each cell is the mean over the draws, ratios are mean "
             "(min–max) over the draws. Every step is sent in the cheaper of two formats: k entries with "
             "indices, or all d values without indices (dense; for ZeroSum, uncompressed ZeroSum with blocks of "
             "256). Baselines: dense GD (k = d, so sent without indices); k = 1 % of d, a budget chosen before "
             "training; k = d/2 (rounded), a fraction chosen before training but after seeing the sweep above, "
             "whose best k lies near it; the paper's one-step rule k* = argmax ||T_k g||²/C(k); the best fixed k in hindsight, "
             "over k = 1, 1 % of d, the powers of two and every round(d/2^(j/8)) from d down to d/8 (on ties, "
             "as above the sparse format's break-even, the largest k). 'tracker': `LevelTracker` "
             "(zerosum.compression.adaptive) over k = d, d/2^(1/4), ... (those cheaper than dense), segments of "
             f"the bits of {SEGMENT_DENSE_STEPS} dense steps, the first {WARMUP:.0%} of each unscored, score = "
             "decrease of the potential log ||g||² per bit, starting dense. Its parameters (segment, warm-up, "
             "grid) were chosen on a9a, mushrooms and phishing; variants tried after these runs (shorter "
             "segments, a coarser grid, doubling the probe's stride after a move) did not bring every run "
             "within 1.05× and were not adopted; the held-out setting below was run after. Variants (`GapLevelTracker`): the potential log(f − ℓ) with ℓ the largest lower bound "
             "f − ||g||²/(2λ) so far ('PL'), and log(f − f*) ('f*', an oracle).", "",
             "| data set | cost | " + " | ".join(label for _, label in BASELINE_ROWS)
             + " | best k | tracker / best | tracker / dense | rule / best | PL / best | f* / best |",
             "|---|---|" + "--:|" * (len(BASELINE_ROWS) + 6)]
    for name, group in by_dataset(draws).items():
        for model in COST_LABELS:
            rows = [compare(r, model) for r in group]
            scale = (lambda b: b / 8e3) if model == "zerosum" else (lambda b: b / 1e3)
            cell = lambda key: "—" if any(c[key] is None for c in rows) else f"{scale(np.mean([c[key] for c in rows])):,.1f}"
            ratio = lambda a, b: [None if c.get(a) is None else c[a] / c[b] for c in rows]
            lines.append(f"| {name} (d = {group[0]['d']}) | {COST_LABELS[model]} "
                         f"({'kB' if model == 'zerosum' else 'kbit'}) | "
                         + " | ".join(cell(key) for key, _ in BASELINE_ROWS)
                         + f" | {', '.join(str(c['best_k']) for c in rows)} | {spread(ratio('tracker', 'best'))} | "
                         f"{spread(ratio('tracker', 'dense'))} | {spread(ratio('greedy', 'best'))} | "
                         f"{spread(ratio('tracker-PL', 'best'))} | {spread(ratio('tracker-f*', 'best'))} |")
    return lines


def report(part1_results, zs, args, draws=(), check=None):
    lines = [f"## E4: adaptive sparsification in the paper's setting (plain compressed GD, step 1/L, "
             f"λ = {args.lam:g}, ε = {args.eps:g} on f − f*)", "",
             "Generated by `python experiments/adaptive_sparsification.py --data DIR` (numbers also in "
             "[adaptive_sparsification.json](adaptive_sparsification.json), figure "
             "[adaptive_sparsification.png](adaptive_sparsification.png)).", ""]
    lines += PAPER + ["", PREVIOUS, ""]
    lines += ["Findings against the baselines a user would pick (the table right below):", ""]
    lines += baseline_findings(draws) if draws else []
    finding = check_finding(check)
    if finding:
        lines.append(finding)
    lines += [""]
    lines += baseline_report(draws, args) + check_report(check) + [""]
    lines += ["Findings of the sweep (the tables below):", ""] + conclusions(part1_results, zs) + [""]
    lines += ["### Adaptive k against the fixed-k sweep", "",
              "One node, true gradient, no error feedback, x⁺ = x − (1/L)·T_k(∇f(x)), T_k per coordinate. "
              "Cost of a step: ⌈log2 d⌉ index bits + 32 value bits per kept entry as emitted by the encoder, plus "
              "per message: nothing (payload only), a 42-byte UDP/IPv4/Ethernet header, or 802.15.4-like frames "
              "(31 bytes overhead per frame of at most 102 payload bytes); last, ZeroSum bytes for one worker "
              "with 1-value blocks. The rule k* = argmax ||T_k(g)||²/C(k) optimises exactly the cost in its "
              "column (checked at every step). Fixed k runs over the powers of two below d and d itself (the "
              "grid), then over every k from half to twice each cost's best k of the grid; 'best' is the best "
              "of all of them, 'median' and 'worst' are over the grid; all are chosen after the fact, with the "
              "costs known. Variants: the same ratio with the curvature-aware "
              "bound ||T_k g||²/L − g_SᵀMg_S/(2L²) ('curv.'), the log-reduction of f − f* per bit "
              "('log-gap', an oracle: it uses f*), and a multi-step criterion ('rollout': for each k of the "
              "sweep, 30 steps of top-k GD on the quadratic model with the Hessian at x*, exact for least "
              "squares; the k with the largest log-reduction of the model's gap per bit). Least squares: "
              "f = ||Ax − y||²/(2N) + λ||x||²/2 on the ±1 labels.", "",
              "| problem | cost | best fixed k: cost | median | worst fixed k: cost | adaptive: cost (k range) | "
              "adaptive / best | / median | / worst | curv. / best | log-gap / best | rollout / best |",
              "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for res in part1_results:
        for model in COST_LABELS:
            s = summarise(res, model)
            if s is None:
                continue
            conv = (lambda b: b / 8) if model == "zerosum" else (lambda b: b)
            u = "kB" if model == "zerosum" else "kbit"
            a = s["bound"]
            ratio = lambda v, ref: "—" if v is None else f"{v / ref:.2f}×"
            lines.append(
                f"| {res['dataset']} {res['problem']} (d = {res['d']}) | {COST_LABELS[model]} | "
                f"k = {s['best'][0]}: {kb(conv(s['best'][1]))} {u} | {kb(conv(s['median']))} | "
                f"k = {s['worst'][0]}: {kb(conv(s['worst'][1]))} | "
                f"{kb(None if a['bits'] is None else conv(a['bits']))} "
                f"({a['k'][0]}–{a['k'][1]}, mean {a['k'][2]:.1f}) | "
                f"{ratio(a['bits'], s['best'][1])} | {ratio(a['bits'], s['median'])} | "
                f"{ratio(a['bits'], s['worst'][1])} | "
                f"{ratio(s.get('curvature', {}).get('bits'), s['best'][1])} | "
                f"{ratio(s.get('log-gap', {}).get('bits'), s['best'][1])} | "
                f"{ratio(s.get('rollout', {}).get('bits'), s['best'][1])} |")
    lines += ["", "The whole sweep (steps to ε; cost to ε in kbit, ZeroSum in kB):", "",
              "| problem | k | steps | payload | + UDP header | 802.15.4-like | ZeroSum kB |",
              "|---|--:|--:|--:|--:|--:|--:|"]
    for res in part1_results:
        for name, r in res["runs"].items():
            if name.startswith("k=") and not r.get("fine"):
                b = r["bits"]
                ok = r["steps"] is not None
                lines.append(f"| {res['dataset']} {res['problem']} | {r['k']} | {r['steps'] if ok else '—'} | "
                             f"{kb(b['payload']) if ok else '—'} | {kb(b['udp']) if ok else '—'} | "
                             f"{kb(b['802.15.4']) if ok else '—'} | {kb(b['zerosum'] / 8) if ok else '—'} |")
    if zs:
        lines += ["", f"### ZeroSum blocks: {zs['workers']} workers, blocks of {zs['block_size']} "
                  f"({zs['dataset']} logistic, m = {zs['blocks']} blocks)", "",
                  "Fixed k: every k from 1 to m. Every worker sends its local gradient on a common set of k blocks, "
                  "so the aggregate is T_k of "
                  "the gradient (plain compressed GD). 'aggregate': the set is the top-k blocks of the current "
                  "aggregate gradient (the paper's rule; an oracle in ZeroSum, where the aggregate is known only "
                  "after the allreduce). 'stale': the top-k blocks of the previous step's aggregate, which every "
                  "worker holds (the first step sends all blocks). 'adaptive' chooses k by ||T_k||²/bytes(k) with "
                  "bytes(k) exactly worker 0's ZeroSum bytes (entries, payload, datagram headers, header-only "
                  "entries; checked every step). 'EF': the previous E4 design, each worker's own top-k blocks "
                  "inside error feedback (AdaptiveTopKBlocks per worker).", "",
                  "| method | steps to ε | kB sent by worker 0 to ε | blocks per step |", "|---|--:|--:|--:|"]
        for name, r in zs["runs"].items():
            ok = r["steps"] is not None
            blocks_ = fmt_k(r) if "k_min" in r else name.split("k=")[-1]
            sent = f"{r['bytes'] / 1e3:.1f}" if ok else "—"
            lines.append(f"| {name} | {r['steps'] if ok else '—'} | {sent} | {blocks_} |")
    return lines


def slim(name, run):
    """A run as stored: without the fields that say nothing for it."""
    run = dict(run)
    if run.get("steps") is not None:
        run.pop("final_gap", None)
    if "k=" in name and run.get("k_min", 0) == run.get("k_max", 0):
        for key in ("k_min", "k_max", "k_mean"):
            run.pop(key, None)
    if not run.get("mismatches"):
        run.pop("mismatches", None)
    return run


def to_json(obj, indent=0):
    """JSON with one line per small object (a run), so the file stays readable and diffable."""
    flat = json.dumps(obj, default=float, ensure_ascii=False)
    if not isinstance(obj, (dict, list)) or len(flat) <= 160:
        return flat
    pad = " " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {to_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    return "[\n" + ",\n".join(pad + to_json(v, indent + 1) for v in obj) + "\n" + " " * indent + "]"


def figure(part1_results, zs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(COST_LABELS)
    n = len(part1_results)
    if not n:
        return
    fig, axes = plt.subplots(len(models), n, figsize=(3.2 * n, 2.6 * len(models)), squeeze=False)
    for j, res in enumerate(part1_results):
        fixed = sorted([(r["k"], r) for name, r in res["runs"].items() if name.startswith("k=") and r["steps"]],
                       key=lambda kr: kr[0])
        for i, model in enumerate(models):
            ax = axes[i][j]
            scale = 1 / 8e3 if model == "zerosum" else 1e-3
            ax.plot([k for k, _ in fixed], [r["bits"][model] * scale for _, r in fixed], "o-", color="grey",
                    markersize=2.5, linewidth=1, label="fixed k")
            for crit, color in (("bound", "C3"), ("curvature", "C0"), ("log-gap", "C2"), ("rollout", "C4")):
                r = res["runs"].get(f"adaptive[{model},{crit}]")
                if r and r["steps"]:
                    ax.axhline(r["bits"][model] * scale, color=color, label=f"adaptive ({crit})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            if i == 0:
                ax.set_title(f"{res['dataset']} {res['problem']}", fontsize=9)
            if j == 0:
                ax.set_ylabel(("kB" if model == "zerosum" else "kbit") + " to ε\n" + COST_LABELS[model], fontsize=7)
            if i == len(models) - 1:
                ax.set_xlabel("k")
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    fig.suptitle("E4: cost to f − f* ≤ ε, fixed k (sweep) vs adaptive k, plain compressed GD", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="directory with the LIBSVM .xz files")
    p.add_argument("--logistic", default="mushrooms,phishing,a9a", help="data sets for logistic regression")
    p.add_argument("--ridge", default="mushrooms,phishing,a9a,w8a", help="data sets for least squares")
    p.add_argument("--lam", type=float, default=0.1)
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--max-steps", type=int, default=40000)
    p.add_argument("--no-variants", action="store_true", help="only the rule itself, not its variants")
    p.add_argument("--no-refine", action="store_true",
                   help="only the powers-of-two sweep, not every k around each cost's best")
    p.add_argument("--zerosum-dataset", default="a9a", help="'' to skip part 2")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--zerosum-max-steps", type=int, default=3000)
    p.add_argument("--baselines", default="phishing,mushrooms,a9a,w8a",
                   help="data sets for the rules against the baselines (part 3; '' to skip)")
    p.add_argument("--seeds", default="0,1,2", help="draws of the data for part 3")
    p.add_argument("--keep", type=float, default=0.9, help="share of the samples in each draw (part 3)")
    p.add_argument("--check", action="store_true", help="the held-out setting (a9a, λ = 0.01, 39k + 32 bits)")
    p.add_argument("--out", default="docs")
    p.add_argument("--fresh", action="store_true",
                   help="start a new JSON instead of adding to (and replacing runs in) the existing one")
    args = p.parse_args()
    out = Path(args.out)
    data = {}

    def get(name):
        if name not in data:
            data[name] = Data(Path(args.data) / f"{name}.xz")
        return data[name]

    path = out / "adaptive_sparsification.json"
    store = json.loads(path.read_text()) if path.exists() and not args.fresh else {}
    results = [r for r in store.get("part1", []) if r["lam"] == args.lam and r["eps"] == args.eps]
    zs = store.get("zerosum")
    if zs and (zs["lam"] != args.lam or zs["eps"] != args.eps):
        zs = None
    for kind, names in (("logistic", args.logistic), ("ridge", args.ridge)):
        for name in filter(None, names.split(",")):
            t = time.time()
            problem = Logistic(get(name), args.lam) if kind == "logistic" else Ridge(get(name), args.lam)
            print(f"{name} {kind}: N = {problem.N}, d = {problem.d}, L = {problem.L:.4g}, f* = {problem.f_star:.6g}",
                  flush=True)
            res = part1(problem, args.eps, args.max_steps, not args.no_variants, not args.no_refine,
                        log=lambda s: print(s, flush=True))
            results = [r for r in results if (r["dataset"], r["problem"]) != (name, kind)] + [res]
            print(f"  ({time.time() - t:.0f}s)", flush=True)
    if args.zerosum_dataset:
        problem = Logistic(get(args.zerosum_dataset), args.lam, workers=args.workers)
        zs = part2(problem, args.workers, args.block_size, args.eps, args.zerosum_max_steps,
                   log=lambda s: print(s, flush=True))
    draws = [r for r in store.get("baselines", []) if r["lam"] == args.lam and r["eps"] == args.eps]
    for name in filter(None, args.baselines.split(",")):
        for seed in map(int, filter(None, args.seeds.split(","))):
            t = time.time()
            problem = Logistic(Data(Path(args.data) / f"{name}.xz", args.keep, seed), args.lam)
            res = part3(problem, args.eps, args.max_steps, log=lambda s: print(s, flush=True))
            res.update(seed=seed, keep=args.keep)
            draws = [r for r in draws if (r["dataset"], r["seed"]) != (name, seed)] + [res]
            print(f"  {name} seed {seed} ({time.time() - t:.0f}s)", flush=True)
            path.write_text(to_json({"part1": results, "zerosum": zs, "baselines": draws}) + "\n")
    check = check_runs(store.get("check"))
    if args.check:
        for seed in [None] + list(map(int, filter(None, args.seeds.split(",")))):
            if any(r["seed"] == seed for r in check):
                continue               # (a run already stored: the method is deterministic)
            run = held_out_check(args.data, args.max_steps, lambda s: print(s, flush=True),
                                 1.0 if seed is None else args.keep, seed)
            check = check_runs(check + [run])
            path.write_text(to_json({"part1": results, "zerosum": zs, "baselines": draws, "check": check}) + "\n")
    draws.sort(key=lambda r: (r["d"], r["seed"]))
    results.sort(key=lambda r: (r["problem"] != "logistic", r["d"]))
    for res in results + ([zs] if zs else []):
        res["runs"] = {name: slim(name, r) for name, r in res["runs"].items()}
    for res in draws + check:
        res["runs"] = {name: slim(name, r) for name, r in res["runs"].items()}
    path.write_text(to_json({"part1": results, "zerosum": zs, "baselines": draws, "check": check}) + "\n")
    figure(results, zs, out / "adaptive_sparsification.png")
    lines = report(results, zs, args, draws, check)
    update_sections(out / "compression.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
