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
                scores as its tensor
``kv_export``   a request's KV cache for some layers, as one tensor
``kv_import``   install a request's KV cache (from another node, maybe another backend)
``drop``        forget a request's caches
``ping``        replies at once (link latency)
``link_probe``  measure latency (and bandwidth, on request) to another node
==============  ===============================================================================

Nothing in a frame is ever executed: the type selects one of these functions, and the body holds
plain values.

Why one module of ~830 lines: its sections (lifecycle, the operations above, the worker, batch
formation, heartbeats) all read and write one object's state: the queue, the worker thread, the
peers and the requests seen. What stands alone is elsewhere: the rules of batch formation in
:mod:`exo_tui.node.batching` (pure), what the last hop adds to a step (the sampled token, its
logprobs, a prompt's scores) in :mod:`exo_tui.node.sampling_step`, the shards, plans and weight
transfers in :mod:`exo_tui.node.host`, the wire types in :mod:`exo_tui.net.protocol`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends import default_backend_name, get_backend
from backends.base import PREFILL_CHUNK, BackendError, ModelConfig, prefill_rows
from exo_tui.inference.sampling import TokenLogprobs, scores_to_array
from exo_tui.models.gguf_file import ModelFileError, TensorInfo
from exo_tui.net.client import connect
from exo_tui.net.connection import Connection
from exo_tui.net.errors import RemoteError
from exo_tui.net.frame import Frame
from exo_tui.net.loop import loop_name
from exo_tui.net.protocol import FILLED, HostError, RingPlan, kv_fields, kv_from_array, kv_to_array
from exo_tui.net.server import serve
from exo_tui.net.timing import hop_timing
from exo_tui.node import sensors
from exo_tui.node.batching import Batching, decodes_first, one_step_a_key
from exo_tui.node.host import ShardHost
from exo_tui.node.kv_budget import RESERVE_MIN_BYTES, BudgetExceeded, KVBudget, shard_cost
from exo_tui.node.profile import (
    NodeProfile,
    benchmark,
    device_profile,
    live_metrics,
    process_rss_bytes,
    runs_on,
)
from exo_tui.node.sampling_step import Samplers, score_prompt

log = logging.getLogger("exo_tui.node")

HEARTBEAT_INTERVAL_S = 1.0
FINISHED_MEMORY = 10_000  # ended requests remembered, so late steps of theirs are discarded
INLINE_MAX_ROWS = 8  # a step of at most this many positions may run on the event loop's thread
_DISCARDED = object()


@dataclass
class _Step:
    """One request's step waiting for this node's worker."""

    conn: Connection
    frame: Frame
    hop: int
    received_s: float = field(default_factory=time.monotonic)
    deferred: bool = False  # a prompt that already let one run of decode steps go first
    started_s: float = 0.0  # when the run that computed it started (monotonic)
    compute_s: float = 0.0  # that run's time

    @property
    def rows(self) -> int:
        """Positions this step computes: 1 for a decode step, the prompt's length for a prefill."""
        tensor = self.frame.tensor
        return int(np.shape(tensor)[0]) if tensor is not None and np.ndim(tensor) else 1

    @property
    def key(self) -> tuple[str, int]:
        """The request and hop this step is for (what ``Batching.visits`` is keyed by)."""
        return str(self.frame.body.get("rid")), self.hop


STREAMING_S = 3.0  # a request is streaming while its last token is this recent


@dataclass
class _RequestStats:
    tokens: int = 0
    first_s: float = field(default_factory=time.monotonic)
    last_s: float = field(default_factory=time.monotonic)


class NodeAgent:
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
    ) -> None:
        self.name = name
        self.bind_host = host
        self.port = port
        self.backend = backend or default_backend_name()
        self.memory_limit_bytes = memory_limit_bytes
        self.security = security
        self.advertise = advertise
        self.run_benchmark = run_benchmark
        self.parent_pid = parent_pid
        self.profile: NodeProfile | None = None
        self.host: ShardHost | None = None
        self.coordinator: Connection | None = None
        self._server: Any = None
        self._peers: dict[tuple[str, int], Connection] = {}
        self._peer_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._queue: deque[_Step] = deque()
        self._wakeup = asyncio.Event()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exo-node-worker")
        self._jobs: set[Future[Any]] = set()  # submitted to the worker and not finished
        self._burst: dict[Connection, int] = {}  # steps announced by a sender as following at once
        self.batch_sizes: Counter[int] = Counter()  # steps per forward run (inline runs count as 1)
        self.inline_steps = 0
        self.decode_steps = 0  # one-position steps run, and their runs' time: this node's own timing
        self.decode_compute_s = 0.0
        self.batching = Batching()  # visits, recent run time and the rules of batch formation
        # Loading weights takes seconds: it runs beside the worker, so the node keeps serving
        # its current shards while it loads the next plan's (a drain or rebalance does not stall).
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exo-node-loader")
        self.samplers = Samplers()  # the last hop's: each request's, from its first step here until it ends
        self._stats: dict[str, _RequestStats] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # requests ended for good
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = asyncio.Event()
        self._advertiser: Any = None
        self._started_s = time.monotonic()
        self.kv = KVBudget(memory_limit_bytes)  # the bytes KV caches may take here, and what they hold

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
        self._shards_changed()
        # Forward frames are handled in the read loop (no hand-off to a lane task): _op_forward
        # either queues the step or runs a decode step at once, and never awaits anything slow.
        self._server = await serve(self._handle, self.bind_host, self.port, security=self.security,
                                   inline_types=("forward",))
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
            node_id=self.profile.node_id,
            name=self.name,
            port=self.port,
            backends=self.profile.backends,
            memory_bytes=self.profile.offered_memory_bytes(),
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
        while self._queue:
            step = self._queue.popleft()
            await self._fail_step(step, "node is shutting down")
        self._worker.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        if self.host is not None:
            self.host.unload_all()

    async def run_until_signalled(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self._stopping.set)
        await self.start()
        if self.parent_pid:
            self._tasks.append(asyncio.create_task(self._watch_parent(), name="node-parent"))
        print(f"exo-tui node {self.name} ({self.profile.node_id}) listening on port {self.port}", flush=True)
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
        try:
            return await op(self, conn, frame)
        except HostError as exc:
            raise RemoteError(str(exc), code=exc.code) from exc
        except (ModelFileError, BackendError, KeyError, ValueError, TypeError) as exc:
            raise RemoteError(str(exc)) from exc

    async def _op_attach(self, conn: Connection, frame: Frame) -> Frame:
        self.coordinator = conn
        return Frame("attached", body=self._state_body())

    async def _op_profile(self, conn: Connection, frame: Frame) -> Frame:
        return Frame("profile", body={"profile": self.profile.to_dict() if self.profile else {}})

    def _state_body(self) -> dict[str, Any]:
        assert self.profile is not None and self.host is not None
        return {
            "profile": self.profile.to_dict(),
            "shards": self.host.describe(),
            "plans": sorted(self.host.plans),
            "port": self.port,
        }

    async def _op_load(self, conn: Connection, frame: Frame) -> Frame:
        b = frame.body
        hosted = await self._in_loader(self.host.load_from_file, b["path"], int(b["start"]), int(b["end"]), b.get("backend"),
                                       str(b.get("model", "")), int(b.get("context") or 0))
        self._shards_changed()
        return self._loaded(hosted)

    async def _op_load_begin(self, conn: Connection, frame: Frame) -> Frame:
        b = frame.body
        tensors = [TensorInfo(t["name"], t["type"], tuple(t["shape"]), int(t["nbytes"])) for t in b["tensors"]]
        config = ModelConfig.from_wire(b["config"])
        self.host.begin_transfer(b["transfer_id"], config, int(b["start"]), int(b["end"]), b.get("backend"), tensors,
                                 str(b.get("model", "")))
        return Frame("ok")

    async def _op_load_chunk(self, conn: Connection, frame: Frame) -> Frame:
        b = frame.body
        transfer = self.host.transfers.get(b["transfer_id"])
        if transfer is None:
            raise HostError(f"no transfer {b['transfer_id']} in progress: send load_begin first")
        transfer.add_chunk(int(b["offset"]), bytes(frame.payload or b""), str(b["sha256"]))
        return Frame("ok", body={"received": transfer.received})

    async def _op_load_commit(self, conn: Connection, frame: Frame) -> Frame:
        hosted = await self._in_loader(self.host.commit_transfer, frame.body["transfer_id"])
        self._shards_changed()
        return self._loaded(hosted)

    def _loaded(self, hosted: Any) -> Frame:
        """The reply to a load: the shard, and the KV budget measured after it (the coordinator
        admits against it at once, not after the next heartbeat: the last one may have been
        taken mid-load, when the budget was nil)."""
        return Frame("loaded", body={"start": hosted.start, "end": hosted.end, "backend": hosted.backend,
                                     "nbytes": hosted.nbytes, "held_bytes": hosted.held_bytes,
                                     "kv": self._kv_report()})

    async def _op_unload(self, conn: Connection, frame: Frame) -> Frame:
        model = frame.body.get("model")
        done = await self._in_worker(self.host.unload, int(frame.body["start"]), int(frame.body["end"]),
                                     None if model is None else str(model))
        self._shards_changed()
        return Frame("ok", body={"unloaded": done, "kv": self._kv_report()})

    async def _op_plan(self, conn: Connection, frame: Frame) -> Frame:
        plan = RingPlan.from_dict(frame.body["plan"])
        self.host.add_plan(plan)
        self.batching.shared_cores = plan.on_loopback()  # the newest plan is the one steps are moving to
        return Frame("ok", body={"plans": sorted(self.host.plans)})

    async def _op_forward(self, conn: Connection, frame: Frame) -> None:
        if self._stopping.is_set():
            raise HostError(f"node {self.name} is shutting down")
        if frame.plan is None:
            raise HostError("a forward frame must name its plan version")
        hop = int(frame.body["hop"])
        if frame.body.get("rid") in self._finished:
            return None  # the request ended while this step was on its way
        plan, _, _ = self.host.hop(frame.plan, hop)  # refuse early: unknown plan, wrong node, shard missing
        adopt = frame.body.get("adopt")
        if type(adopt) is str:  # the finished request whose caches this one takes over: its own state goes
            self.samplers.forget(adopt)
            self._stats.pop(adopt, None)
            self.batching.forget(adopt)
        step = _Step(conn, frame, hop)
        key = step.key
        self.batching.arrived(key, step.received_s)
        more = frame.body.get("more")
        if type(more) is int and more > 0:  # more steps of the previous hop's batch follow at once
            self._burst[conn] = more
        else:
            self._burst.pop(conn, None)
        if self._inline_ok(step, key) and self._next_ready(plan, hop):
            await self._run_inline(step)
        else:
            self._queue.append(step)
            self._wakeup.set()
        return None

    async def _op_kv_export(self, conn: Connection, frame: Frame) -> Frame:
        b = frame.body
        model = b.get("model")
        cache = await self._in_worker(self.host.export_kv, b["rid"], int(b["start"]), int(b["end"]),
                                      None if model is None else str(model))
        return Frame("kv", body=kv_fields(cache), tensor=kv_to_array(cache))

    async def _op_kv_import(self, conn: Connection, frame: Frame) -> Frame:
        b = frame.body
        start, end = int(b["start"]), int(b["end"])
        cache = kv_from_array(start, end, np.array(frame.tensor, copy=True), b)

        def install() -> None:
            model = b.get("model")
            hosted = self.host.shard_for_layers(start, end, None if model is None else str(model))
            if (hosted.start, hosted.end) != (start, end):
                raise HostError(f"KV for layers [{start}, {end}) must cover the whole shard [{hosted.start}, {hosted.end})")
            hosted.shard.import_kv(b["rid"], cache)
            self.kv.record(b["rid"], hosted.key, cache.length)

        await self._in_worker(install)
        return Frame("ok")

    async def _op_drop(self, conn: Connection, frame: Frame) -> Frame:
        """Forget a request's caches. ``final``: the request has ended, so a step of it still
        queued or in flight here is discarded rather than run (it would leave a cache behind)."""
        rid = frame.body["rid"]
        if frame.body.get("final"):
            self._finished[rid] = None
            while len(self._finished) > FINISHED_MEMORY:
                self._finished.popitem(last=False)
        self.samplers.forget(rid)
        self._stats.pop(rid, None)
        self.batching.forget(rid)
        await self._in_worker(self.host.drop, rid)
        self.kv.drop(rid)
        return Frame("ok")

    async def _op_ping(self, conn: Connection, frame: Frame) -> Frame:
        return Frame("pong", body={"t": frame.body.get("t"), "node_id": self.profile.node_id if self.profile else ""})

    async def _op_link_probe(self, conn: Connection, frame: Frame) -> Frame:
        b = frame.body
        peer = await self._peer(b["host"], int(b["port"]))
        rtts = []
        for _ in range(int(b.get("pings", 5))):
            t0 = time.perf_counter()
            await peer.call("ping", {"t": t0}, timeout=5)
            rtts.append(time.perf_counter() - t0)
        result: dict[str, Any] = {"latency_s": float(np.median(rtts)) / 2, "rtt_s": float(np.median(rtts))}
        nbytes = int(b.get("bandwidth_bytes", 0))
        if nbytes:
            blob = bytes(nbytes)
            t0 = time.perf_counter()
            await peer.call("ping", {"t": t0}, payload=blob, timeout=30)
            elapsed = time.perf_counter() - t0 - result["rtt_s"]
            result["bandwidth_bytes_per_s"] = nbytes / max(elapsed, 1e-6)
        return Frame("link", body=result)

    # ------------------------------------------------------------------ the worker

    async def _in_worker(self, fn: Any, *args: Any) -> Any:
        job = self._worker.submit(fn, *args)
        self._jobs.add(job)
        return await asyncio.wrap_future(job)

    def _worker_idle(self) -> bool:
        """Nothing runs on the worker thread nor waits for it. (A job is done the moment its
        function returns, on the worker thread: a cancelled waiter does not make it look done.)"""
        jobs = self._jobs
        if jobs:
            jobs.difference_update([j for j in jobs if j.done()])
        return not jobs

    async def _in_loader(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._loader, fn, *args)

    async def _work_loop(self) -> None:
        """Take every step waiting, run them (one batch per shard), send results on."""
        try:
            await self._work()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the worker loop stopped")
            raise

    async def _work(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                await self._gather()
                queued = list(self._queue)
                batch, _ = decodes_first(queued)
                batch, left = one_step_a_key(queued, batch)
                self._queue.clear()
                self._queue.extend(left)
                self.batch_sizes[len(batch)] += 1
                t0 = time.monotonic()
                results = await self._in_worker(self._run_batch, batch)
                ran_s = time.monotonic() - t0
                self.batching.ran(ran_s)
                for step in batch:
                    step.started_s, step.compute_s = t0, ran_s
                following = self._following(batch, results)
                for step, result, more in zip(batch, results, following, strict=True):
                    await self._deliver(step, result, more)

    def _following(self, batch: list[_Step], results: list[Any]) -> list[int]:
        """For each step of a run, how many hidden states of that run go to the same next hop
        after it (the ``more`` of :meth:`_deliver`)."""
        dest: list[tuple[str, int] | None] = []
        for step, result in zip(batch, results, strict=True):
            plan = self.host.plans.get(step.frame.plan)
            d = None
            if isinstance(result, np.ndarray) and plan is not None and step.hop + 1 < len(plan.ring):
                nxt = plan.ring[step.hop + 1]
                d = (nxt.host, nxt.port)
            dest.append(d)
        left = Counter(d for d in dest if d is not None)
        following = []
        for d in dest:
            if d is None:
                following.append(0)
            else:
                left[d] -= 1
                following.append(left[d])
        return following

    # ------------------------------------------------------------------ batch formation
    #
    # The decode step of a lone stream runs at once on the event loop's thread: no thread
    # hand-offs (each is a scheduler wake-up, which costs most where several nodes share a few
    # cores). Otherwise (other requests active here, something queued or running, a prefill) the
    # step waits in the queue, and the worker thread runs everything queued as one batch per
    # shard. When the worker frees, it first waits (at most a window) for the steps of requests
    # that are due back: each request's time away (the rest of the ring) is measured, so steps
    # that left here together and come back within that window of each other merge into one batch
    # instead of splitting into the first to arrive and the rest. A node that ran a batch sends its
    # hidden states to the next hop back to back, each saying how many ``more`` follow: the next
    # node waits for those too, so the batch stays whole down the ring. A lone stream never
    # waits: there is no other request to wait for.

    def _inline_ok(self, step: _Step, key: tuple[str, int]) -> bool:
        """A lone stream's decode step runs at once, on the loop's thread; anything else goes
        through the queue, where batches form."""
        if self._queue or self._burst or not self._worker_idle():
            return False
        if np.ndim(step.frame.tensor) == 0 or step.rows > INLINE_MAX_ROWS:
            return False  # a prefill runs on the worker: the loop keeps answering pings meanwhile
        if step.conn.input_pending():
            return False  # another frame is already here: it may join this step's batch
        return self.batching.alone((key,), step.received_s)

    def _next_ready(self, plan: RingPlan, hop: int) -> bool:
        """Whether the result can go on without connecting first (a connection takes a while:
        that is done by the worker's loop, not in the read loop where steps run inline)."""
        if hop + 1 >= len(plan.ring):
            return True
        nxt = plan.ring[hop + 1]
        conn = self._peers.get((nxt.host, nxt.port))
        return conn is not None and not conn.is_closed

    async def _gather(self) -> None:
        """Wait, at most a window, for the steps due back here and those a sender announced
        (the rules: :meth:`Batching.gather_wait`)."""
        deadline = time.monotonic() + self.batching.window_s()
        while True:
            now = time.monotonic()
            wait = self.batching.gather_wait(now, deadline, burst=bool(self._burst), queued=[s.key for s in self._queue])
            if wait is None:
                break
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wakeup.wait()
        self._burst.clear()  # what has not come by now is not waited for again

    async def _run_inline(self, step: _Step) -> None:
        self.batch_sizes[1] += 1
        self.inline_steps += 1
        t0 = time.monotonic()
        result = self._run_batch([step])[0]
        step.started_s, step.compute_s = t0, time.monotonic() - t0
        self.batching.ran(step.compute_s)
        await self._deliver(step, result)

    def _run_batch(self, batch: list[_Step]) -> list[Any]:
        """Runs on the worker thread (or inline, when the worker is idle). Groups steps by shard
        and fuses them where the backend can."""
        results: list[Any] = [None] * len(batch)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, step in enumerate(batch):
            if step.frame.body.get("rid") in self._finished:
                results[i] = _DISCARDED
                continue
            try:
                _, _, hosted = self.host.hop(step.frame.plan, step.hop)
            except HostError as exc:
                results[i] = exc
                continue
            groups.setdefault(hosted.key, []).append(i)
        for key, idxs in groups.items():
            shard = self.host.shards[key].shard
            idxs = self._within_budget(batch, key, idxs, results)
            items = []
            for i in idxs:
                f = batch[i].frame
                rid, start = f.body["rid"], int(f.body["pos"])
                adopt = f.body.get("adopt")
                if type(adopt) is str and adopt != rid and not shard.kv_length(rid) and shard.kv_length(adopt):
                    shard.rename_kv(adopt, rid)  # the next turn of a conversation: its prefix is cached
                if shard.kv_length(rid) > start:
                    # The coordinator rebuilds this request from an earlier position (a plan
                    # change or a failure): what is cached past it is stale.
                    if start == 0:
                        shard.drop(rid)
                    else:
                        try:
                            shard.truncate_kv(rid, start)
                        except BackendError as exc:  # windowed layers hold less: the step fails, it runs again whole
                            log.info("cache of %s not cut back to %d (%s)", rid, start, exc)
                            shard.drop(rid)
                x = np.asarray(f.tensor)
                items.append((rid, x, np.arange(start, start + x.shape[0], dtype=np.int64)))
            # a prompt to score needs every row's logits: it runs on its own
            scored = [j for j, i in enumerate(idxs) if shard.is_last and "score" in batch[i].frame.body]
            plain = [j for j in range(len(items)) if j not in scored]
            outs: list[Any] = [None] * len(items)
            scores: dict[int, list[TokenLogprobs]] = {}
            try:
                if len(plain) == 1:
                    outs[plain[0]] = shard.forward(*items[plain[0]])
                elif plain:
                    for j, out in zip(plain, shard.forward_batch([items[j] for j in plain]), strict=True):
                        outs[j] = out
            except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which rebuilds
                _failed(shard, items, outs, plain, exc)
            for j in scored:  # each in pieces; its failure (a bad ask included) fails it alone
                try:
                    outs[j], scores[idxs[j]] = score_prompt(shard, batch[idxs[j]].frame.body["score"], *items[j],
                                                            self.kv.step_room_bytes)
                except Exception as exc:  # noqa: BLE001
                    _failed(shard, items, outs, [j], exc)
            for i, out, (rid, _x, positions) in zip(idxs, outs, items, strict=True):
                results[i] = out
                self.kv.record(rid, key, 0 if isinstance(out, Exception) else int(positions[-1]) + 1)
            if shard.is_last:
                for i in idxs:
                    if batch[i].frame.body.get("fill") and not isinstance(results[i], Exception):
                        results[i] = (FILLED, None, None)  # a prompt's chunk: its caches filled, nothing drawn
                    elif not isinstance(results[i], Exception):
                        try:
                            token, logprobs = self.samplers.sample(batch[i].frame.body, results[i])
                            results[i] = (token, logprobs, scores.get(i))  # scores: score_prompt's, where asked
                        except Exception as exc:  # noqa: BLE001 - bad parameters fail this request only
                            results[i] = exc
        return results

    def _shards_changed(self) -> None:
        """The shards held changed: the bytes a cache position takes on each, and the memory the
        process holds besides caches, measured again."""
        import psutil

        per_position = {}
        with self.host.lock:  # the loader thread installs shards under it
            hosted_all = list(self.host.shards.items())
        for key, hosted in hosted_all:
            c = hosted.shard.config
            per_position[key] = shard_cost(c.n_kv_heads, c.head_dim, hosted.start, hosted.end,
                                           get_backend(hosted.backend).kv_value_bytes(), hosted.shard.ring_layers,
                                           c.ring_window)
        self.kv.set_shards(per_position)
        self.kv.observe(process_rss_bytes(), psutil.virtual_memory().available, settled=True)
        # under a limit, a prompt's chunks small enough for their temporaries to fit the reserve
        room = self.kv.step_room_bytes
        for _, hosted in hosted_all:
            hosted.shard.prefill_chunk = prefill_rows(hosted.shard.config, room)

    def _kv_report(self) -> dict[str, Any]:
        """The KV budget's report, and the rows a step of a prompt should carry at most here: its
        shards' prefill chunks (under a limit, what the reserve holds of a step's temporaries), so
        that the coordinator sends a long prompt through the ring a chunk at a time: whole, its
        hidden states received and sent (rows x hidden floats each, a few copies) would not fit."""
        report = self.kv.report()
        with self.host.lock:
            chunks = [h.shard.prefill_chunk for h in self.host.shards.values()]
        report["prefill_rows"] = min(chunks, default=PREFILL_CHUNK)
        return report

    def _load_room(self) -> int | None:
        """The bytes a shard's load may take here: what the process may hold (its runtime's
        baseline plus the memory limit) less what it holds now (runtime, weights, caches) and the
        KV budget's least reserve; None without a limit."""
        if (limit := self.kv.process_limit_bytes) is None:
            return None
        return limit - process_rss_bytes() - RESERVE_MIN_BYTES

    def _within_budget(self, batch: list[_Step], key: tuple[int, int], idxs: list[int], results: list[Any]) -> list[int]:
        """The steps of ``idxs`` (on shard ``key``) whose caches fit this node's KV budget; the
        others' result is the refusal (the coordinator admits them again later)."""
        growth = {}
        for i in idxs:
            b = batch[i].frame.body
            rid, adopt = b["rid"], b.get("adopt")
            if type(adopt) is str and not self.kv.held(rid, key):
                self.kv.rename(adopt, rid)
            growth[(rid, key)] = int(b["pos"]) + batch[i].rows
        refused = self.kv.check(growth)
        if not refused:
            return idxs
        for i in idxs:
            if (why := refused.get(batch[i].frame.body["rid"])) is not None:
                results[i] = BudgetExceeded(why)
        return [i for i in idxs if batch[i].frame.body["rid"] not in refused]

    async def _deliver(self, step: _Step, result: Any, more: int = 0) -> None:
        """Send a step's result on. ``more``: how many more hidden states of the same run go to
        the same next hop right after this one (it then waits for them, to keep the batch)."""
        self.batching.left(step.key, time.monotonic())
        f = step.frame
        rid = f.body["rid"]
        if result is _DISCARDED or rid in self._finished:
            self._stats.pop(rid, None)
            return
        if isinstance(result, Exception):
            await self._fail_step(step, str(result), kv_budget=isinstance(result, BudgetExceeded))
            return
        plan = self.host.plans.get(f.plan)
        if plan is None:
            await self._fail_step(step, f"plan {f.plan} was dropped during the step")
            return
        if step.rows == 1:
            self.decode_steps += 1
            self.decode_compute_s += step.compute_s
        timing = f.body.get("timing")
        timing = [*(timing if type(timing) is list else ()),
                  hop_timing(self.profile.node_id, step.received_s, step.started_s, step.compute_s).to_wire()]
        if isinstance(result, tuple):  # the last hop: a sampled token (or FILLED)
            token, logprobs, scores = result
            if token != FILLED:
                stats = self._stats.setdefault(rid, _RequestStats())
                stats.tokens += 1
                stats.last_s = time.monotonic()
            body = {"rid": rid, "step": f.body.get("step"), "token": int(token), "timing": timing}
            if logprobs is not None:
                body["logprobs"] = logprobs.to_wire()
            tensor = None
            if scores is not None:  # the prompt's scores, as the frame's tensor
                body["scored"] = True
                tensor = scores_to_array(scores)
            await self._to_coordinator(Frame("token", body=body, tensor=tensor, plan=f.plan))
            return
        nxt = plan.ring[step.hop + 1]
        body = dict(f.body)
        body["hop"] = step.hop + 1
        body["timing"] = timing
        if more:
            body["more"] = more
        else:
            body.pop("more", None)
        try:
            peer = await self._peer(nxt.host, nxt.port)
            await peer.send("forward", body, tensor=np.ascontiguousarray(result, dtype=np.float32), plan=f.plan)
        except (TimeoutError, OSError, ConnectionError, RemoteError) as exc:
            await self._fail_step(step, f"cannot reach next hop {nxt.node_id} at {nxt.host}:{nxt.port}: {exc}", failed=nxt.node_id)

    async def _fail_step(self, step: _Step, reason: str, failed: str | None = None, *, kv_budget: bool = False) -> None:
        body = {"rid": step.frame.body.get("rid"), "step": step.frame.body.get("step"), "error": reason,
                "node_id": self.profile.node_id if self.profile else "", "failed_node": failed}
        if kv_budget:  # refused for want of memory: no node is at fault
            body["kv_budget"] = True
        log.warning("step of %s failed: %s", body["rid"], reason)
        await self._to_coordinator(Frame("step_failed", body=body, plan=step.frame.plan))

    async def _to_coordinator(self, frame: Frame) -> None:
        conn = self.coordinator
        if conn is None or conn.is_closed:
            log.warning("no coordinator attached: dropping %s", frame.type)
            return
        try:
            await conn.send(frame.type, frame.body, tensor=frame.tensor, plan=frame.plan)
        except (OSError, ConnectionError) as exc:
            log.warning("coordinator unreachable: %s", exc)

    async def _peer(self, host: str, port: int) -> Connection:
        key = (host, port)
        lock = self._peer_locks.setdefault(key, asyncio.Lock())
        async with lock:
            conn = self._peers.get(key)
            if conn is None or conn.is_closed:
                conn = await connect(host, port, security=self.security, timeout=3.0)
                self._peers[key] = conn
            return conn

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
            metrics["queue_depth"] = len(self._queue)
            metrics["batch_sizes"] = {str(k): v for k, v in sorted(self.batch_sizes.items())}
            metrics["inline_steps"] = self.inline_steps
            metrics["decode_steps"], metrics["decode_compute_s"] = self.decode_steps, self.decode_compute_s
            metrics.update(sensors.read())
            self.batching.prune(now)
            metrics["busy_fraction"] = (self.batching.busy_s - last_busy) / max(now - last_t, 1e-6)
            last_busy, last_t = self.batching.busy_s, now
            # A request that has streamed no token for STREAMING_S (ended, its cache kept for a next
            # turn) makes no tok/s now: its average would show on a node long after (a drained one too).
            metrics["requests"] = {
                rid: {"tokens": s.tokens, "tok_per_s": (s.tokens - 1) / max(s.last_s - s.first_s, 1e-6)
                      if s.tokens > 1 and now - s.last_s < STREAMING_S else 0.0}
                for rid, s in self._stats.items()
            }
            metrics["shards"] = self.host.describe() if self.host else []
            await self._to_coordinator(Frame("heartbeat", body={"metrics": metrics, "t": time.time()}))


def _failed(shard: Any, items: list[tuple[str, np.ndarray, np.ndarray]], outs: list[Any], rows: list[int],
            exc: Exception) -> None:
    """Rows ``rows`` of a run failed with ``exc``: their caches go (the step may have half-updated
    them) and the error is their result, reported to the coordinator, which rebuilds."""
    log.warning("forward of layers [%d, %d) failed: %s", shard.start, shard.end, exc, exc_info=True)
    for j in rows:
        shard.drop(items[j][0])
        outs[j] = exc


_OPS = {
    "attach": NodeAgent._op_attach,
    "profile": NodeAgent._op_profile,
    "load": NodeAgent._op_load,
    "load_begin": NodeAgent._op_load_begin,
    "load_chunk": NodeAgent._op_load_chunk,
    "load_commit": NodeAgent._op_load_commit,
    "unload": NodeAgent._op_unload,
    "plan": NodeAgent._op_plan,
    "forward": NodeAgent._op_forward,
    "kv_export": NodeAgent._op_kv_export,
    "kv_import": NodeAgent._op_kv_import,
    "drop": NodeAgent._op_drop,
    "ping": NodeAgent._op_ping,
    "link_probe": NodeAgent._op_link_probe,
}
