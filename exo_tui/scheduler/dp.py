"""The dynamic program over the ring: contiguous layer ranges per node under memory limits and pins,
with the cost matrices it reads and the ring orders it runs over.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from exo_tui.scheduler.context import PlanContext
from exo_tui.scheduler.order import ring_order
from exo_tui.scheduler.plan import Pin
from exo_tui.scheduler.spec import ModelSpec

# ------------------------------------------------------------------------------- matrices


@lru_cache(maxsize=64)
def layer_weight_prefix(spec: ModelSpec) -> np.ndarray:
    """Cumulative layer weights (bytes over the mean layer's), 0 first: ``p[b] - p[a]`` weighs ``[a, b)``."""
    w = np.array(spec.layers, dtype=np.float64) / spec.mean_layer_bytes
    return np.concatenate([[0.0], np.cumsum(w)])


@dataclass(frozen=True)
class _Mats:
    """Shard ranges indexed by (end e, length n): the range is ``[e - n, e)``."""

    S: np.ndarray  # start e - n (clipped at 0), int
    Wd: np.ndarray  # layer-weight of the range, inf where the range is not allowed
    M: np.ndarray  # weight bytes of the range (embedding/head at the ends) as a backend holds them, inf
    # where not allowed; a node adds its own KV bytes per layer (N of them)
    N: np.ndarray  # n, float
    gt0: np.ndarray  # 1.0 where the range starts after layer 0
    min_layer_bytes: float
    K: np.ndarray  # the range's KV caches in full layers' caches (a windowed layer's is a fraction: ModelSpec.kv_layers)
    min_kv_share: float  # the smallest layer's KV cache, in full layers' caches


@lru_cache(maxsize=64)
def _mats(spec: ModelSpec, pins: tuple[Pin, ...], min_layers: int, backend: str | None = None) -> _Mats:
    """The ranges' matrices, their bytes as ``backend``'s shards hold them (None: the file's)."""
    L = spec.n_layers
    held = spec.held_bytes(backend)
    W = layer_weight_prefix(spec)
    e = np.arange(L + 1)[:, None]
    n = np.arange(L + 1)[None, :]
    start = e - n
    S = np.clip(start, 0, None)
    pinned = np.zeros(L + 1)
    for p in pins:
        pinned[p.start + 1 : p.end + 1] = 1  # layers p.start..p.end-1
    pp = np.cumsum(pinned)
    crosses = (pp[e] - pp[S]) > 0
    valid = (start >= 0) & (n >= max(1, min_layers)) & ~crosses
    B = np.concatenate([[0.0], np.cumsum(np.array(held.layers, dtype=np.float64))])
    kv_prefix = np.array([spec.kv_layers(0, i) for i in range(L + 1)])
    nf = np.broadcast_to(n, (L + 1, L + 1)).astype(np.float64)
    mem = B[e] - B[S]
    mem = mem + np.where(start == 0, float(held.embed), 0.0)
    mem[L, :] += held.head
    mem[L, L] = B[L] + spec.ends_bytes(True, True, backend)  # the whole model: one form of a tied matrix where shared
    return _Mats(
        S=S,
        Wd=np.where(valid, W[e] - W[S], np.inf),
        M=np.where(valid, mem, np.inf),
        N=nf,
        gt0=(start > 0).astype(np.float64),
        min_layer_bytes=float(min(held.layers)),
        K=kv_prefix[e] - kv_prefix[S],
        min_kv_share=float(np.diff(kv_prefix).min()),
    )


# ------------------------------------------------------------------------------- the dynamic program


def dp_split(
    ctx: PlanContext,
    seq: Sequence[str],
    mode: str,
    targets: Mapping[str, float] | None = None,
    cap: float | None = None,
    close: bool = True,
    skip: bool = True,
) -> list[tuple[str, int, int]] | None:
    """Walk ``seq`` (unpinned nodes in ring order); pins are forced jumps between the nodes.

    State: the cost of covering layers ``[0, e)`` so far. Each node either is skipped or takes
    ``[e - n, e)``; only lengths up to what its memory could hold are looked at. ``mode``:
    ``sum`` (latency objective), ``max`` (slowest stage), ``dev`` (squared deviation from
    ``targets`` layers per node). ``cap``: stages longer than this are not allowed. ``close``:
    count the token's way back from the last stage to ``seq[0]``. ``skip``: nodes may take
    nothing (then the hop into the next node is counted from the skipped one: an estimate);
    without skipping every node takes layers and the costs of this order are exact. Returns the
    shards in ring order, or None when nothing fits.
    """
    spec = ctx.spec
    L = spec.n_layers
    if mode == "sum" and not skip and not ctx.pins and cap is None and uniform_layers(spec) and not ctx.size:
        return _fill_fastest(ctx, seq)
    mats = _mats(spec, ctx.pins, ctx.min_layers)
    inf = np.inf
    cur = np.full(L + 1, inf)
    cur[0] = 0.0
    ends = np.arange(L + 1)
    steps: list[tuple[str, str, np.ndarray]] = []
    W = layer_weight_prefix(spec)
    pin_cost = {}
    for p in ctx.pins:
        c = ctx.compute_s(p.node_id, p.start, p.end, W)
        pin_cost[p] = 0.0 if mode == "dev" else c

    def jump(cur: np.ndarray) -> np.ndarray:
        if not ctx.pins:
            return cur
        new = cur.copy()
        src = np.full(L + 1, -1, dtype=np.int64)
        for p in ctx.pins:
            if not np.isfinite(new[p.start]):
                continue
            v = max(new[p.start], pin_cost[p]) if mode == "max" else new[p.start] + pin_cost[p]
            if v < new[p.end]:
                new[p.end] = v
                src[p.end] = p.start
        steps.append(("jump", "", src))
        return new

    cur = jump(cur)
    nseq = len(seq)
    for i, nid in enumerate(seq):
        room = ctx.usable[nid]
        held = _mats(spec, ctx.pins, ctx.min_layers, ctx.backend[nid])  # this node's bytes of each range
        smallest = held.min_layer_bytes + ctx.kv[nid] * mats.min_kv_share
        k = min(L, int(room // smallest)) if smallest > 0 else L
        if k < max(1, ctx.min_layers):
            if not skip:
                return None
            steps.append(("node", nid, np.full(L + 1, -1, dtype=np.int64)))
            if mode == "dev":
                target = (targets or {}).get(nid, 0.0)
                cur = cur + target * target
            continue
        cols = slice(0, k + 1)
        prior = cur[mats.S[:, cols]]
        feasible = held.M[:, cols] + ctx.kv[nid] * mats.K[:, cols] <= room
        if mode == "dev":
            target = (targets or {}).get(nid, 0.0)
            cost = (mats.N[:, cols] - target) ** 2 + prior
            keep = cur + target * target
        else:
            compute = ctx.t[nid] * mats.Wd[:, cols]
            if nid in ctx.size:  # its seconds per layer by the shard's count of layers
                compute = compute * ctx.size[nid][cols]
            compute[L] += ctx.head_t[nid]
            prev = seq[i - 1] if i > 0 else seq[-1]
            hop_in = ctx.hop(prev, nid) if nseq > 1 else 0.0
            nxt = seq[(i + 1) % nseq]
            close_s = ctx.way_back(nid, seq[0]) if close else 0.0
            if mode == "max" or cap is not None:
                stage = compute + ctx.hop(nid, nxt)
                stage[L] += close_s - ctx.hop(nid, nxt)
                if cap is not None:
                    feasible &= stage <= cap
            if mode == "max":
                cost = np.maximum(stage, prior)
            else:
                gt0 = mats.gt0[:, cols]
                cost = compute + hop_in * gt0 + prior
                # the last of several stages also sends the token back to the start
                cost[L] += close_s * gt0[L]
            keep = cur
        cost = np.where(feasible, cost, inf)
        best = cost.argmin(axis=1)
        val = cost[ends, best]
        if skip:
            take = val < keep
            src = np.where(take, ends - best, -1)
            cur = np.where(take, val, keep)
        else:
            src = np.where(np.isfinite(val), ends - best, -1)
            cur = val
        steps.append(("node", nid, src))
        cur = jump(cur)
    if not np.isfinite(cur[L]):
        return None
    out = []
    e = L
    for kind, nid, src in reversed(steps):
        if kind == "jump":
            while e > 0 and src[e] >= 0:
                s = int(src[e])
                pin = next(p for p in ctx.pins if p.start == s and p.end == e)
                out.append((pin.node_id, s, e))
                e = s
        elif e > 0 and src[e] >= 0:
            s = int(src[e])
            out.append((nid, s, e))
            e = s
    if e != 0:  # pragma: no cover - the program's own invariant
        raise AssertionError("partition program lost its path")
    return list(reversed(out))


@lru_cache(maxsize=64)
def uniform_layers(spec: ModelSpec) -> bool:
    """Whether every layer of ``spec`` has the same bytes."""
    return len(set(spec.layers)) == 1


def _fill_fastest(ctx: PlanContext, seq: Sequence[str]) -> list[tuple[str, int, int]] | None:
    """The latency split of equal layers over ``seq`` in this order, every node used.

    With the order fixed, the hops are fixed and each layer costs its node's seconds per layer,
    so the fastest nodes take as many layers as their memory allows (the first node's memory
    also holds the embedding, the last one's the head): exact, and much cheaper than the program.
    """
    spec = ctx.spec
    L, m = spec.n_layers, len(seq)
    if m == 0 or m * ctx.min_layers > L:
        return None
    caps = []
    for i, nid in enumerate(seq):
        per = spec.held_bytes(ctx.backend[nid]).layers[0] + ctx.kv[nid]
        extra = spec.ends_bytes(i == 0, i == m - 1, ctx.backend[nid])
        cap = min(L, int((ctx.usable[nid] - extra) // per)) if ctx.usable[nid] >= extra else -1
        if cap < ctx.min_layers:
            return None
        caps.append(cap)
    n = [ctx.min_layers] * m
    left = L - m * ctx.min_layers
    for i in sorted(range(m), key=lambda i: (ctx.t[seq[i]], i)):
        give = min(left, caps[i] - n[i])
        n[i] += give
        left -= give
    if left > 0:
        return None
    out, pos = [], 0
    for nid, k in zip(seq, n, strict=True):
        out.append((nid, pos, pos + k))
        pos += k
    return out


def dp_split_any(
    ctx: PlanContext, seq: Sequence[str], mode: str, targets: Mapping[str, float] | None = None, close: bool = True
) -> list[tuple[str, int, int]] | None:
    """:func:`dp_split` on ``seq``; if nothing fits in that order, on its rotations and reversal (the
    first and last shards carry the embedding and the head, so the order can decide whether a
    split fits): starting at the roomiest node, then (up to :data:`ROTATE_MAX` nodes) every
    rotation and reversal, then (up to :data:`PERMUTE_MAX` nodes) every order."""
    out = dp_split(ctx, seq, mode, targets, close=close)
    if out is not None or len(seq) < 2:
        return out
    seq = list(seq)
    tried = {tuple(seq)}
    # The first shard holds the embedding: start at the node with the most room, either way round.
    k = seq.index(max(seq, key=lambda n: (ctx.usable[n], n)))
    start_big = seq[k:] + seq[:k]
    orders = [start_big, [start_big[0], *reversed(start_big[1:])]]
    if len(seq) <= ROTATE_MAX:
        rotations = [seq[i:] + seq[:i] for i in range(1, len(seq))]
        orders += rotations + [list(reversed(o)) for o in [seq, *rotations]]
    if len(seq) <= PERMUTE_MAX:
        orders += [list(p) for p in itertools.permutations(seq)]
    for order in orders:
        if tuple(order) in tried:
            continue
        tried.add(tuple(order))
        out = dp_split(ctx, order, mode, targets, close=close)
        if out is not None:
            return out
    return None


PERMUTE_MAX = 5
ROTATE_MAX = 12


def _cost_matrix(ctx: PlanContext, ids: Sequence[str]) -> np.ndarray:
    index, lat, bw = ctx.links
    ix = np.array([index[n] for n in ids])
    cost: np.ndarray = lat[np.ix_(ix, ix)] + ctx.act_bytes / bw[np.ix_(ix, ix)]
    return cost


def ordered_ring(ctx: PlanContext, ids: Sequence[str]) -> list[str]:
    """``ids`` in ring order, starting after the costliest hop (the closing hop carries only a
    token id). Memoised per planning call."""
    ids = sorted(ids)
    key = tuple(ids)
    if key in ctx.orders:
        return list(ctx.orders[key])
    if len(ids) <= 2:
        return list(ids)
    cost = _cost_matrix(ctx, ids)
    idx = ring_order(cost)
    n = len(idx)
    k = int(np.argmax([cost[idx[i], idx[(i + 1) % n]] for i in range(n)]))
    order = [ids[i] for i in idx[k + 1 :] + idx[: k + 1]]
    ctx.orders[key] = tuple(order)
    return order
