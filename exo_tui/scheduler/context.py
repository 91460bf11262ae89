"""What every part of the partitioner reads: a cluster's numbers for one model, and its errors.

:class:`PlanContext` holds, per node, the memory it may use, its seconds per layer, its backend and its
KV bytes per layer, with the model's spec, the pins and caches of ring orders and predictions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler.plan import LEASE_TOKENS, Constraints, Pin, Predictions
from exo_tui.scheduler.profile import UNKNOWN_LINK, DeviceProfile
from exo_tui.scheduler.spec import ModelSpec

STRATEGIES = ("latency", "throughput", "memory", "exo-ring")
GB = 1e9
COORDINATOR = "coordinator"  # the coordinator's end of a measured link
TOKEN_BYTES = 8  # a sampled token id (and its log-probability) back to the start of the ring
MEMORY_HEADROOM = 1.3  # warn when the cluster's free memory is below this × the model


class InfeasiblePlan(Exception):
    """No plan satisfies the request. The message says which constraint fails and by how much."""

    def __init__(self, message: str, constraint: str, shortfall_bytes: int = 0) -> None:
        super().__init__(message)
        self.constraint = constraint  # memory | pins | eligibility | min_layers_per_shard | strategy
        self.shortfall_bytes = shortfall_bytes


def gb(n: float) -> str:
    if abs(n) < 0.1 * GB:  # a small limit's figures: 0.0 GB would say nothing
        return f"{n / 1e6:.0f} MB"
    return f"{n / GB:.1f} GB"


def ms_text(s: float) -> str:
    return f"{s * 1000:.1f} ms"


# ------------------------------------------------------------------------------- context


@dataclass
class PlanContext:
    spec: ModelSpec
    profiles: dict[str, DeviceProfile]
    usable: dict[str, int]
    t: dict[str, float]  # decode s per mean layer
    head_t: dict[str, float]  # decode s of the output head
    backend: dict[str, str]
    kv: dict[str, float]  # bytes of one layer's KV cache on each node (its backend's cache precision)
    pins: tuple[Pin, ...]
    min_layers: int
    prompt_tokens: int
    act_bytes: int
    coordinator_s: float | None = None  # measured: the token's way back (Constraints.coordinator_s)
    coordinator_links: tuple[tuple[str, str, float], ...] = ()  # Constraints.coordinator_links
    handed_share: float = 1.0 - 1.0 / LEASE_TOKENS  # tokens handed from the last stage to the first (Constraints.handed_share)
    # a node's seconds per layer by its shard's count of layers, over ``t`` (index: the count),
    # where measured on several counts (DeviceProfile.layer_s_by_layers); others: 1
    size: dict[str, np.ndarray] = field(default_factory=dict)
    orders: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)
    predictions: dict[tuple[tuple[str, int, int], ...], Predictions] = field(default_factory=dict)

    def compute_s(self, nid: str, start: int, end: int, W: np.ndarray) -> float:
        """One decode token through layers ``[start, end)`` on node ``nid`` (``W``: the model's
        layer weight prefix), the head included on the last shard."""
        f = self.size.get(nid)
        layers = self.t[nid] * float(W[end] - W[start]) * (float(f[end - start]) if f is not None else 1.0)
        return layers + (self.head_t[nid] if end == self.spec.n_layers else 0.0)

    def need(self, nid: str, start: int, end: int) -> int:
        """Memory node ``nid`` needs for layers ``[start, end)``: weights as its backend holds
        them, its KV caches at its backend's precision, the embedding or head at the ends."""
        return self.spec.range_bytes(start, end, self.kv[nid], self.backend[nid])

    def per_layer(self, nid: str) -> float:
        """An average layer with its KV cache on node ``nid``."""
        spec = self.spec
        return spec.mean_held_layer_bytes(self.backend[nid]) + self.kv[nid] * spec.kv_layers(0, spec.n_layers) / spec.n_layers

    def way_back(self, last: str, first: str) -> float:
        """A decode token's way from the last stage ``last`` to the first ``first``: handed on
        (:attr:`handed_share` of the tokens) over that link (measured, or as other links not
        measured: the probe plus a hop's software; on one node, its hand-off to itself:
        :attr:`handoff`), the rest through the
        coordinator as measured (:meth:`coordinator_hop`). Where the coordinator is not measured,
        the link alone."""
        handed = self.hop(last, first, TOKEN_BYTES)
        via = self.coordinator_hop(first, last)
        if via is None:
            return handed
        return self.handed_share * handed + (1.0 - self.handed_share) * via

    def coordinator_hop(self, first: str, last: str) -> float | None:
        """The token's way back from ``last`` to ``first`` by the coordinator, on a step it sends,
        as measured (None: not measured): its own share, its hop to ``first`` and ``last``'s hop to it."""
        if self.coordinator_s is None:
            return None
        to = {b: s for a, b, s in self.coordinator_links if a == COORDINATOR}
        back = {a: s for a, b, s in self.coordinator_links if b == COORDINATOR}
        return self.coordinator_s + self._coordinator_link(to, back, first) + self._coordinator_link(back, to, last)

    def _coordinator_link(self, way: dict[str, float], other_way: dict[str, float], node: str) -> float:
        """A node's measured link to (or from) the coordinator; else the other way's (a link is
        mostly the same both ways: a ring measures the coordinator's link to its first stage and
        from its last only); else what the measured ones took beyond their nodes' :meth:`reach`,
        the median, plus this node's (0: nothing measured). A node behind a slow link is slow to
        reach from the coordinator too, and the others are not: its measured link, taken as theirs,
        made every one-node plan on another node pay it (slow-link's, measured 1.19-1.21 of their
        prediction)."""
        if node in way:
            return way[node]
        if node in other_way:
            return other_way[node]
        if not way:
            return 0.0
        beyond = float(np.median([s - self.reach[n] for n, s in way.items() if n in self.reach] or list(way.values())))
        return max(0.0, beyond + self.reach.get(node, 0.0))

    @cached_property
    def reach(self) -> dict[str, float]:
        """Each node's fastest link to or from another node (0 without any): how far it is on the
        network from the rest of the cluster (a link behind a slow one is slow to every node; the
        others' are slow only to it), the coordinator's side included."""
        out = {}
        for nid, p in self.profiles.items():
            lat = [p.links[o].latency_s for o in self.profiles if o != nid and o in p.links]
            lat += [q.links[nid].latency_s for o, q in self.profiles.items() if o != nid and nid in q.links]
            out[nid] = min(lat, default=0.0)
        return out

    def hop(self, a: str, b: str, nbytes: float | None = None) -> float:
        if a == b:
            return self.handoff[a]
        return self.profiles[a].link_to(b).hop_s(self.act_bytes if nbytes is None else nbytes)

    @cached_property
    def handoff(self) -> dict[str, float]:
        """Each node's hand-off to itself when it holds the whole ring (the way back of a one-node
        ring's token): as measured there; else the median of the other nodes' measured, of its host
        first (the same software on the same cores); else 0."""
        measured = {n: p.handoff_s for n, p in self.profiles.items() if p.handoff_s is not None}
        out = {}
        for nid, p in self.profiles.items():
            if p.handoff_s is not None:
                out[nid] = p.handoff_s
                continue
            host = [s for n, s in measured.items() if p.host_id and self.profiles[n].host_id == p.host_id]
            others = host or list(measured.values())
            out[nid] = float(np.median(others)) if others else 0.0
        return out

    @cached_property
    def links(self) -> tuple[dict[str, int], np.ndarray, np.ndarray]:
        """(index of each node, latency matrix, bandwidth matrix) over all profiles."""
        ids = sorted(self.profiles)
        index = {n: i for i, n in enumerate(ids)}
        lat = np.full((len(ids), len(ids)), UNKNOWN_LINK.latency_s)
        bw = np.full((len(ids), len(ids)), UNKNOWN_LINK.bandwidth_bytes_per_s)
        for i, nid in enumerate(ids):
            links = self.profiles[nid].links
            known = [p for p in links if p in index]
            if known:
                cols = [index[p] for p in known]
                lat[i, cols] = [links[p].latency_s for p in known]
                bw[i, cols] = np.maximum([links[p].bandwidth_bytes_per_s for p in known], 1.0)
        np.fill_diagonal(lat, 0.0)
        np.fill_diagonal(bw, np.inf)
        return index, lat, bw


