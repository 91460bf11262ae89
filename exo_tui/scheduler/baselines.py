"""The baselines: exo's ring memory-weighted split, reproduced exactly (``exo-ring``), and the same
idea done right (``memory``: largest remainder, reserves, exact memory checks).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from exo_tui.scheduler.context import PlanContext
from exo_tui.scheduler.dp import dp_split, dp_split_any, ordered_ring
from exo_tui.scheduler.profile import DeviceProfile

# ------------------------------------------------------------------------------- strategies


def exo_ring_partitions(profiles: Iterable[DeviceProfile]) -> list[tuple[str, float, float]]:
    """exo's ``RingMemoryWeightedPartitioningStrategy.partition``: ``(node_id, start, end)`` in
    ``[0, 1]``, nodes by (memory, id) descending, ends rounded to 5 decimals.

    Memory is the device's total memory (exo's ``DeviceCapabilities.memory``).
    """
    nodes = sorted(((p.compute_memory_total, p.node_id) for p in profiles), reverse=True)
    total = sum(m for m, _ in nodes)
    if not nodes or total <= 0:
        return []
    parts = []
    start = 0.0
    for mem, nid in nodes:
        end = round(start + mem / total, 5)
        parts.append((nid, start, end))
        start = end
    return parts


def exo_map_partitions(parts: Sequence[tuple[str, float, float]], n_layers: int) -> list[tuple[str, int, int]]:
    """exo's ``map_partitions_to_shards``, with ``end`` exclusive: layers ``int(start * L)`` to
    ``int(end * L) - 1``, the last partition stretched to the last layer, empty ones dropped."""
    shards: list[tuple[str, int, int]] = []
    for i, (nid, s, e) in enumerate(parts):
        a = int(s * n_layers)
        b = int(e * n_layers) - 1
        if i == len(parts) - 1:
            b = n_layers - 1
        if a <= b:
            shards.append((nid, a, b + 1))
    if shards and shards[-1][2] < n_layers:
        nid, a, _ = shards[-1]
        shards[-1] = (nid, a, n_layers)
    return shards


def exo_ring_shards(profiles: Iterable[DeviceProfile], n_layers: int) -> list[tuple[str, int, int]]:
    """exo's ring memory-weighted split of ``n_layers`` layers: ``(node_id, start, end)``."""
    return exo_map_partitions(exo_ring_partitions(profiles), n_layers)


def _proportional(total: int, weight: Mapping[str, float], cap: Mapping[str, int]) -> dict[str, int]:
    """Largest-remainder split of ``total`` ∝ ``weight`` with per-node caps (water-filling)."""
    alloc = dict.fromkeys(weight, 0)
    active = sorted(n for n in weight if cap[n] > 0 and weight[n] > 0)
    remaining = total
    while active:
        wsum = sum(weight[n] for n in active)
        over = [n for n in active if remaining * weight[n] / wsum >= cap[n]]
        if not over:
            break
        for n in over:
            alloc[n] = cap[n]
            remaining -= cap[n]
            active.remove(n)
    if active and remaining > 0:
        wsum = sum(weight[n] for n in active)
        quota = {n: remaining * weight[n] / wsum for n in active}
        for n in active:
            alloc[n] = math.floor(quota[n])
        left = remaining - sum(alloc[n] for n in active)
        for n in sorted(active, key=lambda n: (-(quota[n] - math.floor(quota[n])), -weight[n], n)):
            if left <= 0:
                break
            if alloc[n] < cap[n]:
                alloc[n] += 1
                left -= 1
    return alloc


def _memory_targets(ctx: PlanContext, cands: Sequence[str]) -> dict[str, float]:
    spec = ctx.spec
    pinned = sum(p.end - p.start for p in ctx.pins)
    free_layers = spec.n_layers - pinned
    weight = {n: float(ctx.usable[n]) for n in cands}
    cap = {n: int(ctx.usable[n] // ctx.per_layer(n)) for n in cands}
    while True:
        alloc = _proportional(free_layers, weight, cap)
        small = [n for n in cands if 0 < alloc[n] < ctx.min_layers]
        if not small:
            return {n: float(v) for n, v in alloc.items()}
        drop = min(small, key=lambda n: (weight[n], n))
        weight[drop] = 0.0


def memory_split(ctx: PlanContext, cands: Sequence[str]) -> list[tuple[str, int, int]] | None:
    pinned = sorted({p.node_id for p in ctx.pins})
    if not cands:
        return dp_split(ctx, [], "dev", {})
    targets = _memory_targets(ctx, cands)
    seq = [n for n in ordered_ring(ctx, list(cands) + pinned) if n not in pinned]
    if not ctx.pins:
        # The program's optimum is the targets themselves when they fit in this order (cost 0):
        # lay them out and check each shard exactly before running it.
        out, pos = [], 0
        for n in seq:
            k = int(targets.get(n, 0))
            if k > 0:
                out.append((n, pos, pos + k))
                pos += k
        if pos == ctx.spec.n_layers and all(ctx.need(n, s, e) <= ctx.usable[n] for n, s, e in out):
            return out
    return dp_split_any(ctx, seq, "dev", targets)
