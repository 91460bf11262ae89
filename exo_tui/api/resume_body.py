"""The body of ``POST /exo/v1/resume`` (:mod:`exo_tui.api.forwarding`): a standby's request and
its answer so far, sent to the leader, which goes on from it.

It carries every field of the request that decides its tokens or how they are drafted, so that a
stream resumed on a new leader runs as it would have on the old one: its sampling (seed included),
stop strings, logprobs, its own speculation mode (``speculative``), its prediction's tokens
(``predicted``) and whether its seed is its client's (``seeded``: a sampled stream with a draft
model keeps to the draft sizes its answer alone decides, see :mod:`exo_tui.inference.speculation`).
Both sides build it here, so a field one sends the other reads; a body with an unknown field (a
newer standby), or a bad value, is refused with what is wrong rather than run without it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from exo_tui.inference.request import Request
from exo_tui.inference.sampling import SamplingParams
from exo_tui.inference.speculation import parse_mode

TokenId = Annotated[int, Field(ge=0, strict=True)]


class ResumeBody(BaseModel):
    """What ``POST /exo/v1/resume`` takes (see the module doc)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, description="the id the leader runs it under")
    left: str = Field(default="", description="the id a dead leader ran it under: the caches its steps left")
    prompt_ids: list[TokenId] = Field(min_length=1)
    generated: list[TokenId] = Field(default_factory=list, description="the answer's tokens the client has")
    sampling: dict[str, Any] = Field(description="SamplingParams.to_dict()")
    max_tokens: int = Field(ge=0, strict=True)
    stop: list[str] = Field(default_factory=list)
    top_logprobs: int | None = Field(default=None, ge=0, strict=True)
    speculative: str | int | None = Field(default=None, description="the request's own mode (off, auto, k); "
                                                                     "None: the cluster's")
    predicted: list[TokenId] | None = Field(default=None, description="its prediction's tokens")
    seeded: bool = Field(default=True, description="its seed is its client's (False: exo-tui chose it)")

    @field_validator("sampling")
    @classmethod
    def _sampling(cls, value: dict[str, Any]) -> dict[str, Any]:
        return SamplingParams.from_dict(value).to_dict()  # raises with what is wrong

    @field_validator("speculative", mode="before")
    @classmethod
    def _mode(cls, value: Any) -> str | int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ValueError(f"speculative must be off, auto or a number of drafted tokens, not {value!r}")
        return parse_mode(value)

    @classmethod
    def of(cls, request: Request, *, id: str, left: str = "", generated: list[int] | None = None) -> ResumeBody:  # noqa: A002
        """The body that resumes ``request`` under ``id`` from ``generated`` (the answer the
        client has), on a leader after the one that ran it as ``left`` (if any). Token ids are
        made plain ints here (a tokenizer's or a sampler's may be NumPy's, which the strict
        fields refuse on receipt, not here in the middle of a failover)."""
        return cls(id=id, left=left, prompt_ids=[int(t) for t in request.prompt_ids],
                   generated=[int(t) for t in generated or ()],
                   sampling=request.sampling.to_dict(), max_tokens=int(request.max_tokens), stop=list(request.stop),
                   top_logprobs=None if request.top_logprobs is None else int(request.top_logprobs),
                   speculative=request.speculative,
                   predicted=None if request.predicted is None else [int(t) for t in request.predicted],
                   seeded=request.seeded)

    def request(self) -> Request:
        """The request the leader runs: the standby's, its answer so far included."""
        return Request(list(self.prompt_ids), SamplingParams.from_dict(self.sampling), self.max_tokens,
                       tuple(self.stop), id=self.id, top_logprobs=self.top_logprobs, generated=list(self.generated),
                       speculative=self.speculative, predicted=None if self.predicted is None else list(self.predicted),
                       seeded=self.seeded)
