"""Device scores and dynamic weights, exactly as ``SCHEDULER.md`` gives them.

The score of node ``d`` for work ``w`` is the sum of parts (raw points from the spec's rules):

========================  ======================================================  ===========
part                      rule                                                   group
========================  ======================================================  ===========
``vram_fit``              ``40 * min(1, 2 / (vram_avail / vram_needed))`` if it   resource
                          fits, else 0 (RAM is the VRAM on unified memory and on
                          CPU devices)
``cpu``                   20 if free cores ``>= cpu_cores_needed``                resource
``ram``                   15 if ``ram_avail >= ram_needed``                       resource
``device_type``           10 if ``w.preferred_device_type == d.device_type``      performance
``performance``           ``25 * min(1, benchmark_score / min_performance)``      performance
``load_balance``          ``30 * (1 - load_factor)``                              load_balance
``network``               ``20 * (1 - min(1, avg_latency_ms / 100))`` for         network
                          communication-heavy work, else 0
========================  ======================================================  ===========

How the four weight groups combine with the parts: every part belongs to one group, and a group's
points are multiplied by ``weight_in_force / reference_weight``, where the reference weights are
the spec's defaults 40 / 35 / 15 / 10. At the default weights every multiplier is 1 and the score
is exactly the spec's sum of parts (0 to 160; 150 without a preferred device type). When the
weights shift (say resource 40 → 50 under memory pressure) the resource parts count 1.25 times as
much. Then the penalties: power state not ``active`` halves the score; a heartbeat older than the
timeout makes it 0. A node is eligible when it is not drained or failed and its score is at least
``min_score_threshold``; otherwise :attr:`NodeScore.reason` says why.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler.profile import DeviceProfile
from exo_tui.scheduler.spec import ModelSpec

GROUPS = ("resource", "performance", "load_balance", "network")
REFERENCE_WEIGHTS = {"resource": 40.0, "performance": 35.0, "load_balance": 15.0, "network": 10.0}
PART_GROUP = {
    "vram_fit": "resource",
    "cpu": "resource",
    "ram": "resource",
    "device_type": "performance",
    "performance": "performance",
    "load_balance": "load_balance",
    "network": "network",
}
PART_MAX = {"vram_fit": 40, "cpu": 20, "ram": 15, "device_type": 10, "performance": 25, "load_balance": 30, "network": 20}

# Cluster-state thresholds and the shifts they cause (SCHEDULER.md, "Dynamic weights").
RESOURCE_PRESSURE = 0.8
LOAD_IMBALANCE = 0.7
NETWORK_CONGESTION = 0.6


@dataclass(frozen=True)
class Work:
    """The work to place: what one shard needs."""

    vram_needed: float = 0.0
    ram_needed: float = 0.0
    cpu_cores_needed: float = 1.0
    min_performance: float = 0.0
    preferred_device_type: str | None = None
    communication_heavy: bool = True
    related_nodes: tuple[str, ...] = ()

    @cached_property
    def related_set(self) -> frozenset[str]:
        return frozenset(self.related_nodes)


def work_for_model(
    spec: ModelSpec, profiles: Iterable[DeviceProfile], cpu_cores_needed: float = 1.0
) -> Work:
    """The default work for scoring nodes against a model: an even share of it on each node.

    Memory needed is the model (with its KV cache) split evenly over the nodes that are not
    drained or failed; the minimum performance is the median benchmark score of those nodes (a
    node as fast as the median gets full performance points); pipeline stages talk to the other
    nodes on every token, so the work is communication-heavy and related to all of them.
    """
    live = [p for p in profiles if not p.drained and not p.failed]
    n = max(1, len(live))
    share = spec.total_bytes / n
    scores = sorted(p.benchmark_score for p in live)
    median = scores[len(scores) // 2] if scores else 0.0
    return Work(
        vram_needed=share,
        ram_needed=share,
        cpu_cores_needed=cpu_cores_needed,
        min_performance=median,
        preferred_device_type=None,
        communication_heavy=True,
        related_nodes=tuple(p.node_id for p in live),
    )


@dataclass(frozen=True)
class ClusterState:
    """The cluster's state for the weight shifts, each 0..1."""

    resource_utilization: float = 0.0
    load_imbalance: float = 0.0
    network_congestion: float = 0.0


