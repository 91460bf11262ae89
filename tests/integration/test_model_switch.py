"""A model switch: the current model answers while the new one loads, the switch happens between
two tokens, an answer streaming across it ends with an error that says so (its prompt's tokens
are the old model's), the old model's shards leave the nodes, and the next answer comes from the
new model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from exo_tui import events as ev
from exo_tui.cluster.coordinator import Coordinator
from exo_tui.cluster.view import ChatParams
from tests.factory import write_tiny_llama
from tests.integration.cluster_helpers import cluster_config

pytestmark = pytest.mark.slow


def test_the_old_model_answers_while_the_new_one_loads(tmp_path: Path, default_model_path: Path) -> None:
    first = write_tiny_llama(tmp_path / "first.gguf", weight_type="Q8_0", seed=1, context_length=8192)

    async def run() -> None:
        c = Coordinator(model=str(first), local_nodes=1, config=cluster_config(), home=tmp_path / "home", persist=False)
        await c.start()
        seen: list[ev.Event] = []

        async def record() -> None:
            with c.events.subscribe() as sub:
                while True:
                    seen.append(await sub.get())

        recorder = asyncio.create_task(record())
        try:
            chunks = []
            started = asyncio.Event()

            async def chat() -> None:
                async for chunk in c.chat([{"role": "user", "content": "hi"}], ChatParams(temperature=0.0, max_tokens=8000)):
                    chunks.append(chunk)
                    started.set()

            task = asyncio.create_task(chat())
            await started.wait()
            old_plan = c.plan.version
            await c.set_model(str(default_model_path))
            await asyncio.wait_for(task, 120)

            # the old model's answer went on while the new model's layers loaded
            loading = next(i for i, e in enumerate(seen) if isinstance(e, ev.ShardProgress))
            switched = next(i for i, e in enumerate(seen) if isinstance(e, ev.PlanChanged) and e.version > old_plan)
            tokens = [e for e in seen[loading:switched] if isinstance(e, ev.TokenStreamed)]
            assert tokens, "no token was streamed while the new model loaded"
            assert "model" in seen[switched].reason
            last = chunks[-1]
            assert last.finish_reason == "error" and "switched to another model" in last.error and "ask again" in last.error
            assert len(chunks) > len(tokens)  # it had answered before and during the load

            # only the new model's shards are left on the node; it answers
            assert c.model.path == default_model_path and c.plan.version > old_plan
            node = next(iter(c.nodes.values()))
            reply = await node.conn.call("attach", timeout=10)
            held = reply.body["shards"]
            assert [(s["start"], s["end"], s["model"]) for s in held] == [(0, 30, c._model_key)]
            after = [ch async for ch in c.chat([{"role": "user", "content": "What is the capital of France?"}],
                                               ChatParams(temperature=0.0, max_tokens=12))]
            assert "Paris" in "".join(ch.text for ch in after) and not after[-1].error
        finally:
            recorder.cancel()
            await c.stop()

    asyncio.run(run())


def test_a_model_the_cluster_cannot_hold_is_refused_and_the_current_one_serves_on(tmp_path: Path) -> None:
    first = write_tiny_llama(tmp_path / "first.gguf", weight_type="Q8_0", seed=1)
    huge = write_tiny_llama(tmp_path / "huge.gguf", weight_type="Q8_0", seed=2, context_length=2_000_000_000)
    config = cluster_config()
    config.models.context_length = 0  # each model at its own context: the huge one's caches take a terabyte

    async def run() -> None:
        from exo_tui.inference.generate import GenerationError

        c = Coordinator(model=str(first), local_nodes=1, config=config, home=tmp_path / "home", persist=False)
        await c.start()
        try:
            version = c.plan.version
            with pytest.raises(GenerationError, match="cannot hold"):
                await c.set_model(str(huge))
            assert c.model.path == first and c.plan.version == version and not c._serve_error
            after = [ch async for ch in c.chat([{"role": "user", "content": "hi"}], ChatParams(temperature=0.0, max_tokens=3))]
            assert after[-1].finish_reason in ("stop", "length") and not after[-1].error
        finally:
            await c.stop()

    asyncio.run(run())
