"""Partition strategies: from profiles, a model and constraints to a :class:`Plan`.

Strategies (``make_plan(..., strategy=...)``):

* ``exo-ring`` — exo's ring memory-weighted split, as exo does it: nodes by memory descending
  (ties by node id, descending), each node's share of ``[0, 1)`` is its memory over the total
  rounded to 5 decimals, mapped to layers by truncation (``int(start * L)`` ..
  ``int(end * L)``), the last shard stretched to the end. It knows nothing of memory limits,
  pins or compute; the baseline.
* ``memory`` — the same idea done right: layers in proportion to the memory each node may use
  after reserves, by largest remainder, capped by what fits, at least ``min_layers_per_shard``
  per used node, laid out in the optimised ring order.
* ``latency`` (default) — minimises one stream's time per token: the sum over stages of
  layers × seconds per layer (plus the output head on the last), plus every hop (latency +
  bytes / bandwidth), under memory limits. It may leave slow nodes unused and says so.
* ``throughput`` — minimises the slowest stage (its layers + its outgoing hop), the bound on
  tokens/s when many streams share the ring; among plans with that bound, the fastest single
  stream.

How: the nodes are put in ring order (:mod:`exo_tui.scheduler.order`), then one dynamic program
over "layers covered so far" walks the ring; each node takes a contiguous range (checked
exactly against its memory, embedding and head included) or is skipped; pinned ranges are
forced jumps. Costs add (latency, memory) or take the max (throughput). The used nodes are then
re-ordered and the program run again, and the exact predictions of the candidates pick the
plan. ``latency`` and ``throughput`` also consider the ``memory`` and ``exo-ring`` plans when
those are valid, so they are never predicted worse than the baselines on their own objective.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler.order import ring_order
from exo_tui.scheduler.plan import Constraints, NodePrediction, Pin, Plan, PlanShard, Predictions
from exo_tui.scheduler.profile import UNKNOWN_LINK, DeviceProfile
from exo_tui.scheduler.score import NodeScore, score_nodes
from exo_tui.scheduler.spec import ModelSpec

STRATEGIES = ("latency", "throughput", "memory", "exo-ring")
GB = 1e9
TOKEN_BYTES = 8  # a sampled token id (and its log-probability) back to the start of the ring
MEMORY_HEADROOM = 1.3  # warn when the cluster's free memory is below this × the model


class InfeasiblePlan(Exception):
    """No plan satisfies the request. The message says which constraint fails and by how much."""

    def __init__(self, message: str, constraint: str, shortfall_bytes: int = 0) -> None:
        super().__init__(message)
        self.constraint = constraint  # memory | pins | eligibility | min_layers_per_shard | strategy
        self.shortfall_bytes = shortfall_bytes


def gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def _ms(s: float) -> str:
    return f"{s * 1000:.1f} ms"


# ------------------------------------------------------------------------------- context


@dataclass
class _Ctx:
    spec: ModelSpec
    profiles: dict[str, DeviceProfile]
    usable: dict[str, int]
    t: dict[str, float]  # decode s per mean layer
    head_t: dict[str, float]  # decode s of the output head
    backend: dict[str, str]
    kv: dict[str, float]  # bytes of one layer's KV cache on each node (its backend's cache precision)
    pins: tuple[Pin, ...]
    min_layers: int
    prompt_tokens: int
    act_bytes: int
    orders: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)
    predictions: dict[tuple[tuple[str, int, int], ...], Predictions] = field(default_factory=dict)

    def need(self, nid: str, start: int, end: int) -> int:
        """Memory node ``nid`` needs for layers ``[start, end)``: weights, its KV caches at its
        backend's precision, the embedding or head at the ends."""
        return self.spec.range_bytes(start, end, self.kv[nid])

    def per_layer(self, nid: str) -> float:
        """An average layer with its KV cache on node ``nid``."""
        return self.spec.mean_layer_bytes + self.kv[nid]

    def hop(self, a: str, b: str, nbytes: float | None = None) -> float:
        if a == b:
            return 0.0
        return self.profiles[a].link_to(b).hop_s(self.act_bytes if nbytes is None else nbytes)

    @cached_property
    def links(self) -> tuple[dict[str, int], np.ndarray, np.ndarray]:
        """(index of each node, latency matrix, bandwidth matrix) over all profiles."""
        ids = sorted(self.profiles)
        index = {n: i for i, n in enumerate(ids)}
        lat = np.full((len(ids), len(ids)), UNKNOWN_LINK.latency_s)
        bw = np.full((len(ids), len(ids)), UNKNOWN_LINK.bandwidth_bytes_per_s)
        for i, nid in enumerate(ids):
            links = self.profiles[nid].links
            known = [p for p in links if p in index]
            if known:
                cols = [index[p] for p in known]
                lat[i, cols] = [links[p].latency_s for p in known]
                bw[i, cols] = np.maximum([links[p].bandwidth_bytes_per_s for p in known], 1.0)
        np.fill_diagonal(lat, 0.0)
        np.fill_diagonal(bw, np.inf)
        return index, lat, bw


