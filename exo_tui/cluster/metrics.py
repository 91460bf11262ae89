"""What the coordinator measures of the cluster as it runs: sliding windows and running totals.

Nothing here is predicted. The coordinator feeds :class:`ClusterMetrics` from where the data
already flows:

* :meth:`~ClusterMetrics.started`, :meth:`~ClusterMetrics.token`, :meth:`~ClusterMetrics.ended`
  from its generation loop (time to first token, inter-token latency, tokens/s, running requests);
* :meth:`~ClusterMetrics.follow` reads the event bus: request outcomes (``RequestDone``), plan
  changes;
* :meth:`~ClusterMetrics.step` gets every step's :class:`StepSample` from the pipeline: the hops'
  own timing that came back with the token (:mod:`exo_tui.net.timing`), the round trip and the
  coordinator's time since the request's previous token;
* :meth:`~ClusterMetrics.link_probed` the link probes' round trips and failures;
* :meth:`~ClusterMetrics.set_queued` and :meth:`~ClusterMetrics.queue_wait`: the one place the
  admission queue reports to (``queued`` stays 0 until there is one; a request's wait is counted
  from its creation to the start of its generation). A request it refuses counts as ``rejected``
  when its ``RequestDone`` says ``finish_reason="rejected"`` (or by :meth:`~ClusterMetrics.outcome`).

:meth:`~ClusterMetrics.figures` turns them, with the nodes' heartbeats, into the snapshot's
:class:`~exo_tui.cluster.figures.ClusterFigures`; the running totals and histograms feed the API's
``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from exo_tui import events as ev
from exo_tui.cluster.figures import ClusterFigures, LinkFigures, NodeFigures
from exo_tui.cluster.node_handle import held_bytes
from exo_tui.net.timing import HopTiming
from exo_tui.scheduler.calibration import COORDINATOR as COORDINATOR  # a link's coordinator end

WINDOW_S = 60.0  # percentiles, means and outcome counts are over this window
TOK_RATE_S = 5.0  # tokens/s over this window (the header's figure too)
SERIES_LEN = 300  # the sparklines' samples, one a second: five minutes
PROBES_KEPT = 10  # a link's loss is over its last probes
# At most this many samples a window keeps (the newest): figures are made at every snapshot, and
# many streams make thousands of tokens a minute.
WINDOW_MAX = 2048
RING_MAX = 1024
# Histogram buckets (seconds), upper bounds; Prometheus adds +Inf.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)
OUTCOMES = {"stop": "completed", "length": "completed", "error": "failed", "cancelled": "cancelled",
            "rejected": "rejected"}


class Window:
    """Values with their times, kept for ``horizon_s``."""

    def __init__(self, horizon_s: float = WINDOW_S) -> None:
        self.horizon_s = horizon_s
        self._items: deque[tuple[float, float]] = deque(maxlen=WINDOW_MAX)

    def add(self, value: float, now: float) -> None:
        self._items.append((now, value))
        self._prune(now)

    def _prune(self, now: float) -> None:
        items, edge = self._items, now - self.horizon_s
        while items and items[0][0] < edge:
            items.popleft()

    def values(self, now: float) -> list[float]:
        self._prune(now)
        return [v for _, v in self._items]

    def percentile(self, q: float, now: float) -> float | None:
        values = self.values(now)
        return float(np.percentile(values, q)) if values else None

    def mean(self, now: float) -> float | None:
        values = self.values(now)
        return float(np.mean(values)) if values else None

    def count(self, now: float) -> int:
        self._prune(now)
        return len(self._items)


class Histogram:
    """A cumulative histogram (what Prometheus scrapes): counts per upper bound, sum and count."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def cumulative(self) -> list[tuple[str, int]]:
        return [(repr(b), c) for b, c in zip(self.buckets, self.counts, strict=True)] + [("+Inf", self.count)]


@dataclass(frozen=True)
class StepSample:
    """One step of one request around the ring, as the coordinator saw it."""

    request_id: str
    plan_version: int
    rows: int  # positions computed: 1 for a decode step
    sent_wall: float
    recv_wall: float
    round_trip_s: float  # the step's send to its token (the coordinator's clock)
    coordinator_s: float | None  # the request's previous token to this step's send
    hops: tuple[HopTiming, ...]
    context: int = 0  # positions the request's caches hold once the step has run
    # started by the ring's last hop (the hand-off): sent when that hop handed the token on (its
    # clock), round trip from the previous token's coming; no link to the coordinator on its way
    handed: bool = False


@dataclass
class TokenSplit:
    """A decode token's time, split: compute and queue per node, each link, the coordinator."""

    ts: float
    plan_version: int
    total_s: float
    coordinator_s: float
    compute: dict[str, float]
    queue: dict[str, float]
    links: dict[tuple[str, str], float]



