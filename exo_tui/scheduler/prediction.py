"""Predictions of a ring of shards: time to first token, tokens/s for one stream and saturated,
memory per node.

A node's CPU bounds what it can run: each token takes its compute times the CPU seconds a second of
its runs takes (``cpu_per_busy_s``, its threads). Under a CPU quota of ``q`` cores, a token can come
no faster than that CPU over ``q`` (the quota's period holds the rest back): a node on a quarter of a
core is fast for its first few milliseconds of a period and then stopped, so a short shard there
measures fast and a long one slow. When many streams fill the ring, the nodes of one host
(``host_id``) share its cores: their CPU per token over the host's cores bounds the tokens/s too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler.context import PlanContext, make_context
from exo_tui.scheduler.dp import layer_weight_prefix
from exo_tui.scheduler.plan import Constraints, NodePrediction, PlanShard, Predictions
from exo_tui.scheduler.profile import DeviceProfile
from exo_tui.scheduler.spec import ModelSpec

# ------------------------------------------------------------------------------- predictions


def predict(
    shards: Sequence[PlanShard] | Sequence[tuple[str, int, int]],
    profiles: Mapping[str, DeviceProfile],
    spec: ModelSpec,
    config: SchedulerConfig | None = None,
    prompt_tokens: int = 512,
    coordinator_s: float | None = None,
    coordinator_links: tuple[tuple[str, str, float], ...] = (),
    handed_share: float | None = None,
) -> Predictions:
    """The predictions of a ring of shards (in order) on these profiles; ``coordinator_s`` and
    ``coordinator_links``: the coordinator's measured share of a token and its links
    (:attr:`Constraints.coordinator_s`); ``handed_share``: the tokens the last stage hands to the
    first (:attr:`Constraints.handed_share`)."""
    config = config or SchedulerConfig()
    ctx = make_context(profiles, spec, config, Constraints(prompt_tokens=prompt_tokens, coordinator_s=coordinator_s,
                                                           coordinator_links=coordinator_links,
                                                           handed_share=handed_share))
    return predict_shards(ctx, [(s.node_id, s.start, s.end) if isinstance(s, PlanShard) else (s[0], s[1], s[2]) for s in shards])


def predict_shards(ctx: PlanContext, shards: Sequence[tuple[str, int, int]]) -> Predictions:
    spec = ctx.spec
    W = layer_weight_prefix(spec)
    L = spec.n_layers
    P = max(1, ctx.prompt_tokens)
    nodes = []
    decode = 0.0
    ttft = 0.0
    n = len(shards)
    for i, (nid, s, e) in enumerate(shards):
        p = ctx.profiles[nid]
        w = W[e] - W[s]
        compute = ctx.compute_s(nid, s, e, W)
        if i < n - 1:
            hop = ctx.hop(nid, shards[i + 1][0])
        else:  # the token's way back: handed on to the first stage, or by the coordinator
            hop = ctx.way_back(nid, shards[0][0])
        prefill = p.prefill_s(spec, ctx.backend[nid]) * P * w + (ctx.head_t[nid] if e == L else 0.0)
        prefill_hop = ctx.hop(nid, shards[i + 1][0], ctx.act_bytes * P) if i < n - 1 else 0.0
        decode += compute + hop
        ttft += prefill + prefill_hop
        nodes.append(NodePrediction(nid, ctx.need(nid, s, e), ctx.usable[nid], compute, hop, compute + hop))
    stages = np.array([x.stage_s for x in nodes]) if nodes else np.zeros(1)
    mean = float(stages.mean())
    coeff = float(stages.std() / mean) if mean > 0 and len(nodes) > 1 else 0.0
    quota_s, host_s = cpu_bounds(ctx, nodes, shards)
    decode = max(decode, quota_s)
    slowest = max(float(stages.max()), quota_s, host_s)
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


def cpu_bounds(ctx: PlanContext, nodes: Sequence[NodePrediction],
               shards: Sequence[tuple[str, int, int]]) -> tuple[float, float]:
    """(the least time a token takes by the nodes' CPU quotas, the least by their hosts' cores
    when the stages run at once): a node's CPU a token is its compute times its CPU a second.
    A node its quota held back on the ring measured (``quota_held_layers``) is bounded only on
    a shard of more layers than that: up to there its measured step times hold the wait."""
    quota_s = 0.0
    hosts: dict[str, tuple[float, int]] = {}
    for x, (_, s, e) in zip(nodes, shards, strict=True):
        p = ctx.profiles[x.node_id]
        cpu = x.compute_s * p.cpu_per_busy_s
        if p.cpu_quota_cores and (p.quota_held_layers is None or e - s > p.quota_held_layers):
            quota_s = max(quota_s, cpu / p.cpu_quota_cores)
        if p.host_id:
            spent, cores = hosts.get(p.host_id, (0.0, 0))
            hosts[p.host_id] = (spent + cpu, max(cores, p.cpu_cores))
    host_s = max((spent / max(cores, 1) for spent, cores in hosts.values()), default=0.0)
    return quota_s, host_s


def predict_cached(ctx: PlanContext, shards: Sequence[tuple[str, int, int]]) -> Predictions:
    key = tuple((n, a, b) for n, a, b in shards)
    if key not in ctx.predictions:
        ctx.predictions[key] = predict_shards(ctx, shards)
    return ctx.predictions[key]
