"""The cluster's endpoints, for operators and the console's ``--attach``: ``/health``, the
snapshot (``GET /v1/cluster``), its event stream (``GET /v1/cluster/events``) and the actions
(drain, undrain, remove, pin, unpin, rebalance, add and bootstrap hosts, load a model), each
one :class:`~exo_tui.cluster.view.Command` run as the console runs it. An action with
``dry_run`` answers what it would do (a PlanPreview) and changes nothing; a read-only coordinator
refuses the changes (403). The models on the machine are :mod:`exo_tui.api.model_routes`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from exo_tui.api import schemas as s
from exo_tui.api.convert import EVENT_KINDS, event_to_dict, snapshot_to_dict, to_jsonable
from exo_tui.api.errors import ApiError, documented_errors
from exo_tui.api.model_names import model_ids
from exo_tui.api.sse import SSE_200, SSE_HEADERS
from exo_tui.cluster.proposal import NodeNotFound, resolve_node
from exo_tui.cluster.view import Action, Command, HostKeyUnknown, ServingCluster, run_command
from exo_tui.inference.generate import GenerationError

KEEPALIVE_S = 15.0


def cluster_router(coordinator: ServingCluster, closing: asyncio.Event) -> APIRouter:
    """The routes over ``coordinator``; ``closing`` (set as the server stops) ends event streams."""
    router = APIRouter()

    @router.get("/health", tags=["cluster"], responses=documented_errors(401))
    async def health() -> dict[str, Any]:
        why = getattr(coordinator, "_serve_error", "")
        ready = not why and getattr(coordinator, "ring", None) is not None
        return {"status": "ok", "ready": ready, "error": why or None, "model": model_ids(coordinator)[0]}

    @router.get("/v1/cluster", tags=["cluster"], responses=documented_errors(401),
                description="nodes (profiles, scores, live metrics), links, the plan and its predictions")
    async def cluster() -> s.JsonObject:
        return snapshot_to_dict(coordinator.snapshot())

    @router.get("/v1/cluster/events", tags=["cluster"], responses={200: SSE_200, **documented_errors(401)},
                description="server-sent events: one JSON event per `data:` line (see exo_tui/events.py); "
                            "`replay`: the recent events first; `exclude`: event types not to send, comma-separated "
                            "(e.g. `token,node_metrics`)")
    async def cluster_events(replay: bool = False, exclude: str = "") -> StreamingResponse:
        skipped = {k.strip() for k in exclude.split(",") if k.strip()}
        if unknown := skipped - EVENT_KINDS:
            raise ApiError(422, f"exclude: unknown event type(s) {', '.join(sorted(unknown))}; the types are "
                                f"{', '.join(sorted(EVENT_KINDS))}", param="exclude")
        sub = coordinator.events.subscribe(replay=replay)

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

    def resolve(node: str, *, pinned: bool = False) -> str:
        """The id of the node ``node`` names (404 if none, or several, has that name)."""
        nodes = ((n.node_id, n.name) for n in coordinator.snapshot().nodes)
        try:
            return resolve_node(node, nodes, pinned=coordinator.pins if pinned else ())
        except NodeNotFound as exc:
            raise ApiError(404, str(exc), param="node", code="node_not_found") from exc

    def command(action: Action, node: str | None = None, layers: tuple[int, int] | None = None) -> Command:
        """The command the request asks for (422 where it cannot be one, e.g. layers [5, 5))."""
        try:
            asked = Command(action, (node,) if node is not None else (), layers)
        except ValueError as exc:
            raise ApiError(422, str(exc), param="end" if layers else None, code="invalid_layers" if layers else None) from exc
        return replace(asked, targets=tuple(resolve(t, pinned=action is Action.UNPIN) for t in asked.targets))

    async def act(command: Command, dry_run: bool) -> dict[str, Any]:
        preview = await run_command(coordinator, command, dry_run=dry_run)
        if preview.error:
            if coordinator.readonly and not dry_run:
                raise ApiError(403, preview.error, code="readonly")
            raise ApiError(409, preview.error, code="change_impossible")
        done: dict[str, Any] = to_jsonable(preview)
        return done

    action_doc = "what the change does (a PlanPreview: moves, bytes, tok/s before and after, the new plan)"

    for action in (Action.DRAIN, Action.UNDRAIN, Action.REMOVE):
        def make(action: Action = action) -> Callable[[str, s.ActionRequest | None], Awaitable[s.JsonObject]]:
            async def endpoint(node: str, body: s.ActionRequest | None = None) -> s.JsonObject:
                return await act(command(action, node), bool(body and body.dry_run))

            endpoint.__name__ = f"{action}_node"
            return endpoint

        router.post(f"/v1/cluster/nodes/{{node}}/{action}", tags=["cluster"], description=f"{action} a node: {action_doc}",
                    responses=documented_errors(401, 403, 404, 409, 422))(make())

    @router.post("/v1/cluster/pins", tags=["cluster"], responses=documented_errors(401, 403, 404, 409, 422),
                 description="pin a node to layers [start, end) (moving them there if it holds others), or without "
                             "start/end to the layers it holds now; rebalances keep pinned layers where they are")
    async def pin(body: s.PinRequest) -> s.JsonObject:
        if (body.start is None) != (body.end is None):
            raise ApiError(422, "give both start and end (layers [start, end)), or neither to pin the node's "
                                "current layers", param="start" if body.start is None else "end", code="invalid_layers")
        layers = (body.start, body.end) if body.start is not None and body.end is not None else None
        return await act(command(Action.PIN, body.node, layers), body.dry_run)

    @router.delete("/v1/cluster/pins/{node}", tags=["cluster"], responses=documented_errors(401, 403, 404, 409, 422),
                   description="unpin a node")
    async def unpin(node: str, dry_run: bool = False) -> s.JsonObject:
        return await act(command(Action.UNPIN, node), dry_run)

    @router.post("/v1/cluster/rebalance", tags=["cluster"], responses=documented_errors(401, 403, 409, 422),
                 description=f"make the best plan for the cluster as it is; {action_doc}")
    async def rebalance(body: s.ActionRequest | None = None) -> s.JsonObject:
        return await act(command(Action.REBALANCE), bool(body and body.dry_run))

    @router.post("/v1/cluster/hosts", tags=["cluster"], responses=documented_errors(401, 422), description="add a host by address")
    async def add_host(body: s.HostRequest) -> s.JsonObject:
        await coordinator.add_host(body.host)
        return {"host": body.host}

    @router.post("/v1/cluster/hosts/{host}/bootstrap", tags=["cluster"], responses=documented_errors(401, 403, 409, 422, 502),
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

    @router.post("/v1/cluster/model", tags=["cluster"], responses=documented_errors(401, 403, 404, 422, 503),
                 description="load another model on the cluster")
    async def set_model(body: s.ModelRequest) -> s.JsonObject:
        from exo_tui.models.gguf_file import ModelFileError, UnsupportedModelError

        if coordinator.readonly:
            raise ApiError(403, "read-only coordinator: model changes are disabled", code="readonly")
        try:
            await run_command(coordinator, Command(Action.MODEL, model=body.model))
        except UnsupportedModelError as exc:
            raise ApiError(422, str(exc), param="model", code="model_not_supported") from exc
        except ModelFileError as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found") from exc
        except GenerationError as exc:
            raise ApiError(503, str(exc), type="server_error", code="cluster_unavailable") from exc
        return {"model": model_ids(coordinator)[0]}

    return router
