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
                coordinator. A step for a plan this node does not hold is refused
``kv_export``   a request's KV cache for some layers, as one tensor
``kv_import``   install a request's KV cache (from another node, maybe another backend)
``drop``        forget a request's caches
``ping``        replies at once (link latency)
``link_probe``  measure latency (and bandwidth, on request) to another node
==============  ===============================================================================

Nothing in a frame is ever executed: the type selects one of these functions, and the body holds
plain values.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends import default_backend_name
from backends.base import BackendError, ModelConfig
from exo_tui.inference.sampling import Sampler, SamplingParams
from exo_tui.models.gguf_file import ModelFileError, TensorInfo
from exo_tui.net.errors import RemoteError
from exo_tui.net.frame import Frame
from exo_tui.net.rpc import Connection, connect, serve
from exo_tui.node.host import HostError, RingPlan, ShardHost, kv_from_array, kv_to_array
from exo_tui.node.profile import NodeProfile, benchmark, device_profile, live_metrics

log = logging.getLogger("exo_tui.node")

HEARTBEAT_INTERVAL_S = 1.0
FINISHED_MEMORY = 10_000  # ended requests remembered, so late steps of theirs are discarded
_DISCARDED = object()


@dataclass
class _Step:
    """One request's step waiting for this node's worker."""

    conn: Connection
    frame: Frame
    hop: int
    received_s: float = field(default_factory=time.monotonic)


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
        # Loading weights takes seconds: it runs beside the worker, so the node keeps serving
        # its current shards while it loads the next plan's (a drain or rebalance does not stall).
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exo-node-loader")
        self._samplers: dict[str, Sampler] = {}
        self._stats: dict[str, _RequestStats] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # requests ended for good
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = asyncio.Event()
        self._advertiser: Any = None
        self._busy_s = 0.0
        self._started_s = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        profile = await loop.run_in_executor(None, device_profile, self.name, self.memory_limit_bytes)
        if self.backend not in profile.backends:
            raise BackendError(
                f"backend {self.backend} is not available on this node (available: {', '.join(profile.backends) or 'none'})"
            )
        profile.backend = self.backend
        if self.run_benchmark:
            profile = await loop.run_in_executor(None, lambda: benchmark(profile, backends=[self.backend]))
        self.profile = profile
        self.host = ShardHost(profile.node_id, self.backend)
        self._server = await serve(self._handle, self.bind_host, self.port, security=self.security)
        self.port = getattr(self._server, "port", self.port)
        self._tasks.append(asyncio.create_task(self._work_loop(), name="node-worker"))
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="node-heartbeat"))
        if self.advertise:
            await self._start_advertiser()
        log.info("node %s (%s) serving on %s:%d with %s", self.name, profile.node_id, self.bind_host, self.port, self.backend)

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
            with contextlib.suppress(Exception):
                await self._advertiser.stop()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for conn in list(self._peers.values()):
            with contextlib.suppress(Exception):
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
        except (HostError, ModelFileError, BackendError, KeyError, ValueError, TypeError) as exc:
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
        hosted = await self._in_loader(self.host.load_from_file, b["path"], int(b["start"]), int(b["end"]), b.get("backend"))
        return Frame("loaded", body={"start": hosted.start, "end": hosted.end, "backend": hosted.backend, "nbytes": hosted.nbytes})

    async def _op_load_begin(self, conn: Connection, frame: Frame) -> Frame:
        b = frame.body
        tensors = [TensorInfo(t["name"], t["type"], tuple(t["shape"]), int(t["nbytes"])) for t in b["tensors"]]
        config = ModelConfig(**b["config"])
        self.host.begin_transfer(b["transfer_id"], config, int(b["start"]), int(b["end"]), b.get("backend"), tensors)
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
        return Frame("loaded", body={"start": hosted.start, "end": hosted.end, "backend": hosted.backend, "nbytes": hosted.nbytes})

    async def _op_unload(self, conn: Connection, frame: Frame) -> Frame:
        done = await self._in_worker(self.host.unload, int(frame.body["start"]), int(frame.body["end"]))
        return Frame("ok", body={"unloaded": done})

    async def _op_plan(self, conn: Connection, frame: Frame) -> Frame:
        self.host.add_plan(RingPlan.from_dict(frame.body["plan"]))
        return Frame("ok", body={"plans": sorted(self.host.plans)})

    async def _op_forward(self, conn: Connection, frame: Frame) -> None:
        if self._stopping.is_set():
            raise HostError(f"node {self.name} is shutting down")
        if frame.plan is None:
            raise HostError("a forward frame must name its plan version")
        hop = int(frame.body["hop"])
        if frame.body.get("rid") in self._finished:
            return None  # the request ended while this step was on its way
        self.host.hop(frame.plan, hop)  # refuse early: unknown plan, wrong node, shard missing
        self._queue.append(_Step(conn, frame, hop))
        self._wakeup.set()
        return None

    async def _op_kv_export(self, conn: Connection, frame: Frame) -> Frame:
        b = frame.body
        cache = await self._in_worker(self.host.export_kv, b["rid"], int(b["start"]), int(b["end"]))
        return Frame("kv", body={"length": cache.length}, tensor=kv_to_array(cache))

    async def _op_kv_import(self, conn: Connection, frame: Frame) -> Frame:
        b = frame.body
        start, end = int(b["start"]), int(b["end"])
        cache = kv_from_array(start, end, np.array(frame.tensor, copy=True))

        def install() -> None:
            hosted = self.host.shard_for_layers(start, end)
            if (hosted.start, hosted.end) != (start, end):
                raise HostError(f"KV for layers [{start}, {end}) must cover the whole shard [{hosted.start}, {hosted.end})")
            hosted.shard.import_kv(b["rid"], cache)

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
        self._samplers.pop(rid, None)
        self._stats.pop(rid, None)
        await self._in_worker(self.host.drop, rid)
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
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

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
                batch = list(self._queue)
                self._queue.clear()
                t0 = time.monotonic()
                results = await self._in_worker(self._run_batch, batch)
                self._busy_s += time.monotonic() - t0
                for step, result in zip(batch, results, strict=True):
                    await self._deliver(step, result)

    def _run_batch(self, batch: list[_Step]) -> list[Any]:
        """Runs on the worker thread. Groups steps by shard and fuses them where the backend can."""
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
            items = []
            for i in idxs:
                f = batch[i].frame
                rid, start = f.body["rid"], int(f.body["pos"])
                if shard.kv_length(rid) > start:
                    # The coordinator rebuilds this request from an earlier position (a plan
                    # change or a failure): what is cached past it is stale.
                    if start == 0:
                        shard.drop(rid)
                    else:
                        shard.truncate_kv(rid, start)
                x = np.asarray(f.tensor)
                items.append((rid, x, np.arange(start, start + x.shape[0], dtype=np.int64)))
            outs: list[Any]
            try:
                if len(items) == 1:
                    outs = [shard.forward(*items[0])]
                else:
                    outs = shard.forward_batch(items)
            except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which rebuilds
                log.warning("forward of layers [%d, %d) failed: %s", shard.start, shard.end, exc, exc_info=True)
                for rid, _, _ in items:
                    shard.drop(rid)  # the step may have half-updated the caches
                outs = [exc] * len(items)
            for i, out in zip(idxs, outs, strict=True):
                results[i] = out
            if shard.is_last:
                for i in idxs:
                    if not isinstance(results[i], Exception):
                        try:
                            results[i] = self._sample(batch[i].frame, results[i])
                        except Exception as exc:  # noqa: BLE001 - bad parameters fail this request only
                            results[i] = exc
        return results

    def _sample(self, frame: Frame, logits: np.ndarray) -> tuple[int, float]:
        b = frame.body
        rid = b["rid"]
        sampler = self._samplers.get(rid)
        if sampler is None:
            sampler = self._samplers[rid] = Sampler(SamplingParams.from_dict(b.get("sampling") or {}))
        history = b.get("history")
        n_tokens = int(b["n_tokens"])
        if history is None:
            history = _Length(n_tokens)
        return sampler.sample(logits[-1], history)

    async def _deliver(self, step: _Step, result: Any) -> None:
        f = step.frame
        rid = f.body["rid"]
        if result is _DISCARDED or rid in self._finished:
            self._stats.pop(rid, None)
            return
        if isinstance(result, Exception):
            await self._fail_step(step, str(result))
            return
        plan = self.host.plans.get(f.plan)
        if plan is None:
            await self._fail_step(step, f"plan {f.plan} was dropped during the step")
            return
        if isinstance(result, tuple):  # the last hop: a sampled token
            token, logprob = result
            stats = self._stats.setdefault(rid, _RequestStats())
            stats.tokens += 1
            stats.last_s = time.monotonic()
            await self._to_coordinator(
                Frame("token", body={"rid": rid, "step": f.body.get("step"), "token": int(token), "logprob": float(logprob)}, plan=f.plan)
            )
            return
        nxt = plan.ring[step.hop + 1]
        body = dict(f.body)
        body["hop"] = step.hop + 1
        try:
            peer = await self._peer(nxt.host, nxt.port)
            await peer.send("forward", body, tensor=np.ascontiguousarray(result, dtype=np.float32), plan=f.plan)
        except (TimeoutError, OSError, ConnectionError, RemoteError) as exc:
            await self._fail_step(step, f"cannot reach next hop {nxt.node_id} at {nxt.host}:{nxt.port}: {exc}", failed=nxt.node_id)

    async def _fail_step(self, step: _Step, reason: str, failed: str | None = None) -> None:
        body = {"rid": step.frame.body.get("rid"), "step": step.frame.body.get("step"), "error": reason,
                "node_id": self.profile.node_id if self.profile else "", "failed_node": failed}
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
            metrics["queue_depth"] = len(self._queue)
            metrics["busy_fraction"] = (self._busy_s - last_busy) / max(now - last_t, 1e-6)
            last_busy, last_t = self._busy_s, now
            metrics["requests"] = {
                rid: {"tokens": s.tokens, "tok_per_s": (s.tokens - 1) / max(s.last_s - s.first_s, 1e-6) if s.tokens > 1 else 0.0}
                for rid, s in self._stats.items()
            }
            metrics["shards"] = self.host.describe() if self.host else []
            await self._to_coordinator(Frame("heartbeat", body={"metrics": metrics, "t": time.time()}))


class _Length:
    """Stands in for a history when only its length matters (no repetition penalty)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # noqa: ANN204
        return iter(())


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
