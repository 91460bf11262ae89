"""The ``even`` split: the layers dealt evenly over nodes in the operator's order, around the pins.

``exo-tui chat --nodes A,B,C`` (and a coordinator whose strategy is ``even``) asks for it: the ring
is the order the nodes were given, each pinned range stays where it is pinned, and every range
the pins leave free is shared by the next unpinned nodes (:func:`share`), split evenly by layer
count. Nothing is measured or optimised; the plan still carries its predictions, and a draft model
(``constraints.draft``) goes beside the shards where it costs the ring least, or nowhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler.context import InfeasiblePlan, make_context
from exo_tui.scheduler.draft import place_beside, with_draft, without_draft
from exo_tui.scheduler.plan import Constraints, Pin, Plan, PlanShard
from exo_tui.scheduler.prediction import predict
from exo_tui.scheduler.profile import DeviceProfile
from exo_tui.scheduler.spec import ModelSpec


def even_plan(
    order: Sequence[str],
    backends: Mapping[str, str],
    profiles: Mapping[str, DeviceProfile],
    spec: ModelSpec,
    constraints: Constraints,
    config: SchedulerConfig,
    version: int,
) -> Plan:
    """The even plan over the nodes of ``order`` (live and undrained, in ring order), each running
    ``backends[node]``; pins on nodes not in ``order`` are left out. :class:`InfeasiblePlan` when
    there is no node, or when the pins leave more free ranges than unpinned nodes."""
    n_layers = spec.n_layers
    if not order:
        raise InfeasiblePlan("no live node to hold layers: start a node agent or undrain one", "eligibility")
    present = set(order)
    pins = sorted((p for p in constraints.pins if p.node_id in present), key=lambda p: p.start)
    pinned = {p.node_id for p in pins}
    free = [n for n in order if n not in pinned]
    gaps = unpinned_ranges(pins, n_layers, len(free))
    shards = [PlanShard(p.node_id, p.start, p.end, backends[p.node_id]) for p in pins]
    for (a, b), group in zip(gaps, share(free, [b - a for a, b in gaps]), strict=True):
        bounds = [a + round(i * (b - a) / len(group)) for i in range(len(group) + 1)]
        shards += [PlanShard(n, bounds[i], bounds[i + 1], backends[n]) for i, n in enumerate(group)]
    ordered = tuple(sorted(shards, key=lambda s: s.start))
    predictions = predict(ordered, profiles, spec, config)
    plan = Plan(spec.name, n_layers, ordered, "even", version, predictions, ("layers split evenly in node order",))
    need = constraints.draft
    if need is None:
        return plan
    ctx = make_context(profiles, spec, config, replace(constraints, draft=None))
    where = place_beside(ctx, plan, need, order)  # the layers stay as dealt: beside them, or nowhere
    if where is None:
        return without_draft(ctx, plan, need, order)
    return with_draft(ctx, plan, need, where, "the cheapest node with room beside the shards")


def unpinned_ranges(pins: Sequence[Pin], n_layers: int, free_nodes: int) -> list[tuple[int, int]]:
    """The ranges of layers ``pins`` (sorted by start) leave to the ``free_nodes`` unpinned nodes;
    :class:`InfeasiblePlan` when there are more ranges than nodes to hold them."""
    gaps, at = [], 0
    for p in [*pins, Pin("", n_layers, n_layers)]:
        if p.start > at:
            gaps.append((at, p.start))
        at = max(at, p.end)
    if len(gaps) > free_nodes:
        raise InfeasiblePlan(f"the pins leave {len(gaps)} ranges of layers unheld but only "
                             f"{free_nodes} unpinned node(s) to hold them: unpin a node or add one", "pins")
    return gaps


def share(nodes: list[Any], sizes: list[int]) -> list[list[Any]]:
    """``nodes`` (in order) dealt to ranges of ``sizes`` layers: each range gets at least one node
    and at most one per layer, the rest in proportion to the range's size (largest remainder)."""
    if not sizes:
        return []
    counts = [1] * len(sizes)
    spare = min(len(nodes), sum(sizes)) - len(sizes)
    total = sum(sizes)
    while spare > 0:
        room = [i for i in range(len(sizes)) if counts[i] < sizes[i]]
        best = max(room, key=lambda i: sizes[i] / total * (len(nodes)) - counts[i])
        counts[best] += 1
        spare -= 1
    out, at = [], 0
    for n in counts:
        out.append(nodes[at : at + n])
        at += n
    return out
