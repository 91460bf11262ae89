"""The coordinator: owns the cluster state and the plan, drives generation, survives failures.

It is embedded in the console by default and headless with ``exo-tui serve``; either way front
ends see it only through :class:`~exo_tui.cluster.view.ClusterControl` and its event bus.

Plan changes (drain, undrain, pin, unpin, rebalance, a node joining or failing) all go through
:meth:`Coordinator._switch`: the new shards are loaded while the old plan keeps serving; then, at
a token boundary (no step in flight), every in-flight request's KV cache is moved to its new home
(exported and imported, across backends too) — or, where that is impossible, left to be rebuilt
from the request's token history; the new plan comes into force; old shards are unloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from backends import default_backend_name
from backends.base import KVCache
from exo_tui import events as ev
from exo_tui.cluster.admission import (
    CAPACITY_WAIT_S,
    Admission,
    AdmittedRunner,
    ring_kv_capacity,
    wait_for_plan,
    with_queue_notes,
)
from exo_tui.cluster.local_nodes import LocalNode, spawn_node, stop_node, wait_ready
from exo_tui.cluster.node_handle import NodeHandle
from exo_tui.cluster.pipeline import RemotePipeline, StepFailure
from exo_tui.cluster.store import StateStore
from exo_tui.cluster.view import (
    ChatChunk,
    ChatParams,
    ClusterSnapshot,
    HostView,
    LayerMove,
    LinkView,
    NodeView,
    PlanPreview,
    PlanView,
    QueueView,
    ShardView,
)
from exo_tui.cluster.weights import load_from_path, stream_shard
from exo_tui.config import GB, Config, load_config
from exo_tui.inference.generate import GenerationError, generate
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import TokenLogprobs, scores_from_array
from exo_tui.models.model import Model
from exo_tui.models.spec import spec_from_gguf
from exo_tui.net.address import is_loopback, split_host_port
from exo_tui.net.errors import ConnectError, RemoteError
from exo_tui.net.frame import Frame
from exo_tui.net.protocol import PlanEntry, RingPlan, kv_from_array, kv_to_array
from exo_tui.net.rpc import Connection, connect
from exo_tui.net.security import Security, ensure_cluster, write_node_bundle
from exo_tui.node.profile import BENCH_CONFIG, NodeProfile
from exo_tui.paths import exo_home
from exo_tui.scheduler.diff import ChangePreview, plan_diff, preview_change, should_rebalance
from exo_tui.scheduler.even import even_plan
from exo_tui.scheduler.partition import InfeasiblePlan
from exo_tui.scheduler.plan import Constraints, Pin, Plan
from exo_tui.scheduler.profile import DeviceProfile, Link
from exo_tui.scheduler.score import score_nodes

log = logging.getLogger("exo_tui.cluster")

# Bytes of one benchmark layer (Q4_1 blocks of SmolLM2-135M's shape): node timings scale from it.
_BENCH_PARAMS = (
    2 * BENCH_CONFIG.hidden_size * BENCH_CONFIG.n_heads * BENCH_CONFIG.head_dim
    + 2 * BENCH_CONFIG.hidden_size * BENCH_CONFIG.n_kv_heads * BENCH_CONFIG.head_dim
    + 3 * BENCH_CONFIG.hidden_size * BENCH_CONFIG.intermediate_size
)
BENCH_LAYER_BYTES = _BENCH_PARAMS * 20 // 32
MONITOR_INTERVAL_S = 0.25
RECONNECT_INTERVAL_S = 2.0
LINK_PROBE_INTERVAL_S = 10.0


class Coordinator:
    """The cluster's brain. Implements :class:`~exo_tui.cluster.view.ClusterControl`."""

    def __init__(
        self,
        *,
        model: str | None = None,
        config: Config | None = None,
        peers: list[str] | tuple[str, ...] = (),
        local_nodes: int = 0,
        local_backends: list[str] | None = None,
        local_memory_limits_gb: list[float] | None = None,
        readonly: bool = False,
        strategy: str | None = None,
        weights: str = "auto",  # auto | stream | path
        home: Path | None = None,
        persist: bool = True,
        discover: bool = False,
    ) -> None:
        self.config = config or load_config()
        self.model_name = model
        self.peers = list(peers)
        self.local_count = local_nodes
        self.local_backends = local_backends or []
        self.local_memory_limits_gb = local_memory_limits_gb or []
        self.readonly = readonly
        self.strategy = strategy
        self.weights_mode = weights
        self.home = home or exo_home()
        self.events = ev.EventBus()
        self.nodes: dict[str, NodeHandle] = {}
        self.hosts: dict[str, HostView] = {}
        self.model: Model | None = None
        self.spec: Any = None
        self.plan: Plan | None = None
        self.ring: RingPlan | None = None
        self.pins: dict[str, Pin] = {}
        self.drained: set[str] = set()
        self.retry_limit = self.config.scheduler.fault_tolerance.task_retry_limit
        self.pipeline = RemotePipeline(self)
        adm = self.config.admission
        self.admission = Admission(lambda: ring_kv_capacity(self.ring, self.nodes), queue_bound=adm.queue_bound,
                                   kv_share=adm.kv_share, kept=self.pipeline.kept_positions,
                                   forget_kept=self.pipeline.forget_kept)
        self.security: Security | None = None
        self._local: list[LocalNode] = []
        self._plan_ready = asyncio.Event()
        self._plan_lock = asyncio.Lock()
        self._serve_error = ""
        self._replan_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = False
        self._version = 0
        self._active: dict[str, Request] = {}
        self._inflight_steps = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._last_update = time.time()
        self._last_rebalance_s: float | None = None
        self._tok_times: list[float] = []
        self.store: StateStore | None = (
            StateStore(self.home / "state.db", on_write_error=self._state_write_error) if persist else None
        )
        self.discover = discover
        self.discovery: Any = None
        self.discovered: dict[str, ev.NodeDiscovered] = {}  # nodes seen but not joined (foreign ones too)

    # ================================================================== lifecycle

    async def start(self) -> None:
        cluster = await asyncio.to_thread(ensure_cluster, self.home)
        self.security = cluster.security(enable_tls=self.config.network.security.enable_tls)
        self.model = await asyncio.to_thread(Model, self.model_name)
        _ = await asyncio.to_thread(lambda: self.model.tokenizer)
        self.spec = spec_from_gguf(self.model.gguf)
        self._restore_state()
        await self._start_local_nodes(cluster)
        addresses = [n.address for n in self._local] + [split_host_port(p, self.config.network.node_port) for p in self.peers]
        if self.store is not None:
            addresses += [(k.host, k.port) for k in self.store.known_nodes() if (k.host, k.port) not in addresses]
        results = await asyncio.gather(*(self.add_node(h, p) for h, p in addresses), return_exceptions=True)
        for (h, p), r in zip(addresses, results, strict=True):
            if isinstance(r, BaseException):
                self._notice("error", f"node {h}:{p} could not join: {r}")
        if self.discover:
            await self._start_discovery(cluster)
        self._tasks.append(asyncio.create_task(self._monitor_loop(), name="coordinator-monitor"))
        self._tasks.append(asyncio.create_task(self._link_loop(), name="coordinator-links"))
        if self.nodes:
            await self._probe_links()
            if broken := self.broken_pins():
                self._notice("warning", f"the pin of {', '.join(broken)} cannot hold until the node joins")
            if not await self._adopt_saved_plan():
                await self.replan("initial plan")

    def _restore_state(self) -> None:
        if self.store is None:
            return
        self.drained = self.store.drains()
        self.pins = {n: Pin(n, a, b) for n, (a, b) in self.store.pins().items()}
        for host, port, source, user in self.store.known_hosts():
            self.hosts[host] = HostView(host=host, port=port, source=source, user=user)

    async def _adopt_saved_plan(self) -> bool:
        """Re-adopt the plan a previous coordinator left in force, if its nodes still hold it."""
        saved = self.store.plan() if self.store is not None else None
        if saved is None or self.model is None:
            return False
        version, model_path, body = saved
        if model_path != str(self.model.path):
            return False
        plan = Plan.from_dict(body)
        for s in plan.shards:
            h = self.nodes.get(s.node_id)
            if h is None or h.state == "failed" or (s.start, s.end) not in h.held:
                return False
        self._version = max(self._version, version)
        await self._switch(plan, "re-adopted after a coordinator restart")
        return True

    def _save_constraints(self) -> None:
        if self.store is not None:
            self.store.save_drains(self.drained)
            self.store.save_pins({n: (p.start, p.end) for n, p in self.pins.items()})

    async def _start_discovery(self, cluster: Any) -> None:
        """Browse for nodes and hosts (mDNS, static peers, ssh_config, tailscale, per config).
        Nodes that prove our cluster key join; the others show as foreign."""
        from exo_tui.discovery.mdns import cluster_fingerprint
        from exo_tui.discovery.service import Discovery, net_probe

        fp = cluster_fingerprint(cluster.ca_cert_pem)
        self.discovery = Discovery.from_config(
            self.events, self.config, cli_peers=(), cluster_fingerprint=fp, probe=net_probe(self.security, fp),
            ignore_node_ids=tuple(self.nodes),
        )
        self._tasks.append(asyncio.create_task(self._discovery_loop(), name="coordinator-discovery"))
        try:
            await self.discovery.start()
        except OSError as exc:  # no multicast-capable interface, say
            self._notice("warning", f"discovery could not start ({exc}): add nodes with --peer")

    async def _discovery_loop(self) -> None:
        with self.events.subscribe() as sub:
            async for event in sub:
                try:
                    await self._on_discovery_event(event)
                except Exception as exc:  # noqa: BLE001 - one bad advertisement must not stop discovery
                    log.warning("discovery event %s: %s", event.kind, exc)

    async def _on_discovery_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.NodeDiscovered):
            if event.node_id in self.nodes and self.nodes[event.node_id].state != "failed":
                self.discovery.mark_member(event.node_id)
                return
            self.discovered[event.node_id] = event
            if event.foreign:
                return
            try:
                await self.add_node(event.address, event.port)
            except (ConnectError, OSError, TimeoutError) as exc:
                if "handshake" in str(exc).lower() or "refused the connection" in str(exc):
                    self.discovery.mark_foreign(event.node_id, str(exc))
                return
            self.discovered.pop(event.node_id, None)
            self.discovery.mark_member(event.node_id)
            await self._after_membership_change(f"node {event.name} discovered")
        elif isinstance(event, ev.NodeStateChanged) and event.state == "foreign" and event.node_id in self.discovered:
            self.discovered[event.node_id] = replace(self.discovered[event.node_id], foreign=True)
        elif isinstance(event, ev.NodeGone):
            self.discovered.pop(event.node_id, None)
        elif isinstance(event, ev.HostDiscovered) and event.source != "manual":
            if event.host not in self.hosts or self.hosts[event.host].state == "new":
                self.hosts[event.host] = HostView(host=event.host, port=event.port, source=event.source)
                self._touch()
        elif isinstance(event, ev.HostGone) and event.host in self.hosts and self.hosts[event.host].state == "new":
            del self.hosts[event.host]
            self._touch()
        elif isinstance(event, ev.BootstrapProgress) and event.host in self.hosts:
            state = "bootstrapping" if event.status == "running" else ("failed" if event.status == "failed" else
                                                                      ("node" if event.step == "done" else "bootstrapping"))
            self.hosts[event.host] = replace(self.hosts[event.host], state=state, detail=f"{event.step}: {event.message}")
            self._touch()

    async def _start_local_nodes(self, cluster: Any) -> None:
        if not self.local_count:
            return
        backends = self.local_backends or [""]
        log_dir = self.home / "logs"
        for i in range(self.local_count):
            name = f"{socket.gethostname()}-local{i}" if self.local_count > 1 else socket.gethostname()
            bundle = write_node_bundle(self.home / "nodes" / f"{name}.bundle", cluster.node_bundle(name))
            backend = backends[i % len(backends)] or default_backend_name()
            limit = self.local_memory_limits_gb[i] if i < len(self.local_memory_limits_gb) else None
            extra = [] if self.config.network.security.enable_tls else ["--no-tls"]
            # Nodes on other hosts forward hidden states to this one: then it listens on every
            # interface (TLS and the cluster key guard it), else on loopback only.
            listen = "0.0.0.0" if self.peers or self.discover else "127.0.0.1"
            self._local.append(
                spawn_node(name, backend=backend, key_file=str(bundle), memory_limit_gb=limit, log_dir=log_dir,
                           env={"EXO_TUI_HOME": str(self.home)}, extra_args=extra, listen=listen)
            )
        await asyncio.gather(*(wait_ready(n) for n in self._local))

    async def stop(self) -> None:
        self._stopping = True
        if self.discovery is not None:
            with contextlib.suppress(Exception):
                await self.discovery.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):  # nodes that outlive this coordinator keep no finished caches
            async with asyncio.timeout(5.0):
                await self.pipeline.forget_kept()
        for handle in self.nodes.values():
            if handle.conn is not None:
                with contextlib.suppress(Exception):
                    await handle.conn.aclose()
        await asyncio.gather(*(asyncio.to_thread(stop_node, n) for n in self._local))
        if self.store is not None:
            self.store.close()

    async def __aenter__(self) -> Coordinator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ================================================================== membership

    async def add_node(self, host: str, port: int) -> NodeHandle:
        """Connect to a node agent, attach to it and add it to the cluster."""
        assert self.security is not None
        timeout = self.config.network.discovery.connect_timeout
        # _on_frame never awaits: tokens and heartbeats are handled in the read loop (no lane task).
        conn = await connect(host, port, security=self.security, timeout=timeout, handler=self._on_frame,
                             inline_types=("token", "step_failed", "heartbeat"))
        reply = await conn.call("attach", timeout=10)
        profile = NodeProfile.from_dict(reply.body["profile"])
        existing = self.nodes.get(profile.node_id)
        if existing is not None and existing.connected and existing.conn is not conn:
            await existing.conn.aclose()
        handle = NodeHandle(profile.node_id, profile.name, host, port, profile, conn)
        handle.shards = list(reply.body.get("shards", []))
        handle.held = {(s["start"], s["end"]) for s in handle.shards}
        handle.drained = profile.node_id in self.drained
        handle.state = "drained" if handle.drained and not handle.held else "ready"
        if existing is not None:
            handle.links = existing.links
            handle.history = existing.history
        conn.data["node_id"] = profile.node_id
        conn.on_close(self._on_conn_closed)
        handle.local_process = next((n for n in self._local if n.port == port and host == "127.0.0.1"), None)
        self.nodes[profile.node_id] = handle
        if self.store is not None and handle.local_process is None:
            self.store.remember_node(handle.node_id, handle.name, host, port)
        self.events.publish(ev.NodeJoined(node_id=handle.node_id, name=handle.name, address=host, port=port))
        self._touch()
        return handle

    def _on_conn_closed(self, conn: Connection, reason: BaseException | None) -> None:
        node_id = conn.data.get("node_id")
        handle = self.nodes.get(node_id) if node_id else None
        if handle is None or handle.conn is not conn or self._stopping:
            return
        self._fail_node(node_id, f"connection lost ({reason})" if reason else "connection closed")

    def _fail_node(self, node_id: str, reason: str) -> None:
        handle = self.nodes.get(node_id)
        if handle is None or handle.state == "failed":
            return
        handle.state, handle.reason = "failed", reason
        handle.failures += 1
        log.warning("node %s failed: %s", handle.name, reason)
        if handle.conn is not None:
            handle.conn.close()
        self.pipeline.fail_node(node_id, f"node {handle.name} failed: {reason}")
        self.events.publish(ev.NodeFailed(node_id=node_id, reason=reason))
        self.events.publish(ev.NodeStateChanged(node_id=node_id, state="failed", reason=reason))
        self._touch()
        if self.ring is not None and any(e.node_id == node_id for e in self.ring.ring):
            self._schedule_replan(f"node {handle.name} failed: {reason}")

    def _schedule_replan(self, reason: str) -> asyncio.Task[None]:
        if self._replan_task is None or self._replan_task.done():
            self._plan_ready.clear()  # no new step on a ring with a dead node
            self._replan_task = asyncio.create_task(self._replan_after_failure(reason))
        return self._replan_task

    def broken_pins(self) -> list[str]:
        """The pins that cannot hold now: their node failed, or is not in the cluster (a pin is
        saved with the cluster's state, and its machine may be off when the coordinator starts)."""
        return [
            f"{self.nodes[n].name} layers {p.start}-{p.end - 1}" if n in self.nodes
            else f"{n} layers {p.start}-{p.end - 1} (not in the cluster)"
            for n, p in self.pins.items() if n not in self.nodes or self.nodes[n].state == "failed"
        ]

    async def _replan_after_failure(self, reason: str) -> None:
        """A plan over the survivors. A node that dies while it is being made is failed too
        (its connection closes) and the plan is made again without it."""
        broken = self.broken_pins()
        if broken:
            self._notice("warning", f"{reason}: the pin of {', '.join(broken)} cannot hold until the node returns")
        for attempt in range(1, 2 + len(self.nodes)):
            try:
                await self.replan(reason, move_kv=False)
                return
            except GenerationError:
                return  # _cannot_serve has told requests and the operator why
            except (RemoteError, ConnectionError, TimeoutError, KeyError) as exc:
                log.warning("replanning after a failure, attempt %d: %s", attempt, exc)
                await asyncio.sleep(0.2)
        self._cannot_serve(f"no stable plan after {len(self.nodes) + 1} attempts")

    def node_name(self, node_id: str) -> str:
        handle = self.nodes.get(node_id)
        return handle.name if handle is not None else node_id

    def connection(self, node_id: str) -> Connection:
        handle = self.nodes[node_id]
        if not handle.connected:
            raise KeyError(node_id)
        return handle.conn  # type: ignore[return-value]

    # ================================================================== frames from nodes

    async def _on_frame(self, conn: Connection, frame: Frame) -> Frame | None:
        node_id = conn.data.get("node_id", "")
        b = frame.body
        handle = self.nodes.get(node_id)
        if handle is not None and handle.conn is conn:
            handle.last_heartbeat_s = time.monotonic()  # any frame is a sign of life
        if frame.type == "token":
            try:
                logprobs = None if b.get("logprobs") is None else TokenLogprobs.from_wire(b["logprobs"])
                scores = None
                if b.get("scored"):
                    if frame.tensor is None:
                        raise ValueError("a scored token frame came without its scores")
                    scores = scores_from_array(frame.tensor)
            except ValueError as exc:  # the step fails (and is retried); the connection stays
                self.pipeline.on_step_failed(b["rid"], b.get("step"), frame.plan, f"node {node_id}: {exc}", node_id)
                return None
            self.pipeline.on_token(b["rid"], int(b["step"]), int(frame.plan or 0), int(b["token"]), logprobs, scores)
        elif frame.type == "heartbeat":
            if handle is not None and handle.conn is conn:
                handle.record_heartbeat(b.get("metrics", {}))
                self.admission.poke()  # its KV budget may have changed
                self.events.publish(ev.NodeMetrics(node_id=node_id, metrics={k: v for k, v in handle.metrics.items() if k != "requests"}))
                self._touch()
        elif frame.type == "step_failed":
            suspect = b.get("failed_node") or None
            self.pipeline.on_step_failed(b.get("rid", ""), b.get("step"), frame.plan, str(b.get("error", "")), suspect,
                                         kv_budget=b.get("kv_budget") is True)
        else:
            raise RemoteError(f"the coordinator does not take {frame.type!r} frames")
        return None

    # ================================================================== monitoring

    async def _monitor_loop(self) -> None:
        timeout = self.config.scheduler.fault_tolerance.heartbeat_timeout
        last_reconnect = 0.0
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            now = time.monotonic()
            for handle in list(self.nodes.values()):
                if handle.state != "failed" and handle.heartbeat_age_s(now) > timeout:
                    self._fail_node(handle.node_id, f"no heartbeat for {handle.heartbeat_age_s(now):.1f} s")
            if now - last_reconnect > RECONNECT_INTERVAL_S:
                last_reconnect = now
                for handle in [h for h in self.nodes.values() if h.state == "failed"]:
                    asyncio.create_task(self._try_return(handle))
                if self.store is not None and self.store.write_error is not None:
                    self.store.retry()  # the state file was unwritable (a full disk): catch up once it is
            await self._maybe_auto_rebalance()

    async def _try_return(self, handle: NodeHandle) -> None:
        if handle.local_process is not None and not handle.local_process.alive():
            return
        try:
            back = await self.add_node(handle.host, handle.port)
        except (ConnectError, OSError, RemoteError, TimeoutError):
            return
        back.failures = handle.failures
        self._notice("info", f"node {back.name} is back and eligible again")
        self.events.publish(ev.NodeStateChanged(node_id=back.node_id, state=back.state, reason="returned"))
        await self._after_membership_change(f"node {back.name} returned")

    async def _after_membership_change(self, reason: str) -> None:
        if self._serve_error or self.ring is None:
            with contextlib.suppress(Exception):
                await self.replan(reason)
            return
        preview = await self.preview("rebalance")
        if preview.error or not preview.moves:
            return
        if self.config.scheduler.load_balancing.auto_rebalance:
            await self.apply(preview)
        else:
            self._notice(
                "info",
                f"{reason}: a rebalance would move {len(preview.moves)} layer ranges "
                f"({preview.bytes_moved / 1e6:.0f} MB), {preview.tok_per_s_before:.1f} → {preview.tok_per_s_after:.1f} tok/s: press R",
            )

    async def _maybe_auto_rebalance(self) -> None:
        lb = self.config.scheduler.load_balancing
        if self.plan is None or self.plan.predictions is None or not self._plan_ready.is_set():
            return
        coefficient = self._measured_balance()
        now = time.monotonic()
        if self._last_rebalance_s is None:
            self._last_rebalance_s = now
        if should_rebalance(coefficient, self._last_rebalance_s, now, self.config.scheduler):
            self._last_rebalance_s = now
            preview = await self.preview("rebalance")
            if preview.moves and not preview.error:
                if lb.auto_rebalance:
                    await self.apply(preview)
                else:
                    self._notice("info", f"stage times are imbalanced (std/mean {coefficient:.2f}): press R to rebalance")

    def _measured_balance(self) -> float:
        """std/mean of the stages' busy fractions over the last heartbeat (0 when idle)."""
        if self.ring is None:
            return 0.0
        busy = [self.nodes[e.node_id].metrics.get("busy_fraction", 0.0) for e in self.ring.ring if e.node_id in self.nodes]
        if len(busy) < 2 or max(busy) < 0.05:
            return 0.0
        return float(np.std(busy) / max(np.mean(busy), 1e-9))

    async def _link_loop(self) -> None:
        while True:
            await asyncio.sleep(LINK_PROBE_INTERVAL_S)
            with contextlib.suppress(Exception):
                await self._probe_links()

    async def _probe_links(self) -> None:
        """Latency of every ordered pair of live nodes (the scheduler needs every link)."""
        live = [h for h in self.nodes.values() if h.connected and h.state != "failed"]

        async def probe(a: NodeHandle, b: NodeHandle) -> None:
            try:
                reply = await a.conn.call("link_probe", {"host": b.host, "port": b.port, "pings": 3}, timeout=10)
            except (RemoteError, ConnectionError, TimeoutError):
                return
            a.links[b.node_id] = float(reply.body["latency_s"])
            if "bandwidth_bytes_per_s" in reply.body:
                a.link_bandwidth[b.node_id] = float(reply.body["bandwidth_bytes_per_s"])

        await asyncio.gather(*(probe(a, b) for a in live for b in live if a is not b))

    # ================================================================== planning

    def device_profiles(self) -> list[DeviceProfile]:
        now = time.monotonic()
        rc = self.config.scheduler.resource_reservation
        out = []
        for h in self.nodes.values():
            p = h.profile
            backend = self._node_backend(h)
            timing = p.layer_timing.get(backend)
            held = sum(int(s.get("nbytes", 0)) for s in h.shards)
            avail = int(h.metrics.get("ram_available_bytes", p.ram_available_bytes)) + held
            total = p.ram_total_bytes
            if p.memory_limit_bytes:
                # The limit is the node process's whole budget: what it holds besides its shards'
                # bytes (its runtime, measured: node/kv_budget.py) is not offered. Add the reserves
                # back so the scheduler's usable memory equals what is left.
                runtime = max(0, int((h.metrics.get("kv") or {}).get("runtime_bytes", 0)) - held)
                avail = int(min(avail, p.memory_limit_bytes - runtime) + rc.system_reserved_ram * GB
                            + rc.emergency_reserve * total)
            out.append(
                DeviceProfile(
                    node_id=h.node_id,
                    name=h.name,
                    device_type=p.device_type,
                    ram_total_bytes=total,
                    ram_available_bytes=avail,
                    unified_memory=p.unified_memory,
                    cpu_cores=p.cpu_cores,
                    cpu_utilization=min(1.0, float(h.metrics.get("cpu_percent", 0.0)) / 100.0),
                    backends=(backend,),
                    decode_s_per_layer={backend: timing.decode_layer_s} if timing else {},
                    prefill_s_per_layer_token={backend: timing.prefill_layer_token_s} if timing else {},
                    compute_ref_layer_bytes=BENCH_LAYER_BYTES,
                    kv_value_bytes={backend: p.kv_value_bytes},
                    memory_bandwidth_bytes_per_s=p.memory_bandwidth_bytes_per_s or 10e9,
                    load_factor=0.0,
                    benchmark_score=1.0 / timing.decode_layer_s if timing and timing.decode_layer_s > 0 else 1.0,
                    power_state="battery" if h.metrics.get("on_battery") else "active",
                    links={peer: Link(lat, h.link_bandwidth.get(peer, 1e9)) for peer, lat in h.links.items()},
                    last_heartbeat=h.last_heartbeat_s if h.state != "failed" else now - 1e9,
                    drained=h.node_id in self.drained,
                    failed=h.state == "failed",
                )
            )
        return out

    def _node_backend(self, h: NodeHandle) -> str:
        return h.profile.backend or (h.profile.backends or ["onnx"])[0]

    def constraints(self, *, drained: set[str] | None = None, pins: dict[str, Pin] | None = None) -> Constraints:
        """Pins, drains and failures for the scheduler. A pin on a failed node, or on one not in
        the cluster, cannot hold: it is left out (and kept, to apply again when the node returns);
        see :meth:`broken_pins`."""
        failed = frozenset(n for n, h in self.nodes.items() if h.state == "failed")
        pins = pins if pins is not None else self.pins
        return Constraints(
            pins=tuple(p for n, p in pins.items() if n in self.nodes and n not in failed),
            drained=frozenset(drained if drained is not None else self.drained),
            failed=failed,
        )

    def _preview(self, constraints: Constraints) -> ChangePreview:
        if self.strategy == "even":
            return self._even_preview(constraints)
        return preview_change(
            self.plan,
            self.device_profiles(),
            self.spec,
            constraints,
            self.config.scheduler,
            now=time.monotonic(),
            strategy=self.strategy,
        )

    def _even_preview(self, constraints: Constraints) -> ChangePreview:
        """Layers split evenly over the live, undrained nodes in the order they joined
        (``exo-tui chat --nodes``: the operator's order is the ring); see :mod:`exo_tui.scheduler.even`."""
        live = [h for h in self.nodes.values() if h.state != "failed" and h.node_id not in constraints.drained]
        version = (self.plan.version + 1) if self.plan else 1
        try:
            plan = even_plan([h.node_id for h in live], {h.node_id: self._node_backend(h) for h in live},
                             {p.node_id: p for p in self.device_profiles()}, self.spec, constraints,
                             self.config.scheduler, version)
        except InfeasiblePlan as exc:
            return ChangePreview(None, None, error=str(exc))
        diff = plan_diff(self.plan, plan, self.spec, constraints.failed)
        before = self.plan.predictions.tok_per_s_single if self.plan and self.plan.predictions else 0.0
        after = plan.predictions.tok_per_s_single if plan.predictions else 0.0
        return ChangePreview(plan, diff, (), before, after)

    def _plan_alive(self) -> bool:
        return self.plan is not None and all(
            s.node_id in self.nodes and self.nodes[s.node_id].state != "failed" for s in self.plan.shards
        )

    async def replan(self, reason: str, *, move_kv: bool = True) -> Plan:
        """Make the best plan for the cluster as it is and switch to it."""
        preview = self._preview(self.constraints())
        if preview.error or preview.new_plan is None:
            self._cannot_serve(preview.error or "no plan")
            raise GenerationError(self._serve_error)
        await self._switch(preview.new_plan, reason, move_kv=move_kv)
        return preview.new_plan

    def _cannot_serve(self, why: str) -> None:
        free = sum(
            max(0, h.memory_available_bytes) for h in self.nodes.values() if h.state != "failed" and h.node_id not in self.drained
        )
        need = self.spec.total_bytes if self.spec is not None else 0
        self._serve_error = f"the cluster cannot serve the model: {why} (free {free / 1e9:.2f} GB on live nodes, the model needs {need / 1e9:.2f} GB)"
        self._plan_ready.set()  # waiting steps wake up and fail with the error
        self._notice("error", self._serve_error)

    async def _switch(self, new: Plan, reason: str, *, move_kv: bool = True) -> None:
        """Load, switch at a token boundary, move KV, unload (see the module doc)."""
        async with self._plan_lock:
            old_plan, old_ring = self.plan, self.ring
            same = old_plan is not None and self._plan_alive() and old_plan.shards == new.shards
            if same and not self._serve_error:
                self._plan_ready.set()
                self._refresh_states()
                return
            self._version = max(self._version, old_plan.version if old_plan else 0) + 1
            new = new.with_version(self._version)
            ring = self._ring_for(new)
            moves = _moves(old_plan, new, self.spec)
            # 1. load what is missing, max_task_migration at a time, while the old plan serves
            limit = max(1, self.config.scheduler.load_balancing.max_task_migration)
            missing = [e for e in ring.ring if (e.start, e.end) not in self.nodes[e.node_id].held]
            for i in range(0, len(missing), limit):
                await asyncio.gather(*(self._ensure_shard(e) for e in missing[i : i + limit]))
            conns = [self.connection(e.node_id) for e in ring.ring]
            await asyncio.gather(*(conn.call("plan", {"plan": ring.to_dict()}, timeout=30) for conn in conns))
            # 2. switch at a token boundary: no new step starts; wait for the ones running
            self._plan_ready.clear()
            await self._idle.wait()
            # 3. move the KV caches of requests in flight
            if move_kv and old_ring is not None and self._plan_alive():
                await self._move_kv(old_ring, ring)
            self.plan, self.ring = new, ring
            self._serve_error = ""
            self._plan_ready.set()
            # 4. unload what the new plan does not use; drained nodes become drained
            await self._unload_unused(ring)
            self._refresh_states()
            if self.store is not None:
                self.store.save_plan(new.version, str(self.model.path) if self.model else "", new.to_dict())
            diff = {"moves": [m.__dict__ for m in moves], "bytes_moved": sum(m.nbytes for m in moves)}
            self.events.publish(ev.PlanChanged(version=new.version, plan=new.to_dict(), diff=diff, reason=reason))
            self._touch()
            log.info("plan %d in force (%s): %s", new.version, reason, new.layout)

    def _refresh_states(self) -> None:
        """Drained when a drained node holds nothing, draining while it still does, else ready."""
        for h in self.nodes.values():
            if h.state in ("ready", "draining", "drained", "loading"):
                if h.node_id in self.drained:
                    wanted = "draining" if h.held else "drained"
                else:
                    wanted = "ready"
                if wanted != h.state:
                    h.state = wanted
                    self.events.publish(ev.NodeStateChanged(node_id=h.node_id, state=wanted))

    def _ring_for(self, plan: Plan) -> RingPlan:
        """The ring as nodes see it. A node the coordinator reaches on loopback is named, for
        the others, by the address this host has on their network."""
        handles = [self.nodes[s.node_id] for s in plan.shards]
        remote = next((h for h in handles if not is_loopback(h.host) and h.connected), None)
        outward = remote.conn.local_address if remote is not None else ""
        entries = []
        for s, h in zip(plan.shards, handles, strict=True):
            host = outward if outward and is_loopback(h.host) else h.host
            entries.append(PlanEntry(s.node_id, host, h.port, s.start, s.end, s.backend or self._node_backend(h)))
        return RingPlan(plan.version, plan.n_layers, tuple(entries))

    async def _ensure_shard(self, entry: PlanEntry) -> None:
        h = self.nodes[entry.node_id]
        conn = self.connection(entry.node_id)
        prior = h.state
        h.state = "loading"
        self.events.publish(ev.NodeStateChanged(node_id=h.node_id, state="loading", reason=f"layers {entry.start}-{entry.end - 1}"))
        assert self.model is not None
        try:
            if self._use_path(h):
                body = await load_from_path(conn, str(self.model.path), entry.start, entry.end, entry.backend)
                self.events.publish(ev.ShardProgress(node_id=h.node_id, start=entry.start, end=entry.end,
                                                     done_bytes=int(body.get("nbytes", 0)), total_bytes=int(body.get("nbytes", 0))))
            else:
                def progress(done: int, total: int) -> None:
                    self.events.publish(ev.ShardProgress(node_id=h.node_id, start=entry.start, end=entry.end, done_bytes=done, total_bytes=total))

                body = await stream_shard(conn, self.model.gguf, entry.start, entry.end, entry.backend, progress=progress)
        finally:
            if h.state == "loading":
                h.state = prior if prior != "loading" else "ready"
        h.held.add((entry.start, entry.end))
        h.shards = [s for s in h.shards if (s["start"], s["end"]) != (entry.start, entry.end)]
        h.shards.append({"start": entry.start, "end": entry.end, "backend": body.get("backend"), "nbytes": int(body.get("nbytes", 0))})

    def _use_path(self, h: NodeHandle) -> bool:
        if self.weights_mode != "auto":
            return self.weights_mode == "path"
        return is_loopback(h.host) and h.profile.hostname == socket.gethostname()

    async def _unload_unused(self, ring: RingPlan) -> None:
        keep = {(e.node_id, e.start, e.end) for e in ring.ring}
        for h in self.nodes.values():
            if not h.connected:
                continue
            for start, end in list(h.held):
                if (h.node_id, start, end) not in keep:
                    with contextlib.suppress(RemoteError, ConnectionError, TimeoutError):
                        await h.conn.call("unload", {"start": start, "end": end}, timeout=30)
                    h.held.discard((start, end))
                    h.shards = [s for s in h.shards if (s["start"], s["end"]) != (start, end)]

    async def _move_kv(self, old: RingPlan, new: RingPlan) -> None:
        """Move every in-flight request's caches from the old ring's shards to the new ones."""
        for rid in self.pipeline.in_flight():
            cached = self.pipeline.cached(rid)
            if cached is None or cached[0] != old.version:
                continue
            try:
                for e in new.ring:
                    if any(o.node_id == e.node_id and (o.start, o.end) == (e.start, e.end) for o in old.ring):
                        continue  # the same shard on the same node keeps its cache
                    parts = []
                    for o in old.ring:
                        a, b = max(o.start, e.start), min(o.end, e.end)
                        if a >= b:
                            continue
                        reply = await self.connection(o.node_id).call("kv_export", {"rid": rid, "start": a, "end": b}, timeout=30)
                        parts.append(kv_from_array(a, b, np.asarray(reply.tensor)))
                    cache = _concat_kv(parts)
                    await self.connection(e.node_id).call(
                        "kv_import", {"rid": rid, "start": e.start, "end": e.end}, tensor=kv_to_array(cache), timeout=30
                    )
            except (RemoteError, ConnectionError, TimeoutError, KeyError, ValueError) as exc:
                log.info("KV of %s not moved (%s): it will be rebuilt from its tokens", rid, exc)
                continue
            self.pipeline.set_cached(rid, new.version, cached[1])

    # ================================================================== PipelineHost

    async def plan_ready(self) -> RingPlan:
        while True:
            if self._serve_error:
                raise GenerationError(self._serve_error)
            if self._plan_ready.is_set() and self.ring is not None:
                self._inflight_steps += 1
                self._idle.clear()
                return self.ring
            await self._plan_ready.wait()
            if self.ring is None and not self._serve_error:
                await asyncio.sleep(0.05)

    def step_done(self) -> None:
        self._inflight_steps -= 1
        if self._inflight_steps <= 0:
            self._inflight_steps = 0
            self._idle.set()

    async def step_failed(self, failure: StepFailure, plan: RingPlan) -> None:
        node_id = failure.node_id
        if node_id is None or node_id not in self.nodes:
            node_id = await self._find_dead(plan)
        if node_id is not None and self.nodes[node_id].state != "failed":
            self._fail_node(node_id, str(failure))
        if self.ring is not None and self.ring.version == plan.version:
            if node_id is None:
                # Nobody is dead: the step was refused (e.g. a plan switch raced it). Try again.
                await asyncio.sleep(0.05)
                return
            task = self._schedule_replan(str(failure))
            await task
        elif self._replan_task is not None and not self._replan_task.done():
            await self._replan_task

    async def _find_dead(self, plan: RingPlan) -> str | None:
        for e in plan.ring:
            h = self.nodes.get(e.node_id)
            if h is None or not h.connected:
                return e.node_id
            try:
                await h.conn.call("ping", {"t": time.time()}, timeout=1.0)
            except (RemoteError, ConnectionError, TimeoutError):
                return e.node_id
        return None

    # ================================================================== generation

    async def generate(self, request: Request, on_queued: Any = None) -> AsyncIterator[Any]:
        """Chunks of ``request``'s answer (see :func:`exo_tui.inference.generate.generate`), once
        admission lets it run (:mod:`exo_tui.cluster.admission`; ``on_queued(n)`` while it waits
        with ``n`` requests ahead)."""
        await wait_for_plan(self, self.config.admission.plan_wait_s)
        await self.admission.known(CAPACITY_WAIT_S)
        assert self.model is not None
        ticket = self.admission.ticket(request, self.model.config.context_length)
        await self.admission.enter(ticket, on_queued=on_queued)
        self._active[request.id] = request
        chunks = generate(AdmittedRunner(self.pipeline, self.admission, ticket), self.model.tokenizer, request,
                          context_length=self.model.config.context_length)
        try:
            # aclosing: the caches are released before the request's room goes to the next one
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if chunk.token_id is not None:
                        self._tok_times.append(time.monotonic())
                        self.events.publish(ev.TokenStreamed(request_id=request.id, token_id=chunk.token_id,
                                                             text=chunk.text))
                    yield chunk
        finally:
            self._active.pop(request.id, None)
            self.admission.leave(ticket)

    def new_request(self, messages: list[dict[str, str]], params: ChatParams) -> Request:
        assert self.model is not None
        sampling = params.sampling(self.model.sampling).with_seed()
        return Request(self.model.chat_prompt_ids(messages), sampling, params.max_tokens, tuple(params.stop))

    async def chat(self, messages: list[dict[str, str]], params: ChatParams) -> AsyncIterator[ChatChunk]:
        request = self.new_request(messages, params)
        finish, error = None, ""
        notes: asyncio.Queue[int] = asyncio.Queue()
        try:
            async for chunk in with_queue_notes(self.generate(request, on_queued=notes.put_nowait), notes):
                if isinstance(chunk, int):
                    yield ChatChunk(queued_ahead=chunk)
                    continue
                if chunk.finish_reason:
                    finish = chunk.finish_reason
                    break
                yield ChatChunk(text=chunk.text, token_ids=chunk.token_ids)
        except GenerationError as exc:
            finish, error = "error", str(exc)
        except (asyncio.CancelledError, GeneratorExit):
            finish = "cancelled"
            raise
        finally:
            nodes = tuple(self.nodes[n].name for n in self.pipeline.served_by_request(request.id) if n in self.nodes) or tuple(
                self.nodes[s.node_id].name for s in (self.plan.shards if self.plan else ()) if s.node_id in self.nodes
            )
            done = ev.RequestDone(
                request_id=request.id, finish_reason=finish or "cancelled", prompt_tokens=len(request.prompt_ids),
                completion_tokens=len(request.generated), ttft_s=request.ttft_s, tok_per_s=request.decode_tok_per_s,
                nodes=nodes, error=error,
            )
            self.events.publish(done)
        yield ChatChunk(
            finish_reason=finish or "stop", prompt_tokens=len(request.prompt_ids), completion_tokens=len(request.generated),
            ttft_s=request.ttft_s, tok_per_s=request.decode_tok_per_s, nodes=nodes, error=error,
        )

    # ================================================================== operator actions

    def _resolve(self, target: str, *, pinned: bool = False) -> str:
        """The node id ``target`` (an id or a name) names. ``pinned``: an id of a pinned node not
        in the cluster counts too (its pin can be taken off)."""
        if target in self.nodes or (pinned and target in self.pins):
            return target
        matches = [h.node_id for h in self.nodes.values() if h.name == target]
        if len(matches) == 1:
            return matches[0]
        known = ", ".join(sorted(h.name for h in self.nodes.values()))
        raise KeyError(f"no node {target!r}: known nodes are {known or 'none'}")

    def _proposed(
        self, action: str, ids: tuple[str, ...], layers: tuple[int, int] | None = None
    ) -> tuple[set[str], dict[str, Pin]]:
        """The drains and pins ``action`` on ``ids`` would leave (raises ValueError if it can't)."""
        drained, pins = set(self.drained), dict(self.pins)
        if layers is not None and action != "pin":
            raise ValueError(f"only a pin takes layers, not {action}")
        if action in ("drain", "remove"):
            drained |= set(ids)
        elif action == "undrain":
            drained -= set(ids)
        elif action == "pin" and layers is not None:
            pins.update(self._ranged_pin(ids, layers, pins))
        elif action == "pin":
            for nid in ids:
                shard = self.plan.shard_of(nid) if self.plan else None
                if shard is None:
                    raise ValueError(f"node {self.nodes[nid].name} holds no layers to pin: pin a node that serves layers")
                pins[nid] = Pin(nid, shard.start, shard.end)
        elif action == "unpin":
            for nid in ids:
                pins.pop(nid, None)
        elif action != "rebalance":
            raise ValueError(f"unknown action {action!r}: use drain, undrain, pin, unpin, rebalance or remove")
        return drained, pins

    def _ranged_pin(self, ids: tuple[str, ...], layers: tuple[int, int], pins: dict[str, Pin]) -> dict[str, Pin]:
        """The pin of one node to ``layers`` (raises ValueError for a range no plan can keep)."""
        if len(ids) != 1:
            raise ValueError("a pin with layers names exactly one node")
        nid, (start, end) = ids[0], (int(layers[0]), int(layers[1]))
        n_layers = self.spec.n_layers if self.spec is not None else 0
        if not 0 <= start < end <= n_layers:
            raise ValueError(f"layers {start}-{end - 1} are not within the model's 0-{n_layers - 1}: "
                             f"give START-END with 0 <= START <= END <= {n_layers - 1}")
        for other, p in pins.items():
            if other != nid and p.start < end and start < p.end:
                raise ValueError(f"layers {start}-{end - 1} overlap the pin of {self.nodes[other].name} "
                                 f"({p.start}-{p.end - 1}): unpin it first")
        if self.nodes[nid].state == "failed":
            raise ValueError(f"node {self.nodes[nid].name} has failed: a pin needs a node that is up")
        if nid in self.drained:
            raise ValueError(f"node {self.nodes[nid].name} is drained: undrain it before pinning layers to it")
        return {nid: Pin(nid, start, end)}

    async def preview(
        self, action: str, targets: tuple[str, ...] = (), layers: tuple[int, int] | None = None
    ) -> PlanPreview:
        return (await self._planned(action, targets, layers))[0]

    async def _planned(
        self, action: str, targets: tuple[str, ...], layers: tuple[int, int] | None
    ) -> tuple[PlanPreview, ChangePreview | None, set[str], dict[str, Pin]]:
        """What ``action`` would do now: the operator's view of it (targets resolved to node ids,
        or the error), the scheduler's change, and the drains and pins it would leave."""
        try:
            ids = tuple(self._resolve(t, pinned=action == "unpin") for t in targets)
            drained, pins = self._proposed(action, ids, layers)
        except (KeyError, ValueError) as exc:
            return PlanPreview(action, tuple(targets), error=str(exc.args[0]), layers=layers), None, set(), {}
        change = await asyncio.to_thread(self._preview, self.constraints(drained=drained, pins=pins))
        view = replace(_to_view_preview(action, ids, change, self, self._streaming_note()), layers=layers)
        return view, change, drained, pins

    def _streaming_note(self) -> str:
        if not self._active:
            return ""
        return f"{len(self._active)} answer(s) streaming: the switch happens between two tokens and their caches move with it"

    async def apply(self, preview: PlanPreview) -> PlanPreview:
        """Carry out an action previewed with :meth:`preview`, planned afresh on the cluster as
        it is now (it may have changed since the preview); returns what was done."""
        if self.readonly:
            return replace(preview, error="read-only console: changes are disabled")
        action, layers = preview.action, preview.layers
        result, change, drained, pins = await self._planned(action, preview.targets, layers)
        ids = result.targets  # resolved to node ids
        if not result.error and change is not None and change.new_plan is not None:
            self.drained, self.pins = drained, pins
            self._save_constraints()
            for nid in ids:
                if action in ("drain", "remove") and self.nodes[nid].state in ("ready", "loading"):
                    self.nodes[nid].state = "draining"
                    self.events.publish(ev.NodeStateChanged(node_id=nid, state="draining"))
            try:
                await self._switch(change.new_plan, f"{action} {' '.join(self.node_name(i) for i in ids)}".strip())
                if action == "remove":
                    for nid in ids:
                        await self._forget(nid)
                self._last_rebalance_s = time.monotonic()
            except (GenerationError, InfeasiblePlan, RemoteError, ConnectionError, TimeoutError, KeyError) as exc:
                result = replace(result, error=str(exc))
        elif not result.error:
            result = replace(result, error="no plan")
        names = " ".join(self.node_name(i) for i in ids)
        if layers is not None:
            names = f"{names} layers {layers[0]}-{layers[1] - 1}"
        self._audit(action, names, "ok" if not result.error else f"error: {result.error}",
                    f"{len(result.moves)} moves, {result.bytes_moved / 1e6:.1f} MB, "
                    f"{result.tok_per_s_before:.1f} → {result.tok_per_s_after:.1f} tok/s")
        return result

    def _audit(self, action: str, target: str, result: str, detail: str = "") -> None:
        """An operator action: on the event stream and in the persisted audit log."""
        if self.store is not None:
            self.store.audit(action, target, result, detail)
        self.events.publish(ev.OperatorAction(action=action, target=target, result=result, detail=detail))

    async def _forget(self, node_id: str) -> None:
        h = self.nodes.pop(node_id, None)
        self.drained.discard(node_id)
        self.pins.pop(node_id, None)
        if h is not None and h.conn is not None:
            await h.conn.aclose()
        if h is not None:
            self.events.publish(ev.NodeGone(node_id=node_id, name=h.name))
        if self.store is not None:
            self.store.forget_node(node_id)
        self._save_constraints()

    async def bootstrap(self, host: str, *, accept_new_host_key: bool = False) -> None:
        from exo_tui.bootstrap import bootstrap_host  # heavy: asyncssh

        def progress(event: ev.Event) -> None:
            self.events.publish(event)

        result = await bootstrap_host(host, accept_new_host_key=accept_new_host_key, on_event=progress, home=self.home)
        await self.add_node(result.host, result.port)
        await self._after_membership_change(f"node {host} joined")

    async def add_host(self, host: str) -> None:
        self.hosts[host] = HostView(host=host, source="manual")
        if self.store is not None:
            self.store.remember_host(host, 22, "manual")
        self._audit("add_host", host, "ok")
        self.events.publish(ev.HostDiscovered(host=host, source="manual"))
        self._touch()

    async def set_model(self, name_or_path: str) -> None:
        model = await asyncio.to_thread(Model, name_or_path)
        _ = await asyncio.to_thread(lambda: model.tokenizer)
        async with self._plan_lock:
            self.model, self.model_name, self.spec = model, name_or_path, spec_from_gguf(model.gguf)
            self.plan, self.ring = None, None
            self.pins.clear()
            for h in self.nodes.values():
                if h.connected:
                    for start, end in list(h.held):
                        with contextlib.suppress(Exception):
                            await h.conn.call("unload", {"start": start, "end": end}, timeout=30)
                h.held.clear()
                h.shards = []
        await self.replan(f"model {model.name}")
        self._audit("model", model.name, "ok")

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
        nodes = []
        for h in self.nodes.values():
            s = scores.get(h.node_id)
            shard = self.plan.shard_of(h.node_id) if self.plan is not None else None
            pin = self.pins.get(h.node_id)
            nodes.append(
                NodeView(
                    node_id=h.node_id, name=h.name, address=h.host, port=h.port, state=h.state,
                    backend=self._node_backend(h), backends=tuple(h.profile.backends),
                    memory_total_bytes=h.profile.memory_limit_bytes or h.memory_total_bytes,
                    memory_used_bytes=sum(int(x.get("nbytes", 0)) for x in h.shards) if h.profile.memory_limit_bytes
                    else h.memory_total_bytes - int(h.metrics.get("ram_available_bytes", h.profile.ram_available_bytes)),
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
            plan=_plan_view(self.plan, self.pins, self.spec) if self.plan else None,
            hosts=tuple(self.hosts.values()),
            tok_per_s=self.tok_per_s(),
            updated_at=self._last_update,
            readonly=self.readonly,
            sampling=dict(self.model.sampling) if self.model else {},
            queue=QueueView(**self.admission.stats().to_dict()),
        )


# ====================================================================== helpers


def _concat_kv(parts: list[KVCache]) -> KVCache:
    parts = sorted(parts, key=lambda c: c.start)
    keys = [k for p in parts for k in p.keys]
    values = [v for p in parts for v in p.values]
    return KVCache(parts[0].start, parts[-1].end, parts[0].length, keys, values)


def _moves(old: Plan | None, new: Plan, spec: Any) -> list[LayerMove]:
    diff = plan_diff(old, new, spec)
    return [LayerMove(m.start, m.end, m.src, m.dst, m.nbytes) for m in diff.moves]


def _plan_view(plan: Plan, pins: dict[str, Pin], spec: Any) -> PlanView:
    pred = plan.predictions
    return PlanView(
        version=plan.version,
        n_layers=plan.n_layers,
        shards=tuple(ShardView(s.node_id, s.start, s.end, pinned=s.node_id in pins) for s in plan.shards),
        strategy=plan.strategy,
        predicted_tok_per_s=pred.tok_per_s_single if pred else 0.0,
        predicted_ttft_s=pred.ttft_s if pred else 0.0,
        predicted_ttft_prompt_tokens=pred.prompt_tokens if pred else 0,
        reasons=plan.reasons,
    )


def _to_view_preview(action: str, ids: tuple[str, ...], change: ChangePreview, c: Coordinator, note: str) -> PlanPreview:
    moves = tuple(LayerMove(m.start, m.end, m.src, m.dst, m.nbytes) for m in (change.diff.moves if change.diff else ()))
    notes = [n for n in (note, *change.notes) if n]
    return PlanPreview(
        action=action,
        targets=ids,
        moves=moves,
        bytes_moved=change.bytes_moved,
        tok_per_s_before=change.tok_per_s_before,
        tok_per_s_after=change.tok_per_s_after,
        new_plan=_plan_view(change.new_plan, c.pins, c.spec) if change.new_plan else None,
        error=change.error,
        note="; ".join(notes),
    )


__all__ = ["Coordinator"]
