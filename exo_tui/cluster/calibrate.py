"""What the ring measures, as the scheduler's figures: each node's seconds per layer, each link's
hop, the coordinator's share of a token (exo_tui/scheduler/calibration.py plans with them).

The pipeline hands every step's timing to :meth:`Calibrator.step` (beside the cluster strip's
:class:`~exo_tui.cluster.metrics.ClusterMetrics`): each hop's residence at its node (the frame's
arrival to its result leaving: the run and the wait for it, on the node's own clock) over the layers
it holds in the ring in force gives its seconds per (mean) layer, a decode step's per token, a
prompt's step's per prompt token, kept per bucket of load: the requests running (the nodes run their
steps together) and the positions the step's request holds. The shard with the output head gives the
head's time, once the node was also measured without it or with it on shards of other sizes
(SmolLM2's head is 13.6 layers' bytes and takes about 5 layers' time on ONNX: counted by its bytes,
the node holding it looked twice as fast as it was). The links and the coordinator take what the
round trip leaves (:func:`~exo_tui.cluster.metrics.split_token`), so the parts add up to the token;
they, and the token, count only while one request runs (a batch's round trip is shared). A link
between two nodes is also timed on the steps of many rows (a prompt's, a verify step's: their
hidden states are that many times a decode token's bytes), and its bandwidth is fitted from those
against the decode steps' (:func:`~exo_tui.scheduler.calibration.fit_link`; the probe's holds where
the sizes do not separate latency and bandwidth). The figures
are means over the last :data:`WINDOW_S` seconds, so a node that slows down (other work, a CPU
quota, heat, a battery) is seen within seconds; a figure no longer measured (the node holds no
layers, or another shard, or the load moved) is kept for :data:`KEEP_S`, after which its start-up
benchmark counts again.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar

from exo_tui.cluster.metrics import StepSample, TokenSplit, split_token
from exo_tui.scheduler.calibration import (
    LinkMeasure,
    Measurements,
    NodeMeasure,
    fit_link,
    head_bytes_layers,
    load_bucket,
    shard_layer_units,
)
from exo_tui.scheduler.spec import ModelSpec

WINDOW_S = 10.0  # figures are means over this window
MIN_SAMPLES = 5  # decode tokens a node's figure needs in the window
KEEP_S = 300.0  # a figure no longer measured is kept this long
SAMPLES_MAX = 4096
MIN_BUSY = 0.05  # a node's CPU a second of runs is measured over heartbeats it ran this share of
QUOTA_HELD = 0.8  # ... and used less than this share of its CPU quota
CPU_SAMPLES = 3  # heartbeats the figure needs in the window
HEAD_FIT_LAYERS = 4.0
SIZED_MAX = 64  # a link's hops on steps of many rows kept (for KEEP_S) to fit its bandwidth
HEAD_NEAR_LAYERS = 4.0  # the head from the same node without it: on about as many layers  # a head found from two shards with it: their layers this far apart


class _Series:
    """(time, value) pairs of the last :data:`WINDOW_S`, and the last window's mean kept."""

    def __init__(self) -> None:
        self.items: deque[tuple[float, float]] = deque(maxlen=SAMPLES_MAX)
        self.kept: tuple[float, float, int] | None = None  # (time, mean, samples) of the last full window

    def add(self, ts: float, value: float) -> None:
        self.items.append((ts, value))

    def mean(self, now: float, min_samples: int = MIN_SAMPLES) -> tuple[float, int] | None:
        while self.items and self.items[0][0] < now - WINDOW_S:
            self.items.popleft()
        if len(self.items) >= min_samples:
            mean = sum(v for _, v in self.items) / len(self.items)
            self.kept = (now, mean, len(self.items))
            return mean, len(self.items)
        if self.kept is not None and now - self.kept[0] <= KEEP_S:
            return self.kept[1], self.kept[2]
        return None


Bucket = tuple[int, int]  # (batch, context): scheduler/calibration.py's load_bucket


def _median(values: Iterable[float]) -> float | None:
    got = sorted(values)
    return statistics.median(got) if got else None


Points = dict[tuple[str, Bucket], list[tuple[float, float, int]]]  # (layers, figure, samples) per node and load


