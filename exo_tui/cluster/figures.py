"""The cluster's measured figures, as front ends see them: plain frozen data in the snapshot.

:class:`ClusterFigures` is what :mod:`exo_tui.cluster.metrics` measured over its sliding window
(``window_s``): the cluster's resource use and requests, the ring's time per token split into
compute per node, each link and the coordinator, and each node's share of it. A figure that was
not measured (no request yet, a sensor the platform lacks) is ``None``, never ``0``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LinkFigures:
    src: str  # node id, or "coordinator"
    dst: str
    ring_s: float | None = None  # mean time a token spends on this link of the ring
    rtt_s: float | None = None  # the probes' round trip (node to node links)
    loss: float | None = None  # share of recent probes that failed


@dataclass(frozen=True)
class NodeFigures:
    node_id: str
    name: str
    state: str
    up: bool = True
    cpu_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    vram_used_bytes: int | None = None
    vram_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    stage_s: float | None = None  # mean compute time of its layers per token (measured, from the frames)
    queue_s: float | None = None  # mean wait before its run started
    idle_share: float | None = None  # share of a token's time it was not computing
    token_share: float | None = None  # its compute's share of a token's time
    steps: int = 0  # decode steps measured in the window
    own_stage_s: float | None = None  # the node's own timing of its decode steps (its heartbeats)


@dataclass(frozen=True)
class ClusterFigures:
    window_s: float = 60.0
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    cpu_percent: float | None = None  # mean over live nodes
    vram_used_bytes: int | None = None
    vram_total_bytes: int | None = None
    balance: float | None = None  # std/mean of the stages' measured times
    running: int = 0
    queued: int = 0
    queue_wait_p50_s: float | None = None
    queue_wait_p95_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None
    tok_per_s: float = 0.0
    completed: int = 0  # outcomes in the window
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    success_rate: float | None = None  # completed / (completed + failed + rejected)
    draft_acceptance: float | None = None  # speculative decoding: drafted tokens kept, of the window's requests
    token_s: float | None = None  # mean time of one decode token around the ring (plan in force)
    coordinator_s: float | None = None  # of which in the coordinator, between a token and the next step
    comm_share: float | None = None  # of which on the links
    measured_tok_per_s: float | None = None  # 1 / token_s: one stream's rate on the plan in force
    predicted_tok_per_s: float | None = None  # the plan's prediction of the same
    remeasured_tok_per_s: float | None = None  # the plan in force predicted again on the measured figures
    plan_version: int | None = None
    nodes: tuple[NodeFigures, ...] = ()
    links: tuple[LinkFigures, ...] = ()
    series: dict[str, tuple[float, ...]] = field(default_factory=dict)  # tok_per_s, ttft_s, queue_depth: 1/s

    def node(self, node_id: str) -> NodeFigures | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ClusterFigures | None:
        """From the JSON form (``--attach``); keys a newer server adds are ignored."""
        if not d:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["nodes"] = tuple(_pick(NodeFigures, n) for n in d.get("nodes") or ())
        kw["links"] = tuple(_pick(LinkFigures, x) for x in d.get("links") or ())
        kw["series"] = {k: tuple(v) for k, v in (d.get("series") or {}).items()}
        return cls(**kw)


def _pick(cls: type, d: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})
