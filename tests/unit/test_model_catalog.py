"""The model catalog over a machine's stores, built in a temporary HOME (tests/model_store.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exo_tui.models import catalog
from exo_tui.models.catalog import resolve_model
from exo_tui.models.gguf_file import ModelFileError
from exo_tui.models.model import Model
from tests.model_store import Store, build_store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Store:
    return build_store(tmp_path_factory.mktemp("stores"), default_model_path)


@pytest.fixture
def home(store: Store, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Store:
    """The store's HOME as the process's, exo-tui's own home (the cache) fresh for each test."""
    for key in ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE", "EXO_TUI_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(store.home))
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path / "exo"))
    (tmp_path / "exo").mkdir()
    (tmp_path / "exo" / "config.yaml").write_text(f"models:\n  paths: [{json.dumps(str(store.folder))}]\n")
    return store


def by_name(entries: list[catalog.CatalogEntry]) -> dict[str, catalog.CatalogEntry]:
    return {e.name: e for e in entries}


def test_every_store_is_listed_with_its_names_and_metadata(home: Store) -> None:
    entries = by_name(catalog.scan())
    assert set(entries) == {
        "smollm2-135m", "tiny-split", "truncated", "odd-family",
        "smollm2:135m", "smollm2:latest", "someone/tiny:q8", "broken:latest", "gone:7b",
        "SmolLM2-135M-Instruct-Q4_1-lms", "smollm2-135m-instruct-q4_1-hf",
    }
    size = home.default_model.stat().st_size
    for name, source in [("smollm2-135m", "registry"), ("smollm2:135m", "ollama"), ("smollm2:latest", "ollama"),
                         ("SmolLM2-135M-Instruct-Q4_1-lms", "lmstudio"), ("smollm2-135m-instruct-q4_1-hf", "huggingface")]:
        e = entries[name]
        assert (e.source, e.family, e.size_label, e.quant, e.context_length, e.size_bytes) == \
            (source, "llama", "135M", "Q4_1", 8192, size), name
        assert e.usable and not e.reason, (name, e.reason)
        assert 130e6 < e.parameters < 140e6
    tiny = entries["someone/tiny:q8"]
    assert (tiny.family, tiny.quant, tiny.context_length, tiny.usable) == ("llama", "Q8_0", 256, True)
    assert tiny.path.name == f"sha256-{tiny.digest}"
    # the Hugging Face snapshot's file is a symlink into blobs/: listed by the snapshot path, read through it
    hf = entries["smollm2-135m-instruct-q4_1-hf"]
    assert hf.path.is_symlink() and hf.path.resolve().parent.name == "blobs"


def test_a_split_model_is_one_model_of_all_its_parts(home: Store) -> None:
    split = by_name(catalog.scan())["tiny-split"]
    parts = sorted(home.folder.glob("tiny-split-*.gguf"))
    assert len(parts) == 2 and split.parts == 2 and split.path == parts[0]
    assert split.size_bytes == sum(p.stat().st_size for p in parts)
    assert split.family == "llama" and split.quant == "Q8_0"
    tiny = by_name(catalog.scan())["someone/tiny:q8"]
    assert split.parameters == tiny.parameters  # both parts' tensors counted
    # the runtime reads one file: the reason says so and how to merge
    assert not split.usable and "split into 2 files" in split.reason and "llama-gguf-split --merge" in split.reason


def test_broken_entries_are_listed_unusable_with_the_reason(home: Store) -> None:
    entries = by_name(catalog.scan())
    reasons = {n: entries[n].reason for n in ("broken:latest", "gone:7b", "truncated", "odd-family")}
    assert not any(entries[n].usable for n in reasons)
    assert "manifest" in reasons["broken:latest"] and "ollama pull" in reasons["broken:latest"]
    assert "is missing" in reasons["gone:7b"]
    assert "truncated" in reasons["truncated"]
    assert "'mamba' is not supported" in reasons["odd-family"]


