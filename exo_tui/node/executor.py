"""The step executor: a node's forward steps, from their arrival to their results.

A step (:class:`Step`) is one request's pass through this node's layers. :class:`StepExecutor`
holds the queue steps wait in and the one worker thread that runs them, forms batches (the rules
are :mod:`exo_tui.node.batching`'s), and runs a batch (:meth:`StepExecutor.run`): grouped by
shard, a conversation's cached prefix taken over (``adopt``), a stale cache cut back, checked
against the KV budget, fused into one forward run where the backend can, and, on the last shard,
scored (a prompt's ``score``) and sampled (:mod:`exo_tui.node.sampling_step`). Each result goes to
the ``deliver`` callback the agent gives it, which sends it on (the next hop, or the coordinator).

Interface, as :mod:`exo_tui.node.agent` uses it:

==========================  =====================================================================
``arrived(step, ...)``      a step came (in the read loop): run it at once, or queue it
``work()``                  the loop that runs what is queued (the agent's task)
``run(batch)``              one run of steps on the shards: hidden states, ``Sampled`` or errors
``in_worker(fn, *args)``    another operation on the worker thread (caches are touched by one)
``report()``                what a heartbeat carries of the steps (queue, runs by size)
``drain()`` / ``close()``   stopping: the steps still queued, then the worker thread's end
==========================  =====================================================================

The batch formation, in short: the decode step of a lone stream runs at once on the event
loop's thread: no thread hand-offs (each is a scheduler wake-up, which costs most where several
nodes share a few cores). Otherwise (other requests active here, something queued or running, a
prefill) the step waits in the queue, and the worker thread runs everything queued as one batch
per shard. When the worker frees, it first waits (at most a window) for the steps of requests
that are due back: each request's time away (the rest of the ring) is measured, so steps that
left here together and come back within that window of each other merge into one batch instead
of splitting into the first to arrive and the rest. A node that ran a batch sends its hidden
states to the next hop back to back, each saying how many ``more`` follow: the next node waits
for those too, so the batch stays whole down the ring. A lone stream never waits: there is no
other request to wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Container
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from backends.base import BackendError, HeadRows
from exo_tui.inference.sampling import TokenLogprobs
from exo_tui.inference.speculative import Verdict
from exo_tui.net.connection import Connection
from exo_tui.net.frame import Frame
from exo_tui.net.messages import Forward
from exo_tui.net.protocol import FILLED, HostError
from exo_tui.node.batching import Batching, decodes_first, one_step_a_key
from exo_tui.node.host import ShardHost
from exo_tui.node.kv_budget import BudgetExceeded, KVBudget, ShardKey
from exo_tui.node.sampling_step import Samplers, score_prompt

log = logging.getLogger("exo_tui.node")

INLINE_MAX_ROWS = 8  # a step of at most this many positions may run on the event loop's thread
DISCARDED = object()  # the result of a step of a request that ended meanwhile: nothing is sent


@dataclass
class Step:
    """One request's step waiting for this node's worker: the frame (its tensor and plan) and its
    body, decoded."""

    conn: Connection
    frame: Frame
    body: Forward
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
    def prompt(self) -> bool:
        """A step of several positions other than a verify step's (the last accepted token and
        its drafts: a stream's decode step, batched as one)."""
        return self.rows > 1 and self.body.draft is None

    @property
    def hop(self) -> int:
        return self.body.hop

    @property
    def key(self) -> tuple[str, int]:
        """The request and hop this step is for (what ``Batching.visits`` is keyed by)."""
        return self.body.rid, self.body.hop


class Sampled(NamedTuple):
    """The last hop's result of a step: the token drawn (or FILLED), its logprobs where asked, and
    the prompt's scores where asked; of a verify step (its ``draft``), the verdict and each of its
    tokens' logprobs where asked (``token`` is then the verdict's last)."""

    token: int
    logprobs: TokenLogprobs | None
    scores: list[TokenLogprobs] | None
    verdict: Verdict | None = None
    listed: list[TokenLogprobs] | None = None


