"""The coordinator: owns the cluster state and the plan, drives generation, survives failures.

It is embedded in the console by default and headless with ``exo-tui serve``; either way front
ends see it only through :class:`~exo_tui.cluster.view.ClusterControl` and its event bus.

Plan changes (drain, undrain, pin, unpin, rebalance, a node joining or failing) all go through
:meth:`~exo_tui.cluster.switching.PlanSwitching._switch`: the new shards are loaded while the old
plan keeps serving; then, at a token boundary (no step in flight), every in-flight request's KV
cache is moved to its new home (exported and imported, across backends too) — or, where that is
impossible, left to be rebuilt from the request's token history; the new plan comes into force;
old shards are unloaded.

This module is the facade: the state, its start and stop, and generation. The rest is in parts
named for what they hold, which :class:`Coordinator` combines:
:class:`~exo_tui.cluster.membership.Membership` (nodes joining, their frames, heartbeats, failures,
discovery), :class:`~exo_tui.cluster.switching.PlanSwitching` (plans, switching, KV moves, the
pipeline's callbacks), :class:`~exo_tui.cluster.actions.OperatorActions` (commands, their audit,
bootstrap, the model) and :class:`~exo_tui.cluster.snapshots.Snapshots` (what front ends see).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

from backends import default_backend_name
from exo_tui import events as ev
from exo_tui.cluster import model_choices, model_switch
from exo_tui.cluster.actions import OperatorActions
from exo_tui.cluster.admission import (
    CAPACITY_WAIT_S,
    Admission,
    AdmittedRunner,
    QueueFull,
    ring_kv_capacity,
    wait_for_plan,
    with_queue_notes,
)
from exo_tui.cluster.calibrate import Calibrator
from exo_tui.cluster.drafting import ClusterDraft
from exo_tui.cluster.following import Following
from exo_tui.cluster.joining import JoinEndpoint, reaches_beyond_loopback
from exo_tui.cluster.local_nodes import LocalNode, spawn_node, stop_node, wait_ready
from exo_tui.cluster.membership import Membership
from exo_tui.cluster.metrics import ClusterMetrics
from exo_tui.cluster.node_handle import NodeHandle
from exo_tui.cluster.pipeline import RemotePipeline
from exo_tui.cluster.room import RoomNotes
from exo_tui.cluster.snapshots import Snapshots
from exo_tui.cluster.store import StateStore
from exo_tui.cluster.switching import PlanSwitching
from exo_tui.cluster.view import (
    ChatChunk,
    ChatParams,
    HostView,
)
from exo_tui.config import Config, load_config
from exo_tui.inference.generate import Chunk, GenerationError, generate
from exo_tui.inference.request import Request
from exo_tui.inference.speculation import Speculation, StepCosts
from exo_tui.models.model import Model
from exo_tui.models.spec import served_context, spec_from_gguf
from exo_tui.net.address import split_host_port
from exo_tui.net.protocol import RingPlan
from exo_tui.net.security import Security, ensure_cluster, write_node_bundle
from exo_tui.node.profile import process_rss_bytes
from exo_tui.paths import exo_home
from exo_tui.scheduler.calibration import FollowState
from exo_tui.scheduler.plan import Pin, Plan


class Coordinator(Membership, PlanSwitching, OperatorActions, Snapshots, Following):
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
        join: bool = False,  # serve the join endpoint (network.join): exo-tui serve and the console do
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
        self.spec = None
        self.plan: Plan | None = None
        self.ring: RingPlan | None = None
        self.pins: dict[str, Pin] = {}
        self.drained: set[str] = set()
        self.retry_limit = self.config.scheduler.fault_tolerance.task_retry_limit
        # Speculative decoding for requests that do not say (exo_tui.inference.speculation):
        # off, auto or a fixed number of drafted tokens; ``exo-tui serve --speculative``.
        self.speculative: str | int = "auto"
        self.draft: ClusterDraft | None = None  # a draft model (``--draft``, exo_tui.cluster.drafting)
        self._step_costs: tuple[int | None, StepCosts] = (None, StepCosts())  # the plan's, by its version
        self.pipeline = RemotePipeline(self)
        self.pipeline.window = lambda: self.model.config.at_context(self.context_length).ring_window if self.model is not None else 0
        self.pipeline.context = lambda: self.context_length  # a hand-off lease stays within it ...
        self.pipeline.halt_on = lambda: self.model.tokenizer.eos_ids if self.model is not None else frozenset()  # ... and stops at EOS
        adm = self.config.admission
        self.admission = Admission(lambda: ring_kv_capacity(self.ring, self.nodes), queue_bound=adm.queue_bound,
                                   kv_share=adm.kv_share, kept=self.pipeline.kept_positions,
                                   forget_kept=self.pipeline.forget_kept,
                                   capacity_for=lambda n: ring_kv_capacity(self.ring, self.nodes, n),
                                   kept_requests=self.pipeline.kept_requests)
        self.metrics = ClusterMetrics()  # measured figures (exo_tui/cluster/metrics.py)
        self.room_notes = RoomNotes()  # what nodes' refused loads said of their room (exo_tui/cluster/room.py)
        self.calibrator = Calibrator()  # the scheduler's measured figures (exo_tui/cluster/calibrate.py)
        self.pipeline.on_step_timed = self._step_timed
        self._remeasured: tuple[int, float] | None = None  # (plan version, its prediction on the measured figures)
        self._follow_state = FollowState()
        self._gap_noted: tuple[int, float] | None = None  # (plan version, measured tok/s) of the gap last shown
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
        self.discovery = None
        self.discovered: dict[str, ev.NodeDiscovered] = {}  # nodes seen but not joined (foreign ones too)
        self.join = join and self.config.network.join.enabled
        self.joining: JoinEndpoint | None = None
        self._specs = model_choices.SpecCache(self.config.models.context_length)  # of the catalog's models, for the picker
        self._model_key = ""  # the tag nodes keep the served model's shards under (model_switch.model_key)
        self.term = 0  # the Raft term this coordinator leads in (exo_tui.cluster.leadership); 0: a single coordinator
        self.coordinator_set: Any = None  # its CoordinatorSet when it leads one (its join endpoint admits coordinators)

    # ================================================================== lifecycle

    async def start(self) -> None:
        cluster = await asyncio.to_thread(ensure_cluster, self.home)
        self.security = cluster.security(enable_tls=self.config.network.security.enable_tls)
        before, opened = process_rss_bytes(), 0
        if self.model is None:  # a coordinator set's new leader comes with the model its process opened
            self.model = await asyncio.to_thread(lambda: Model(self.model_name, paths=self.config.models.paths))
            opened = process_rss_bytes() - before
        model = self.model
        _ = await asyncio.to_thread(lambda: model.tokenizer)
        before = process_rss_bytes()
        self.spec = spec_from_gguf(model.gguf, context_limit=self.config.models.context_length)
        # what a node loading from the file will grow by before its first load is checked: the
        # file opened, its shards' bytes counted (cluster/room.py)
        self.room_notes.open_bytes = max(0, opened) + max(0, process_rss_bytes() - before)
        self._model_key = await asyncio.to_thread(model_switch.model_key, model.path)
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
        if self.join:
            await self._start_join_endpoint()
        self._tasks.append(asyncio.create_task(self._monitor_loop(), name="coordinator-monitor"))
        self._tasks.append(asyncio.create_task(self._link_loop(), name="coordinator-links"))
        self._tasks.append(asyncio.create_task(self._follow_loop(), name="coordinator-follow"))
        self._tasks.append(asyncio.create_task(self.metrics.follow(self.events), name="coordinator-metrics"))
        if self.nodes:
            await self._probe_links()
            if broken := self.broken_pins():
                self._notice("warning", f"the pin of {', '.join(broken)} cannot hold until the node joins")
            if not await self._adopt_saved_plan():
                await self.replan("initial plan")

    async def _start_join_endpoint(self) -> None:
        endpoint = JoinEndpoint(self)
        cfg = self.config.network.join
        try:
            await endpoint.start(cfg.host, cfg.port)
        except OSError as exc:
            self._notice("warning", f"the join endpoint cannot listen on {cfg.host}:{cfg.port} "
                                    f"({exc.strerror or exc}): `exo-tui node --join` will not reach this coordinator; "
                                    "set network.join.port, or stop what holds the port")
            return
        self.joining = endpoint

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
            listen = "0.0.0.0" if self.peers or self.discover or (self.join and reaches_beyond_loopback(self.config)) \
                else "127.0.0.1"
            self._local.append(
                spawn_node(name, backend=backend, key_file=str(bundle), memory_limit_gb=limit, log_dir=log_dir,
                           env={"EXO_TUI_HOME": str(self.home)}, extra_args=extra, listen=listen)
            )
        await asyncio.gather(*(wait_ready(n) for n in self._local))

    async def stop(self, *, release: bool = True) -> None:
        """Stop, closing the nodes' connections; ``release``: also drop the finished requests'
        caches on the nodes (a leader stepping down does not: the new leader drives them now)."""
        self._stopping = True
        if self.joining is not None:
            with contextlib.suppress(Exception):
                await self.joining.close()
        if self.discovery is not None:
            with contextlib.suppress(Exception):  # stopping: a browser that fails to close changes nothing
                await self.discovery.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):  # each loop logged its own failure
                await task
        with contextlib.suppress(Exception):  # nodes that outlive this coordinator keep no finished caches
            if release:
                async with asyncio.timeout(5.0):
                    await self.pipeline.forget_kept()
        for handle in self.nodes.values():
            if handle.conn is not None:
                with contextlib.suppress(Exception):  # stopping: the node notices the closed socket anyway
                    await handle.conn.aclose()
        await asyncio.gather(*(asyncio.to_thread(stop_node, n) for n in self._local))
        if self.store is not None:
            self.store.close()

    async def __aenter__(self) -> Coordinator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ================================================================== generation

    @property
    def context_length(self) -> int:
        """The context the served model runs at (:meth:`served_context_of`); 0 before a model is loaded."""
        return 0 if self.model is None else self.served_context_of(self.model)

    def served_context_of(self, model: Model) -> int:
        """The context ``model`` runs at here, in tokens (a request's prompt and answer): its
        file's, or ``models.context_length`` where that is shorter."""
        return served_context(model.config.context_length, self.config.models.context_length)

    def serve_error(self) -> str:
        """Why a request cannot be served now and what to do; empty when it can."""
        if self._serve_error:
            return self._serve_error
        if self.ring is None:
            return ("the cluster has no plan yet: no node serves the model (start a node agent, "
                    "add one with --peer, or undrain one)")
        return ""

    async def generate(self, request: Request,
                       on_queued: Callable[[int], None] | None = None) -> AsyncGenerator[Chunk, None]:
        """Chunks of ``request``'s answer (see :func:`exo_tui.inference.generate.generate`), once
        admission lets it run (:mod:`exo_tui.cluster.admission`; ``on_queued(n)`` while it waits
        with ``n`` requests ahead)."""
        await wait_for_plan(self, self.config.admission.plan_wait_s)
        await self.admission.known(CAPACITY_WAIT_S)
        assert self.model is not None
        ticket = self.admission.ticket(request, self.context_length)
        self.metrics.started(request)
        arrived = time.monotonic()
        try:
            await self.admission.enter(ticket, on_queued=on_queued)
        except BaseException:
            self.metrics.ended(request)
            raise
        self.metrics.queue_wait(time.monotonic() - arrived)
        self._active[request.id] = request
        self.pipeline.pin_model(request.id, self._model_key)  # its prompt's tokens are this model's
        if request.speculation is None:
            mode = request.speculative if request.speculative is not None else self.speculative
            request.speculation = Speculation.for_request(mode, request.predicted,
                                                          seeded=not request.sampling.greedy and request.seeded)
        if request.speculation is not None and self.draft is not None:
            self.draft.attach(request.speculation, request.id, request.sampling)
        if request.speculation is not None:
            request.speculation.streams = lambda: len(self._active)
            request.speculation.costs = self.step_costs()
        chunks = generate(AdmittedRunner(self.pipeline, self.admission, ticket), self.model.tokenizer, request,
                          context_length=self.context_length)
        try:
            # aclosing: the caches are released before the request's room goes to the next one
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if chunk.token_id is not None:
                        self._tok_times.append(time.monotonic())
                        self.metrics.token(request)
                        self.events.publish(ev.TokenStreamed(request_id=request.id, token_id=chunk.token_id,
                                                             text=chunk.text))
                    yield chunk
        finally:
            self._active.pop(request.id, None)
            self.admission.leave(ticket)
            self.metrics.ended(request)

    def step_costs(self) -> StepCosts:
        """The cost of a verify step's rows on the plan in force, as its streams measure it (a
        new plan starts a new measure)."""
        version = self.ring.version if self.ring is not None else None
        if self._step_costs[0] != version:
            self._step_costs = (version, StepCosts())
        return self._step_costs[1]

    def new_request(self, messages: list[dict[str, str]], params: ChatParams) -> Request:
        assert self.model is not None
        sampling = params.sampling(self.model.sampling)
        predicted = self.model.tokenizer.encode(params.prediction, add_special=False, parse_special=False) \
            if params.prediction else None
        return Request(self.model.chat_prompt_ids(messages), sampling.with_seed(), params.max_tokens,
                       tuple(params.stop), speculative=params.speculative, predicted=predicted,
                       seeded=sampling.seed is not None)

    async def chat(self, messages: list[dict[str, str]], params: ChatParams) -> AsyncGenerator[ChatChunk, None]:
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
        except QueueFull as exc:  # counted as rejected (metrics), not failed
            finish, error = "rejected", str(exc)
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
        stats = request.speculation.stats if request.speculation is not None else None
        yield ChatChunk(
            finish_reason=finish or "stop", prompt_tokens=len(request.prompt_ids), completion_tokens=len(request.generated),
            drafted_tokens=stats.drafted if stats else 0, accepted_tokens=stats.accepted if stats else 0,
            ttft_s=request.ttft_s, tok_per_s=request.decode_tok_per_s, nodes=nodes, error=error,
        )


__all__ = ["Coordinator"]
