"""What the ring measures, as the scheduler's figures: each node's seconds per layer, each link's
hop, the coordinator's share of a token (exo_tui/scheduler/calibration.py plans with them).

The pipeline hands every step's timing to :meth:`Calibrator.step` (beside the cluster strip's
:class:`~exo_tui.cluster.metrics.ClusterMetrics`): each hop's residence at its node (the frame's
arrival to its result leaving: the run and the wait for it, on the node's own clock) over the
layers it holds in the ring in force gives its seconds per (mean) layer, a decode step's per
token, a prompt's step's per prompt token. The links and the coordinator take what the round
trip leaves (:func:`~exo_tui.cluster.metrics.split_token`), so the parts add up to the token. Only steps taken while one request runs count: a batch's run
is shared, and its time is not one stream's. The figures are means over the last
:data:`WINDOW_S` seconds, so a node that slows down (other work, a CPU quota, heat, a battery) is
seen within seconds; a node's last figure is kept while it holds no layers (nothing measures it
then) for :data:`KEEP_S`, after which its start-up benchmark counts again.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

from exo_tui.cluster.metrics import COORDINATOR, StepSample, split_token
from exo_tui.scheduler.calibration import LinkMeasure, Measurements, NodeMeasure, shard_layer_units
from exo_tui.scheduler.spec import ModelSpec

WINDOW_S = 10.0  # figures are means over this window
MIN_SAMPLES = 5  # decode tokens a node's figure needs in the window
KEEP_S = 300.0  # a figure no longer measured is kept this long
SAMPLES_MAX = 4096


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


class Calibrator:
    """Measured figures for the scheduler, from the steps' timing."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.decode: dict[str, _Series] = defaultdict(_Series)
        self.prefill: dict[str, _Series] = defaultdict(_Series)
        self.links: dict[tuple[str, str], _Series] = defaultdict(_Series)
        self.coordinator = _Series()
        self.token = _Series()  # a decode token's whole time (the ring and the coordinator)
        self.token_version: int | None = None  # the plan version ``token`` measures
        self.act_bytes = 0  # a decode token's hidden state, the bytes a link's hop carried

    def step(self, sample: StepSample, ring: Any, spec: ModelSpec | None, running: int, act_bytes: int,
             *, answering: bool = False) -> None:
        """One step's timing, taken on ``ring`` (the RingPlan in force) with ``running`` requests;
        ``answering``: the request has its first token (a step of several rows is then a
        speculative verify step: neither a prompt's nor one token's, so not counted)."""
        if spec is None or ring is None or sample.plan_version != ring.version or running != 1 or not sample.hops:
            return
        if answering and sample.rows != 1:
            return
        entries = {e.node_id: e for e in ring.ring}
        if [h.node_id for h in sample.hops] != [e.node_id for e in ring.ring]:
            return
        now = self.clock()
        for h in sample.hops:
            e = entries[h.node_id]
            units = shard_layer_units(spec, e.start, e.end)
            if units <= 0:
                continue
            # its residence: the run, and the wait for it (a node short of CPU waits to run)
            if sample.rows == 1:
                self.decode[h.node_id].add(now, h.residence_s / units)
            else:
                self.prefill[h.node_id].add(now, h.residence_s / sample.rows / units)
        if sample.rows != 1:
            return
        token = split_token(sample, now)
        coordinator = token.coordinator_s
        for (a, b), s in token.links.items():
            if COORDINATOR in (a, b):
                coordinator += s
            else:
                self.links[(a, b)].add(now, s)
        self.coordinator.add(now, coordinator)
        if self.token_version != sample.plan_version:
            self.token, self.token_version = _Series(), sample.plan_version
        self.token.add(now, token.total_s)
        self.act_bytes = act_bytes

    def measurements(self) -> Measurements:
        now = self.clock()
        nodes = {}
        for nid, series in self.decode.items():
            got = series.mean(now)
            if got is None:
                continue
            pre = self.prefill[nid].mean(now, 1) if nid in self.prefill else None
            nodes[nid] = NodeMeasure(got[0], pre[0] if pre else None, got[1])
        links = {}
        for key, series in self.links.items():
            got = series.mean(now)
            if got is not None:
                links[key] = LinkMeasure(got[0], float(self.act_bytes), got[1])
        coord = self.coordinator.mean(now)
        return Measurements(nodes, links, coord[0] if coord else None)

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