def split_token(sample: StepSample, ts: float) -> TokenSplit:
    """The communication is what the round trip leaves after the nodes' residences (each on its
    own clock, exact); the wall times at the hops' ends split it between the links (hosts'
    clocks may be offset: a negative estimate counts as none)."""
    hops = sample.hops
    comm = max(0.0, sample.round_trip_s - sum(h.residence_s for h in hops))
    ends = [(hops[-1].node_id if sample.handed else COORDINATOR, hops[0].node_id, hops[0].in_wall - sample.sent_wall)]
    ends += [(a.node_id, b.node_id, b.in_wall - a.out_wall) for a, b in zip(hops, hops[1:], strict=False)]
    if not sample.handed:
        ends.append((hops[-1].node_id, COORDINATOR, sample.recv_wall - hops[-1].out_wall))
    raw = [max(0.0, x) for _, _, x in ends]
    total_raw = sum(raw)
    shares = [r / total_raw for r in raw] if total_raw > 0 else [1.0 / len(raw)] * len(raw)
    links: dict[tuple[str, str], float] = {}
    compute: dict[str, float] = defaultdict(float)
    queue: dict[str, float] = defaultdict(float)
    for (a, b, _), share in zip(ends, shares, strict=True):
        if a == b:  # a one-node ring's hand-off: no link, the step waited on that node
            queue[a] += comm * share
        else:
            links[(a, b)] = links.get((a, b), 0.0) + comm * share
    for h in hops:
        compute[h.node_id] += h.compute_s
        queue[h.node_id] += h.queue_s
    coord = sample.coordinator_s or 0.0
    return TokenSplit(ts, sample.plan_version, sample.round_trip_s + coord, coord, dict(compute), dict(queue), links)


