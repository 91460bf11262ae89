"""The coordinator's view of one node: its connection, profile, state and live metrics."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from exo_tui.net.address import host_port
from exo_tui.net.codec import call
from exo_tui.net.connection import Connection
from exo_tui.net.messages import Unload, Unloaded
from exo_tui.node.profile import NodeProfile


def held_bytes(shard: dict[str, Any]) -> int:
    """What a node's shard (as its describe() or load reply says it) holds: its backend's form
    of its tensors, or (a node that does not say) their bytes in the file."""
    return int(shard.get("held_bytes") or shard.get("nbytes", 0))

HISTORY_LEN = 60  # one minute of heartbeats for the console's sparklines


@dataclass
class NodeHandle:
    node_id: str
    name: str
    host: str
    port: int
    profile: NodeProfile
    conn: Connection | None = None
    state: str = "ready"  # ready | loading | suspect | draining | drained | failed
    reason: str = ""
    last_heartbeat_s: float = field(default_factory=time.monotonic)
    metrics: dict[str, Any] = field(default_factory=dict)
    history: dict[str, deque[float]] = field(default_factory=dict)
    links: dict[str, float] = field(default_factory=dict)  # peer node id -> latency_s
    link_bandwidth: dict[str, float] = field(default_factory=dict)  # peer node id -> bytes/s
    local_process: Any = None  # LocalNode when the coordinator started it
    shards: list[dict[str, Any]] = field(default_factory=list)  # as the node reports them
    held: set[tuple[int, int]] = field(default_factory=set)  # layer ranges loaded there
    drained: bool = False
    failures: int = 0

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)

    @property
    def connected(self) -> bool:
        return self.live_conn is not None

    @property
    def live_conn(self) -> Connection | None:
        """The connection while it is open; None when there is none or it has closed."""
        return self.conn if self.conn is not None and not self.conn.is_closed else None

    def heartbeat_age_s(self, now: float | None = None) -> float:
        return (now if now is not None else time.monotonic()) - self.last_heartbeat_s

    def record_heartbeat(self, metrics: dict[str, Any]) -> None:
        self.last_heartbeat_s = time.monotonic()
        self.metrics = metrics
        self.shards = list(metrics.get("shards", self.shards))
        for key in ("cpu_percent", "ram_used_percent", "tok_per_s", "busy_fraction"):
            value = metrics.get(key)
            if key == "tok_per_s":
                value = sum(r.get("tok_per_s", 0.0) for r in metrics.get("requests", {}).values())
            if value is not None:
                self.history.setdefault(key, deque(maxlen=HISTORY_LEN)).append(float(value))

    def note_kv(self, kv: dict[str, Any]) -> None:
        """The KV budget a load or unload reply carries (measured after it): admission uses it at
        once, where the last heartbeat may have been taken mid-load, with no budget left."""
        self.metrics["kv"] = kv

    async def unload(self, start: int, end: int, model: str | None = None) -> None:
        """Unload the node's shard of layers ``[start, end)`` (of the model tagged ``model``;
        None: whichever it holds), noting the KV budget it measures after."""
        if (conn := self.live_conn) is None:
            raise ConnectionError(f"{self.name} is not connected")
        self.note_kv((await call(conn, Unload(start, end, model), Unloaded, timeout=30)).kv)

    @property
    def tok_per_s(self) -> float:
        return float(sum(r.get("tok_per_s", 0.0) for r in self.metrics.get("requests", {}).values()))

    @property
    def memory_total_bytes(self) -> int:
        return int(self.metrics.get("ram_total_bytes", self.profile.ram_total_bytes))

    @property
    def memory_available_bytes(self) -> int:
        limit = self.profile.memory_limit_bytes
        avail = int(self.metrics.get("ram_available_bytes", self.profile.ram_available_bytes))
        held = sum(held_bytes(s) for s in self.shards)
        if limit:
            return max(0, min(avail, limit - held))
        return avail
