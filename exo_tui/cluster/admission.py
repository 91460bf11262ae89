"""Admission: a request runs when the ring's KV budgets can hold it; the others wait their turn.

Each node reports the bytes its KV caches may take (:mod:`exo_tui.node.kv_budget`) and the bytes a
position of a request takes there; the ring holds ``min(budget / bytes per position)`` positions
over its nodes, more where windowed layers keep rings (:func:`ring_kv_capacity`). A request is admitted when the positions reserved by the requests running, plus
the finished ones whose caches are kept for a next turn, plus its own fit in that:

- its own are its prompt plus ``max_tokens`` (within the context), or, with
  ``admission.kv_share`` below 1, that share of them: it reserves more as it grows,
  and when there is no more to give, it is *preempted*: it gives its caches back, waits at the
  head of the queue, and when admitted again its token history (its checkpoint) rebuilds them,
  exactly;
- the others wait in one queue, first come first served (a preempted request goes first), of at
  most ``admission.queue_bound`` requests; past it a request is refused at once
  (:class:`QueueFull`: the API's 429 with ``Retry-After``).

A request without ``max_tokens`` (up to the context) reserves ``OPEN_STEP`` positions at a time,
with preemption, and ends where the ring's memory ends if that is before the context.

Kept caches of finished requests go when a request needs their room. A node that refuses a step
for want of memory anyway (its budget shrank: another process took memory) preempts the request
the same way. Until every node of the ring has reported its budget, one request runs at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from exo_tui.inference.generate import GenerationError
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import TokenLogprobs
from exo_tui.inference.speculative import Draft, Verdict

if TYPE_CHECKING:
    from exo_tui.cluster.pipeline import RemotePipeline

_T = TypeVar("_T")

log = logging.getLogger("exo_tui.cluster")

OPEN_STEP = 256  # positions at a time for a request without max_tokens
CAPACITY_WAIT_S = 3.0  # a first request waits this long for the nodes' budgets (heartbeats are 1 s apart)


class QueueFull(GenerationError):
    """The admission queue is at its bound: try again after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooLarge(GenerationError):
    """The request could never fit the ring's KV budget, even alone."""


class KVBudgetExceeded(GenerationError):
    """A node refused a step of the request: its KV caches would outgrow the node's budget."""


class NotReady(GenerationError):
    """No plan came into force within the wait: try again after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Ticket:
    """One request's place in admission: the positions it may need and those reserved for it."""

    rid: str
    full: int  # prompt + max_tokens, within the context: all it can ever hold
    step: int  # positions reserved at a time (all of ``full`` unless kv_share < 1)
    need: int  # positions it waits for
    reserved: int = 0
    preempted: int = 0
    waiter: asyncio.Future[None] | None = field(default=None, repr=False)
    admitted_s: float | None = None


