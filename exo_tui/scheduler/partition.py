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

This module holds the entry points (:func:`eligible_nodes`, :func:`make_plan`) and the rule that
keeps the serving plan; the parts are beside it: :mod:`.context` (a cluster's numbers for one
model, :class:`InfeasiblePlan`), :mod:`.prediction` (:func:`predict`), :mod:`.dp` (the dynamic
program and ring orders), :mod:`.baselines` (``exo-ring``, ``memory``), :mod:`.search` (local
search for small clusters), :mod:`.explain` (checks, errors and a plan's reasons) and
:mod:`.even` (the ``even`` split in the operator's node order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler.baselines import exo_map_partitions as exo_map_partitions  # re-exported
from exo_tui.scheduler.baselines import exo_ring_partitions as exo_ring_partitions  # re-exported
from exo_tui.scheduler.baselines import exo_ring_shards, memory_split
from exo_tui.scheduler.context import STRATEGIES, InfeasiblePlan, PlanContext, gb, make_context
from exo_tui.scheduler.dp import dp_split, dp_split_any, ordered_ring
from exo_tui.scheduler.draft import by_cost, draft_bytes, draft_cost, place_beside, with_draft, without_draft
from exo_tui.scheduler.explain import check_pins, explain_no_fit, plan_reasons, reserve_text
from exo_tui.scheduler.plan import Constraints, Plan, PlanShard
from exo_tui.scheduler.prediction import predict as predict  # re-exported
from exo_tui.scheduler.prediction import predict_cached, predict_shards
from exo_tui.scheduler.profile import DeviceProfile
from exo_tui.scheduler.score import NodeScore, score_nodes
from exo_tui.scheduler.search import (
    LOCAL_SEARCH_MAX_NODES,
    latency_shortlist,
    local_search,
    throughput_candidates,
)
from exo_tui.scheduler.spec import ModelSpec

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
    ``constraints.draft``: a draft model the plan places and counts (:mod:`.draft`).
    """
    config = config or SchedulerConfig()
    constraints = constraints or Constraints()
    need = constraints.draft
    ps = list(profiles)
    bare = replace(constraints, draft=None)
    plan = _make_plan(ps, spec, strategy, bare, config, now=now, version=version, scores=scores,
                      check_memory=check_memory, current=current)
    if need is None:
        return plan
    ctx = make_context({p.node_id: p for p in ps}, spec, config, bare)
    elig = eligible_nodes(ps, spec, config, bare, now, scores)[0]
    where = place_beside(ctx, plan, need, elig)
    if where is not None:
        return with_draft(ctx, plan, need, where, "the cheapest node with room beside the shards")
    key = _plan_key(strategy or config.partition.strategy)
    best: tuple[tuple[float, float], Plan, str] | None = None
    for nid in by_cost(ctx, plan, need, elig):  # the draft's bytes kept out of one node, each in turn
        nbytes = draft_bytes(ctx, need, nid)
        if nbytes > ctx.usable[nid]:
            continue
        kept = replace(bare, reserved=(*bare.reserved, (nid, nbytes)))
        try:
            other = _make_plan(ps, spec, strategy, kept, config, now=now, version=version, scores=scores,
                               check_memory=check_memory, current=current)
        except InfeasiblePlan:
            continue
        k = (key(other), draft_cost(ctx, other, need, nid))
        if best is None or k < best[0]:
            best = (k, other, nid)
    if best is None:
        return without_draft(ctx, plan, need, elig)
    return with_draft(ctx, best[1], need, best[2], "no node had room beside the shards: the plan leaves it this room")


def _plan_key(strategy: str) -> Callable[[Plan], float]:
    """A made plan's objective under ``strategy``: seconds a token (one stream), or a token's
    time at the slowest stage (throughput)."""
    def key(plan: Plan) -> float:
        pred = plan.predictions
        if pred is None:
            return float("inf")
        if strategy == "throughput":
            return 1.0 / pred.tok_per_s_saturated if pred.tok_per_s_saturated > 0 else float("inf")
        return pred.decode_s_per_token

    return key


def _make_plan(
    profiles: Iterable[DeviceProfile],
    spec: ModelSpec,
    strategy: str | None,
    constraints: Constraints,
    config: SchedulerConfig,
    *,
    now: float,
    version: int,
    scores: Mapping[str, NodeScore] | None,
    check_memory: bool,
    current: Plan | None,
) -> Plan:
    """:func:`make_plan` without a draft model."""
    strategy = strategy or config.partition.strategy
    if strategy not in STRATEGIES:
        raise InfeasiblePlan(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}", "strategy")
    ps = {p.node_id: p for p in profiles}
    ctx = make_context(ps, spec, config, constraints)
    elig, scores, excluded = eligible_nodes(ps.values(), spec, config, constraints, now, scores)
    if not elig:
        why = "; ".join(f"{n}: {r}" for n, r in sorted(excluded.items())) or "the cluster has no nodes"
        raise InfeasiblePlan(f"no node can take layers ({why}): add a node, undrain one, or check heartbeats", "eligibility")
    check_pins(ctx, set(elig), excluded)
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
                f"{reserve_text(config, [ctx.profiles[over.node_id]])} (over by {gb(over.memory_bytes - over.usable_bytes)}): exo splits by total "
                "memory alone; use the memory or latency strategy", "memory", over.memory_bytes - over.usable_bytes)
        return plan

    memory_shards = memory_split(ctx, cands)
    if memory_shards is None:
        raise explain_no_fit(ctx, cands, config)
    if strategy == "memory":
        return _finish(ctx, memory_shards, "memory", version, elig, excluded, config)

    candidates = [memory_shards]
    if not ctx.pins:
        exo = exo_ring_shards([ps[n] for n in elig], spec.n_layers)
        exo_pred = predict_shards(ctx, exo) if exo else None
        if exo_pred and exo_pred.fits_memory and all(e - s >= ctx.min_layers for _, s, e in exo):
            candidates.append(exo)
    seq = [n for n in ordered_ring(ctx, cands + sorted(pinned)) if n not in pinned]

    def latency_key(sh: Sequence[tuple[str, int, int]]) -> float:
        return predict_cached(ctx, sh).decode_s_per_token

    def throughput_key(sh: Sequence[tuple[str, int, int]]) -> tuple[float, float]:
        pr = predict_cached(ctx, sh)
        return (round(1.0 / pr.tok_per_s_saturated, 12), pr.decode_s_per_token)

    key: Callable[[Sequence[tuple[str, int, int]]], float | tuple[float, float]]
    key = latency_key if strategy == "latency" else throughput_key
    if strategy == "latency":
        # Over all nodes the first stage is not known, so the token's way back is left out;
        # over the nodes that pass chose, in their own ring order, it is counted.
        first = dp_split_any(ctx, latency_shortlist(ctx, seq), "sum", close=False)
        if first is not None:
            candidates.append(first)
            used = sorted({n for n, _, _ in first} - pinned)
            seq2 = [n for n in ordered_ring(ctx, used + sorted(pinned)) if n not in pinned]
            second = dp_split(ctx, seq2, "sum", skip=False) or dp_split(ctx, seq2, "sum")
            if second is not None:
                candidates.append(second)
        if not ctx.pins:  # the fastest node that holds the whole model alone: no hops at all
            alone = [n for n in cands if ctx.need(n, 0, spec.n_layers) <= ctx.usable[n]]
            if alone and spec.n_layers >= ctx.min_layers:
                candidates.append([(min(alone, key=lambda n: (ctx.t[n], n)), 0, spec.n_layers)])
        if len(cands) <= LOCAL_SEARCH_MAX_NODES:
            candidates.append(local_search(ctx, min(candidates, key=latency_key), cands, pinned, latency_key, "sum"))
    else:
        bound = dp_split_any(ctx, seq, "max")
        if bound is not None:
            candidates.extend(throughput_candidates(ctx, bound, pinned))
            used = sorted({n for n, _, _ in bound} - pinned)
            seq2 = [n for n in ordered_ring(ctx, used + sorted(pinned)) if n not in pinned]
            if seq2 != seq:
                bound2 = dp_split(ctx, seq2, "max")
                if bound2 is not None:
                    candidates.extend(throughput_candidates(ctx, bound2, pinned))

    best_shards = min(candidates, key=key)
    kept = _keepable(ctx, current, elig) if current is not None else None
    if kept is not None and _objective(key(kept)) <= _objective(key(best_shards)) * (1 + KEEP_GAIN):
        best_shards = kept
    return _finish(ctx, best_shards, strategy, version, elig, excluded, config)


# A new plan must be predicted this much faster than the serving one to replace it: as much as
# two windows of measured figures differ on a steady cluster (the same plan's prediction moved
# 5-9 % between rounds of benchmarks/emulated.py; at 2 %, near-ties flipped every re-plan), and
# what auto_rebalance asks (scheduler/calibration.py's MIN_GAIN).
KEEP_GAIN = 0.10


def _objective(key: float | tuple[float, float]) -> float:
    """The part of a strategy's sort key that :data:`KEEP_GAIN` applies to: seconds a token
    (latency) or a token's time at the slowest stage (throughput)."""
    return key[0] if isinstance(key, tuple) else key


def _keepable(ctx: PlanContext, current: Plan, elig: Sequence[str]) -> list[tuple[str, int, int]] | None:
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
    return shards if predict_cached(ctx, shards).fits_memory else None


def _finish(
    ctx: PlanContext,
    shards: Sequence[tuple[str, int, int]],
    strategy: str,
    version: int,
    elig: Sequence[str],
    excluded: Mapping[str, str],
    config: SchedulerConfig,
) -> Plan:
    pinned = {p.node_id for p in ctx.pins}
    pred = predict_cached(ctx, shards)
    plan_shards = tuple(PlanShard(n, s, e, ctx.backend[n], n in pinned) for n, s, e in shards)
    reasons = plan_reasons(ctx, shards, strategy, elig, excluded, pred)
    return Plan(ctx.spec.name, ctx.spec.n_layers, plan_shards, strategy, version, pred, tuple(reasons))
