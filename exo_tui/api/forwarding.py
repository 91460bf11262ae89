"""The API on every coordinator of a set: the leader serves it, a standby forwards it.

:class:`CoordinatorSetApi` is the ASGI app ``exo-tui serve --coordinators ...`` runs (behind
:class:`~exo_tui.api.guard.ApiGuard`, so the key and body limits hold on every coordinator):

- ``GET /health``: answered by each coordinator itself: ``role`` (``leader`` or ``standby``), the
  leader's API URL (``leader_api``), the term and every coordinator's role, term and lag.
- On the leader in charge, every other route is its coordinator's app (:func:`~exo_tui.api.app.create_app`).
  A change (any POST, PUT, PATCH or DELETE but a generation) is answered only once a majority of
  the coordinators holds what it wrote (:meth:`~exo_tui.cluster.replicated_state.ReplicatedStore.settled`);
  a leader without a majority refuses changes with one sentence (503).
- On a standby, ``/v1/chat/completions`` and ``/v1/completions`` run here over
  :class:`RemoteCluster`: the generation itself runs on the leader (``POST /exo/v1/resume``, a
  stream of chunks with their token ids), and this coordinator keeps the answer's token history.
  When the leader dies mid-answer, the request is sent again from that history to the new
  leader, whose generation goes on from it (same seed, same positions: same tokens), so the
  client's text goes on as if nothing happened. Every other route is forwarded to the leader as
  it is (``/v1/cluster/events`` and Ollama's streams too: those end with the leader).
- A stream through the leader itself ends when the leader dies: the client sees the connection
  close (docs/coordinators.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

import httpx
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse, StreamingResponse

from exo_tui import events as ev
from exo_tui.api.app import create_app
from exo_tui.api.guard import DEFAULT_MAX_BODY_BYTES, ApiGuard
from exo_tui.api.resume_body import ResumeBody
from exo_tui.cluster.replicated_state import NotAcknowledged
from exo_tui.inference.generate import Chunk, GenerationError
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import TokenLogprobs

if TYPE_CHECKING:
    from exo_tui.cluster.view import ServingCluster

log = logging.getLogger("exo_tui.api.forwarding")

RESUME_PATH = "/exo/v1/resume"
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
READS = ("GET", "HEAD", "OPTIONS")
ACK_TIMEOUT_S = 3.0
FAILOVER_WAIT_S = 30.0  # how long a stream through a standby waits for a new leader
HOP_HEADERS = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade",
               b"proxy-authorization", b"proxy-connection", b"content-length"}


async def _json(send: Any, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    response = JSONResponse(body, status_code=status, headers=headers)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


def _error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


# ---------------------------------------------------------------------- the leader's side of a resume


async def _resume(scope: Any, receive: Any, send: Any, coordinator: Any) -> None:
    """``POST /exo/v1/resume``: generate from a standby's request and answer so far, as NDJSON
    lines (``text``, ``ids``: the tokens whose text it is, ``lp``, ``finish``; the last line has
    ``generated``: every token of the answer)."""
    http = StarletteRequest(scope, receive)
    try:
        body = ResumeBody.model_validate_json(await http.body())
    except ValueError as exc:  # pydantic's ValidationError is one
        await _json(send, 400, _error(f"a resume body was refused (is the standby's exo-tui another version?): {exc}",
                                      "invalid_request"))
        return
    request, left = body.request(), body.left
    ring = getattr(coordinator, "ring", None)
    if left and request.generated and ring is not None:
        # The caches the dead leader's steps left on the nodes hold the prompt and the answer but
        # its last token (not yet run): the resumed request takes them over.
        coordinator.pipeline.keep_left(left, request.tokens[:-1], len(request.prompt_ids), ring)

    async def lines() -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(coordinator.generate(request)) as chunks:
                async for c in chunks:
                    line: dict[str, Any] = {"text": c.text, "ids": list(c.token_ids)}
                    if c.logprobs:
                        line["lp"] = [[at, lp.to_wire()] for at, lp in c.logprobs]
                    if c.finish_reason:
                        line["finish"] = c.finish_reason
                        line["generated"] = list(request.generated)
                        line["cached"] = request.cached_tokens
                    yield json.dumps(line) + "\n"
        except GenerationError as exc:
            yield json.dumps({"error": str(exc)}) + "\n"

    await StreamingResponse(lines(), media_type="application/x-ndjson")(scope, receive, send)


# ---------------------------------------------------------------------- a standby's generation


class RemoteCluster:
    """What a standby's generation routes see of the cluster: the model this process opened, and
    a ``generate`` that runs on the leader and survives the leader's death (see the module doc)."""

    readonly = False
    admission = None
    ring = True  # the routes' readiness checks: the leader's own answers whether it can serve

    def __init__(self, cset: Any, model: Any, model_name: str | None, config: Any, context_length: int,
                 api_key: str | None) -> None:
        self.cset = cset
        self.model = model
        self.model_name = model_name
        self.config = config
        self.context_length = context_length
        self.pins: dict[str, Any] = {}
        self.events = ev.EventBus()
        self._serve_error = ""
        self._plan_ready = asyncio.Event()
        self._plan_ready.set()
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.failovers = 0  # streams re-issued to a new leader (benchmarks read it)

    def serve_error(self) -> str:
        return ""

    def node_name(self, node_id: str) -> str:
        return node_id

    async def _leader_api(self, deadline: float) -> str:
        while True:
            url = self.cset.leader_api()
            if url:
                return str(url)
            if time.monotonic() > deadline:
                raise GenerationError(f"no coordinator has led for {FAILOVER_WAIT_S:.0f} s: {self.cset.minority_sentence()}")
            await asyncio.sleep(0.05)

    async def generate(self, request: Request, on_queued: Any = None) -> AsyncIterator[Chunk]:
        history: list[int] = []  # the tokens whose text the client has
        failed_at: float | None = None
        incarnation, left, lost = request.id, "", 0  # the id the leader runs it under; the one a dead leader ran
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None)) as client:
            while True:
                url = await self._leader_api(time.monotonic() + FAILOVER_WAIT_S)
                try:
                    async with client.stream("POST", url + RESUME_PATH, headers=self._headers,
                                             json=ResumeBody.of(request, id=incarnation, left=left,
                                                                  generated=history).model_dump()) as resp:
                        if resp.status_code != 200:
                            text = (await resp.aread()).decode(errors="replace")
                            if resp.status_code in (502, 503) and (failed_at is None or time.monotonic() - failed_at < FAILOVER_WAIT_S):
                                failed_at = failed_at or time.monotonic()
                                await asyncio.sleep(0.1)  # a leader still taking charge
                                continue
                            raise GenerationError(_message(text) or f"the leader answered {resp.status_code}")
                        if failed_at is not None and left:
                            self.failovers += 1
                            log.info("stream %s re-issued to %s after %d tokens (%.2f s after the leader was lost)",
                                     request.id, url, len(history), time.monotonic() - failed_at)
                        failed_at = None
                        async for line in resp.aiter_lines():
                            if not line:
                                continue
                            d = json.loads(line)
                            if "error" in d:
                                raise GenerationError(str(d["error"]))
                            ids = [int(t) for t in d.get("ids", ())]
                            history.extend(ids)
                            request.generated = [int(t) for t in d["generated"]] if "generated" in d else list(history)
                            # the prompt's tokens whose caches were taken over (a resumed stream's, from the dead leader's)
                            request.cached_tokens = min(len(request.prompt_ids), max(request.cached_tokens, int(d.get("cached", 0))))
                            if request.first_token_s is None and ids:
                                request.first_token_s = time.monotonic()
                            listed = tuple((int(at), TokenLogprobs.from_wire(lp)) for at, lp in d.get("lp", ()))
                            yield Chunk(text=d.get("text", ""), token_id=ids[-1] if ids else None, held=tuple(ids[:-1]),
                                        logprobs=listed, finish_reason=d.get("finish"))
                            if d.get("finish"):
                                request.finish_reason = d["finish"]
                                request.finished_s = time.monotonic()
                                return
                except (httpx.TransportError, httpx.RemoteProtocolError) as exc:
                    if failed_at is None:
                        log.warning("the leader at %s was lost mid-stream (%s): waiting for the next one", url, exc)
                if failed_at is None:
                    failed_at = time.monotonic()
                    lost += 1
                    left, incarnation = incarnation, f"{request.id}-r{lost}"
                await asyncio.sleep(0.05)


