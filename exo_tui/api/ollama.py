"""Ollama's API on the same server and port as the OpenAI one, for the tools that speak it (Open
WebUI, editors' Ollama providers, the ``ollama`` Python and JavaScript clients).

``GET /api/version``, ``GET /api/tags`` (the usable models of the catalog), ``POST /api/show``,
``POST /api/chat`` and ``POST /api/generate`` (NDJSON streamed by default, one object with
``"stream": false``), ``GET /api/ps`` (the model the cluster serves). Model names are as Ollama
clients send them (``name:tag``; ``:latest`` when left out) and resolve through
:mod:`exo_tui.models.catalog`; only the model the cluster serves answers: another one of the
catalog is a 404 that says how to switch to it.

``options`` map to sampling: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
``num_predict``, ``stop``, ``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``,
``frequency_penalty``; exo-tui's own ``speculative`` (off, auto or k drafted tokens) and
``prediction`` (text the answer is expected to copy, drafted from: OpenAI's Predicted Outputs; the
last object counts ``draft_count``, ``draft_accepted_count`` and the prediction's accepted and
rejected tokens); Ollama's others (``num_ctx``, ``num_gpu``, ``mirostat``…) are ignored, as
Ollama ignores those it does not know. What a request leaves out takes the model's recommendation,
then OpenAI's defaults — as on ``/v1``, so one prompt gets one answer on either API. What exo-tui
cannot do (``format``, ``tools``, ``images``, ``think``, ``suffix``, ``template``) is a 400 that says
so, never ignored. Errors have Ollama's shape ``{"error": "message"}``, with its status codes.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field

from exo_tui.api.errors import RETRY_AFTER_S
from exo_tui.api.generation import (
    MAX_STOPS,
    OPENAI_SAMPLING,
    Generation,
    context_note,
    until_done_or_disconnect,
)
from exo_tui.api.model_names import model_ids
from exo_tui.api.prompts import PromptRefused, Prompts
from exo_tui.cluster.admission import wait_for_plan
from exo_tui.inference.generate import GenerationError
from exo_tui.inference.request import Request as GenRequest
from exo_tui.inference.sampling import with_defaults
from exo_tui.inference.speculation import parse_mode
from exo_tui.models import catalog
from exo_tui.models.sampling_params import COUNT_MAX

OLLAMA_VERSION = "0.9.0"  # the Ollama API this one follows (clients compare versions)
NDJSON = "application/x-ndjson"
# Ollama options that exo-tui takes (option -> SamplingParams field, type) ...
SAMPLING_OPTIONS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
    "min_p": ("min_p", float), "seed": ("seed", int), "repeat_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float), "frequency_penalty": ("frequency_penalty", float),
}
# ... and the request fields that ask for what it cannot do (field -> why)
UNSUPPORTED = {
    "format": "structured output (format) is not supported by exo-tui yet: leave format out and ask for JSON "
              "in the prompt",
    "tools": "tool calling is not supported by exo-tui yet: leave tools out",
    "images": "images are not supported: exo-tui runs text models",
    "think": "thinking is not supported by exo-tui yet: leave think out",
    "suffix": "suffix (fill-in-the-middle) is not supported by exo-tui yet: leave suffix out",
    "template": "a request's own template is not supported: the model's chat template is used (or send raw: true "
                "with the prompt already templated)",
}


class OllamaErrorBody(BaseModel):
    error: str = Field(description="what went wrong and what to do")


def _documented(*codes: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses of a route: 200 (NDJSON too when it streams) and Ollama's errors (401 is
    the app's, in OpenAI's shape)."""
    from exo_tui.api.schemas import ErrorResponse

    text = {400: "a bad body or option, or what exo-tui cannot do", 404: "an unknown model, or one not loaded",
            503: "the cluster cannot serve yet"}
    out: dict[int | str, dict[str, Any]] = {c: {"model": OllamaErrorBody, "description": text[c]} for c in codes}
    out[401] = {"model": ErrorResponse, "description": "missing or wrong API key"}
    if stream:
        out[200] = {"description": "one JSON object, or with stream (the default) one per line",
                    "content": {"application/json": {}, NDJSON: {"schema": {"type": "object"}}}}
    return out


class OllamaError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "2"} if self.status == 503 else None
        return JSONResponse({"error": self.message}, status_code=self.status, headers=headers)


