"""The generation loop: prefill, decode, detokenize, stop — over any pipeline of shards.

The loop knows nothing of where layers run. A :class:`StepRunner` runs the tokens of a request
that are not yet in the pipeline's caches (``request.tokens[start:]``) through every layer and
returns the sampled next token; it is an in-process list of shards (:mod:`.local`) or a ring of
node agents driven by the coordinator. Because the request carries its whole token history, a
runner may rebuild caches anywhere (after a node fails or the plan changes) and the loop goes on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from exo_tui.inference.request import Request
from exo_tui.inference.sampling import TokenLogprobs
from exo_tui.inference.speculative import Draft, Verdict
from exo_tui.inference.stops import StopMatcher
from exo_tui.models.detokenizer import StreamingDetokenizer
from exo_tui.models.tokenizer import Tokenizer


class StepRunner(Protocol):
    async def step(self, request: Request, start: int) -> tuple[int, TokenLogprobs | None]:
        """Run ``request.tokens[start:]`` (at positions ``start..``) through the pipeline and
        return the next token sampled with ``request.sampling``, with its logprobs when
        ``request.top_logprobs`` asks for them (else None). A step from ``start`` 0 of a request
        that wants its prompt scored (``request.wants_prompt_scores``) also sets
        ``request.prompt_scores``."""
        ...

    async def release(self, request: Request) -> None:
        """Free the request's caches everywhere."""
        ...

    def served_by(self) -> tuple[str, ...]:
        """Names of the nodes (or backends) that ran the request's layers."""
        ...


@runtime_checkable
class Verifier(Protocol):
    async def verify(self, request: Request, start: int, draft: Draft) -> tuple[Verdict, list[TokenLogprobs] | None]:
        """A verify step (:mod:`exo_tui.inference.speculative`): ``request.tokens[start:]`` and
        then ``draft``'s tokens run as one step; the drafts the model agrees with and the next
        token, with each one's logprobs when ``request.top_logprobs`` asks. The caches keep the
        request's tokens and the accepted drafts only (rejected positions are dropped, at the
        latest when the next step begins)."""
        ...


# A token listed with a chunk: where its text begins in the answer (characters) and its logprobs.
Listed = tuple[int, TokenLogprobs]


@dataclass(frozen=True)
class Chunk:
    text: str = ""
    token_id: int | None = None
    # When the request asked for logprobs: the tokens whose text begins in this chunk's text (a
    # token holding part of a character is listed with the one that completes it). The last
    # chunk lists what is left when the answer ran to its end; tokens a stop string cut off
    # entirely, and the end-of-sequence token, are not listed.
    logprobs: tuple[Listed, ...] = ()
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str = ""
    # Tokens before ``token_id`` that gave no text of their own (part of a character the next
    # completes, or held back as maybe the start of a stop string): the chunk's text is theirs too.
    held: tuple[int, ...] = ()

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token whose text is in this chunk, in order."""
        return (*self.held, self.token_id) if self.token_id is not None else self.held


class GenerationError(RuntimeError):
    """Generation could not go on; the message says why and what to do."""


async def generate(
    runner: StepRunner, tokenizer: Tokenizer, request: Request, *, context_length: int
) -> AsyncGenerator[Chunk, None]:
    """Stream the answer to ``request``. The last chunk has ``finish_reason`` set.

    Cancelling the consuming task (or closing the iterator) stops generation between steps and
    releases the request's caches. A request that comes with ``generated`` tokens already (a
    stream resumed after its coordinator died) goes on from them: their text is not sent again,
    and the detokenizer and stop strings start where it left off.
    """
    detok = StreamingDetokenizer(tokenizer)
    stops = StopMatcher(list(request.stop))
    eos = tokenizer.eos_ids
    start = 0
    finish = "length"
    hit_stop_string = False
    listing: deque[Listed] = deque()  # tokens asked about whose text is not out yet
    produced = emitted = 0  # characters the detokenizer gave, and that were handed out
    held: list[int] = []  # tokens whose text is not out yet

    def listed() -> tuple[Listed, ...]:
        out = []
        while listing and listing[0][0] < emitted:
            out.append(listing.popleft())
        return tuple(out)
    for token in request.generated:  # a resumed request (another coordinator sent its answer so far)
        piece = detok.add(token)
        produced += len(piece)
        emitted += len(stops.feed(piece)[0])
    try:
        if not request.prompt_ids:
            raise GenerationError("the prompt is empty: give at least one token")
        if request.max_tokens == 0 and request.wants_prompt_scores:
            await runner.step(request, 0)  # the prompt scored; the token it samples is no part of any answer
        verifier = runner if isinstance(runner, Verifier) else None
        spec = request.speculation if verifier is not None else None
        done = False
        while not done and len(request.generated) < request.max_tokens:
            if request.n_tokens >= context_length:
                break
            room = min(request.max_tokens - len(request.generated), context_length - request.n_tokens)
            decoding = start >= len(request.prompt_ids)  # the prompt is in the caches (a prompt's step runs no drafts)
            began = time.monotonic()  # a step's time includes its drafting's (a draft model's steps grow with k)
            draft = await spec.draft(request.tokens, len(request.prompt_ids), room) if spec is not None and decoding else None
            ran = 0  # the drafts the step ran (a runner may take a plain step instead: caches to rebuild, a lease)
            if draft is not None and len(draft) and verifier is not None and spec is not None:
                verdict, listed_lps = await verifier.verify(request, start, draft)
                ran = verdict.drafted
                if ran:
                    spec.verified(draft, verdict)
                tokens: tuple[int, ...] = verdict.tokens
                lps: list[TokenLogprobs | None] = list(listed_lps) if listed_lps is not None else [None] * len(tokens)
            else:
                token, logprobs = await runner.step(request, start)
                tokens, lps = (token,), [logprobs]
            if spec is not None and decoding:  # a decode step, timed for the stream
                spec.timed(1 + ran, time.monotonic() - began)
            start = request.n_tokens + len(tokens) - 1  # the last token is the first the caches lack
            for token, logprobs in zip(tokens, lps, strict=True):
                if len(request.generated) >= request.max_tokens:
                    break
                request.generated.append(token)
                if logprobs is not None:
                    request.logprobs.append(logprobs)
                if request.first_token_s is None:
                    request.first_token_s = time.monotonic()
                if token in eos:
                    finish, done = "stop", True
                    break
                if logprobs is not None:
                    listing.append((produced, logprobs))
                piece = detok.add(token)
                produced += len(piece)
                text, stopped = stops.feed(piece)
                if text:
                    emitted += len(text)
                    yield Chunk(text=text, token_id=token, logprobs=listed(), held=tuple(held))
                    held.clear()
                else:
                    held.append(token)
                if stopped:
                    finish, hit_stop_string, done = "stop", True, True
                    break
        if not hit_stop_string:
            tail, _ = stops.feed(detok.flush())
            tail += stops.flush()
            if stops.stopped:  # held back as maybe part of an earlier stop, it was one itself
                finish = "stop"
            emitted += len(tail)
            rest = listed() if stops.stopped else (*listing,)
            if tail or rest:
                yield Chunk(text=tail, logprobs=rest, held=tuple(held) if tail else ())
        request.finished_s = time.monotonic()
        request.finish_reason = finish
        yield Chunk(finish_reason=finish)
    finally:
        if request.finished_s is None:
            request.finished_s = time.monotonic()
        await runner.release(request)
