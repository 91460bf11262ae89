"""Where a draft model runs (``--draft MODEL``, issue 42), counted in the plan.

A draft model runs whole on one node (:mod:`exo_tui.cluster.drafting`). The plan counts it there
like a one-shard plan of its own: its weights as that node's backend holds them and one stream's
KV cache at the served context (:class:`~exo_tui.scheduler.plan.DraftNeed`), so no shard is
given the memory it takes, and it names the node (:class:`~exo_tui.scheduler.plan.PlanDraft`,
shown in the partition view and ``exo-tui status``).

It goes where it costs the ring least (:func:`draft_cost`): a draft token's time on the node
(its seconds per layer of the draft's spec, the draft's layers and head), counted once more for
the share of the ring's compute the node's own stage does, since with several streams its
drafts and its stage's steps take turns there (a node outside the ring drafts beside nothing).
Among the nodes with room beside the plan the least cost wins; where none has room,
:func:`exo_tui.scheduler.partition.make_plan` plans again with the draft's bytes kept out of
each eligible node in turn and keeps the best plan (its own objective first, then the draft's
cost); where no plan leaves room, the plan says so and no stream drafts from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from exo_tui.scheduler.context import PlanContext, gb, ms_text
from exo_tui.scheduler.plan import DraftNeed, Plan, PlanDraft


def draft_bytes(ctx: PlanContext, need: DraftNeed, nid: str) -> int:
    """The draft model's memory on node ``nid``: its weights as the node's backend holds them and
    one stream's KV cache at the served context, at the backend's cache precision."""
    backend = ctx.backend[nid]
    kv = ctx.profiles[nid].kv_bytes_per_layer(need.spec, backend)
    return need.spec.range_bytes(0, need.spec.n_layers, kv, backend)


def draft_token_s(ctx: PlanContext, need: DraftNeed, nid: str) -> float:
    """One draft token's seconds on node ``nid``: its layers and its head."""
    spec = need.spec
    per_layer = ctx.profiles[nid].layer_s(spec, ctx.backend[nid])
    return per_layer * (spec.n_layers + spec.head_bytes / max(spec.mean_layer_bytes, 1.0))


def draft_cost(ctx: PlanContext, plan: Plan, need: DraftNeed, nid: str) -> float:
    """What drafting on ``nid`` costs the ring a draft token: its time there, and again the share of
    the ring's compute the node's stage does (its drafts and its steps take turns)."""
    pred = plan.predictions
    node = pred.node(nid) if pred else None
    compute = sum(n.compute_s for n in pred.nodes) if pred else 0.0
    busy = node.compute_s / compute if node is not None and compute > 0 else 0.0
    return draft_token_s(ctx, need, nid) * (1.0 + busy)


def room_beside(ctx: PlanContext, plan: Plan, nid: str) -> int:
    """Memory node ``nid`` has left beside its part of ``plan`` (all it may use, outside the plan)."""
    pred = plan.predictions
    node = pred.node(nid) if pred else None
    return ctx.usable[nid] - (node.memory_bytes if node is not None else 0)


def by_cost(ctx: PlanContext, plan: Plan, need: DraftNeed, nodes: Iterable[str]) -> list[str]:
    """``nodes``, the cheapest place for the draft first (ties: the ring's order, then outside it by id)."""
    ring = {n: i for i, n in enumerate(plan.node_ids)}
    return sorted(nodes, key=lambda n: (draft_cost(ctx, plan, need, n), ring.get(n, len(ring)), n))


def place_beside(ctx: PlanContext, plan: Plan, need: DraftNeed, eligible: Iterable[str]) -> str | None:
    """The cheapest eligible node with room for the draft beside ``plan`` (None: none has)."""
    fits = [n for n in eligible if room_beside(ctx, plan, n) >= draft_bytes(ctx, need, n)]
    return by_cost(ctx, plan, need, fits)[0] if fits else None


def with_draft(ctx: PlanContext, plan: Plan, need: DraftNeed, nid: str, why: str) -> Plan:
    """``plan`` running the draft on ``nid``: named, its bytes added to the node's predicted memory
    (``ctx``: the cluster without the draft's bytes kept out), and a reason that says so."""
    nbytes = draft_bytes(ctx, need, nid)
    pred = plan.predictions
    if pred is not None and pred.node(nid) is not None:
        nodes = tuple(replace(n, memory_bytes=n.memory_bytes + nbytes, usable_bytes=ctx.usable[nid])
                      if n.node_id == nid else n for n in pred.nodes)
        pred = replace(pred, nodes=nodes)
    token_s = draft_token_s(ctx, need, nid)
    name = ctx.profiles[nid].name or nid
    reason = (f"draft model {need.model} on {name}: {gb(nbytes)} (its weights and one stream's KV at "
              f"{need.spec.context_length} tokens), {ms_text(token_s)} a draft token; {why}")
    return replace(plan, predictions=pred, reasons=(*plan.reasons, reason),
                   draft=PlanDraft(need.model, nid, nbytes, token_s))


def without_draft(ctx: PlanContext, plan: Plan, need: DraftNeed, eligible: Iterable[str]) -> Plan:
    """``plan`` saying that no node has room for the draft model, and how much it needs."""
    least = min((draft_bytes(ctx, need, n) for n in eligible), default=0)
    reason = (f"draft model {need.model} runs nowhere: it needs {gb(least)} (its weights and one stream's KV at "
              f"{need.spec.context_length} tokens) and no plan leaves a node that much; no stream drafts from it "
              "(serve at a shorter --context, add memory, or a smaller draft)")
    return replace(plan, reasons=(*plan.reasons, reason), draft=PlanDraft(need.model, "", least))