class _OllamaRoute(APIRoute):
    """Errors in Ollama's shape for this router's routes, whatever the app's handlers do."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except OllamaError as exc:
                return exc.response()

        return route


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


# ---------------------------------------------------------------------- the catalog as Ollama lists it


def catalog_paths(coordinator: Any) -> list[str] | None:
    models = getattr(getattr(coordinator, "config", None), "models", None)
    return list(models.paths) if models is not None else None


async def scan(coordinator: Any) -> list[catalog.CatalogEntry]:
    return await asyncio.to_thread(catalog.scan, catalog_paths(coordinator))


def served_entry(coordinator: Any, entries: list[catalog.CatalogEntry]) -> catalog.CatalogEntry | None:
    """The catalog's entry of the file the cluster serves (a path outside the catalog: one made
    from the open model)."""
    model = coordinator.model
    if model is None:
        return None
    entry = catalog.entry_for_path(model.path, entries)
    name = model_ids(coordinator)[0]
    if entry is None:  # a path outside the stores: described once
        key = (str(model.path), name)
        if key not in _DESCRIBED:
            _DESCRIBED.clear()
            _DESCRIBED[key] = catalog.describe(catalog.Found(name, "path", Path(model.path), (Path(model.path),)))
        return _DESCRIBED[key]
    return entry if entry.name == name else replace(entry, name=name)


_DESCRIBED: dict[tuple[str, str], catalog.CatalogEntry] = {}


def listed(coordinator: Any, entries: list[catalog.CatalogEntry]) -> list[catalog.CatalogEntry]:
    """The models clients are offered: the one served first, then the catalog's other usable ones
    (a file found under several names, as Ollama's tags of one blob, under each)."""
    served = served_entry(coordinator, entries)
    out = [served] if served is not None else []
    out += [e for e in entries if e.usable and (served is None or e.name != served.name)]
    return out


def details(e: catalog.CatalogEntry) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": e.family, "families": [e.family] if e.family else None,
            "parameter_size": e.size_label, "quantization_level": e.quant}


def digest(e: catalog.CatalogEntry) -> str:
    if e.digest:
        return e.digest
    import hashlib

    return hashlib.sha256(f"{e.path}:{e.size_bytes}:{e.modified}".encode()).hexdigest()


def tag_of(e: catalog.CatalogEntry) -> dict[str, Any]:
    name = e.name if ":" in e.name.rsplit("/", 1)[-1] else f"{e.name}:latest"
    return {"name": name, "model": name, "modified_at": _iso(e.modified), "size": e.size_bytes,
            "digest": digest(e), "details": details(e)}


def openai_models(coordinator: Any, entries: list[catalog.CatalogEntry]) -> list[dict[str, Any]]:
    """``/v1/models``'s list: the served model first (under its OpenAI id), then the others."""
    out = []
    for i, e in enumerate(listed(coordinator, entries)):
        mid = model_ids(coordinator)[0] if i == 0 and coordinator.model is not None else e.name
        out.append({"id": mid, "object": "model", "created": int(e.modified), "owned_by": "exo-tui"})
    return out


# ---------------------------------------------------------------------- request bodies


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OllamaError(400, f"the body is not JSON ({exc}): send a JSON object") from exc
    if not isinstance(body, dict):
        raise OllamaError(400, "the body must be a JSON object")
    return body


def _model_name(body: dict[str, Any]) -> str:
    name = body.get("model") or body.get("name")  # "name": older clients'
    if not isinstance(name, str) or not name.strip():
        raise OllamaError(400, "model is required: send {\"model\": \"name:tag\"} (GET /api/tags lists them)")
    return name.strip()


