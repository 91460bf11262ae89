"""A model larger than any node's memory runs across three node processes: the answer is token for
token one unlimited process's, and a drain the other two cannot absorb is refused with the numbers.

A node's ``--memory-limit`` is its process's whole budget, the runtime included, so the model is
sized from what the nodes offer once they run: larger than two nodes' room, within three's."""

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
LIMIT_GB = 0.3
PROMPT = "Tell me about the lighthouse."
GREEDY = ChatParams(temperature=0.0, max_tokens=12, seed=3, stop=())
LAYER_BYTES = 3_200_000  # a hidden-512 Q8_0 layer of write_tiny_llama's shape below, roughly


def test_a_model_larger_than_any_node(tmp_path: Path, tiny_model: Path) -> None:
    os.environ["EXO_TUI_HOME"] = str(tmp_path)
    with node_processes(tmp_path, ["onnx"] * 3, memory_limits_gb=[LIMIT_GB] * 3) as ns:

        async def answer(c) -> list[int]:  # noqa: ANN001
            ids: list[int] = []
            async for chunk in c.chat([{"role": "user", "content": PROMPT}], GREEDY):
                ids.extend(chunk.token_ids)
            return [t for t in ids if t not in c.model.tokenizer.eos_ids]

        async def run() -> None:
            async with coordinator(ns, model=tiny_model, strategy="memory") as c:
                offered = sorted(p.ram_available_bytes for p in c.device_profiles())
                room = offered[0]  # the smallest node's room for shards, its runtime left out
                layers = int(2.6 * room / LAYER_BYTES)  # more than two nodes hold, less than three
                big = write_tiny_llama(tmp_path / "big.gguf", n_layers=layers, hidden=512, intermediate=1536,
                                       n_heads=8, n_kv_heads=2, weight_type="Q8_0", context_length=256, seed=5)
                size = GGUFModel(big).nbytes
                assert offered[-1] < size and offered[0] + offered[1] < size < sum(offered) * 0.95, (offered, size)
                want = await asyncio.to_thread(reference_answer, big, PROMPT, GREEDY.max_tokens, 3)
                await c.set_model(str(big))
                assert len(c.plan.shards) == 3, c.plan.layout
                assert await answer(c) == want
                victim = c.plan.shards[1].node_id
                preview = await c.preview(Command("drain", (victim,)))
                assert preview.error and "GB" in preview.error, preview
                assert victim in c.plan.node_ids  # nothing moved
                assert await answer(c) == want

        asyncio.run(run())
