"""Where a step's result goes, a part of the node agent (:class:`exo_tui.node.agent.NodeAgent`):
the next hop's hidden state, the last hop's token to the coordinator, the hand-off of that token
straight to the first hop (``ahead`` steps, whose lead must still be the latest the coordinator
sent), and a step's failure. The agent's connections to its peers are kept here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from exo_tui.inference.sampling import scores_to_array
from exo_tui.net import messages as wire
from exo_tui.net.client import connect
from exo_tui.net.codec import Message, send
from exo_tui.net.connection import Connection
from exo_tui.net.errors import RemoteError
from exo_tui.net.frame import Frame
from exo_tui.net.protocol import FILLED, HostError, RingPlan
from exo_tui.net.timing import hop_timing
from exo_tui.node.executor import DISCARDED, Sampled, Step, StepExecutor
from exo_tui.node.host import ShardHost
from exo_tui.node.kv_budget import BudgetExceeded
from exo_tui.node.profile import NodeProfile, RequestRates

log = logging.getLogger("exo_tui.node")

FINISHED_MEMORY = 10_000  # ended requests remembered, so late steps of theirs are discarded
# A token the last node hands on waits up to this long for the next ones, so that they go to the
# coordinator a few to a write (one wake-up of its process, one TLS record: on one 2-core machine
# each took CPU from the node's next step); a step longer than it sends each token at once.
TOKEN_HOLD_S = 0.010


class StepRouting:
    """A step's result on its way (a part of the NodeAgent, which holds the state below)."""

    security: Any
    host: ShardHost | None
    profile: NodeProfile | None
    coordinator: Connection | None
    executor: StepExecutor
    decode_steps: int
    decode_compute_s: float
    _peers: dict[tuple[str, int], Connection]
    _peer_locks: dict[tuple[str, int], asyncio.Lock]
    _stats: RequestRates
    _finished: OrderedDict[str, None]
    _leads: OrderedDict[str, int | None]
    _handing: set[asyncio.Task[Any]]

    @property
    def started_host(self) -> ShardHost:
        """The shards and plans this node holds (set when it starts)."""
        if self.host is None:
            raise HostError("the node agent has not started: it holds no shards yet")
        return self.host

    @property
    def started_profile(self) -> NodeProfile:
        """This device's profile (measured when it starts)."""
        if self.profile is None:
            raise HostError("the node agent has not started: it has no profile yet")
        return self.profile

    def _lead(self, rid: str, lead: int | None) -> None:
        """The coordinator sent ``rid`` a step of lead ``lead``: handed steps of any other lead go."""
        self._leads[rid] = lead
        self._leads.move_to_end(rid)
        while len(self._leads) > FINISHED_MEMORY:
            self._leads.popitem(last=False)

    def _superseded(self, msg: wire.Forward) -> bool:
        """A handed step whose lead is no longer the latest step the coordinator sent its request."""
        return msg.handed and (msg.lead is None or self._leads.get(msg.rid) != msg.lead)

    def _next_ready(self, plan: RingPlan, hop: int) -> bool:
        """Whether the result can go on without connecting first (a connection takes a while:
        that is done by the worker's loop, not in the read loop where steps run inline)."""
        if hop + 1 >= len(plan.ring):
            return True
        nxt = plan.ring[hop + 1]
        conn = self._peers.get((nxt.host, nxt.port))
        return conn is not None and not conn.is_closed

    async def _deliver(self, step: Step, result: Any, more: int = 0) -> None:
        """Send a step's result on. ``more``: how many more hidden states of the same run go to
        the same next hop right after this one (it then waits for them, to keep the batch)."""
        f, msg = step.frame, step.body
        rid = msg.rid
        if result is DISCARDED or rid in self._finished or self._superseded(msg):
            self._stats.forget(rid)
            return
        if isinstance(result, Exception):
            await self._fail_step(step, str(result), kv_budget=isinstance(result, BudgetExceeded))
            return
        plan = self.started_host.plans.get(f.plan) if f.plan is not None else None
        if plan is None:
            await self._fail_step(step, f"plan {f.plan} was dropped during the step")
            return
        if step.rows == 1:
            self.decode_steps += 1
            self.decode_compute_s += step.compute_s
        timing = [*(msg.timing or ()),
                  hop_timing(self.started_profile.node_id, step.received_s, step.started_s, step.compute_s).to_wire()]
        if isinstance(result, Sampled):  # the last hop: a sampled token (or FILLED)
            token, logprobs, scores = result.token, result.logprobs, result.scores
            if token != FILLED:
                self._stats.drew(rid, 1 if result.verdict is None else len(result.verdict.tokens))
            verdict = result.verdict  # a verify step's: the drafts kept and the next token
            token_msg = wire.Token(rid, msg.step, int(token), timing, None if logprobs is None else logprobs.to_wire(),
                              scores is not None, None if verdict is None else list(verdict.tokens),
                              None if verdict is None else verdict.accepted,
                              None if result.listed is None else [x.to_wire() for x in result.listed])
            tensor = None if scores is None else scores_to_array(scores)  # the prompt's scores, as the frame's tensor
            hand_on = msg.ahead > 0 and verdict is None and token != FILLED and token not in (msg.halt_on or ())
            # the token goes out at the end of this loop turn (writes coalesce), the handed step after it;
            # one of a handed step handed on may wait for the next ones (TOKEN_HOLD_S; the lease's last
            # takes them along); a step the coordinator sent answers at once (its round trip is timed)
            await self._to_coordinator(token_msg, tensor=tensor, plan=f.plan,
                                       hold_s=self._token_hold_s(step) if hand_on and msg.handed else 0.0)
            if hand_on:
                await self._hand_off(step, plan, int(token))
            return
        nxt = plan.ring[step.hop + 1]
        onward = msg.copy(hop=step.hop + 1, timing=timing, more=more)
        try:
            peer = await self._peer(nxt.host, nxt.port)
            await send(peer, onward, tensor=np.ascontiguousarray(result, dtype=np.float32), plan=f.plan)
        except (TimeoutError, OSError, ConnectionError, RemoteError) as exc:
            await self._fail_step(step, f"cannot reach next hop {nxt.node_id} at {nxt.host}:{nxt.port}: {exc}", failed=nxt.node_id)

    async def _hand_off(self, step: Step, plan: RingPlan, token: int) -> None:
        """The last hop hands the token it drew to the first hop as the next step (before the
        coordinator hears of it): here, without a socket, where this node is the first hop."""
        msg = step.body
        nxt = msg.copy(hop=0, pos=msg.n_tokens, step=msg.step + 1, n_tokens=msg.n_tokens + 1, ahead=msg.ahead - 1,
                       handed=True, history=None if msg.history is None else [*msg.history, token], adopt=None,
                       score=None, timing=None, more=0)
        tensor = np.array([token], dtype=np.int64)
        first = plan.ring[0]
        if first.node_id == self.started_profile.node_id:
            handed = Step(step.conn, Frame("forward", tensor=tensor, plan=step.frame.plan), nxt)
            # a task, not a call: the read loop runs between two steps (a drop, a newer step, pings)
            task = asyncio.create_task(self._arrive_handed(handed, self._next_ready(plan, 0)))
            self._handing.add(task)
            task.add_done_callback(self._handing.discard)
            return
        try:
            await send(await self._peer(first.host, first.port), nxt, tensor=tensor, plan=step.frame.plan)
        except (TimeoutError, OSError, ConnectionError, RemoteError) as exc:
            reason = f"cannot hand the token to the first hop {first.node_id} at {first.host}:{first.port}: {exc}"
            log.warning("step of %s failed: %s", msg.rid, reason)
            await self._to_coordinator(wire.StepFailed(msg.rid, reason, nxt.step, self.started_profile.node_id,
                                                       first.node_id, False), plan=step.frame.plan)

    async def _arrive_handed(self, step: Step, next_ready: bool) -> None:
        """A step this node handed itself arrives: now, once the token before it has gone to the
        coordinator (that write is the hand-off's, as it is a link's between two nodes, not the
        step's time here)."""
        step.received_s = time.monotonic()
        await self.executor.arrived(step, next_ready=next_ready)

    async def _fail_step(self, step: Step, reason: str, failed: str | None = None, *, kv_budget: bool = False) -> None:
        # kv_budget: refused for want of memory, no node is at fault
        failure = wire.StepFailed(step.body.rid, reason, step.body.step, self.profile.node_id if self.profile else "", failed,
                             kv_budget)
        log.warning("step of %s failed: %s", failure.rid, reason)
        await self._to_coordinator(failure, plan=step.frame.plan)

    def _token_hold_s(self, step: Step) -> float:
        """How long a token this node hands on may wait for the next ones before it goes to the
        coordinator: what TOKEN_HOLD_S leaves after the tokens already waiting, where the next
        step (as long as this one) ends within it; else 0 (it goes at the end of this turn)."""
        conn = self.coordinator
        if conn is None:
            return 0.0
        left = TOKEN_HOLD_S - conn.held_s
        return left if left >= step.compute_s else 0.0

    async def _to_coordinator(self, msg: Message, *, tensor: np.ndarray | None = None, plan: int | None = None,
                              hold_s: float = 0.0) -> None:
        conn = self.coordinator
        if conn is None or conn.is_closed:
            log.warning("no coordinator attached: dropping %s", msg.TYPE)
            return
        try:
            await send(conn, msg, tensor=tensor, plan=plan, hold_s=hold_s)
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