def _make_ctx(
    profiles: Mapping[str, DeviceProfile], spec: ModelSpec, config: SchedulerConfig, constraints: Constraints
) -> _Ctx:
    rr = config.resource_reservation
    usable, t, head_t, backend, kv = {}, {}, {}, {}, {}
    head_layers = spec.head_bytes / spec.mean_layer_bytes
    for nid, p in profiles.items():
        usable[nid] = p.usable_bytes(rr.system_reserved_ram * 1024**3, rr.system_reserved_vram * 1024**3, rr.emergency_reserve)
        backend[nid] = p.best_backend()
        kv[nid] = p.kv_bytes_per_layer(spec, backend[nid])
        t[nid] = p.layer_s(spec, backend[nid])
        head_t[nid] = t[nid] * head_layers
    m = constraints.min_layers_per_shard or config.partition.min_layers_per_shard
    return _Ctx(spec, dict(profiles), usable, t, head_t, backend, kv, tuple(sorted(constraints.pins, key=lambda p: p.start)),
                m, constraints.prompt_tokens, spec.activation_bytes_per_token)


# ------------------------------------------------------------------------------- predictions


def predict(
    shards: Sequence[PlanShard] | Sequence[tuple[str, int, int]],
    profiles: Mapping[str, DeviceProfile],
    spec: ModelSpec,
    config: SchedulerConfig | None = None,
    prompt_tokens: int = 512,
) -> Predictions:
    """The predictions of a ring of shards (in order) on these profiles."""
    config = config or SchedulerConfig()
    ctx = _make_ctx(profiles, spec, config, Constraints(prompt_tokens=prompt_tokens))
    return _predict(ctx, [(s.node_id, s.start, s.end) if isinstance(s, PlanShard) else tuple(s) for s in shards])


def _predict(ctx: _Ctx, shards: Sequence[tuple[str, int, int]]) -> Predictions:
    spec = ctx.spec
    W = _prefix(spec)
    L = spec.n_layers
    P = max(1, ctx.prompt_tokens)
    nodes = []
    decode = 0.0
    ttft = 0.0
    n = len(shards)
    for i, (nid, s, e) in enumerate(shards):
        p = ctx.profiles[nid]
        w = W[e] - W[s]
        compute = ctx.t[nid] * w + (ctx.head_t[nid] if e == L else 0.0)
        if n == 1:
            hop = 0.0
        elif i < n - 1:
            hop = ctx.hop(nid, shards[i + 1][0])
        else:
            hop = ctx.hop(nid, shards[0][0], TOKEN_BYTES)
        prefill = p.prefill_s(spec, ctx.backend[nid]) * P * w + (ctx.head_t[nid] if e == L else 0.0)
        prefill_hop = ctx.hop(nid, shards[i + 1][0], ctx.act_bytes * P) if i < n - 1 else 0.0
        decode += compute + hop
        ttft += prefill + prefill_hop
        nodes.append(NodePrediction(nid, ctx.need(nid, s, e), ctx.usable[nid], compute, hop, compute + hop))
    stages = np.array([x.stage_s for x in nodes]) if nodes else np.zeros(1)
    mean = float(stages.mean())
    coeff = float(stages.std() / mean) if mean > 0 and len(nodes) > 1 else 0.0
    slowest = float(stages.max())
    return Predictions(
        decode_s_per_token=decode,
        tok_per_s_single=1.0 / decode if decode > 0 else 0.0,
        tok_per_s_saturated=1.0 / slowest if slowest > 0 else 0.0,
        ttft_s=ttft,
        prompt_tokens=P,
        load_balance_coefficient=coeff,
        nodes=tuple(nodes),
        fits_memory=all(x.fits for x in nodes),
    )


def _predict_cached(ctx: _Ctx, shards: Sequence[tuple[str, int, int]]) -> Predictions:
    key = tuple(tuple(x) for x in shards)
    if key not in ctx.predictions:
        ctx.predictions[key] = _predict(ctx, shards)
    return ctx.predictions[key]


