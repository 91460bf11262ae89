"""The model-family fixtures of tests/fixtures/families/ (made by tests/fixtures/make_families.py):
what the manifest says of each file holds for the file itself, and the folder stays small."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from exo_tui.models.gguf_header import GGUFHeader, type_name

FAMILIES = Path(__file__).resolve().parents[1] / "fixtures" / "families"
MANIFEST = json.loads((FAMILIES / "manifest.json").read_text())
ENTRIES = {e["name"]: e for e in MANIFEST["fixtures"]}
MAX_GGUF_BYTES = 2_500_000
MAX_FOLDER_BYTES = 25_000_000  # 24.6 MB: the GGUFs, the reference logits (a wide fixture's of six sequences),
# llama.cpp's logits of the quantized files (of the six); 3.6 MB of it qwen2-fallback's (llama.cpp's
# Q5_0 and Q5_1 fallbacks, the one check of those blocks against llama.cpp on its own files)


def _ggufs(entry: dict) -> list[tuple[str, dict[str, int] | None]]:
    """(file name, the tensor types the manifest lists for it) of each GGUF of a fixture."""
    files = [(entry["gguf"], entry["gguf_tensor_types"])] if entry["gguf"] else []
    return files + [(q["gguf"], q["tensor_types"]) for q in entry.get("quantized", [])]


def test_the_manifest_lists_the_families() -> None:
    expected = {"llama2", "llama3", "llama-linear", "llama-yarn", "mistral-nemo", "qwen2", "qwen3", "gemma3",
                "phi3", "phi3-longrope", "qwen3moe", "mixtral"}
    assert expected <= set(ENTRIES)
    assert all(_ggufs(e) for e in ENTRIES.values()), "a fixture without any GGUF file"


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_each_gguf_has_the_listed_architecture_and_tensor_types(name: str) -> None:
    entry = ENTRIES[name]
    for file, types in _ggufs(entry):
        path = FAMILIES / file
        assert path.is_file(), f"{file} is listed but missing"
        assert path.stat().st_size <= MAX_GGUF_BYTES, f"{file} is {path.stat().st_size} bytes"
        header = GGUFHeader(path)
        assert header.fields["general.architecture"] == entry["architecture"]
        counts: dict[str, int] = {}
        for t in header.tensors.values():
            counts[type_name(t.type_id)] = counts.get(type_name(t.type_id), 0) + 1
        assert counts == types, file
        assert len(header.fields["tokenizer.ggml.tokens"]) == entry["vocab_size"]
        assert header.tensors["token_embd.weight"].dims[1] == entry["vocab_size"]


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_each_logits_file_is_float32_of_tokens_by_vocabulary(name: str) -> None:
    entry = ENTRIES[name]
    logits = np.load(FAMILIES / entry["logits"])
    tokens = entry["tokens"]
    assert logits.dtype == np.float32
    assert logits.shape == (len(tokens), entry["vocab_size"]) == (MANIFEST["t_tokens"], entry["vocab_size"])
    assert all(0 <= t < entry["vocab_size"] for t in tokens)
    assert np.isfinite(logits).all()
    assert logits.std() == pytest.approx(entry["logits_std"], abs=1e-3)
    assert entry["logits_std"] > 1.0, "near-uniform logits would not tell a wrong model from a right one"


def test_nothing_unlisted_and_the_folder_stays_small() -> None:
    listed = {"manifest.json"} | {e["logits"] for e in ENTRIES.values()}
    listed |= {file for e in ENTRIES.values() for file, _ in _ggufs(e)}
    listed |= {q["llama_cpp_logits"] for e in ENTRIES.values() for q in e.get("quantized", [])}
    listed |= {e["sequence_logits"] for e in ENTRIES.values() if "sequence_logits" in e}
    present = {p.name for p in FAMILIES.iterdir()}
    assert present == listed
    assert sum(p.stat().st_size for p in FAMILIES.iterdir()) <= MAX_FOLDER_BYTES


WIDE = sorted(n for n, e in ENTRIES.items() if e.get("quantized"))


@pytest.mark.parametrize("name", WIDE)
def test_a_wide_fixture_is_checked_over_its_prompt_and_random_sequences(name: str) -> None:
    """The quantized files' distances are measured over every position of these sequences: the
    prompt first (its logits are the fixture's), then random token ids, all different."""
    entry = ENTRIES[name]
    sequences, logits = entry["sequences"], np.load(FAMILIES / entry["sequence_logits"])
    shape = (MANIFEST["wide_sequences"], MANIFEST["t_tokens"], entry["vocab_size"])
    assert logits.dtype == np.float32 and logits.shape == shape and np.array(sequences).shape == shape[:2]
    assert sequences[0] == entry["tokens"] and len({tuple(s) for s in sequences}) == len(sequences)
    np.testing.assert_array_equal(logits[0], np.load(FAMILIES / entry["logits"]))
    assert all(0 <= t < entry["vocab_size"] for s in sequences for t in s) and np.isfinite(logits).all()
    for q in entry["quantized"]:
        assert np.load(FAMILIES / q["llama_cpp_logits"]).shape == shape, q["gguf"]