# What a step gives: the hidden state for the next hop, the last hop's Sampled, the error that
# failed it, or DISCARDED.
Deliver = Callable[[Step, Any, int], Awaitable[None]]


class StepExecutor:
    """Runs this node's steps (see the module's docstring). ``kv``, ``samplers`` and ``finished``
    (the requests ended for good) are the agent's; ``deliver(step, result, more)`` sends a result
    on, ``more`` saying how many hidden states of the same run go to the same next hop after it.
    :meth:`start` gives it the shards to run on."""

    def __init__(self, kv: KVBudget, samplers: Samplers, finished: Container[str], deliver: Deliver,
                 superseded: Callable[[Forward], bool] = lambda body: False) -> None:
        self.kv = kv
        self.samplers = samplers
        self.finished = finished
        self.superseded = superseded  # a handed step the coordinator has moved past: discarded
        self.deliver = deliver
        self.host: ShardHost | None = None
        self.queue: deque[Step] = deque()
        # the requests and hops of the run under way, from its start until its last result has gone
        # on: a later step of one of them (a prompt's next chunk) waits for the queue; run inline
        # in the gap after the worker returned, its result went on first and overtook the run's
        self._running: set[tuple[str, int]] = set()
        self._wakeup = asyncio.Event()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exo-node-worker")
        self._jobs: set[Future[Any]] = set()  # submitted to the worker and not finished
        self._burst: dict[Connection, int] = {}  # steps announced by a sender as following at once
        self.batch_sizes: Counter[int] = Counter()  # steps per forward run (inline runs count as 1)
        self.inline_steps = 0
        self.batching = Batching()  # visits, recent run time and the rules of batch formation

    def start(self, host: ShardHost) -> None:
        self.host = host

    @property
    def started_host(self) -> ShardHost:
        """The shards and plans this node holds (set when it starts)."""
        if self.host is None:
            raise HostError("the node agent has not started: it holds no shards yet")
        return self.host

    # ------------------------------------------------------------------ arrival

    async def arrived(self, step: Step, *, next_ready: bool) -> None:
        """A step came (in the read loop). ``next_ready``: its result can go on without
        connecting first."""
        key = step.key
        self.batching.arrived(key, step.received_s)
        if (more := step.body.more) > 0:  # more steps of the previous hop's batch follow at once
            self._burst[step.conn] = more
        else:
            self._burst.pop(step.conn, None)
        if self._inline_ok(step, key) and next_ready:
            await self._run_inline(step)
        else:
            self.queue.append(step)
            self._wakeup.set()

    def report(self) -> dict[str, Any]:
        """What a heartbeat carries of the steps: how many wait, the runs by their size, the
        steps run inline."""
        return {"queue_depth": len(self.queue), "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "inline_steps": self.inline_steps}

    def forget(self, rid: str) -> None:
        """A request ended (or its caches were taken over): it is not expected back."""
        self.batching.forget(rid)

    # ------------------------------------------------------------------ the worker

    async def in_worker(self, fn: Any, *args: Any) -> Any:
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

    def drain(self) -> list[Step]:
        """The steps still queued, taken out (the node is stopping: the agent fails them)."""
        steps = list(self.queue)
        self.queue.clear()
        return steps

    def close(self) -> None:
        """End the worker thread, once what runs on it has finished."""
        self._worker.shutdown(wait=True)

    async def work(self) -> None:
        """Take every step waiting, run them (one batch per shard), send results on."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self.queue:
                await self._gather()
                queued = list(self.queue)
                batch, _ = decodes_first(queued)
                batch, left = one_step_a_key(queued, batch)
                self.queue.clear()
                self.queue.extend(left)
                self.batch_sizes[len(batch)] += 1
                self._running = {step.key for step in batch}
                try:
                    t0 = time.monotonic()
                    results = await self.in_worker(self.run, batch)
                    ran_s = time.monotonic() - t0
                    self.batching.ran(ran_s)
                    for step in batch:
                        step.started_s, step.compute_s = t0, ran_s
                    following = self._following(batch, results)
                    for step, result, more in zip(batch, results, following, strict=True):
                        await self._deliver(step, result, more)
                finally:
                    self._running = set()

    async def _deliver(self, step: Step, result: Any, more: int = 0) -> None:
        self.batching.left(step.key, time.monotonic())
        await self.deliver(step, result, more)

    def _following(self, batch: list[Step], results: list[Any]) -> list[int]:
        """For each step of a run, how many hidden states of that run go to the same next hop
        after it (the ``more`` of ``deliver``)."""
        dest: list[tuple[str, int] | None] = []
        for step, result in zip(batch, results, strict=True):
            plan = self.started_host.plans.get(step.frame.plan) if step.frame.plan is not None else None
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

    def _inline_ok(self, step: Step, key: tuple[str, int]) -> bool:
        """A lone stream's decode step runs at once, on the loop's thread; anything else goes
        through the queue, where batches form."""
        if self.queue or self._burst or not self._worker_idle() or key in self._running:
            return False
        if step.frame.tensor is None or np.ndim(step.frame.tensor) == 0 or step.rows > INLINE_MAX_ROWS:
            return False  # a prefill runs on the worker: the loop keeps answering pings meanwhile
        if step.conn.input_pending():
            return False  # another frame is already here: it may join this step's batch
        return self.batching.alone((key,), step.received_s)

    async def _gather(self) -> None:
        """Wait, at most a window, for the steps due back here and those a sender announced
        (the rules: :meth:`Batching.gather_wait`)."""
        deadline = time.monotonic() + self.batching.window_s()
        while True:
            now = time.monotonic()
            wait = self.batching.gather_wait(now, deadline, burst=bool(self._burst), queued=[s.key for s in self.queue])
            if wait is None:
                break
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wakeup.wait()
        self._burst.clear()  # what has not come by now is not waited for again

    async def _run_inline(self, step: Step) -> None:
        self.batch_sizes[1] += 1
        self.inline_steps += 1
        t0 = time.monotonic()
        result = self.run([step])[0]
        step.started_s, step.compute_s = t0, time.monotonic() - t0
        self.batching.ran(step.compute_s)
        await self._deliver(step, result)

    # ------------------------------------------------------------------ a run

    def run(self, batch: list[Step]) -> list[Any]:
        """Runs on the worker thread (or inline, when the worker is idle). Groups steps by shard
        and fuses them where the backend can."""
        results: list[Any] = [None] * len(batch)
        groups: dict[ShardKey, list[int]] = {}
        for i, step in enumerate(batch):
            if step.body.rid in self.finished or self.superseded(step.body):
                results[i] = DISCARDED
                continue
            try:
                _, _, hosted = self.started_host.hop(step.frame.plan, step.hop)
            except HostError as exc:
                results[i] = exc
                continue
            groups.setdefault(hosted.key, []).append(i)
        for key, idxs in groups.items():
            shard = self.started_host.shards[key].shard
            idxs = self._within_budget(batch, key, idxs, results)
            items = []
            for i in idxs:
                f, body = batch[i].frame, batch[i].body
                rid, start, adopt = body.rid, body.pos, body.adopt
                if adopt is not None and adopt != rid and not shard.kv_length(rid) and shard.kv_length(adopt):
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
            # a prompt to score, and a verify step (its drafts), need every row's logits: a prompt
            # runs on its own, a verify step in the batch where the backend runs it there (its rows
            # beside the other steps' in one pass over the weights), else alone
            scored = [j for j, i in enumerate(idxs) if shard.is_last and batch[i].body.score is not None]
            verifying = [j for j, i in enumerate(idxs) if shard.is_last and batch[i].body.draft is not None
                         and j not in scored]
            plain = [j for j in range(len(items)) if j not in scored and j not in verifying]
            if shard.verifies_in_batch and len(plain) + len(verifying) > 1:
                plain, verifying, every = sorted(plain + verifying), [], set(verifying)
            else:
                every = set()
            outs: list[Any] = [None] * len(items)
            scores: dict[int, list[TokenLogprobs]] = {}
            try:
                if len(plain) == 1:
                    outs[plain[0]] = shard.forward(*items[plain[0]])
                elif plain:
                    wanted = [n for n, j in enumerate(plain) if j in every]
                    for j, out in zip(plain, shard.forward_batch([items[j] for j in plain], wanted), strict=True):
                        outs[j] = HeadRows.of(out) if j in every else out
            except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which rebuilds
                _failed(shard, items, outs, plain, exc)
            for j in verifying:  # the head on the rows the check reads (Shard.forward_rows)
                try:
                    outs[j] = shard.forward_rows(*items[j])
                except Exception as exc:  # noqa: BLE001
                    _failed(shard, items, outs, [j], exc)
            for j in scored:  # each in pieces; its failure (a bad ask included) fails it alone
                try:
                    ask = batch[idxs[j]].body.score
                    assert ask is not None
                    outs[j], scores[idxs[j]] = score_prompt(shard, ask, *items[j], self.kv.step_room_bytes)
                except Exception as exc:  # noqa: BLE001
                    _failed(shard, items, outs, [j], exc)
            for i, out, (rid, _x, positions) in zip(idxs, outs, items, strict=True):
                results[i] = out
                self.kv.record(rid, key, 0 if isinstance(out, Exception) else int(positions[-1]) + 1)
            if shard.is_last:
                for i in idxs:
                    if batch[i].body.fill and not isinstance(results[i], Exception):
                        results[i] = Sampled(FILLED, None, None)  # a prompt's chunk: its caches filled, nothing drawn
                    elif not isinstance(results[i], Exception) and batch[i].body.draft is not None:
                        try:
                            verdict, listed = self.samplers.verify(batch[i].body, results[i], shard.config.vocab_size)
                            results[i] = Sampled(verdict.tokens[-1], None, None, verdict, listed)
                        except Exception as exc:  # noqa: BLE001 - a bad draft fails this request only
                            results[i] = exc
                    elif not isinstance(results[i], Exception):
                        try:
                            token, logprobs = self.samplers.sample(batch[i].body, results[i])
                            results[i] = Sampled(token, logprobs, scores.get(i))  # scores: score_prompt's, where asked
                        except Exception as exc:  # noqa: BLE001 - bad parameters fail this request only
                            results[i] = exc
        return results

    def _within_budget(self, batch: list[Step], key: ShardKey, idxs: list[int], results: list[Any]) -> list[int]:
        """The steps of ``idxs`` (on shard ``key``) whose caches fit this node's KV budget; the
        others' result is the refusal (the coordinator admits them again later)."""
        growth = {}
        for i in idxs:
            b = batch[i].body
            if b.adopt is not None and not self.kv.held(b.rid, key):
                self.kv.rename(b.adopt, b.rid)
            growth[(b.rid, key)] = b.pos + batch[i].rows
        refused = self.kv.check(growth)
        if not refused:
            return idxs
        for i in idxs:
            if (why := refused.get(batch[i].body.rid)) is not None:
                results[i] = BudgetExceeded(why)
        return [i for i in idxs if batch[i].body.rid not in refused]


def _failed(shard: Any, items: list[tuple[str, np.ndarray, np.ndarray]], outs: list[Any], rows: list[int],
            exc: Exception) -> None:
    """Rows ``rows`` of a run failed with ``exc``: their caches go (the step may have half-updated
    them) and the error is their result, reported to the coordinator, which rebuilds."""
    log.warning("forward of layers [%d, %d) failed: %s", shard.start, shard.end, exc, exc_info=True)
    for j in rows:
        shard.drop(items[j][0])
        outs[j] = exc
