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
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler.order import ring_order
from exo_tui.scheduler.plan import Constraints, NodePrediction, Pin, Plan, PlanShard, Predictions
from exo_tui.scheduler.profile import DeviceProfile
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
    pins: tuple[Pin, ...]
    min_layers: int
    prompt_tokens: int
    act_bytes: int

    def hop(self, a: str, b: str, nbytes: float | None = None) -> float:
        if a == b:
            return 0.0
        return self.profiles[a].link_to(b).hop_s(self.act_bytes if nbytes is None else nbytes)


def _make_ctx(
    profiles: Mapping[str, DeviceProfile], spec: ModelSpec, config: SchedulerConfig, constraints: Constraints
) -> _Ctx:
    rr = config.resource_reservation
    usable, t, head_t, backend = {}, {}, {}, {}
    head_layers = spec.head_bytes / spec.mean_layer_bytes
    for nid, p in profiles.items():
        usable[nid] = p.usable_bytes(rr.system_reserved_ram * 1024**3, rr.system_reserved_vram * 1024**3, rr.emergency_reserve)
        backend[nid] = p.best_backend()
        t[nid] = p.layer_s(spec, backend[nid])
        head_t[nid] = t[nid] * head_layers
    m = constraints.min_layers_per_shard or config.partition.min_layers_per_shard
    return _Ctx(spec, dict(profiles), usable, t, head_t, backend, tuple(sorted(constraints.pins, key=lambda p: p.start)),
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
        nodes.append(NodePrediction(nid, spec.range_bytes(s, e), ctx.usable[nid], compute, hop, compute + hop))
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


# ------------------------------------------------------------------------------- matrices


@lru_cache(maxsize=64)
def _prefix(spec: ModelSpec) -> np.ndarray:
    w = np.array(spec.layers, dtype=np.float64) / spec.mean_layer_bytes
    return np.concatenate([[0.0], np.cumsum(w)])


@dataclass(frozen=True)
class _Mats:
    Wd: np.ndarray  # (L+1, L+1): layer-weight of [s, e), inf where the range is not allowed
    M: np.ndarray  # memory bytes of [s, e), inf where not allowed
    N: np.ndarray  # e - s
    rows_gt0: np.ndarray  # (L+1, 1): 1.0 where s > 0


@lru_cache(maxsize=64)
def _mats(spec: ModelSpec, pins: tuple[Pin, ...], min_layers: int) -> _Mats:
    L = spec.n_layers
    W = _prefix(spec)
    s = np.arange(L + 1)[:, None]
    e = np.arange(L + 1)[None, :]
    n = (e - s).astype(np.float64)
    pinned = np.zeros(L + 1)
    for p in pins:
        pinned[p.start + 1 : p.end + 1] = 1  # layers p.start..p.end-1
    pinned_prefix = np.cumsum(np.concatenate([[0.0], pinned[1:]]))
    crosses = (pinned_prefix[None, :] - pinned_prefix[:, None]) > 0
    valid = (n >= max(1, min_layers)) & ~crosses
    B = np.concatenate([[0.0], np.cumsum(np.array(spec.layers, dtype=np.float64))])
    mem = B[None, :] - B[:, None] + spec.kv_bytes_per_layer * n
    mem[0, :] += spec.embed_bytes
    mem[:, L] += spec.head_bytes
    if spec.tied_embeddings:
        mem[0, L] -= min(spec.embed_bytes, spec.head_bytes)
    Wd = np.where(valid, W[None, :] - W[:, None], np.inf)
    M = np.where(valid, mem, np.inf)
    return _Mats(Wd, M, n, (np.arange(L + 1) > 0).astype(np.float64)[:, None])


# ------------------------------------------------------------------------------- the dynamic program


def _dp(
    ctx: _Ctx,
    seq: Sequence[str],
    mode: str,
    targets: Mapping[str, float] | None = None,
    cap: float | None = None,
) -> list[tuple[str, int, int]] | None:
    """Walk ``seq`` (unpinned nodes in ring order); pins are forced jumps between the nodes.

    ``mode``: ``sum`` (latency objective), ``max`` (slowest stage), ``dev`` (squared deviation
    from ``targets`` layers per node). ``cap``: stages longer than this are not allowed.
    Returns the shards in ring order, or None when nothing fits.
    """
    spec = ctx.spec
    L = spec.n_layers
    mats = _mats(spec, ctx.pins, ctx.min_layers)
    inf = np.inf
    cur = np.full(L + 1, inf)
    cur[0] = 0.0
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
        rows = np.flatnonzero(np.isfinite(cur))
        rows = rows[rows < L]
        if len(rows) == 0:
            steps.append(("node", nid, np.full(L + 1, -1, dtype=np.int64)))
            continue
        t = ctx.t[nid]
        wd = mats.Wd[rows]
        feasible = mats.M[rows] <= ctx.usable[nid]
        if mode == "dev":
            target = (targets or {}).get(nid, 0.0)
            cost = (mats.N[rows] - target) ** 2
            cost = np.where(feasible & np.isfinite(wd), cost + cur[rows][:, None], inf)
            skip = cur + target * target
        else:
            compute = t * wd
            compute[:, L] += ctx.head_t[nid]
            prev = seq[i - 1] if i > 0 else seq[-1]
            hop_in = ctx.hop(prev, nid) if nseq > 1 else 0.0
            nxt = seq[(i + 1) % nseq]
            stage = compute + ctx.hop(nid, nxt)
            stage[:, L] += ctx.hop(nid, seq[0], TOKEN_BYTES) - ctx.hop(nid, nxt)
            if cap is not None:
                feasible &= stage <= cap
            if mode == "max":
                cost = np.maximum(stage, cur[rows][:, None])
            else:
                cost = compute + hop_in * mats.rows_gt0[rows] + cur[rows][:, None]
                # the last of several stages also sends the token back to the start
                cost[:, L] += ctx.hop(nid, seq[0], TOKEN_BYTES) * mats.rows_gt0[rows][:, 0]
            cost = np.where(feasible, cost, inf)
            skip = cur
        best = cost.argmin(axis=0)
        val = cost[best, np.arange(L + 1)]
        take = val < skip
        src = np.where(take, rows[best], -1)
        cur = np.where(take, val, skip)
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


def _dp_any(
    ctx: _Ctx, seq: Sequence[str], mode: str, targets: Mapping[str, float] | None = None
) -> list[tuple[str, int, int]] | None:
    """:func:`_dp` on ``seq``; if nothing fits in that order, on its rotations and reversal (the
    first and last shards carry the embedding and the head, so the order can decide whether a
    split fits), then, for up to :data:`PERMUTE_MAX` nodes, on every order."""
    out = _dp(ctx, seq, mode, targets)
    if out is not None or len(seq) < 2:
        return out
    seq = list(seq)
    tried = {tuple(seq)}
    orders = [seq[i:] + seq[:i] for i in range(1, len(seq))]
    orders += [list(reversed(o)) for o in [seq, *orders]]
    if len(seq) <= PERMUTE_MAX:
        orders += [list(p) for p in itertools.permutations(seq)]
    for order in orders:
        if tuple(order) in tried:
            continue
        tried.add(tuple(order))
        out = _dp(ctx, order, mode, targets)
        if out is not None:
            return out
    return None


PERMUTE_MAX = 5


def _cost_matrix(ctx: _Ctx, ids: Sequence[str]) -> np.ndarray:
    n = len(ids)
    c = np.zeros((n, n))
    for i, a in enumerate(ids):
        pa = ctx.profiles[a]
        for j, b in enumerate(ids):
            if i != j:
                c[i, j] = pa.link_to(b).hop_s(ctx.act_bytes)
    return c


def _ordered(ctx: _Ctx, ids: Sequence[str]) -> list[str]:
    ids = sorted(ids)
    if len(ids) <= 2:
        return list(ids)
    order = [ids[i] for i in ring_order(_cost_matrix(ctx, ids))]
    # Start after the costliest hop: the closing hop carries only a token id.
    n = len(order)
    costs = [ctx.hop(order[i], order[(i + 1) % n]) for i in range(n)]
    k = int(np.argmax(costs))
    return order[k + 1 :] + order[: k + 1]


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
    per_layer = spec.mean_layer_bytes + spec.kv_bytes_per_layer
    weight = {n: float(ctx.usable[n]) for n in cands}
    cap = {n: int(ctx.usable[n] // per_layer) for n in cands}
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
        need = ctx.spec.range_bytes(p.start, p.end)
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
    need = sum(spec.range_bytes(a, b) for a, b in free)
    have = sum(ctx.usable[n] for n in cands)
    largest = max(cands, key=lambda n: (ctx.usable[n], n)) if cands else None
    largest_text = f"; largest free is {largest} with {gb(ctx.usable[largest])}" if largest else ""
    kv = spec.kv_bytes_per_layer * spec.n_layers
    if need > have:
        what = "the model" if not ctx.pins else "the unpinned layers"
        return InfeasiblePlan(
            f"{what} needs {gb(need)} (weights and a {spec.context_length}-token KV cache of {gb(kv)} in all) but the "
            f"eligible nodes have {gb(have)} free {_reserve_text(config)}: needs {gb(need - have)} more{largest_text}. "
            "Add a node, free memory, or lower the context length.", "memory", need - have)
    # Enough bytes in total, but not in whole layers per node (or in the minimum shard size).
    per_layer = spec.mean_layer_bytes + spec.kv_bytes_per_layer
    room = sum(int(ctx.usable[n] // per_layer) for n in cands)
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
) -> Plan:
    """The plan for ``spec`` on these nodes, or :class:`InfeasiblePlan` saying why none exists.

    ``now`` is the caller's clock (the same as the profiles' ``last_heartbeat``): nodes without a
    heartbeat for longer than ``heartbeat_timeout`` score 0. ``check_memory=False`` lets
    ``exo-ring`` return a plan that does not fit (for comparisons); the others always fit.
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
        shards = exo_ring_shards([ps[n] for n in elig], spec.n_layers)
        plan = _finish(ctx, shards, "exo-ring", version, elig, excluded, config)
        if ctx.pins:
            raise InfeasiblePlan("exo-ring cannot honour pins (it splits by memory alone): use latency, throughput or memory", "pins")
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
        first = _dp_any(ctx, seq, "sum")
        if first is not None:
            candidates.append(first)
            used = sorted({n for n, _, _ in first} - pinned)
            seq2 = [n for n in _ordered(ctx, used + sorted(pinned)) if n not in pinned]
            if seq2 != seq:
                second = _dp(ctx, seq2, "sum")
                if second is not None:
                    candidates.append(second)
        key = lambda sh: _predict(ctx, sh).decode_s_per_token  # noqa: E731
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
            pr = _predict(ctx, sh)
            return (round(1.0 / pr.tok_per_s_saturated, 12), pr.decode_s_per_token)

    best_shards = min(candidates, key=key)
    return _finish(ctx, best_shards, strategy, version, elig, excluded, config)


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
    pred = _predict(ctx, shards)
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
    per_layer = spec.mean_layer_bytes + spec.kv_bytes_per_layer
    for n in sorted(unused, key=lambda n: ctx.t[n]):
        if ctx.usable[n] < per_layer * ctx.min_layers:
            node_reasons.append(f"{n} left unused: its {gb(ctx.usable[n])} free cannot hold {ctx.min_layers} layer(s) "
                                f"({gb(per_layer * ctx.min_layers)})")
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
    if len(node_reasons) > MAX_NODE_REASONS:
        more = len(node_reasons) - MAX_NODE_REASONS
        node_reasons = node_reasons[:MAX_NODE_REASONS] + [f"... and {more} more nodes hold nothing"]
    return out + node_reasons