def test_headers_are_cached_by_path_size_and_mtime(home: Store, tmp_path: Path) -> None:
    cache = tmp_path / "catalog.json"
    first = catalog.scan(cache_path=cache)
    saved = json.loads(cache.read_text())["entries"]
    key = str(by_name(first)["someone/tiny:q8"].path.resolve())
    # a cached value is used while the file's size and mtime match it ...
    saved[key]["info"]["quant"] = "CACHED"
    cache.write_text(json.dumps({"version": catalog._cache_stamp(), "entries": saved}))
    assert by_name(catalog.scan(cache_path=cache))["someone/tiny:q8"].quant == "CACHED"
    # ... and read again once the file changes
    saved[key]["stamp"][1] -= 10
    cache.write_text(json.dumps({"version": catalog._cache_stamp(), "entries": saved}))
    assert by_name(catalog.scan(cache_path=cache))["someone/tiny:q8"].quant == "Q8_0"
    assert [e.to_dict() for e in catalog.scan(cache_path=cache)] == [e.to_dict() for e in first]


@pytest.mark.parametrize("name", ["smollm2:135m", "SmolLM2:135M", "registry.ollama.ai/library/smollm2:135m",
                                  "library/smollm2:135m", "smollm2", "smollm2:latest"])
def test_ollama_names_resolve_to_their_blobs(home: Store, name: str) -> None:
    path = resolve_model(name)
    assert path.parent.name == "blobs" and path.name.startswith("sha256-")
    assert path.samefile(home.default_model)


def test_other_names_resolve_and_broken_ones_say_why(home: Store) -> None:
    assert resolve_model("smollm2-135m:latest").samefile(home.default_model)
    assert resolve_model("someone/tiny:q8").samefile(home.tiny)
    assert resolve_model("SmolLM2-135M-Instruct-Q4_1-lms").samefile(home.default_model)
    assert resolve_model("smollm2-135m-instruct-q4_1-hf.gguf").samefile(home.default_model)
    with pytest.raises(ModelFileError, match="is missing"):
        resolve_model("gone:7b")
    with pytest.raises(ModelFileError, match="exo-tui models"):
        resolve_model("nothing-here:1b")


def test_a_model_opened_by_its_ollama_name_keeps_that_name(home: Store) -> None:
    m = Model("someone/tiny:q8")
    assert m.name == "someone/tiny:q8" and m.path.samefile(home.tiny)
    assert Model(str(home.tiny)).name == "tiny-llama"  # a path: the file's own name for its model


def test_the_models_command_lists_the_store(home: Store, capsys: pytest.CaptureFixture[str]) -> None:
    from exo_tui.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "FAMILY", "PARAMS", "QUANT", "SIZE", "CONTEXT", "WHERE"]
    row = next(line for line in lines if line.startswith("smollm2:135m "))
    assert row.split()[:7] == ["smollm2:135m", "llama", "135M", "Q4_1", "98.4", "MB", "8192"]
    assert row.split()[7].startswith("~/.ollama/models/blobs/sha256-")
    broken = lines.index(next(line for line in lines if line.startswith("✗ truncated ")))
    assert lines[broken + 1].strip().startswith("cannot run:") and "truncated" in lines[broken + 1]
    assert "6 usable, 5 not" in out

    assert main(["models", "--json", "--usable"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {m["name"] for m in listed} == {"smollm2-135m", "smollm2:135m", "smollm2:latest", "someone/tiny:q8",
                                           "SmolLM2-135M-Instruct-Q4_1-lms", "smollm2-135m-instruct-q4_1-hf"}
    assert all(m["usable"] and m["family"] == "llama" for m in listed)


def test_a_folder_linked_into_itself_is_walked_once(tmp_path: Path, default_model_path: Path) -> None:
    folder = tmp_path / "models"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "m.gguf").symlink_to(default_model_path)
    (folder / "sub" / "loop").symlink_to(folder)
    found = [f for f in catalog.discover([str(folder)], env={"HOME": str(tmp_path / "nohome")}) if f.source == "config"]
    assert [f.name for f in found] == ["m"]
