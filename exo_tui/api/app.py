"""The HTTP API over one coordinator: the app, and its OpenAI-compatible models and completions.

``create_app(coordinator, api_key=...)`` builds the FastAPI app; :mod:`exo_tui.api.server` runs
it with uvicorn in the coordinator's own event loop, so handlers call the coordinator directly.
The app holds the routes of this module (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``) and the routers beside it: the cluster's endpoints
(:mod:`exo_tui.api.cluster_routes`), the machine's models (:mod:`exo_tui.api.model_routes`),
``/metrics`` (:mod:`exo_tui.api.metrics`) and Ollama's API (:mod:`exo_tui.api.ollama`).

Errors always have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``
(:mod:`exo_tui.api.errors`):
400 a request the server understood but cannot do (bad JSON, prompt too long), 401 a missing or
wrong API key, 403 a change refused by a read-only coordinator, 404 an unknown model, node or
path, 409 a cluster change that is impossible now, 422 parameters out of range, 429 too many
requests waiting for the cluster's memory (with ``Retry-After``), 503 the cluster cannot serve the
model (``Retry-After`` when it is still starting). A request sent before the first plan, or while
a model loads, waits for it (``admission.plan_wait_s``). A client that disconnects
cancels its generation.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from exo_tui import __version__
from exo_tui.api import schemas as s
from exo_tui.api.cluster_routes import cluster_router
from exo_tui.api.errors import RETRY_AFTER_S, ApiError, add_error_handlers, documented_errors
from exo_tui.api.generation import (
    MAX_STOPS,
    OPENAI_SAMPLING,
    Generation,
    context_note,
    until_done_or_disconnect,
)
from exo_tui.api.guard import DEFAULT_MAX_BODY_BYTES, ApiGuard
from exo_tui.api.logprobs import chat_logprobs, completion_logprobs, prompt_listed
from exo_tui.api.metrics import add_metrics_route
from exo_tui.api.model_names import model_ids
from exo_tui.api.model_routes import models_router
from exo_tui.api.ollama import ollama_router, openai_models, scan
from exo_tui.api.prompts import PromptRefused, Prompts
from exo_tui.api.sse import SSE_200, SSE_HEADERS, sse, sse_template
from exo_tui.cluster.admission import NotReady, QueueFull, TooLarge, wait_for_plan
from exo_tui.cluster.view import ServingCluster
from exo_tui.inference.generate import GenerationError, Listed
from exo_tui.inference.request import Request as GenRequest
from exo_tui.inference.sampling import SamplingParams, with_defaults
from exo_tui.inference.speculation import parse_mode
from exo_tui.models.model import Model

log = logging.getLogger("exo_tui.api")

# Module level: FastAPI resolves the (string) annotations of dependencies in this module's globals.
bearer = HTTPBearer(auto_error=False, description="the API key (network.api.key or EXO_TUI_API_KEY), when one is set")


def create_app(coordinator: ServingCluster, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The API over ``coordinator`` (a :class:`~exo_tui.cluster.view.ServingCluster`: the embedded
    :class:`~exo_tui.cluster.coordinator.Coordinator`); it reaches the cluster through nothing else.

    :class:`~exo_tui.api.guard.ApiGuard` wraps every path (``/docs`` and ``/openapi.json`` too): the
    key is checked from the headers before any body byte is read, and bodies stop at
    ``max_body_bytes`` (413). The key dependency below stays for the OpenAPI document's security
    scheme."""
    async def check_key(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if not api_key:
            return
        if creds is None:
            raise ApiError(401, "this server needs an API key: send it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        if not hmac.compare_digest(creds.credentials.encode(), api_key.encode()):
            raise ApiError(401, "incorrect API key provided: use the key in network.api.key or EXO_TUI_API_KEY "
                                "of the coordinator", code="invalid_api_key")

    app = FastAPI(
        title="exo-tui",
        version=__version__,
        description="OpenAI-compatible API and cluster control of an exo-tui coordinator.",
        dependencies=[Depends(check_key)],
    )
    app.add_middleware(ApiGuard, api_key=api_key, max_body_bytes=max_body_bytes)
    app.state.coordinator = coordinator
    app.state.closing = asyncio.Event()  # set by the server as it stops: event streams end at once
    build_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """The OpenAPI document, made afresh: ``model`` lists the model served now."""
        app.openapi_schema = None
        schema = build_openapi()
        if coordinator.model is not None:
            for name in ("ChatCompletionRequest", "CompletionRequest"):
                prop = schema.get("components", {}).get("schemas", {}).get(name, {}).get("properties", {}).get("model")
                if prop is not None:
                    prop["enum"] = model_ids(coordinator)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema

    add_error_handlers(app)
    prompts = Prompts(coordinator)

    async def prompt_of(work: Awaitable[list[int]]) -> list[int]:
        try:
            return await work
        except PromptRefused as exc:
            raise ApiError(400, exc.message, param=exc.param, code=exc.code) from exc

    # ------------------------------------------------------------------ helpers

    def served() -> Model:
        """The model the cluster serves (a 503 while it loads)."""
        if coordinator.model is None:
            raise ApiError(503, "the coordinator is still loading its model: try again in a moment",
                           type="server_error", code="cluster_unavailable")
        return coordinator.model

    def check_model(name: str) -> str:
        served()
        ids = model_ids(coordinator)
        if (name not in ids and name.lower() not in [i.lower() for i in ids]):
            raise ApiError(404, f"the model {name!r} does not exist here: this cluster serves {ids[0]!r} "
                                f"(GET /v1/models)", param="model", code="model_not_found")
        return ids[0]

    async def ready() -> None:
        """Wait (admission.plan_wait_s at most) for the model and a plan, as the console
        does: a request sent while the server starts or loads a model is served once it can be."""
        try:
            await wait_for_plan(coordinator, coordinator.config.admission.plan_wait_s, RETRY_AFTER_S)
        except NotReady as exc:
            raise ApiError(503, str(exc), type="server_error", code="cluster_unavailable",
                           retry_after_s=exc.retry_after_s) from exc
        except GenerationError as exc:
            raise ApiError(503, str(exc), type="server_error", code="cluster_unavailable") from exc

    def sampling(body: s._Sampling) -> SamplingParams:
        given = {
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
            "repetition_penalty": body.repetition_penalty, "frequency_penalty": body.frequency_penalty,
            "presence_penalty": body.presence_penalty, "seed": body.seed,
        }
        recommended = coordinator.model.sampling if coordinator.model is not None else {}
        try:
            # Left out: the model's recommendation, else OpenAI's defaults (temperature 1, no nucleus).
            return with_defaults(given, recommended, OPENAI_SAMPLING).with_seed()
        except ValueError as exc:
            raise ApiError(422, str(exc), code="invalid_parameter") from exc

    def stops(stop: s.Stop) -> tuple[str, ...]:
        items = [stop] if isinstance(stop, str) else list(stop or [])
        if len(items) > MAX_STOPS:
            raise ApiError(422, f"stop takes at most {MAX_STOPS} strings, not {len(items)}", param="stop",
                           code="invalid_parameter")
        return tuple(x for x in items if x)

    def new_request(prompt_ids: list[int], body: s._Sampling, max_tokens: int | None,
                    top_logprobs: int | None = None, prompt_logprobs: int | None = None) -> GenRequest:
        context = coordinator.context_length
        if len(prompt_ids) >= context:
            raise ApiError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                                f"{len(prompt_ids)}: shorten it{context_note(coordinator)}", param="messages",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = context - len(prompt_ids)
        elif len(prompt_ids) + max_tokens > context:
            raise ApiError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                                f"{len(prompt_ids)} and max_tokens asks for {max_tokens} more: ask for at most "
                                f"{context - len(prompt_ids)}{context_note(coordinator)}", param="max_tokens",
                           code="context_length_exceeded")
        return GenRequest(prompt_ids, sampling(body), max_tokens, stops(body.stop), top_logprobs=top_logprobs,
                          prompt_logprobs=prompt_logprobs, seeded=body.seed is not None, **speculation_of(body))

    async def start(http: Request, request: GenRequest) -> Generation:
        """Start generating; wait for the first chunk so a cluster that cannot serve is a 503."""
        gen = Generation(coordinator, request)
        try:
            await until_done_or_disconnect(http, gen, gen.first())
        except QueueFull as exc:
            await gen.cancel()
            raise ApiError(429, str(exc), type="requests", code="rate_limit_exceeded",
                           retry_after_s=exc.retry_after_s) from exc
        except TooLarge as exc:
            await gen.cancel()
            raise ApiError(400, str(exc), param="max_tokens", code="kv_budget_exceeded") from exc
        except NotReady as exc:
            await gen.cancel()
            raise ApiError(503, str(exc), type="server_error", code="cluster_unavailable",
                           retry_after_s=exc.retry_after_s) from exc
        except GenerationError as exc:
            await gen.cancel()
            raise ApiError(503, str(exc), type="server_error", code="cluster_unavailable") from exc
        except BaseException:
            await gen.cancel()
            raise
        return gen

    async def collect(http: Request, gen: Generation) -> tuple[str, list[Listed]]:
        try:
            return await until_done_or_disconnect(http, gen, _collect(gen))
        except GenerationError as exc:  # the cluster lost the ability to serve mid-answer
            raise ApiError(503, str(exc), type="server_error", code="cluster_unavailable") from exc

    def speculation_of(body: s._Sampling) -> dict[str, Any]:
        """A request's ``speculative`` and ``prediction`` (its tokens), as the Request takes them."""
        out: dict[str, Any] = {}
        if body.speculative is not None:
            try:
                out["speculative"] = parse_mode(body.speculative)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="speculative", code="invalid_parameter") from exc
        if body.prediction is not None and body.prediction.text():
            out["predicted"] = served().tokenizer.encode(body.prediction.text(), add_special=False, parse_special=False)
        return out

    def usage(request: GenRequest) -> dict[str, Any]:
        p, c = len(request.prompt_ids), len(request.generated)
        stats = request.speculation.stats if request.speculation is not None else None
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": request.cached_tokens},
                "completion_tokens_details": {
                    "accepted_prediction_tokens": stats.prediction_accepted if stats else 0,
                    "rejected_prediction_tokens": stats.prediction_rejected if stats else 0,
                    "reasoning_tokens": 0}}

    # ------------------------------------------------------------------ models

    @app.get("/v1/models", response_model=s.ModelList, responses=documented_errors(401), tags=["openai"])
    async def list_models() -> dict[str, Any]:

        return {"object": "list", "data": openai_models(coordinator, await scan(coordinator)) if coordinator.model is not None else []}

    @app.get("/v1/models/{model}", response_model=s.ModelCard, responses=documented_errors(401, 404, 503), tags=["openai"])
    async def get_model(model: str) -> dict[str, Any]:
        mid = check_model(model)
        return {"id": mid, "object": "model", "created": int(served().path.stat().st_mtime), "owned_by": "exo-tui"}

    # ------------------------------------------------------------------ chat completions

    @app.post("/v1/chat/completions", response_model=s.ChatCompletion, tags=["openai"],
              responses={200: SSE_200, **documented_errors(400, 401, 404, 422, 429, 503)})
    async def chat_completions(body: s.ChatCompletionRequest, http: Request) -> Any:
        await ready()
        mid = check_model(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        prompt_ids = await prompt_of(prompts.chat(served(), messages))
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_parameter")
        top = (body.top_logprobs or 0) if body.logprobs else None
        request = new_request(prompt_ids, body, body.answer_limit, top)
        gen = await start(http, request)
        cid = f"chatcmpl-{request.id}"  # the id in the events (RequestDone...)
        tokenizer = served().tokenizer
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_chat_stream(gen, cid, mid, include_usage, usage, tokenizer),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        text, listed = await collect(http, gen)
        return {
            "id": cid, "object": "chat.completion", "created": gen.created, "model": mid,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": chat_logprobs(tokenizer, listed) if top is not None else None,
                         "finish_reason": gen.finish_reason}],
            "usage": usage(request), "system_fingerprint": f"exo-tui-{__version__}", **speculation(request),
        }

    # ------------------------------------------------------------------ completions

    @app.post("/v1/completions", response_model=s.Completion, tags=["openai"],
              responses={200: SSE_200, **documented_errors(400, 401, 404, 422, 429, 503)})
    async def completions(body: s.CompletionRequest, http: Request) -> Any:
        await ready()
        mid = check_model(body.model)
        tokenizer = served().tokenizer
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request, not {len(prompt)}: send them as separate requests",
                               param="prompt", code="invalid_prompt")
            prompt = str(prompt[0])  # a string, as checked
        if isinstance(prompt, str):
            prompt_ids = await prompt_of(prompts.text(served(), prompt))
            prompt_text = prompt
        else:
            ids = [int(x) for x in prompt]
            bad = [x for x in ids if not 0 <= x < tokenizer.vocab_size]
            if bad or not ids:
                raise ApiError(400, f"token ids must be in [0, {tokenizer.vocab_size}) and at least one: {bad[:5] or '[]'}",
                               param="prompt", code="invalid_prompt")
            prompt_ids = ids
            prompt_text = tokenizer.decode(ids)
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty: give at least one token", param="prompt", code="invalid_prompt")
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens 0 asks for nothing: give at least 1, or 0 with echo (and logprobs) "
                                "to score the prompt", param="max_tokens", code="invalid_parameter")
        scored = body.echo and body.logprobs is not None
        request = new_request(prompt_ids, body, body.max_tokens, body.logprobs, body.logprobs if scored else None)
        gen = await start(http, request)
        cid = f"cmpl-{request.id}"
        prefix = prompt_text if body.echo else ""
        echoed: list[Listed] = prompt_listed(tokenizer, prompt_ids, request.prompt_scores) if scored else []
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_text_stream(gen, cid, mid, include_usage, usage, prefix, tokenizer, echoed),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        text, listed = await collect(http, gen)
        logprobs = completion_logprobs(tokenizer, [*echoed, *((at + len(prefix), lp) for at, lp in listed)]) \
            if body.logprobs is not None else None
        return {
            "id": cid, "object": "text_completion", "created": gen.created, "model": mid,
            "choices": [{"index": 0, "text": prefix + text, "logprobs": logprobs, "finish_reason": gen.finish_reason}],
            "usage": usage(request), "system_fingerprint": f"exo-tui-{__version__}", **speculation(request),
        }

    # ------------------------------------------------------------------ cluster

    add_metrics_route(app, coordinator)
    app.include_router(cluster_router(coordinator, app.state.closing))


    app.include_router(models_router(coordinator))
    app.include_router(ollama_router(coordinator, prompts))
    return app


