"""A mixture-of-experts model across node processes, drained and killed mid-answer: the same
tokens as one undisturbed process (Qwen3-MoE fixture: 8 experts, top 2)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from exo_tui.cluster.view import Command
from tests.integration.cluster_helpers import coordinator, node_processes, reference_answer
from tests.integration.test_live_ops import _disturbed

pytestmark = pytest.mark.slow
MODEL = Path(__file__).parents[1] / "fixtures" / "families" / "qwen3moe.gguf"
PROMPT = "Explain how a bicycle works."
N = 48


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return reference_answer(MODEL, PROMPT, N)


@pytest.mark.parametrize("disturbance", ["drain", "kill -9"])
def test_a_mixture_of_experts_survives_a_drain_and_a_kill(tmp_path: Path, reference: list[int], disturbance: str) -> None:
    os.environ["EXO_TUI_HOME"] = str(tmp_path)
    with node_processes(tmp_path, ["onnx", "onnx", "onnx"]) as ns:

        async def run() -> None:
            async with coordinator(ns, model=MODEL) as c:
                assert c.spec.experts == (8, 2)
                assert {s.experts for s in c.snapshot().plan.shards} == {(8, 2)}  # the node detail shows them
                victim = c.plan.shards[0].node_id
                proc = next(n for n in ns.nodes if n.port == c.nodes[victim].port)

                async def disturb() -> None:
                    if disturbance == "drain":
                        preview = await c.preview(Command("drain", (victim,)))
                        assert not preview.error and preview.moves
                        done = await c.apply(preview)
                        assert not done.error, done.error
                    else:
                        os.kill(proc.pid, signal.SIGKILL)

                [tokens] = await _disturbed(c, [PROMPT], N, disturb, after_tokens=8)
                assert tokens == reference
                assert victim not in c.plan.node_ids

        asyncio.run(run())
