"""What the pipeline (:mod:`exo_tui.cluster.pipeline`) keeps of the steps it sends through the
ring: a step awaited (:class:`Sent`), a hand-off lease (:class:`Lease`), the caches a request holds
on its plan (:class:`Cached`) or left for a next turn (:class:`Kept`), what a step and a verify step
give back, and what the pipeline needs of the coordinator (:class:`PipelineHost`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from backends.base import MAX_DRAFT
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import TokenLogprobs
from exo_tui.net.connection import Connection
from exo_tui.net.messages import Token
from exo_tui.net.protocol import RingPlan

STEP_TIMEOUT_S = 600.0  # last resort; failures are normally detected by heartbeats and sockets


class StepFailure(Exception):
    """A step could not complete; ``node_id`` is the node to suspect (None: unknown)."""

    def __init__(self, message: str, node_id: str | None = None, *, kv_budget: bool = False) -> None:
        super().__init__(message)
        self.node_id = node_id
        self.kv_budget = kv_budget  # refused for want of memory: no node is at fault


class PipelineHost(Protocol):
    """What the pipeline needs from the coordinator."""

    retry_limit: int

    async def plan_ready(self) -> RingPlan:
        """The plan in force, waiting while a plan switch is under way, and counts a step as
        running on it until :meth:`step_done`. Raises :class:`GenerationError` when the
        cluster cannot serve the model."""
        ...

    def step_done(self) -> None:
        """The step that :meth:`plan_ready` let start has ended (a token boundary)."""
        ...

    def prefill_rows(self, plan: RingPlan) -> int:
        """The rows a step of a prompt may carry through ``plan``'s ring at most."""
        ...

    def fill_window(self, plan: RingPlan) -> int:
        """How many of a long prompt's chunks to keep in flight through ``plan``'s ring at once."""
        ...

    def connection(self, node_id: str) -> Connection:
        ...

    def node_name(self, node_id: str) -> str:
        ...

    async def step_failed(self, failure: StepFailure, plan: RingPlan) -> None:
        """Handle a failed step: suspect/fail the node, and return once a new plan is in force
        (or raise :class:`GenerationError` when none can be made)."""
        ...


@dataclass
class Cached:
    version: int
    length: int


@dataclass
class Kept:
    """A finished request's caches, left on the nodes of ``plan`` for a next turn."""

    tokens: tuple[int, ...]  # the positions they hold
    prompt: int  # how many of them were its prompt
    plan: RingPlan


def shared_prefix(a: list[int], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if len(diff) else n


# What a step gives back: the token, its logprobs (when asked) and the prompt's scores (when asked
# and the step ran the prompt from its start).
Result = tuple[int, TokenLogprobs | None, list[TokenLogprobs] | None]
# What a verify step gives back besides: the tokens kept (the accepted drafts, then the next
# token), how many drafts were accepted, and each token's logprobs (when asked).
VerdictReply = tuple[tuple[int, ...], int, list[TokenLogprobs] | None]


def verdict_from_wire(msg: Token) -> VerdictReply:
    """A verify step's token frame's ``tokens``, ``accepted`` and ``listed``; ValueError when
    they do not fit together."""
    tokens, accepted, listed = msg.tokens, msg.accepted, msg.listed
    if not tokens or accepted is None or accepted != len(tokens) - 1 or tokens[-1] != msg.token:
        raise ValueError(f"a verify step's reply must list the accepted drafts and the next token (accepted + 1 "
                         f"token ids, the last its token), not tokens={tokens!r:.80} accepted={accepted!r}")
    lps = None
    if listed is not None:
        if len(listed) != len(tokens):
            raise ValueError("a verify step's listed logprobs must be one for each of its tokens")
        lps = [TokenLogprobs.from_wire(x) for x in listed]
    return tuple(tokens), accepted, lps


@dataclass
class Sent:
    """A step sent to the ring, whose reply is awaited."""

    key: tuple[str, int, int]  # (request id, step, plan version): what the reply is matched by
    fut: asyncio.Future[Result]
    plan: RingPlan
    rows: int
    end: int  # the positions its request's caches hold once it has run
    times: tuple[float, float, float | None] = (0.0, 0.0, None)  # sent (monotonic, wall), the coordinator's share
    timer: asyncio.TimerHandle | None = None
    verdict: VerdictReply | None = None  # a verify step's, once its reply came
    handed: bool = False  # started by the ring's last hop (a lease's), not sent by the coordinator


@dataclass
class Lease:
    """A step sent with ``ahead``, and the steps the ring then runs on its own (the hand-off)."""

    plan: RingPlan
    first: int  # the step (answer tokens so far) the coordinator sent
    n0: int  # the request's tokens once that step has run
    steps: dict[int, Sent]  # step -> what awaits its token, the first's included
    last: int  # the last step the ring may run
    taken: int = -1  # the last step whose token the request asked for
    open: bool = True  # the ring may still be running steps of it
    holds_step: bool = False  # it ends the plan's step in flight (host.step_done) when it closes
    cached: int = 0  # the positions the ring's caches hold after the latest step whose token came


def drafting(request: Request) -> bool:
    """Whether the request's speculation drafts (a fixed k, or auto expecting a gain, a prediction's
    drafts included): its steps go one at a time, each with the drafts of its time, not in a lease.
    A stream whose drafts auto finds not worth a verify step now (a prediction's among many
    streams batched, say) takes leases as a plain one does; where its drafts become worth one
    again, its lease ends at the next token (:meth:`Leases._leased`), not at the lease's last."""
    spec = request.speculation
    return spec is not None and (isinstance(spec.mode, int) or spec.best_k(MAX_DRAFT) > 0)


def expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError(f"no token within {STEP_TIMEOUT_S:.0f} s"))