# ------------------------------------------------------------------------------- matrices


@lru_cache(maxsize=64)
def _prefix(spec: ModelSpec) -> np.ndarray:
    w = np.array(spec.layers, dtype=np.float64) / spec.mean_layer_bytes
    return np.concatenate([[0.0], np.cumsum(w)])


@dataclass(frozen=True)
class _Mats:
    """Shard ranges indexed by (end e, length n): the range is ``[e - n, e)``."""

    S: np.ndarray  # start e - n (clipped at 0), int
    Wd: np.ndarray  # layer-weight of the range, inf where the range is not allowed
    M: np.ndarray  # weight bytes of the range (embedding/head at the ends), inf where not allowed; a
    # node adds its own KV bytes per layer (N of them)
    N: np.ndarray  # n, float
    gt0: np.ndarray  # 1.0 where the range starts after layer 0
    min_layer_bytes: float


@lru_cache(maxsize=64)
def _mats(spec: ModelSpec, pins: tuple[Pin, ...], min_layers: int) -> _Mats:
    L = spec.n_layers
    W = _prefix(spec)
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
    B = np.concatenate([[0.0], np.cumsum(np.array(spec.layers, dtype=np.float64))])
    nf = np.broadcast_to(n, (L + 1, L + 1)).astype(np.float64)
    mem = B[e] - B[S]
    mem = mem + np.where(start == 0, float(spec.embed_bytes), 0.0)
    mem[L, :] += spec.head_bytes
    if spec.tied_embeddings:
        mem[L, L] -= min(spec.embed_bytes, spec.head_bytes)
    return _Mats(
        S=S,
        Wd=np.where(valid, W[e] - W[S], np.inf),
        M=np.where(valid, mem, np.inf),
        N=nf,
        gt0=(start > 0).astype(np.float64),
        min_layer_bytes=float(min(spec.layers)),
    )


# ------------------------------------------------------------------------------- the dynamic program


