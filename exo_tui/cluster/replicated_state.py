"""The cluster's state replicated by Raft among the coordinators, and the store the coordinator writes it through.

:class:`ClusterState` is the replicated state machine: plain values (the plan and its version,
pins, drains, nodes, hosts, join-token hashes, the model served, the audit log, the coordinators'
API addresses and the elections). Its ``@replicated`` methods are the only writes; pysyncobj
applies them on every coordinator in log order once a majority holds them. Reads are of the
local copy (a standby's may lag by the entries in flight: :meth:`~exo_tui.cluster.consensus.CoordinatorSet.status`
says how many).

:class:`ReplicatedStore` has :class:`~exo_tui.cluster.store.StateStore`'s methods, so the
coordinator persists through it unchanged: a write is submitted at once and acknowledged later
(:meth:`ReplicatedStore.settled`), which the API waits for before it answers a change
(:mod:`exo_tui.api.forwarding`). A write the majority does not take (this coordinator lost its
quorum or its leadership) is reported, as the SQLite store reports a full disk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from pysyncobj import FAIL_REASON, SyncObjConsumer, replicated

from exo_tui.cluster import raft_lib  # noqa: F401  (undoes pysyncobj's patch of socket.inet_ntop)
from exo_tui.cluster.store import AuditEntry, KnownNode

AUDIT_KEPT = 2000  # audit lines the replicated log keeps (the oldest go first)
ELECTIONS_KEPT = 100


class ClusterState(SyncObjConsumer):
    """What every coordinator holds the same copy of (a consumer of the coordinators'
    :class:`~pysyncobj.SyncObj`). Values only: they travel pickled inside pysyncobj's
    Fernet-authenticated frames and its journal; nothing here is code."""

    def __init__(self) -> None:
        super().__init__()  # first: the consumer replicates the attributes set after it
        self.nodes: dict[str, tuple[str, str, int, float]] = {}  # id -> (name, host, port, last_seen)
        self.hosts: dict[str, tuple[int, str, str]] = {}  # host -> (port, source, user)
        self.pins: dict[str, tuple[int, int]] = {}
        self.drains: list[str] = []
        self.plan: tuple[int, str, dict[str, Any]] | None = None  # version, model path, Plan.to_dict()
        self.model: str = ""  # the model served (a name or path), once a leader has set one
        self.join_tokens: dict[str, dict[str, Any]] = {}  # join-tokens.json's records (hashes, never secrets)
        self.audit: list[tuple[float, str, str, str, str]] = []
        self.coordinators: dict[str, dict[str, Any]] = {}  # raft address -> {"api": url, "name": ...}
        self.elections: list[tuple[int, str, float]] = []  # (term, raft address, wall time) of each leader

    @replicated
    def put_node(self, node_id: str, name: str, host: str, port: int, last_seen: float) -> None:
        self.nodes[node_id] = (name, host, port, last_seen)

    @replicated
    def drop_node(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)
        self.pins.pop(node_id, None)
        self.drains = [n for n in self.drains if n != node_id]

    @replicated
    def put_host(self, host: str, port: int, source: str, user: str) -> None:
        self.hosts[host] = (port, source, user)

    @replicated
    def set_pins(self, pins: dict[str, tuple[int, int]]) -> None:
        self.pins = dict(pins)

    @replicated
    def set_drains(self, drains: list[str]) -> None:
        self.drains = sorted(drains)

    @replicated
    def set_plan(self, version: int, model: str, body: dict[str, Any]) -> None:
        self.plan = (version, model, body)

    @replicated
    def set_model(self, model: str) -> None:
        self.model = model

    @replicated
    def set_join_tokens(self, records: dict[str, dict[str, Any]]) -> None:
        self.join_tokens = dict(records)

    @replicated
    def add_audit(self, ts: float, action: str, target: str, result: str, detail: str) -> None:
        self.audit.append((ts, action, target, result, detail))
        del self.audit[:-AUDIT_KEPT]

    @replicated
    def put_coordinator(self, address: str, api_url: str, name: str) -> None:
        self.coordinators[address] = {"api": api_url, "name": name}

    @replicated
    def took_charge(self, term: int, address: str, ts: float) -> None:
        self.elections.append((term, address, ts))
        del self.elections[:-ELECTIONS_KEPT]


class NotAcknowledged(RuntimeError):
    """A change the majority of the coordinators did not take; the message says why and what to do."""


def fail_text(err: Any) -> str:
    return {
        FAIL_REASON.QUEUE_FULL: "its queue of changes is full",
        FAIL_REASON.MISSING_LEADER: "no coordinator leads (no majority reaches each other)",
        FAIL_REASON.DISCARDED: "a new leader discarded it",
        FAIL_REASON.NOT_LEADER: "this coordinator no longer leads",
        FAIL_REASON.LEADER_CHANGED: "the leader changed while it was written",
        FAIL_REASON.REQUEST_DENIED: "the leader refused it",
    }.get(err, f"pysyncobj failure {err}")


class ReplicatedStore:
    """:class:`~exo_tui.cluster.store.StateStore`'s interface over :class:`ClusterState`.

    Called on the event loop; each write is submitted to Raft and returns True at once (the
    in-memory state, which the coordinator runs on, is whole); :meth:`settled` waits until every
    write submitted so far is committed by a majority, or raises :class:`NotAcknowledged`."""

    def __init__(self, state: ClusterState, loop: asyncio.AbstractEventLoop,
                 on_write_error: Callable[[str | None], None] | None = None) -> None:
        self.state = state
        self.loop = loop
        self.write_error: str | None = None
        self._on_write_error = on_write_error
        self._pending: list[asyncio.Future[None]] = []

    def _submit(self, method: Callable[..., Any], *args: Any) -> bool:
        future: asyncio.Future[None] = self.loop.create_future()

        def done(_result: Any, err: Any) -> None:  # on pysyncobj's thread
            self.loop.call_soon_threadsafe(self._resolve, future, err)

        method(*args, callback=done)
        self._pending.append(future)
        return True

    def _resolve(self, future: asyncio.Future[None], err: Any) -> None:
        if future.done():
            return
        if err == FAIL_REASON.SUCCESS:
            future.set_result(None)
            if self.write_error is not None:
                self.write_error = None
                if self._on_write_error is not None:
                    self._on_write_error(None)
            return
        message = (f"a change was not acknowledged by a majority of the coordinators ({fail_text(err)}): "
                   "it holds on this coordinator only until another leads")
        future.set_exception(NotAcknowledged(message))
        first = self.write_error is None
        self.write_error = message
        if first and self._on_write_error is not None:
            self._on_write_error(message)

    async def settled(self, timeout_s: float) -> None:
        """Return once every write submitted so far is held by a majority; raise
        :class:`NotAcknowledged` when one is refused or ``timeout_s`` passes first."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            async with asyncio.timeout(timeout_s):
                for f in pending:
                    await f
        except TimeoutError:
            raise NotAcknowledged(f"a majority of the coordinators did not acknowledge the change within {timeout_s:.0f} s: "
                                  "this coordinator cannot reach them; the change is not durable") from None

    # StateStore's interface ------------------------------------------------------------------

    def close(self) -> None:
        for f in self._pending:
            if not f.done():
                f.cancel()
        self._pending = []

    def retry(self) -> bool:
        return self.write_error is None

    def remember_node(self, node_id: str, name: str, host: str, port: int) -> bool:
        return self._submit(self.state.put_node, node_id, name, host, port, time.time())

    def forget_node(self, node_id: str) -> bool:
        return self._submit(self.state.drop_node, node_id)

    def known_nodes(self) -> list[KnownNode]:
        return [KnownNode(n, *v) for n, v in self.state.nodes.items()]

    def remember_host(self, host: str, port: int, source: str, user: str = "") -> bool:
        return self._submit(self.state.put_host, host, port, source, user)

    def known_hosts(self) -> list[tuple[str, int, str, str]]:
        return [(h, *v) for h, v in self.state.hosts.items()]

    def save_pins(self, pins: dict[str, tuple[int, int]]) -> bool:
        return self._submit(self.state.set_pins, dict(pins))

    def pins(self) -> dict[str, tuple[int, int]]:
        return dict(self.state.pins)

    def save_drains(self, drained: set[str]) -> bool:
        return self._submit(self.state.set_drains, sorted(drained))

    def drains(self) -> set[str]:
        return set(self.state.drains)

    def save_plan(self, version: int, model: str, body: dict[str, Any]) -> bool:
        return self._submit(self.state.set_plan, version, model, body)

    def plan(self) -> tuple[int, str, dict[str, Any]] | None:
        return self.state.plan

    def save_model(self, model: str) -> bool:
        return self._submit(self.state.set_model, model)

    def save_join_tokens(self, records: dict[str, dict[str, Any]]) -> bool:
        return self._submit(self.state.set_join_tokens, records)

    def audit(self, action: str, target: str, result: str, detail: str = "") -> bool:
        return self._submit(self.state.add_audit, time.time(), action, target, result, detail)

    def audit_log(self, limit: int = 200) -> list[AuditEntry]:
        return [AuditEntry(*row) for row in self.state.audit[-limit:]]