@dataclass(frozen=True)
class AdmissionStats:
    running: int
    queued: int
    admitted: int
    preempted: int
    rejected: int
    reserved_positions: int
    capacity_positions: int | None  # None: not every node of the ring has reported yet
    queue_bound: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Admission:
    """The coordinator's admission queue (see the module doc). ``capacity()``: the positions the
    ring holds now (None: unknown); ``kept()``: positions held by kept caches of finished requests;
    ``forget_kept()``: drop them (a coroutine). ``capacity_for(n)``, when given: the positions the
    ring holds for ``n`` requests' caches (windowed layers' rings take a request's window at most,
    so it depends on how many), in place of ``capacity()``; ``kept_requests()``: how many kept
    caches there are."""

    def __init__(self, capacity: Callable[[], int | None], *, queue_bound: int = 64, kv_share: float = 1.0,
                 kept: Callable[[], int] = lambda: 0, forget_kept: Callable[[], Awaitable[None]] | None = None,
                 capacity_for: Callable[[int], int | None] | None = None,
                 kept_requests: Callable[[], int] = lambda: 0) -> None:
        self._capacity_now = capacity
        self.capacity_for = capacity_for
        self.kept_requests = kept_requests
        self.queue_bound = queue_bound
        self.kv_share = kv_share
        self.kept = kept
        self.forget_kept = forget_kept
        self._waiting: deque[Ticket] = deque()
        self._running: dict[str, Ticket] = {}
        self._forgetting: asyncio.Task[Any] | None = None
        self.admitted = self.preempted = self.rejected = 0
        self._service_s = 10.0  # a request's mean time running (smoothed), for Retry-After

    # ------------------------------------------------------------------ state

    def capacity(self, more: int = 0) -> int | None:
        """The positions the ring holds for the caches held now (running requests' and kept ones')
        and ``more`` requests' besides (at least one)."""
        if self.capacity_for is None:
            return self._capacity_now()
        return self.capacity_for(max(1, len(self._running) + self.kept_requests() + more))

    def capacity_alone(self) -> int | None:
        """The positions the ring holds for one request's caches and nothing else."""
        return self._capacity_now() if self.capacity_for is None else self.capacity_for(1)

    def stats(self) -> AdmissionStats:
        return AdmissionStats(len(self._running), len(self._waiting), self.admitted, self.preempted, self.rejected,
                              self.reserved(), self.capacity(), self.queue_bound)

    def reserved(self) -> int:
        return sum(t.reserved for t in self._running.values())

    def running(self, rid: str) -> bool:
        return rid in self._running

    def ahead(self, rid: str) -> int | None:
        """Requests ahead of ``rid`` in the queue (None: it is not waiting)."""
        for i, t in enumerate(self._waiting):
            if t.rid == rid:
                return i
        return None

    def retry_after_s(self) -> int:
        """About when a place in the queue frees: the queue's requests, served as many at once as
        run now, each taking the mean time a request has run."""
        rounds = (len(self._waiting) + 1) / max(1, len(self._running))
        return max(1, min(600, math.ceil(rounds * self._service_s)))

    # ------------------------------------------------------------------ entering and leaving

    def ticket(self, request: Request, context_length: int) -> Ticket:
        """The request's place. One that runs up to the context (no ``max_tokens`` given) ends
        where the ring's memory ends, if that comes first (``finish_reason`` length), and reserves
        ``OPEN_STEP`` positions at a time (so it is preempted, not refused, when memory is short)."""
        prompt = len(request.prompt_ids)
        full = min(context_length, prompt + max(1, request.max_tokens))
        open_ended = full >= context_length
        cap = self.capacity_alone()
        if open_ended and cap is not None and full > cap > prompt:
            request.max_tokens, full = cap - prompt, cap
        if open_ended:
            step = prompt + OPEN_STEP
        elif self.kv_share < 1:
            step = max(prompt + 1, math.ceil(self.kv_share * full))
        else:
            step = full
        return Ticket(request.id, full, min(step, full), min(step, full))

    async def known(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every node of the ring has reported its budget."""
        deadline = time.monotonic() + timeout_s
        while self.capacity_alone() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def enter(self, ticket: Ticket, *, front: bool = False,
                    on_queued: Callable[[int], None] | None = None) -> None:
        """Wait until ``ticket`` is admitted (raises :class:`QueueFull` or :class:`TooLarge`).
        ``on_queued(n)``: called with the requests ahead while it waits, as that changes."""
        cap = self.capacity_alone()
        if cap == 0:
            raise TooLarge("no node of the ring has memory left for KV caches beyond its runtime and shards "
                           "(exo-tui status shows each node's KV MB): give the nodes a larger --memory-limit or more memory")
        if cap is not None and ticket.need > cap:
            raise TooLarge(
                f"the request needs KV caches for {ticket.need} positions and the ring's nodes hold {cap} in all: "
                "ask for fewer max_tokens, send a shorter prompt, or give the nodes more memory (--memory-limit)")
        if not self._waiting and self._fits(ticket.need):
            self._start(ticket)
            return
        if not front and len(self._waiting) >= self.queue_bound:
            self.rejected += 1
            raise QueueFull(f"the server is busy: {len(self._running)} requests run and {len(self._waiting)} wait "
                            f"(the queue's bound, admission.queue_bound); try again later",
                            self.retry_after_s())
        ticket.waiter = asyncio.get_running_loop().create_future()
        if front:
            self._waiting.appendleft(ticket)
        else:
            self._waiting.append(ticket)
        self._pump()
        try:
            while True:
                if on_queued is not None and (n := self.ahead(ticket.rid)) is not None:
                    on_queued(n)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await asyncio.shield(ticket.waiter)
                if ticket.waiter.done():
                    break
                self._pump()  # capacity may have grown without a poke
        except BaseException:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
            elif ticket.rid in self._running:
                self.leave(ticket)
            raise
        finally:
            ticket.waiter = None

    def leave(self, ticket: Ticket) -> None:
        """The request has ended (its caches are released): its positions go to the next."""
        if self._running.pop(ticket.rid, None) is not None and ticket.admitted_s is not None:
            self._service_s = 0.8 * self._service_s + 0.2 * (time.monotonic() - ticket.admitted_s)
        ticket.reserved = 0
        self._pump()

    def grow(self, ticket: Ticket, need: int) -> bool:
        """Reserve at least ``need`` positions for a running request (another ``step`` of them
        when it can); False: no room now (it must be preempted)."""
        want = min(ticket.full, max(need, ticket.reserved + ticket.step))
        others = self.reserved() - ticket.reserved + self.kept()
        cap = self.capacity()
        if cap is None:
            ok = len(self._running) == 1
        else:
            want = want if others + want <= cap else max(need, cap - others)
            ok = others + want <= cap
        if ok:
            ticket.reserved = want
        else:
            self._short()
        return ok

    def preempt(self, ticket: Ticket, need: int) -> None:
        """A running request gives its positions back and will wait (at the head) for ``need``."""
        self._running.pop(ticket.rid, None)
        ticket.reserved = 0
        ticket.need = min(ticket.full, max(need, ticket.step))
        ticket.preempted += 1
        self.preempted += 1
        self._pump()

    def alone(self, ticket: Ticket) -> bool:
        return set(self._running) <= {ticket.rid}

    def poke(self) -> None:
        """Capacity may have changed (a heartbeat, a new plan): admit what fits now."""
        self._pump()

    # ------------------------------------------------------------------ internals

    def _fits(self, need: int) -> bool:
        cap = self.capacity(more=1)
        if cap is None:
            return not self._running  # unknown: one at a time
        if self.reserved() + self.kept() + need <= cap:
            return True
        if self.reserved() + need <= cap:
            self._short()  # it fits once the kept caches go
        return not self._running and need <= cap and not self.kept()

    def _short(self) -> None:
        """Requests wait for room that kept caches of finished requests hold: drop them."""
        forget_kept = self.forget_kept
        if forget_kept is None or not self.kept() or (self._forgetting is not None and not self._forgetting.done()):
            return

        async def forget() -> None:
            await forget_kept()
            self._pump()

        self._forgetting = asyncio.get_running_loop().create_task(forget())

    def _start(self, ticket: Ticket) -> None:
        ticket.reserved = ticket.need
        ticket.admitted_s = time.monotonic()
        self._running[ticket.rid] = ticket
        self.admitted += 1

    def _pump(self) -> None:
        while self._waiting and self._fits(self._waiting[0].need):
            ticket = self._waiting.popleft()
            self._start(ticket)
            if ticket.waiter is not None and not ticket.waiter.done():
                ticket.waiter.set_result(None)


class AdmittedRunner:
    """A :class:`~exo_tui.inference.generate.StepRunner` that keeps one request's steps within
    the positions admission reserved for it: it reserves more as the request grows, and when
    there is none to give (or a node refuses the step for memory), gives the caches back, waits
    to be admitted again and rebuilds them from the request's tokens."""

    def __init__(self, pipeline: RemotePipeline, admission: Admission, ticket: Ticket) -> None:
        self.pipeline = pipeline
        self.admission = admission
        self.ticket = ticket

    async def step(self, request: Request, start: int) -> tuple[int, TokenLogprobs | None]:
        while True:
            need = request.n_tokens  # the positions its caches hold after this step
            if need > self.ticket.reserved and not self.admission.grow(self.ticket, need):
                await self._preempt(request, need)
                continue
            try:
                return await self.pipeline.step(request, start, reserved=self.ticket.reserved)
            except KVBudgetExceeded:
                if self.admission.alone(self.ticket):
                    raise  # nothing else holds memory it could wait for
                await self._preempt(request, need)

    async def verify(self, request: Request, start: int, draft: Draft) -> tuple[Verdict, list[TokenLogprobs] | None]:
        """A verify step, its drafted positions reserved like any others; where they find no room
        (in the reservation, or on a node), a plain step instead: drafts are never worth a wait."""
        need = request.n_tokens + len(draft)
        if need <= self.ticket.reserved or self.admission.grow(self.ticket, need):
            try:
                return await self.pipeline.verify(request, start, draft)
            except KVBudgetExceeded:
                pass  # the caches were given back: the plain step rebuilds them
        token, logprobs = await self.step(request, start)
        return Verdict((token,), 0, 0), None if logprobs is None else [logprobs]

    async def _preempt(self, request: Request, need: int) -> None:
        await self.pipeline.evict(request)
        self.admission.preempt(self.ticket, need)
        await self.admission.enter(self.ticket, front=True)

    async def release(self, request: Request) -> None:
        await self.pipeline.release(request)

    def served_by(self) -> tuple[str, ...]:
        return self.pipeline.served_by()


async def wait_for_plan(coordinator: Any, timeout_s: float, retry_after_s: int = 2) -> None:
    """Return once the coordinator has a model and a plan in force; raise :class:`NotReady` after
    ``timeout_s`` (or at once when it cannot serve the model: that is not a matter of waiting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        why = getattr(coordinator, "_serve_error", "")
        if why:
            raise GenerationError(why)
        if coordinator.model is not None and getattr(coordinator, "ring", None) is not None \
                and coordinator._plan_ready.is_set():
            return
        if time.monotonic() >= deadline:
            what = "its model is still loading" if coordinator.model is None else \
                "the cluster has no plan yet: no node serves the model (start a node agent, add one with --peer, or undrain one)"
            raise NotReady(f"not ready after waiting {timeout_s:.0f} s: {what}", retry_after_s)
        await asyncio.sleep(0.05)


UNBOUNDED = 1 << 40  # positions a node holds whose every layer keeps a ring (its caches never grow past them)


def ring_kv_capacity(ring: Any, nodes: dict[str, Any], requests: int = 1) -> int | None:
    """Positions the ring's KV budgets hold for ``requests`` requests' caches: over its nodes, the
    least of budget / bytes a position takes there. None until every node of the ring has
    reported its budget.

    Where windowed layers keep rings, a request of ``n`` positions takes at most ``n`` times a
    position's bytes, and at most ``n`` times the full-length layers' bytes plus the rings' whole
    (``window_bytes``): so ``requests`` requests fit in the larger of ``budget / bytes per
    position`` and ``(budget - requests * window_bytes) / full-length bytes per position``."""
    if ring is None:
        return None
    caps = []
    for entry in ring.ring:
        handle = nodes.get(entry.node_id)
        kv = handle.metrics.get("kv") if handle is not None else None
        if not isinstance(kv, dict) or not kv.get("bytes_per_position"):
            return None
        budget, per = int(kv.get("budget_bytes", 0)), int(kv["bytes_per_position"])
        cap = budget // per
        window, full = int(kv.get("window_bytes", 0)), int(kv.get("full_bytes_per_position", per))
        if window and budget >= requests * window:
            cap = max(cap, (budget - requests * window) // full if full else UNBOUNDED)
        caps.append(cap)
    return min(caps) if caps else None


async def with_queue_notes(chunks: AsyncGenerator[_T, None], notes: asyncio.Queue[int]) -> AsyncGenerator[_T | int, None]:
    """``chunks``, and, until the first of them, each number put in ``notes`` (the requests ahead
    while the request waits its turn: the console shows "queued (n ahead)")."""
    it = chunks
    first: asyncio.Future[_T] = asyncio.ensure_future(anext(it))
    note: asyncio.Future[int] | None = None
    try:
        while not first.done():
            note = asyncio.ensure_future(notes.get())
            await asyncio.wait((first, note), return_when=asyncio.FIRST_COMPLETED)
            if note.done():
                yield note.result()
            else:
                note.cancel()
        try:
            chunk = first.result()
        except StopAsyncIteration:
            return
        yield chunk
        async for chunk in it:
            yield chunk
    finally:
        if note is not None:
            note.cancel()
        if not first.done():
            first.cancel()
            # Its end (cancelled, or an error raised while it stopped) is not this generator's to
            # raise; a cancellation aimed at the task running this one propagates from the wait
            # (and ``it``, still running in ``first``, is then left to end there).
            await asyncio.wait((first,))
            error = None if first.cancelled() else first.exception()
            if error is not None and not isinstance(error, StopAsyncIteration):
                log.warning("a stream ended with an error while it was being stopped", exc_info=error)
        await it.aclose()
