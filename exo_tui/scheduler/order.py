"""Ring order: the cyclic order of nodes that minimises the total hop cost around the ring.

Exact (Held-Karp dynamic program, vectorised) for up to :data:`EXACT_MAX` nodes; above that,
nearest neighbour from every start (vectorised) followed by 2-opt on the symmetrised costs.
Deterministic: ties go to the smaller index, and the result starts at index 0's node when exact.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

EXACT_MAX = 10
HEURISTIC_STARTS = 2  # nearest-neighbour tours tried before 2-opt


def tour_cost(cost: np.ndarray, order: Sequence[int]) -> float:
    n = len(order)
    if n < 2:
        return 0.0
    return float(sum(cost[order[i], order[(i + 1) % n]] for i in range(n)))


def ring_order(cost: np.ndarray) -> list[int]:
    """Indices ``0..n-1`` in the cyclic order of least total ``cost[i, j]`` (i → j)."""
    n = cost.shape[0]
    if n <= 3:
        if n == 3 and cost[0, 2] + cost[2, 1] + cost[1, 0] < cost[0, 1] + cost[1, 2] + cost[2, 0]:
            return [0, 2, 1]
        return list(range(n))
    if n <= EXACT_MAX:
        return _held_karp(cost)
    return _heuristic(cost)


_MASKS: dict[int, tuple[np.ndarray, ...]] = {}


def _held_karp(cost: np.ndarray) -> list[int]:
    """Exact: start at node 0, visit the others (bitmask over 1..n-1), return to 0."""
    n = cost.shape[0]
    m = n - 1
    full = 1 << m
    c = cost[1:, 1:]
    dp = np.full((full, m), np.inf)
    parent = np.full((full, m), -1, dtype=np.int64)
    for j in range(m):
        dp[1 << j, j] = cost[0, j + 1]
    if m not in _MASKS:
        counts = np.array([bin(x).count("1") for x in range(full)])
        _MASKS[m] = tuple(np.flatnonzero(counts == k) for k in range(m + 1))
    by_count = _MASKS[m]
    for k in range(2, m + 1):
        masks = by_count[k]
        for j in range(m):
            sel = masks[(masks >> j) & 1 == 1]
            prev = sel ^ (1 << j)
            # dp[prev, i] + c[i, j] over i in prev (others are inf)
            cand = dp[prev] + c[:, j][None, :]
            best = cand.argmin(axis=1)
            dp[sel, j] = cand[np.arange(len(sel)), best]
            parent[sel, j] = best
    last = dp[full - 1] + cost[1:, 0]
    j = int(last.argmin())
    mask = full - 1
    path = []
    while j >= 0:
        path.append(j + 1)
        pj = int(parent[mask, j])
        mask ^= 1 << j
        j = pj if mask else -1
    return [0, *reversed(path)]


def _heuristic(cost: np.ndarray) -> list[int]:
    n = cost.shape[0]
    sym = (cost + cost.T) / 2.0
    best_order: list[int] | None = None
    best_cost = np.inf
    starts = range(0, n, max(1, n // HEURISTIC_STARTS))
    for s in starts:
        order = _nearest_neighbour(sym, s)
        c = tour_cost(sym, order)
        if c < best_cost - 1e-15:
            best_cost, best_order = c, order
    assert best_order is not None
    order = _two_opt(sym, best_order, 3 if n <= 32 else 2)
    i = order.index(min(order))
    return order[i:] + order[:i]


def _nearest_neighbour(sym: np.ndarray, start: int) -> list[int]:
    n = sym.shape[0]
    visited = np.zeros(n, dtype=bool)
    order = [start]
    visited[start] = True
    cur = start
    for _ in range(n - 1):
        row = np.where(visited, np.inf, sym[cur])
        cur = int(row.argmin())
        visited[cur] = True
        order.append(cur)
    return order


def _two_opt(sym: np.ndarray, order: list[int], max_passes: int = 3) -> list[int]:
    n = len(order)
    tour = np.array(order)
    for _ in range(max_passes):
        improved = False
        for i in range(n - 2):
            a, b = tour[i], tour[i + 1]
            js = np.arange(i + 2, n if i > 0 else n - 1)
            if len(js) == 0:
                continue
            c = tour[js]
            d = tour[(js + 1) % n]
            delta = sym[a, c] + sym[b, d] - sym[a, b] - sym[c, d]
            k = int(delta.argmin())
            if delta[k] < -1e-12:
                j = int(js[k])
                tour[i + 1 : j + 1] = tour[i + 1 : j + 1][::-1].copy()
                improved = True
        if not improved:
            break
    return [int(x) for x in tour]


def brute_force_order(cost: np.ndarray) -> list[int]:
    """The exact order by trying every permutation (for tests, n <= 8)."""
    n = cost.shape[0]
    best = None
    best_c = np.inf
    for perm in itertools.permutations(range(1, n)):
        order = [0, *perm]
        c = tour_cost(cost, order)
        if c < best_c - 1e-15:
            best_c, best = c, order
    return best or list(range(n))
