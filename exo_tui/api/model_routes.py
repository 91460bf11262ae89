"""The cluster's model endpoints beside ``POST /v1/cluster/model``: the machine's models, each
planned on the cluster (``GET /v1/cluster/models``), and what switching to one would do
(``POST /v1/cluster/models/preview``). The console's picker reads them when attached (``--attach``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from exo_tui.api.convert import to_jsonable
from exo_tui.api.errors import documented_errors
from exo_tui.cluster.view import Action, Command


class ModelPreviewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, description="a name GET /v1/cluster/models lists, or a path to a .gguf")


def models_router(coordinator: Any) -> APIRouter:
    router = APIRouter(prefix="/v1/cluster", tags=["cluster"])

    @router.get("/models", responses=documented_errors(401),
                description="the GGUF models on the coordinator's machine (exo-tui models), each with "
                            "whether the runtime can run it, whether the cluster can hold it now and its "
                            "predicted tok/s (ModelChoice of exo_tui/cluster/view.py)")
    async def cluster_models() -> list[dict[str, Any]]:
        choices: list[dict[str, Any]] = to_jsonable(await coordinator.models())
        return choices

    @router.post("/models/preview", responses=documented_errors(401, 422),
                 description="what switching the cluster to a model would do (a PlanPreview: "
                             "every layer a fresh load, bytes, tok/s before and after); POST "
                             "/v1/cluster/model switches")
    async def preview_model(body: ModelPreviewRequest) -> dict[str, Any]:
        preview: dict[str, Any] = to_jsonable(await coordinator.preview(Command(Action.MODEL, model=body.model)))
        return preview

    return router
