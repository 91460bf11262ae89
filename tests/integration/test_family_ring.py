"""Each model family across node processes: a mixed MLX/ONNX ring answers token for token as one
process does, with weights streamed to the nodes; ``exo-tui chat --model PATH`` answers on the
family files and refuses one it cannot run, in one sentence."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends import available_backends
from exo_tui.cluster.view import ChatParams
from tests.integration.cluster_helpers import coordinator, node_processes, reference_answer
from tests.unit.test_family_logits import DENSE, FIXTURES, MOE

pytestmark = pytest.mark.slow
RING = ["onnx", "onnx"] if os.environ.get("EXO_TUI_TEST_RING") == "onnx" or "mlx" not in available_backends() else ["mlx", "onnx"]
PROMPT = "Who moves the layers when a node fails?"
GREEDY = ChatParams(temperature=0.0, max_tokens=16, seed=1, stop=())
FAMILIES = ["llama3", "mistral-nemo", "qwen2", "qwen3", "gemma3", "phi3-longrope", "qwen3moe", "mixtral"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("exo-home")
    os.environ["EXO_TUI_HOME"] = str(home)
    with node_processes(home, RING) as ns:
        yield ns


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixed_ring_answers_as_one_process(nodes, family: str) -> None:
    path = FIXTURES / f"{family}.gguf"
    want = reference_answer(path, PROMPT, GREEDY.max_tokens, seed=1)

    async def run() -> None:
        async with coordinator(nodes, model=path, weights="stream") as c:
            assert c.plan is not None and len(c.plan.shards) == 2
            ids: list[int] = []
            async for chunk in c.chat([{"role": "user", "content": PROMPT}], GREEDY):
                ids.extend(chunk.token_ids)
            eos = c.model.tokenizer.eos_ids
            assert [t for t in ids if t not in eos] == want, family

    asyncio.run(run())


def _chat(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "exo_tui.cli", "chat", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "EXO_TUI_HOME": str(home)})


@pytest.mark.parametrize("family", ["gemma3", "phi3", "qwen2"])
def test_chat_answers_on_a_family_file(tmp_path: Path, family: str) -> None:
    r = _chat("--model", str(FIXTURES / f"{family}.gguf"), "--temperature", "0", "--max-tokens", "8", "--json",
              PROMPT, home=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["completion_tokens"] >= 1 and result["completion_token_ids"]


def test_chat_refuses_an_unsupported_family_in_one_sentence(tmp_path: Path) -> None:
    from tests.factory import write_tiny_llama

    path = write_tiny_llama(tmp_path / "moe.gguf", arch="qwen2moe")
    r = _chat("--model", str(path), "hello", home=tmp_path)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "architecture 'qwen2moe'" in last and "it runs llama, qwen2, qwen3, gemma3, phi3, qwen3moe" in last
    assert "Traceback" not in r.stderr


assert set(FAMILIES) <= {e["name"] for e in DENSE + MOE}