def cluster_state(profiles: Iterable[DeviceProfile], network_congestion: float | None = None) -> ClusterState:
    """Measure the cluster state from profiles.

    * resource utilisation: the larger of memory in use (over all nodes' compute memory) and the
      mean CPU utilisation;
    * load imbalance: the spread of load factors, ``max - min``;
    * network congestion: unless the caller measured it (loss, queueing), the mean over known
      links of ``min(1, latency_ms / 100)``, the network part's own scale.
    """
    ps = [p for p in profiles if not p.drained and not p.failed]
    if not ps:
        return ClusterState()
    total = sum(p.compute_memory_total for p in ps)
    avail = sum(min(p.compute_memory_available, p.compute_memory_total) for p in ps)
    mem_util = 1.0 - avail / total if total > 0 else 0.0
    cpu_util = sum(p.cpu_utilization for p in ps) / len(ps)
    loads = [p.load_factor for p in ps]
    if network_congestion is None:
        lat = np.fromiter((link.latency_s for p in ps for link in p.links.values()), dtype=np.float64)
        network_congestion = float(np.minimum(1.0, lat * 10.0).mean()) if lat.size else 0.0  # latency_ms / 100
    return ClusterState(
        resource_utilization=max(0.0, min(1.0, max(mem_util, cpu_util))),
        load_imbalance=max(0.0, min(1.0, max(loads) - min(loads))),
        network_congestion=max(0.0, min(1.0, network_congestion)),
    )


@dataclass(frozen=True)
class Weights:
    resource: float
    performance: float
    load_balance: float
    network: float
    shifts: tuple[str, ...] = ()  # why they moved from the configured values

    def as_dict(self) -> dict[str, float]:
        return {g: getattr(self, g) for g in GROUPS}

    def multiplier(self, group: str) -> float:
        return float(getattr(self, group)) / REFERENCE_WEIGHTS[group]


def dynamic_weights(config: SchedulerConfig, state: ClusterState) -> Weights:
    """The configured weights shifted by the cluster state (never below 0)."""
    s = config.scoring
    w = {
        "resource": s.resource_weight,
        "performance": s.performance_weight,
        "load_balance": s.load_balance_weight,
        "network": s.network_weight,
    }
    shifts = []
    if state.resource_utilization > RESOURCE_PRESSURE:
        w["resource"] += 10
        w["performance"] -= 5
        shifts.append(f"resource utilisation {state.resource_utilization:.2f} > {RESOURCE_PRESSURE}: resource +10, performance -5")
    if state.load_imbalance > LOAD_IMBALANCE:
        w["load_balance"] += 10
        w["resource"] -= 5
        shifts.append(f"load imbalance {state.load_imbalance:.2f} > {LOAD_IMBALANCE}: load balance +10, resource -5")
    if state.network_congestion > NETWORK_CONGESTION:
        w["network"] += 15
        w["performance"] -= 5
        shifts.append(f"network congestion {state.network_congestion:.2f} > {NETWORK_CONGESTION}: network +15, performance -5")
    return Weights(**{k: max(0.0, v) for k, v in w.items()}, shifts=tuple(shifts))


