"""Running requests through a ring of node agents, and surviving the ring changing under them.

A step sends the request's new tokens to the first hop of the plan in force; each node runs its
layers and forwards the hidden state to the next; the last samples and sends the token back on
its connection to the coordinator, which resolves the step's future.

The hand-off: a plain decode step (no drafts, nothing to rebuild) goes out with a lease of
``lease_tokens - 1`` more steps (``ahead``): the last hop hands each token it draws straight to the
first hop as the next step's, and tells the coordinator of it in parallel (a handed step's tokens
a few to a write, within ``TOKEN_HOLD_S`` of node/routing.py), so a token crosses the ring's links
only, not the coordinator's. The coordinator still sees every token, in order, and
decides the answer's end: the lease never runs past ``max_tokens`` or the context, stops at an
end-of-sequence token (``halt_on``), and a stop string, a cancel or a failure abandons the rest
(the nodes discard a handed step of a request dropped or sent a newer step, ``lead``); what the
ring ran past is cut back when the caches are next used. The request's tokens (the accepted ones)
stay the checkpoint. A lease counts as one step in flight on its plan until its last token came
(a plan switch waits for it). A stream that drafts (:func:`drafting`) takes no lease: each of its
steps goes with the drafts of its time; one that starts drafting has them verified once its lease
has run out.

The pipeline remembers, per request, which plan version its KV caches belong to and how many
tokens they hold. When the plan in force is a newer one — a drain, a rebalance, a failure — and
the caches were not moved to it, the step re-runs the request's whole token history (its
checkpoint) on the new ring, which rebuilds the caches there. A failed step is retried on the
plan the coordinator makes over the survivors, up to ``retry_limit`` times.

A request that runs to its end (not cancelled, not failed) leaves its caches on its nodes for a
while (the last ``KEEP_FINISHED``). A chat's next turn sends the whole conversation again; when
its tokens begin with an earlier request's prompt and part of that request's answer, its first
step takes those caches over (``adopt`` in the frame) and runs only what follows. A new request
sharing no more than the earlier one's prompt is run from scratch, so asking the same question
twice runs the same steps twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from backends.memory import MIN_PREFILL_CHUNK
from exo_tui.cluster.admission import KVBudgetExceeded
from exo_tui.cluster.handoff import Leases
from exo_tui.cluster.metrics import StepSample
from exo_tui.cluster.ring_steps import (
    STEP_TIMEOUT_S,
    Cached,
    Kept,
    Lease,
    PipelineHost,
    Result,
    Sent,
    StepFailure,
    VerdictReply,
    drafting,
    expire,
    shared_prefix,
)
from exo_tui.inference.generate import GenerationError
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import TokenLogprobs
from exo_tui.inference.speculative import Draft, Verdict
from exo_tui.net.codec import call, send
from exo_tui.net.errors import ConnectionClosed, RemoteError
from exo_tui.net.messages import Done, DraftQ, Drop, Forward, ScoreAsk
from exo_tui.net.protocol import RingPlan
from exo_tui.net.timing import HopTiming, timings_from_wire
from exo_tui.scheduler.plan import LEASE_TOKENS as LEASE_TOKENS

log = logging.getLogger("exo_tui.cluster")

KEEP_FINISHED = 2  # finished requests whose caches stay on their nodes for a next turn
MIN_ADOPTED = 16  # fewer shared tokens than this are run again rather than taken over


class RemotePipeline(Leases):
    """A :class:`~exo_tui.inference.generate.StepRunner` over node agents."""

    def __init__(self, host: PipelineHost) -> None:
        self.host = host
        self._pending: dict[tuple[str, int, int], asyncio.Future[Result]] = {}
        self._cached: dict[str, Cached] = {}
        self._served: dict[str, tuple[str, ...]] = {}
        self._active_plans: dict[str, RingPlan] = {}
        self._models: dict[str, str] = {}  # request id -> the model tag its tokens are of (pin_model)
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        # Each step's timing goes to this, when set (the coordinator's metrics).
        self.on_step_timed: Callable[[StepSample], None] | None = None
        self._timing: dict[tuple[str, int, int], tuple[tuple[HopTiming, ...] | None, float, float]] = {}
        self._verdicts: dict[tuple[str, int, int], VerdictReply] = {}  # verify steps' replies, by step
        self._verifying: set[tuple[str, int, int]] = set()  # the verify steps awaited
        self._handed_gone = set()
        self._last_token_s: dict[str, float] = {}  # request id -> when its last token came
        self._leases: dict[str, Lease] = {}  # request id -> its hand-off lease
        self._leads = itertools.count(secrets.randbits(48))  # each step the coordinator sends: a new lead
        self.lease_tokens = LEASE_TOKENS  # the steps of a hand-off lease (scheduler/plan.py); 1: none
        self.context: Callable[[], int] = lambda: 0  # the context requests run at (0: no hand-off)
        self.halt_on: Callable[[], frozenset[int]] = frozenset  # tokens after which a lease stops (EOS)
        self.handed_steps = 0  # steps the ring ran on its own and whose token was used
        self.filled_chunks = 0  # steps that filled a prompt's chunk (_fill_and_run)
        self.failed_steps = 0  # steps that failed and were tried again
        self._chunk_ids = itertools.count(1)  # a chunk's step id, negated (_send)
        self.most_chunks_in_flight = 0  # the most chunks of one prompt sent and not yet back
        # The model's windowed layers' cache bound (ModelConfig.ring_window; 0: none): a kept
        # cache past it can be cut back by one position only.
        self.window: Callable[[], int] = lambda: 0

    # ------------------------------------------------------------------ frames from nodes

    def on_token(self, rid: str, step: int, plan_version: int, token: int, logprobs: TokenLogprobs | None,
                 scores: list[TokenLogprobs] | None = None, timing: Any = None,
                 verdict: VerdictReply | None = None) -> None:
        key = (rid, step, plan_version)
        fut = self._pending.get(key)
        if verdict is None and key in self._verifying and key in self._handed_gone:
            return  # the token of a handed step given up (a lease left for drafts), not the verify step's reply
        if fut is not None and not fut.done():
            hops = timings_from_wire(timing)
            self._timing[(rid, step, plan_version)] = (hops, time.monotonic(), time.time())
            if verdict is not None:
                self._verdicts[(rid, step, plan_version)] = verdict
            fut.set_result((token, logprobs, scores))
            lease = self._leases.get(rid)
            if lease is not None and lease.plan.version == plan_version and lease.steps.get(step) is not None:
                self._lease_token(rid, lease, step, token, hops)

    def on_step_failed(self, rid: str, step: int | None, plan_version: int | None, error: str, node_id: str | None,
                       *, kv_budget: bool = False) -> None:
        for key, fut in list(self._pending.items()):
            if key[0] == rid and (step is None or key[1] == step) and not fut.done():
                fut.set_exception(StepFailure(error, node_id, kv_budget=kv_budget))

    def fail_node(self, node_id: str, reason: str) -> None:
        """A node died: every step in flight on a plan that includes it fails now."""
        for (rid, _step, _version), fut in list(self._pending.items()):
            plan = self._active_plans.get(rid)
            if plan is not None and any(e.node_id == node_id for e in plan.ring) and not fut.done():
                fut.set_exception(StepFailure(reason, node_id))

    # ------------------------------------------------------------------ StepRunner

    def cached(self, rid: str) -> tuple[int, int] | None:
        c = self._cached.get(rid)
        return (c.version, c.length) if c else None

    def set_cached(self, rid: str, version: int, length: int) -> None:
        """Record that a request's caches now live on plan ``version`` (after a KV move)."""
        self._cached[rid] = Cached(version, length)

    def forget_cached(self, rid: str) -> None:
        """The request's caches are gone (a node unloaded their shard): its next step rebuilds them
        from its tokens."""
        self._cached.pop(rid, None)

    def in_flight(self) -> list[str]:
        return list(self._cached)

    def pin_model(self, rid: str, model: str) -> None:
        """The request's tokens are of the model tagged ``model``: a plan of another model (after
        a model switch) ends it rather than running them there."""
        self._models[rid] = model

    async def step(self, request: Request, start: int, *, reserved: int | None = None) -> tuple[int, TokenLogprobs | None]:
        """A plain step; ``reserved``: the positions admission holds for the request's caches, which
        a lease's steps (the ring running on alone) may not pass."""
        token, logprobs, _ = await self._step(request, start, None, reserved)
        return token, logprobs

    async def verify(self, request: Request, start: int, draft: Draft) -> tuple[Verdict, list[TokenLogprobs] | None]:
        """A verify step (:class:`~exo_tui.inference.generate.Verifier`): the request's last token
        and ``draft``'s run as one step, the last hop checking them. Where the caches must be
        rebuilt first (a new plan, a failure), the step is a plain one and the draft waits."""
        token, logprobs, reply = await self._step(request, start, draft)
        if reply is None:
            return Verdict((token,), 0, 0), None if logprobs is None else [logprobs]
        tokens, accepted, listed = reply
        return Verdict(tokens, accepted, len(draft)), listed

    async def _step(self, request: Request, start: int, draft: Draft | None,
                    reserved: int | None = None) -> tuple[int, TokenLogprobs | None, VerdictReply | None]:
        attempts = 0
        while True:
            # drafts worth a verify step (not a probe of the plan's cost) end a lease at its next token
            leased = self._leased(request, drafts=draft is not None and len(draft) > 0 and drafting(request))
            if leased is not None:
                try:
                    token, logprobs, _ = await self._result(leased)
                except (TimeoutError, StepFailure, ConnectionClosed, ConnectionError, RemoteError) as exc:
                    self._drop_lease(request.id)
                    attempts = await self._failed(request, leased.plan, exc, attempts)
                    continue
                self.handed_steps += leased.handed
                return token, logprobs, None
            plan = await self.host.plan_ready()
            if self._models.get(request.id, plan.model) != plan.model:
                self.host.step_done()
                raise GenerationError("the cluster switched to another model during this answer (its tokens are the "
                                      "old model's): ask again")
            cached = self._cached.get(request.id)
            if cached is not None and cached.version != plan.version:
                old = self._active_plans.get(request.id)
                self._cached.pop(request.id, None)
                if old is not None:
                    # Free the caches on nodes that left the ring. Nodes still in it must not get a
                    # drop racing the rebuild: they reset a stale cache themselves when a step
                    # starts at position 0.
                    gone = [e for e in old.ring if all(e.node_id != n.node_id for n in plan.ring)]
                    if gone:
                        asyncio.create_task(self._drop_on(replace(old, ring=tuple(gone)), request.id))
                cached = None
            pos = cached.length if cached is not None else 0
            # a prompt to score runs whole: a kept cache would leave its first positions unscored
            may_adopt = cached is None and start == 0 and not request.wants_prompt_scores
            adopted = self._take_kept(request, plan) if may_adopt else None
            if adopted is not None:
                pos = request.cached_tokens = adopted[1]
            # drafts run with the last token only: caches to rebuild first take a plain step
            drafts = draft if draft is not None and pos == request.n_tokens - 1 and adopted is None else None
            # a plain decode step goes with a lease (the hand-off): the ring runs on from its token
            ahead = 0
            if draft is None and adopted is None and pos == request.n_tokens - 1 and not request.wants_prompt_scores \
                    and not drafting(request):
                room = min(request.max_tokens - len(request.generated), self.context() - request.n_tokens)
                if reserved is not None:  # a lease's steps grow the caches with no word from admission
                    room = min(room, reserved - request.n_tokens + 1)
                ahead = max(0, min(self.lease_tokens - 1, room - 1))
            reply: VerdictReply | None = None
            try:
                try:
                    adopt = adopted[0] if adopted else None
                    if drafts is not None:
                        (token, logprobs, scores), reply = await self._run_verify(plan, request, pos, drafts)
                    elif request.wants_prompt_scores:  # a prompt to score runs whole, as it is scored
                        token, logprobs, scores = await self._run(plan, request, pos, adopt)
                    elif ahead:
                        token, logprobs, scores = await self._run(plan, request, pos, ahead=ahead)
                    else:
                        token, logprobs, scores = await self._fill_and_run(plan, request, pos, adopt)
                    if scores is not None and [x.token for x in scores] != request.prompt_ids[1:]:
                        last = plan.ring[-1].node_id
                        raise StepFailure(f"node {last} scored {len(scores)} tokens that are not the prompt's "
                                          f"{len(request.prompt_ids) - 1} after its first", last)
                finally:
                    lease = self._leases.get(request.id) if ahead else None
                    if lease is not None and lease.plan is plan and lease.open and lease.first == len(request.generated):
                        lease.holds_step = True  # the plan's step in flight ends with the lease
                    else:
                        self.host.step_done()
            except (TimeoutError, StepFailure, ConnectionClosed, ConnectionError, RemoteError) as exc:
                if ahead:
                    self._drop_lease(request.id)
                if adopted is not None:  # whatever was not taken over yet goes; the retry runs it all
                    request.cached_tokens = 0
                    asyncio.create_task(self._drop_on(plan, adopted[0], final=True))
                attempts = await self._failed(request, plan, exc, attempts)
                continue
            self._ran(request, plan, request.n_tokens + (reply[1] if reply else 0), leased=bool(ahead))
            if scores is not None:
                request.prompt_scores = scores
            return token, logprobs, reply

    def _ran(self, request: Request, plan: RingPlan, length: int, *, leased: bool) -> None:
        """A step the coordinator sent came back: the caches hold the request's tokens and the
        drafts accepted, ``length`` positions (the rejected ones' are cut back when the next step
        begins there). A step that opened a lease may come back after tokens of the lease's later
        steps (a node sends a lease's tokens a few to a write): those positions, which the lease's
        tokens recorded, are on the nodes too, and stay counted (an earlier lease's count does not:
        a step sent after it starts where the request's tokens say, and the nodes cut back there)."""
        lease = self._leases.get(request.id) if leased else None
        if lease is not None and lease.plan is plan and lease.first == len(request.generated):
            length = max(length, lease.cached)
        self._cached[request.id] = Cached(plan.version, length)

    async def _failed(self, request: Request, plan: RingPlan, exc: Exception, attempts: int) -> int:
        """A step of ``request`` on ``plan`` failed with ``exc``: once a new plan is in force, the
        attempts so far (the retry runs the request's tokens again); raises where it may not retry."""
        if isinstance(exc, StepFailure) and exc.kv_budget:
            self._cached.pop(request.id, None)
            raise KVBudgetExceeded(str(exc)) from exc  # admission decides: wait, or fail
        attempts += 1
        self.failed_steps += 1
        failure = exc if isinstance(exc, StepFailure) else StepFailure(str(exc) or type(exc).__name__)
        log.warning("request %s: step failed on plan %d (%s); attempt %d", request.id, plan.version, failure, attempts)
        self._cached.pop(request.id, None)
        if attempts > self.host.retry_limit:
            raise GenerationError(
                f"request {request.id} failed {attempts} times in a row; last error: {failure}"
            ) from exc
        await self.host.step_failed(failure, plan)
        return attempts

    async def _fill_and_run(self, plan: RingPlan, request: Request, pos: int, adopt: str | None) -> Result:
        """The step: a long prompt goes through the ring a chunk at a time, the last chunk drawing
        the first token. Whole, each node would receive and send all its rows' hidden states at
        once (rows x hidden floats, a few copies), which a node under a memory limit cannot hold
        beside its caches (the 8B shape's ring at 1.9 GB limits and a 1,900-token prompt: two
        nodes 39 and 94 MB past their limits, then a budget too small for the request's caches).
        The chunks are pipelined: the next is sent without waiting for the one before to come back,
        up to one a node of the ring that runs beside the others (``fill_window``; at most
        ``FILL_QUEUED`` waiting at a node, which the nodes size their chunks for), so while the last
        node runs one chunk the first runs a later one. A node runs a request's chunks in order,
        one a run (``batching.one_step_a_key``)."""
        if request.n_tokens - pos <= MIN_PREFILL_CHUNK:  # a decode step, or a short prompt: no lookup
            return await self._run(plan, request, pos, adopt)
        rows = self.host.prefill_rows(plan)
        window = self.host.fill_window(plan)
        filling: deque[Sent] = deque()
        last: Sent | None = None
        try:
            while True:
                if len(filling) >= window:
                    await self._filled(request, filling.popleft())
                if request.n_tokens - pos <= rows:
                    break
                filling.append(await self._send(plan, request, pos, adopt, end=pos + rows))
                self.most_chunks_in_flight = max(self.most_chunks_in_flight, len(filling))
                pos, adopt = pos + rows, None
            last = await self._send(plan, request, pos, adopt)
            while filling:
                await self._filled(request, filling.popleft())
            return await self._result(last)
        finally:  # a chunk failed (or the request was cancelled): what is still out is abandoned
            for sent in (*filling, *([last] if last is not None else [])):
                self._abandon(sent)

    async def _filled(self, request: Request, sent: Sent) -> None:
        await self._result(sent)
        self.filled_chunks += 1
        self._cached[request.id] = Cached(sent.plan.version, sent.end)

    def _take_kept(self, request: Request, plan: RingPlan) -> tuple[str, int] | None:
        """The kept request whose caches this one's first step can take over, and how many of its
        positions: at least MIN_ADOPTED tokens shared, more than that request's prompt, and at
        least one token of this request left to run, and where the model's windowed layers keep
        only their last positions, a cut back that leaves them what the next query sees (else
        the nodes could not cut them back). Kept caches of an older plan go."""
        best: tuple[str, int] | None = None
        window = self.window()
        for rid, kept in list(self._kept.items()):
            if kept.plan.version != plan.version:
                del self._kept[rid]
                asyncio.create_task(self._drop_on(kept.plan, rid, final=True))
                continue
            n = shared_prefix(request.tokens, kept.tokens)
            held = len(kept.tokens)
            cuttable = not window or max(0, held - window) <= max(0, n - window + 1)
            if cuttable and n > kept.prompt and MIN_ADOPTED <= n < len(request.tokens) and (best is None or n > best[1]):
                best = (rid, n)
        if best is not None:
            del self._kept[best[0]]
        return best

    def steps_in_flight(self) -> int:
        """Steps sent to a ring whose replies are awaited (a long prompt's chunks each count)."""
        return len(self._pending)

    def kept_requests(self) -> int:
        """Finished requests whose caches are kept (on every node of their ring)."""
        return len(self._kept)

    def kept_positions(self) -> int:
        """Positions the kept caches of finished requests hold (on every node of their ring)."""
        return sum(len(k.tokens) for k in self._kept.values())

    async def evict(self, request: Request) -> None:
        """Give back a request's caches between two of its steps (it was preempted for memory):
        its next step rebuilds them from its tokens."""
        self._cached.pop(request.id, None)
        self._drop_lease(request.id)
        plan = self._active_plans.get(request.id)
        if plan is not None:
            await asyncio.shield(self._drop_on(plan, request.id))

    async def forget_kept(self) -> None:
        """Drop every finished request's caches left on the nodes (the coordinator is stopping)."""
        kept, self._kept = self._kept, OrderedDict()
        await asyncio.gather(*(self._drop_on(k.plan, rid, final=True) for rid, k in kept.items()))

    async def _run(self, plan: RingPlan, request: Request, pos: int, adopt: str | None = None, ahead: int = 0) -> Result:
        """One step through the ring: the request's tokens from ``pos``, the last hop drawing the
        next token (and, ``ahead``, running on from it: a lease)."""
        return await self._result(await self._send(plan, request, pos, adopt, ahead=ahead))

    async def _run_verify(self, plan: RingPlan, request: Request, pos: int,
                          draft: Draft) -> tuple[Result, VerdictReply | None]:
        """A verify step through the ring, and its last hop's verdict."""
        sent = await self._send(plan, request, pos, draft=draft)
        result = await self._result(sent)
        reply = sent.verdict
        if reply is None:
            last = plan.ring[-1].node_id
            raise StepFailure(f"node {last} answered a verify step without its verdict", last)
        if len(reply[0]) > len(draft) + 1 or list(reply[0][:-1]) != list(draft.tokens[: len(reply[0]) - 1]):
            last = plan.ring[-1].node_id
            raise StepFailure(f"node {last} accepted tokens that were not the draft's", last)
        return result, reply

    async def _send(self, plan: RingPlan, request: Request, pos: int, adopt: str | None = None, end: int | None = None,
                    draft: Draft | None = None, ahead: int = 0) -> Sent:
        """Send a step to the ring's first node: the request's tokens from ``pos``, the last hop
        drawing the next token; or (``end``) its tokens up to ``end`` only, filling the caches (a
        prompt's chunk, which comes back as FILLED). A chunk's correlation id (``step``) is its
        own, negative, so the chunks of one step in flight at once tell their replies apart.
        ``ahead``: the ring runs that many more steps on its own (a lease, awaited here too)."""
        step = len(request.generated) if end is None else -next(self._chunk_ids)
        key = (request.id, step, plan.version)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Result] = loop.create_future()
        self._pending[key] = fut
        self._drop_lease(request.id)  # a step sent supersedes what the ring ran on its own
        if draft is not None and len(draft):
            self._verifying.add(key)
        self._active_plans[request.id] = plan
        self._served[request.id] = tuple(e.node_id for e in plan.ring)
        drafted = list(draft.tokens) if draft is not None else []
        body = Forward(
            rid=request.id,
            hop=0,
            pos=pos,
            step=step,
            n_tokens=request.n_tokens if end is None else end,
            sampling=request.sampling.to_dict(),
            fill=end is not None,
            history=request.tokens if request.sampling.uses_history and end is None else None,
            adopt=adopt,
            logprobs=request.top_logprobs,
            score=ScoreAsk(request.prompt_logprobs, request.prompt_ids[1:])
            if pos == 0 and request.wants_prompt_scores and request.prompt_logprobs is not None else None,
            draft=drafted or None,
            draft_q=DraftQ(*draft.q.to_wire()) if draft is not None and draft.q is not None else None,
            ahead=ahead,
            lead=next(self._leads),
            halt_on=sorted(self.halt_on()) or None if ahead else None,
        )
        sent = Sent(key, fut, plan, (request.n_tokens if end is None else end) - pos + len(drafted),
                     (end or request.n_tokens) + len(drafted))
        if ahead:
            lease = self._leases[request.id] = Lease(plan, step, request.n_tokens, {step: sent}, step + ahead)
            for i in range(1, ahead + 1):
                f: asyncio.Future[Result] = loop.create_future()
                k = (request.id, step + i, plan.version)
                self._pending[k] = f
                lease.steps[step + i] = Sent(k, f, plan, 1, request.n_tokens + i, handed=True,
                                              timer=loop.call_later(STEP_TIMEOUT_S, expire, f))
                f.add_done_callback(functools.partial(self._lease_failed, lease))
        first = plan.ring[0].node_id
        try:
            try:
                conn = self.host.connection(first)
            except KeyError as exc:
                raise StepFailure(f"node {first} is not connected", first) from exc
            sent_m = time.monotonic()
            last = self._last_token_s.get(request.id)
            sent.times = (sent_m, time.time(), sent_m - last if last is not None and pos > 0 and end is None else None)
            tokens = request.tokens_from(pos) + drafted if end is None else request.tokens[pos:end]
            try:
                await send(conn, body, tensor=np.asarray(tokens, dtype=np.int64), plan=plan.version)
            except (ConnectionError, OSError) as exc:
                raise StepFailure(f"cannot send to {first}: {exc}", first) from exc
        except BaseException:  # not sent (or cancelled while sending): nothing to wait for
            self._abandon(sent)
            if ahead:
                self._drop_lease(request.id)
            raise
        # A timer that fails the future, not asyncio.timeout (a tenth of the coordinator's time
        # a token went to its task bookkeeping) nor wait_for (Python 3.11's drops a cancel that
        # lands when the token has just come, so a stopped answer went on). A cancel of the task
        # awaiting it cancels ``fut`` and comes out of the await as it is.
        sent.timer = loop.call_later(STEP_TIMEOUT_S, expire, fut)
        return sent

    async def _result(self, sent: Sent) -> Result:
        """What a sent step gives back (raises its failure); it is then no longer waited for."""
        try:
            result = await sent.fut
            sent.verdict = self._verdicts.pop(sent.key, None)
            self._timed(sent.key, sent.plan, sent.rows, sent.times, sent.end, sent.handed)
            return result
        finally:
            self._abandon(sent)

    def _abandon(self, sent: Sent) -> None:
        """A sent step is no longer waited for (its reply came, or it was given up): a reply that
        still comes is dropped."""
        if sent.timer is not None:
            sent.timer.cancel()
        if not sent.fut.done():
            sent.fut.cancel()
        elif not sent.fut.cancelled():
            sent.fut.exception()  # retrieved: a failure behind the one being raised is not logged as lost
        waited = self._pending.get(sent.key)
        if waited is not None and waited is not sent.fut:
            return  # a step sent since under the same key (a verify step in a lease's place): its own
        self._pending.pop(sent.key, None)
        self._timing.pop(sent.key, None)
        self._verdicts.pop(sent.key, None)
        if sent.key in self._verifying:
            self._verifying.discard(sent.key)
            self._handed_gone.discard(sent.key)

    def _timed(self, key: tuple[str, int, int], plan: RingPlan, rows: int, sent: tuple[float, float, float | None],
               context: int, handed: bool = False) -> None:
        """Hand the step's timing (the hops' records that came with its token) to ``on_step_timed``."""
        got = self._timing.pop(key, None)
        if got is None:
            return
        hops, recv_m, recv_w = got
        self._last_token_s[key[0]] = recv_m
        if self.on_step_timed is None or hops is None or [h.node_id for h in hops] != [e.node_id for e in plan.ring]:
            return
        sent_m, sent_w, coordinator_s = sent
        if not sent_m:  # a handed step whose previous token came without its timing
            return
        # a handed step's way: from the last hop's hand-off of the token before to its own (one clock)
        round_trip = hops[-1].out_wall - sent_w if handed else recv_m - sent_m
        self.on_step_timed(StepSample(key[0], plan.version, rows, sent_w, recv_w, round_trip, coordinator_s, hops,
                                      context, handed))

    async def _drop_on(self, plan: RingPlan, rid: str, *, final: bool = False) -> None:
        async def drop(node_id: str) -> None:
            with contextlib.suppress(Exception):  # a node gone or failing drops its caches as it goes
                await call(self.host.connection(node_id), Drop(rid, final), Done, timeout=5)

        await asyncio.gather(*(drop(e.node_id) for e in plan.ring))

    async def release(self, request: Request) -> None:
        """The request has ended (or was cancelled, maybe mid-step). When it ran to its end, with
        its caches whole on the plan in force, they stay for a next turn (the oldest kept ones
        go); otherwise (cancelled, failed) they are dropped for good, everywhere, and a step of it
        still on its way is discarded by the nodes."""
        cached = self._cached.pop(request.id, None)
        self._models.pop(request.id, None)
        self._last_token_s.pop(request.id, None)
        lease = self._leases.get(request.id)
        # the ring ran past the answer's end (a stop string): those positions are cut back when
        # the caches are next used; where it still runs, they are dropped
        ran_past = lease is not None and any(s.fut.done() for k, s in lease.steps.items() if k >= len(request.generated))
        in_flight = lease is not None and lease.open
        self._drop_lease(request.id)
        self._handed_gone = {k for k in self._handed_gone if k[0] != request.id}
        for key, fut in list(self._pending.items()):
            if key[0] == request.id and not fut.done():
                fut.cancel()
                in_flight = True
        plan = self._active_plans.pop(request.id, None)
        if plan is None:
            return
        ended = request.finish_reason in ("stop", "length")
        if ran_past and self.window():  # the ring ran past the answer's end: windowed layers cannot cut it back
            in_flight = True
        if ended and not in_flight and cached is not None and cached.version == plan.version \
                and cached.length > len(request.prompt_ids):
            self._kept[request.id] = Kept(tuple(request.tokens[: cached.length]), len(request.prompt_ids), plan)
            while len(self._kept) > KEEP_FINISHED:
                rid, old = self._kept.popitem(last=False)
                await asyncio.shield(self._drop_on(old.plan, rid, final=True))
            return
        await asyncio.shield(self._drop_on(plan, request.id, final=True))

    def keep_left(self, rid: str, tokens: list[int], prompt: int, plan: RingPlan) -> None:
        """Caches that a request of an earlier leader left on the nodes of ``plan``, holding
        ``tokens``: kept as a finished request's, so that the request resumed from it (a stream a
        standby re-issues, :mod:`exo_tui.api.forwarding`) takes them over, not a prefill."""
        self._kept[rid] = Kept(tuple(tokens), prompt, plan)

    def served_by(self) -> tuple[str, ...]:
        """Names of the nodes of the most recent request's ring."""
        if not self._served:
            return ()
        return tuple(self.host.node_name(n) for n in next(reversed(self._served.values())))

    def served_by_request(self, rid: str) -> tuple[str, ...]:
        return self._served.get(rid, ())
