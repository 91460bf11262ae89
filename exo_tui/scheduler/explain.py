"""Why a plan is what it is, or why there is none: the pins' and memory checks with messages that
say what to do, and the reasons a plan lists (nodes left unused and what they would cost).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler.context import MEMORY_HEADROOM, InfeasiblePlan, PlanContext, gb, ms_text
from exo_tui.scheduler.plan import Pin, Predictions
from exo_tui.scheduler.profile import DeviceProfile

# ------------------------------------------------------------------------------- checks and errors


def check_pins(ctx: PlanContext, eligible: set[str], excluded: Mapping[str, str]) -> None:
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
                f"(short by {gb(need - have)}): pin fewer layers there, free memory, or serve a shorter context (--context)",
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


def _free_ranges(ctx: PlanContext) -> list[tuple[int, int]]:
    out, pos = [], 0
    for p in ctx.pins:
        if p.start > pos:
            out.append((pos, p.start))
        pos = p.end
    if pos < ctx.spec.n_layers:
        out.append((pos, ctx.spec.n_layers))
    return out


def reserve_text(config: SchedulerConfig, profiles: Sequence[DeviceProfile]) -> str:
    """What the free memory of ``profiles`` is after: the reserves, or their --memory-limit."""
    rr = config.resource_reservation
    reserves = (f"reserves ({rr.system_reserved_ram:g} GB RAM, {rr.system_reserved_vram:g} GB VRAM, "
                f"{rr.emergency_reserve * 100:g} % kept free)")
    limited = sum(p.memory_limited for p in profiles)
    if limited and limited == len(profiles):
        return "under their --memory-limit (less what their runtimes grew by, a load's peak and the least reserve)"
    if limited:
        return f"under their --memory-limit, or after {reserves} where there is none"
    return f"after {reserves}"


def explain_no_fit(ctx: PlanContext, cands: Sequence[str], config: SchedulerConfig) -> InfeasiblePlan:
    spec = ctx.spec
    free = _free_ranges(ctx)
    # at the smallest KV cache and weights any candidate keeps: if even those do not fit, nothing does
    kv_layer = min((ctx.kv[n] for n in cands), default=float(spec.kv_bytes_per_layer))
    backends: list[str | None] = [*sorted({ctx.backend[n] for n in cands})] or [None]
    need = min(sum(spec.range_bytes(a, b, kv_layer, backend) for a, b in free) for backend in backends)
    have = sum(ctx.usable[n] for n in cands)
    largest = max(cands, key=lambda n: (ctx.usable[n], n)) if cands else None
    largest_text = f"; largest free is {largest} with {gb(ctx.usable[largest])}" if largest else ""
    kv = kv_layer * spec.n_layers
    if need > have:
        what = "the model" if not ctx.pins else "the unpinned layers"
        return InfeasiblePlan(
            f"{what} needs {gb(need)} (weights plus a KV cache of {gb(kv)} for {spec.context_length} tokens) but the "
            f"eligible nodes have {gb(have)} free {reserve_text(config, [ctx.profiles[n] for n in cands])}: needs {gb(need - have)} more{largest_text}. "
            "Add a node, free memory, or serve a shorter context (--context, models.context_length).", "memory",
            need - have)
    # Enough bytes in total, but not in whole layers per node (or in the minimum shard size).
    per_layer = min(spec.mean_held_layer_bytes(backend) for backend in backends) + kv_layer
    room = sum(int(ctx.usable[n] // ctx.per_layer(n)) for n in cands)
    layers = sum(b - a for a, b in free)
    if room < layers:
        short = int((layers - room) * per_layer)
        return InfeasiblePlan(
            f"the eligible nodes can hold {room} whole layers of the {layers} to place ({gb(per_layer)} per layer with "
            f"its KV cache): needs room for {layers - room} more layers ({gb(short)}){largest_text}. Add a node, free "
            "memory, or serve a shorter context (--context).", "memory", short)
    if ctx.min_layers > 1:
        return InfeasiblePlan(
            f"no split gives every used node at least min_layers_per_shard {ctx.min_layers} layers within its memory"
            f"{largest_text}: lower min_layers_per_shard or free memory", "min_layers_per_shard")
    first = min(spec.range_bytes(0, 1, None, backend) for backend in backends) if not any(p.start == 0 for p in ctx.pins) else 0
    return InfeasiblePlan(
        f"no contiguous split fits: the first shard needs the embedding ({gb(spec.embed_bytes)}) and the last the "
        f"output head ({gb(spec.head_bytes)}) besides their layers (layer 0 alone needs {gb(first)}){largest_text}. "
        "Add a node with more memory or free memory.", "memory", max(0, first - (ctx.usable[largest] if largest else 0)))


MAX_NODE_REASONS = 6


def plan_reasons(
    ctx: PlanContext,
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
        for over in pred.nodes:
            if not over.fits:
                out.append(f"{over.node_id} is over its memory: {gb(over.memory_bytes)} on {gb(over.usable_bytes)} free")
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
            d_hop = ctx.hop(used[0], n) + ctx.way_back(n, used[0]) - ctx.way_back(used[0], used[0])
        else:
            d_hop = min(ctx.hop(used[i], n) + ctx.hop(n, used[(i + 1) % k]) - ctx.hop(used[i], used[(i + 1) % k])
                        for i in range(k))
        delta = d_compute + d_hop
        if strategy == "throughput":
            node_reasons.append(f"{n} left unused: with it the slowest stage would not get shorter")
        elif delta > 0:
            node_reasons.append(f"{n} left unused: adding it would slow one stream by {ms_text(delta)}/token")
        else:
            node_reasons.append(f"{n} left unused by the {strategy} split")
    for n, why in sorted(excluded.items()):
        node_reasons.append(f"{n} holds nothing: {why}")
    more = len(unused) + len(excluded) - MAX_NODE_REASONS
    if more > 0:
        node_reasons = node_reasons[:MAX_NODE_REASONS] + [f"... and {more} more nodes hold nothing"]
    return out + node_reasons
