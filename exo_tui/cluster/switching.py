"""Plan switching and KV moves: the scheduler's view of the nodes, previews of a change, and
:meth:`PlanSwitching._switch` — new shards loaded while the old plan serves, the switch at a token
boundary with every in-flight request's KV cache moved to its new home (or left to be rebuilt from
its tokens), old shards unloaded — and the pipeline's callbacks (the plan in force, failed steps).

A part of :class:`~exo_tui.cluster.coordinator.Coordinator`, which holds the state it reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from backends.base import PREFILL_CHUNK
from backends.memory import LOAD_CHUNK_BYTES, LOAD_PEAK_DECODED
from exo_tui import events as ev
from exo_tui.cluster.kv_moves import KVMoves
from exo_tui.cluster.node_handle import NodeHandle, held_bytes
from exo_tui.cluster.ring_steps import StepFailure
from exo_tui.cluster.room import REPLANS_AFTER_REFUSAL, is_refusal, limit_needed
from exo_tui.cluster.view import (
    LayerMove,
)
from exo_tui.cluster.weights import load_from_path, stream_shard
from exo_tui.config import GB
from exo_tui.inference.generate import GenerationError
from exo_tui.net.address import is_loopback
from exo_tui.net.codec import call
from exo_tui.net.errors import RemoteError
from exo_tui.net.messages import Loaded, Ping, PlanOp, Plans, Pong
from exo_tui.net.protocol import (
    FILL_QUEUED,
    PlanEntry,
    RingPlan,
)
from exo_tui.node.kv_budget import RESERVE_MIN_BYTES, process_budget_bytes
from exo_tui.node.profile import NodeProfile
from exo_tui.scheduler.calibration import Measurements, calibrate, measured_constraints
from exo_tui.scheduler.context import InfeasiblePlan
from exo_tui.scheduler.diff import ChangePreview, plan_diff, preview_change
from exo_tui.scheduler.even import even_plan
from exo_tui.scheduler.partition import make_plan
from exo_tui.scheduler.plan import Constraints, Pin, Plan
from exo_tui.scheduler.profile import DeviceProfile, Link
from exo_tui.scheduler.spec import ModelSpec

if TYPE_CHECKING:
    from exo_tui.models.model import Model

log = logging.getLogger("exo_tui.cluster")

class PlanSwitching(KVMoves):
    """The plan in force and every change of it (a part of the Coordinator)."""

    # ================================================================== planning

    def device_profiles(self, spec: ModelSpec | None = None, limit_bytes: int | None = None, *,
                        measured: bool = True) -> list[DeviceProfile]:
        """The nodes as the scheduler sees them, for planning ``spec`` (a load's peak is the
        model's: the one served by default): their start-up figures corrected by what the ring
        measures (``measured=False``: the start-up ones). ``limit_bytes``: as if every
        memory-limited node had that limit (what limit would serve: cluster/room.py)."""
        now = time.monotonic()
        rc = self.config.scheduler.resource_reservation
        planned = spec or self.spec
        kquant = bool(planned and planned.kquant)  # the planned model's layers pick the timings
        out = []
        for h in self.nodes.values():
            p = h.profile
            backend = self._node_backend(h)
            timing = p.layer_timing.get(backend)
            decode_s, prefill_s, ref_bytes = timing.for_model(kquant) if timing else (0, 0, 0)
            held = sum(held_bytes(s) for s in h.shards) + (self.draft.held_on(h) if self.draft is not None else 0)
            avail = int(h.metrics.get("ram_available_bytes", p.ram_available_bytes)) + held
            total = p.ram_total_bytes
            limit = (limit_bytes or p.memory_limit_bytes) if p.memory_limit_bytes else 0
            if limit:
                # The limit is what the node gives to models, above its runtime's resident memory
                # at start (its baseline): what the runtime grew since, besides its shards' bytes
                # (measured: node/kv_budget.py), is not offered. Add the reserves back so the
                # scheduler's usable memory equals what is left.
                # A load's peak beside its shard's arrays (node/host.py) is not offered either, nor
                # the least reserve the node keeps out of its KV budget (node/kv_budget.py): offered,
                # a plan could give a node layers whose caches at the served context it cannot hold.
                # The model's file opened grows it too, and refusals say more (cluster/room.py).
                grown = (self.room_notes.growth(h, self._model_key) + self._load_peak_bytes(backend, spec)
                         + RESERVE_MIN_BYTES)
                avail = int(min(avail, limit - grown) + rc.system_reserved_ram * GB + rc.emergency_reserve * total)
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
                    decode_s_per_layer={backend: decode_s} if timing else {},
                    prefill_s_per_layer_token={backend: prefill_s} if timing else {},
                    compute_ref_layer_bytes=ref_bytes,
                    kv_value_bytes={backend: p.kv_value_bytes},
                    memory_bandwidth_bytes_per_s=p.memory_bandwidth_bytes_per_s or 10e9,
                    load_factor=0.0,
                    benchmark_score=1.0 / decode_s if decode_s > 0 else 1.0,
                    power_state="battery" if h.metrics.get("on_battery") else "active",
                    links={peer: Link(lat, h.link_bandwidth.get(peer, 1e9)) for peer, lat in h.links.items()},
                    last_heartbeat=h.last_heartbeat_s if h.state != "failed" else now - 1e9,
                    drained=h.node_id in self.drained,
                    failed=h.state == "failed",
                    memory_limited=bool(p.memory_limit_bytes),
                    # held back by it, its step times hold the quota's wait up to the layers it held then;
                    # beyond, the bound counts (calibrate.py's heartbeat, prediction.py's cpu_bounds)
                    cpu_quota_cores=quota if isinstance(quota := h.metrics.get("cpu_quota_cores"), (int, float)) else None,
                    host_id=p.hostname,
                )
            )
        if planned is None or not measured:
            return out
        return calibrate(out, planned, self.measured())  # measured, then planned

    def measured(self) -> Measurements:
        """What the ring measured (:meth:`Calibrator.measurements`), each node's host named."""
        return self.calibrator.measurements({h.node_id: h.profile.hostname for h in self.nodes.values()})

    def _load_peak_bytes(self, backend: str, spec: ModelSpec | None = None) -> int:
        """What a load of ``spec``'s model (by default the served one) on ``backend`` takes at its
        peak beside its shard's arrays, as the node counts it (the spec's, from the file; a layer
        decoded whole where the spec does not say: backends/base.py's load_peak_bytes)."""
        spec = spec or self.spec
        if spec is None:
            return 0
        known = dict(spec.load_peaks)
        if backend in known:
            return known[backend]
        return int(LOAD_PEAK_DECODED * max(spec.layers, default=0)) + LOAD_CHUNK_BYTES

    def _node_backend(self, h: NodeHandle) -> str:
        return h.profile.backend or (h.profile.backends or ["onnx"])[0]

    def constraints(self, *, drained: set[str] | None = None, pins: dict[str, Pin] | None = None) -> Constraints:
        """Pins, drains and failures for the scheduler. A pin on a failed node, or on one not in
        the cluster, cannot hold: it is left out (and kept, to apply again when the node returns);
        see :meth:`broken_pins`."""
        failed = frozenset(n for n, h in self.nodes.items() if h.state == "failed")
        pins = pins if pins is not None else self.pins
        draft = self.draft.need() if self.draft is not None else None  # counted on its node (scheduler/draft.py)
        return measured_constraints(Constraints(
            pins=tuple(p for n, p in pins.items() if n in self.nodes and n not in failed),
            drained=frozenset(drained if drained is not None else self.drained),
            failed=failed,
            draft=draft,
        ), self.measured())

    def _preview(self, constraints: Constraints, profiles: list[DeviceProfile] | None = None) -> ChangePreview:
        """The plan the scheduler would choose now, and what switching to it would move.
        ``profiles``: :meth:`device_profiles`, taken by a caller that plans on another thread
        (the ring's steps feed the figures on the event loop's; read there, they are not read
        while they change)."""
        if self.strategy == "even":
            return self._even_preview(constraints, profiles=profiles)
        return preview_change(
            self.plan,
            self.device_profiles() if profiles is None else profiles,
            self._served_spec(),
            constraints,
            self.config.scheduler,
            now=time.monotonic(),
            strategy=self.strategy,
        )

    def _served_spec(self) -> ModelSpec:
        if self.spec is None:
            raise GenerationError("the coordinator has no model loaded yet")
        return self.spec

    def _even_preview(self, constraints: Constraints, *, spec: ModelSpec | None = None,
                      current: Plan | None | Literal[True] = True,
                      profiles: list[DeviceProfile] | None = None) -> ChangePreview:
        """Layers split evenly over the live, undrained nodes in the order they joined
        (``exo-tui chat --nodes``: the operator's order is the ring); see :mod:`exo_tui.scheduler.even`.
        ``spec``/``current``: another model's and no plan (a model switch), instead of the served
        model's and its plan."""
        spec = spec or self._served_spec()
        old = self.plan if current is True else current
        live = [h for h in self.nodes.values() if h.state != "failed" and h.node_id not in constraints.drained]
        version = (old.version + 1) if old else 1
        try:
            plan = even_plan([h.node_id for h in live], {h.node_id: self._node_backend(h) for h in live},
                             {p.node_id: p for p in (self.device_profiles(spec) if profiles is None else profiles)},
                             spec, constraints,
                             self.config.scheduler, version)
        except InfeasiblePlan as exc:
            return ChangePreview(None, None, error=str(exc))
        diff = plan_diff(old, plan, spec, constraints.failed)
        before = old.predictions.tok_per_s_single if old and old.predictions else 0.0
        after = plan.predictions.tok_per_s_single if plan.predictions else 0.0
        return ChangePreview(plan, diff, (), before, after)

    def _plan_alive(self) -> bool:
        return self.plan is not None and all(
            s.node_id in self.nodes and self.nodes[s.node_id].state != "failed" for s in self.plan.shards
        )

    async def replan(self, reason: str, *, move_kv: bool = True, unload_later: bool = False) -> Plan:
        """Make the best plan for the cluster as it is and switch to it. A node that refuses its
        load for want of room said how much it has: the plan is made again with that
        (:mod:`exo_tui.cluster.room`), and if none fits, the cluster cannot serve.
        ``unload_later``: see :meth:`_switch`."""
        for attempt in range(REPLANS_AFTER_REFUSAL + 1):
            preview = self._preview(self.constraints())
            if preview.error or preview.new_plan is None:
                self._cannot_serve(preview.error or "no plan")
                raise GenerationError(self._serve_error)
            try:
                await self._switch(preview.new_plan, reason, move_kv=move_kv, unload_later=unload_later)
            except RemoteError as exc:
                if not is_refusal(exc):
                    raise
                if attempt == REPLANS_AFTER_REFUSAL:
                    self._cannot_serve(f"the nodes refused their loads {attempt + 1} times ({exc})")
                    raise GenerationError(self._serve_error) from None
                log.info("a node refused its load (%s): planning again with the room it reported", exc)
                continue
            return preview.new_plan
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _cannot_serve(self, why: str) -> None:
        free = sum(
            max(0, h.memory_available_bytes) for h in self.nodes.values() if h.state != "failed" and h.node_id not in self.drained
        )
        # the weights as the live nodes' backends hold them (the least of those); the caches: as the reason counts them
        live: set[str | None] = {self._node_backend(h) for h in self.nodes.values() if h.state != "failed"} or {None}
        weights = min(self.spec.range_bytes(0, self.spec.n_layers, 0, b) for b in live) if self.spec is not None else 0
        held = "" if self.spec is None or weights == self.spec.weight_bytes else f", {self.spec.weight_bytes / 1e9:.2f} GB in its file"
        self._serve_error = (f"the cluster cannot serve the model: {why} (free {free / 1e9:.2f} GB on live nodes; "
                             f"its weights alone take {weights / 1e9:.2f} GB{held}){self._limit_hint()}")
        self._plan_ready.set()  # waiting steps wake up and fail with the error
        self._notice("error", self._serve_error)

    def _limit_hint(self) -> str:
        """Where the live nodes are memory-limited: the least limit each would need to serve."""
        limited = [h for h in self.nodes.values() if h.state != "failed" and h.profile.memory_limit_bytes]
        spec = self.spec
        if spec is None or not limited or self.strategy == "even":
            return ""
        now = time.monotonic()

        def fits(limit: int) -> bool:
            try:
                make_plan(self.device_profiles(limit_bytes=limit), spec, self.strategy, self.constraints(),
                          self.config.scheduler, now=now)
            except InfeasiblePlan:
                return False
            return True

        low = max(h.profile.memory_limit_bytes or 0 for h in limited)
        need = limit_needed(fits, low, max(low, 4 * spec.total_bytes + (1 << 30)))
        if need is None:
            return ""
        return f": give each node a memory limit of {need / 1e9:.2f} GB or more (--memory-limit, --local-memory-limit)"

    async def _switch(self, new: Plan, reason: str, *, move_kv: bool = True, unload_later: bool = False) -> None:
        """Load, switch at a token boundary, move KV, unload (see the module doc).

        ``unload_later``: return once the new plan is in force, the old shards unloading in a task
        of their own (after a failure the steps waiting for this plan resume at once: the
        unload's round trip, 13-38 ms, is not part of the stall).

        A node whose memory limit cannot hold its new shards beside the ones it serves now is
        *short*: it swaps them during the pause instead (the in-flight caches are read from its
        old shards first, then those unload, then the new ones load), so the pause lasts its load;
        its limit is never passed, and the answer goes on."""
        async with self._plan_lock:
            began = time.monotonic()
            old_plan, old_ring = self.plan, self.ring
            same = old_plan is not None and self._plan_alive() and old_plan.shards == new.shards
            if same and not self._serve_error:
                if old_plan is not None and old_plan.draft != new.draft:  # the draft model placed anew: no shard moves
                    self.plan = replace(old_plan, draft=new.draft, predictions=new.predictions, reasons=new.reasons)
                self._plan_ready.set()
                self._refresh_states()
                return
            self._version = max(self._version, old_plan.version if old_plan else 0) + 1
            new = new.with_version(self._version)
            ring = self._ring_for(new)
            moves = _moves(old_plan, new, self._served_spec())
            # 1. load what is missing, max_task_migration at a time, while the old plan serves
            missing = [e for e in ring.ring if (e.start, e.end) not in self.nodes[e.node_id].held]
            short = self._short_of_room(missing)
            await self._load_entries([e for e in missing if e.node_id not in short], short)
            swapped = [e for e in missing if e.node_id in short]
            conns = [self.connection(e.node_id) for e in ring.ring]
            await asyncio.gather(*(call(conn, PlanOp(ring), Plans, timeout=30) for conn in conns))
            # 2. switch at a token boundary: no new step starts; wait for the ones running
            self._plan_ready.clear()
            paused = time.monotonic()
            try:
                await self._idle.wait()
                swap = (lambda: self._swap_shards(swapped, ring, old_ring)) if swapped else None
                # 3. move the KV caches of requests in flight (short nodes swap their shards between
                # reading and writing them)
                if move_kv and old_ring is not None and self._plan_alive():
                    await self._move_kv(old_ring, ring, swap)
                elif swap is not None:
                    await swap()
                self.plan, self.ring = new, ring
                self._serve_error = ""
            finally:
                self._plan_ready.set()
            resumed = time.monotonic()
            # 4. unload what the new plan does not use, once steps have resumed: the nodes held the
            # old shards beside the new ones while both plans' shards loaded (a node short of room
            # swapped its shards during the pause instead, above); drained nodes become drained
            if unload_later:
                unloading = asyncio.create_task(self._unload_after_switch())
                self._tasks = [t for t in self._tasks if not t.done()] + [unloading]  # stop() cancels it
            else:
                await self._unload_unused(ring)
            self._refresh_states()
            if self.store is not None:
                self.store.save_plan(new.version, str(self.model.path) if self.model else "", new.to_dict())
            swapped_ids = sorted({e.node_id for e in swapped})
            diff = {"moves": [m.__dict__ for m in moves], "bytes_moved": sum(m.nbytes for m in moves),
                    "swapped": swapped_ids}
            self.events.publish(ev.PlanChanged(version=new.version, plan=new.to_dict(), diff=diff, reason=reason))
            self._touch()
            log.info("plan %d in force (%s): %s%s; %d shards loaded in %.3f s, steps paused %.3f s", new.version, reason,
                     new.layout, f"; swapped on {', '.join(swapped_ids)} (short of memory)" if swapped else "",
                     len(missing), paused - began, resumed - paused)

    async def _unload_after_switch(self) -> None:
        """Unload what the plan in force does not use, once the steps the switch woke were sent
        (they run first on the nodes), under the plan lock (a switch that comes meanwhile sees
        the shards as they are, and this unloads against the plan then in force)."""
        await asyncio.sleep(0)  # the woken steps' frames go out first; only the order, not the outcome, rests on it
        async with self._plan_lock:
            if self.ring is not None:
                await self._unload_unused(self.ring)
                self._refresh_states()

    def _short_of_room(self, missing: list[PlanEntry]) -> set[str]:
        """The nodes whose missing shards do not fit beside the shards they hold, under what their
        process may hold (its runtime's baseline plus its memory limit) as their last KV report
        gives it (what the process holds besides caches, the caches, the budget's least reserve)."""
        need: dict[str, int] = {}
        for e in missing:
            backend = self._node_backend(self.nodes[e.node_id])
            need[e.node_id] = need.get(e.node_id, 0) + self._served_spec().range_bytes(e.start, e.end, 0, backend)
        short = set()
        for node_id, nbytes in need.items():
            h = self.nodes[node_id]
            kv = h.metrics.get("kv") or {}
            limit = process_budget_bytes(int(kv.get("limit_bytes") or 0), int(kv.get("runtime_baseline_bytes", 0)))
            if not h.held or limit is None:
                continue
            room = limit - int(kv.get("runtime_bytes", 0)) - int(kv.get("used_bytes", 0)) - RESERVE_MIN_BYTES
            if nbytes + self._load_peak_bytes(self._node_backend(h)) > room:
                short.add(node_id)
        return short

    async def _load_entries(self, entries: list[PlanEntry], short: set[str] | None = None) -> None:
        """Load ``entries``, max_task_migration at a time. A node that refuses for want of room
        (its memory grew since its report) joins ``short`` where one is given; any other failure
        (and without ``short``, that one too) is raised once the batch's other loads are done."""
        limit = max(1, self.config.scheduler.load_balancing.max_task_migration)
        for i in range(0, len(entries), limit):
            batch = entries[i : i + limit]
            results = await asyncio.gather(*(self._ensure_shard(e) for e in batch), return_exceptions=True)
            for e, result in zip(batch, results, strict=True):
                if is_refusal(result):
                    self.room_notes.refused(self.nodes[e.node_id], result, self._model_key)
                if short is not None and is_refusal(result):
                    log.info("node %s: %s; it swaps its shards during the pause", e.node_id, result)
                    short.add(e.node_id)
                elif isinstance(result, BaseException):
                    raise result

    async def _swap_shards(self, entries: list[PlanEntry], ring: RingPlan, old_ring: RingPlan | None) -> None:
        """On nodes short of memory: unload what ``ring`` does not use, then load ``entries``. If a
        load fails, the old shards load again (the old plan serves on) and the error is raised."""
        nodes = {e.node_id for e in entries}
        await self._unload_unused(ring, nodes)
        try:
            await self._load_entries(entries)
        except BaseException:
            back = [e for e in (old_ring.ring if old_ring else ()) if e.node_id in nodes
                    and (e.start, e.end) not in self.nodes[e.node_id].held]
            keep = {(e.node_id, e.start, e.end) for e in (old_ring.ring if old_ring else ())}
            for e in entries:  # what did load makes room for the old shards
                if (e.node_id, e.start, e.end) not in keep and (e.start, e.end) in self.nodes[e.node_id].held:
                    await self._unload(self.nodes[e.node_id], e.start, e.end)
            with contextlib.suppress(RemoteError, ConnectionError, TimeoutError):
                await self._load_entries(back)
            for rid in self.pipeline.in_flight():  # their caches on those nodes went with the old shards
                self.pipeline.forget_cached(rid)
            raise

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

    def _ring_for(self, plan: Plan, model_key: str | None = None) -> RingPlan:
        """The ring as nodes see it. A node the coordinator reaches on loopback is named, for
        the others, by the address this host has on their network."""
        handles = [self.nodes[s.node_id] for s in plan.shards]
        outward = next((c.local_address for h in handles if not is_loopback(h.host) and (c := h.live_conn) is not None), "")
        entries = []
        for s, h in zip(plan.shards, handles, strict=True):
            host = outward if outward and is_loopback(h.host) else h.host
            entries.append(PlanEntry(s.node_id, host, h.port, s.start, s.end, s.backend or self._node_backend(h)))
        return RingPlan(plan.version, plan.n_layers, tuple(entries), self._model_key if model_key is None else model_key)

    async def _ensure_shard(self, entry: PlanEntry) -> None:
        assert self.model is not None
        body = await self._load_shard(entry, self.model, self._model_key)
        self.room_notes.loaded(entry.node_id, self._model_key)
        h = self.nodes[entry.node_id]
        h.held.add((entry.start, entry.end))
        h.shards = [s for s in h.shards if (s["start"], s["end"]) != (entry.start, entry.end)]
        h.shards.append(_shard_record(entry, body, self._model_key))

    async def _load_shard(self, entry: PlanEntry, model: Model, key: str) -> Loaded:
        """Load ``entry``'s layers of ``model`` on its node, under the tag ``key`` (from the file
        where the node can read it, else streamed), with the node's state and progress published."""
        h = self.nodes[entry.node_id]
        conn = self.connection(entry.node_id)
        prior = h.state
        h.state = "loading"
        self.events.publish(ev.NodeStateChanged(node_id=h.node_id, state="loading", reason=f"layers {entry.start}-{entry.end - 1}"))
        try:
            context = self.served_context_of(model)
            if self._use_path(h):
                body = await load_from_path(conn, str(model.path), entry.start, entry.end, entry.backend, key, context)
                self.events.publish(ev.ShardProgress(node_id=h.node_id, start=entry.start, end=entry.end,
                                                     done_bytes=body.nbytes, total_bytes=body.nbytes))
            else:
                def progress(done: int, total: int) -> None:
                    self.events.publish(ev.ShardProgress(node_id=h.node_id, start=entry.start, end=entry.end, done_bytes=done, total_bytes=total))

                body = await stream_shard(conn, model.gguf, entry.start, entry.end, entry.backend, progress=progress, tag=key,
                                          context=context)
        finally:
            if h.state == "loading":
                h.state = prior if prior != "loading" else "ready"
        h.note_kv(body.kv)
        return body

    def reads_model_files(self, node_id: str) -> bool:
        """Whether the node reads the model files at the coordinator's paths (else they are streamed)."""
        h = self.nodes.get(node_id)
        return h is not None and self._use_path(h)

    def _use_path(self, h: NodeHandle) -> bool:
        if self.weights_mode != "auto":
            return self.weights_mode == "path"
        return is_loopback(h.host) and h.profile.hostname == socket.gethostname()

    async def _unload_unused(self, ring: RingPlan, nodes: set[str] | None = None) -> None:
        """Unload every shard ``ring`` does not use (on ``nodes`` only, when given), all nodes at once."""
        keep = {(e.node_id, e.start, e.end) for e in ring.ring}
        await asyncio.gather(*(
            self._unload(h, start, end)
            for h in self.nodes.values() if h.connected and (nodes is None or h.node_id in nodes)
            for start, end in list(h.held) if (h.node_id, start, end) not in keep
        ))

    async def _unload(self, h: NodeHandle, start: int, end: int) -> None:
        with contextlib.suppress(RemoteError, ConnectionError, TimeoutError):
            assert h.conn is not None
            await h.unload(start, end, self._model_key)
        h.held.discard((start, end))
        h.shards = [s for s in h.shards if (s["start"], s["end"]) != (start, end)]

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

    def prefill_rows(self, plan: RingPlan) -> int:
        """The rows a step of a prompt carries at most through ``plan``'s ring: the fewest its
        nodes' last KV reports ask for (``prefill_rows``: under a limit, what the reserve holds of
        a step's temporaries; else ``PREFILL_CHUNK``)."""
        rows = [int((self.nodes[e.node_id].metrics.get("kv") or {}).get("prefill_rows") or PREFILL_CHUNK)
                for e in plan.ring if e.node_id in self.nodes]
        return max(1, min(rows, default=PREFILL_CHUNK))

    def fill_window(self, plan: RingPlan) -> int:
        """How many of a long prompt's chunks to keep in flight through ``plan``'s ring: as many as
        its nodes can run at once, ``FILL_QUEUED + 1`` at most. A machine runs as many of its
        nodes at once as its cores hold their threads (at least one): more would only take the
        cores from each other. Three local nodes on 2 cores, a 2,000-token prompt: of one thread
        each, two at once, its first token 1.6x sooner (1.63-1.68 s against 2.55-2.67 one chunk
        at a time); of two threads each, all three at once made it 8 % later (so one at a time)."""
        machines: dict[str, list[NodeProfile]] = {}
        for e in plan.ring:
            handle = self.nodes.get(e.node_id)
            if handle is not None:
                host = "loopback" if is_loopback(e.host) else e.host
                machines.setdefault(host, []).append(handle.profile)
        at_once = sum(max(1, min(len(ps), min(p.cpu_cores for p in ps) // max(_threads(p) for p in ps)))
                      for ps in machines.values())
        return max(1, min(at_once, FILL_QUEUED + 1))

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
            conn = h.live_conn if h is not None else None
            if conn is None:
                return e.node_id
            try:
                await call(conn, Ping(time.time()), Pong, timeout=1.0)
            except (RemoteError, ConnectionError, TimeoutError):
                return e.node_id
        return None


def _shard_record(entry: PlanEntry, loaded: Loaded, key: str) -> dict[str, Any]:
    """What the coordinator keeps of a shard a node loaded (as the node's describe() says it)."""
    return {"start": entry.start, "end": entry.end, "backend": loaded.backend, "nbytes": loaded.nbytes,
            "held_bytes": loaded.held_bytes or loaded.nbytes, "model": key}


def _moves(old: Plan | None, new: Plan, spec: ModelSpec) -> list[LayerMove]:
    diff = plan_diff(old, new, spec)
    return [LayerMove(m.start, m.end, m.src, m.dst, m.nbytes) for m in diff.moves]


def _threads(profile: NodeProfile) -> int:
    """The threads a node's steps run on (its engine's, else all of its machine's cores)."""
    try:
        return max(1, int(profile.engine.get("threads") or profile.cpu_cores))
    except (TypeError, ValueError):
        return max(1, profile.cpu_cores)
