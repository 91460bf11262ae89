"""Request and response bodies of the HTTP API, as pydantic models (they make the OpenAPI document).

The OpenAI-compatible bodies follow OpenAI's field names; fields OpenAI has and exo-tui does not
use (``user``, ``logit_bias``...) are accepted and ignored, like other OpenAI-compatible servers
do. ``top_k`` and ``repetition_penalty`` are extensions, as in vLLM and llama.cpp.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from exo_tui.models.sampling_params import COUNT_MAX

SEED_MAX = 2**63 - 1


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


Stop = str | list[str] | None
PREDICTION_MAX_CHARS = 1 << 20


class PredictionPart(BaseModel):
    type: Literal["text"] = "text"
    text: str = Field(max_length=PREDICTION_MAX_CHARS)


class PredictionContent(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to copy largely (code to edit);
    its tokens are drafted and checked, so the answer is the same, only sooner."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: str | list[PredictionPart] = Field(max_length=PREDICTION_MAX_CHARS)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, description="a model id from GET /v1/models")
    temperature: float | None = Field(default=None, ge=0, le=2, description="0 is greedy; default: the model's recommendation, else 1")
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX, description="same seed, same answer")
    stop: Stop = Field(default=None, description="up to 4 strings; the answer ends before the first one")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="only 1 answer per request")
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    top_k: int | None = Field(default=None, ge=0, le=COUNT_MAX, description="extension: 0 is off")
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10, description="extension: 1 is off")
    user: str | None = None
    prediction: PredictionContent | None = Field(default=None, description="Predicted Outputs: text the answer is "
                                                 "expected to copy; drafted from, checked token by token")
    speculative: str | int | None = Field(default=None, description="extension: off, auto or a number of drafted "
                                          "tokens a step (1..32); default: the cluster's (serve --speculative)")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = Field(default=False, description="each answer token's log-probability under the model")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="and this many likeliest tokens' at each position (needs logprobs)")
    max_tokens: int | None = Field(default=None, ge=1, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def answer_limit(self) -> int | None:
        """The answer's token limit: ``max_completion_tokens``, else the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] = Field(description="a string, a one-string list, or token ids")
    max_tokens: int | None = Field(default=16, ge=0, description="0 only with echo: the prompt scored, nothing generated")
    echo: bool = Field(default=False, description="the prompt before the answer (and, with logprobs, its tokens' logprobs)")
    logprobs: int | None = Field(default=None, ge=0, le=5, description="each token's log-probability and this many likeliest tokens'")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(default=0, description="prompt tokens not run again: an earlier turn of the conversation left their caches")


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(default=0, description="tokens of the prediction the answer kept")
    rejected_prediction_tokens: int = Field(default=0, description="tokens of the prediction drafted and not kept")
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class SpeculationCounts(BaseModel):
    """Extension: what speculative decoding drafted (from any source) and kept, and its verify steps;
    there when anything was drafted."""

    drafted_tokens: int
    accepted_tokens: int
    verify_steps: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    speculation: SpeculationCounts | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # null: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
    speculation: SpeculationCounts | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "exo-tui"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ActionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dry_run: bool = Field(default=False, description="only say what would change (the plan diff)")


class PinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    node: str = Field(min_length=1, description="node id or name")
    start: int | None = Field(default=None, ge=0, description="first layer (omit start and end: the node's current layers)")
    end: int | None = Field(default=None, ge=1, description="one past the last layer")
    dry_run: bool = False


class HostRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = Field(min_length=1, description="[user@]host[:port]")


class BootstrapRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    accept_new_host_key: bool = False


class ModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, description="registered model name or path to a .gguf on the coordinator")


# A JSON object whose shape is documented in exo_tui/cluster/view.py (ClusterSnapshot, PlanPreview).
JsonObject = dict[str, Any]
