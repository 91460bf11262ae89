"""The scheduler: pure functions from device profiles and a model to scores, plans and diffs.

No I/O, no asyncio, no clocks: callers pass ``now`` on the clock of the profiles' heartbeats.

Main entry points:

* :func:`score_nodes` — each node's score, breakdown, weights in force and eligibility reason;
* :func:`make_plan` — a :class:`Plan` for a strategy (``latency`` by default) under
  :class:`Constraints`, or :class:`InfeasiblePlan` saying which constraint fails and by how much;
* :func:`predict` — the predictions of any ring of shards;
* :func:`plan_diff`, :func:`migration_steps` — what a change moves, in steps;
* :func:`preview_change` — the new plan, its diff and tok/s before → after, for a confirmation;
* :func:`should_rebalance` — the rebalance rule.
"""

from exo_tui.scheduler.baselines import exo_ring_shards
from exo_tui.scheduler.context import STRATEGIES, InfeasiblePlan
from exo_tui.scheduler.diff import (
    ChangePreview,
    LayerMove,
    MigrationStep,
    PlanDiff,
    migration_steps,
    plan_diff,
    preview_change,
    should_rebalance,
)
from exo_tui.scheduler.partition import eligible_nodes, make_plan
from exo_tui.scheduler.plan import (
    Constraints,
    DraftNeed,
    NodePrediction,
    Pin,
    Plan,
    PlanDraft,
    PlanShard,
    Predictions,
)
from exo_tui.scheduler.prediction import predict
from exo_tui.scheduler.profile import DeviceProfile, Link
from exo_tui.scheduler.score import (
    ClusterState,
    NodeScore,
    Weights,
    Work,
    cluster_state,
    dynamic_weights,
    score_node,
    score_nodes,
    score_parts,
    work_for_model,
)
from exo_tui.scheduler.spec import ModelSpec, synthetic_spec

__all__ = [
    "STRATEGIES",
    "ChangePreview",
    "ClusterState",
    "Constraints",
    "DraftNeed",
    "DeviceProfile",
    "InfeasiblePlan",
    "LayerMove",
    "Link",
    "MigrationStep",
    "ModelSpec",
    "NodePrediction",
    "NodeScore",
    "Pin",
    "Plan",
    "PlanDraft",
    "PlanDiff",
    "PlanShard",
    "Predictions",
    "Weights",
    "Work",
    "cluster_state",
    "dynamic_weights",
    "eligible_nodes",
    "exo_ring_shards",
    "make_plan",
    "migration_steps",
    "plan_diff",
    "predict",
    "preview_change",
    "score_node",
    "score_nodes",
    "score_parts",
    "should_rebalance",
    "synthetic_spec",
    "work_for_model",
]
