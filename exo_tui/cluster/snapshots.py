"""Snapshots: the cluster as the front ends see it (:class:`~exo_tui.cluster.view.ClusterSnapshot`),
the operator's view of a plan and of a change, and the notices and state-file errors they show.

A part of :class:`~exo_tui.cluster.coordinator.Coordinator`, which holds the state it reads.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from exo_tui import events as ev
from exo_tui.cluster.figures import ClusterFigures
from exo_tui.cluster.metrics import node_memory
from exo_tui.cluster.parts import CoordinatorParts
from exo_tui.cluster.view import (
    Action,
    ClusterSnapshot,
    CoordinatorView,
    LayerMove,
    LinkView,
    NodeView,
    PlanPreview,
    PlanView,
    QueueView,
    ShardView,
)
from exo_tui.scheduler.diff import ChangePreview
from exo_tui.scheduler.plan import Pin, Plan, PlanShard, Predictions
from exo_tui.scheduler.score import score_nodes

if TYPE_CHECKING:
    from collections.abc import Iterable

    from exo_tui.cluster.node_handle import NodeHandle
    from exo_tui.scheduler.spec import ModelSpec

log = logging.getLogger("exo_tui.cluster")


class Snapshots(CoordinatorParts):
    """The cluster as the front ends see it (a part of the Coordinator)."""

    # ================================================================== views

    def _touch(self) -> None:
        self._last_update = time.time()

    def _state_write_error(self, message: str | None) -> None:
        if message is not None:
            self._notice("error", message)
        else:
            self._notice("info", f"the coordinator's state is saved again in {self.home / 'state.db'}")

    def _notice(self, level: str, message: str) -> None:
        log.log(logging.ERROR if level == "error" else logging.INFO, message)
        self.events.publish(ev.Notice(level=level, message=message))

    def tok_per_s(self, window_s: float = 5.0) -> float:
        now = time.monotonic()
        self._tok_times = [t for t in self._tok_times if now - t <= window_s]
        return len(self._tok_times) / window_s

    def snapshot(self) -> ClusterSnapshot:
        now = time.monotonic()
        profiles = self.device_profiles()
        scores = score_nodes(profiles, self.spec, self.config.scheduler, now) if self.spec is not None and profiles else {}
        startup = {p.node_id: p.layer_s(self.spec) for p in self.device_profiles(measured=False)} if self.spec is not None else {}
        measured = self.measured().nodes
        nodes = []
        for h in self.nodes.values():
            s = scores.get(h.node_id)
            shard = self.plan.shard_of(h.node_id) if self.plan is not None else None
            pin = self.pins.get(h.node_id)
            used, total = node_memory(h)
            nodes.append(
                NodeView(
                    node_id=h.node_id, name=h.name, address=h.host, port=h.port, state=h.state,
                    backend=self._node_backend(h), backends=tuple(h.profile.backends),
                    memory_total_bytes=total, memory_used_bytes=used,
                    cpu_percent=float(h.metrics.get("cpu_percent", 0.0)),
                    score=s.score if s else None, eligible=bool(s and s.eligible) and h.state != "failed",
                    ineligible_reason=(h.reason if h.state == "failed" else (s.reason if s else "")),
                    score_breakdown=dict(s.weighted_parts) if s else {}, weights=dict(s.weights) if s else {},
                    layers=(shard.start, shard.end) if shard else None,
                    pinned=(pin.start, pin.end) if pin else None,
                    drained=h.node_id in self.drained,
                    tok_per_s=h.tok_per_s,
                    heartbeat_age_s=None if h.state == "failed" else h.heartbeat_age_s(now),
                    profile=h.profile.to_dict(),
                    history={k: tuple(v) for k, v in h.history.items()},
                    kv={k: int(v) for k, v in (h.metrics.get("kv") or {}).items()},
                    layer_s_startup=startup.get(h.node_id),
                    layer_s_measured=measured[h.node_id].decode_s_per_layer if h.node_id in measured else None,
                )
            )
        for d in self.discovered.values():
            if d.node_id in self.nodes:
                continue
            nodes.append(NodeView(
                node_id=d.node_id, name=d.name, address=d.address, port=d.port,
                state="foreign" if d.foreign else "discovered", backends=tuple(d.backends),
                memory_total_bytes=d.memory_bytes, eligible=False,
                ineligible_reason="does not hold this cluster's key: bootstrap it over SSH or join it with a token"
                if d.foreign else "joining",
            ))
        links = []
        if self.ring is not None and len(self.ring.ring) > 1:
            ring = self.ring.ring
            for a, b in zip(ring, ring[1:] + ring[:1], strict=True):
                ha, hb = self.nodes.get(a.node_id), self.nodes.get(b.node_id)
                ok = bool(ha and hb and ha.state != "failed" and hb.state != "failed")
                lat = ha.links.get(b.node_id) if ha else None
                links.append(LinkView(a.node_id, b.node_id, lat * 1000 if lat is not None else None, ok))
        return ClusterSnapshot(
            name=self.config.cluster.name,
            model=self.model.name if self.model else (self.model_name or ""),
            nodes=tuple(nodes),
            links=tuple(links),
            plan=_plan_view(self.plan, self.pins, self.spec,
                            _reported_precisions(self.nodes.values(), self.ring.model if self.ring else ""),
                            self.draft.describe() if self.draft is not None else "")
            if self.plan else None,
            hosts=tuple(self.hosts.values()),
            tok_per_s=self.tok_per_s(),
            updated_at=self._last_update,
            readonly=self.readonly,
            sampling=dict(self.model.sampling) if self.model else {},
            metrics=self.figures(),
            queue=QueueView(**self.admission.stats().to_dict()),
            coordinators=tuple(CoordinatorView(**s.to_dict()) for s in self.coordinator_set.status())
            if self.coordinator_set is not None else (),
        )


# ====================================================================== helpers

    def figures(self) -> ClusterFigures:
        """The measured figures (exo_tui/cluster/metrics.py) beside the plan's prediction."""
        self.metrics.set_queued(self.admission.stats().queued)
        pred = self.plan.predictions if self.plan is not None else None
        figures = self.metrics.figures(self.nodes.values(), ring=self.ring,
                                       plan_version=self.ring.version if self.ring else None,
                                       predicted_tok_per_s=pred.tok_per_s_single if pred else None)
        return dataclasses.replace(figures, remeasured_tok_per_s=self.remeasured_tok_per_s())


