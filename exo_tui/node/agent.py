"""The node agent: ``exo-tui node``. Serves shards to a coordinator over the wire protocol.

Operations (frame ``type`` → what the node does):

==============  ===============================================================================
``attach``      the sender becomes this node's coordinator (heartbeats and tokens go to it);
                replies with the profile, the shards held and the plans known
``profile``     replies with the profile (``--print-profile`` prints the same)
``load``        load layers ``[start, end)`` from a GGUF path on this host
``load_begin``  weights of a shard will stream in: tensor list, total bytes
``load_chunk``  a chunk of those bytes with its SHA-256 (a bad chunk is refused: send it again)
``load_commit`` build the shard from the streamed weights
``unload``      free a shard
``plan``        a ring plan this node takes part in (frames name the plan version they are for)
``forward``     one step of one request through this node's layers; the hidden state goes
                straight to the next hop, or the last hop samples and sends ``token`` to the
                coordinator. A step for a plan this node does not hold is refused. ``adopt``:
                a finished request whose caches this one takes over (its conversation's prefix);
                ``logprobs`` (k): the token's logprobs and its k likeliest alternatives' come
                with it; ``score`` (``top``, ``targets``): the last hop scores the prompt, each
                of ``targets`` given the tokens before it, and the ``token`` frame carries the
                scores as its tensor; ``ahead`` (n): the last hop hands the token it drew
                straight to the first hop as the next step's, n times (``handed`` steps), the
                coordinator told of each token in parallel (the hand-off)
``kv_export``   a request's KV cache for some layers, as one tensor
``kv_import``   install a request's KV cache (from another node, maybe another backend)
``drop``        forget a request's caches
``ping``        replies at once (link latency)
``link_probe``  measure latency (and bandwidth, on request) to another node
==============  ===============================================================================

Nothing in a frame is ever executed: the type selects one of these functions, and the body holds
plain values.

Here: the lifecycle, the operations above, and heartbeats. Elsewhere: where a step's result
goes (the next hop, the coordinator, the hand-off to the first hop) in :mod:`exo_tui.node.routing`,
the steps' queue, worker thread, batches and what a run does (cache adoption, truncation, scoring,
sampling) in :mod:`exo_tui.node.executor`, the rules of batch formation in
:mod:`exo_tui.node.batching` (pure), what the last hop adds to a step in
:mod:`exo_tui.node.sampling_step`, the shards, plans and weight transfers in
:mod:`exo_tui.node.host`, every body sent or received as a type in :mod:`exo_tui.net.messages`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from backends import default_backend_name, get_backend
from backends.base import PREFILL_CHUNK, BackendError, ModelConfig
from backends.memory import prefill_rows
from exo_tui.models.gguf_file import ModelFileError, TensorInfo
from exo_tui.net import messages as wire
from exo_tui.net.codec import Message, reply
from exo_tui.net.connection import Connection
from exo_tui.net.errors import RemoteError
from exo_tui.net.frame import Frame
from exo_tui.net.loop import loop_name
from exo_tui.net.protocol import (
    DRAFT_TAG,
    FILL_QUEUED,
    HostError,
    kv_from_array,
    kv_shape,
    kv_to_array,
)
from exo_tui.net.server import serve
from exo_tui.net.timing import measure_link
from exo_tui.node import sensors
from exo_tui.node.drafting import NodeDrafts
from exo_tui.node.executor import Step, StepExecutor
from exo_tui.node.fencing import Fence
from exo_tui.node.host import ShardHost
from exo_tui.node.kv_budget import (
    RESERVE_MIN_BYTES,
    KVBudget,
    ShardCost,
    ShardKey,
    shard_cost,
)
from exo_tui.node.profile import (
    NodeProfile,
    RequestRates,
    benchmark,
    device_profile,
    live_metrics,
    process_rss_bytes,
    runs_on,
)
from exo_tui.node.routing import FINISHED_MEMORY, StepRouting
from exo_tui.node.sampling_step import Samplers

log = logging.getLogger("exo_tui.node")

HEARTBEAT_INTERVAL_S = 1.0


class NodeAgent(StepRouting):
    def __init__(
        self,
        *,
        name: str,
        host: str = "0.0.0.0",
        port: int = 52416,
        backend: str | None = None,
        memory_limit_bytes: int | None = None,
        security: Any = None,
        advertise: bool = False,
        run_benchmark: bool = True,
        parent_pid: int | None = None,
        sock: Any = None,
    ) -> None:
        self.name = name
        self.bind_host = host
        self.port = port
        self.listen_sock = sock  # bound already (net.server.listening_socket): served instead of host:port
        self.backend = backend or default_backend_name()
        self.memory_limit_bytes = memory_limit_bytes
        self.security = security
        self.advertise = advertise
        self.run_benchmark = run_benchmark
        self.parent_pid = parent_pid
        self.profile: NodeProfile | None = None
        self.host: ShardHost | None = None
        self.coordinator: Connection | None = None
        self.fence = Fence()  # the newest coordinator term seen (exo_tui.node.fencing)
        self._server: Any = None
        self._peers: dict[tuple[str, int], Connection] = {}
        self._peer_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self.decode_steps = 0  # one-position steps run, and their runs' time: this node's own timing
        self.decode_compute_s = 0.0
        # Loading weights takes seconds: it runs beside the worker, so the node keeps serving
        # its current shards while it loads the next plan's (a drain or rebalance does not stall).
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exo-node-loader")
        self.samplers = Samplers()  # the last hop's: each request's, from its first step here until it ends
        self._stats = RequestRates()  # each request's tokens drawn here and their rate
        self._finished: OrderedDict[str, None] = OrderedDict()  # requests ended for good
        # request -> the lead of the latest step the coordinator sent it: its handed steps run
        # while it is theirs (a newer step, a drop or the request's end discards them)
        self._leads: OrderedDict[str, int | None] = OrderedDict()
        self._handing: set[asyncio.Task[Any]] = set()  # handed steps on their way to this node's own first hop
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = asyncio.Event()
        self._advertiser: Any = None
        self._started_s = time.monotonic()
        self.kv = KVBudget(memory_limit_bytes)  # the bytes KV caches may take here, and what they hold
        # the queue, the worker thread, batch formation, and what a run does to each step
        self.executor = StepExecutor(self.kv, self.samplers, self._finished, self._deliver, self._superseded)
        self.drafts = NodeDrafts(self.backend, self.kv)  # a draft model, where the coordinator asks this node to run one

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        profile = await loop.run_in_executor(None, device_profile, self.name, self.memory_limit_bytes)
        if self.backend not in profile.backends:
            raise BackendError(
                f"backend {self.backend} is not available on this node (available: {', '.join(profile.backends) or 'none'})"
            )
        await loop.run_in_executor(None, runs_on, profile, self.backend)
        # The runtime's own memory (Python, NumPy, the backend imported and checked: runs_on
        # measures it) is not what --memory-limit gives to models: the process may hold the limit
        # above it. Taken before the benchmark (cached, so run on a first start only) and any shard.
        self.kv.baseline_bytes = profile.runtime_baseline_bytes
        if self.run_benchmark:
            profile = await loop.run_in_executor(None, lambda: benchmark(profile, backends=[self.backend]))
        self.profile = profile
        self.host = ShardHost(profile.node_id, self.backend, room=self._load_room)
        self.executor.start(self.host)
        self._shards_changed()
        # Forward frames are handled in the read loop (no hand-off to a lane task): _op_forward
        # either queues the step or runs a decode step at once, and never awaits anything slow.
        self._server = await serve(self._handle, self.bind_host, self.port, security=self.security,
                                   inline_types=("forward",), sock=self.listen_sock)
        self.port = getattr(self._server, "port", self.port)
        self._tasks.append(asyncio.create_task(self._work_loop(), name="node-worker"))
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="node-heartbeat"))
        if self.advertise:
            await self._start_advertiser()
        log.info("node %s (%s) serving on %s:%d with %s, on %s", self.name, profile.node_id, self.bind_host,
                 self.port, self.backend, loop_name())

    async def _start_advertiser(self) -> None:
        try:
            from exo_tui.discovery.mdns import NodeAdvertiser
        except ImportError:
            log.warning("mDNS advertising is not available in this build")
            return
        assert self.profile is not None
        from exo_tui.discovery.mdns import cluster_fingerprint

        ca = getattr(self.security, "ca_cert_pem", None)
        self._advertiser = NodeAdvertiser(
            cluster=cluster_fingerprint(ca) if ca else "",
            node_id=self.started_profile.node_id,
            name=self.name,
            port=self.port,
            backends=self.started_profile.backends,
            memory_bytes=self.started_profile.offered_memory_bytes(),
        )
        await self._advertiser.start()

    async def stop(self) -> None:
        """Refuse new steps, finish the one running, close every socket."""
        self._stopping.set()
        if self._advertiser is not None:
            with contextlib.suppress(Exception):  # stopping: a withdrawn record times out on its own
                await self._advertiser.stop()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):  # stopping: the listener is closed either way
                await self._server.wait_closed()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):  # each loop logged its own failure
                await task
        for conn in list(self._peers.values()):
            with contextlib.suppress(Exception):  # stopping: a peer notices the closed socket anyway
                await conn.aclose()
        for step in self.executor.drain():
            await self._fail_step(step, "node is shutting down")
        self.executor.close()
        self.drafts.close()
        self._loader.shutdown(wait=True)
        if self.host is not None:
            self.started_host.unload_all()

    async def run_until_signalled(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self._stopping.set)
        await self.start()
        if self.parent_pid:
            self._tasks.append(asyncio.create_task(self._watch_parent(), name="node-parent"))
        print(f"exo-tui node {self.name} ({self.started_profile.node_id}) listening on port {self.port}", flush=True)
        await self._stopping.wait()
        await self.stop()

    async def _watch_parent(self) -> None:
        """A node started by a coordinator (``--local-nodes``) stops when that process is gone,
        however it ended (even ``kill -9``)."""
        import os

        while os.getppid() == self.parent_pid:
            await asyncio.sleep(1.0)
        log.warning("the coordinator that started this node (pid %s) is gone: stopping", self.parent_pid)
        self._stopping.set()

    # ------------------------------------------------------------------ dispatch

    async def _handle(self, conn: Connection, frame: Frame) -> Frame | None:
        op = _OPS.get(frame.type)
        if op is None:
            raise RemoteError(f"unknown operation {frame.type!r}")
        if frame.type != "attach":
            self.fence.check(conn, frame.type)
        handler, message = op
        msg = message.decode(frame.body)  # the one place a body is read: BadBody names what does not fit
        try:
            return await handler(self, conn, frame, msg)
        except HostError as exc:
            raise RemoteError(str(exc), code=exc.code, detail=exc.detail) from exc
        except (ModelFileError, BackendError, KeyError, ValueError, TypeError) as exc:
            raise RemoteError(str(exc)) from exc

    async def _op_attach(self, conn: Connection, frame: Frame, msg: wire.Attach) -> Frame:
        self.fence.attach(conn, msg.term)
        self.coordinator = conn
        return reply(self._state())

    async def _op_profile(self, conn: Connection, frame: Frame, msg: wire.ProfileAsk) -> Frame:
        return reply(wire.Profile(self.profile.to_dict() if self.profile else {}))

    def _state(self) -> wire.Attached:
        assert self.profile is not None and self.host is not None
        # kv: what the process holds now: the first plan counts the room it leaves
        return wire.Attached(self.profile.to_dict(), self.started_host.describe(), sorted(self.started_host.plans), self.port,
                        self._kv_report())

    async def _op_load(self, conn: Connection, frame: Frame, msg: wire.Load) -> Frame:
        hosted = await self._in_loader(self.started_host.load_from_file, msg.path, msg.start, msg.end, msg.backend,
                                       msg.model, msg.context)
        self._shards_changed()
        return self._loaded(hosted)

    async def _op_load_begin(self, conn: Connection, frame: Frame, msg: wire.LoadBegin) -> Frame:
        tensors = [TensorInfo(t.name, t.type, tuple(t.shape), t.nbytes) for t in msg.tensors]
        config = ModelConfig.from_wire(msg.config)
        self.started_host.begin_transfer(msg.transfer_id, config, msg.start, msg.end, msg.backend, tensors, msg.model)
        return reply(wire.Done())

    async def _op_load_chunk(self, conn: Connection, frame: Frame, msg: wire.LoadChunk) -> Frame:
        transfer = self.started_host.transfers.get(msg.transfer_id)
        if transfer is None:
            raise HostError(f"no transfer {msg.transfer_id} in progress: send load_begin first")
        transfer.add_chunk(msg.offset, bytes(frame.payload or b""), msg.sha256)
        return reply(wire.ChunkReceived(transfer.received))

    async def _op_load_commit(self, conn: Connection, frame: Frame, msg: wire.LoadCommit) -> Frame:
        transfer = self.started_host.transfers.get(msg.transfer_id)
        if transfer is not None and transfer.model.startswith(DRAFT_TAG):  # a draft model's weights
            draft = await self.drafts.install(self.started_host.take_transfer(msg.transfer_id))
            self._shards_changed()
            return reply(wire.Loaded(0, draft.config.n_layers, draft.backend, draft.nbytes, draft.nbytes,
                                     self._kv_report()))
        hosted = await self._in_loader(self.started_host.commit_transfer, msg.transfer_id)
        self._shards_changed()
        return self._loaded(hosted)

    def _loaded(self, hosted: Any) -> Frame:
        """The reply to a load: the shard, and the KV budget measured after it (the coordinator
        admits against it at once, not after the next heartbeat: the last one may have been
        taken mid-load, when the budget was nil)."""
        return reply(wire.Loaded(hosted.start, hosted.end, hosted.backend, hosted.nbytes, hosted.held_bytes,
                            self._kv_report()))

    async def _op_unload(self, conn: Connection, frame: Frame, msg: wire.Unload) -> Frame:
        done = await self.executor.in_worker(self.started_host.unload, msg.start, msg.end, msg.model)
        self._shards_changed()
        return reply(wire.Unloaded(done, self._kv_report()))

    async def _op_plan(self, conn: Connection, frame: Frame, msg: wire.PlanOp) -> Frame:
        plan = msg.plan.check()
        self.started_host.add_plan(plan)
        self.executor.batching.shared_cores = plan.on_loopback()  # the newest plan is the one steps are moving to
        return reply(wire.Plans(sorted(self.started_host.plans)))

    async def _op_forward(self, conn: Connection, frame: Frame, msg: wire.Forward) -> None:
        if self._stopping.is_set():
            raise HostError(f"node {self.name} is shutting down")
        if frame.plan is None:
            raise HostError("a forward frame must name its plan version")
        if msg.rid in self._finished:
            return None  # the request ended while this step was on its way
        plan, _, _ = self.started_host.hop(frame.plan, msg.hop)  # refuse early: unknown plan, wrong node, shard missing
        if msg.handed:
            if self._superseded(msg):
                return None  # the coordinator sent the request a newer step (or dropped it) since
        else:
            self._lead(msg.rid, msg.lead)
        if (adopt := msg.adopt) is not None:  # the finished request whose caches this one takes over: its own state goes
            self.samplers.forget(adopt)
            self._stats.forget(adopt)
            self.executor.forget(adopt)
        await self.executor.arrived(Step(conn, frame, msg), next_ready=self._next_ready(plan, msg.hop))
        return None

    async def _op_kv_export(self, conn: Connection, frame: Frame, msg: wire.KVExport) -> Frame:
        if msg.length is not None and msg.length < 0:
            raise HostError(f"kv_export's length must be a number of positions, not {msg.length}")
        cache = await self.executor.in_worker(self.started_host.export_kv, msg.rid, msg.start, msg.end, msg.model, msg.length)
        return reply(wire.KV(*kv_shape(cache)), tensor=kv_to_array(cache))

    async def _op_kv_import(self, conn: Connection, frame: Frame, msg: wire.KVImport) -> Frame:
        start, end = msg.start, msg.end
        cache = kv_from_array(start, end, np.array(frame.tensor, copy=True), msg.length, msg.held)

        def install() -> None:
            hosted = self.started_host.shard_for_layers(start, end, msg.model)
            if (hosted.start, hosted.end) != (start, end):
                raise HostError(f"KV for layers [{start}, {end}) must cover the whole shard [{hosted.start}, {hosted.end})")
            hosted.shard.import_kv(msg.rid, cache)
            self.kv.record(msg.rid, hosted.key, cache.length)

        await self.executor.in_worker(install)
        return reply(wire.Done())

    async def _op_drop(self, conn: Connection, frame: Frame, msg: wire.Drop) -> Frame:
        """Forget a request's caches. ``final``: the request has ended, so a step of it still
        queued or in flight here is discarded rather than run (it would leave a cache behind)."""
        rid = msg.rid
        if msg.final:
            self._finished[rid] = None
            while len(self._finished) > FINISHED_MEMORY:
                self._finished.popitem(last=False)
        self.samplers.forget(rid)
        self._stats.forget(rid)
        self.executor.forget(rid)
        self._leads.pop(rid, None)  # its handed steps still on their way are discarded
        await self.executor.in_worker(self.started_host.drop, rid)
        self.kv.drop(rid)
        await self.drafts.drop(rid)
        return reply(wire.Done())

    async def _op_draft_step(self, conn: Connection, frame: Frame, msg: wire.DraftStep) -> Frame:
        if self._stopping.is_set():
            raise HostError(f"node {self.name} is shutting down")
        model = self.drafts.model
        try:
            return reply(await self.drafts.step(msg, np.asarray(frame.tensor if frame.tensor is not None else [],
                                                                np.int64)))
        finally:
            if self.drafts.model is not model:  # loaded here: the weights are the runtime's, measured again
                self._shards_changed()

    async def _op_ping(self, conn: Connection, frame: Frame, msg: wire.Ping) -> Frame:
        return reply(wire.Pong(msg.t, self.profile.node_id if self.profile else ""))

    async def _op_link_probe(self, conn: Connection, frame: Frame, msg: wire.LinkProbe) -> Frame:
        return reply(await measure_link(await self._peer(msg.host, msg.port), msg.pings, msg.bandwidth_bytes))

    # ------------------------------------------------------------------ the worker

    async def _in_loader(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._loader, fn, *args)

    async def _work_loop(self) -> None:
        """Run the executor's loop: every step waiting, one batch per shard, results sent on."""
        try:
            await self.executor.work()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the worker loop stopped")
            raise

    def _shards_changed(self) -> None:
        """The shards held changed: the bytes a cache position takes on each, and the memory the
        process holds besides caches, measured again."""
        import psutil

        per_position: dict[ShardKey, ShardCost | int] = {}
        with self.started_host.lock:  # the loader thread installs shards under it
            hosted_all = list(self.started_host.shards.items())
        for key, hosted in hosted_all:
            c = hosted.shard.config
            per_position[key] = shard_cost(c.n_kv_heads, c.head_dim, hosted.start, hosted.end,
                                           get_backend(hosted.backend).kv_value_bytes(), hosted.shard.ring_layers,
                                           c.ring_rows)
        self.kv.set_shards(per_position)
        self.kv.observe(process_rss_bytes(), psutil.virtual_memory().available, settled=True)
        # under a limit, a prompt's chunks small enough for their temporaries to fit the reserve
        room = self.kv.step_room_bytes
        for _, hosted in hosted_all:
            hosted.shard.prefill_chunk = prefill_rows(hosted.shard.config, room, FILL_QUEUED)

    def _kv_report(self) -> dict[str, Any]:
        """The KV budget's report, and the rows a step of a prompt should carry at most here: its
        shards' prefill chunks (under a limit, what the reserve holds of a step's temporaries), so
        that the coordinator sends a long prompt through the ring a chunk at a time: whole, its
        hidden states received and sent (rows x hidden floats each, a few copies) would not fit."""
        report = self.kv.report()
        with self.started_host.lock:
            chunks = [h.shard.prefill_chunk for h in self.started_host.shards.values()]
        report["prefill_rows"] = min(chunks, default=PREFILL_CHUNK)
        return report

    def _load_room(self) -> int | None:
        """The bytes a shard's load may take here: what the process may hold (its runtime's
        baseline plus the memory limit) less what it holds now (runtime, weights, caches) and the
        KV budget's least reserve; None without a limit."""
        if (limit := self.kv.process_limit_bytes) is None:
            return None
        return limit - process_rss_bytes() - RESERVE_MIN_BYTES

    # ------------------------------------------------------------------ heartbeats

    async def _heartbeat_loop(self) -> None:
        try:
            await self._heartbeats()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("heartbeats stopped")
            raise

    async def _heartbeats(self) -> None:
        import psutil

        psutil.cpu_percent(interval=None)
        last_busy, last_t = 0.0, time.monotonic()
        while True:
            slept = time.monotonic()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            lag = time.monotonic() - slept - HEARTBEAT_INTERVAL_S
            if lag > 0.5:
                log.warning("event loop was blocked for %.2f s: heartbeat late", lag)
            if self.coordinator is None or self.coordinator.is_closed:
                continue
            now = time.monotonic()
            metrics = live_metrics(self.memory_limit_bytes)
            self.kv.observe(metrics["process_rss_bytes"], psutil.virtual_memory().available)
            metrics["kv"] = self._kv_report()
            ex = self.executor
            metrics.update(ex.report())
            metrics["decode_steps"], metrics["decode_compute_s"] = self.decode_steps, self.decode_compute_s
            metrics.update(sensors.read())
            ex.batching.prune(now)
            metrics["busy_fraction"] = (ex.batching.busy_s - last_busy) / max(now - last_t, 1e-6)
            # the CPU its runs take a second (the coordinator's ratio of the two: a quota's bound)
            metrics["busy_s"], metrics["cpu_time_s"] = ex.batching.busy_s, time.process_time()
            last_busy, last_t = ex.batching.busy_s, now
            metrics["requests"] = self._stats.report(now)
            metrics["draft"] = self.drafts.metrics()
            metrics["shards"] = [s.to_body() for s in self.started_host.describe()] if self.host else []
            await self._to_coordinator(wire.Heartbeat(metrics, time.time()))


_OPS: dict[str, tuple[Any, type[Message]]] = {  # a frame's type: its handler, and the message its body holds
    "attach": (NodeAgent._op_attach, wire.Attach),
    "profile": (NodeAgent._op_profile, wire.ProfileAsk),
    "load": (NodeAgent._op_load, wire.Load),
    "load_begin": (NodeAgent._op_load_begin, wire.LoadBegin),
    "load_chunk": (NodeAgent._op_load_chunk, wire.LoadChunk),
    "load_commit": (NodeAgent._op_load_commit, wire.LoadCommit),
    "unload": (NodeAgent._op_unload, wire.Unload),
    "plan": (NodeAgent._op_plan, wire.PlanOp),
    "forward": (NodeAgent._op_forward, wire.Forward),
    "kv_export": (NodeAgent._op_kv_export, wire.KVExport),
    "kv_import": (NodeAgent._op_kv_import, wire.KVImport),
    "drop": (NodeAgent._op_drop, wire.Drop),
    "draft_step": (NodeAgent._op_draft_step, wire.DraftStep),
    "ping": (NodeAgent._op_ping, wire.Ping),
    "link_probe": (NodeAgent._op_link_probe, wire.LinkProbe),
}