class ClusterMetrics:
    def __init__(self, *, clock: Any = time.monotonic, window_s: float = WINDOW_S) -> None:
        self.clock = clock
        self.window_s = window_s
        self.ttft = Window(window_s)
        self.itl = Window(window_s)
        self.wait = Window(window_s)
        self.tokens = Window(TOK_RATE_S)
        self.outcomes: dict[str, Window] = {o: Window(window_s) for o in ("completed", "failed", "cancelled", "rejected")}
        self.ring: deque[TokenSplit] = deque(maxlen=RING_MAX)
        # running totals (Prometheus)
        self.ttft_hist = Histogram(TTFT_BUCKETS)
        self.itl_hist = Histogram(ITL_BUCKETS)
        self.wait_hist = Histogram(WAIT_BUCKETS)
        self.tokens_total = 0
        self.prompt_tokens_total = 0
        self.outcomes_total: Counter[str] = Counter()
        self.node_compute_total: defaultdict[str, float] = defaultdict(float)  # node id -> seconds of decode compute
        self.node_steps_total: Counter[str] = Counter()  # node id -> decode steps
        self.link_total: defaultdict[tuple[str, str], float] = defaultdict(float)  # link -> seconds of tokens on it
        self.coordinator_total_s = 0.0
        self.plan_changes_total = 0
        self.queued = 0
        self.probes: dict[tuple[str, str], deque[float | None]] = {}
        self.series: dict[str, deque[float]] = {k: deque(maxlen=SERIES_LEN) for k in ("tok_per_s", "ttft_s", "queue_depth")}
        self.drafted = Window(window_s)  # speculative decoding: each ended request's drafted tokens ...
        self.accepted = Window(window_s)  # ... and of them those kept
        self._running: dict[str, float] = {}  # request id -> its last token's time (or its start)
        self._first: set[str] = set()  # requests that have their first token

    # ------------------------------------------------------------------ requests

    def started(self, request: Any) -> None:
        now = self.clock()
        self._running[request.id] = now
        self.prompt_tokens_total += len(request.prompt_ids)
        self.queue_wait(max(0.0, now - request.created_s))

    def token(self, request: Any) -> None:
        now = self.clock()
        self.tokens_total += 1
        self.tokens.add(1.0, now)
        if request.id not in self._first:
            self._first.add(request.id)
            ttft = request.ttft_s if request.first_token_s is not None else max(0.0, now - request.created_s)
            self.ttft.add(ttft, now)
            self.ttft_hist.observe(ttft)
        else:
            gap = now - self._running.get(request.id, now)
            self.itl.add(gap, now)
            self.itl_hist.observe(gap)
        self._running[request.id] = now

    def has_first_token(self, request_id: str) -> bool:
        """Whether a running request has its first token (its steps of several rows after it are
        speculative verify steps, not its prompt's)."""
        return request_id in self._first

    def ended(self, request: Any) -> None:
        self._running.pop(request.id, None)
        self._first.discard(request.id)
        spec = getattr(request, "speculation", None)
        if spec is not None and spec.stats.drafted:
            now = self.clock()
            self.drafted.add(spec.stats.drafted, now)
            self.accepted.add(spec.stats.accepted, now)

    def outcome(self, finish_reason: str) -> None:
        name = OUTCOMES.get(finish_reason, "failed")
        self.outcomes_total[name] += 1
        self.outcomes[name].add(1.0, self.clock())

    def set_queued(self, n: int) -> None:
        """Requests waiting for admission now (the admission queue sets it)."""
        self.queued = max(0, int(n))

    def queue_wait(self, seconds: float) -> None:
        """A request's wait from its arrival to the start of its generation."""
        self.wait.add(seconds, self.clock())
        self.wait_hist.observe(seconds)

    @property
    def running(self) -> int:
        return len(self._running)

    async def follow(self, bus: ev.EventBus) -> None:
        """Take outcomes and plan changes from the bus, and sample the sparklines once a second."""
        with bus.subscribe(kinds=(ev.RequestDone, ev.PlanChanged)) as sub:
            next_tick = self.clock()
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, next_tick - self.clock())):
                        event = await sub.get()
                        if isinstance(event, ev.RequestDone):
                            self.outcome(event.finish_reason)
                        elif isinstance(event, ev.PlanChanged):
                            self.plan_changes_total += 1
                        continue
                self.tick()
                next_tick = self.clock() + 1.0

    def tick(self) -> None:
        now = self.clock()
        self.series["tok_per_s"].append(self.tokens.count(now) / TOK_RATE_S)
        self.series["ttft_s"].append(self.ttft.percentile(50, now) or 0.0)
        self.series["queue_depth"].append(float(self.queued))

    # ------------------------------------------------------------------ the ring

    def step(self, sample: StepSample) -> TokenSplit | None:
        """A step's timing came back with its token (decode steps go into the ring's figures): its
        split (None: not a decode step's)."""
        if sample.rows != 1 or not sample.hops:
            return None
        now = self.clock()
        token = split_token(sample, now)
        self.ring.append(token)
        while self.ring and self.ring[0].ts < now - self.window_s:
            self.ring.popleft()
        for node, s in token.compute.items():
            self.node_compute_total[node] += s
            self.node_steps_total[node] += 1
        for link, s in token.links.items():
            self.link_total[link] += s
        self.coordinator_total_s += token.coordinator_s
        return token

    def link_probed(self, src: str, dst: str, rtt_s: float | None) -> None:
        """A link probe's round trip, or None when it failed."""
        self.probes.setdefault((src, dst), deque(maxlen=PROBES_KEPT)).append(rtt_s)

    def link_probe(self, src: str, dst: str) -> tuple[float | None, float | None]:
        """(the last round trip that came back, the share of recent probes lost)."""
        probes = self.probes.get((src, dst))
        if not probes:
            return None, None
        rtt = next((p for p in reversed(probes) if p is not None), None)
        return rtt, sum(1 for p in probes if p is None) / len(probes)

    # ------------------------------------------------------------------ figures

    def _tokens(self, now: float, plan_version: int | None) -> list[TokenSplit]:
        return [t for t in self.ring if t.ts >= now - self.window_s and (plan_version is None or t.plan_version == plan_version)]

    def balance(self, plan_version: int | None) -> float | None:
        """std/mean of the stages' measured compute times per token on plan ``plan_version``
        (None before two stages were measured): what the rebalance threshold reads."""
        return _balance(_stages(self._tokens(self.clock(), plan_version)))

    def figures(self, nodes: Iterable[Any], *, ring: Any = None, plan_version: int | None = None,
                predicted_tok_per_s: float | None = None) -> ClusterFigures:
        """The figures of the window, with ``nodes`` (the coordinator's node handles) and the
        ring in force (``ring``: its :class:`~exo_tui.net.protocol.RingPlan`)."""
        now = self.clock()
        handles = list(nodes)
        live = [h for h in handles if h.state != "failed"]
        tokens = self._tokens(now, plan_version)
        token_s = _mean([t.total_s for t in tokens])
        stage = _stages(tokens)
        outcomes = {k: w.count(now) for k, w in self.outcomes.items()}
        judged = outcomes["completed"] + outcomes["failed"] + outcomes["rejected"]
        comm = _mean([sum(t.links.values()) / t.total_s for t in tokens if t.total_s > 0])
        vram = [(h.metrics.get("vram_used_bytes"), h.metrics.get("vram_total_bytes")) for h in live]
        vram = [(u, t) for u, t in vram if u is not None and t is not None]
        cpus = [float(h.metrics["cpu_percent"]) for h in live if "cpu_percent" in h.metrics]
        return ClusterFigures(
            window_s=self.window_s,
            memory_used_bytes=sum(node_memory(h)[0] for h in live),
            memory_total_bytes=sum(node_memory(h)[1] for h in live),
            cpu_percent=_mean(cpus),
            vram_used_bytes=sum(u for u, _ in vram) if vram else None,
            vram_total_bytes=sum(t for _, t in vram) if vram else None,
            balance=_balance(stage),
            running=self.running,
            queued=self.queued,
            queue_wait_p50_s=self.wait.percentile(50, now),
            queue_wait_p95_s=self.wait.percentile(95, now),
            ttft_p50_s=self.ttft.percentile(50, now),
            ttft_p95_s=self.ttft.percentile(95, now),
            itl_p50_s=self.itl.percentile(50, now),
            itl_p95_s=self.itl.percentile(95, now),
            tok_per_s=self.tokens.count(now) / TOK_RATE_S,
            success_rate=outcomes["completed"] / judged if judged else None,
            draft_acceptance=_ratio(sum(self.accepted.values(now)), sum(self.drafted.values(now))),
            token_s=token_s,
            coordinator_s=_mean([t.coordinator_s for t in tokens]),
            comm_share=comm,
            measured_tok_per_s=1.0 / token_s if token_s else None,
            predicted_tok_per_s=predicted_tok_per_s,
            plan_version=plan_version,
            nodes=tuple(self._node(h, tokens, stage.get(h.node_id), token_s) for h in handles),
            links=self._links(handles, ring, tokens),
            series={k: tuple(v) for k, v in self.series.items()},
            **outcomes,
        )

    def _node(self, h: Any, tokens: list[TokenSplit], stage_s: float | None, token_s: float | None) -> NodeFigures:
        m = h.metrics if h.state != "failed" else {}
        mine = [t for t in tokens if h.node_id in t.compute]
        share = _mean([t.compute[h.node_id] / t.total_s for t in mine if t.total_s > 0])
        steps, spent = m.get("decode_steps"), m.get("decode_compute_s")
        used, total = node_memory(h) if h.state != "failed" else (None, None)
        return NodeFigures(
            node_id=h.node_id, name=h.name, state=h.state, up=h.state != "failed",
            cpu_percent=_num(m.get("cpu_percent")), memory_used_bytes=used, memory_total_bytes=total,
            vram_used_bytes=m.get("vram_used_bytes"), vram_total_bytes=m.get("vram_total_bytes"),
            temperature_c=_num(m.get("temperature_c")), power_w=_num(m.get("power_w")),
            stage_s=stage_s, queue_s=_mean([t.queue[h.node_id] for t in mine]),
            token_share=share, idle_share=None if share is None else max(0.0, 1.0 - share), steps=len(mine),
            own_stage_s=float(spent) / steps if steps and spent is not None else None,
        )

    def _links(self, handles: list[Any], ring: Any, tokens: list[TokenSplit]) -> tuple[LinkFigures, ...]:
        if ring is None or not ring.ring:
            return ()
        ids = [e.node_id for e in ring.ring]
        pairs = [(COORDINATOR, ids[0]), *zip(ids, ids[1:], strict=False), (ids[-1], COORDINATOR)]
        if len(ids) > 1:  # the ring closes there for the probes (a token goes back by the coordinator)
            pairs.append((ids[-1], ids[0]))
        out = []
        for a, b in pairs:
            rtt, loss = self.link_probe(a, b)
            on_path = any((a, b) in t.links for t in tokens)
            ring_s = _mean([t.links.get((a, b), 0.0) for t in tokens]) if on_path else None
            out.append(LinkFigures(a, b, ring_s, rtt, loss))
        return tuple(out)


def _stages(tokens: list[TokenSplit]) -> dict[str, float]:
    """Each node's mean compute time per token."""
    spent: dict[str, list[float]] = defaultdict(list)
    for t in tokens:
        for node, s in t.compute.items():
            spent[node].append(s)
    return {node: sum(v) / len(v) for node, v in spent.items()}


def _balance(stage: dict[str, float]) -> float | None:
    values = list(stage.values())
    if len(values) < 2 or np.mean(values) <= 0:
        return None
    return float(np.std(values) / np.mean(values))


def node_memory(h: Any) -> tuple[int, int]:
    """(used, total) bytes of a node as the console shows it: where it has a limit, its models'
    memory (its shards' bytes and KV caches) of the limit, which lies above its runtime's own;
    else the machine's memory."""
    total = h.profile.memory_limit_bytes or h.memory_total_bytes
    if h.profile.memory_limit_bytes:
        kv = h.metrics.get("kv") or {}
        used = sum(held_bytes(x) for x in h.shards) + int(kv.get("used_bytes", 0))
    else:
        used = h.memory_total_bytes - int(h.metrics.get("ram_available_bytes", h.profile.ram_available_bytes))
    return used, total


def _mean(values: list[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None