def _head_layers(plain: Points, heads: Points, quota: Collection[str] = (),
                 hosts: Mapping[str, str] | None = None) -> dict[tuple[str, Bucket], float]:
    """The output head's decode time in layers, for each node (and load) measured with the head
    (its step's time at each count of layers it held with it) and either without it on about as
    many layers (within :data:`HEAD_NEAR_LAYERS`: a layer's time depends on how many a shard
    holds; the head is what the step leaves beyond its layers) or with it at two counts of layers
    at least :data:`HEAD_FIT_LAYERS` apart (the step's time over its layers is a line: its slope a
    layer's time, what it leaves at no layers the head's); else, against the layer time of the
    other nodes of its host (``hosts``: node → host) measured without it on about as many layers
    (the median; not nodes under a CPU quota, ``quota``): a ring measures its last node with the
    head only, and the head's bytes (SmolLM2's: 13.6 layers against the 5 it takes on ONNX) made
    that node's layer 0.65 of its time, and the plan putting every layer on it 1.2× too fast. Only
    its host's: another machine's layer time would make the node as fast as that machine and book
    all of its own slowness as the head. Else none (the caller takes another node's head, or the
    head's bytes)."""
    known = hosts or {}
    out = {}
    for key, got in heads.items():
        units, residence, _ = max(got, key=lambda g: g[2])
        near = [p for p in plain.get(key, ()) if abs(p[0] - units) <= HEAD_NEAR_LAYERS and p[1] > 0]
        if near:
            rate = min(near, key=lambda p: abs(p[0] - units))[1]
            out[key] = max(0.0, residence - rate * units) / rate
            continue
        low, high = min(got), max(got)
        if high[0] - low[0] >= HEAD_FIT_LAYERS and high[1] > low[1]:
            rate = (high[1] - low[1]) / (high[0] - low[0])
            out[key] = max(0.0, low[1] / rate - low[0])
            continue
        host = known.get(key[0])
        if not host:
            continue
        peers = _median(p[1] for (nid, bucket), pts in plain.items() if bucket == key[1] and nid != key[0]
                        and nid not in quota and known.get(nid) == host
                        for p in pts if abs(p[0] - units) <= HEAD_NEAR_LAYERS and p[1] > 0)
        if peers:
            out[key] = max(0.0, residence - peers * units) / peers
    return out