# ---------------------------------------------------------------------- streaming




def speculation(request: GenRequest) -> dict[str, Any]:
    """The extension ``speculation``: every draft source's drafted tokens and those kept (it
    varies with the stream's measurements, so it stays out of OpenAI's ``usage``)."""
    stats = request.speculation.stats if request.speculation is not None else None
    if stats is None or not stats.drafted:
        return {}
    return {"speculation": {"drafted_tokens": stats.drafted, "accepted_tokens": stats.accepted,
                            "verify_steps": stats.steps}}


async def _collect(gen: Generation) -> tuple[str, list[Listed]]:
    pieces: list[str] = []
    listed: list[Listed] = []
    while (chunk := await gen.next()) is not None:
        pieces.append(chunk.text)
        listed.extend(chunk.logprobs)
    return "".join(pieces), listed


def _stream_error(exc: BaseException) -> str:
    code = "cluster_unavailable" if isinstance(exc, GenerationError) else "internal_error"
    return sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": code}})


async def _chat_stream(gen: Generation, cid: str, mid: str, include_usage: bool, usage: Any,
                       tokenizer: Any) -> AsyncIterator[str]:
    base = {"id": cid, "object": "chat.completion.chunk", "created": gen.created, "model": mid,
            "system_fingerprint": f"exo-tui-{__version__}"}
    extra = {"usage": None} if include_usage else {}
    asked = gen.request.top_logprobs is not None

    def chunk(delta: dict[str, Any], finish: str | None = None, listed: tuple[Listed, ...] = ()) -> str:
        logprobs = chat_logprobs(tokenizer, listed) if asked and listed else None
        return sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                    **extra})

    content = sse_template({**base, "choices": [{"index": 0, "delta": {"content": "\0"}, "logprobs": None,
                                                 "finish_reason": None}], **extra})
    try:
        yield chunk({"role": "assistant", "content": ""})
        while (c := await gen.next()) is not None:
            if c.logprobs:
                yield chunk({"content": c.text}, listed=c.logprobs)
            elif c.text:
                yield content(c.text)
        yield chunk({}, gen.finish_reason)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(gen.request), **speculation(gen.request)})
    except Exception as exc:  # noqa: BLE001 - the stream has begun: tell the client in the stream
        yield _stream_error(exc)
    finally:
        gen.cancel_soon()  # a client that went away: stop at the next token boundary, drop caches
    yield "data: [DONE]\n\n"


