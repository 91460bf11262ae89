"""Speculative decoding through a ring of real node processes (issue 42): verify steps carry the
last token and k drafts, every node runs them as one step, the last one checks them, the caches
drop the rejected positions. Greedy answers are token for token those of one process without
speculation, on a mixed ONNX+MLX ring and on one node, with prompt lookup and with a prediction
(and a draft model on the mixed ring);
a kill -9 of the middle node and a drain during speculation give the same text."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from exo_tui.cluster.coordinator import Coordinator
from exo_tui.cluster.drafting import load_draft
from exo_tui.cluster.view import ChatParams, Command
from tests.integration.cluster_helpers import coordinator, node_processes, reference_answer

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function that adds two numbers, then repeat it exactly."
N = 32


@pytest.fixture(scope="module")
def reference(default_model_path: Path) -> list[int]:
    return reference_answer(default_model_path, PROMPT, N)


async def answer(c: Coordinator, params: ChatParams, during=None) -> tuple[list[int], int, int]:  # noqa: ANN001
    """The answer's tokens (end token left out) and the drafted and accepted counts; ``during``
    runs once the answer has 12 tokens, while the stream waits at that token boundary."""
    tokens: list[int] = []
    drafted = accepted = 0
    async for chunk in c.chat([{"role": "user", "content": PROMPT}], params):
        tokens.extend(chunk.token_ids)
        if chunk.finish_reason:
            assert chunk.finish_reason in ("stop", "length"), chunk.error
            drafted, accepted = chunk.drafted_tokens, chunk.accepted_tokens
        elif during is not None and len(tokens) >= 12:
            await during()
            during = None
    eos = c.model.tokenizer.eos_ids
    return [t for t in tokens if t not in eos], drafted, accepted


async def drain(c: Coordinator, node_id: str) -> None:
    done = await c.apply(await c.preview(Command("drain", (node_id,))))
    assert not done.error, done.error


def test_greedy_through_a_mixed_ring_and_one_node_is_the_plain_answer(exo_home: Path, reference: list[int],
                                                                     default_model_path: Path) -> None:
    """Prompt lookup (k = 4), a prediction that is the answer, one edited, and a draft model (the
    model drafting for itself, on the node the plan places it): the same tokens."""
    with node_processes(exo_home, ["onnx", "mlx", "onnx"]) as ns:

        async def run() -> None:
            async with coordinator(ns) as c:
                assert len(c.plan.shards) == 3
                text = c.model.tokenizer.decode(reference)
                edited = text.replace("a", "b", 3)
                for params in (ChatParams(temperature=0.0, max_tokens=N, speculative=4),
                               ChatParams(temperature=0.0, max_tokens=N, prediction=text),
                               ChatParams(temperature=0.0, max_tokens=N, speculative=8, prediction=edited)):
                    tokens, drafted, accepted = await answer(c, params)
                    assert tokens == reference, params
                    assert drafted >= accepted > 0, params
                    if params.prediction == text:
                        assert accepted >= N // 2  # copying: most of the answer came from drafts
                c.draft = load_draft(str(default_model_path), c, c.model)
                await c.replan("a draft model")
                tokens, drafted, accepted = await answer(c, ChatParams(temperature=0.0, max_tokens=N, speculative=4))
                assert tokens == reference and drafted >= accepted > 0
                assert c.draft.turned_off == 0 and c.draft.node_id() in c.plan.node_ids
                c.draft = None
                assert c.pipeline.failed_steps == 0 and len(c.plan.shards) == 3  # no step was rebuilt
                c.speculative = "off"
                tokens, drafted, _ = await answer(c, ChatParams(temperature=0.0, max_tokens=N))
                assert tokens == reference and drafted == 0
                c.speculative = "auto"
                await drain(c, c.plan.shards[0].node_id)
                await drain(c, c.plan.shards[0].node_id)
                assert len(c.plan.shards) == 1  # one node holds the model
                tokens, drafted, accepted = await answer(c, ChatParams(temperature=0.0, max_tokens=N, prediction=text))
                assert tokens == reference and accepted >= N // 2
                assert c.pipeline.failed_steps == 0

        asyncio.run(run())


@pytest.mark.parametrize("disturbance", ["kill-9-middle", "drain-middle"])
def test_a_failure_or_drain_during_speculation_gives_the_same_text(exo_home: Path, reference: list[int],
                                                                   disturbance: str) -> None:
    with node_processes(exo_home, ["onnx", "onnx", "onnx"]) as ns:

        async def run() -> None:
            async with coordinator(ns) as c:
                middle = c.plan.shards[1].node_id
                text = c.model.tokenizer.decode(reference)
                edited = text.replace("e", "x", 4)  # some drafts rejected, so caches are cut back

                async def disturb() -> None:
                    if disturbance == "kill-9-middle":
                        proc = next(n for n in ns.nodes if n.port == c.nodes[middle].port)
                        os.kill(proc.pid, signal.SIGKILL)
                    else:
                        await drain(c, middle)

                params = ChatParams(temperature=0.0, max_tokens=N, speculative=6, prediction=edited)
                tokens, drafted, accepted = await answer(c, params, during=disturb)
                assert tokens == reference
                assert drafted > accepted > 0
                assert middle not in c.plan.node_ids

        asyncio.run(run())
