"""The names the API answers to for the model the cluster serves (``/v1`` and Ollama's API)."""

from __future__ import annotations

from pathlib import Path

from exo_tui.cluster.view import ServingCluster


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
