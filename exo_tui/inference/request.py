"""A generation request: its prompt, its parameters and its token history (its checkpoint)."""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

from exo_tui.inference.sampling import SamplingParams, TokenLogprobs
from exo_tui.inference.speculation import Speculation

_counter = itertools.count()


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{os.getpid():x}-{next(_counter):x}-{os.urandom(3).hex()}"


@dataclass
class Request:
    """One generation. ``tokens`` (prompt + generated) is everything needed to rebuild its KV
    cache anywhere, so a request survives the loss of any node that held part of it."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    id: str = field(default_factory=new_request_id)
    top_logprobs: int | None = None  # None: no logprobs; k: each token's and its k likeliest alternatives'
    prompt_logprobs: int | None = None  # None: the prompt is not scored; k: as top_logprobs, for its tokens
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # a token's each, when asked for
    # When prompt_logprobs asks: the prompt's tokens after its first, each scored given those before
    prompt_scores: list[TokenLogprobs] = field(default_factory=list)
    created_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    finished_s: float | None = None
    cached_tokens: int = 0  # prompt tokens whose caches an earlier turn of the conversation left
    finish_reason: str | None = None  # "stop" or "length" once it has run to its end; else None
    speculation: Speculation | None = None  # drafts checked by verify steps (None: plain steps only)
    speculative: str | int | None = None  # the request's own mode (off, auto, k); None: the cluster's
    predicted: list[int] | None = None  # OpenAI's prediction, tokenized: drafted from first
    # The seed is its client's (or a console's :set seed), to give the same answer again; False:
    # exo-tui chose it (SamplingParams.with_seed), and nobody can ask for the answer again
    seeded: bool = True

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def wants_prompt_scores(self) -> bool:
        """The prompt is to be scored and is not yet."""
        return self.prompt_logprobs is not None and not self.prompt_scores and len(self.prompt_ids) > 1

    @property
    def n_tokens(self) -> int:
        """``len(self.tokens)``, without building the list."""
        return len(self.prompt_ids) + len(self.generated)

    def tokens_from(self, start: int) -> list[int]:
        """``self.tokens[start:]``, without copying the prompt when ``start`` is past it."""
        n = len(self.prompt_ids)
        return self.generated[start - n :] if start >= n else self.prompt_ids[start:] + self.generated

    @property
    def ttft_s(self) -> float:
        return (self.first_token_s - self.created_s) if self.first_token_s is not None else 0.0

    @property
    def decode_tok_per_s(self) -> float:
        """Generated tokens after the first, per second since the first."""
        if self.first_token_s is None or self.finished_s is None or len(self.generated) < 2:
            return 0.0
        elapsed = self.finished_s - self.first_token_s
        return (len(self.generated) - 1) / elapsed if elapsed > 0 else 0.0