def size_factors(profiles: Mapping[str, DeviceProfile], backend: Mapping[str, str], n_layers: int) -> dict[str, np.ndarray]:
    """Each measured node's seconds per layer by its shard's count of layers (0..``n_layers``)
    over its decode figure: between the counts it was measured on, interpolated; beyond them, as
    the other nodes of its host (``host_id``; of the cluster where none) measured theirs grow
    from that count on (the median of their ratios); where none did, flat. A node measured on one
    count is otherwise predicted at that count's time for any shard, and the plan that puts every
    layer on it looks as fast as its share of exo's ring did (this VM: 1.3-1.8× too fast)."""
    n = np.arange(n_layers + 1, dtype=float)
    curves = {}
    for nid, p in profiles.items():
        base = p.decode_s_per_layer.get(backend[nid])
        if p.layer_s_by_layers and base:
            xs, ys = zip(*p.layer_s_by_layers, strict=True)
            curves[nid] = (min(xs), max(xs), np.interp(n, xs, ys) / base)
    out = {}
    for nid, (lo, hi, f) in curves.items():
        host = profiles[nid].host_id
        peers = [c for j, c in curves.items() if j != nid and (not host or profiles[j].host_id == host)]
        peers = peers or [c for j, c in curves.items() if j != nid]
        f = f.copy()
        for edge, beyond in ((hi, n > hi), (lo, n < lo)):
            ratios = [g / np.interp(edge, n, g) for plo, phi, g in peers if plo <= edge <= phi]
            if ratios and beyond.any():
                r = np.median(np.vstack(ratios), axis=0)
                f[beyond] = np.interp(edge, n, f) * r[beyond]
        out[nid] = f
    return out


