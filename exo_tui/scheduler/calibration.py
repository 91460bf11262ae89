"""Measured, then planned: the cost model corrected by what the ring measures.

Pure, like the rest of the scheduler: the coordinator (:mod:`exo_tui.cluster.calibrate`) measures
and hands the figures in as values; nothing here reads a clock or a socket.

* :class:`NodeMeasure` — a node's measured seconds per layer: a decode step's time on its shard
  (the hops' own timing) over the shard's layers in mean layers of the model, and a prompt
  token's the same way during prefill; and the output head's decode time in this node's layers,
  where the node was measured both with and without it (the head's bytes say little of its time:
  SmolLM2's is 13.6 layers' bytes and runs in about 5 layers' time on ONNX);
* by load: the figures are kept per bucket of batch size (the requests whose steps the nodes run
  together) and context length (:func:`load_bucket`), since a step's time grows with both;
  :meth:`Measurements.at` picks a load's, the nearest bucket measured where its own is not;
* :class:`LinkMeasure` — the time a decode token's hidden state spent on a link, and its bytes;
  and the link's bandwidth where steps of different sizes crossed it (:func:`fit_link`: a prompt's
  or a verify step's rows against a decode step's one);
* :class:`Measurements` — those, with the coordinator's share of a token on the steps it sends (its
  own time between a token and the next step, and its links to the first and from the last stage)
  and the share of tokens the last stage handed straight to the first (the hand-off); and, where
  one node held every layer, its hand-off to itself (the ring's way back there: no link holds it).

:func:`calibrate` gives the profiles those figures in place of the start-up benchmark's (a node
with no measurement keeps its own); :func:`measured_constraints` carries the coordinator's share
into the predictions. :func:`prediction_gap` and :func:`follow` are the rule that acts on a gap:
beyond :data:`GAP` it is shown; a rebalance is applied alone only when the gap has held for
``hold_s``, the new plan is predicted :data:`MIN_GAIN` better on the measured figures, and
``cooldown_s`` have passed since the last one (hysteresis: a plan never flaps).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from exo_tui.scheduler.context import COORDINATOR as COORDINATOR  # a link's coordinator end
from exo_tui.scheduler.plan import Constraints
from exo_tui.scheduler.profile import DeviceProfile, Link
from exo_tui.scheduler.spec import ModelSpec

GAP = 0.15  # measured speed this far from the prediction is shown, and may be acted on
MIN_GAIN = 0.10  # a rebalance applied alone must be predicted this much faster
HOLD_S = 5.0  # seconds a gap must hold before a rebalance is applied alone
COOLDOWN_S = 30.0  # seconds between two rebalances applied alone


def head_bytes_layers(spec: ModelSpec) -> float:
    """The output head in mean layers of ``spec`` by its bytes: its time where none is measured."""
    return spec.head_bytes / spec.mean_layer_bytes


def shard_layer_units(spec: ModelSpec, start: int, end: int, head_layers: float | None = None) -> float:
    """Layers ``[start, end)`` in mean layers of ``spec`` (a layer weighs its bytes over the mean),
    plus the output head on the last shard (``head_layers``, by default its bytes in mean
    layers): the units a node's seconds per layer are counted in
    (:meth:`~exo_tui.scheduler.profile.DeviceProfile.layer_s`)."""
    units = sum(spec.layers[start:end]) / spec.mean_layer_bytes
    if end == spec.n_layers:
        units += head_bytes_layers(spec) if head_layers is None else head_layers
    return units


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT_BUCKETS = tuple(2**k for k in range(7, 18))  # 128 .. 131,072 positions


def load_bucket(batch: int, context: int) -> tuple[int, int]:
    """The (batch, context) bucket a step of ``batch`` requests at ``context`` positions counts
    in: each rounded up to a power of two (the last bucket holds everything larger)."""
    b = next((x for x in BATCH_BUCKETS if batch <= x), BATCH_BUCKETS[-1])
    c = next((x for x in CONTEXT_BUCKETS if context <= x), CONTEXT_BUCKETS[-1])
    return b, c


def _nearest(buckets: Iterable[tuple[int, int]], want: tuple[int, int]) -> tuple[int, int] | None:
    """The measured bucket nearest ``want``: the same batch first (a batch's step time differs
    more than a context's), then the nearest context, the smaller on a tie."""
    def distance(b: tuple[int, int]) -> tuple[float, float, int]:
        return abs(math.log2(b[0] / want[0])), abs(math.log2(b[1] / want[1])), b[1]
    return min(buckets, key=distance, default=None)


@dataclass(frozen=True)
class NodeMeasure:
    decode_s_per_layer: float | None = None  # one decode step, one mean layer
    prefill_s_per_layer_token: float | None = None  # one prompt token, one mean layer
    samples: int = 0
    head_layers: float | None = None  # the output head's decode time in this node's layers, measured
    # seconds per layer by the layers its shard held (the counts it was measured on)
    by_layers: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class LinkMeasure:
    hop_s: float  # mean time a decode token's hidden state spent on the link
    nbytes: float  # what it carried
    samples: int = 0
    bandwidth_bytes_per_s: float | None = None  # learned from steps of different sizes (None: the probe's)


FIT_SPREAD = 4.0  # a link's bandwidth is fitted from steps at least this many times a decode step's bytes
FIT_MIN = 2  # ... and at least this many of them


def fit_link(small: Iterable[tuple[float, float]], big: Iterable[tuple[float, float]]) -> float | None:
    """A link's bandwidth (bytes/s) from its hops: ``small``, (bytes, seconds) of one-row steps
    (decode), and ``big``, of steps of many rows (a prompt's, a verify step's). A hop takes
    latency + bytes / bandwidth; anchored at the small steps' median, the bandwidth is the inverse
    of the median slope to each big step at least :data:`FIT_SPREAD` times their bytes (robust to a
    stray hop either way). None where the sizes do not separate the two (too few big steps, or big
    steps no slower than small ones): the probe's bandwidth holds."""
    small = list(small)
    if not small:
        return None
    x0 = statistics.median(x for x, _ in small)
    y0 = statistics.median(y for _, y in small)
    slopes = [(y - y0) / (x - x0) for x, y in big if x >= FIT_SPREAD * x0 and x > x0]
    if len(slopes) < FIT_MIN:
        return None
    slope = statistics.median(slopes)
    return 1.0 / slope if slope > 0 else None


@dataclass(frozen=True)
class Measurements:
    nodes: Mapping[str, NodeMeasure] = field(default_factory=dict)  # at the load planned for
    links: Mapping[tuple[str, str], LinkMeasure] = field(default_factory=dict)
    coordinator_s: float | None = None  # a token's time in the coordinator, between it and the step it sends
    by_load: Mapping[str, Mapping[tuple[int, int], NodeMeasure]] = field(default_factory=dict)  # every bucket
    cpu_per_busy_s: Mapping[str, float] = field(default_factory=dict)  # a node's CPU seconds a second of its runs
    handed_share: float | None = None  # decode tokens the last node handed straight to the first
    handoff: Mapping[str, float] = field(default_factory=dict)  # a one-node ring's hand-off to itself, by node
    held_layers: Mapping[str, int] = field(default_factory=dict)  # a node its CPU quota holds back: its shard's layers

    @property
    def empty(self) -> bool:
        return not self.nodes and not self.links and self.coordinator_s is None

    def at(self, batch: int, context: int) -> Measurements:
        """These measurements with each node's figures for ``batch`` requests at ``context``
        positions: its bucket's, else its nearest measured bucket's."""
        want = load_bucket(batch, context)
        nodes = {}
        for nid, loads in self.by_load.items():
            got = want if want in loads else _nearest(loads, want)
            if got is not None:
                nodes[nid] = loads[got]
        return replace(self, nodes=nodes)


def calibrate(profiles: Iterable[DeviceProfile], spec: ModelSpec, measured: Measurements) -> list[DeviceProfile]:
    """``profiles`` with the measured figures in place of the start-up ones.

    A measured decode time replaces the benchmark's for the node's backend (on this model's
    layers: scaled for another model by its layers' bytes); its other work is in the measurement,
    so ``load_factor`` is 0, and the memory-bandwidth floor is not applied (``calibrated``). The
    score's performance figure moves by the same ratio: the node is re-scored.
    The head's measured time (in the node's layers) replaces its bytes' estimate. Prefill, where
    not measured, keeps the start-up ratio of prefill to decode. A measured link takes its
    learned bandwidth (:func:`fit_link`), else keeps its probed one; its latency is what the decode
    hop took beyond the bytes' time at that bandwidth. A link
    between two nodes that the ring has not measured takes its probe's time plus what the measured
    hops took beyond their probes' (:func:`hop_software_s`): a hop's frame is encoded, sent through
    TLS and decoded by both nodes' software, which a ping does not show (1.3-1.5 ms a hop on the
    2-core VM against pings of 0.1-0.3 ms), and without it a plan through pairs never measured
    looked cheaper than the ring it was measured on.

    A node not measured, on a host where others were (``host_id``; not nodes their CPU quota held
    back), takes their measured ÷ start-up ratio (the median) on its start-up figures: the host's
    cores are as busy for it as for them. Without it, a node measured while other work loaded its
    machine looked slower than its idle neighbours' start-up figures, and the plan offered to move
    its layers to a neighbour that would run no faster (and, measured there, back again)."""
    profiles = list(profiles)
    by_id = {p.node_id: p for p in profiles}
    software_s = hop_software_s(by_id, measured)
    busier = host_slowdown(profiles, spec, measured)
    out = []
    for p in profiles:
        m = measured.nodes.get(p.node_id)
        backend = p.best_backend()
        if m is not None and m.decode_s_per_layer:
            startup_decode = p.layer_s(spec, backend)
            startup_prefill = p.prefill_s(spec, backend)
            prefill = m.prefill_s_per_layer_token or startup_prefill * m.decode_s_per_layer / max(startup_decode, 1e-12)
            p = replace(p, decode_s_per_layer={backend: m.decode_s_per_layer},
                        prefill_s_per_layer_token={backend: prefill}, head_layers=m.head_layers,
                        layer_s_by_layers=m.by_layers,
                        compute_ref_layer_bytes=int(round(spec.mean_active_layer_bytes)), load_factor=0.0,
                        benchmark_score=p.benchmark_score * startup_decode / m.decode_s_per_layer, calibrated=True)
        elif p.host_id in busier and backend in p.decode_s_per_layer:
            ratio = busier[p.host_id]
            p = replace(p, decode_s_per_layer={backend: p.layer_s(spec, backend) * ratio},
                        prefill_s_per_layer_token={backend: p.prefill_s(spec, backend) * ratio},
                        compute_ref_layer_bytes=int(round(spec.mean_active_layer_bytes)), load_factor=0.0,
                        benchmark_score=p.benchmark_score / ratio, calibrated=True)
        if p.node_id in measured.cpu_per_busy_s:
            p = replace(p, cpu_per_busy_s=measured.cpu_per_busy_s[p.node_id])
        if p.node_id in measured.handoff:
            p = replace(p, handoff_s=measured.handoff[p.node_id])
        if p.node_id in measured.held_layers:
            p = replace(p, quota_held_layers=measured.held_layers[p.node_id])
        links = dict(p.links)
        for (a, b), lm in measured.links.items():
            if a != p.node_id or b == COORDINATOR or lm.samples <= 0:
                continue
            known = p.link_to(b)
            bandwidth = lm.bandwidth_bytes_per_s or known.bandwidth_bytes_per_s
            latency = max(0.0, lm.hop_s - lm.nbytes / max(bandwidth, 1.0))
            links[b] = Link(latency, bandwidth, known.loss)
        for b in by_id:
            if software_s and b != p.node_id and (p.node_id, b) not in measured.links:
                known = p.link_to(b)
                links[b] = Link(known.latency_s + software_s, known.bandwidth_bytes_per_s, known.loss)
        if links != p.links:
            p = replace(p, links=links)
        out.append(p)
    return out


def host_slowdown(profiles: Iterable[DeviceProfile], spec: ModelSpec, measured: Measurements) -> dict[str, float]:
    """Each host's measured ÷ start-up decode time per layer, the median over its nodes measured
    (not those their CPU quota held back: their slowness is their own)."""
    ratios: dict[str, list[float]] = {}
    for p in profiles:
        m = measured.nodes.get(p.node_id)
        if not p.host_id or m is None or not m.decode_s_per_layer or p.node_id in measured.held_layers:
            continue
        startup = p.layer_s(spec, p.best_backend())
        if startup > 0:
            ratios.setdefault(p.host_id, []).append(m.decode_s_per_layer / startup)
    return {host: statistics.median(r) for host, r in ratios.items()}


def hop_software_s(profiles: Mapping[str, DeviceProfile], measured: Measurements) -> float:
    """The median of what the measured hops took beyond their links' probed time (0: none)."""
    extra = [lm.hop_s - profiles[a].link_to(b).hop_s(lm.nbytes) for (a, b), lm in measured.links.items()
             if lm.samples > 0 and a in profiles and b in profiles and a != b]
    return max(0.0, statistics.median(extra)) if extra else 0.0


def measured_constraints(constraints: Constraints, measured: Measurements) -> Constraints:
    """``constraints`` with the coordinator's measured share of a token and its links to and from
    each node measured, which the predictions count on the tokens' way back from the last stage to
    the first that the coordinator sends (a plan's first and last stage may not be those of the
    ring measured: the node behind a slow link last, its link to the coordinator is in the token),
    and the measured share of tokens handed straight from the last stage to the first."""
    if measured.handed_share is not None:
        constraints = replace(constraints, handed_share=measured.handed_share)
    if measured.coordinator_s is None:
        return constraints
    links = tuple(sorted((a, b, lm.hop_s) for (a, b), lm in measured.links.items() if COORDINATOR in (a, b)))
    return replace(constraints, coordinator_s=measured.coordinator_s, coordinator_links=links)


def prediction_gap(predicted_tok_per_s: float, measured_tok_per_s: float) -> float | None:
    """How far the measured speed is from the prediction, as a fraction of it (negative:
    slower); None without both."""
    if predicted_tok_per_s <= 0 or measured_tok_per_s <= 0:
        return None
    return measured_tok_per_s / predicted_tok_per_s - 1.0


@dataclass(frozen=True)
class FollowState:
    """What :func:`follow` remembers between checks."""

    gap_since: float | None = None  # when the gap (beyond GAP) was first seen, on the caller's clock
    last_applied: float | None = None  # when a rebalance was last applied alone


def follow(state: FollowState, gap: float | None, gain: float | None, now: float, *, hold_s: float = HOLD_S,
           cooldown_s: float = COOLDOWN_S) -> tuple[FollowState, bool]:
    """(the new state, whether to apply the rebalance now). ``gap``: :func:`prediction_gap` of the
    plan in force; ``gain``: the rebalance's predicted speed-up on the measured figures (after /
    before - 1), None when it moves nothing."""
    if gap is None or abs(gap) <= GAP:
        return replace(state, gap_since=None), False
    since = state.gap_since if state.gap_since is not None else now
    state = replace(state, gap_since=since)
    cooled = state.last_applied is None or now - state.last_applied >= cooldown_s
    if now - since >= hold_s and cooled and gain is not None and gain >= MIN_GAIN:
        return FollowState(None, now), True
    return state, False
