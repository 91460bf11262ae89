"""Searching around the dynamic program: a local search over ring orders for small clusters (an
unused node inserted, a node dropped, replaced or moved, the ring started elsewhere; each ring
re-split by the program and kept by the caller's key), the shortlist of nodes worth the program's
time on a large cluster, and throughput's second pass (the fastest stream under the min-max bound).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from exo_tui.scheduler.context import PlanContext
from exo_tui.scheduler.dp import dp_split, layer_weight_prefix, uniform_layers

LOCAL_SEARCH_MAX_NODES = 12  # clusters this small also get the local search below
LOCAL_SEARCH_BUDGET = 80
LOCAL_SEARCH_BUDGET_SLOW = 12
LOCAL_SEARCH_ROUNDS = 4
LOCAL_SEARCH_ROTATE_MAX = 5  # rings this short are also tried from every starting node
LOCAL_SEARCH_MOVE_MAX = 8  # rings this short also try moving each node to every other place


def local_search(
    ctx: PlanContext,
    start: Sequence[tuple[str, int, int]],
    cands: Sequence[str],
    pinned: set[str],
    key: Callable[[Sequence[tuple[str, int, int]]], float],
    mode: str,
) -> list[tuple[str, int, int]]:
    """Improve a plan by changing its ring: insert an unused node at each place, drop a node,
    replace one by an unused node, move one to another place, start the ring elsewhere; the
    program re-splits the layers of each new ring exactly (every node takes layers). Keep the
    best by exact prediction; repeat while it improves."""
    best = list(start)
    best_val = key(best)
    t = ctx.t
    # orders tried, in all rounds: bounds the decision time (equal layers without pins take the
    # exact greedy split, which is cheap; otherwise each order runs the program)
    fast = mode == "sum" and not ctx.pins and uniform_layers(ctx.spec)
    budget = LOCAL_SEARCH_BUDGET if fast else LOCAL_SEARCH_BUDGET_SLOW
    for _ in range(LOCAL_SEARCH_ROUNDS):
        seq = [n for n, _, _ in best if n not in pinned]
        unused = [n for n in cands if n not in set(seq)]
        extra = list(dict.fromkeys(sorted(unused, key=lambda n: (t[n], n))[:4]
                                   + sorted(unused, key=lambda n: (-ctx.usable[n], n))[:2]))
        trials = [seq[:i] + [x] + seq[i:] for x in extra for i in range(len(seq) + 1)]
        trials += [seq[:a] + seq[a + 1 :] for a in range(len(seq))] if len(seq) > 1 or ctx.pins else []
        trials += [seq[:a] + [x] + seq[a + 1 :] for a in range(len(seq)) for x in extra]
        if len(seq) <= LOCAL_SEARCH_MOVE_MAX:
            for a in range(len(seq)):
                rest = seq[:a] + seq[a + 1 :]
                trials += [rest[:i] + [seq[a]] + rest[i:] for i in range(len(rest) + 1) if i != a]
        if len(seq) + 1 <= LOCAL_SEARCH_ROTATE_MAX:  # the ring starts at order[0]: try each start
            trials += [o[i:] + o[:i] for o in [seq, *trials] for i in range(1, len(o))]
        improved = False
        seen: set[tuple[str, ...]] = {tuple(seq)}
        for order in trials:
            if tuple(order) in seen:
                continue
            seen.add(tuple(order))
            budget -= 1
            if budget < 0:
                return best
            found = dp_split(ctx, order, mode, skip=False)
            if found is None:
                continue
            if mode == "max":
                options = throughput_candidates(ctx, found, pinned)
            else:
                options = [found]
            for sh in options:
                v = key(sh)
                if v < best_val:
                    best, best_val, improved = sh, v, True
        if not improved:
            break
    return best


SHORTLIST_MIN = 16


def latency_shortlist(ctx: PlanContext, seq: Sequence[str]) -> list[str]:
    """For one stream, the nodes worth the program's time on a large cluster: the fastest ones
    that can hold a shard, until they could hold the model 1.5 times over (at least
    :data:`SHORTLIST_MIN`), and the four roomiest; in ``seq``'s order."""
    if len(seq) <= SHORTLIST_MIN:
        return list(seq)
    keep: set[str] = set()
    room = 0.0
    for n in sorted(seq, key=lambda n: (ctx.t[n], n)):
        if room >= 1.5 * ctx.spec.n_layers and len(keep) >= SHORTLIST_MIN:
            break
        layers = ctx.usable[n] // ctx.per_layer(n)
        if layers >= ctx.min_layers:
            keep.add(n)
            room += layers
    keep.update(sorted(seq, key=lambda n: (-ctx.usable[n], n))[:4])
    return [n for n in seq if n in keep]


def throughput_candidates(
    ctx: PlanContext, bound: list[tuple[str, int, int]], pinned: set[str]
) -> list[list[tuple[str, int, int]]]:
    """The min-max plan, and the fastest single stream among plans with no slower stage."""
    order = [n for n, _, _ in bound if n not in pinned]
    best = dp_split(ctx, order, "sum", cap=_dp_stage_cap(ctx, order, bound))
    return [bound] + ([best] if best is not None else [])


def _dp_stage_cap(ctx: PlanContext, seq: Sequence[str], bound: Sequence[tuple[str, int, int]]) -> float:
    """The DP's own (approximate) slowest stage of ``bound``, to constrain the second pass."""
    spec = ctx.spec
    W = layer_weight_prefix(spec)
    L = spec.n_layers
    pinned = {p.node_id for p in ctx.pins}
    n = len(seq)
    worst = 0.0
    for nid, s, e in bound:
        compute = ctx.compute_s(nid, s, e, W)
        if nid in pinned:
            stage = compute
        else:
            i = seq.index(nid)
            stage = compute + (ctx.way_back(nid, seq[0]) if e == L else ctx.hop(nid, seq[(i + 1) % n]))
        worst = max(worst, stage)
    return worst * (1 + 1e-9) + 1e-15
