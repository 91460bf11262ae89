"""Typed events the coordinator publishes, and the bus that carries them.

The TUI, the API's ``/v1/cluster/events`` stream and the logs are all subscribers; none of them
reaches into coordinator internals. Events are plain frozen dataclasses so they serialise to JSON
(:meth:`Event.to_dict`) and compare in tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, kw_only=True)
class Event:
    kind: ClassVar[str] = "event"
    ts: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, **dataclasses.asdict(self)}


# ----------------------------------------------------------------- hosts and nodes


@dataclass(frozen=True, kw_only=True)
class HostDiscovered(Event):
    """A host we could bootstrap (``_ssh._tcp``, ssh_config, config, tailscale)."""

    kind: ClassVar[str] = "host_discovered"
    host: str
    port: int = 22
    source: str = ""  # mdns | ssh_config | config | tailscale | peer
    name: str = ""


@dataclass(frozen=True, kw_only=True)
class HostGone(Event):
    kind: ClassVar[str] = "host_gone"
    host: str
    port: int = 22
    source: str = ""


@dataclass(frozen=True, kw_only=True)
class NodeDiscovered(Event):
    """A node agent seen (mDNS, a peer) but not yet joined. ``foreign``: not of our cluster."""

    kind: ClassVar[str] = "node_discovered"
    node_id: str
    name: str
    address: str
    port: int
    backends: tuple[str, ...] = ()
    memory_bytes: int = 0
    version: str = ""
    foreign: bool = False
    source: str = "mdns"


@dataclass(frozen=True, kw_only=True)
class NodeUpdated(Event):
    """A discovered node's advertisement changed (address, memory...)."""

    kind: ClassVar[str] = "node_updated"
    node_id: str
    name: str
    address: str
    port: int


@dataclass(frozen=True, kw_only=True)
class NodeGone(Event):
    kind: ClassVar[str] = "node_gone"
    node_id: str
    name: str = ""


@dataclass(frozen=True, kw_only=True)
class NodeJoined(Event):
    kind: ClassVar[str] = "node_joined"
    node_id: str
    name: str
    address: str
    port: int


@dataclass(frozen=True, kw_only=True)
class NodeMetrics(Event):
    """A heartbeat's live metrics for one node."""

    kind: ClassVar[str] = "node_metrics"
    node_id: str
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class NodeStateChanged(Event):
    """ready, loading, draining, drained, failed, suspect, foreign, discovered."""

    kind: ClassVar[str] = "node_state"
    node_id: str
    state: str
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class NodeFailed(Event):
    kind: ClassVar[str] = "node_failed"
    node_id: str
    reason: str


# ----------------------------------------------------------------- plans and shards


@dataclass(frozen=True, kw_only=True)
class PlanChanged(Event):
    """A new plan is in force. ``plan`` and ``diff`` are their ``to_dict()`` forms."""

    kind: ClassVar[str] = "plan_changed"
    version: int
    plan: dict[str, Any] = field(default_factory=dict)
    diff: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class ShardProgress(Event):
    """Weights of a shard arriving at a node."""

    kind: ClassVar[str] = "shard_progress"
    node_id: str
    start: int
    end: int
    done_bytes: int
    total_bytes: int


# ----------------------------------------------------------------- requests


@dataclass(frozen=True, kw_only=True)
class TokenStreamed(Event):
    kind: ClassVar[str] = "token"
    request_id: str
    token_id: int
    text: str


@dataclass(frozen=True, kw_only=True)
class RequestDone(Event):
    kind: ClassVar[str] = "request_done"
    request_id: str
    finish_reason: str  # stop | length | cancelled | error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    tok_per_s: float = 0.0
    nodes: tuple[str, ...] = ()
    error: str = ""


# ----------------------------------------------------------------- operator


@dataclass(frozen=True, kw_only=True)
class OperatorAction(Event):
    kind: ClassVar[str] = "operator_action"
    action: str  # drain | undrain | pin | unpin | rebalance | bootstrap | remove | model
    target: str
    result: str  # ok | cancelled | error: ...
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class BootstrapProgress(Event):
    kind: ClassVar[str] = "bootstrap_progress"
    host: str
    step: str  # connect | detect | venv | upload | install | key | start | handshake | done
    status: str  # running | ok | failed
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class PredictionGap(Event):
    """The plan in force runs more than 15 % off its prediction (scheduler/calibration.py):
    ``remeasured_tok_per_s`` is the plan predicted again on the measured figures, and
    ``rebalance_tok_per_s`` what the rebalance it would make is predicted to give (0: it would
    move nothing); ``applied`` when ``scheduler.load_balancing.auto_rebalance`` made it."""

    kind: ClassVar[str] = "prediction_gap"
    plan_version: int
    predicted_tok_per_s: float
    measured_tok_per_s: float
    remeasured_tok_per_s: float = 0.0
    rebalance_tok_per_s: float = 0.0
    moves: int = 0
    applied: bool = False


@dataclass(frozen=True, kw_only=True)
class Notice(Event):
    """Something the operator should read (a warning, a rebalance proposal)."""

    kind: ClassVar[str] = "notice"
    level: str  # info | warning | error
    message: str


# ----------------------------------------------------------------- the bus


class EventBus:
    """Fan-out of events to any number of async subscribers.

    ``publish`` never blocks the publisher: a subscriber that falls more than ``maxsize`` events
    behind loses its oldest events and is told how many by ``dropped``.

    ``history`` (what a subscriber asking for ``replay`` gets first: a console opening or
    attaching) is the cluster's recent story, the last ``history`` events but for the ones that
    come by the hundred a second or every second per node (``UNKEPT``): a 500-token answer had
    pushed every node joining and every plan out of it.
    """

    UNKEPT: ClassVar[tuple[type[Event], ...]] = (TokenStreamed, NodeMetrics)

    def __init__(self, maxsize: int = 10_000, history: int = 500) -> None:
        self._subscribers: list[_Subscription] = []
        self._maxsize = maxsize
        self.history: list[Event] = []
        self._history_len = history

    def publish(self, event: Event) -> None:
        if not isinstance(event, self.UNKEPT):
            self.history.append(event)
            if len(self.history) > self._history_len:
                del self.history[: len(self.history) - self._history_len]
        for sub in list(self._subscribers):
            if sub.kinds is None or isinstance(event, sub.kinds):
                sub.put(event)

    def subscribe(self, *, replay: bool = False, kinds: tuple[type[Event], ...] | None = None) -> _Subscription:
        """A subscription to every event, or (``kinds``) to events of those types only: a task that
        waits for a few kinds is not woken by every token streamed."""
        sub = _Subscription(self, self._maxsize, kinds)
        if replay:
            for event in self.history:
                if kinds is None or isinstance(event, kinds):
                    sub.put(event)
        self._subscribers.append(sub)
        return sub

    def _remove(self, sub: _Subscription) -> None:
        if sub in self._subscribers:
            self._subscribers.remove(sub)


class _Subscription:
    def __init__(self, bus: EventBus, maxsize: int, kinds: tuple[type[Event], ...] | None = None) -> None:
        self._bus = bus
        self.kinds = kinds
        self._queue: asyncio.Queue[Event] = asyncio.Queue(maxsize)
        self.dropped = 0

    def put(self, event: Event) -> None:
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(event)

    async def get(self) -> Event:
        return await self._queue.get()

    def get_nowait(self) -> Event | None:
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def close(self) -> None:
        self._bus._remove(self)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        try:
            while True:
                yield await self._queue.get()
        finally:
            self.close()

    def __enter__(self) -> _Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
