"""A machine's model stores, built in a temporary HOME: Ollama's (manifests and blobs), LM Studio's,
a Hugging Face cache snapshot whose file is a symlink to its blob, and a ``models.paths`` folder
with a split GGUF, a truncated one and one of a family the runtime lacks. The default model
(SmolLM2) is linked in, not copied. exo-tui's build cache stays the one of the process that built
the store (``Store.cache``): under the store's HOME each process would build the ONNX kernel again,
about a minute on a busy 2-core machine."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tests.factory import write_tiny_llama

OLLAMA_DIGEST_BYTES = 1 << 20  # a test store's blob is named by the sha256 of its first MiB (Ollama hashes all)


@dataclass
class Store:
    home: Path  # the HOME
    folder: Path  # the models.paths folder
    default_model: Path
    tiny: Path  # a tiny llama model (its blob in Ollama's store)
    cache: str  # EXO_TUI_CACHE: the built kernels of the process that built the store

    @property
    def env(self) -> dict[str, str]:
        """HOME and no store-moving variables (a developer's own would leak in); the build cache kept."""
        env = {k: v for k, v in os.environ.items() if k not in ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE")}
        env["HOME"] = str(self.home)
        env["EXO_TUI_CACHE"] = self.cache
        return env


def build_cache() -> str:
    """The folder exo-tui keeps its built kernels in for this process (before HOME moves)."""
    import platformdirs

    return os.environ.get("EXO_TUI_CACHE", "").strip() or platformdirs.user_cache_dir("exo-tui")


def link(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        dst.symlink_to(src)
    return dst


def digest_of(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read(OLLAMA_DIGEST_BYTES)).hexdigest()


def ollama_manifest(root: Path, name: str, tag: str, blob_digest: str, *, namespace: str = "library",
                    registry: str = "registry.ollama.ai", size: int = 0) -> Path:
    path = root / "manifests" / registry / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64, "size": 2},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{blob_digest}", "size": size},
            {"mediaType": "application/vnd.ollama.image.license", "digest": "sha256:" + "1" * 64, "size": 10},
        ],
    }))
    return path


def build_store(base: Path, default_model: Path) -> Store:
    home = base / "home"
    tiny = write_tiny_llama(base / "tiny.gguf", weight_type="Q8_0", seed=3)

    # Ollama: two tags of the default model's blob, a tiny model in a namespace, a broken
    # manifest, and one whose blob is gone.
    ollama = home / ".ollama" / "models"
    d_default, d_tiny = digest_of(default_model), digest_of(tiny)
    link(default_model, ollama / "blobs" / f"sha256-{d_default}")
    link(tiny, ollama / "blobs" / f"sha256-{d_tiny}")
    ollama_manifest(ollama, "smollm2", "135m", d_default, size=default_model.stat().st_size)
    ollama_manifest(ollama, "smollm2", "latest", d_default, size=default_model.stat().st_size)
    ollama_manifest(ollama, "tiny", "q8", d_tiny, namespace="someone")
    broken = ollama / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    ollama_manifest(ollama, "gone", "7b", "f" * 64)

    # LM Studio: publisher/repo/file.gguf
    link(default_model, home / ".lmstudio" / "models" / "lmstudio-community" / "SmolLM2-135M-Instruct-GGUF"
         / "SmolLM2-135M-Instruct-Q4_1-lms.gguf")

    # The Hugging Face cache: snapshots/<rev>/file -> ../../blobs/<sha256>
    repo = home / ".cache" / "huggingface" / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF"
    link(default_model, repo / "blobs" / d_default)
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "smollm2-135m-instruct-q4_1-hf.gguf").symlink_to(Path("..", "..", "blobs", d_default))

    # models.paths: a split model, a truncated file, an unsupported family.
    folder = base / "my-models"
    folder.mkdir()
    write_tiny_llama(folder / "tiny-split.gguf", weight_type="Q8_0", seed=4, split_max_tensors=20)
    data = tiny.read_bytes()
    (folder / "truncated.gguf").write_bytes(data[: len(data) // 2])
    write_tiny_llama(folder / "odd-family.gguf", arch="mamba", seed=5)
    return Store(home, folder, default_model, tiny, build_cache())