def _by_layers(points: list[tuple[float, float, int]]) -> tuple[tuple[float, float], ...]:
    """A node's seconds per layer by the layers its shard held (samples-weighted where two
    shards held as many), in order."""
    merged: dict[float, tuple[float, int]] = {}
    for units, rate, n in points:
        total, count = merged.get(units, (0.0, 0))
        merged[units] = (total + rate * n, count + n)
    return tuple((u, total / count) for u, (total, count) in sorted(merged.items()))


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[Calibrator, _P], _R]) -> Callable[Concatenate[Calibrator, _P], _R]:
    def run(self: Calibrator, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


class Calibrator:
    """Measured figures for the scheduler, from the steps' timing."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # the ring's steps and heartbeats add to the series on the event loop's thread; a plan made
        # on a worker thread reads (and trims) them: every method that touches them holds this
        self._lock = threading.Lock()
        # per (node, load bucket, the shard's layers): a decode step's seconds per layer on shards
        # without the head; on the shard with it, the step's time (the head's is what its layers leave)
        self.decode: dict[tuple[str, Bucket, float], _Series] = defaultdict(_Series)
        self.head: dict[tuple[str, Bucket, float], _Series] = defaultdict(_Series)  # by its layers
        self.prefill: dict[tuple[str, Bucket], _Series] = defaultdict(_Series)
        self.links: dict[tuple[str, str], _Series] = defaultdict(_Series)
        # a link between two nodes on steps of many rows: (time, bytes, seconds), for its bandwidth
        self.sized: dict[tuple[str, str], deque[tuple[float, float, float]]] = defaultdict(
            lambda: deque(maxlen=SIZED_MAX))
        self.coordinator = _Series()  # its share of a token, on the steps it sends
        self.handed = _Series()  # 1 for a decode token handed from the last node to the first, else 0
        self.handoff: dict[str, _Series] = defaultdict(_Series)  # a one-node ring's hand-off to itself
        self.token = _Series()  # a decode token's whole time (the ring and the coordinator)
        self.token_version: int | None = None  # the plan version ``token`` measures
        self.act_bytes = 0  # a decode token's hidden state, the bytes a link's hop carried
        self.load: Bucket = load_bucket(1, 1)  # the latest decode step's: the load plans are predicted for
        self.head_prior = 0.0  # the head in layers by its bytes, for a node measured only with it
        self.cpu: dict[str, _Series] = defaultdict(_Series)  # a node's CPU seconds a second of its runs
        self._cpu_last: dict[str, tuple[float, float, float, float]] = {}  # its last heartbeat's (time, CPU, busy, resided)
        self.resided: dict[str, float] = defaultdict(float)  # a node's steps' residences, summed (its share of the steps' time)
        self.layers: dict[str, int] = {}  # the layers of the shard each node ran its latest decode step on
        # nodes their CPU quota held back at their last heartbeat (their step times hold the quota's
        # wait, and their CPU a second of runs is the quota's spread over those runs: see heartbeat)
        self.held: set[str] = set()
        self.quota: set[str] = set()  # nodes under a CPU quota (their heartbeats say)

    @_locked
    def heartbeat(self, node_id: str, metrics: dict[str, Any]) -> None:
        """A node's heartbeat: the CPU its process took since the last one over the time its runs
        took, where it ran enough to tell (:data:`MIN_BUSY`). Where its quota held it back, the
        CPU over its steps' residences instead (what the planner counts as its time on them, the
        quota's waits in it, before a run and during one): with those residences the quota's
        bound is the ring's measured token, and on a plan that gives the node more layers than it
        held then (:attr:`layers`; the bound counts only there, scheduler/prediction.py's
        ``cpu_bounds``) it grows with them: a node a quarter core gave a third of the layers at
        100 tokens a second gives all of them at 33 or fewer. Without it the
        planner saw only the stretched residences, which hold the quota's wait at the measured
        share of the work, and put every layer on the throttled node (benchmarks/emulated.py's
        slow-node: 0.69 of the prediction)."""
        quota = metrics.get("cpu_quota_cores")
        if isinstance(quota, (int, float)) and quota > 0:
            self.quota.add(node_id)
        else:
            self.quota.discard(node_id)
        cpu, busy = metrics.get("cpu_time_s"), metrics.get("busy_s")
        if not isinstance(cpu, (int, float)) or not isinstance(busy, (int, float)):
            return
        now = self.clock()
        resided = self.resided[node_id]
        last, self._cpu_last[node_id] = self._cpu_last.get(node_id), (now, float(cpu), float(busy), resided)
        if last is None or now <= last[0]:
            return
        dt, d_cpu, d_busy, d_resided = now - last[0], cpu - last[1], busy - last[2], resided - last[3]
        held = isinstance(quota, (int, float)) and quota > 0 and d_cpu / dt > QUOTA_HELD * quota
        if held:
            self.held.add(node_id)
            if d_resided >= MIN_BUSY * dt and d_cpu > 0:
                self.cpu[node_id].add(now, d_cpu / d_resided)
        else:
            self.held.discard(node_id)
            if d_busy >= MIN_BUSY * dt and d_cpu > 0:
                self.cpu[node_id].add(now, d_cpu / d_busy)

    @_locked
    def step(self, sample: StepSample, ring: Any, spec: ModelSpec | None, running: int, act_bytes: int,
             *, answering: bool = False, token: TokenSplit | None = None) -> None:
        """One step's timing, taken on ``ring`` (the RingPlan in force) with ``running`` requests
        (the nodes run their steps together: the batch); ``answering``: the request has its first
        token (a step of several rows is then a speculative verify step: neither a prompt's nor
        one token's, so not counted); ``token``: the decode step's split where the cluster's
        figures made it already (:func:`~exo_tui.cluster.metrics.split_token`)."""
        if spec is None or ring is None or sample.plan_version != ring.version or not sample.hops:
            return
        entries = {e.node_id: e for e in ring.ring}
        if [h.node_id for h in sample.hops] != [e.node_id for e in ring.ring]:
            return
        for h in sample.hops:
            self.resided[h.node_id] += h.residence_s
            if sample.rows == 1:
                self.layers[h.node_id] = entries[h.node_id].end - entries[h.node_id].start
        now = self.clock()
        if sample.rows != 1 and running == 1 and act_bytes > 0:  # a link's time on many rows' bytes
            links = split_token(sample, now).links
            for pair in zip((h.node_id for h in sample.hops), (h.node_id for h in sample.hops[1:]), strict=False):
                if pair in links:
                    self.sized[pair].append((now, float(sample.rows * act_bytes), links[pair]))
        if answering and sample.rows != 1:
            return
        bucket = load_bucket(max(1, running), sample.context)
        self.head_prior = head_bytes_layers(spec)
        for h in sample.hops:
            e = entries[h.node_id]
            layers = shard_layer_units(spec, e.start, e.end, head_layers=0.0)
            if layers <= 0:
                continue
            key = (h.node_id, bucket)
            # its residence: the run, and the wait for it (a node short of CPU waits to run)
            if sample.rows != 1:  # the head runs on one row of a prompt's: left out
                self.prefill[key].add(now, h.residence_s / sample.rows / layers)
            elif e.end == spec.n_layers:
                self.head[(*key, round(layers, 2))].add(now, h.residence_s)
            else:
                self.decode[(*key, round(layers, 2))].add(now, h.residence_s / layers)
        if sample.rows != 1:
            return
        self.load = bucket
        if running != 1:  # the links and the token: one stream's
            return
        if token is None:
            token = split_token(sample, now)
        for (a, b), s in token.links.items():  # the coordinator's own too (its ends of the ring)
            self.links[(a, b)].add(now, s)
        # a token the last node handed on passed none of the coordinator's links or time (its way
        # back is the last->first link, above): the coordinator's figures are those of the steps it
        # sends, and the share of tokens handed on is measured beside them (scheduler/context.py's
        # way_back weighs the two ways by it)
        self.handed.add(now, 1.0 if sample.handed else 0.0)
        if sample.handed and len(sample.hops) == 1:  # one node handed the token to itself: no link holds that way
            self.handoff[sample.hops[0].node_id].add(now, max(0.0, sample.round_trip_s - sample.hops[0].residence_s))
        if not sample.handed:
            self.coordinator.add(now, token.coordinator_s)
        if self.token_version != sample.plan_version:
            self.token, self.token_version = _Series(), sample.plan_version
        self.token.add(now, token.total_s)
        self.act_bytes = act_bytes

    @_locked
    def measurements(self, hosts: Mapping[str, str] | None = None) -> Measurements:
        """The figures, every load bucket's, and each node's at the latest decode step's load.
        ``hosts``: each node's host, where known (a node measured only with the head is timed
        against its host's other nodes: :func:`_head_layers`)."""
        now = self.clock()
        plain: Points = defaultdict(list)
        for (nid, bucket, units), s in self.decode.items():
            if (got := s.mean(now)) is not None:
                plain[(nid, bucket)].append((units, got[0], got[1]))
        heads: Points = defaultdict(list)
        for (nid, bucket, units), s in self.head.items():
            if (got := s.mean(now)) is not None:
                heads[(nid, bucket)].append((units, got[0], got[1]))
        head_layers = _head_layers(plain, heads, self.quota, hosts)
        by_load: dict[str, dict[Bucket, NodeMeasure]] = defaultdict(dict)
        for key in {*plain, *heads}:
            nid, bucket = key
            # else another node's head in layers (a ratio, whatever that node's speed), else its bytes'
            h = head_layers.get(key, _median(v for (_, b), v in head_layers.items() if b == bucket))
            head = h if h is not None else self.head_prior
            points = plain.get(key, []) + [(u, r / (u + head), n) for u, r, n in heads.get(key, ())]
            _, rate, n = max(points, key=lambda p: p[2])  # the most measured shard's
            pre = self.prefill[key].mean(now, 1) if key in self.prefill else None
            by_load[nid][bucket] = NodeMeasure(rate, pre[0] if pre else None, n, h, _by_layers(points))
        links = {}
        for link, series in self.links.items():
            got = series.mean(now)
            if got is not None:
                links[link] = LinkMeasure(got[0], float(self.act_bytes), got[1], self._bandwidth(link, got[0], now))
        coord = self.coordinator.mean(now)
        cpu = {nid: got[0] for nid, s in self.cpu.items() if (got := s.mean(now, CPU_SAMPLES)) is not None}
        handed = self.handed.mean(now)
        handoff = {nid: got[0] for nid, s in self.handoff.items() if (got := s.mean(now)) is not None}
        held = {nid: self.layers[nid] for nid in self.held if nid in self.layers}
        return Measurements({}, links, coord[0] if coord else None, dict(by_load), cpu,
                            handed[0] if handed else None, handoff, held).at(*self.load)

    def _bandwidth(self, link: tuple[str, str], mean_s: float, now: float) -> float | None:
        """``link``'s bandwidth fitted from its hops on steps of many rows (of the last
        :data:`KEEP_S`) against its decode hops (the window's, else their kept mean)."""
        sized = self.sized.get(link)
        while sized and sized[0][0] < now - KEEP_S:
            sized.popleft()
        if not sized:
            return None
        small = [(float(self.act_bytes), v) for _, v in self.links[link].items] or [(float(self.act_bytes), mean_s)]
        return fit_link(small, ((n, s) for _, n, s in sized))

    @_locked
    def measured_tok_per_s(self, plan_version: int | None) -> tuple[float, int] | None:
        """One stream's measured tokens/s on plan ``plan_version`` over the window, and the tokens
        it is measured on (None before :data:`MIN_SAMPLES` of them)."""
        if plan_version is None or plan_version != self.token_version:
            return None
        while self.token.items and self.token.items[0][0] < self.clock() - WINDOW_S:
            self.token.items.popleft()
        items = self.token.items
        if len(items) < MIN_SAMPLES:
            return None
        mean = sum(v for _, v in items) / len(items)
        return (1.0 / mean if mean > 0 else 0.0), len(items)