def _message(text: str) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(json.loads(text)["error"]["message"])
    return text[:500]


# ---------------------------------------------------------------------- the front door


class CoordinatorSetApi:
    """The ASGI app of one coordinator of a set (see the module doc)."""

    def __init__(self, cset: Any, remote: RemoteCluster, *, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.cset = cset
        self.remote = remote
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        # The standby's app serves only the generation routes (GENERATION_PATHS): of a ServingCluster
        # they need what RemoteCluster has; every other route is forwarded before it reaches the app.
        self.standby_app = create_app(cast("ServingCluster", remote), api_key=api_key, max_body_bytes=max_body_bytes)
        self.leader_app: Any = None
        self.coordinator: Any = None
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None))
        self.state = self.standby_app.state  # ApiServer sets state.closing as it stops
        self.guarded = ApiGuard(self, api_key=api_key, max_body_bytes=max_body_bytes)
        self.guarded.state = self.state

    async def set_leader(self, coordinator: Any) -> None:
        """The coordinator this process runs as leader (None: it stands by)."""
        old, self.coordinator = self.leader_app, coordinator
        self.leader_app = None if coordinator is None else \
            create_app(coordinator, api_key=self.api_key, max_body_bytes=self.max_body_bytes)
        if old is not None:
            old.state.closing.set()  # a deposed leader's event streams end

    def health(self) -> dict[str, Any]:
        c = self.coordinator if self.cset.is_leader else None
        st = self.cset.state
        why = getattr(c, "_serve_error", "") if c is not None else ""
        return {
            "status": "ok", "role": self.cset.role, "leader_api": self.cset.leader_api(), "term": self.cset.term,
            "coordinator": self.cset.address, "in_charge": c is not None and self.leader_app is not None,
            "ready": c is not None and not why and getattr(c, "ring", None) is not None,
            "error": why or None, "commit": self.cset.commit_index(),
            "coordinators": [s.to_dict() for s in self.cset.status()],
            # this coordinator's copy of the replicated state (a standby's may lag: see its lag)
            "drains": sorted(st.drains), "pins": {n: list(p) for n, p in st.pins.items()}, "hosts": sorted(st.hosts),
            "join_tokens": sorted(st.join_tokens),  # the ids of the join tokens' records (hashes stay inside)
            "plan_version": st.plan[0] if st.plan else None, "elections": [list(e) for e in st.elections[-10:]],
        }

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method in READS:
            await _json(send, 200, self.health())
            return
        leader_app = self.leader_app
        if leader_app is not None and self.cset.is_leader:
            if path == RESUME_PATH and method == "POST":
                await _resume(scope, receive, send, self.coordinator)
                return
            if method in READS or path in GENERATION_PATHS:
                await leader_app(scope, receive, send)
                return
            if not self.cset.has_quorum:
                await _json(send, 503, _error(self.cset.minority_sentence(), "no_majority"), {"Retry-After": "2"})
                return
            await leader_app(scope, receive, self._acknowledged(send))
            return
        if path in GENERATION_PATHS and method == "POST":
            await self.standby_app(scope, receive, send)
            return
        leader = self.cset.leader_api()
        if leader == self.cset.api_url:
            await _json(send, 503, _error("this coordinator was elected leader and is taking charge (connecting to the "
                                          "nodes): try again in a moment", "taking_charge"), {"Retry-After": "1"})
            return
        if leader is None:
            await _json(send, 503, _error(
                f"no coordinator leads now ({self.cset.minority_sentence() if not self.cset.has_quorum else 'an election is under way'}): "
                "try again in a few seconds", "no_leader"), {"Retry-After": "2"})
            return
        await self._forward(scope, receive, send, leader)

    def _acknowledged(self, send: Any) -> Any:
        """``send`` that holds a change's answer until a majority has what it wrote (else a 503)."""
        refused = False

        async def wrapped(message: dict[str, Any]) -> None:
            nonlocal refused
            if message["type"] == "http.response.start":
                store = getattr(self.coordinator, "store", None)
                try:
                    if store is not None:
                        await store.settled(ACK_TIMEOUT_S)
                except NotAcknowledged as exc:
                    refused = True
                    await _json(send, 503, _error(str(exc), "not_acknowledged"), {"Retry-After": "2"})
                    return
            if not refused:
                await send(message)
        return wrapped

    async def _forward(self, scope: Any, receive: Any, send: Any, leader: str) -> None:
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_HEADERS]
        url = leader + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        try:
            resp = await self._client.send(self._client.build_request(scope["method"], url, headers=headers,
                                                                      content=bytes(body)), stream=True)
        except httpx.TransportError as exc:
            await _json(send, 503, _error(f"the leader at {leader} cannot be reached ({exc}): an election follows; "
                                          "try again in a few seconds", "no_leader"), {"Retry-After": "2"})
            return
        try:
            out = [(k, v) for k, v in resp.headers.raw if k.lower() not in HOP_HEADERS]
            await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
            with contextlib.suppress(httpx.TransportError):  # the leader died mid-answer: the client sees it end
                async for chunk in resp.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await resp.aclose()

    async def aclose(self) -> None:
        if self.leader_app is not None:
            self.leader_app.state.closing.set()
        await self._client.aclose()
