"""What the coordinator's parts share: its state, and the methods one part calls on another.

:class:`~exo_tui.cluster.coordinator.Coordinator` is made of parts (:class:`Membership`,
:class:`PlanSwitching`, :class:`OperatorActions`, :class:`Snapshots`), each a base class of it and
each a subclass of :class:`CoordinatorParts`. The attributes below are declared here and set in
``Coordinator.__init__``; the methods under ``TYPE_CHECKING`` are defined by one part (or the
coordinator) and called by others, so the type checker holds every part to the one signature.
Nothing here exists at run time beyond an empty class.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from exo_tui import events as ev
    from exo_tui.cluster.admission import Admission
    from exo_tui.cluster.calibrate import Calibrator
    from exo_tui.cluster.drafting import ClusterDraft
    from exo_tui.cluster.joining import JoinEndpoint
    from exo_tui.cluster.local_nodes import LocalNode
    from exo_tui.cluster.metrics import ClusterMetrics
    from exo_tui.cluster.model_choices import SpecCache
    from exo_tui.cluster.node_handle import NodeHandle
    from exo_tui.cluster.pipeline import RemotePipeline
    from exo_tui.cluster.room import RoomNotes
    from exo_tui.cluster.store import StateStore
    from exo_tui.cluster.view import Command, HostView, PlanPreview
    from exo_tui.config import Config
    from exo_tui.discovery.service import Discovery
    from exo_tui.inference.request import Request
    from exo_tui.models.model import Model
    from exo_tui.net.connection import Connection
    from exo_tui.net.messages import Loaded
    from exo_tui.net.protocol import PlanEntry, RingPlan
    from exo_tui.net.security import Security
    from exo_tui.scheduler.calibration import FollowState, Measurements
    from exo_tui.scheduler.diff import ChangePreview
    from exo_tui.scheduler.plan import Constraints, Pin, Plan
    from exo_tui.scheduler.profile import DeviceProfile
    from exo_tui.scheduler.spec import ModelSpec


class CoordinatorParts:
    """The coordinator's state, as every part of it sees it."""

    # settings and what it was asked to run
    config: Config
    model_name: str | None
    peers: list[str]
    local_count: int
    local_backends: list[str]
    local_memory_limits_gb: list[float]
    readonly: bool
    strategy: str | None
    weights_mode: str
    home: Path
    # the cluster
    events: ev.EventBus
    nodes: dict[str, NodeHandle]
    hosts: dict[str, HostView]
    model: Model | None
    spec: ModelSpec | None
    plan: Plan | None
    ring: RingPlan | None
    pins: dict[str, Pin]
    drained: set[str]
    retry_limit: int
    pipeline: RemotePipeline
    draft: ClusterDraft | None  # a draft model (--draft)
    admission: Admission
    metrics: ClusterMetrics
    security: Security | None
    store: StateStore | None
    discover: bool
    discovery: Discovery | None
    discovered: dict[str, ev.NodeDiscovered]
    join: bool
    joining: JoinEndpoint | None
    _local: list[LocalNode]
    _plan_ready: asyncio.Event
    _plan_lock: asyncio.Lock
    _serve_error: str
    _replan_task: asyncio.Task[None] | None
    _tasks: list[asyncio.Task[Any]]
    _stopping: bool
    _version: int
    _active: dict[str, Request]
    _inflight_steps: int
    _idle: asyncio.Event
    _last_update: float
    _last_rebalance_s: float | None
    _tok_times: list[float]
    _specs: SpecCache
    _model_key: str
    room_notes: RoomNotes
    calibrator: Calibrator
    _remeasured: tuple[int, float] | None
    _follow_state: FollowState
    _gap_noted: tuple[int, float] | None
    term: int  # the Raft term this coordinator leads in; 0: a single coordinator
    coordinator_set: Any  # its CoordinatorSet when it leads one (exo_tui.cluster.consensus); else None

    if TYPE_CHECKING:
        # Membership
        async def add_node(self, host: str, port: int) -> NodeHandle: ...
        def connection(self, node_id: str) -> Connection: ...
        def node_name(self, node_id: str) -> str: ...
        def _fail_node(self, node_id: str, reason: str) -> None: ...
        def _schedule_replan(self, reason: str) -> asyncio.Task[None]: ...
        async def _after_membership_change(self, reason: str) -> None: ...

        # PlanSwitching
        def constraints(self, *, drained: set[str] | None = None, pins: dict[str, Pin] | None = None) -> Constraints: ...
        def device_profiles(self, spec: ModelSpec | None = None, limit_bytes: int | None = None, *,
                            measured: bool = True) -> list[DeviceProfile]: ...
        def _node_backend(self, h: NodeHandle) -> str: ...
        def measured(self) -> Measurements: ...
        def _preview(self, constraints: Constraints, profiles: list[DeviceProfile] | None = None) -> ChangePreview: ...
        def _cannot_serve(self, why: str) -> None: ...
        def _ring_for(self, plan: Plan, model_key: str | None = None) -> RingPlan: ...
        async def _load_shard(self, entry: PlanEntry, model: Model, key: str) -> Loaded: ...
        def _refresh_states(self) -> None: ...
        def _even_preview(self, constraints: Constraints, *, spec: ModelSpec | None = None,
                          current: Plan | None | Literal[True] = True,
                          profiles: list[DeviceProfile] | None = None) -> ChangePreview: ...
        async def replan(self, reason: str, *, move_kv: bool = True, unload_later: bool = False) -> Plan: ...
        async def _switch(self, new: Plan, reason: str, *, move_kv: bool = True, unload_later: bool = False) -> None: ...

        # OperatorActions
        async def preview(self, command: Command) -> PlanPreview: ...
        async def apply(self, preview: PlanPreview) -> PlanPreview: ...
        async def _replace_model(self, model: Model, name: str, spec: ModelSpec, key: str) -> None: ...

        # Snapshots
        def _touch(self) -> None: ...
        def _notice(self, level: str, message: str) -> None: ...

        # Following
        def remeasured_tok_per_s(self) -> float | None: ...

        # the Coordinator
        def served_context_of(self, model: Model) -> int: ...
        def _save_constraints(self) -> None: ...
