"""Membership and health: nodes joining (found by discovery, added by address, coming back),
their frames (hello, heartbeats), failures and the replan after them, the monitor and link probes.

A part of :class:`~exo_tui.cluster.coordinator.Coordinator`, which holds the state it reads
(``nodes``, ``discovered``, ``hosts``, ``plan``, ``ring``, the event bus) and the other parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any

from exo_tui import events as ev
from exo_tui.cluster.node_handle import NodeHandle
from exo_tui.cluster.parts import CoordinatorParts
from exo_tui.cluster.ring_steps import verdict_from_wire
from exo_tui.cluster.view import Action, Command, HostView
from exo_tui.inference.generate import GenerationError
from exo_tui.inference.sampling import TokenLogprobs, scores_from_array
from exo_tui.net.client import connect
from exo_tui.net.codec import Message, call
from exo_tui.net.connection import Connection
from exo_tui.net.errors import BadBody, ConnectError, HandshakeError, RemoteError
from exo_tui.net.frame import Frame
from exo_tui.net.messages import (
    Attach,
    Attached,
    Heartbeat,
    Link,
    LinkProbe,
    StepFailed,
    Token,
    Unload,
    Unloaded,
)
from exo_tui.node.profile import NodeProfile
from exo_tui.scheduler.diff import should_rebalance

log = logging.getLogger("exo_tui.cluster")


class NodeGone(KeyError):
    """A node the coordinator needs a link to has none (it failed or left). A KeyError, as the
    handlers of a vanished node expect, whose text says so (a bare KeyError read as its id alone:
    an undrain after a kill answered "'n-83b6aa2509f1'")."""

    def __init__(self, node_id: str, name: str) -> None:
        super().__init__(node_id)
        self.node_id, self.name = node_id, name

    def __str__(self) -> str:
        return (f"node {self.name} has no live link (it failed or left the cluster): "
                "wait for it to rejoin, or drain or remove it")

MONITOR_INTERVAL_S = 0.25
STALL_S = 0.5  # a monitor tick this late means this process's loop was held: see _monitor_loop
RECONNECT_INTERVAL_S = 2.0
LINK_PROBE_INTERVAL_S = 10.0
# what the discovery loop acts on (_on_discovery_event): it is not woken by the rest (a token streamed)
DISCOVERY_EVENTS = (ev.NodeDiscovered, ev.NodeStateChanged, ev.NodeGone, ev.HostDiscovered, ev.HostGone,
                    ev.BootstrapProgress)


# What a node sends its coordinator unasked, by frame type.
_NODE_FRAMES: dict[str, type[Message]] = {Token.TYPE: Token, Heartbeat.TYPE: Heartbeat, StepFailed.TYPE: StepFailed}


class Membership(CoordinatorParts):
    """Nodes joining, their frames, heartbeats and failures (a part of the Coordinator)."""

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
        with self.events.subscribe(kinds=DISCOVERY_EVENTS) as sub:
            async for event in sub:
                try:
                    await self._on_discovery_event(event)
                except Exception as exc:  # noqa: BLE001 - one bad advertisement must not stop discovery
                    log.warning("discovery event %s: %s", event.kind, exc)

    async def _on_discovery_event(self, event: ev.Event) -> None:
        assert self.discovery is not None  # its events come after it starts
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
                if isinstance(exc, HandshakeError):  # it answered but is not of this cluster
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

    # ================================================================== membership

    async def add_node(self, host: str, port: int) -> NodeHandle:
        """Connect to a node agent, attach to it and add it to the cluster."""
        assert self.security is not None
        timeout = self.config.network.discovery.connect_timeout
        # _on_frame never awaits: tokens and heartbeats are handled in the read loop (no lane task).
        conn = await connect(host, port, security=self.security, timeout=timeout, handler=self._on_frame,
                             inline_types=("token", "step_failed", "heartbeat"))
        # The term fences: the node refuses the commands of an older term's coordinator from then on.
        state = await call(conn, Attach(self.term or None), Attached, timeout=10)
        profile = NodeProfile.from_dict(state.profile)
        existing = self.nodes.get(profile.node_id)
        if existing is not None and (old := existing.live_conn) is not None and old is not conn:
            await old.aclose()
        handle = NodeHandle(profile.node_id, profile.name, host, port, profile, conn)
        handle.note_kv(state.kv)
        # Only shards of this coordinator's model count as held: a node may still hold another
        # model's, of the same layer ranges (left by an earlier coordinator, or a switch that did
        # not finish), which are unloaded.
        handle.shards = [s.to_body() for s in state.shards if s.model == self._model_key]
        handle.held = {(s.start, s.end) for s in state.shards if s.model == self._model_key}
        self.room_notes.attached(handle.node_id, self._model_key, bool(handle.shards))
        for s in state.shards:
            if s.model != self._model_key:
                with contextlib.suppress(RemoteError, ConnectionError, TimeoutError):  # it goes with the node's next load
                    await call(conn, Unload(s.start, s.end, s.model), Unloaded, timeout=30)
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
        node_id = str(conn.data.get("node_id") or "")
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
                await self.replan(reason, move_kv=False, unload_later=True)
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
        handle = self.nodes.get(node_id)
        conn = handle.live_conn if handle is not None else None
        if conn is None:
            raise NodeGone(node_id, self.node_name(node_id))
        return conn

    # ================================================================== frames from nodes

    async def _on_frame(self, conn: Connection, frame: Frame) -> Frame | None:
        node_id = conn.data.get("node_id", "")
        handle = self.nodes.get(node_id)
        if handle is not None and handle.conn is conn:
            handle.last_heartbeat_s = time.monotonic()  # any frame is a sign of life
        kind = _NODE_FRAMES.get(frame.type)
        if kind is None:
            raise RemoteError(f"the coordinator does not take {frame.type!r} frames")
        try:
            msg = kind.decode(frame.body)  # the one place a node's frame is read: BadBody names what does not fit
        except BadBody as exc:
            if kind is not Heartbeat:  # a step's reply that cannot be read: the step fails now, not at its timeout
                self._unreadable_step_reply(node_id, frame, exc)
            raise  # and the node is told what it sent wrong
        if isinstance(msg, Token):
            try:
                logprobs = None if msg.logprobs is None else TokenLogprobs.from_wire(msg.logprobs)
                scores = None
                if msg.scored:
                    if frame.tensor is None:
                        raise ValueError("a scored token frame came without its scores")
                    scores = scores_from_array(frame.tensor)
                verdict = None if msg.tokens is None else verdict_from_wire(msg)
            except ValueError as exc:  # the step fails (and is retried); the connection stays
                self.pipeline.on_step_failed(msg.rid, msg.step, frame.plan, f"node {node_id}: {exc}", node_id)
                return None
            self.pipeline.on_token(msg.rid, msg.step, int(frame.plan or 0), msg.token, logprobs, scores, msg.timing,
                                   verdict)
        elif isinstance(msg, Heartbeat):
            if handle is not None and handle.conn is conn:
                handle.record_heartbeat(msg.metrics)
                self.calibrator.heartbeat(node_id, msg.metrics)
                self.admission.poke()  # its KV budget may have changed
                self.events.publish(ev.NodeMetrics(node_id=node_id, metrics={k: v for k, v in handle.metrics.items() if k != "requests"}))
                self._touch()
        elif isinstance(msg, StepFailed):
            self.pipeline.on_step_failed(msg.rid, msg.step, frame.plan, msg.error, msg.failed_node or None,
                                         kv_budget=msg.kv_budget)
        return None

    def _unreadable_step_reply(self, node_id: str, frame: Frame, exc: BadBody) -> None:
        """A token or step_failed frame whose body does not fit: the step it names fails (and is
        tried again); where it names none that can be read, every step through the node does."""
        reason = f"node {self.node_name(node_id)} sent a {frame.type} frame that cannot be read ({exc}): is it running the same exo-tui version?"
        body = frame.body if isinstance(frame.body, dict) else {}
        rid, step = body.get("rid"), body.get("step")
        if isinstance(rid, str) and type(step) is int:
            self.pipeline.on_step_failed(rid, step, frame.plan, reason, node_id)
        else:
            self.pipeline.fail_node(node_id, reason)

    # ================================================================== monitoring

    async def _monitor_loop(self) -> None:
        timeout = self.config.scheduler.fault_tolerance.heartbeat_timeout
        last_reconnect = 0.0
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            now = time.monotonic()
            stalled_s, last_tick = now - last_tick - MONITOR_INTERVAL_S, now
            if stalled_s > STALL_S:
                # This loop was held (a GC, a burst of work) and read no frame meanwhile: the
                # heartbeats that came are still unread in the sockets. The time it could not listen
                # does not count against the nodes.
                log.warning("the coordinator's event loop was held for %.1f s", stalled_s)
                for handle in self.nodes.values():
                    handle.last_heartbeat_s = min(now, handle.last_heartbeat_s + stalled_s)
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
            try:
                await self.replan(reason)
            except Exception:  # the cluster still cannot serve: the notice says why; the next change tries again
                log.info("no plan after %s", reason, exc_info=True)
            return
        preview = await self.preview(Command(Action.REBALANCE))
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
            preview = await self.preview(Command(Action.REBALANCE))
            if preview.moves and not preview.error:
                if lb.auto_rebalance:
                    await self.apply(preview)
                else:
                    self._notice("info", f"stage times are imbalanced (std/mean {coefficient:.2f}): press R to rebalance")

    def _measured_balance(self) -> float:
        """std/mean of the stages' measured times per token on the plan in force, from the frames'
        timing (exo_tui/cluster/metrics.py; the figure the console shows); 0 before any."""
        return (self.metrics.balance(self.ring.version) if self.ring is not None else None) or 0.0

    async def _link_loop(self) -> None:
        while True:
            await asyncio.sleep(LINK_PROBE_INTERVAL_S)
            try:
                await self._probe_links()
            except Exception:  # the links keep their last values; the next round probes again
                log.warning("probing the links failed", exc_info=True)

    async def _probe_links(self) -> None:
        """Latency of every ordered pair of live nodes (the scheduler needs every link)."""
        live = [h for h in self.nodes.values() if h.connected and h.state != "failed"]

        async def probe(a: NodeHandle, b: NodeHandle) -> None:
            try:
                if (conn := a.live_conn) is None:
                    raise ConnectionError(f"{a.name} is not connected")
                link = await call(conn, LinkProbe(b.host, b.port, pings=3), Link, timeout=10)
            except (RemoteError, ConnectionError, TimeoutError):
                self.metrics.link_probed(a.node_id, b.node_id, None)
                return
            self.metrics.link_probed(a.node_id, b.node_id, link.rtt_s)
            a.links[b.node_id] = link.latency_s
            if link.bandwidth_bytes_per_s is not None:
                a.link_bandwidth[b.node_id] = link.bandwidth_bytes_per_s

        await asyncio.gather(*(probe(a, b) for a in live for b in live if a is not b))
