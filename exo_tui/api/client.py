"""A running coordinator over HTTP: the :class:`~exo_tui.cluster.view.ClusterControl` of
``exo-tui --attach URL``, and the plumbing of the operator commands (``exo-tui status`` ...).

:class:`ClusterClient` keeps a local :class:`~exo_tui.events.EventBus` fed from
``GET /v1/cluster/events`` and a snapshot refreshed from ``GET /v1/cluster`` (every second, and
soon after each event), so ``snapshot()`` stays a cheap, synchronous call as the protocol wants.
Previews are the action endpoints with ``dry_run``; ``apply`` calls them for real; ``chat``
streams ``/v1/chat/completions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from exo_tui.api.convert import event_from_dict, preview_from_dict, snapshot_from_dict
from exo_tui.cluster.view import (
    Action,
    ChatChunk,
    ChatParams,
    ClusterSnapshot,
    Command,
    HostKeyUnknown,
    ModelChoice,
    PlanPreview,
)
from exo_tui.events import EventBus, Notice

log = logging.getLogger("exo_tui.api.client")

DEFAULT_URL = "http://127.0.0.1:52415"
SNAPSHOT_INTERVAL_S = 1.0
EVENTS_QUERY = {"replay": "true", "exclude": "token"}  # the recent story first; no streamed tokens


class ApiClientError(RuntimeError):
    """The coordinator refused a call or could not be reached; the message says what to do."""

    def __init__(self, message: str, status: int = 0, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def _base(url: str) -> str:
    url = url.rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url[: -len("/v1")] if url.endswith("/v1") else url


def not_running(url: str) -> str:
    return f"no coordinator at {url}: start one with `exo-tui serve` (or pass --url)"


def raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        err = response.json()["error"]
        message, code, param = err.get("message") or response.reason_phrase, err.get("code"), err.get("param")
    except (ValueError, KeyError, TypeError):
        message, code, param = response.text[:300] or response.reason_phrase, None, None
    raise ApiClientError(message, response.status_code, code, param)


class ClusterClient:
    """``ClusterControl`` over a coordinator's HTTP API.

    ``ClusterClient(url, api_key=None)``; ``await start()`` connects (raises
    :class:`ApiClientError` with what to do when nothing answers) and starts following events;
    ``await stop()`` ends that. The API key defaults to the config's ``network.api.key`` /
    ``EXO_TUI_API_KEY``.
    """

    def __init__(self, url: str = DEFAULT_URL, *, api_key: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = _base(url)
        if api_key is None:
            api_key = _configured_key()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.events = EventBus()
        self.readonly = False
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=5.0))
        self._snapshot = ClusterSnapshot(name="", model="")
        self._tasks: list[asyncio.Task[Any]] = []
        self._refresh = asyncio.Event()
        self._model_id = ""
        self.coordinator_apis: list[str] = []  # the API URLs of a coordinator set's members (from /health)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.refresh()
        self._tasks = [
            asyncio.create_task(self._follow_events(), name="attach-events"),
            asyncio.create_task(self._poll_snapshot(), name="attach-snapshot"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        await self._http.aclose()

    async def __aenter__(self) -> ClusterClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ HTTP

    async def request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = await self._http.request(method, path, **kw)
        except httpx.ConnectError as exc:
            raise ApiClientError(not_running(self.url), code="no_coordinator") from exc
        except httpx.TimeoutException as exc:
            raise ApiClientError(f"the coordinator at {self.url} did not answer in time ({exc!r}): is it overloaded?") from exc
        except httpx.HTTPError as exc:  # it closed or reset the connection: out of connections, or stopping
            raise ApiClientError(f"the coordinator at {self.url} closed the connection without an answer "
                                 f"({type(exc).__name__}: {exc or 'no reason given'}): it may be overloaded or "
                                 "stopping; see its log") from exc
        raise_for_error(response)
        try:
            return response.json()
        except ValueError as exc:
            raise ApiClientError(f"the coordinator at {self.url} answered {response.status_code} with something "
                                 f"that is not JSON: {response.text[:120]!r}") from exc

    async def refresh(self) -> ClusterSnapshot:
        data = await self.request("GET", "/v1/cluster")
        self._snapshot = snapshot_from_dict(data)
        self.readonly = self._snapshot.readonly
        return self._snapshot

    async def _poll_snapshot(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SNAPSHOT_INTERVAL_S):
                    await self._refresh.wait()
            self._refresh.clear()
            try:
                await self.refresh()
            except ApiClientError as exc:
                log.debug("snapshot refresh failed: %s", exc)

    async def _follow_events(self) -> None:
        """Relay the coordinator's events into the local bus; reconnect when the stream breaks.

        The stream starts with the coordinator's recent events (``replay``), so an attached
        console shows what happened before it came, as an embedded one does; after a reconnect,
        those it has already seen are skipped. Streamed tokens are not sent (a chat has them from
        its own stream): every token of every answer would cross the network to be dropped."""
        warned = False
        last_ts = float("-inf")
        while True:
            try:
                async with self._http.stream("GET", "/v1/cluster/events", params=EVENTS_QUERY,
                                             timeout=httpx.Timeout(None, connect=5.0)) as r:
                    raise_for_error(r)
                    warned = False
                    await self._learn_coordinators()
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        event = event_from_dict(json.loads(line[5:]))
                        if event is not None and event.ts > last_ts:
                            last_ts = event.ts
                            self.events.publish(event)
                            if event.kind not in ("token", "node_metrics"):
                                self._refresh.set()
            except (httpx.HTTPError, ApiClientError, ValueError) as exc:
                if not warned:
                    self.events.publish(Notice(level="error", message=f"lost the coordinator's event stream ({exc}): reconnecting"))
                    warned = True
                if isinstance(exc, httpx.ConnectError):
                    await self._follow_set()
            await asyncio.sleep(1.0)

    async def _learn_coordinators(self) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            health = (await self._http.get("/health", timeout=5.0)).json()
            self.coordinator_apis = [c["api"] for c in health.get("coordinators") or () if c.get("api")]

    async def _follow_set(self) -> None:
        """The coordinator attached to is gone: attach to another of its set that answers (a
        standby forwards to the leader, whichever it is)."""
        for api in self.coordinator_apis:
            if _base(api) == self.url:
                continue
            with contextlib.suppress(httpx.HTTPError):
                (await self._http.get(f"{_base(api)}/health", timeout=3.0)).raise_for_status()
                self.events.publish(Notice(level="warning", message=f"the coordinator at {self.url} is gone: "
                                                                    f"following its set at {_base(api)}"))
                self.url = _base(api)
                self._http.base_url = httpx.URL(self.url)
                return

    # ------------------------------------------------------------------ ClusterControl

    def snapshot(self) -> ClusterSnapshot:
        return self._snapshot

    async def preview(self, command: Command) -> PlanPreview:
        return await self._act(command, dry_run=True)

    async def apply(self, preview: PlanPreview) -> PlanPreview:
        result = await self._act(preview.command, dry_run=False)
        self._refresh.set()
        return result

    async def _act(self, command: Command, *, dry_run: bool) -> PlanPreview:
        try:
            data = await self.action(command, dry_run=dry_run)
        except ApiClientError as exc:
            return PlanPreview(command.action, command.targets, error=str(exc), layers=command.layers)
        return preview_from_dict(data)

    async def action(self, command: Command, *, dry_run: bool = False) -> dict[str, Any]:
        """One plan change as the API answers it (raises :class:`ApiClientError`)."""
        action, targets, layers = command.action, command.targets, command.layers
        body: dict[str, Any] = {"dry_run": dry_run}
        match action:
            case Action.MODEL:
                name = command.model
                preview: dict[str, Any] = await self.request("POST", "/v1/cluster/models/preview", json={"model": name},
                                                             timeout=120)
                if not dry_run and not preview.get("error"):
                    await self.set_model(name)
                return preview
            case Action.DRAIN | Action.UNDRAIN | Action.REMOVE:
                results = [await self.request("POST", f"/v1/cluster/nodes/{_q(t)}/{action}", json=body) for t in targets]
            case Action.PIN:
                results = []
                for t in targets:
                    pin = {"node": t, **body}
                    if layers is not None:
                        pin["start"], pin["end"] = layers
                    results.append(await self.request("POST", "/v1/cluster/pins", json=pin))
            case Action.UNPIN:
                results = [await self.request("DELETE", f"/v1/cluster/pins/{_q(t)}",
                                              params={"dry_run": str(dry_run).lower()}) for t in targets]
            case Action.REBALANCE:
                rebalanced: dict[str, Any] = await self.request("POST", "/v1/cluster/rebalance", json=body)
                return rebalanced
        return _merge(action, results)

    async def chat(self, messages: list[dict[str, str]], params: ChatParams) -> AsyncGenerator[ChatChunk, None]:
        body: dict[str, Any] = {
            "model": self._model_id, "messages": messages, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": params.max_tokens,
        }
        if not body["model"]:
            try:
                models = (await self.request("GET", "/v1/models"))["data"]
                if not models:
                    raise ApiClientError(f"the coordinator at {self.url} has no model loaded yet: try again in a moment")
            except ApiClientError as exc:
                yield ChatChunk(finish_reason="error", error=str(exc))
                return
            body["model"] = self._model_id = models[0]["id"]
        for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
            if getattr(params, name) is not None:  # left out: the coordinator uses the model's
                body[name] = getattr(params, name)
        if params.stop:
            body["stop"] = list(params.stop)
        if params.speculative is not None:
            body["speculative"] = params.speculative
        if params.prediction:
            body["prediction"] = {"type": "content", "content": params.prediction}
        started = time.monotonic()
        first: float | None = None
        finish, error = None, ""
        usage: dict[str, Any] = {}
        drafts: dict[str, Any] = {}  # the extension "speculation", with the usage
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=body,
                                         timeout=httpx.Timeout(None, connect=5.0)) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise_for_error(r)
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    data = json.loads(payload)
                    if "error" in data:
                        finish, error = "error", data["error"].get("message", "error")
                        continue
                    usage = data.get("usage") or usage
                    drafts = data.get("speculation") or drafts
                    for choice in data.get("choices", ()):
                        text = choice.get("delta", {}).get("content") or ""
                        if text:
                            first = first or time.monotonic()
                            yield ChatChunk(text=text)
                        finish = choice.get("finish_reason") or finish
        except httpx.ConnectError as exc:
            finish, error = "error", not_running(self.url)
            log.debug("chat: %s", exc)
        except ApiClientError as exc:
            finish, error = "error", str(exc)
        except (httpx.HTTPError, ValueError) as exc:
            finish, error = "error", f"the stream from {self.url} broke: {exc}"
        end = time.monotonic()
        completion = int(usage.get("completion_tokens", 0))
        decode_s = end - first if first else 0.0
        yield ChatChunk(
            finish_reason=finish or "stop", prompt_tokens=int(usage.get("prompt_tokens", 0)), completion_tokens=completion,
            drafted_tokens=int(drafts.get("drafted_tokens", 0)), accepted_tokens=int(drafts.get("accepted_tokens", 0)),
            ttft_s=(first - started) if first else 0.0,
            tok_per_s=(completion - 1) / decode_s if completion > 1 and decode_s > 0 else 0.0,
            nodes=tuple(n.name for n in self._snapshot.nodes if n.layers), error=error,
        )

    async def bootstrap(self, host: str, *, accept_new_host_key: bool = False) -> None:
        try:
            await self.request("POST", f"/v1/cluster/hosts/{_q(host)}/bootstrap",
                               json={"accept_new_host_key": accept_new_host_key}, timeout=600)
        except ApiClientError as exc:
            if exc.code == "host_key_unknown":
                raise HostKeyUnknown(host, exc.param or "") from exc
            raise
        self._refresh.set()

    async def add_host(self, host: str) -> None:
        await self.request("POST", "/v1/cluster/hosts", json={"host": host})
        self._refresh.set()

    async def set_model(self, name_or_path: str) -> None:
        await self.request("POST", "/v1/cluster/model", json={"model": name_or_path}, timeout=600)
        self._refresh.set()

    async def models(self) -> list[ModelChoice]:
        data = await self.request("GET", "/v1/cluster/models", timeout=120)
        return [ModelChoice(**{k: v for k, v in d.items() if k in _CHOICE_FIELDS}) for d in data]


_CHOICE_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelChoice))


def _q(part: str) -> str:
    from urllib.parse import quote

    return quote(part, safe="")


def _merge(action: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several targets, one after the other: the last plan, all the moves."""
    if not results:
        return {"action": action, "targets": []}
    if len(results) == 1:
        return results[0]
    last = dict(results[-1])
    last["targets"] = [t for r in results for t in r.get("targets", [])]
    last["moves"] = [m for r in results for m in r.get("moves", [])]
    last["bytes_moved"] = sum(int(r.get("bytes_moved") or 0) for r in results)
    last["tok_per_s_before"] = results[0].get("tok_per_s_before", 0.0)
    return last


def _configured_key() -> str | None:
    from exo_tui.config import ConfigError, load_config

    try:
        return load_config().network.api.key
    except (ConfigError, OSError):
        import os

        return os.environ.get("EXO_TUI_API_KEY") or None


__all__ = ["ApiClientError", "ClusterClient", "DEFAULT_URL", "not_running", "raise_for_error"]
