"""A model switch while an answer streams: the answer ends with an error that says so (its prompt's
tokens are the old model's), and the next answer comes from the new model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from exo_tui.cluster.coordinator import Coordinator
from exo_tui.cluster.view import ChatParams
from tests.factory import write_tiny_llama
from tests.integration.cluster_helpers import cluster_config

pytestmark = pytest.mark.slow


def test_an_answer_streaming_across_a_switch_ends_with_the_reason(tmp_path: Path) -> None:
    first = write_tiny_llama(tmp_path / "first.gguf", weight_type="Q8_0", seed=1, context_length=4096)
    second = write_tiny_llama(tmp_path / "second.gguf", weight_type="Q8_0", seed=2)

    async def run() -> None:
        c = Coordinator(model=str(first), local_nodes=1, config=cluster_config(), home=tmp_path / "home", persist=False)
        await c.start()
        try:
            chunks = []
            switched = asyncio.Event()

            async def chat() -> None:
                async for chunk in c.chat([{"role": "user", "content": "hi"}], ChatParams(temperature=0.0, max_tokens=4000)):
                    chunks.append(chunk)
                    if len(chunks) == 5:
                        switched.set()

            task = asyncio.create_task(chat())
            await switched.wait()
            await c.set_model(str(second))
            await asyncio.wait_for(task, 120)
            last = chunks[-1]
            assert last.finish_reason == "error" and "switched from" in last.error and "ask again" in last.error
            assert c.model.path == second and c.plan is not None
            after = [ch async for ch in c.chat([{"role": "user", "content": "hi"}], ChatParams(temperature=0.0, max_tokens=5))]
            assert after[-1].finish_reason in ("stop", "length") and not after[-1].error
        finally:
            await c.stop()

    asyncio.run(run())