async def _text_stream(gen: Generation, cid: str, mid: str, include_usage: bool, usage: Any,
                       prefix: str, tokenizer: Any, echoed: list[Listed]) -> AsyncIterator[str]:
    base = {"id": cid, "object": "text_completion", "created": gen.created, "model": mid,
            "system_fingerprint": f"exo-tui-{__version__}"}
    extra = {"usage": None} if include_usage else {}
    asked = gen.request.top_logprobs is not None

    def chunk(text: str, finish: str | None = None, listed: tuple[Listed, ...] = ()) -> str:
        logprobs = completion_logprobs(tokenizer, listed, len(prefix)) if asked and listed else None
        return sse({**base, "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
                    **extra})

    content = sse_template({**base, "choices": [{"index": 0, "text": "\0", "logprobs": None, "finish_reason": None}],
                            **extra})
    try:
        if echoed:  # the prompt with its tokens' logprobs
            yield sse({**base, "choices": [{"index": 0, "text": prefix, "finish_reason": None,
                                            "logprobs": completion_logprobs(tokenizer, echoed)}], **extra})
        elif prefix:
            yield content(prefix)
        while (c := await gen.next()) is not None:
            if c.logprobs:
                yield chunk(c.text, listed=c.logprobs)
            elif c.text:
                yield content(c.text)
        yield chunk("", gen.finish_reason)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(gen.request), **speculation(gen.request)})
    except Exception as exc:  # noqa: BLE001
        yield _stream_error(exc)
    finally:
        gen.cancel_soon()
    yield "data: [DONE]\n\n"