def _dp(
    ctx: _Ctx,
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
    if mode == "sum" and not skip and not ctx.pins and cap is None and _uniform(spec):
        return _fill_fastest(ctx, seq)
    close_hop = close
    mats = _mats(spec, ctx.pins, ctx.min_layers)
    inf = np.inf
    cur = np.full(L + 1, inf)
    cur[0] = 0.0
    ends = np.arange(L + 1)
    steps: list[tuple[str, str, np.ndarray]] = []
    W = _prefix(spec)
    pin_cost = {}
    for p in ctx.pins:
        c = ctx.t[p.node_id] * float(W[p.end] - W[p.start]) + (ctx.head_t[p.node_id] if p.end == L else 0.0)
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
        smallest = mats.min_layer_bytes + ctx.kv[nid]
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
        feasible = mats.M[:, cols] + ctx.kv[nid] * mats.N[:, cols] <= room
        if mode == "dev":
            target = (targets or {}).get(nid, 0.0)
            cost = (mats.N[:, cols] - target) ** 2 + prior
            keep = cur + target * target
        else:
            compute = ctx.t[nid] * mats.Wd[:, cols]
            compute[L] += ctx.head_t[nid]
            prev = seq[i - 1] if i > 0 else seq[-1]
            hop_in = ctx.hop(prev, nid) if nseq > 1 else 0.0
            nxt = seq[(i + 1) % nseq]
            close = ctx.hop(nid, seq[0], TOKEN_BYTES) if close_hop else 0.0
            if mode == "max" or cap is not None:
                stage = compute + ctx.hop(nid, nxt)
                stage[L] += close - ctx.hop(nid, nxt)
                if cap is not None:
                    feasible &= stage <= cap
            if mode == "max":
                cost = np.maximum(stage, prior)
            else:
                gt0 = mats.gt0[:, cols]
                cost = compute + hop_in * gt0 + prior
                # the last of several stages also sends the token back to the start
                cost[L] += close * gt0[L]
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
def _uniform(spec: ModelSpec) -> bool:
    return len(set(spec.layers)) == 1


def _fill_fastest(ctx: _Ctx, seq: Sequence[str]) -> list[tuple[str, int, int]] | None:
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
        per = spec.layers[0] + ctx.kv[nid]
        extra = (spec.embed_bytes if i == 0 else 0) + (spec.head_bytes if i == m - 1 else 0)
        if m == 1 and spec.tied_embeddings:
            extra -= min(spec.embed_bytes, spec.head_bytes)
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


def _dp_any(
    ctx: _Ctx, seq: Sequence[str], mode: str, targets: Mapping[str, float] | None = None, close: bool = True
) -> list[tuple[str, int, int]] | None:
    """:func:`_dp` on ``seq``; if nothing fits in that order, on its rotations and reversal (the
    first and last shards carry the embedding and the head, so the order can decide whether a
    split fits): starting at the roomiest node, then (up to :data:`ROTATE_MAX` nodes) every
    rotation and reversal, then (up to :data:`PERMUTE_MAX` nodes) every order."""
    out = _dp(ctx, seq, mode, targets, close=close)
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
        out = _dp(ctx, order, mode, targets, close=close)
        if out is not None:
            return out
    return None


PERMUTE_MAX = 5
ROTATE_MAX = 12


def _cost_matrix(ctx: _Ctx, ids: Sequence[str]) -> np.ndarray:
    index, lat, bw = ctx.links
    ix = np.array([index[n] for n in ids])
    return lat[np.ix_(ix, ix)] + ctx.act_bytes / bw[np.ix_(ix, ix)]


def _ordered(ctx: _Ctx, ids: Sequence[str]) -> list[str]:
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


def _memory_targets(ctx: _Ctx, cands: Sequence[str]) -> dict[str, float]:
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


# ------------------------------------------------------------------------------- checks and errors


def _check_pins(ctx: _Ctx, eligible: set[str], excluded: Mapping[str, str]) -> None:
    L = ctx.spec.n_layers
    seen: dict[str, Pin] = {}
    for p in ctx.pins:
        if p.node_id not in ctx.profiles:
            known = ", ".join(sorted(ctx.profiles)) or "none"
            raise InfeasiblePlan(f"pin {p.node_id}:{p.start}-{p.end} names a node that is not in the cluster (known: {known})", "pins")
        if not 0 <= p.start < p.end <= L:
            raise InfeasiblePlan(f"pin {p.node_id}:{p.start}-{p.end} is outside the model's layers 0-{L} (END is exclusive)", "pins")
        if p.node_id in seen:
            raise InfeasiblePlan(f"node {p.node_id} is pinned twice ({seen[p.node_id].start}-{seen[p.node_id].end} and {p.start}-{p.end}): a node holds one range", "pins")
        seen[p.node_id] = p
        if p.node_id not in eligible:
            why = excluded.get(p.node_id, "not eligible")
            raise InfeasiblePlan(f"pinned node {p.node_id} cannot hold layers: it is {why}; unpin it or bring it back", "pins")
        if p.end - p.start < ctx.min_layers:
            raise InfeasiblePlan(
                f"pin {p.node_id}:{p.start}-{p.end} holds {p.end - p.start} layers, fewer than "
                f"min_layers_per_shard {ctx.min_layers}: widen the pin or lower the minimum", "min_layers_per_shard")
        need = ctx.need(p.node_id, p.start, p.end)
        have = ctx.usable[p.node_id]
        if need > have:
            raise InfeasiblePlan(
                f"node {p.node_id} has {gb(have)} free, needs {gb(need)} for pinned layers {p.start}-{p.end - 1} "
                f"(short by {gb(need - have)}): pin fewer layers there, free memory, or lower the context length",
                "memory", need - have)
    pos = 0
    for a, b in [(p.start, p.end) for p in ctx.pins]:
        if a < pos:
            raise InfeasiblePlan(f"pins overlap at layer {a}: each layer can be pinned to one node", "pins")
        if 0 < a - pos < ctx.min_layers:
            raise InfeasiblePlan(
                f"layers {pos}-{a - 1} between pins are {a - pos} layers, fewer than min_layers_per_shard "
                f"{ctx.min_layers}: move the pins or lower the minimum", "min_layers_per_shard")
        pos = b
    if 0 < L - pos < ctx.min_layers:
        raise InfeasiblePlan(
            f"layers {pos}-{L - 1} after the last pin are {L - pos} layers, fewer than min_layers_per_shard "
            f"{ctx.min_layers}: move the pins or lower the minimum", "min_layers_per_shard")


def _free_ranges(ctx: _Ctx) -> list[tuple[int, int]]:
    out, pos = [], 0
    for p in ctx.pins:
        if p.start > pos:
            out.append((pos, p.start))
        pos = p.end
    if pos < ctx.spec.n_layers:
        out.append((pos, ctx.spec.n_layers))
    return out


def _reserve_text(config: SchedulerConfig) -> str:
    rr = config.resource_reservation
    return (f"after reserves ({rr.system_reserved_ram:g} GB RAM, {rr.system_reserved_vram:g} GB VRAM, "
            f"{rr.emergency_reserve * 100:g} % kept free)")


def _explain_no_fit(ctx: _Ctx, cands: Sequence[str], config: SchedulerConfig) -> InfeasiblePlan:
    spec = ctx.spec
    free = _free_ranges(ctx)
    # at the smallest KV cache any candidate keeps: if even that does not fit, nothing does
    kv_layer = min((ctx.kv[n] for n in cands), default=float(spec.kv_bytes_per_layer))
    need = sum(spec.range_bytes(a, b, kv_layer) for a, b in free)
    have = sum(ctx.usable[n] for n in cands)
    largest = max(cands, key=lambda n: (ctx.usable[n], n)) if cands else None
    largest_text = f"; largest free is {largest} with {gb(ctx.usable[largest])}" if largest else ""
    kv = kv_layer * spec.n_layers
    if need > have:
        what = "the model" if not ctx.pins else "the unpinned layers"
        return InfeasiblePlan(
            f"{what} needs {gb(need)} (weights plus a KV cache of {gb(kv)} for {spec.context_length} tokens) but the "
            f"eligible nodes have {gb(have)} free {_reserve_text(config)}: needs {gb(need - have)} more{largest_text}. "
            "Add a node, free memory, or lower the context length.", "memory", need - have)
    # Enough bytes in total, but not in whole layers per node (or in the minimum shard size).
    per_layer = spec.mean_layer_bytes + kv_layer
    room = sum(int(ctx.usable[n] // ctx.per_layer(n)) for n in cands)
    layers = sum(b - a for a, b in free)
    if room < layers:
        short = int((layers - room) * per_layer)
        return InfeasiblePlan(
            f"the eligible nodes can hold {room} whole layers of the {layers} to place ({gb(per_layer)} per layer with "
            f"its KV cache): needs room for {layers - room} more layers ({gb(short)}){largest_text}. Add a node, free "
            "memory, or lower the context length.", "memory", short)
    if ctx.min_layers > 1:
        return InfeasiblePlan(
            f"no split gives every used node at least min_layers_per_shard {ctx.min_layers} layers within its memory"
            f"{largest_text}: lower min_layers_per_shard or free memory", "min_layers_per_shard")
    first = spec.range_bytes(0, 1) if not any(p.start == 0 for p in ctx.pins) else 0
    return InfeasiblePlan(
        f"no contiguous split fits: the first shard needs the embedding ({gb(spec.embed_bytes)}) and the last the "
        f"output head ({gb(spec.head_bytes)}) besides their layers (layer 0 alone needs {gb(first)}){largest_text}. "
        "Add a node with more memory or free memory.", "memory", max(0, first - (ctx.usable[largest] if largest else 0)))


# ------------------------------------------------------------------------------- entry points


def eligible_nodes(
    profiles: Iterable[DeviceProfile],
    spec: ModelSpec,
    config: SchedulerConfig | None = None,
    constraints: Constraints | None = None,
    now: float = 0.0,
    scores: Mapping[str, NodeScore] | None = None,
) -> tuple[list[str], dict[str, NodeScore], dict[str, str]]:
    """(eligible ids, scores, reason per excluded node) after drains, failures and scores."""
    config = config or SchedulerConfig()
    constraints = constraints or Constraints()
    ps = list(profiles)
    scores = dict(scores) if scores is not None else score_nodes(ps, spec, config, now)
    excluded: dict[str, str] = {}
    ok: list[str] = []
    for p in ps:
        if p.node_id in constraints.failed or p.failed:
            excluded[p.node_id] = "failed"
        elif p.node_id in constraints.drained or p.drained:
            excluded[p.node_id] = "drained"
        elif not scores[p.node_id].eligible:
            excluded[p.node_id] = scores[p.node_id].reason
        else:
            ok.append(p.node_id)
    return ok, scores, excluded


def make_plan(
    profiles: Iterable[DeviceProfile],
    spec: ModelSpec,
    strategy: str | None = None,
    constraints: Constraints | None = None,
    config: SchedulerConfig | None = None,
    *,
    now: float,
    version: int = 1,
    scores: Mapping[str, NodeScore] | None = None,
    check_memory: bool = True,
    current: Plan | None = None,
) -> Plan:
    """The plan for ``spec`` on these nodes, or :class:`InfeasiblePlan` saying why none exists.

    ``now`` is the caller's clock (the same as the profiles' ``last_heartbeat``): nodes without a
    heartbeat for longer than ``heartbeat_timeout`` score 0. ``check_memory=False`` lets
    ``exo-ring`` return a plan that does not fit (for comparisons); the others always fit.
    ``current``: the plan serving now. The latency and throughput strategies keep them while
    they still honour every constraint and no plan is predicted more than ``KEEP_GAIN`` better:
    a switch moves weights and caches, which two equal nodes trading places would pay for nothing.
    """
    config = config or SchedulerConfig()
    constraints = constraints or Constraints()
    strategy = strategy or config.partition.strategy
    if strategy not in STRATEGIES:
        raise InfeasiblePlan(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}", "strategy")
    ps = {p.node_id: p for p in profiles}
    ctx = _make_ctx(ps, spec, config, constraints)
    elig, scores, excluded = eligible_nodes(ps.values(), spec, config, constraints, now, scores)
    if not elig:
        why = "; ".join(f"{n}: {r}" for n, r in sorted(excluded.items())) or "the cluster has no nodes"
        raise InfeasiblePlan(f"no node can take layers ({why}): add a node, undrain one, or check heartbeats", "eligibility")
    _check_pins(ctx, set(elig), excluded)
    pinned = {p.node_id for p in ctx.pins}
    cands = [n for n in elig if n not in pinned]

    if strategy == "exo-ring":
        if ctx.pins:
            raise InfeasiblePlan("exo-ring cannot honour pins (it splits by memory alone): use latency, throughput or memory", "pins")
        shards = exo_ring_shards([ps[n] for n in elig], spec.n_layers)
        if not shards:
            raise InfeasiblePlan("exo-ring: the eligible nodes report no memory at all: check their profiles", "memory",
                                 spec.total_bytes)
        plan = _finish(ctx, shards, "exo-ring", version, elig, excluded, config)
        small = [s for s in plan.shards if s.n_layers < ctx.min_layers]
        if small:
            raise InfeasiblePlan(
                f"exo-ring gives {small[0].node_id} {small[0].n_layers} layers, fewer than min_layers_per_shard "
                f"{ctx.min_layers}: use the memory or latency strategy", "min_layers_per_shard")
        if check_memory and plan.predictions and not plan.predictions.fits_memory:
            over = max(plan.predictions.nodes, key=lambda n: n.memory_bytes - n.usable_bytes)
            raise InfeasiblePlan(
                f"exo-ring puts {gb(over.memory_bytes)} on {over.node_id}, which has {gb(over.usable_bytes)} free "
                f"{_reserve_text(config)} (over by {gb(over.memory_bytes - over.usable_bytes)}): exo splits by total "
                "memory alone; use the memory or latency strategy", "memory", over.memory_bytes - over.usable_bytes)
        return plan

    memory_shards = _memory_shards(ctx, cands)
    if memory_shards is None:
        raise _explain_no_fit(ctx, cands, config)
    if strategy == "memory":
        return _finish(ctx, memory_shards, "memory", version, elig, excluded, config)

    candidates = [memory_shards]
    if not ctx.pins:
        exo = exo_ring_shards([ps[n] for n in elig], spec.n_layers)
        exo_pred = _predict(ctx, exo) if exo else None
        if exo_pred and exo_pred.fits_memory and all(e - s >= ctx.min_layers for _, s, e in exo):
            candidates.append(exo)
    seq = [n for n in _ordered(ctx, cands + sorted(pinned)) if n not in pinned]
    if strategy == "latency":
        # Over all nodes the first stage is not known, so the token's way back is left out;
        # over the nodes that pass chose, in their own ring order, it is counted.
        first = _dp_any(ctx, _latency_shortlist(ctx, seq), "sum", close=False)
        if first is not None:
            candidates.append(first)
            used = sorted({n for n, _, _ in first} - pinned)
            seq2 = [n for n in _ordered(ctx, used + sorted(pinned)) if n not in pinned]
            second = _dp(ctx, seq2, "sum", skip=False) or _dp(ctx, seq2, "sum")
            if second is not None:
                candidates.append(second)
        if not ctx.pins:  # the fastest node that holds the whole model alone: no hops at all
            alone = [n for n in cands if ctx.need(n, 0, spec.n_layers) <= ctx.usable[n]]
            if alone and spec.n_layers >= ctx.min_layers:
                candidates.append([(min(alone, key=lambda n: (ctx.t[n], n)), 0, spec.n_layers)])
        key = lambda sh: _predict_cached(ctx, sh).decode_s_per_token  # noqa: E731
        if len(cands) <= LOCAL_SEARCH_MAX_NODES:
            candidates.append(_local_search(ctx, min(candidates, key=key), cands, pinned, key, "sum"))
    else:
        bound = _dp_any(ctx, seq, "max")
        if bound is not None:
            candidates.extend(_throughput_candidates(ctx, bound, pinned))
            used = sorted({n for n, _, _ in bound} - pinned)
            seq2 = [n for n in _ordered(ctx, used + sorted(pinned)) if n not in pinned]
            if seq2 != seq:
                bound2 = _dp(ctx, seq2, "max")
                if bound2 is not None:
                    candidates.extend(_throughput_candidates(ctx, bound2, pinned))

        def key(sh: Sequence[tuple[str, int, int]]) -> tuple[float, float]:
            pr = _predict_cached(ctx, sh)
            return (round(1.0 / pr.tok_per_s_saturated, 12), pr.decode_s_per_token)

    best_shards = min(candidates, key=key)
    kept = _keepable(ctx, current, elig) if current is not None else None
    if kept is not None and _objective(key(kept)) <= _objective(key(best_shards)) * (1 + KEEP_GAIN):
        best_shards = kept
    return _finish(ctx, best_shards, strategy, version, elig, excluded, config)


KEEP_GAIN = 0.02  # a new plan must be predicted this much faster than the serving one to replace it


def _objective(key: float | tuple[float, float]) -> float:
    """The part of a strategy's sort key that :data:`KEEP_GAIN` applies to: seconds a token
    (latency) or a token's time at the slowest stage (throughput)."""
    return key[0] if isinstance(key, tuple) else key


def _keepable(ctx: _Ctx, current: Plan, elig: Sequence[str]) -> list[tuple[str, int, int]] | None:
    """The serving plan's shards, if a plan could still be made of them: the same model (a
    :class:`Plan` covers its layers in order), every node eligible and in it once, every pin where
    it asks, each unpinned shard at least ``min_layers`` and everything within memory. Else None."""
    if current.n_layers != ctx.spec.n_layers:
        return None
    shards = [(s.node_id, s.start, s.end) for s in current.shards]
    pinned = {(p.node_id, p.start, p.end) for p in ctx.pins}
    ok = set(elig)
    if not pinned <= set(shards) or not set(current.node_ids) <= ok or len(set(current.node_ids)) != len(shards):
        return None
    if any(e - s < ctx.min_layers and (n, s, e) not in pinned for n, s, e in shards):
        return None
    return shards if _predict_cached(ctx, shards).fits_memory else None


LOCAL_SEARCH_MAX_NODES = 12  # clusters this small also get the local search below
LOCAL_SEARCH_BUDGET = 80
LOCAL_SEARCH_BUDGET_SLOW = 12
LOCAL_SEARCH_ROUNDS = 4
LOCAL_SEARCH_ROTATE_MAX = 5  # rings this short are also tried from every starting node
LOCAL_SEARCH_MOVE_MAX = 8  # rings this short also try moving each node to every other place


def _local_search(
    ctx: _Ctx,
    start: Sequence[tuple[str, int, int]],
    cands: Sequence[str],
    pinned: set[str],
    key: Any,
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
    fast = mode == "sum" and not ctx.pins and _uniform(ctx.spec)
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
            found = _dp(ctx, order, mode, skip=False)
            if found is None:
                continue
            if mode == "max":
                options = _throughput_candidates(ctx, found, pinned)
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


def _latency_shortlist(ctx: _Ctx, seq: Sequence[str]) -> list[str]:
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


def _throughput_candidates(
    ctx: _Ctx, bound: list[tuple[str, int, int]], pinned: set[str]
) -> list[list[tuple[str, int, int]]]:
    """The min-max plan, and the fastest single stream among plans with no slower stage."""
    order = [n for n, _, _ in bound if n not in pinned]
    best = _dp(ctx, order, "sum", cap=_dp_stage_cap(ctx, order, bound))
    return [bound] + ([best] if best is not None else [])


def _dp_stage_cap(ctx: _Ctx, seq: Sequence[str], bound: Sequence[tuple[str, int, int]]) -> float:
    """The DP's own (approximate) slowest stage of ``bound``, to constrain the second pass."""
    spec = ctx.spec
    W = _prefix(spec)
    L = spec.n_layers
    pinned = {p.node_id for p in ctx.pins}
    n = len(seq)
    worst = 0.0
    for nid, s, e in bound:
        compute = ctx.t[nid] * (W[e] - W[s]) + (ctx.head_t[nid] if e == L else 0.0)
        if nid in pinned:
            stage = compute
        else:
            i = seq.index(nid)
            stage = compute + (ctx.hop(nid, seq[0], TOKEN_BYTES) if e == L else ctx.hop(nid, seq[(i + 1) % n]))
        worst = max(worst, stage)
    return worst * (1 + 1e-9) + 1e-15


def _memory_shards(ctx: _Ctx, cands: Sequence[str]) -> list[tuple[str, int, int]] | None:
    pinned = sorted({p.node_id for p in ctx.pins})
    if not cands:
        return _dp(ctx, [], "dev", {})
    targets = _memory_targets(ctx, cands)
    seq = [n for n in _ordered(ctx, list(cands) + pinned) if n not in pinned]
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
    return _dp_any(ctx, seq, "dev", targets)


def _finish(
    ctx: _Ctx,
    shards: Sequence[tuple[str, int, int]],
    strategy: str,
    version: int,
    elig: Sequence[str],
    excluded: Mapping[str, str],
    config: SchedulerConfig,
) -> Plan:
    pinned = {p.node_id for p in ctx.pins}
    pred = _predict_cached(ctx, shards)
    plan_shards = tuple(PlanShard(n, s, e, ctx.backend[n], n in pinned) for n, s, e in shards)
    reasons = _reasons(ctx, shards, strategy, elig, excluded, pred)
    return Plan(ctx.spec.name, ctx.spec.n_layers, plan_shards, strategy, version, pred, tuple(reasons))


MAX_NODE_REASONS = 6


def _reasons(
    ctx: _Ctx,
    shards: Sequence[tuple[str, int, int]],
    strategy: str,
    elig: Sequence[str],
    excluded: Mapping[str, str],
    pred: Predictions,
) -> list[str]:
    spec = ctx.spec
    used = [n for n, _, _ in shards]
    out = [{
        "latency": "latency: fewest seconds per token for one stream",
        "throughput": "throughput: the slowest stage as short as possible, for many streams at once",
        "memory": "memory: layers in proportion to each node's free memory",
        "exo-ring": "exo-ring: exo's split by total memory (baseline; knows no compute or limits)",
    }[strategy] + f"; {len(used)} of {len(elig)} eligible nodes used"]
    free = sum(ctx.usable[n] for n in elig)
    if free < MEMORY_HEADROOM * spec.total_bytes:
        out.append(f"warning: the eligible nodes have {gb(free)} free, less than {MEMORY_HEADROOM} x the model's "
                   f"{gb(spec.total_bytes)}: little room for other work")
    if not pred.fits_memory:
        for n in pred.nodes:
            if not n.fits:
                out.append(f"{n.node_id} is over its memory: {gb(n.memory_bytes)} on {gb(n.usable_bytes)} free")
    node_reasons = []
    unused = [n for n in elig if n not in used]
    slowest_used = max(used, key=lambda n: ctx.t[n])
    unused = sorted(unused, key=lambda n: (ctx.t[n], n))
    for n in unused[:MAX_NODE_REASONS]:
        if ctx.usable[n] < ctx.per_layer(n) * ctx.min_layers:
            node_reasons.append(f"{n} left unused: its {gb(ctx.usable[n])} free cannot hold {ctx.min_layers} layer(s) "
                                f"({gb(ctx.per_layer(n) * ctx.min_layers)})")
            continue
        m = ctx.min_layers
        d_compute = m * (ctx.t[n] - ctx.t[slowest_used])
        k = len(used)
        if k == 1:
            d_hop = ctx.hop(used[0], n) + ctx.hop(n, used[0], TOKEN_BYTES)
        else:
            d_hop = min(ctx.hop(used[i], n) + ctx.hop(n, used[(i + 1) % k]) - ctx.hop(used[i], used[(i + 1) % k])
                        for i in range(k))
        delta = d_compute + d_hop
        if strategy == "throughput":
            node_reasons.append(f"{n} left unused: with it the slowest stage would not get shorter")
        elif delta > 0:
            node_reasons.append(f"{n} left unused: adding it would slow one stream by {_ms(delta)}/token")
        else:
            node_reasons.append(f"{n} left unused by the {strategy} split")
    for n, why in sorted(excluded.items()):
        node_reasons.append(f"{n} holds nothing: {why}")
    more = len(unused) + len(excluded) - MAX_NODE_REASONS
    if more > 0:
        node_reasons = node_reasons[:MAX_NODE_REASONS] + [f"... and {more} more nodes hold nothing"]
    return out + node_reasons