def make_context(
    profiles: Mapping[str, DeviceProfile], spec: ModelSpec, config: SchedulerConfig, constraints: Constraints
) -> PlanContext:
    rr = config.resource_reservation
    usable, t, head_t, backend, kv, size = {}, {}, {}, {}, {}, {}
    head_layers = spec.head_bytes / spec.mean_layer_bytes
    for nid, p in profiles.items():
        usable[nid] = p.usable_bytes(rr.system_reserved_ram * 1024**3, rr.system_reserved_vram * 1024**3, rr.emergency_reserve)
        backend[nid] = p.best_backend()
        kv[nid] = p.kv_bytes_per_layer(spec, backend[nid])
        t[nid] = p.layer_s(spec, backend[nid])
        head_t[nid] = t[nid] * (head_layers if p.head_layers is None else p.head_layers)
    for nid, nbytes in constraints.reserved:  # kept for other work (a draft model: scheduler/draft.py)
        if nid in usable:
            usable[nid] -= nbytes
    size = size_factors(profiles, backend, spec.n_layers)
    m = constraints.min_layers_per_shard or config.partition.min_layers_per_shard
    handed = constraints.handed_share
    if handed is None:  # a lease's share; a stream that drafts takes no lease
        handed = 0.0 if constraints.draft is not None else 1.0 - 1.0 / LEASE_TOKENS
    return PlanContext(spec, dict(profiles), usable, t, head_t, backend, kv, tuple(sorted(constraints.pins, key=lambda p: p.start)),
                m, min(constraints.prompt_tokens, max(1, spec.context_length - 1)),  # a prompt the context holds
                spec.activation_bytes_per_token, constraints.coordinator_s, constraints.coordinator_links,
                min(1.0, max(0.0, handed)), size=size)
