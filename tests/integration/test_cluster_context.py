"""A model whose file allows a context no node can hold the caches of (as a Llama 3.1's 131072
tokens do on most machines) is served at the cluster's context, 8192 tokens unless told: it runs
on a node whose memory limit is far below its caches at its own context, answers as one unlimited
process does, and a request past the served context is refused by the OpenAI API with what to
do. Served at its own context (``models.context_length: 0``) the same cluster has no plan, and
says why with the numbers."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import openai
import pytest

from exo_tui.api.server import ApiServer
from exo_tui.config import DEFAULT_CONTEXT
from exo_tui.inference.generate import GenerationError
from exo_tui.models.gguf_file import GGUFModel
from tests.factory import write_tiny_llama
from tests.helpers.sshd import free_port
from tests.integration.cluster_helpers import cluster_config, coordinator, node_processes, reference_answer

pytestmark = pytest.mark.slow
CONTEXT = 1 << 20  # the file's: its caches take 0.5 GB on this shape (512 bytes a token)
LIMIT_GB = 0.3
PROMPT = "Tell me about the lighthouse."


def test_a_model_is_served_at_the_clusters_context(tmp_path: Path) -> None:
    os.environ["EXO_TUI_HOME"] = str(tmp_path)
    path = write_tiny_llama(tmp_path / "long.gguf", context_length=CONTEXT, seed=3)
    model = GGUFModel(path)
    assert model.config.context_length == CONTEXT
    want = reference_answer(path, PROMPT, 8)
    with node_processes(tmp_path, ["onnx"], memory_limits_gb=[LIMIT_GB]) as ns:

        async def run() -> None:
            async with coordinator(ns, model=path, strategy=None) as c:
                assert c.plan is not None, c.serve_error()
                assert c.context_length == DEFAULT_CONTEXT
                assert c.snapshot().plan.context_length == DEFAULT_CONTEXT
                server = ApiServer(c, port=free_port())
                await server.start()
                try:
                    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
                    reply = await client.chat.completions.create(
                        model=c.model.name, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
                        temperature=0.0, seed=7)
                    assert reply.usage.completion_tokens == len(want)
                    assert reply.choices[0].message.content == c.model.tokenizer.decode(want)
                    with pytest.raises(openai.BadRequestError) as e:
                        await client.chat.completions.create(
                            model=c.model.name, messages=[{"role": "user", "content": PROMPT}],
                            max_tokens=DEFAULT_CONTEXT)
                    assert e.value.code == "context_length_exceeded"
                    assert f"{DEFAULT_CONTEXT} tokens" in e.value.message and f"--context {CONTEXT}" in e.value.message
                finally:
                    await server.stop()

            config = cluster_config()
            config.models.context_length = 0  # the file's own context: its caches do not fit the node
            with pytest.raises(GenerationError) as e:
                async with coordinator(ns, model=path, config=config, strategy=None):
                    pass
            assert f"for {CONTEXT} tokens" in str(e.value) and "--context" in str(e.value), e.value

        asyncio.run(run())