def _shard_view(s: PlanShard, pins: dict[str, Pin], spec: ModelSpec | None, pred: Predictions | None,
                precision: str = "") -> ShardView:
    """A shard with its bytes: its weights as its backend holds them (quantized) and, from the
    plan's prediction, what it needs on its node with its caches beside what that node offers;
    and the math its node reports running it at."""
    node = pred.node(s.node_id) if pred is not None else None
    return ShardView(s.node_id, s.start, s.end, pinned=s.node_id in pins,
                     weight_bytes=int(spec.range_bytes(s.start, s.end, 0, s.backend or None)) if spec is not None else 0,
                     memory_bytes=node.memory_bytes if node else 0, usable_bytes=node.usable_bytes if node else 0,
                     experts=spec.experts if spec is not None else (0, 0), precision=precision)


def _reported_precisions(handles: Iterable[NodeHandle], model: str) -> dict[tuple[str, int, int], str]:
    """What each node says it runs each of its shards of ``model`` at, by (node, start, end)."""
    out = {}
    for h in handles:
        for sh in h.shards:
            if sh.get("precision") and (not model or sh.get("model", model) == model):
                out[(h.node_id, int(sh["start"]), int(sh["end"]))] = str(sh["precision"])
    return out


def _plan_view(plan: Plan, pins: dict[str, Pin], spec: ModelSpec | None,
               precisions: dict[tuple[str, int, int], str] | None = None, draft: str = "") -> PlanView:
    pred = plan.predictions
    held = precisions or {}
    return PlanView(
        version=plan.version,
        n_layers=plan.n_layers,
        shards=tuple(_shard_view(s, pins, spec, pred, held.get((s.node_id, s.start, s.end), "")) for s in plan.shards),
        strategy=plan.strategy,
        predicted_tok_per_s=pred.tok_per_s_single if pred else 0.0,
        predicted_ttft_s=pred.ttft_s if pred else 0.0,
        predicted_ttft_prompt_tokens=pred.prompt_tokens if pred else 0,
        reasons=plan.reasons,
        context_length=spec.context_length if spec is not None else 0,
        draft=draft,
    )


def _to_view_preview(action: Action, ids: tuple[str, ...], change: ChangePreview, c: CoordinatorParts, note: str,
                     spec: ModelSpec | None = None) -> PlanPreview:
    """The operator's view of ``change``; ``spec``: the model its new plan is for (another model's,
    when it previews a switch), else the one served."""
    moves = tuple(LayerMove(m.start, m.end, m.src, m.dst, m.nbytes) for m in (change.diff.moves if change.diff else ()))
    notes = [n for n in (note, *change.notes) if n]
    return PlanPreview(
        action=action,
        targets=ids,
        moves=moves,
        bytes_moved=change.bytes_moved,
        tok_per_s_before=change.tok_per_s_before,
        tok_per_s_after=change.tok_per_s_after,
        new_plan=_plan_view(change.new_plan, c.pins, spec if spec is not None else c.spec) if change.new_plan else None,
        error=change.error,
        note="; ".join(notes),
    )
