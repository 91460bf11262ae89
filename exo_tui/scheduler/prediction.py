"""Predictions of a ring of shards: time to first token, tokens/s for one stream and saturated,
memory per node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler.context import TOKEN_BYTES, PlanContext, make_context
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
) -> Predictions:
    """The predictions of a ring of shards (in order) on these profiles; ``coordinator_s``: the
    coordinator's measured share of a token (:attr:`Constraints.coordinator_s`)."""
    config = config or SchedulerConfig()
    ctx = make_context(profiles, spec, config, Constraints(prompt_tokens=prompt_tokens, coordinator_s=coordinator_s))
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
        compute = ctx.t[nid] * w + (ctx.head_t[nid] if e == L else 0.0)
        if i < n - 1:
            hop = ctx.hop(nid, shards[i + 1][0])
        elif ctx.coordinator_s is not None:  # measured: the token's way back by the coordinator
            hop = ctx.coordinator_s
        elif n == 1:
            hop = 0.0
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


def predict_cached(ctx: PlanContext, shards: Sequence[tuple[str, int, int]]) -> Predictions:
    key = tuple((n, a, b) for n, a, b in shards)
    if key not in ctx.predictions:
        ctx.predictions[key] = predict_shards(ctx, shards)
    return ctx.predictions[key]
