"""An in-test ClusterControl: plain snapshots, simple plan arithmetic and a streamed reply.

Only for widget and screen tests of the console (and the dev script that shows the app without a
real cluster); the Pilot tests against a real local cluster use the coordinator.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from exo_tui import events as ev
from exo_tui.cluster.view import (
    ChatChunk,
    ChatParams,
    ClusterSnapshot,
    HostKeyUnknown,
    HostView,
    LayerMove,
    LinkView,
    NodeView,
    PlanPreview,
    PlanView,
    QueueView,
    ShardView,
)

T0 = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC: every timestamp of the fixture is fixed
LAYER_BYTES = 3_250_000
REPLY = (
    "The capital of France is **Paris**.\n\n"
    "- It sits on the Seine\n"
    "- About 2.1 million people live there\n\n"
    "```python\nprint('bonjour')\n```\n"
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


class FakeCluster:
    """A ClusterControl with deterministic data (no clocks, no randomness)."""

    def __init__(
        self, n_nodes: int = 3, n_layers: int = 30, *, chat_delay_s: float = 0.0, hosts: int = 2, reply: str = REPLY
    ) -> None:
        self.reply = reply
        self.events = ev.EventBus()
        self.n_layers = n_layers
        self.nodes: dict[str, NodeView] = {n.node_id: n for n in make_nodes(n_nodes)}
        self.version = 1
        self.pins: dict[str, tuple[int, int]] = {}
        self.chat_delay_s = chat_delay_s
        self.applied: list[PlanPreview] = []
        self.chats: list[list[dict[str, str]]] = []
        self.chat_params: list[ChatParams] = []
        self.queue: QueueView | None = None  # admission's counts in the snapshot
        self.queued_ahead: list[int] = []  # notes a chat yields before its answer, as while it waits its turn
        self.admit = asyncio.Event()  # set: the waiting chat is admitted
        self.admit.set()
        self.fail_next_chat = ""
        self.known_keys: set[str] = set()
        self.hosts: dict[str, HostView] = {
            f"10.0.0.{20 + i}": HostView(host=f"10.0.0.{20 + i}", source="mdns" if i % 2 == 0 else "ssh_config", user="exo")
            for i in range(hosts)
        }
        self.model = "smollm2-135m"
        self.shards = self._split(self._eligible())
        self._sync_nodes()
        for n in self.nodes.values():
            self.events.publish(ev.NodeJoined(node_id=n.node_id, name=n.name, address=n.address, port=n.port, ts=T0 - 60))
        self.events.publish(ev.PlanChanged(version=1, reason="initial plan", ts=T0 - 55))

    # ------------------------------------------------------------------ plan arithmetic

    def _eligible(self, drained: set[str] = frozenset(), removed: set[str] = frozenset()) -> list[str]:
        return [
            n.node_id
            for n in sorted(self.nodes.values(), key=lambda n: n.node_id)
            if n.node_id not in removed and not (n.drained or n.node_id in drained) and n.state != "failed"
        ]

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
                    shards.append(ShardView(node_id, start, layer, pinned=node_id in pins))
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
            queue=self.queue,
        )

    async def preview(
        self, action: str, targets: tuple[str, ...] = (), layers: tuple[int, int] | None = None
    ) -> PlanPreview:
        await asyncio.sleep(0)
        pins = dict(self.pins)
        drained: set[str] = set()
        removed: set[str] = set()
        ids = None
        if action == "drain":
            drained = set(targets)
        elif action == "undrain":
            for t in targets:
                self.nodes[t] = dataclasses.replace(self.nodes[t], drained=False)
        elif action == "remove":
            removed = set(targets)
        elif action == "pin" and layers is not None:
            pins[targets[0]] = layers
        elif action == "pin":
            for t in targets:
                if self.nodes[t].layers:
                    pins[t] = self.nodes[t].layers  # type: ignore[assignment]
        elif action == "unpin":
            for t in targets:
                pins.pop(t, None)
        elif action != "rebalance":
            return PlanPreview(action, targets, error=f"unknown action {action}")
        ids = self._eligible(drained, removed)
        if not ids:
            return PlanPreview(action, targets, error="no node would be left to hold the model: add a node or undrain one first")
        new = self._split(ids, pins)
        moves = self._moves(self.shards, new)
        return PlanPreview(
            action=action,
            targets=targets,
            moves=moves,
            bytes_moved=sum(m.nbytes for m in moves),
            tok_per_s_before=self._tok_per_s(self.shards),
            tok_per_s_after=self._tok_per_s(new),
            new_plan=PlanView(self.version + 1, self.n_layers, new),
            layers=layers,
        )

    async def apply(self, preview: PlanPreview) -> PlanPreview:
        await asyncio.sleep(0)
        self.applied.append(preview)
        if preview.action == "drain":
            for t in preview.targets:
                self.nodes[t] = dataclasses.replace(self.nodes[t], drained=True)
        if preview.action == "remove":
            for t in preview.targets:
                self.nodes.pop(t, None)
                self.pins.pop(t, None)
        if preview.action == "pin" and preview.layers is not None:
            self.pins[preview.targets[0]] = preview.layers
        elif preview.action == "pin":
            for t in preview.targets:
                if self.nodes[t].layers:
                    self.pins[t] = self.nodes[t].layers  # type: ignore[assignment]
        if preview.action == "unpin":
            for t in preview.targets:
                self.pins.pop(t, None)
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

    async def chat(self, messages: list[dict[str, str]], params: ChatParams) -> AsyncIterator[ChatChunk]:
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
