"""A model about three times larger than each node's memory runs across three node processes: the
answer is token for token one unlimited process's, a drain the other two cannot absorb is refused
with the numbers, and an undrain gives the node its layers back."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from exo_tui.cluster.view import ChatParams, Command
from exo_tui.models.gguf_file import GGUFModel
from tests.factory import write_tiny_llama
from tests.integration.cluster_helpers import coordinator, node_processes, reference_answer

pytestmark = pytest.mark.slow
LIMIT_GB = 0.035
PROMPT = "Tell me about the lighthouse."
GREEDY = ChatParams(temperature=0.0, max_tokens=12, seed=3, stop=())


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_llama(tmp_path_factory.mktemp("big") / "big.gguf", n_layers=24, hidden=512, intermediate=1536,
                            n_heads=8, n_kv_heads=2, weight_type="Q8_0", context_length=256, seed=5)
    size = GGUFModel(path).nbytes
    assert 2.0 * LIMIT_GB * 1e9 < size < 3.0 * LIMIT_GB * 1e9  # two nodes cannot hold it, three can
    return path


def test_a_model_larger_than_any_node(tmp_path: Path, big: Path) -> None:
    os.environ["EXO_TUI_HOME"] = str(tmp_path)
    want = reference_answer(big, PROMPT, GREEDY.max_tokens, seed=3)
    with node_processes(tmp_path, ["onnx"] * 3, memory_limits_gb=[LIMIT_GB] * 3) as ns:

        async def answer(c) -> list[int]:  # noqa: ANN001
            ids: list[int] = []
            async for chunk in c.chat([{"role": "user", "content": PROMPT}], GREEDY):
                ids.extend(chunk.token_ids)
            return [t for t in ids if t not in c.model.tokenizer.eos_ids]

        async def run() -> None:
            async with coordinator(ns, model=big, strategy="memory") as c:
                assert len(c.plan.shards) == 3, c.plan.layout
                for s in c.plan.shards:  # every node within its limit, counting the file's bytes
                    assert c.spec.range_bytes(s.start, s.end, 0) <= LIMIT_GB * 1e9
                assert await answer(c) == want
                victim = c.plan.shards[1].node_id
                preview = await c.preview(Command("drain", (victim,)))
                assert preview.error and "GB" in preview.error, preview
                assert victim in c.plan.node_ids  # nothing moved
                assert await answer(c) == want
                # drained by the operator anyway it cannot be: undrain is a no-op that keeps serving
                undrain = await c.preview(Command("undrain", (victim,)))
                assert not undrain.moves
                assert await answer(c) == want

        asyncio.run(run())
