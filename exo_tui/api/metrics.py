"""``GET /metrics``: the coordinator's measured figures in Prometheus' text format.

Every name starts ``exo_tui_``. Counters and histograms are running totals since the coordinator
started (what Prometheus' ``rate()`` and ``histogram_quantile()`` want); gauges are the figures
of the sliding window (:mod:`exo_tui.cluster.metrics`). Labels: ``model`` on the request series,
``node`` (its name) on the per-node ones, ``src``/``dst`` on links. Like every route, it is behind
the API key when one is set (give Prometheus the key as ``authorization: credentials``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from exo_tui.cluster.figures import NodeFigures

P = "exo_tui_"


class ClusterCollector:
    """Reads the coordinator at each scrape (nothing is copied between scrapes)."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        c = self.coordinator
        m = c.metrics
        f = c.figures()
        model = c.model.name if getattr(c, "model", None) is not None else (getattr(c, "model_name", "") or "")
        names = {h.node_id: h.name for h in c.nodes.values()}

        def gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(P + name, doc, labels=list(labels or {"model": model}))
            if value is not None:
                g.add_metric(list((labels or {"model": model}).values()), value)
            return g

        requests = CounterMetricFamily(P + "requests", "requests ended, by outcome", labels=["model", "outcome"])
        for outcome in ("completed", "failed", "cancelled", "rejected"):
            requests.add_metric([model, outcome], m.outcomes_total[outcome])
        yield requests
        tokens = CounterMetricFamily(P + "generation_tokens", "tokens generated", labels=["model"])
        tokens.add_metric([model], m.tokens_total)
        yield tokens
        prompt = CounterMetricFamily(P + "prompt_tokens", "prompt tokens of the requests started", labels=["model"])
        prompt.add_metric([model], m.prompt_tokens_total)
        yield prompt
        for name, doc, hist in (
            ("time_to_first_token_seconds", "a request's start to its first token", m.ttft_hist),
            ("inter_token_latency_seconds", "time between two tokens of a request", m.itl_hist),
            ("queue_wait_seconds", "a request's arrival to the start of its generation", m.wait_hist),
        ):
            h = HistogramMetricFamily(P + name, doc, labels=["model"])
            h.add_metric([model], hist.cumulative(), hist.sum)
            yield h
        yield gauge("requests_running", "requests generating now", m.running)
        yield gauge("requests_queued", "requests waiting for admission now", m.queued)
        yield gauge("tokens_per_second", "tokens generated per second, last seconds", f.tok_per_s)
        yield gauge("success_ratio", "completed / (completed + failed + rejected) in the window", f.success_rate)
        yield gauge("load_balance_coefficient", "std/mean of the stages' measured times (the rebalance reads it)", f.balance)
        yield gauge("token_seconds", "mean time of one decode token around the ring", f.token_s)
        yield gauge("ring_communication_ratio", "share of a token's time on the links", f.comm_share)
        yield gauge("predicted_tokens_per_second", "the plan's prediction of one stream's tokens/s", f.predicted_tok_per_s)
        yield gauge("measured_tokens_per_second", "one stream's tokens/s measured on the plan", f.measured_tok_per_s)
        yield gauge("plan_version", "version of the plan in force", f.plan_version)
        changes = CounterMetricFamily(P + "plan_changes", "plans that came into force")
        changes.add_metric([], m.plan_changes_total)
        yield changes
        coord = CounterMetricFamily(P + "coordinator_seconds", "decode tokens' time in the coordinator, between a token and the next step")
        coord.add_metric([], m.coordinator_total_s)
        yield coord
        yield from _nodes(f, c, m, model)
        yield from _links(f, m, names)


def _nodes(f: Any, c: Any, m: Any, model: str) -> Iterator[Metric]:
    per_node: dict[str, tuple[str, Callable[[NodeFigures], float | None]]] = {
        "node_up": ("1 while the node is a live member", lambda n: 1.0 if n.up else 0.0),
        "node_cpu_percent": ("CPU use", lambda n: n.cpu_percent),
        "node_memory_used_bytes": ("memory in use (with a limit: its models', shards and KV caches)", lambda n: n.memory_used_bytes),
        "node_memory_total_bytes": ("memory offered (its limit, above its runtime's own, where it has one)", lambda n: n.memory_total_bytes),
        "node_vram_used_bytes": ("GPU memory in use", lambda n: n.vram_used_bytes),
        "node_vram_total_bytes": ("GPU memory", lambda n: n.vram_total_bytes),
        "node_temperature_celsius": ("hottest sensor", lambda n: n.temperature_c),
        "node_power_watts": ("power draw", lambda n: n.power_w),
        "node_stage_seconds": ("mean compute time of its layers per decode token, measured", lambda n: n.stage_s),
        "node_queue_seconds": ("mean wait of a step before its run", lambda n: n.queue_s),
        "node_idle_ratio": ("share of a token's time it was not computing", lambda n: n.idle_share),
    }
    for name, (doc, get) in per_node.items():
        g = GaugeMetricFamily(P + name, doc, labels=["node", "node_id"])
        for n in f.nodes:
            value = get(n)
            if value is not None:
                g.add_metric([n.name, n.node_id], float(value))
        yield g
    info = GaugeMetricFamily(P + "node_info", "a node's state and backend (value 1)", labels=["node", "node_id", "state", "backend"])
    for h in c.nodes.values():
        info.add_metric([h.name, h.node_id, h.state, h.profile.backend or ""], 1.0)
    yield info
    failures = CounterMetricFamily(P + "node_failures", "times the node failed", labels=["node", "node_id"])
    steps = CounterMetricFamily(P + "node_decode_steps", "decode steps measured", labels=["node", "node_id", "model"])
    compute = CounterMetricFamily(P + "node_compute_seconds", "decode steps' compute time", labels=["node", "node_id", "model"])
    for h in c.nodes.values():
        failures.add_metric([h.name, h.node_id], h.failures)
        steps.add_metric([h.name, h.node_id, model], m.node_steps_total[h.node_id])
        compute.add_metric([h.name, h.node_id, model], m.node_compute_total[h.node_id])
    yield failures
    yield steps
    yield compute


def _links(f: Any, m: Any, names: dict[str, str]) -> Iterator[Metric]:
    def name(x: str) -> str:
        return names.get(x, x)

    rtt = GaugeMetricFamily(P + "link_rtt_seconds", "the link probes' last round trip", labels=["src", "dst"])
    loss = GaugeMetricFamily(P + "link_loss_ratio", "share of the link's recent probes that failed", labels=["src", "dst"])
    for (a, b), _ in m.probes.items():
        r, lost = m.link_probe(a, b)
        if r is not None:
            rtt.add_metric([name(a), name(b)], r)
        if lost is not None:
            loss.add_metric([name(a), name(b)], lost)
    yield rtt
    yield loss
    ring = CounterMetricFamily(P + "link_seconds", "decode tokens' time on each link of the ring", labels=["src", "dst"])
    for (a, b), s in m.link_total.items():
        ring.add_metric([name(a), name(b)], s)
    yield ring


def add_metrics_route(app: FastAPI, coordinator: Any) -> None:
    """``GET /metrics`` on ``app`` (behind its API key, like the other routes)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(coordinator))

    @app.get("/metrics", tags=["cluster"], response_class=Response,
             description="the cluster's measured figures in Prometheus' text format (names prefixed exo_tui_)")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
