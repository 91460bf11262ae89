"""The HTTP API: OpenAI-compatible completions and the cluster's endpoints, over one coordinator.

``create_app(coordinator, api_key=...)`` builds the FastAPI app; :mod:`exo_tui.api.server` runs
it with uvicorn in the coordinator's own event loop, so handlers call the coordinator directly.

Errors always have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
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
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from exo_tui import __version__
from exo_tui.api import schemas as s
from exo_tui.api.convert import EVENT_KINDS, event_to_dict, snapshot_to_dict, to_jsonable
from exo_tui.api.generation import Generation
from exo_tui.api.guard import DEFAULT_MAX_BODY_BYTES, ApiGuard, BodyTooLarge
from exo_tui.api.logprobs import chat_logprobs, completion_logprobs, prompt_listed
from exo_tui.api.metrics import add_metrics_route
from exo_tui.cluster.admission import NotReady, QueueFull, TooLarge, wait_for_plan
from exo_tui.cluster.view import Command, HostKeyUnknown, ServingCluster, run_command
from exo_tui.inference.generate import GenerationError, Listed
from exo_tui.inference.request import Request as GenRequest
from exo_tui.inference.sampling import SamplingParams, with_defaults

log = logging.getLogger("exo_tui.api")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE_S = 15.0
MAX_STOPS = 4
RETRY_AFTER_S = 2  # on a 503
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0}  # what a request leaves out, after the model's own


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type=self.type, param=self.param, code=self.code,
                              retry_after_s=self.retry_after_s)


def error_response(status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                   param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> JSONResponse:
    headers = None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif status in (429, 503):  # busy; loading, no plan yet, no node reachable: clients that honour it retry then
        headers = {"Retry-After": str(retry_after_s or RETRY_AFTER_S)}
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    if 422 in codes:
        codes = (400, *codes)  # a body that is not JSON at all is a 400, as in OpenAI's API
    text = {400: "bad request", 401: "missing or wrong API key", 403: "read-only coordinator",
            404: "unknown model, node or host", 409: "the change is impossible now", 422: "invalid parameters",
            429: "too many requests waiting: try again after Retry-After seconds",
            502: "the host could not be bootstrapped", 503: "the cluster cannot serve the model"}
    return {c: {"model": s.ErrorResponse, "description": text[c]} for c in codes}


# One server-sent event (OpenAPI before 3.2 has ``schema`` describe each event of a stream).
_SSE_200 = {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON object, or [DONE] at the end"},
                   "event": {"type": "string"}, "id": {"type": "string"}},
}}}}


# Module level: FastAPI resolves the (string) annotations of dependencies in this module's globals.
bearer = HTTPBearer(auto_error=False, description="the API key (network.api.key or EXO_TUI_API_KEY), when one is set")


def model_ids(coordinator: ServingCluster) -> list[str]:
    """The id the API lists for the loaded model first, then other names it answers to."""
    from exo_tui.models.registry import DEFAULT_MODEL

    names: list[str] = []
    given = coordinator.model_name
    if given:
        names.append(Path(given).stem if Path(str(given)).suffix == ".gguf" else str(given))
    else:
        names.append(DEFAULT_MODEL)
    model = coordinator.model
    if model is not None:
        names += [model.name, model.path.stem, model.path.name]
    return list(dict.fromkeys(n for n in names if n))


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

    app.openapi = openapi  # type: ignore[method-assign]

    # ------------------------------------------------------------------ errors

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" or (e.get("type") == "model_attributes_type" and tuple(e.get("loc", ())) == ("body",))
               for e in errors):
            return error_response(400, "the body is not a JSON object: send JSON with Content-Type: application/json",
                                  code="invalid_json")
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path")]
        param = ".".join(loc) or None
        parts = []
        for e in errors[:5]:
            where = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body", "query", "path")) or "body"
            parts.append(f"{where}: {e.get('msg', 'invalid')}")
        return error_response(422, "invalid parameters: " + "; ".join(parts), param=param, code="invalid_parameter")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.error("internal error: %r", exc, exc_info=exc)
        return error_response(500, f"internal error in the coordinator: {type(exc).__name__}: {exc}; see its log",
                              type="server_error", code="internal_error")

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = "no such path: see /docs for the API"
        elif exc.status_code == 405:
            message = f"method not allowed here: {exc.detail}"
        code = "body_too_large" if isinstance(exc, BodyTooLarge) else str(exc.status_code)
        return error_response(exc.status_code, message, code=code)

    # ------------------------------------------------------------------ helpers

    def check_model(name: str) -> str:
        if coordinator.model is None:
            raise ApiError(503, "the coordinator is still loading its model: try again in a moment",
                           type="server_error", code="cluster_unavailable")
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
        context = coordinator.model.config.context_length
        if len(prompt_ids) >= context:
            raise ApiError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                                f"{len(prompt_ids)}: shorten it", param="messages", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = context - len(prompt_ids)
        elif len(prompt_ids) + max_tokens > context:
            raise ApiError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                                f"{len(prompt_ids)} and max_tokens asks for {max_tokens} more: ask for at most "
                                f"{context - len(prompt_ids)}", param="max_tokens", code="context_length_exceeded")
        return GenRequest(prompt_ids, sampling(body), max_tokens, stops(body.stop), top_logprobs=top_logprobs,
                          prompt_logprobs=prompt_logprobs)

    async def start(http: Request, request: GenRequest) -> Generation:
        """Start generating; wait for the first chunk so a cluster that cannot serve is a 503."""
        gen = Generation(coordinator, request)
        try:
            await _until_done_or_disconnect(http, gen, gen.first())
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
            return await _until_done_or_disconnect(http, gen, _collect(gen))
        except GenerationError as exc:  # the cluster lost the ability to serve mid-answer
            raise ApiError(503, str(exc), type="server_error", code="cluster_unavailable") from exc

    def usage(request: GenRequest) -> dict[str, Any]:
        p, c = len(request.prompt_ids), len(request.generated)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": request.cached_tokens}}

    # ------------------------------------------------------------------ models

    @app.get("/v1/models", response_model=s.ModelList, responses=_errors(401), tags=["openai"])
    async def list_models() -> dict[str, Any]:
        from exo_tui.api.ollama import openai_models, scan  # the served model, then the catalog's others

        return {"object": "list", "data": openai_models(coordinator, await scan(coordinator)) if coordinator.model is not None else []}

    @app.get("/v1/models/{model}", response_model=s.ModelCard, responses=_errors(401, 404, 503), tags=["openai"])
    async def get_model(model: str) -> dict[str, Any]:
        mid = check_model(model)
        return {"id": mid, "object": "model", "created": int(coordinator.model.path.stat().st_mtime), "owned_by": "exo-tui"}

    # ------------------------------------------------------------------ chat completions

    @app.post("/v1/chat/completions", response_model=s.ChatCompletion, tags=["openai"],
              responses={200: _SSE_200, **_errors(400, 401, 404, 422, 429, 503)})
    async def chat_completions(body: s.ChatCompletionRequest, http: Request) -> Any:
        await ready()
        mid = check_model(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_ids = await asyncio.to_thread(coordinator.model.chat_prompt_ids, messages)
        except Exception as exc:  # noqa: BLE001 - the chat template refused these messages
            raise ApiError(400, f"the model's chat template cannot render these messages: {exc}",
                           param="messages", code="invalid_messages") from exc
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_parameter")
        top = (body.top_logprobs or 0) if body.logprobs else None
        request = new_request(prompt_ids, body, body.max_completion_tokens or body.max_tokens, top)
        gen = await start(http, request)
        cid = f"chatcmpl-{request.id}"  # the id in the events (RequestDone...)
        tokenizer = coordinator.model.tokenizer
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
            "usage": usage(request), "system_fingerprint": f"exo-tui-{__version__}",
        }

    # ------------------------------------------------------------------ completions

    @app.post("/v1/completions", response_model=s.Completion, tags=["openai"],
              responses={200: _SSE_200, **_errors(400, 401, 404, 422, 429, 503)})
    async def completions(body: s.CompletionRequest, http: Request) -> Any:
        await ready()
        mid = check_model(body.model)
        tokenizer = coordinator.model.tokenizer
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request, not {len(prompt)}: send them as separate requests",
                               param="prompt", code="invalid_prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(tokenizer.encode, prompt)
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
            "usage": usage(request), "system_fingerprint": f"exo-tui-{__version__}",
        }

    # ------------------------------------------------------------------ cluster

    add_metrics_route(app, coordinator)

    @app.get("/health", tags=["cluster"], responses=_errors(401))
    async def health() -> dict[str, Any]:
        why = getattr(coordinator, "_serve_error", "")
        ready = not why and getattr(coordinator, "ring", None) is not None
        return {"status": "ok", "ready": ready, "error": why or None, "model": model_ids(coordinator)[0]}

    @app.get("/v1/cluster", tags=["cluster"], responses=_errors(401),
             description="nodes (profiles, scores, live metrics), links, the plan and its predictions")
    async def cluster() -> s.JsonObject:
        return snapshot_to_dict(coordinator.snapshot())

    @app.get("/v1/cluster/events", tags=["cluster"], responses={200: _SSE_200, **_errors(401)},
             description="server-sent events: one JSON event per `data:` line (see exo_tui/events.py); "
                         "`replay`: the recent events first; `exclude`: event types not to send, comma-separated "
                         "(e.g. `token,node_metrics`)")
    async def cluster_events(replay: bool = False, exclude: str = "") -> StreamingResponse:
        skipped = {k.strip() for k in exclude.split(",") if k.strip()}
        if unknown := skipped - EVENT_KINDS:
            raise ApiError(422, f"exclude: unknown event type(s) {', '.join(sorted(unknown))}; the types are "
                                f"{', '.join(sorted(EVENT_KINDS))}", param="exclude")
        sub = coordinator.events.subscribe(replay=replay)
        closing: asyncio.Event = app.state.closing

        async def stream() -> AsyncIterator[str]:
            # The stream never ends by itself: it ends when the server stops (else the server
            # waited out its graceful shutdown for every attached console, then cancelled them
            # with a traceback in its log).
            closed = asyncio.ensure_future(closing.wait())
            try:
                yield ": exo-tui events\n\n"
                while not closed.done():
                    if (event := sub.get_nowait()) is None:
                        getter = asyncio.ensure_future(sub.get())
                        await asyncio.wait((getter, closed), timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED)
                        if not getter.done():
                            getter.cancel()
                            if closed.done():
                                return
                            yield ": keep-alive\n\n"
                            continue
                        event = getter.result()
                    if event.kind not in skipped:
                        yield f"data: {json.dumps(event_to_dict(event))}\n\n"
            finally:
                closed.cancel()
                sub.close()

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    def resolve_node(node: str, *, pinned: bool = False) -> str:
        """The id of the node ``node`` names. ``pinned``: a pinned node's id counts though the node
        is not in the cluster (its pin can be taken off)."""
        if pinned and node in coordinator.pins:
            return node
        snap = coordinator.snapshot()
        for n in snap.nodes:
            if n.node_id == node:
                return n.node_id
        named = [n.node_id for n in snap.nodes if n.name == node]
        if len(named) == 1:
            return named[0]
        known = ", ".join(sorted(n.name for n in snap.nodes)) or "none"
        reason = "several nodes have that name: use its id" if named else f"known nodes are {known}"
        raise ApiError(404, f"no node {node!r}: {reason}", param="node", code="node_not_found")

    async def act(command: Command, dry_run: bool) -> dict[str, Any]:
        preview = await run_command(coordinator, command, dry_run=dry_run)
        if preview.error:
            if coordinator.readonly and not dry_run:
                raise ApiError(403, preview.error, code="readonly")
            raise ApiError(409, preview.error, code="change_impossible")
        return to_jsonable(preview)

    action_doc = "what the change does (a PlanPreview: moves, bytes, tok/s before and after, the new plan)"

    for action in ("drain", "undrain", "remove"):
        def make(action: str = action):  # noqa: ANN202
            async def endpoint(node: str, body: s.ActionRequest | None = None) -> s.JsonObject:
                return await act(Command(action, (resolve_node(node),)), bool(body and body.dry_run))

            endpoint.__name__ = f"{action}_node"
            return endpoint

        app.post(f"/v1/cluster/nodes/{{node}}/{action}", tags=["cluster"], description=f"{action} a node: {action_doc}",
                 responses=_errors(401, 403, 404, 409, 422))(make())

    @app.post("/v1/cluster/pins", tags=["cluster"], responses=_errors(401, 403, 404, 409, 422),
              description="pin a node to layers [start, end) (moving them there if it holds others), or without "
                          "start/end to the layers it holds now; rebalances keep pinned layers where they are")
    async def pin(body: s.PinRequest) -> s.JsonObject:
        if (body.start is None) != (body.end is None):
            raise ApiError(422, "give both start and end (layers [start, end)), or neither to pin the node's "
                                "current layers", param="start" if body.start is None else "end", code="invalid_layers")
        layers = (body.start, body.end) if body.start is not None and body.end is not None else None
        if layers is not None and layers[0] >= layers[1]:
            raise ApiError(422, f"start {layers[0]} must be below end {layers[1]} (end is one past the last layer)",
                           param="end", code="invalid_layers")
        return await act(Command("pin", (resolve_node(body.node),), layers), body.dry_run)

    @app.delete("/v1/cluster/pins/{node}", tags=["cluster"], responses=_errors(401, 403, 404, 409, 422),
                description="unpin a node")
    async def unpin(node: str, dry_run: bool = False) -> s.JsonObject:
        return await act(Command("unpin", (resolve_node(node, pinned=True),)), dry_run)

    @app.post("/v1/cluster/rebalance", tags=["cluster"], responses=_errors(401, 403, 409, 422),
              description=f"make the best plan for the cluster as it is; {action_doc}")
    async def rebalance(body: s.ActionRequest | None = None) -> s.JsonObject:
        return await act(Command("rebalance"), bool(body and body.dry_run))

    @app.post("/v1/cluster/hosts", tags=["cluster"], responses=_errors(401, 422), description="add a host by address")
    async def add_host(body: s.HostRequest) -> s.JsonObject:
        await coordinator.add_host(body.host)
        return {"host": body.host}

    @app.post("/v1/cluster/hosts/{host}/bootstrap", tags=["cluster"], responses=_errors(401, 403, 409, 422, 502),
              description="install and start a node agent on a host over SSH and join it")
    async def bootstrap(host: str, body: s.BootstrapRequest | None = None) -> s.JsonObject:
        if coordinator.readonly:
            raise ApiError(403, "read-only coordinator: bootstrap is disabled", code="readonly")
        try:
            await coordinator.bootstrap(host, accept_new_host_key=bool(body and body.accept_new_host_key))
        except HostKeyUnknown as exc:
            raise ApiError(409, str(exc), param=exc.fingerprint, code="host_key_unknown") from exc
        except Exception as exc:  # noqa: BLE001 - the host's fault, reported with the reason
            raise ApiError(502, f"bootstrap of {host} failed: {exc}", type="server_error", code="bootstrap_failed") from exc
        return {"host": host}

    @app.post("/v1/cluster/model", tags=["cluster"], responses=_errors(401, 403, 404, 422, 503),
              description="load another model on the cluster")
    async def set_model(body: s.ModelRequest) -> s.JsonObject:
        from exo_tui.models.gguf_file import ModelFileError, UnsupportedModelError

        if coordinator.readonly:
            raise ApiError(403, "read-only coordinator: model changes are disabled", code="readonly")
        try:
            await run_command(coordinator, Command("model", model=body.model))
        except UnsupportedModelError as exc:
            raise ApiError(422, str(exc), param="model", code="model_not_supported") from exc
        except ModelFileError as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found") from exc
        except GenerationError as exc:
            raise ApiError(503, str(exc), type="server_error", code="cluster_unavailable") from exc
        return {"model": model_ids(coordinator)[0]}

    from exo_tui.api.model_routes import models_router
    from exo_tui.api.ollama import ollama_router  # Ollama's API (/api/*); it imports this module

    app.include_router(models_router(coordinator))
    app.include_router(ollama_router(coordinator))
    return app


# ---------------------------------------------------------------------- streaming


async def _until_done_or_disconnect(http: Request, gen: Generation, work: Any) -> Any:
    """Run ``work``; if the client goes away first, cancel the generation (its caches are dropped)."""
    work_task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        done, _ = await asyncio.wait({work_task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        log.info("client went away: cancelling %s", gen.request.id)
        await gen.cancel()
        raise ClientGone()
    finally:
        for t in (work_task, gone):
            if not t.done():
                t.cancel()
        for t in (work_task, gone):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


class ClientGone(Exception):
    pass


async def _disconnected(http: Request) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(gen: Generation) -> tuple[str, list[Listed]]:
    pieces: list[str] = []
    listed: list[Listed] = []
    while (chunk := await gen.next()) is not None:
        pieces.append(chunk.text)
        listed.extend(chunk.logprobs)
    return "".join(pieces), listed


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _sse_template(obj: Any) -> Callable[[str], str]:
    """``_sse`` of ``obj`` whose one ``"\0"`` string is each call's argument: the event of a
    streamed token is one JSON string formatted into text made once, not a dict encoded whole."""
    before, after = _sse(obj).split('"\\u0000"')
    return lambda text: before + json.dumps(text) + after


def _stream_error(exc: BaseException) -> str:
    code = "cluster_unavailable" if isinstance(exc, GenerationError) else "internal_error"
    return _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": code}})


async def _chat_stream(gen: Generation, cid: str, mid: str, include_usage: bool, usage: Any,
                       tokenizer: Any) -> AsyncIterator[str]:
    base = {"id": cid, "object": "chat.completion.chunk", "created": gen.created, "model": mid,
            "system_fingerprint": f"exo-tui-{__version__}"}
    extra = {"usage": None} if include_usage else {}
    asked = gen.request.top_logprobs is not None

    def chunk(delta: dict[str, Any], finish: str | None = None, listed: tuple[Listed, ...] = ()) -> str:
        logprobs = chat_logprobs(tokenizer, listed) if asked and listed else None
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                     **extra})

    content = _sse_template({**base, "choices": [{"index": 0, "delta": {"content": "\0"}, "logprobs": None,
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
            yield _sse({**base, "choices": [], "usage": usage(gen.request)})
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
        return _sse({**base, "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
                     **extra})

    content = _sse_template({**base, "choices": [{"index": 0, "text": "\0", "logprobs": None, "finish_reason": None}],
                             **extra})
    try:
        if echoed:  # the prompt with its tokens' logprobs
            yield _sse({**base, "choices": [{"index": 0, "text": prefix, "finish_reason": None,
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
            yield _sse({**base, "choices": [], "usage": usage(gen.request)})
    except Exception as exc:  # noqa: BLE001
        yield _stream_error(exc)
    finally:
        gen.cancel_soon()
    yield "data: [DONE]\n\n"
