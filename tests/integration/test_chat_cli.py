"""``exo-tui chat`` on this machine, as a user runs it, on each backend and mixed (issue 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factory import write_tiny_llama

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


def _chat(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exo_tui.cli", "chat", *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, "EXO_TUI_HOME": str(home)},
    )


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    home = tmp_path_factory.mktemp("home")
    out = {}
    for name, flags in {
        "onnx": ["--backend", "onnx"],
        "mlx": ["--backend", "mlx"],
        "mlx,onnx": ["--backends", "mlx,onnx"],
        "onnx,mlx": ["--backends", "onnx,mlx"],
    }.items():
        r = _chat(*flags, "--temperature", "0", "--max-tokens", "64", "--json", QUESTION, home=home)
        assert r.returncode == 0, r.stderr[-2000:]
        out[name] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("engine", ["onnx", "mlx"])
def test_greedy_answer_is_paris(answers: dict[str, dict], engine: str) -> None:
    result = answers[engine]
    assert "Paris" in result["text"], result["text"]
    assert result["finish_reason"] == "stop"  # the answer ends by itself, before max tokens
    assert result["completion_tokens"] == len(result["completion_token_ids"])
    assert result["ttft_s"] > 0


def test_backends_agree_token_for_token(answers: dict[str, dict]) -> None:
    ids = {name: a["completion_token_ids"] for name, a in answers.items()}
    assert ids["mlx"] == ids["onnx"] == ids["mlx,onnx"] == ids["onnx,mlx"], ids
    assert answers["mlx,onnx"]["served_by"] == ["mlx[0:15)", "onnx[15:30)"]


def test_streams_text_then_stats(tmp_path: Path) -> None:
    r = _chat("--backend", "onnx", "--temperature", "0", "--max-tokens", "12", QUESTION, home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr and "prompt" in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/m.gguf"], "does not exist"),
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["--backend", "onnx", "--temperature", "-1"], "temperature must be >= 0"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path: Path, args: list[str], message: str) -> None:
    r = _chat(*args, QUESTION, home=tmp_path)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_settings_left_out_take_the_models_recommendation(tmp_path: Path) -> None:
    """A GGUF that recommends greedy decoding and top-k 5 gets them unless the command says
    otherwise; the default model gets its card's temperature 0.2 and top-p 0.9."""
    model = write_tiny_llama(tmp_path / "greedy.gguf", sampling={
        "general.sampling.temp": 0.0, "general.sampling.top_k": 5,
    })
    runs = {}
    for name, flags in {"model's": [], "given": ["--temperature", "0.5"]}.items():
        r = _chat("--model", str(model), "--backend", "onnx", "--max-tokens", "4", "--json", *flags, "hi", home=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[name] = json.loads(r.stdout.strip().splitlines()[-1])["sampling"]
    assert (runs["model's"]["temperature"], runs["model's"]["top_k"], runs["model's"]["top_p"]) == (0.0, 5, 1.0)
    assert (runs["given"]["temperature"], runs["given"]["top_k"]) == (0.5, 5)
    r = _chat("--backend", "onnx", "--max-tokens", "1", "--json", QUESTION, home=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    sampling = json.loads(r.stdout.strip().splitlines()[-1])["sampling"]
    assert (sampling["temperature"], sampling["top_p"]) == (0.2, 0.9)