def _refuse_unsupported(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    for name in fields:
        value = body.get(name)
        if value not in (None, "", [], False):
            raise OllamaError(400, UNSUPPORTED[name])


def sampling_options(options: Any, recommended: dict[str, Any]) -> tuple[Any, int | None, tuple[str, ...]]:
    """(SamplingParams, num_predict, stops) from a request's ``options``."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise OllamaError(400, "options must be a JSON object, e.g. {\"temperature\": 0}")
    given: dict[str, Any] = {}
    for key, (name, kind) in SAMPLING_OPTIONS.items():
        value = options.get(key)
        if value is None:
            continue
        try:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or \
                    (kind is int and value != int(value)):
                raise ValueError
            given[name] = kind(value)
        except (ValueError, OverflowError):  # NaN, infinities, integers past a float's range
            raise OllamaError(400, f"option {key} must be {'a whole number' if kind is int else 'a number'}, "
                                   f"not {value!r}") from None
    last_n = options.get("repeat_last_n")
    if last_n is not None:
        if isinstance(last_n, bool) or not isinstance(last_n, int) or not -1 <= last_n <= COUNT_MAX:
            raise OllamaError(400, f"option repeat_last_n must be -1 (the whole context), 0 (off) or more, up to "
                                   f"{COUNT_MAX}, not {last_n!r}")
        if last_n == 0:
            given.update(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        else:
            given["repetition_window"] = max(0, last_n)
    try:
        params = with_defaults(given, recommended, OPENAI_SAMPLING).with_seed()
    except ValueError as exc:
        raise OllamaError(400, f"invalid options: {exc}") from exc
    num_predict = options.get("num_predict")
    if num_predict is not None and (isinstance(num_predict, bool) or not isinstance(num_predict, int)
                                    or num_predict == 0 or num_predict < -2):
        raise OllamaError(400, f"option num_predict must be a positive whole number, or -1 / -2 for no limit, "
                               f"not {num_predict!r}")
    stop = options.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise OllamaError(400, "option stop must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise OllamaError(400, f"option stop takes at most {MAX_STOPS} strings, not {len(stops)}")
    return params, (num_predict if num_predict and num_predict > 0 else None), tuple(s for s in stops if s)


# ---------------------------------------------------------------------- the router


def ollama_router(coordinator: Any, prompts: Prompts | None = None) -> APIRouter:
    """The ``/api/*`` routes over ``coordinator`` (``prompts``: the app's, shared with its OpenAI routes)."""
    prompts = prompts if prompts is not None else Prompts(coordinator)
    router = APIRouter(prefix="/api", tags=["ollama"], route_class=_OllamaRoute)

    async def ready() -> None:
        """Wait (admission.plan_wait_s at most) for the model and a plan, as the OpenAI routes and
        the console do: a request sent while the server starts or switches models is served then."""
        try:
            await wait_for_plan(coordinator, coordinator.config.admission.plan_wait_s, RETRY_AFTER_S)
        except GenerationError as exc:  # NotReady too: waited long enough, or the model cannot be served
            raise OllamaError(503, str(exc)) from exc

    async def check_served(name: str) -> None:
        """Nothing when ``name`` names the model the cluster serves (once it is ready); else the 404
        or 503 that says why."""
        await ready()
        wanted = set(catalog.candidates(name))
        if wanted & {i.lower() for i in model_ids(coordinator)}:
            return
        found = catalog.find(name, await asyncio.to_thread(catalog.discover, catalog_paths(coordinator)))
        served = model_ids(coordinator)[0]
        if found is not None and _same_file(found.path, coordinator.model.path):
            return
        if found is not None:
            raise OllamaError(404, f"model '{name}' is on this machine but not loaded: this cluster serves "
                                   f"'{served}'; switch the cluster to it in the console (m) or with "
                                   f"POST /v1/cluster/model")
        raise OllamaError(404, f"model '{name}' not found: this cluster serves '{served}' (GET /api/tags "
                               "lists the models on this machine)")

    def new_request(prompt_ids: list[int], options: Any) -> GenRequest:
        params, num_predict, stops = sampling_options(options, dict(coordinator.model.sampling))
        context = coordinator.context_length
        if len(prompt_ids) >= context:
            raise OllamaError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context holds {context}: "
                                   f"shorten it{context_note(coordinator)}")
        room = context - len(prompt_ids)
        seeded = isinstance(options, dict) and options.get("seed") is not None
        return GenRequest(prompt_ids, params, min(num_predict or room, room), stops, seeded=seeded,
                          **speculation_options(options))

    def speculation_options(options: Any) -> dict[str, Any]:
        """exo-tui's options ``speculative`` (off, auto or k) and ``prediction`` (text the answer
        is expected to copy, as OpenAI's Predicted Outputs), as the Request takes them."""
        options = options if isinstance(options, dict) else {}
        out: dict[str, Any] = {}
        if options.get("speculative") is not None:
            try:
                out["speculative"] = parse_mode(options["speculative"])
            except ValueError as exc:
                raise OllamaError(400, f"option {exc}") from exc
        prediction = options.get("prediction")
        if prediction is not None:
            if not isinstance(prediction, str):
                raise OllamaError(400, "option prediction must be the text the answer is expected to copy")
            if prediction:
                out["predicted"] = coordinator.model.tokenizer.encode(prediction, add_special=False, parse_special=False)
        return out

    async def start(http: Request, request: GenRequest) -> Generation:
        await ready()  # at once, unless the plan changed since check_served
        gen = Generation(coordinator, request)
        try:
            await until_done_or_disconnect(http, gen, gen.first())
        except GenerationError as exc:
            await gen.cancel()
            raise OllamaError(503, str(exc)) from exc
        except BaseException:
            await gen.cancel()
            raise
        return gen

    def stats(request: GenRequest, began_s: float) -> dict[str, Any]:
        ttft = request.ttft_s
        rate = request.decode_tok_per_s
        eval_s = (len(request.generated) - 1) / rate if rate > 0 else 0.0
        spec = request.speculation.stats if request.speculation is not None else None
        drafts = {} if spec is None or not spec.drafted else {"draft_count": spec.drafted, "draft_accepted_count": spec.accepted,
                                          "accepted_prediction_count": spec.prediction_accepted,
                                          "rejected_prediction_count": spec.prediction_rejected}
        return {"total_duration": int((time.monotonic() - began_s) * 1e9), "load_duration": 0,
                "prompt_eval_count": len(request.prompt_ids), "prompt_eval_duration": int(ttft * 1e9),
                "eval_count": len(request.generated), "eval_duration": int(eval_s * 1e9), **drafts}

    async def answer(http: Request, body: dict[str, Any], name: str, prompt_ids: list[int], chat: bool,
                     began_s: float) -> Response:
        request = new_request(prompt_ids, body.get("options"))
        gen = await start(http, request)

        def piece(text: str) -> dict[str, Any]:
            if chat:
                return {"model": name, "created_at": now_iso(), "message": {"role": "assistant", "content": text},
                        "done": False}
            return {"model": name, "created_at": now_iso(), "response": text, "done": False}

        def last() -> dict[str, Any]:
            out = {**piece(""), "done": True, "done_reason": gen.finish_reason or "stop", **stats(request, began_s)}
            if not chat:
                out["context"] = request.tokens
            return out

        if body.get("stream", True) is False:
            pieces = []
            try:
                pieces = await until_done_or_disconnect(http, gen, _texts(gen))
            except GenerationError as exc:
                raise OllamaError(503, str(exc)) from exc
            whole = last()
            if chat:
                whole["message"]["content"] = "".join(pieces)
            else:
                whole["response"] = "".join(pieces)
            return JSONResponse(whole)

        async def stream() -> AsyncIterator[str]:
            try:
                while (c := await gen.next()) is not None:
                    if c.text:
                        yield json.dumps(piece(c.text)) + "\n"
                yield json.dumps(last()) + "\n"
            except Exception as exc:  # noqa: BLE001 - the stream has begun: the client reads it in the stream
                yield json.dumps({"error": str(exc) or type(exc).__name__}) + "\n"
            finally:
                gen.cancel_soon()

        return StreamingResponse(stream(), media_type=NDJSON)

    def loaded(name: str, chat: bool) -> JSONResponse:
        """What Ollama answers to a request with nothing to say: the model is loaded."""
        out: dict[str, Any] = {"model": name, "created_at": now_iso(), "done": True, "done_reason": "load"}
        out.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
        return JSONResponse(out)

    async def prompt_ids(messages: list[dict[str, str]] | None = None, text: str = "", add_special: bool = True,
                         room: int | None = None) -> list[int]:
        try:
            if messages is not None:
                return await prompts.chat(coordinator.model, messages)
            return await prompts.text(coordinator.model, text, add_special=add_special, room=room)
        except PromptRefused as exc:
            raise OllamaError(400, exc.message) from exc

    # ------------------------------------------------------------------ routes

    @router.get("/version", responses=_documented())
    async def version() -> dict[str, Any]:
        from exo_tui import __version__

        return {"version": OLLAMA_VERSION, "exo_tui": __version__}

    @router.get("/tags", responses=_documented())
    async def tags() -> dict[str, Any]:
        entries = await scan(coordinator)
        return {"models": [tag_of(e) for e in listed(coordinator, entries)]}

    @router.get("/ps", responses=_documented())
    async def ps() -> dict[str, Any]:
        if coordinator.model is None or getattr(coordinator, "ring", None) is None:
            return {"models": []}
        entries = await scan(coordinator)
        served = served_entry(coordinator, entries)
        assert served is not None
        tag = tag_of(served)
        return {"models": [{**tag, "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                            "context_length": coordinator.context_length}]}

    @router.post("/show", responses=_documented(400, 404))
    async def show(http: Request) -> dict[str, Any]:
        body = await _body(http)
        name = _model_name(body)
        entries = await scan(coordinator)
        found = catalog.find(name, await asyncio.to_thread(catalog.discover, catalog_paths(coordinator)))
        entry = next((e for e in entries if found is not None and e.name == found.name), None)
        if entry is None and coordinator.model is not None and \
                set(catalog.candidates(name)) & {i.lower() for i in model_ids(coordinator)}:
            entry = served_entry(coordinator, entries)
        if entry is None:
            raise OllamaError(404, f"model '{name}' not found (GET /api/tags lists the models on this machine)")
        if not entry.usable:
            raise OllamaError(404, f"model '{name}' cannot be used: {entry.reason}")
        fields = dict(entry.fields)
        template = str(fields.pop("tokenizer.chat_template", ""))
        sampling = _recommended(coordinator, entry)
        return {
            "modelfile": f"# exo-tui: {entry.name}\nFROM {entry.path}\n",
            "parameters": "\n".join(f"{k} {v}" for k, v in sampling.items()),
            "template": template,
            "license": str(fields.get("general.license", "")),
            "details": details(entry),
            "model_info": {**fields, "general.parameter_count": entry.parameters},
            "capabilities": ["completion"],
            "modified_at": _iso(entry.modified),
        }

    @router.post("/chat", responses=_documented(400, 404, 503, stream=True))
    async def chat(http: Request) -> Response:
        began = time.monotonic()
        body = await _body(http)
        name = _model_name(body)
        _refuse_unsupported(body, ("format", "tools", "think"))
        messages = body.get("messages") or []
        if not isinstance(messages, list):
            raise OllamaError(400, "messages must be a list of {\"role\", \"content\"} objects")
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise OllamaError(400, f"messages[{i}] must have role system, user or assistant (tool messages are "
                                       "not supported) and a content string")
            if m.get("images"):
                raise OllamaError(400, UNSUPPORTED["images"])
            content = m.get("content", "")
            if not isinstance(content, str):
                raise OllamaError(400, f"messages[{i}].content must be a string")
            turns.append({"role": m["role"], "content": content})
        await check_served(name)
        if not turns:
            return loaded(name, chat=True)
        return await answer(http, body, name, await prompt_ids(turns), True, began)

    @router.post("/generate", responses=_documented(400, 404, 503, stream=True))
    async def generate(http: Request) -> Response:
        began = time.monotonic()
        body = await _body(http)
        name = _model_name(body)
        _refuse_unsupported(body, ("format", "images", "think", "suffix", "template"))
        prompt, system = body.get("prompt") or "", body.get("system") or ""
        context = body.get("context") or []
        if not isinstance(prompt, str) or not isinstance(system, str):
            raise OllamaError(400, "prompt and system must be strings")
        if not isinstance(context, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in context):
            raise OllamaError(400, "context must be the list of token ids a previous answer returned")
        await check_served(name)
        if not prompt:
            return loaded(name, chat=False)
        tokenizer = coordinator.model.tokenizer
        if bad := [t for t in context if not 0 <= t < tokenizer.vocab_size]:
            raise OllamaError(400, f"context holds token ids outside this model's vocabulary: {bad[:5]}")
        if body.get("raw"):
            ids = await prompt_ids(text=prompt, add_special=not context, room=max(1, coordinator.context_length - len(context)))
        else:
            turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            ids = await prompt_ids(turns)
        return await answer(http, body, name, [*context, *ids], False, began)

    return router


def _recommended(coordinator: Any, entry: catalog.CatalogEntry) -> dict[str, Any]:
    model = coordinator.model
    if model is not None and _same_file(Path(model.path), entry.path):
        return dict(model.sampling)
    return {}


async def _texts(gen: Generation) -> list[str]:
    pieces: list[str] = []
    while (c := await gen.next()) is not None:
        pieces.append(c.text)
    return pieces


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and a.samefile(b)
    except OSError:
        return False