@dataclass(frozen=True)
class NodeScore:
    """A node's score with everything the console shows about it."""

    node_id: str
    score: float
    eligible: bool
    reason: str  # why not eligible ("" when eligible)
    parts: dict[str, float] = field(default_factory=dict)  # raw points per part (spec rules)
    weighted_parts: dict[str, float] = field(default_factory=dict)  # after the group multipliers
    weights: dict[str, float] = field(default_factory=dict)  # group -> weight in force
    penalty: str = ""  # "power state sleep: x0.5" / "no heartbeat for 4.1 s: 0"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def score_parts(d: DeviceProfile, w: Work) -> dict[str, float]:
    """The raw points of each part for node ``d`` and work ``w``."""
    parts = dict.fromkeys(PART_MAX, 0.0)
    vram = d.effective_vram_available
    if vram >= w.vram_needed:
        parts["vram_fit"] = 40.0 if w.vram_needed <= 0 else 40.0 * min(1.0, 2.0 / (vram / w.vram_needed))
    if d.cpu_cores * (1.0 - d.cpu_utilization) >= w.cpu_cores_needed:
        parts["cpu"] = 20.0
    if d.ram_available_bytes >= w.ram_needed:
        parts["ram"] = 15.0
    if w.preferred_device_type is not None and w.preferred_device_type == d.device_type:
        parts["device_type"] = 10.0
    if w.min_performance <= 0:
        parts["performance"] = 25.0
    else:
        parts["performance"] = 25.0 * min(1.0, max(0.0, d.benchmark_score) / w.min_performance)
    parts["load_balance"] = 30.0 * (1.0 - min(max(d.load_factor, 0.0), 1.0))
    if w.communication_heavy:
        related = w.related_set
        lat = [link.latency_s for n, link in d.links.items() if n in related and n != d.node_id]
        avg_ms = 1000.0 * sum(lat) / len(lat) if lat else 0.0
        parts["network"] = 20.0 * (1.0 - min(1.0, avg_ms / 100.0))
    return parts


def score_node(
    d: DeviceProfile, w: Work, weights: Weights, config: SchedulerConfig, now: float
) -> NodeScore:
    parts = score_parts(d, w)
    weighted = {k: v * weights.multiplier(PART_GROUP[k]) for k, v in parts.items()}
    total = sum(weighted.values())
    penalty = ""
    timeout = config.fault_tolerance.heartbeat_timeout
    age = now - d.last_heartbeat
    if age > timeout:
        total = 0.0
        penalty = f"no heartbeat for {age:.1f} s (timeout {timeout:g} s): score 0"
    elif d.power_state != "active":
        total *= 0.5
        penalty = f"power state {d.power_state}: score x0.5"
    threshold = config.scoring.min_score_threshold
    reason = ""
    if d.failed:
        reason = "failed"
    elif d.drained:
        reason = "drained"
    elif age > timeout:
        reason = penalty
    elif total < threshold:
        short = sorted(((PART_MAX[k] * weights.multiplier(PART_GROUP[k]) - weighted[k], k) for k in parts), reverse=True)
        lost = ", ".join(f"{k} {weighted[k]:.0f}/{PART_MAX[k] * weights.multiplier(PART_GROUP[k]):.0f}" for _, k in short[:2])
        reason = f"score {total:.1f} < {threshold:g} (lowest parts: {lost})"
        if penalty:
            reason += f"; {penalty}"
    return NodeScore(
        node_id=d.node_id,
        score=round(total, 3),
        eligible=not reason,
        reason=reason,
        parts=parts,
        weighted_parts=weighted,
        weights=weights.as_dict(),
        penalty=penalty,
    )


def score_nodes(
    profiles: Iterable[DeviceProfile],
    work: Work | ModelSpec,
    config: SchedulerConfig | None = None,
    now: float = 0.0,
    state: ClusterState | None = None,
) -> dict[str, NodeScore]:
    """Score every node. ``work`` is a :class:`Work` or a model (then :func:`work_for_model`)."""
    config = config or SchedulerConfig()
    ps = list(profiles)
    if isinstance(work, ModelSpec):
        work = work_for_model(work, ps)
    weights = dynamic_weights(config, state or cluster_state(ps))
    return {p.node_id: score_node(p, work, weights, config, now) for p in ps}
